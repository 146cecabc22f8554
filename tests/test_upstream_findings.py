"""Each upstream finding of docs/upstream-findings.md still reproduces: upstream breaks the point, ours keeps it.

When one of these fails because upstream fixed it, regenerate the page (``python -m scripts.upstream_findings --out
docs/upstream-findings.md``) and drop the finding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.upstream_findings import FINDINGS, Finding, kit_table, run_kit, run_upstream_matrix

PAGE = Path(__file__).parents[1] / "docs" / "upstream-findings.md"


@pytest.mark.parametrize("finding", FINDINGS, ids=[finding.slug for finding in FINDINGS])
def test_the_finding_reproduces_upstream_breaks_it_and_ours_keeps_it(tmp_path: Path, finding: Finding) -> None:
    observed = finding.run(tmp_path)
    assert observed.upstream_breaks, f"upstream no longer breaks it: {observed.upstream}"
    assert observed.ours_keeps, observed.ours


def test_the_page_states_every_finding_with_its_reproduction() -> None:
    text = PAGE.read_text()
    for finding in FINDINGS:
        assert f"## {finding.title}" in text and finding.reproduction in text, finding.slug


def _verdicts(table: str) -> dict[tuple[str, int], str]:
    """``(check, column) -> "pass" | "FAIL" | "not reached"`` from a kit table."""
    verdicts = {}
    for line in table.splitlines()[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for column, cell in enumerate(cells[1:]):
            verdicts[(cells[0], column)] = next(
                word for word in ("pass", "FAIL", "not reached", "left out") if cell.startswith(word)
            )
    return verdicts


def test_the_conformance_kit_on_upstreams_strategies_gives_what_the_page_says(tmp_path: Path) -> None:
    live = _verdicts(kit_table(run_kit(tmp_path)))
    text = PAGE.read_text()
    start = text.index("| check |")
    published = _verdicts(text[start : text.index("\n\n", start)])
    assert live == published


def test_the_resume_matrix_with_upstreams_strategies_fails_only_on_betas_under_upstream_as_the_page_says(
    tmp_path: Path,
) -> None:
    matrix = run_upstream_matrix(tmp_path)
    assert len(matrix.cells) == 49
    failed = {(cell.saved_by, cell.resumed_by) for cell in matrix.failures}
    assert failed == {(row, "ModelParallelStrategy") for row in matrix.rows}, matrix.table()
    assert all("'betas'" in problem for cell in matrix.failures for problem in cell.problems), matrix.table()
    table = matrix.table()
    text = PAGE.read_text()
    start = text.index(table.splitlines()[0])
    assert _verdicts(table) == _verdicts(text[start : text.index("\n\n", start)])
