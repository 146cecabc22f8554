"""ModelParallelStrategy restores tuple hyper-parameters (Adam's ``betas``) as lists."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.optim import Optimizer

from scripts.upstream_proposals.core import UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import fit


def hyperparameters_as_defined(optimizer: Optimizer) -> None:
    """Each group's hyper-parameter back in its optimizer's type where a load handed it back as a list (torch's
    ``set_optimizer_state_dict`` flattens and re-packs the groups: a tuple comes back a list)."""
    for group in optimizer.param_groups:
        for key, default in optimizer.defaults.items():
            if isinstance(default, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])


class HyperParametersAsSaved(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy`` calling :func:`hyperparameters_as_defined` after its load."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only)
        for optimizer in self.optimizers:
            hyperparameters_as_defined(optimizer)
        return checkpoint


class FabricHyperParametersAsSaved(FabricModelParallelStrategy):
    """The same on Fabric's ``ModelParallelStrategy``: :func:`hyperparameters_as_defined` on each optimizer of the
    state after ``fabric.load``."""

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        remaining = super().load_checkpoint(path, state, strict, **kwargs)
        for optimizer in state.values() if isinstance(state, dict) else ():
            if isinstance(optimizer, Optimizer):
                hyperparameters_as_defined(optimizer)
        return remaining


def _restored_betas(path: Path) -> Any:
    return torch.load(path, weights_only=True)["optimizer_states"][0]["param_groups"][0]["betas"]


def reproduce(root: Path, cls: type) -> Outcome:
    """A ``ddp`` file (Adam) resumed under ``cls``, whose state right after the restore is saved and read back."""
    fit(lambda: "ddp", root / "ddp", epochs=1)
    strategy = lambda: cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)  # noqa: E731
    fit(strategy, root / "resumed", ckpt_path=root / "ddp" / "epoch=0.ckpt")
    saved, restored = (
        _restored_betas(root / "ddp" / "epoch=0.ckpt"),
        _restored_betas(root / "resumed" / "restored.ckpt"),
    )
    return Outcome(
        type(restored) is type(saved) and tuple(restored) == tuple(saved),
        f"Adam's betas restored as {type(restored).__name__} {restored!r} (saved: {type(saved).__name__} {saved!r})",
    )


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _ShardedBoringModel(BoringModel):
    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), betas=(0.8, 0.9))

    def on_train_start(self) -> None:
        raise StopIteration  # what the test reads is the state right after the restore


def _resume(root: Path, strategy: ModelParallelStrategy) -> None:
    model = _ShardedBoringModel()
    with contextlib.suppress(StopIteration):
        trainer(strategy, root).fit(model, ckpt_path=root / "ddp.ckpt")
    assert model.trainer.optimizers[0].param_groups[0]["betas"] == (0.8, 0.9)


def _save(root: Path) -> None:
    model = _ShardedBoringModel()
    model.on_train_start = lambda: None  # type: ignore[method-assign]
    fitted = trainer("ddp", root)
    fitted.fit(model)
    fitted.save_checkpoint(root / "ddp.ckpt")


def test_load_full_checkpoint_keeps_hyperparameter_types(tmp_path: Path, cls: type = HyperParametersAsSaved) -> None:
    on_two_ranks(lambda: _save(tmp_path))
    on_two_ranks(lambda: _resume(tmp_path, cls(data_parallel_size=2, tensor_parallel_size=1)))


# The test for upstream's tests_fabric/strategies/test_model_parallel_integration.py


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module, mesh=mesh["data_parallel"])
    return module


def _plain_checkpoint(path: Path) -> None:
    """A file in torch's layout (as ``ddp`` or one device writes it) after a step of ``Adam(betas=(0.8, 0.9))``."""
    model = nn.Linear(32, 4)
    optimizer = torch.optim.Adam(model.parameters(), betas=(0.8, 0.9))
    model(torch.randn(2, 32)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def _fabric_load_betas(root: Path, cls: type) -> Any:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=cls(_shard, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    model = fabric.setup_module(nn.Linear(32, 4))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters(), betas=(0.8, 0.9)))
    fabric.load(root / "plain.ckpt", {"model": model, "optimizer": optimizer})
    return optimizer.param_groups[0]["betas"]


def test_fabric_load_full_checkpoint_keeps_hyperparameter_types(
    tmp_path: Path, cls: type = FabricHyperParametersAsSaved
) -> None:
    _plain_checkpoint(tmp_path / "plain.ckpt")
    assert on_two_ranks(lambda: _fabric_load_betas(tmp_path, cls)) == [(0.8, 0.9)] * 2


PROPOSAL = Proposal(
    slug="hyperparameter-types",
    title="ModelParallelStrategy restores tuple hyper-parameters (Adam's `betas`) as lists",
    kind="bug",
    issues=(),
    severity="silent wrong training",
    status=f"open: `_load_checkpoint` keeps what `set_optimizer_state_dict` leaves in the groups on {UPSTREAM_MAIN};"
    " no issue found",
    template={
        "Bug description": "After a resume under `ModelParallelStrategy`, every tuple hyper-parameter of the"
        " optimizer (Adam's and AdamW's `betas`) is a list. The values are equal, so today's torch optimizers train"
        " on exactly; but the restored state is not the one saved, a checkpoint written after the resume differs"
        " from the one it came from, and code that checks the type (or an optimizer that unpacks a tuple) breaks."
        " Severity is the weakest of this list: nothing trains wrong today.",
        "Reproduction": "`BoringModel` with `Adam(betas=(0.8, 0.9))`: fit under `ddp`, save, resume under"
        " `ModelParallelStrategy`, read `optimizer.param_groups[0]['betas']`.",
        "Expected": "`(0.8, 0.9)`.",
        "Actual": "`[0.8, 0.9]`.",
        "Environment": "pytorch-lightning 2.6.6, torch 2.13, 2 CPU processes (gloo).",
    },
    change="`src/lightning/fabric/strategies/model_parallel.py`, `_load_checkpoint`: after"
    " `set_optimizer_state_dict`, put each hyper-parameter that the optimizer defines as a tuple back as a tuple"
    " (torch's distributed state-dict API flattens the groups and rebuilds them from lists). Here:"
    " `hyperparameters_as_defined`, called after upstream's load (`HyperParametersAsSaved`, and"
    " `FabricHyperParametersAsSaved` after `fabric.load`).",
    cost="Behaviour: the types of the saved state, nothing else (values are already equal). A hyper-parameter"
    " that a user deliberately stores as a list where the optimizer's default is a tuple becomes a tuple.",
    fix=(hyperparameters_as_defined, HyperParametersAsSaved.load_checkpoint),
    released=ModelParallelStrategy,
    changed=HyperParametersAsSaved,
    reproduce=reproduce,
    tests=(
        test_load_full_checkpoint_keeps_hyperparameter_types,
        test_fabric_load_full_checkpoint_keeps_hyperparameter_types,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        "The Fabric test goes into upstream's `tests_fabric/strategies/test_model_parallel_integration.py`: the load"
        " is Fabric's `_load_checkpoint`, which `fabric.load` and the Trainer's strategy both call.",
    ),
)
