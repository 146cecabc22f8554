"""Resuming a DCP directory under ModelParallelStrategy unpickles its ``.metadata``: a crafted one runs code."""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
import pickle
from pathlib import Path
from typing import Any

from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard

from scripts.upstream_findings import _RunsCode
from scripts.upstream_proposals.core import UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import fit

_TORCH_VALUES = {
    "Size",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "bool",
}
_TORCH_VALUES |= {"complex64", "complex128", "float8_e4m3fn", "float8_e5m2"}


class MetadataOnly(pickle.Unpickler):
    """Builds only what DCP's ``.metadata`` is made of: the dataclasses and enums of
    ``torch.distributed.checkpoint``, ``torch.Size``, dtypes, ``torch.serialization._get_layout``, paths and
    ``OrderedDict``. Any other global (``os.system``, ``builtins.open``, ...) is refused before it is called."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = (
            (module == "torch" and name in _TORCH_VALUES)
            or (module == "torch.serialization" and name == "_get_layout")
            or (module == "pathlib" and name in {"Path", "PosixPath", "WindowsPath"})
            or (module == "collections" and name == "OrderedDict")
        )
        if module.startswith("torch.distributed.checkpoint."):
            found = getattr(importlib.import_module(module), name, None)
            allowed = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
        if not allowed:
            raise pickle.UnpicklingError(f"{module}.{name} is not part of a distributed checkpoint's metadata")
        return super().find_class(module, name)


def check_metadata(path: Path) -> None:
    """Reads the ``.metadata`` of the DCP directory ``path`` (if there is one) with :class:`MetadataOnly`."""
    if (path / ".metadata").is_file():
        with (path / ".metadata").open("rb") as file:
            MetadataOnly(file).load()


class MetadataReadSafely(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy``, reading a directory's ``.metadata`` with :class:`MetadataOnly` before
    torch's DCP reader unpickles it."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        check_metadata(Path(self.broadcast(checkpoint_path)))
        return super().load_checkpoint(checkpoint_path, weights_only)


class FabricMetadataReadSafely(FabricModelParallelStrategy):
    """The same check on Fabric's ``ModelParallelStrategy`` (``fabric.load`` of a directory)."""

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        check_metadata(Path(self.broadcast(path)))
        return super().load_checkpoint(path, state, strict, **kwargs)


def _craft(directory: Path, marker: Path) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(_RunsCode(marker)))


def reproduce(root: Path, cls: type) -> Outcome:
    """A DCP directory whose ``.metadata`` creates a file when unpickled, resumed under ``cls``."""
    fit(lambda: cls(data_parallel_size=2, tensor_parallel_size=1), root / "saves", epochs=1)
    marker = root / "code-ran"
    _craft(root / "saves" / "epoch=0.ckpt", marker)
    resuming = lambda: cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)  # noqa: E731
    try:
        fit(resuming, root / "resumed", ckpt_path=root / "saves" / "epoch=0.ckpt")
        refused = ""
    except RuntimeError as error:
        refused = "refused" if "is not part of a distributed checkpoint's metadata" in str(error) else "failed"
    ran = marker.exists()
    said = {"refused": "refused", "failed": "failed afterwards", "": "resumed"}[refused]
    return Outcome(not ran and refused == "refused", f"{said}; the crafted code {'ran' if ran else 'did not run'}")


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _ShardedBoringModel(BoringModel):
    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])


def _save(root: Path, cls: type) -> None:
    callback = ModelCheckpoint(dirpath=root, filename="{epoch}")
    trainer(cls(data_parallel_size=2, tensor_parallel_size=1), root, callbacks=[callback]).fit(_ShardedBoringModel())


def _resume(root: Path, cls: type) -> None:
    with contextlib.suppress(pickle.UnpicklingError):
        trainer(cls(data_parallel_size=2, tensor_parallel_size=1), root).fit(
            _ShardedBoringModel(), ckpt_path=root / "epoch=0.ckpt"
        )


def test_load_distributed_checkpoint_runs_no_code_from_metadata(tmp_path: Path, cls: type = MetadataReadSafely) -> None:
    on_two_ranks(lambda: _save(tmp_path, cls))
    _craft(tmp_path / "epoch=0.ckpt", tmp_path / "code-ran")
    with contextlib.suppress(RuntimeError):  # a rank's error, if the load got past the metadata
        on_two_ranks(lambda: _resume(tmp_path, cls))
    assert not (tmp_path / "code-ran").exists()


def test_load_distributed_checkpoint_reads_the_metadata_it_saved(
    tmp_path: Path, cls: type = MetadataReadSafely
) -> None:
    on_two_ranks(lambda: _save(tmp_path, cls))
    on_two_ranks(lambda: _resume(tmp_path, cls))  # an UnpicklingError would be swallowed: check the metadata too
    with (tmp_path / "epoch=0.ckpt" / ".metadata").open("rb") as file:
        assert MetadataOnly(file).load().state_dict_metadata


# The test for upstream's tests_fabric/strategies/test_model_parallel_integration.py


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _fabric_save_or_load(root: Path, cls: type, load: bool) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=cls(_shard, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup_module(nn.Linear(32, 4))
    if not load:
        fabric.save(root / "saved", {"model": model})
        return
    with contextlib.suppress(pickle.UnpicklingError):
        fabric.load(root / "saved", {"model": model})


def test_fabric_load_distributed_checkpoint_runs_no_code_from_metadata(
    tmp_path: Path, cls: type = FabricMetadataReadSafely
) -> None:
    on_two_ranks(lambda: _fabric_save_or_load(tmp_path, cls, load=False))
    _craft(tmp_path / "saved", tmp_path / "code-ran")
    with contextlib.suppress(RuntimeError):  # a rank's error, if the load got past the metadata
        on_two_ranks(lambda: _fabric_save_or_load(tmp_path, cls, load=True))
    assert not (tmp_path / "code-ran").exists()


PROPOSAL = Proposal(
    slug="code-in-metadata",
    title="Resuming a distributed checkpoint runs code from its `.metadata`",
    kind="bug",
    issues=(),
    severity="security",
    status=f"open: `_distributed_checkpoint_load` calls `torch.distributed.checkpoint.load`, whose reader unpickles"
    f" `.metadata`, on {UPSTREAM_MAIN}; no issue found",
    template={
        "Bug description": "Lightning defaults to `weights_only` loading so that opening a checkpoint from elsewhere"
        " cannot run code. A distributed checkpoint (`ModelParallelStrategy`, `FSDPStrategy(state_dict_type="
        "'sharded')`) is a directory whose `.metadata` torch's `FileSystemReader` reads with plain `pickle.load`:"
        " resuming from a downloaded directory runs whatever its `.metadata` asks, on every rank.",
        "Reproduction": "Save a DCP directory; replace `.metadata` by a pickle whose `__reduce__` creates a file;"
        " `trainer.fit(model, ckpt_path=directory)`.",
        "Expected": "The load refuses the metadata; no code runs.",
        "Actual": "The file is created (the code ran), then the load fails.",
        "Environment": "pytorch-lightning 2.6.6, torch 2.13, 2 CPU processes (gloo).",
    },
    change="`src/lightning/fabric/strategies/model_parallel.py` `_load_checkpoint` and"
    " `src/lightning/fabric/strategies/fsdp.py` `_distributed_checkpoint_load`: before torch's reader runs, read"
    " `.metadata` with an unpickler that builds only the types DCP metadata holds (DCP's dataclasses and enums,"
    " `torch.Size`, dtypes, layouts, paths) and refuses every other global. Here: `MetadataOnly`, called"
    " (`check_metadata`) by a subclass before upstream's load, `MetadataReadSafely` (and `FabricMetadataReadSafely`"
    " on Fabric's class). The complete version passes a `FileSystemReader` subclass whose"
    " `read_metadata` uses the restricted unpickler, so the file is read once (no window between check and use).",
    cost="Behaviour: DCP metadata of torch 2.4 to 2.13 loads as before (the types are those torch writes);"
    " a `.metadata` with other globals (a custom planner's extra types) is refused and needs an opt-out, like"
    " `weights_only=False`. The metadata is read twice here (it is small).",
    fix=(MetadataOnly, check_metadata, MetadataReadSafely.load_checkpoint),  # Fabric's override: the same
    released=ModelParallelStrategy,
    changed=MetadataReadSafely,
    reproduce=reproduce,
    tests=(
        test_load_distributed_checkpoint_runs_no_code_from_metadata,
        test_load_distributed_checkpoint_reads_the_metadata_it_saved,
        test_fabric_load_distributed_checkpoint_runs_no_code_from_metadata,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        "The Fabric test goes into upstream's `tests_fabric/strategies/test_model_parallel_integration.py`: the load"
        " that unpickles `.metadata` is Fabric's `_load_checkpoint`, which `fabric.load` and the Trainer's strategy"
        " both call (Fabric's `FSDPStrategy` reads sharded directories through the same DCP reader).",
    ),
)
