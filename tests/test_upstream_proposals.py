"""Each proposal of docs/upstream-proposals.md: its reproduction fails on upstream's class as released and passes with
the change, its tests in upstream's style pass with the change, and the page's index table is what these runs gave.

When a reproduction passes on upstream as released, upstream fixed it: regenerate the page (``python -m
scripts.upstream_proposals --out docs/upstream-proposals.md``) and mark the proposal done.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.upstream_findings import FINDINGS
from scripts.upstream_proposals import FINDING_PROPOSALS, OPEN_ISSUES, PROPOSALS, Result, index_table, run
from scripts.upstream_proposals.core import Proposal

PAGE = Path(__file__).parents[1] / "docs" / "upstream-proposals.md"
BY_SLUG = {proposal.slug: proposal for proposal in PROPOSALS}
_RESULTS: dict[str, Result] = {}


def _result(slug: str, tmp_path_factory: pytest.TempPathFactory) -> Result:
    """The proposal's runs, once per test process (the table's test reads the same runs)."""
    if slug not in _RESULTS:
        _RESULTS[slug] = run(BY_SLUG[slug], tmp_path_factory.mktemp(slug))
    return _RESULTS[slug]


@pytest.mark.parametrize("slug", BY_SLUG)
def test_the_reproduction_fails_on_upstream_as_released(slug: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    released = _result(slug, tmp_path_factory).released
    assert not released.holds, f"upstream no longer shows it: {released.detail}"


@pytest.mark.parametrize("slug", BY_SLUG)
def test_the_reproduction_passes_with_the_change(slug: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    changed = _result(slug, tmp_path_factory).changed
    assert changed.holds, changed.detail


@pytest.mark.parametrize(
    ("slug", "test"),
    [(proposal.slug, test.__name__) for proposal in PROPOSALS for test in proposal.tests],
    ids=[f"{proposal.slug}-{test.__name__}" for proposal in PROPOSALS for test in proposal.tests],
)
def test_the_upstream_style_test_passes_with_the_change(
    slug: str, test: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    error = _result(slug, tmp_path_factory).tests[test]
    assert error is None, error


@pytest.mark.parametrize("slug", BY_SLUG)
def test_the_first_upstream_style_test_fails_on_upstream_as_released(
    slug: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    assert _result(slug, tmp_path_factory).tests_on_released == {BY_SLUG[slug].tests[0].__name__: False}


def test_the_index_table_on_the_page_is_what_the_runs_gave(tmp_path_factory: pytest.TempPathFactory) -> None:
    table = index_table({slug: _result(slug, tmp_path_factory) for slug in BY_SLUG})
    assert table in PAGE.read_text()


def test_every_finding_has_a_proposal() -> None:
    assert set(FINDING_PROPOSALS) == {finding.slug for finding in FINDINGS} | {"betas-restored-as-lists"}
    assert set(FINDING_PROPOSALS.values()) <= set(BY_SLUG)


def test_every_open_upstream_issue_this_package_solves_has_a_proposal() -> None:
    assert set(OPEN_ISSUES) <= {number for proposal in PROPOSALS for number in proposal.issues}


@pytest.mark.parametrize("proposal", PROPOSALS, ids=list(BY_SLUG))
def test_a_fabric_test_after_the_first_or_the_reason_there_is_none(proposal: Proposal) -> None:
    names = [test.__name__ for test in proposal.tests]
    fabric = [name for name in names if name.startswith("test_fabric_")]
    if fabric:  # Lightning's contributing guide: the Trainer's strategy and Fabric's, where both have the problem
        assert len(fabric) == 1 and names[0] not in fabric, names
    else:
        assert "No Fabric test" in " ".join(proposal.notes), proposal.slug


@pytest.mark.parametrize("proposal", PROPOSALS, ids=list(BY_SLUG))
def test_the_issue_text_follows_lightnings_template(proposal: Proposal) -> None:
    bug = ["Bug description", "Reproduction", "Expected", "Actual", "Environment"]
    feature = ["Description & Motivation", "Pitch", "Alternatives"]
    assert list(proposal.template) == (bug if proposal.kind == "bug" else feature)
