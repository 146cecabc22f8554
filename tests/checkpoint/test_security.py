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


# torch.distributed.checkpoint unpickles too: FileSystemReader.read_metadata with plain pickle, DefaultLoadPlanner's
# non-tensor items with weights_only=False. Only checkpoint/dcp.py may touch those; everything else reads through it.
DCP_READER = "checkpoint/dcp.py"


def _dcp_load_names(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        alias.asname or alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module in ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict_loader")
        for alias in node.names
        if alias.name == "load"
    }


def test_only_the_safe_dcp_reader_touches_torchs_unpickling_dcp_classes() -> None:
    unsafe = {"FileSystemReader", "DefaultLoadPlanner", "read_metadata", "load_bytes"}
    offending = [
        _where(path, call)
        for path in SOURCES
        if str(path.relative_to(PACKAGE)) != DCP_READER
        for call in _calls(path)
        if (call.func.id if isinstance(call.func, ast.Name) else getattr(call.func, "attr", None)) in unsafe
    ]
    assert not offending, "DCP reads outside lightning_strategies/checkpoint/dcp.py:\n" + "\n".join(offending)


def test_every_dcp_load_goes_through_the_safe_reader_and_planner() -> None:
    loads = [
        (path, call)
        for path in SOURCES
        for call in _calls(path)
        if (isinstance(call.func, ast.Name) and call.func.id in _dcp_load_names(path))
        or ast.unparse(call.func) in ("dcp.load", "torch.distributed.checkpoint.load")
    ]
    assert loads, "no DCP load found: scan broken"
    offending = [
        _where(path, call)
        for path, call in loads
        if {keyword.arg: ast.unparse(keyword.value) for keyword in call.keywords}.get("storage_reader", "")
        != "SafeFileSystemReader(directory)"
        or "planner" not in {keyword.arg for keyword in call.keywords}
        or str(path.relative_to(PACKAGE)) != DCP_READER
    ]
    assert not offending, "DCP loads that torch's own reader or planner could unpickle in:\n" + "\n".join(offending)


def test_every_unpickler_of_the_package_resolves_globals_from_an_allowlist() -> None:
    unpicklers = [
        (path, node)
        for path in SOURCES
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and any("Unpickler" in ast.unparse(base) for base in node.bases)
    ]
    assert unpicklers, "no unpickler found: scan broken"
    for path, node in unpicklers:
        methods = {item.name: item for item in node.body if isinstance(item, ast.FunctionDef)}
        assert "find_class" in methods, f"{path}: {node.name} resolves any global"
        assert "super()" not in ast.unparse(methods["find_class"]), f"{path}: {node.name} defers to pickle's lookup"
