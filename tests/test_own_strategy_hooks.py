"""docs/own-strategy.md's hook table documents exactly the hooks the package says are meant to be overridden."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

from lightning_strategies import DirectReferenceStrategy
from lightning_strategies.strategies.hooks import OVERRIDABLE_HOOKS

PAGE = Path(__file__).parents[1] / "docs" / "own-strategy.md"
# A row of the table: | `name` or `name(arguments)` | default | override when |
ROW = re.compile(r"^\| `(?P<name>\w+)(?:\((?P<arguments>[^)]*)\))?` \|(?P<rest>.*)\|$")


def _documented() -> dict[str, str | None]:
    """Each hook in the table, with the arguments it is shown with (``None``: shown without parentheses)."""
    text = PAGE.read_text()
    table = text[text.index("| hook | default | override when |") :].split("\n\n", 1)[0]
    rows = table.splitlines()[2:]  # after the header and the separator
    documented: dict[str, str | None] = {}
    for row in rows:
        match = ROW.match(row)
        assert match is not None, f"not a hook row (one hook per row, its name in backticks): {row!r}"
        assert match["name"] not in documented, f"{match['name']} is documented twice"
        assert len(match["rest"].split(" | ")) == 2, f"{match['name']}: the row needs a default and an override-when"
        documented[match["name"]] = match["arguments"]
    return documented


def _defining_class(name: str) -> type:
    for cls in DirectReferenceStrategy.__mro__:
        if name in vars(cls):
            return cls
    raise AssertionError(f"DirectReferenceStrategy has no {name!r}")


def test_the_hook_table_lists_exactly_the_overridable_hooks() -> None:
    documented = _documented()

    assert len(set(OVERRIDABLE_HOOKS)) == len(OVERRIDABLE_HOOKS)
    assert sorted(set(OVERRIDABLE_HOOKS) - set(documented)) == [], "overridable but not in docs/own-strategy.md"
    assert sorted(set(documented) - set(OVERRIDABLE_HOOKS)) == [], "in docs/own-strategy.md but not OVERRIDABLE_HOOKS"
    assert list(documented) == list(OVERRIDABLE_HOOKS), "the table lists the hooks in OVERRIDABLE_HOOKS' order"


def test_each_hook_is_the_package_s_own_and_shown_with_its_arguments() -> None:
    for name, arguments in _documented().items():
        owner = _defining_class(name)
        assert owner.__module__.startswith("lightning_strategies."), f"{name} is defined by {owner.__qualname__}"
        value = inspect.getattr_static(owner, name)
        if arguments is None:  # a property or a class attribute
            assert not inspect.isfunction(value), f"{name} is a method: show it as `{name}(...)`"
            continue
        assert inspect.isfunction(value), f"{name} is not a method: show it without parentheses"
        parameters = list(inspect.signature(value).parameters.values())[1:]  # without self
        shown = ", ".join(
            ("*" if p.kind is p.VAR_POSITIONAL else "**" if p.kind is p.VAR_KEYWORD else "") + p.name
            for p in parameters
        )
        assert arguments == shown, f"{name} is shown as `{name}({arguments})`, its signature is `{name}({shown})`"


def test_the_required_hooks_are_among_them() -> None:
    required = {
        "configure_for_fit",
        "configure_for_evaluation",
        "_canonical_model_state",
        "_canonical_optimizer_state",
        "_load_canonical_model_state",
        "_load_canonical_optimizer_state",
        "_canonical_param_shapes",
        "gradients_are_sharded",
        "clip_grad_by_norm",
        "block_backward_sync",
        "complete_gradients",
        "full_parameters",
        "_run_step",
        "checkpoint_metadata",
        "_broadcast_buffers",
        "sharded_format",
        "before_restore",
        "strategy_name",
    }
    assert required <= set(OVERRIDABLE_HOOKS)
