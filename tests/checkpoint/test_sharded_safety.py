"""Sharded checkpoints are as safe as full ones: nothing in a directory runs code, shards of different saves are never
mixed, and a refused load (sharded or full) leaves every rank's weights bit-identical."""

from __future__ import annotations

import contextlib
import io
import pickle
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemReader

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.cli import main
from lightning_strategies.testing import ConformanceModel
from lightning_strategies.testing.models import FEATURES, HIDDEN, OUTPUTS
from tests.conftest import free_loopback_port
from tests.support.helpers import fit, guarded_strategy, new_model, unchanged_reports

STRATEGIES: dict[str, type[FairScaleFSDPStrategy | FSDP2Strategy]] = {
    "fsdp_fairscale": FairScaleFSDPStrategy,
    "fsdp2": FSDP2Strategy,
}
ENTRY_POINTS = ["resume", "inspect", "consolidate"]


class WiderModel(ConformanceModel):
    """Another architecture: a wider hidden layer."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = nn.Linear(FEATURES, HIDDEN + 4)
        self.head = nn.Linear(HIDDEN + 4, OUTPUTS)


class ExtraSubmoduleModel(ConformanceModel):
    """The model with one more submodule (not optimized)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.extra = nn.Linear(OUTPUTS, OUTPUTS)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.extra(super().forward(inputs))
        return output


def _sharded(name: str, **kwargs: Any) -> FairScaleFSDPStrategy | FSDP2Strategy:
    return STRATEGIES[name](start_method="fork", state_dict_type="sharded", **kwargs)


def _save(strategy: Any, directory: Path, model: ConformanceModel) -> Path:
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(strategy, model, callbacks=[checkpoints], max_epochs=1, enable_checkpointing=True)
    return directory / "epoch=0.ckpt"


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """``<strategy>``: a sharded save; ``<strategy>-other``: another run's; ``fsdp2-extra``: a model with more keys."""
    directory = tmp_path_factory.mktemp("saves")
    runs: dict[str, Callable[[], tuple[Any, ConformanceModel]]] = {
        "fsdp_fairscale": lambda: (_sharded("fsdp_fairscale"), new_model()),
        "fsdp_fairscale-other": lambda: (_sharded("fsdp_fairscale"), new_model(seed=4)),
        "fsdp2": lambda: (_sharded("fsdp2"), new_model()),
        "fsdp2-other": lambda: (_sharded("fsdp2"), new_model(seed=4)),
        "fsdp2-extra": lambda: (_sharded("fsdp2"), new_model(cls=ExtraSubmoduleModel)),
    }
    paths = {}
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("MASTER_ADDR", "127.0.0.1")
        environment.setenv("GLOO_SOCKET_IFNAME", "lo")
        for name, run in runs.items():
            environment.setenv("MASTER_PORT", str(free_loopback_port()))
            strategy, model = run()
            paths[name] = _save(strategy, directory / name, model)
    yield paths


def _copy(source: Path, tmp_path: Path, name: str = "copy.ckpt") -> Path:
    target = tmp_path / name
    shutil.copytree(source, target)
    return target


def _enter(entry: str, strategy_name: str, path: Path, tmp_path: Path) -> str:
    """Gives ``path`` to one entry point; returns its error message (every case here must be refused)."""
    if entry == "resume":
        with pytest.raises(Exception) as refused:
            fit(_sharded(strategy_name), new_model(seed=11), ckpt_path=path, max_epochs=2)
        return str(refused.value)
    arguments = ["inspect", str(path)] if entry == "inspect" else ["consolidate", str(path), str(tmp_path / "out.ckpt")]
    code, output = _run_cli(arguments)
    assert code == 1, output
    assert "Traceback" not in output
    return output


def _run_cli(arguments: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(arguments)
    return code, out.getvalue() + err.getvalue()


# ---------------------------------------------------------------------------------------------- no code runs


class RunsCode:
    """Unpickling this creates ``marker`` (``open(marker, "w")``): proof that a loader ran code from a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (self.marker, "w"))


def _craft_dcp_metadata(directory: Path, marker: Path) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(RunsCode(marker)))


def _craft_dcp_item(directory: Path, marker: Path) -> None:
    """Points the item ``optimizer_0.param_groups.0.lr`` at a payload appended to rank 0's ``.distcp`` file."""
    metadata = FileSystemReader(str(directory)).read_metadata()  # the test's own, trusted file
    index = next(index for index in metadata.storage_data if index.fqn == "optimizer_0.param_groups.0.lr")
    info = metadata.storage_data[index]
    target = directory / info.relative_path
    buffer = io.BytesIO()
    torch.save(RunsCode(marker), buffer)
    payload = buffer.getvalue()
    info.offset, info.length = target.stat().st_size, len(payload)
    with open(target, "ab") as file:
        file.write(payload)
    with open(directory / ".metadata", "wb") as file:
        pickle.dump(metadata, file)


def _craft_torch_file(path: Path, marker: Path) -> None:
    content = torch.load(path, weights_only=True)
    content["payload"] = RunsCode(marker)
    torch.save(content, path)


CRAFTED: dict[str, tuple[str, Callable[[Path, Path], None]]] = {
    "fsdp2 .metadata": ("fsdp2", _craft_dcp_metadata),
    "fsdp2 .distcp item": ("fsdp2", _craft_dcp_item),
    "fsdp2 meta.pt": ("fsdp2", lambda directory, marker: _craft_torch_file(directory / "meta.pt", marker)),
    "fsdp_fairscale meta.pt": (
        "fsdp_fairscale",
        lambda directory, marker: _craft_torch_file(directory / "meta.pt", marker),
    ),
    "fsdp_fairscale rank0.pt": (
        "fsdp_fairscale",
        lambda directory, marker: _craft_torch_file(directory / "rank0.pt", marker),
    ),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("crafted", sorted(CRAFTED))
def test_a_crafted_sharded_checkpoint_never_runs_code(
    saves: dict[str, Path], tmp_path: Path, crafted: str, entry: str
) -> None:
    strategy_name, craft = CRAFTED[crafted]
    marker = tmp_path / "code-ran"
    directory = _copy(saves[strategy_name], tmp_path)
    craft(directory, marker)

    message = _enter(entry, strategy_name, directory, tmp_path)

    assert not marker.exists(), f"{entry} ran code from the crafted {crafted}"
    assert "running code" in message or "could not be read" in message or "damaged" in message, message


_PICKLE_LOOKUPS: list[str] = []
_RECORDING: list[bool] = []


def _audit(event: str, arguments: tuple[Any, ...]) -> None:
    if _RECORDING and event == "pickle.find_class":
        _PICKLE_LOOKUPS.append(f"{arguments[0]}.{arguments[1]}")


@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_inspect_and_consolidate_never_unpickle_through_pickles_own_lookup(
    saves: dict[str, Path], tmp_path: Path, strategy_name: str
) -> None:
    # pickle.load/loads and every Unpickler that resolves globals through pickle (torch's weights_only=False loads,
    # DCP's metadata reader) report "pickle.find_class"; torch's weights-only unpickler and our DCP metadata reader do
    # not. The hook is installed once and records only inside this test.
    if not getattr(sys, "_lightning_strategies_audit", False):
        sys.addaudithook(_audit)
        vars(sys)["_lightning_strategies_audit"] = True
    _PICKLE_LOOKUPS.clear()
    _RECORDING.append(True)
    try:
        assert _run_cli(["inspect", str(saves[strategy_name])])[0] == 0
        assert _run_cli(["consolidate", str(saves[strategy_name]), str(tmp_path / "full.ckpt")])[0] == 0
    finally:
        _RECORDING.clear()
    assert _PICKLE_LOOKUPS == []


# ---------------------------------------------------------------------------------------------- one save per directory


# Each case mixes files and returns the names an error may give (the first file whose check fails).


def _foreign_shard(directory: Path, other: Path, strategy_name: str) -> tuple[str, ...]:
    name = "rank1.pt" if strategy_name == "fsdp_fairscale" else "__1_0.distcp"
    shutil.copyfile(other / name, directory / name)
    return (name,)


def _swapped_shards(directory: Path, other: Path, strategy_name: str) -> tuple[str, ...]:
    first, second = ("rank0.pt", "rank1.pt") if strategy_name == "fsdp_fairscale" else ("__0_0.distcp", "__1_0.distcp")
    (directory / first).rename(directory / "swap")
    (directory / second).rename(directory / first)
    (directory / "swap").rename(directory / second)
    return first, second


def _stale_meta(directory: Path, other: Path, strategy_name: str) -> tuple[str, ...]:
    shutil.copyfile(other / "meta.pt", directory / "meta.pt")
    return ("rank0.pt", "rank1.pt") if strategy_name == "fsdp_fairscale" else ("__0_0.distcp",)


MIXED: dict[str, Callable[[Path, Path, str], tuple[str, ...]]] = {
    "foreign shard": _foreign_shard,
    "swapped shards": _swapped_shards,
    "stale meta.pt": _stale_meta,
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("case", sorted(MIXED))
@pytest.mark.parametrize("strategy_name", sorted(STRATEGIES))
def test_shards_of_different_saves_are_refused_naming_the_file(
    saves: dict[str, Path], tmp_path: Path, strategy_name: str, case: str, entry: str
) -> None:
    directory = _copy(saves[strategy_name], tmp_path)
    names = MIXED[case](directory, saves[f"{strategy_name}-other"], strategy_name)

    message = _enter(entry, strategy_name, directory, tmp_path)

    assert any(f"{name} " in message for name in names), message
    assert any(reason in message for reason in ("another save", "swapped", "of this save", "truncated")), message


# ------------------------------------------------------------------------------------------ refused: weights untouched


def _resume_refused(strategy: Any, path: Path, model: ConformanceModel, pattern: str, directory: Path) -> None:
    with pytest.raises(Exception, match=pattern):
        fit(strategy, model, ckpt_path=path, max_epochs=2)
    reports = unchanged_reports(directory)
    assert reports and all(reports), reports


WRONG_SHARDED: dict[str, tuple[str, str, Callable[[], ConformanceModel], str]] = {
    "fsdp_fairscale, another architecture": (
        "fsdp_fairscale",
        "fsdp_fairscale",
        lambda: new_model(cls=WiderModel),
        r"rank[01]\.pt does not fit the model; nothing was loaded",
    ),
    "fsdp2, another architecture": (
        "fsdp2",
        "fsdp2",
        lambda: new_model(cls=WiderModel),
        r"(?s)does not fit the model; nothing was loaded.*'encoder.weight': checkpoint has shape",
    ),
    "fsdp2, an extra submodule in the checkpoint": (
        "fsdp2-extra",
        "fsdp2",
        lambda: new_model(),
        r"unexpected keys \(2\): 'extra.weight', 'extra.bias'",
    ),
    "fsdp2, an extra submodule in the model": (
        "fsdp2",
        "fsdp2",
        lambda: new_model(cls=ExtraSubmoduleModel),
        r"missing keys \(2\): 'extra.weight', 'extra.bias'",
    ),
    "fsdp2, another optimizer": ("fsdp2", "fsdp2", lambda: new_model("sgd"), r"optimizer 0: the saved state does not"),
    "fsdp_fairscale, another optimizer": (
        "fsdp_fairscale",
        "fsdp_fairscale",
        lambda: new_model("sgd"),
        r"param group 0 lacks 'betas'|momentum",
    ),
}


@pytest.mark.parametrize("case", sorted(WRONG_SHARDED))
def test_a_sharded_checkpoint_of_another_model_is_refused_with_the_weights_bit_identical(
    saves: dict[str, Path], tmp_path: Path, case: str
) -> None:
    saved, strategy_name, model, pattern = WRONG_SHARDED[case]
    strategy = guarded_strategy(STRATEGIES[strategy_name], tmp_path, state_dict_type="sharded")
    _resume_refused(strategy, saves[saved], model(), pattern, tmp_path)


def _meta_tensor(checkpoint: dict[str, Any]) -> None:
    checkpoint["state_dict"]["head.weight"] = torch.empty(OUTPUTS, HIDDEN, device="meta")


def _sparse_tensor(checkpoint: dict[str, Any]) -> None:
    checkpoint["state_dict"]["head.weight"] = checkpoint["state_dict"]["head.weight"].to_sparse()


@pytest.mark.parametrize("breaks", [_meta_tensor, _sparse_tensor], ids=["meta-device", "sparse"])
@pytest.mark.parametrize("strategy_class", [ShardedDDPStrategy, FairScaleFSDPStrategy, FSDP2Strategy])
def test_a_full_checkpoint_with_unusable_tensors_is_refused_with_the_weights_bit_identical(
    tmp_path: Path, strategy_class: type[Any], breaks: Callable[[dict[str, Any]], None]
) -> None:
    saved = _save(strategy_class(start_method="fork"), tmp_path / "saved", new_model())
    checkpoint = torch.load(saved, weights_only=True)
    breaks(checkpoint)
    broken = tmp_path / "broken.ckpt"
    torch.save(checkpoint, broken)

    strategy = guarded_strategy(strategy_class, tmp_path)
    _resume_refused(strategy, broken, new_model(seed=11), r"'head.weight': (is a meta-device|has the sparse)", tmp_path)


# ---------------------------------------------------------------------------------------------- inspect and consolidate


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _overwrite_start(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:64] = b"\xff" * 64
    path.write_bytes(bytes(data))


def _symlink(path: Path) -> None:
    copy = path.with_name("elsewhere.bin")
    path.rename(copy)
    path.symlink_to(copy)


def _claim_world_size(directory: Path) -> None:
    meta = torch.load(directory / "meta.pt", weights_only=True)
    meta["lightning_strategies"]["world_size"] = meta["sharded_save"]["world_size"] = 10**9
    torch.save(meta, directory / "meta.pt")


def _deflate(path: Path) -> None:
    """Rewrites a torch file with deflated records around a 64 MiB tensor of zeros: a small file, a large load."""
    content = torch.load(path, weights_only=True)
    content["padding"] = torch.zeros(16 * 2**20)
    buffer = io.BytesIO()
    torch.save(content, buffer)
    with zipfile.ZipFile(buffer) as source, zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as target:
        for record in source.infolist():
            target.writestr(record.filename, source.read(record.filename))


BAD: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "truncated rank file": ("fsdp_fairscale", lambda d: _truncate(d / "rank1.pt"), "rank1.pt' could not be read"),
    "zero-byte rank file": ("fsdp_fairscale", lambda d: (d / "rank0.pt").write_bytes(b""), "rank0.pt' is empty"),
    "symlinked rank file": ("fsdp_fairscale", lambda d: _symlink(d / "rank1.pt"), "rank1.pt is a symbolic link"),
    "world size 10**9": ("fsdp_fairscale", _claim_world_size, "999999998 of the 1000000000 rank files"),
    "compressed meta.pt": ("fsdp_fairscale", lambda d: _deflate(d / "meta.pt"), "unpack to more bytes than the file"),
    "missing .distcp": ("fsdp2", lambda d: (d / "__1_0.distcp").unlink(), "lacks __1_0.distcp"),
    "truncated .distcp": ("fsdp2", lambda d: _truncate(d / "__0_0.distcp"), "__0_0.distcp is truncated"),
    "damaged .distcp": ("fsdp2", lambda d: _overwrite_start(d / "__0_0.distcp"), "__0_0.distcp is damaged"),
    "symlinked .distcp": ("fsdp2", lambda d: _symlink(d / "__1_0.distcp"), "__1_0.distcp is a symbolic link"),
    "world size 10**9 (DCP)": ("fsdp2", _claim_world_size, "2 rank stamp(s) for a save at world size 1000000000"),
}


@pytest.mark.parametrize("entry", ["inspect", "consolidate"])
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_broken_sharded_directory_fails_with_a_named_error_quickly(
    saves: dict[str, Path], tmp_path: Path, case: str, entry: str
) -> None:
    strategy_name, breaks, named = BAD[case]
    directory = _copy(saves[strategy_name], tmp_path)
    breaks(directory)

    started = time.monotonic()
    message = _enter(entry, strategy_name, directory, tmp_path)  # exit code 1, no traceback

    assert named in message, message
    assert time.monotonic() - started < 10


def test_inspect_flags_non_finite_weights_in_full_and_sharded_checkpoints(
    saves: dict[str, Path], tmp_path: Path
) -> None:
    directory = _copy(saves["fsdp_fairscale"], tmp_path)
    shard = torch.load(directory / "rank0.pt", weights_only=True)
    flat = next(key for key in shard["state_dict"] if "flat_param" in key)
    shard["state_dict"][flat][0] = float("nan")
    torch.save(shard, directory / "rank0.pt")
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": {"weight": torch.tensor([1.0, float("inf")])}}, full)

    for path, named in ((directory, f"rank0.pt:{flat}"), (full, "'weight'")):
        code, output = _run_cli(["inspect", str(path)])
        assert code == 1 and "non-finite: 1 tensor(s) hold NaN or Inf" in output and named in output, output


def test_inspect_flags_wrapper_segments_nested_below_the_top(tmp_path: Path) -> None:
    path = tmp_path / "nested.ckpt"
    weights = {"encoder.module.weight": torch.zeros(2, 2), "head.module.bias": torch.zeros(2)}
    torch.save({"state_dict": weights}, path)

    code, output = _run_cli(["inspect", str(path)])

    assert code == 0 and "nested-wrapper: Every nested key has a 'module' segment" in output, output
