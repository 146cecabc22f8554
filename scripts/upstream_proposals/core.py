"""What a proposal is made of, and how its reproduction and its upstream-style tests are run."""

from __future__ import annotations

import ast
import inspect
import textwrap
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Where upstream's status was read: the main branch of the mirror fetched on the day of the check.
UPSTREAM_MAIN = "master at 7f0c343 (2026-07-20)"
CHECKED = "2026-12-07"
ISSUES = "https://github.com/Lightning-AI/pytorch-lightning/issues/"


@dataclass(frozen=True)
class Outcome:
    """What a reproduction saw.

    Attributes:
        holds: Whether the expected behaviour held (``False``: the reproduction shows the problem).
        detail: What was measured, in a sentence.
    """

    holds: bool
    detail: str


@dataclass(frozen=True)
class Proposal:
    """One problem, written as Lightning's issue template asks, with the change that solves it on upstream's class.

    Attributes:
        slug: A short name, used for directories and test ids.
        title: The issue's title.
        kind: ``"bug"`` or ``"feature"`` (which template the issue uses).
        issues: Upstream's issue numbers (empty: none filed yet).
        severity: Silent wrong training, data loss, security, crash or missing feature.
        status: What upstream's main branch does about it (see :data:`UPSTREAM_MAIN`).
        template: The issue's sections in the template's order (bug: reproduction, expected, actual, environment;
            feature: motivation, pitch, alternatives).
        change: Which upstream file and function change, what the change does and why.
        cost: Behaviour change and what could break (the size is counted from :attr:`fix`).
        fix: The code of the change: the classes and functions of the scoped version shown here.
        released: Upstream's class as released (what the reproduction fails on).
        changed: Upstream's class with the change applied.
        reproduce: Runs the problem's reproduction with a class in place of upstream's (``released`` or ``changed``).
        tests: The tests that would go into upstream's test files, each taking a temporary directory.
        upstream_test_file: Where upstream keeps such tests.
        notes: Links and remarks for the page.
        released_label: What :attr:`released` is, on the page (where it is not upstream's class as released).
    """

    slug: str
    title: str
    kind: str
    issues: tuple[int, ...]
    severity: str
    status: str
    template: dict[str, str]
    change: str
    cost: str
    fix: tuple[Any, ...]
    released: type
    changed: type
    reproduce: Callable[[Path, type], Outcome]
    tests: tuple[Callable[[Path], None], ...]
    upstream_test_file: str
    notes: tuple[str, ...] = field(default=())
    released_label: str = "Upstream as released"


def code_lines(obj: Any) -> int:
    """Lines of code in ``obj``'s source: no blank lines, comments or docstrings."""
    source = textwrap.dedent(inspect.getsource(obj))
    docstrings: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            value = body[0].value
            if isinstance(value, ast.Constant) and isinstance(value.value, str):
                docstrings.update(range(body[0].lineno, (body[0].end_lineno or body[0].lineno) + 1))
    return sum(
        1
        for number, line in enumerate(source.splitlines(), start=1)
        if line.strip() and not line.strip().startswith("#") and number not in docstrings
    )


def change_size(proposal: Proposal) -> int:
    """Lines of code of the change as shown here (counted from :attr:`Proposal.fix`)."""
    return sum(code_lines(obj) for obj in proposal.fix)


def run_reproduction(proposal: Proposal, root: Path, cls: type) -> Outcome:
    """The reproduction with ``cls``; an exception it did not expect is a failed outcome naming the exception."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        return proposal.reproduce(root, cls)
    except Exception as error:  # the reproduction's own failure is what the page and the tests report
        last = str(error).strip().splitlines()[-1] if str(error).strip() else ""
        return Outcome(False, f"raised {type(error).__name__}: {last[:300]}")


def run_test(test: Callable[[Path], None], root: Path) -> str | None:
    """``None`` when the upstream-style test passed, else the end of its traceback."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        test(root)
    except Exception:
        return traceback.format_exc()[-2000:]
    return None
