"""One proposal per problem this package solves that upstream Lightning has: the issue as Lightning's template asks,
the change on upstream's own class, and the tests that would go into upstream's test files.

Each proposal is a module here (``PROPOSAL``): the change is a small subclass of upstream's class, or a patch scoped
to one call, kept outside the package; the reproduction runs against upstream's class as released (where it shows
the problem) and with the change (where it must not). ``python -m scripts.upstream_proposals --out
docs/upstream-proposals.md`` runs them all and writes the page with its index table from the results;
``tests/test_upstream_proposals.py`` runs the same in CI and checks the page's table against them.
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytorch_lightning as pl
import torch

from scripts.upstream_proposals import (
    async_save,
    code_in_metadata,
    compiled_keys,
    fsdp_cpu,
    full_state_memory,
    hyperparameter_types,
    mixed_saves,
    optimizer_order,
    resumed_checkpoint,
    storage_options,
)
from scripts.upstream_proposals.core import (
    CHECKED,
    ISSUES,
    UPSTREAM_MAIN,
    Outcome,
    Proposal,
    change_size,
    run_reproduction,
    run_test,
)

#: Every proposal, findings of ``docs/upstream-findings.md`` first, then the open upstream issues.
PROPOSALS: list[Proposal] = [
    optimizer_order.PROPOSAL,
    mixed_saves.PROPOSAL,
    code_in_metadata.PROPOSAL,
    fsdp_cpu.PROPOSAL,
    hyperparameter_types.PROPOSAL,
    compiled_keys.PROPOSAL,
    async_save.PROPOSAL,
    storage_options.PROPOSAL,
    resumed_checkpoint.PROPOSAL,
    full_state_memory.PROPOSAL,
]

#: Each finding of ``docs/upstream-findings.md`` (its slug there; the betas are the resume matrix's finding) and the
#: proposal that fixes it.
FINDING_PROPOSALS = {
    "swapped-optimizer-state": "optimizer-state-order",
    "mixed-saves": "mixed-saves",
    "code-in-metadata": "code-in-metadata",
    "fsdp-strategy-cpu": "fsdp-cpu",
    "betas-restored-as-lists": "hyperparameter-types",
}

#: The upstream issues, open on upstream's main branch, that this package solves (each needs a proposal).
OPEN_ISSUES = (20233, 21557, 21812, 21905, 21813, 20312, 11207)


@dataclass(frozen=True)
class Result:
    """What a proposal's runs gave.

    Attributes:
        released: The reproduction on upstream's class as released.
        changed: The reproduction on upstream's class with the change.
        tests: Each upstream-style test's name and ``None`` (passed) or the end of its traceback, with the change.
        tests_on_released: The first upstream-style test's name (the one that shows the problem) and whether it
            passed on upstream's class as released (failing there, it is a test that would have caught the problem).
    """

    released: Outcome
    changed: Outcome
    tests: dict[str, str | None]
    tests_on_released: dict[str, bool]


def run(proposal: Proposal, root: Path) -> Result:
    """The reproduction both ways and every upstream-style test (with the change), in directories under ``root``."""
    return Result(
        released=run_reproduction(proposal, root / "released", proposal.released),
        changed=run_reproduction(proposal, root / "changed", proposal.changed),
        tests={test.__name__: run_test(test, root / test.__name__) for test in proposal.tests},
        tests_on_released={  # the first test is the one that shows the problem; the others guard what must stay
            test.__name__: run_test(partial(test, cls=proposal.released), root / f"{test.__name__}-released") is None
            for test in proposal.tests[:1]
        },
    )


def _issue_cell(proposal: Proposal) -> str:
    if not proposal.issues:
        return "none filed (finding)"
    return ", ".join(f"[#{number}]({ISSUES}{number})" for number in proposal.issues)


def _verdict(outcome: Outcome) -> str:
    return "passes" if outcome.holds else "fails"


def index_table(results: dict[str, Result]) -> str:
    """The maintainers' index: one row per proposal, its verdicts taken from ``results``."""
    lines = [
        f"| problem | upstream issue | severity | change (lines of code) | status upstream ({UPSTREAM_MAIN}, checked"
        f" {CHECKED}) | reproduction, upstream as released | reproduction, with the change | upstream-style tests,"
        " with the change |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for proposal in PROPOSALS:
        result = results[proposal.slug]
        passed = sum(error is None for error in result.tests.values())
        status = proposal.status.split(":")[0]
        lines.append(
            f"| {proposal.title} ({{ref}}`details <proposal-{proposal.slug}>`) | {_issue_cell(proposal)} |"
            f" {proposal.severity} | {change_size(proposal)} | {status} | {_verdict(result.released)} |"
            f" {_verdict(result.changed)} | {passed} of {len(result.tests)} pass |"
        )
    return "\n".join(lines)


def _section(proposal: Proposal, result: Result) -> list[str]:
    module = inspect.getmodule(proposal.reproduce)
    source = f"scripts/upstream_proposals/{Path(module.__file__ if module and module.__file__ else '').name}"
    fixes = ", ".join(f"`{getattr(obj, '__qualname__', obj)}`" for obj in proposal.fix)
    template = "bug report" if proposal.kind == "bug" else "feature request"
    lines = [
        f"(proposal-{proposal.slug})=",
        f"## {proposal.title}",
        "",
        f"Upstream issue: {_issue_cell(proposal)}. Severity: {proposal.severity}."
        f" Status on upstream's main branch: {proposal.status}.",
        "",
        *([" ".join(proposal.notes), ""] if proposal.notes else []),
        f"### The issue ({template} template)",
        "",
    ]
    for heading, text in proposal.template.items():
        lines += [f"**{heading}.** {text}", ""]
    lines += [
        "### The change",
        "",
        proposal.change,
        "",
        f"**Cost.** {change_size(proposal)} lines of code as shown here ({fixes} in `{source}`, counted without blank"
        f" lines, comments and docstrings). {proposal.cost}",
        "",
        "### Shown on upstream's class",
        "",
        f"- {proposal.released_label} (`{proposal.released.__name__}`): {result.released.detail.rstrip('.')}.",
        f"- With the change (`{proposal.changed.__name__}`): {result.changed.detail.rstrip('.')}.",
        "",
        f"### Tests for upstream's `{proposal.upstream_test_file}` (under its `tests` folder)",
        "",
    ]
    for name, error in result.tests.items():
        if name not in result.tests_on_released:
            released = "run with the change only (on upstream as released the first test is run)"
        elif result.tests_on_released[name]:
            released = "PASSES on upstream as released too"
        else:
            released = "fails on upstream as released"
        lines.append(f"- `{name}`: {'passes' if error is None else 'FAILS'} with the change; {released}.")
    return [*lines, ""]


def page(results: dict[str, Result]) -> str:
    """The docs page: the index table, then each proposal (issue text, change, cost, what ran)."""
    lines = [
        "# Upstream proposals",
        "",
        f"Measured with pytorch-lightning {pl.__version__} and torch {torch.__version__} on 2 CPU processes (gloo),"
        f" {time.strftime('%Y-%m-%d')}. Written by `python -m scripts.upstream_proposals --out"
        " docs/upstream-proposals.md`, which runs every reproduction against upstream's class as released and with"
        " the change, and every upstream-style test with the change; `tests/test_upstream_proposals.py` runs the same"
        " in CI and fails when this table differs from what it ran. The code of each proposal is a module of"
        " `scripts/upstream_proposals/`: the change as a subclass of upstream's class (or a patch scoped to one call,"
        " nothing in this package's API), the reproduction, and the tests in upstream's style (`BoringModel`,"
        " `Trainer(accelerator='cpu', devices=2, strategy=...)`, each rank a fork: upstream would mark them"
        " `@RunIf(standalone=True)`); where Lightning Fabric's strategy has the problem too, one of them"
        " (`test_fabric_...`) applies the same change to Fabric's class (`Fabric(accelerator='cpu', devices=2,"
        " strategy=...)`), as Lightning's contributing guide asks for both, and where it does not, the proposal says"
        " why. Each proposal is one issue and one pull request: the issue text follows"
        " Lightning's templates, the pull request is the change, its tests, a CHANGELOG line and, for the features,"
        " a paragraph in the strategy's docs. Status upstream was read on the main branch of"
        f" Lightning-AI/pytorch-lightning ({UPSTREAM_MAIN}, the newest snapshot available) on {CHECKED}; 'none"
        " filed' means no upstream issue was found for the problem. The reproductions of the first four are those of"
        " [upstream findings](upstream-findings.md).",
        "",
        "## Index",
        "",
        index_table(results),
        "",
    ]
    for proposal in PROPOSALS:
        lines += _section(proposal, results[proposal.slug])
    return "\n".join(lines)


def run_all(root: Path) -> dict[str, Result]:
    """:func:`run` for every proposal."""
    return {proposal.slug: run(proposal, root / proposal.slug) for proposal in PROPOSALS}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    arguments = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as directory:
        results = run_all(Path(directory))
    arguments.out.write_text(page(results))
    print(f"Wrote {arguments.out}: {len(results)} proposals.")
