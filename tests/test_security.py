"""No code path of the package loads a checkpoint in a way that can run code: an AST scan of lightning_strategies/**."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import lightning_strategies

PACKAGE = Path(lightning_strategies.__file__).parent
SOURCES = sorted(PACKAGE.rglob("*.py"))


def _calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _where(path: Path, call: ast.Call) -> str:
    return f"{path.relative_to(PACKAGE.parent)}:{call.lineno}: {ast.unparse(call)[:120]}"


def _is_torch_load(call: ast.Call) -> bool:
    """``torch.load(...)`` (also ``torch.serialization.load``) or a ``load`` imported from torch under any alias."""
    function = call.func
    if isinstance(function, ast.Attribute) and function.attr == "load":
        owner = ast.unparse(function.value)
        return owner in ("torch", "torch.serialization")
    return False


def _torch_load_aliases(path: Path) -> set[str]:
    """Names under which a module imports torch's ``load`` directly (``from torch import load as x``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.serialization")
        for alias in node.names
        if alias.name == "load"
    }


def test_the_scan_sees_the_whole_package() -> None:
    relative = {str(path.relative_to(PACKAGE)) for path in SOURCES}
    assert {"checkpoint/io.py", "strategies/base.py", "strategies/fsdp2.py"} <= relative
    assert any(_is_torch_load(call) for path in SOURCES for call in _calls(path)), "no torch.load found: scan broken"


def test_no_call_passes_weights_only_false() -> None:
    offending = [
        _where(path, call)
        for path in SOURCES
        for call in _calls(path)
        for keyword in call.keywords
        if keyword.arg == "weights_only" and isinstance(keyword.value, ast.Constant) and keyword.value.value is False
    ]
    assert not offending, "weights_only=False loads can run code from the file:\n" + "\n".join(offending)


def test_every_torch_load_passes_weights_only_true_explicitly() -> None:
    offending = []
    for path in SOURCES:
        aliases = _torch_load_aliases(path)
        for call in _calls(path):
            direct = isinstance(call.func, ast.Name) and call.func.id in aliases
            if not (_is_torch_load(call) or direct):
                continue
            flags = [keyword.value for keyword in call.keywords if keyword.arg == "weights_only"]
            if not (len(flags) == 1 and isinstance(flags[0], ast.Constant) and flags[0].value is True):
                offending.append(_where(path, call))
    assert not offending, "torch.load without an explicit weights_only=True:\n" + "\n".join(offending)


def test_no_call_unpickles_outside_torch_weights_only_loading() -> None:
    # pickle.load(s), an Unpickler, dill or joblib would bypass torch's weights-only unpickler altogether.
    unsafe = {"load", "loads", "Unpickler"}
    offending = [
        _where(path, call)
        for path in SOURCES
        for call in _calls(path)
        if isinstance(call.func, ast.Attribute)
        and call.func.attr in unsafe
        and ast.unparse(call.func.value) in ("pickle", "dill", "joblib", "cloudpickle", "_pickle")
    ]
    assert not offending, "calls that unpickle without weights_only:\n" + "\n".join(offending)


def test_the_default_checkpoint_io_never_loads_with_weights_only_false(tmp_path: Path) -> None:
    # Lightning itself calls checkpoint_io.load_checkpoint(path) without weights_only (e.g. the fork launcher's weights
    # file), and defaults remote paths to weights_only=False: the package's plugin always loads weights-only.
    import pickle

    from lightning_strategies.strategies.atomic_io import AtomicTorchCheckpointIO

    class RunsCode:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("code ran",))

    path = tmp_path / "evil.ckpt"
    torch.save({"state_dict": {}, "payload": RunsCode()}, path)
    io = AtomicTorchCheckpointIO()
    with pytest.raises(pickle.UnpicklingError):
        io.load_checkpoint(path)
    with pytest.raises(ValueError, match="weights_only=False"):
        io.load_checkpoint(path, weights_only=False)
