"""Each upstream finding of docs/upstream-findings.md still reproduces: upstream breaks the point, ours keeps it.

When one of these fails because upstream fixed it, regenerate the page (``python -m scripts.upstream_findings --out
docs/upstream-findings.md``) and drop the finding.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lightning_strategies.testing.matrix import run_matrix
from scripts.upstream_findings import (
    FINDINGS,
    PROPOSALS_PAGE,
    Finding,
    heading_anchor,
    kit_table,
    proposal_link,
    run_kit,
    upstream_matrix_strategies,
)
from tests.support.upstream_runs import ShardedByUser

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


def test_the_page_links_every_finding_to_its_proposal() -> None:
    text = PAGE.read_text()
    sections = text.split("\n## ")
    for finding in FINDINGS:
        section = next(part for part in sections if part.startswith(f"{finding.title}\n"))
        assert f"- **Proposed fix:** {proposal_link(finding.slug)}." in section, finding.slug
    assert f"Proposed fix of the `betas`: {proposal_link('betas-restored-as-lists')}." in text
    headings = (PAGE.parent / PROPOSALS_PAGE).read_text().splitlines()
    anchors = {heading_anchor(line.removeprefix("## ")) for line in headings if line.startswith("## ")}
    linked = re.findall(rf"\]\({re.escape(PROPOSALS_PAGE)}#([^)]+)\)", text)
    assert len(linked) == len(FINDINGS) + 1 and set(linked) <= anchors, linked


def test_heading_anchors_are_githubs_and_mysts() -> None:
    title = "Resuming a distributed checkpoint runs code from its `.metadata` (rank 0's memory)"
    assert heading_anchor(title) == "resuming-a-distributed-checkpoint-runs-code-from-its-metadata-rank-0s-memory"


def _verdicts(table: str) -> dict[tuple[str, str], str]:
    """``(row, column header) -> "pass" | "FAIL" | "not reached" | "left out"`` from a kit or matrix table."""
    lines = table.splitlines()
    headers = [cell.strip() for cell in lines[0].strip().strip("|").split("|")][1:]
    verdicts = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        for header, cell in zip(headers, cells[1:], strict=True):
            verdicts[(cells[0], header)] = next(
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
    # Without upstream's ddp_spawn: in the published 7 x 7 matrix it behaves as ddp in every cell, and its 13 cells
    # (8 spawned fits) took half of this test's time. The page itself is written from the whole matrix.
    strategies = [strategy for strategy in upstream_matrix_strategies() if strategy.label != "ddp_spawn"]
    matrix = run_matrix(strategies, tmp_path / "matrix", model_class=ShardedByUser)
    assert len(matrix.cells) == 36
    failed = {(cell.saved_by, cell.resumed_by) for cell in matrix.failures}
    assert failed == {(row, "ModelParallelStrategy") for row in matrix.rows}, matrix.table()
    assert all("'betas'" in problem for cell in matrix.failures for problem in cell.problems), matrix.table()
    table = matrix.table()
    text = PAGE.read_text()
    start = text.index(table.splitlines()[0].split(" | ")[0])
    published = _verdicts(text[start : text.index("\n\n", start)])
    live = _verdicts(table)
    assert live == {cell: verdict for cell, verdict in published.items() if cell in live}
    assert published[("ddp_spawn", "ddp")] == published[("ddp", "ddp_spawn")] == "pass"
