"""A DCP directory of ModelParallelStrategy that mixes shard files of two saves resumes without a word."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.fsdp import fully_shard

from scripts.upstream_findings import _mix
from scripts.upstream_proposals.core import UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.helpers import canonical_checkpoint
from tests.support.upstream_runs import fit

#: The file a save writes beside DCP's: each shard file's SHA-256, as its rank wrote it.
MANIFEST = "shards.json"


def _digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def record_shards(path: Path, rank: int, world_size: int) -> None:
    """After a DCP save into ``path``: each rank hashes the files it wrote (DCP names them
    ``__<rank>_<n>.distcp``), and rank 0 writes all digests to :data:`MANIFEST`."""
    own = {file.name: _digest(file) for file in path.glob(f"__{rank}_*.distcp")}
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, own)
    if rank == 0:
        (path / MANIFEST).write_text(json.dumps({k: v for files in gathered for k, v in files.items()}))


def refuse_foreign_shards(path: Path, rank: int, world_size: int) -> None:
    """Before a load of ``path``: where :data:`MANIFEST` is, the ranks share the hashing of every shard file and
    all raise if one is not the file the record lists (missing, another digest, or not listed)."""
    if not (path / MANIFEST).is_file():
        return
    recorded = json.loads((path / MANIFEST).read_text())
    present = sorted({*recorded, *(file.name for file in path.glob("*.distcp"))})
    mine = present[rank::world_size]  # the ranks share the reading
    wrong = [name for name in mine if not (path / name).is_file() or recorded.get(name) != _digest(path / name)]
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, wrong)
    if any(gathered):
        names = ", ".join(sorted(name for found in gathered for name in found))
        raise RuntimeError(f"{path}: {names} is not the file its save wrote ({MANIFEST} records another)")


class ShardsOfOneSave(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy``; a DCP save also records each rank's shard files' digests, and a load
    of a directory with that record refuses files it does not list as written."""

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(filepath))
        if path.is_dir():  # a DCP save
            record_shards(path, self.global_rank, self.world_size)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        refuse_foreign_shards(Path(self.broadcast(checkpoint_path)), self.global_rank, self.world_size)
        return super().load_checkpoint(checkpoint_path, weights_only)


class FabricShardsOfOneSave(FabricModelParallelStrategy):
    """The same record and check on Fabric's ``ModelParallelStrategy`` (``fabric.save`` and ``fabric.load``)."""

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        super().save_checkpoint(path, state, storage_options, filter)
        directory = Path(self.broadcast(path))
        if directory.is_dir():  # a DCP save
            record_shards(directory, self.global_rank, self.world_size)

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        refuse_foreign_shards(Path(self.broadcast(path)), self.global_rank, self.world_size)
        return super().load_checkpoint(path, state, strict, **kwargs)


def reproduce(root: Path, cls: type) -> Outcome:
    """Two epochs saved as DCP directories; rank 1's shard of the second copied into the first; resume the first."""
    saving = lambda: cls(data_parallel_size=2, tensor_parallel_size=1)  # noqa: E731
    fit(saving, root / "saves", epochs=2)
    first, second = root / "saves" / "epoch=0.ckpt", root / "saves" / "epoch=1.ckpt"
    saved_first, saved_second = (canonical_checkpoint(path)["state_dict"] for path in (first, second))
    _mix(first, second)
    resuming = lambda: cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)  # noqa: E731
    try:
        fit(resuming, root / "resumed", ckpt_path=first)
    except RuntimeError as error:
        refused = "__1_0.distcp" in str(error) and "not the file its save wrote" in str(error)
        return Outcome(refused, "refused before loading: __1_0.distcp is not the file its save wrote")
    restored = canonical_checkpoint(root / "resumed" / "restored.ckpt")["state_dict"]
    mixed = sorted(
        key
        for key, value in restored.items()
        if isinstance(value, Tensor) and value.dim() > 0 and value.shape[0] > 1
        if not torch.equal(value, saved_first[key])
        if torch.equal(value[value.shape[0] // 2 :], saved_second[key][value.shape[0] // 2 :])
    )
    return Outcome(not mixed, f"resumed without a warning; {len(mixed)} tensor(s) hold rows of the other save")


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _ShardedBoringModel(BoringModel):
    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])


def _save_twice(root: Path, cls: type) -> None:
    every_epoch = ModelCheckpoint(dirpath=root, filename="{epoch}", save_top_k=-1)
    strategy = cls(data_parallel_size=2, tensor_parallel_size=1)
    trainer(strategy, root, max_epochs=2, callbacks=[every_epoch]).fit(_ShardedBoringModel())


def _resume(root: Path, cls: type) -> str:
    try:
        trainer(cls(data_parallel_size=2, tensor_parallel_size=1), root).fit(
            _ShardedBoringModel(), ckpt_path=root / "epoch=0.ckpt"
        )
    except RuntimeError as error:
        return str(error)
    return "resumed"


def test_load_distributed_checkpoint_refuses_shards_of_another_save(
    tmp_path: Path, cls: type = ShardsOfOneSave
) -> None:
    on_two_ranks(lambda: _save_twice(tmp_path, cls))
    shutil.copyfile(tmp_path / "epoch=1.ckpt" / "__1_0.distcp", tmp_path / "epoch=0.ckpt" / "__1_0.distcp")
    messages = on_two_ranks(lambda: _resume(tmp_path, cls))
    assert all("__1_0.distcp is not the file its save wrote" in message for message in messages), messages


# The test for upstream's tests_fabric/strategies/test_model_parallel_integration.py


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _fabric_model(cls: type) -> tuple[Fabric, nn.Module]:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=cls(_shard, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    return fabric, fabric.setup_module(nn.Linear(32, 4))


def _fabric_save_twice(root: Path, cls: type) -> None:
    fabric, model = _fabric_model(cls)
    fabric.save(root / "first", {"model": model})
    with torch.no_grad():  # the second save holds other weights
        for param in model.parameters():
            param.add_(1.0)
    fabric.save(root / "second", {"model": model})


def _fabric_load(root: Path, cls: type) -> str:
    fabric, model = _fabric_model(cls)
    try:
        fabric.load(root / "first", {"model": model})
    except RuntimeError as error:
        return str(error)
    return "loaded"


def test_fabric_load_distributed_checkpoint_refuses_shards_of_another_save(
    tmp_path: Path, cls: type = FabricShardsOfOneSave
) -> None:
    on_two_ranks(lambda: _fabric_save_twice(tmp_path, cls))
    shutil.copyfile(tmp_path / "second" / "__1_0.distcp", tmp_path / "first" / "__1_0.distcp")
    messages = on_two_ranks(lambda: _fabric_load(tmp_path, cls))
    assert all("__1_0.distcp is not the file its save wrote" in message for message in messages), messages


PROPOSAL = Proposal(
    slug="mixed-saves",
    title="ModelParallelStrategy resumes a distributed checkpoint that mixes shard files of two saves without a word",
    kind="bug",
    issues=(),
    severity="silent wrong training",
    status=f"open: nothing in the DCP directory says which save a `.distcp` belongs to on {UPSTREAM_MAIN}; no issue"
    " found",
    template={
        "Bug description": "A `ModelParallelStrategy` (or `FSDPStrategy(state_dict_type='sharded')`) checkpoint is a"
        " directory with one `.distcp` file per rank. If a file of another save ends up in it (an interrupted copy"
        " or sync between storage systems, a save that overwrote only some files), the resume loads it: each rank's"
        " rows come from whichever save its file belongs to, and training continues from a model no save held.",
        "Reproduction": "Save two epochs as DCP directories; copy `__1_0.distcp` of the second into the first;"
        " resume from the first.",
        "Expected": "The resume refuses, naming the file that does not belong.",
        "Actual": "It resumes; the tensors hold rank 0's rows of the first save and rank 1's rows of the second.",
        "Environment": "pytorch-lightning 2.6.6, torch 2.13, 2 CPU processes (gloo).",
    },
    change="`src/lightning/pytorch/strategies/model_parallel.py`, `save_checkpoint` and `load_checkpoint` (and"
    " Fabric's `_save_checkpoint`/`_load_checkpoint`): after DCP's save, every rank hashes the files it wrote, and"
    " rank 0 writes the digests beside `meta.pt`; a load of a directory with that record has the ranks share the"
    " hashing of every `.distcp` present and refuses, on every rank, any file the record does not list with that"
    " digest. Here: `record_shards` and `refuse_foreign_shards`, called by `ShardsOfOneSave`, a subclass (and by"
    " `FabricShardsOfOneSave` on Fabric's class). This package does it without reading the files twice: each rank"
    " writes a small stamp tensor (save id, rank) into its own shard and the load checks the stamps; that needs a"
    " planner change and is the larger version.",
    cost="Behaviour: directories without the record (older saves) load as before. Cost: each rank reads back the"
    " files it wrote at the save, and the files are read once more at the load (page cache makes the first cheap,"
    " not the second on a cold store). A tool that rewrites shard files in place (no Lightning code does) would"
    " have to rewrite the record.",
    fix=(_digest, record_shards, refuse_foreign_shards, ShardsOfOneSave),  # Fabric's: the same calls
    released=ModelParallelStrategy,
    changed=ShardsOfOneSave,
    reproduce=reproduce,
    tests=(
        test_load_distributed_checkpoint_refuses_shards_of_another_save,
        test_fabric_load_distributed_checkpoint_refuses_shards_of_another_save,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        "The Fabric test goes into upstream's `tests_fabric/strategies/test_model_parallel_integration.py`: Fabric's"
        " `save` and `load` of a distributed checkpoint mix shards of two saves the same way.",
    ),
)
