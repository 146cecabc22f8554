"""Each upstream finding of docs/upstream-findings.md still reproduces: upstream breaks the point, ours keeps it.

When one of these fails because upstream fixed it, regenerate the page (``python -m tests.upstream_findings --out
docs/upstream-findings.md``) and drop the finding.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.upstream_findings import FINDINGS, Finding

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
