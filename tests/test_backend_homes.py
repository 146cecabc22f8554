"""One home per backend: fairscale's and torch's private names are each used in one module, and ``checkpoint/``
(the format) runs no collective and needs no fairscale.

When fairscale or torch moves a private name, the one module that uses it says what breaks. The checks read the
package's source (its syntax tree), so names inside strings of messages and docstrings do not count.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import fairscale
import pytest
import torch

import lightning_strategies

PACKAGE = Path(lightning_strategies.__file__).resolve().parent
FAIRSCALE_HOME = PACKAGE / "fairscale" / "_private.py"
TORCH_HOME = PACKAGE / "_torch_private.py"
CHECKPOINT = PACKAGE / "checkpoint"

# Private names that fairscale's source uses and that belong to someone else in this package.
NOT_FAIRSCALE_S = {
    "_optimizer": "Lightning's LightningOptimizer wraps the optimizer under this name",
    "_handles": "UnitCallGuard's own hook handles",
    "_fsdp_wrapped_module": "a key segment of the checkpoint format: every reader of FSDP checkpoints strips it",
    "_fpw_module": "a key segment of the checkpoint format: every reader of FSDP checkpoints strips it",
    "_fields": "collections.namedtuple's own attribute (a staged copy rebuilds named tuples)",
}

# torch.distributed's collectives (and point-to-point calls): what checkpoint/ must never run.
COLLECTIVES = frozenset(
    {
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_reduce",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "batch_isend_irecv",
        "broadcast",
        "broadcast_object_list",
        "gather",
        "gather_object",
        "irecv",
        "isend",
        "monitored_barrier",
        "recv",
        "recv_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "scatter",
        "scatter_object_list",
        "send",
        "send_object_list",
    }
)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and name != "_"


def _package_modules() -> list[Path]:
    return sorted(path for path in PACKAGE.rglob("*.py") if "__pycache__" not in path.parts)


def _fairscale_private_names() -> frozenset[str]:
    """Every private name fairscale's source defines or reads (attributes, methods, ``getattr`` strings), less the
    ones torch's modules, tensors and optimizers have too (``_parameters``, ``_apply``, ...)."""
    names: set[str] = set()
    for path in Path(fairscale.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute):
                names.add(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"_\w+", node.value):
                names.add(node.value)
    parameter = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([parameter], lr=0.1)
    torch_owned: set[str] = set()
    for owner in (torch.nn.Module, torch.nn.Module(), torch.Tensor, parameter, torch.optim.Optimizer, optimizer):
        torch_owned |= set(dir(owner))
    return frozenset(name for name in names if _is_private(name)) - torch_owned - set(NOT_FAIRSCALE_S)


def fairscale_private_uses(source: str, names: frozenset[str]) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of each fairscale-private name read (``x._name``), named in ``getattr``/``vars`` (a string
    that is just the name) or overridden (a method of that name)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in names:
            yield node.lineno, node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names:
            yield node.lineno, node.value
        elif isinstance(node, ast.ClassDef):  # a method that overrides one of fairscale's
            for method in node.body:
                if isinstance(method, ast.FunctionDef) and method.name in names:
                    yield method.lineno, method.name


def _torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Local names bound to torch modules (``dist`` for ``torch.distributed``, ``c10d``, ...)."""
    aliases = {"torch": "torch"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch" or alias.name.startswith("torch."):
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``torch.a.b`` for an expression that names a torch object through attributes, else ``None``."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name) or node.id not in aliases:
        return None
    return ".".join([aliases[node.id], *reversed(parts)])


def torch_private_uses(source: str) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of each torch-private name: imported (``from torch.x._y import z``, ``from torch.x import
    _z``), reached (``torch.x._y``) or looked up (``getattr(torch.x, "_y")``)."""
    tree = ast.parse(source)
    aliases = _torch_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            dotted = [*node.module.split("."), *(alias.name for alias in node.names)]  # type: ignore[union-attr]
            if any(_is_private(part) for part in dotted):
                yield node.lineno, ".".join(dotted)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch" and any(_is_private(p) for p in alias.name.split(".")):
                    yield node.lineno, alias.name
        elif isinstance(node, ast.Attribute) and _is_private(node.attr):
            dotted_name = _dotted(node, aliases)
            if dotted_name is not None:
                yield node.lineno, dotted_name
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"getattr", "hasattr", "setattr", "delattr"}
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and _is_private(node.args[1].value)
            and _dotted(node.args[0], aliases) is not None
        ):
            yield node.lineno, f"{_dotted(node.args[0], aliases)}.{node.args[1].value}"


def collective_calls(source: str) -> Iterator[tuple[int, str]]:
    """``(line, name)`` of each ``torch.distributed`` collective called, or imported by name."""
    tree = ast.parse(source)
    aliases = _torch_aliases(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            dotted = _dotted(node.func, aliases)
            if dotted is not None and dotted.startswith("torch.distributed") and dotted.rsplit(".")[-1] in COLLECTIVES:
                yield node.lineno, dotted
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            for alias in node.names:
                if alias.name in COLLECTIVES:
                    yield node.lineno, f"{node.module}.{alias.name}"


def _uses(check: object, *, skip: Path | None = None, under: Path = PACKAGE) -> list[str]:
    found = []
    for path in _package_modules():
        if path == skip or under not in path.parents:
            continue
        for line, name in check(path.read_text(encoding="utf-8")):  # type: ignore[operator]
            found.append(f"{path.relative_to(PACKAGE)}:{line}: {name}")
    return found


def test_fairscale_private_names_are_used_in_one_module_only() -> None:
    names = _fairscale_private_names()

    found = _uses(lambda source: fairscale_private_uses(source, names), skip=FAIRSCALE_HOME)

    assert not found, "fairscale-private names belong in lightning_strategies/fairscale/_private.py:\n" + "\n".join(
        found
    )


def test_the_fairscale_home_holds_the_names_the_strategies_need() -> None:
    used = {name for _, name in fairscale_private_uses(FAIRSCALE_HOME.read_text(), _fairscale_private_names())}

    assert {"_param_infos", "_shared_param_infos", "_lazy_init", "_unflattened_param_views"} <= used
    assert {"_global_group_cache", "_param_to_rank", "_should_accumulate_grads", "_clear_counters"} <= used


def test_torch_private_names_are_used_in_one_module_only() -> None:
    found = _uses(torch_private_uses, skip=TORCH_HOME)

    assert not found, "torch-private names belong in lightning_strategies/_torch_private.py:\n" + "\n".join(found)


def test_the_checkpoint_package_runs_no_collective() -> None:
    assert not _uses(collective_calls, under=CHECKPOINT)


def _fairscale_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0:  # `from ..fairscale import` is this package's
            modules = [node.module or ""]
        found += [
            f"{path.relative_to(PACKAGE)}:{node.lineno}" for module in modules if module.split(".")[0] == "fairscale"
        ]
    return found


def test_only_the_fairscale_package_imports_fairscale() -> None:
    fairscale_home = PACKAGE / "fairscale"

    found = [
        place for path in _package_modules() if fairscale_home not in path.parents for place in _fairscale_imports(path)
    ]

    assert not found, "modules that need fairscale belong in lightning_strategies/fairscale/:\n" + "\n".join(found)


def test_the_import_check_finds_fairscale_imports_and_not_this_packages_own() -> None:
    assert _fairscale_imports(PACKAGE / "fairscale" / "gradients.py")
    assert not _fairscale_imports(PACKAGE / "strategies" / "__init__.py")  # re-exports lightning_strategies.fairscale


def test_no_library_module_uses_unittest_mock() -> None:
    found = [str(path.relative_to(PACKAGE)) for path in _package_modules() if "unittest" in path.read_text()]

    assert not found


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from torch.distributed._composable.checkpoint_activation import checkpoint", True),
        ("from torch.distributed.checkpoint._traverse import set_element", True),
        ("import torch\ntorch.distributed.distributed_c10d._get_default_group()", True),
        ("import torch.distributed as dist\ndist.distributed_c10d._get_default_store()", True),
        ("import torch\ngetattr(torch.distributed.distributed_c10d, '_abort_process_group', None)", True),
        ("import torch\nwith torch._C.DisableTorchFunctionSubclass(): pass", True),
        ("import torch\ntorch.distributed.get_rank()\nmodule._parameters", False),
    ],
)
def test_the_torch_check_finds_private_names(source: str, expected: bool) -> None:
    assert bool(list(torch_private_uses(source))) is expected


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("import torch.distributed as dist\ndist.all_reduce(x)", True),
        ("import torch\ntorch.distributed.barrier()", True),
        ("from torch.distributed import broadcast", True),
        ("import functools\nfunctools.reduce(f, xs)\ntorch.gather(x, 0, i)", False),
        ("from torch.distributed.tensor import DTensor\nDTensor.from_local(x, mesh)", False),
    ],
)
def test_the_collective_check_finds_collectives(source: str, expected: bool) -> None:
    assert bool(list(collective_calls(source))) is expected


def test_the_fairscale_check_finds_private_names() -> None:
    names = _fairscale_private_names()
    source = "flat._param_infos\ngetattr(p, '_saved_grad_shard')\nclass F:\n    def _use_full_params(self): ..."

    assert {name for _, name in fairscale_private_uses(source, names)} == {
        "_param_infos",
        "_saved_grad_shard",
        "_use_full_params",
    }
    assert not list(fairscale_private_uses("module._parameters\nmodule._apply(fn)", names))
