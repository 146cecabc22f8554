"""ModelParallelStrategy re-keys a full file's optimizer state by module position, not through the param groups."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any
from unittest import mock

import lightning_fabric.strategies.model_parallel as fabric_model_parallel
import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import ModelParallelStrategy as FabricModelParallelStrategy
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from scripts.upstream_findings import SameShapeLayers, _optimizer_difference
from scripts.upstream_proposals.core import UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import fit


def names_through_groups(state: dict[str, Any], module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """``state`` (torch's layout: parameters numbered through the param groups) keyed by parameter names.

    The ``j``-th number of saved group ``g`` is the ``j``-th parameter of the optimizer's group ``g``; its name is
    the module's name for that parameter. Names already (a sharded save's layout) are left as they are.
    """
    if not any(isinstance(number, int) for group in state["param_groups"] for number in group["params"]):
        return state
    name_of = {id(param): name for name, param in module.named_parameters()}
    names: dict[int, str] = {}
    for saved, live in zip(state["param_groups"], optimizer.param_groups, strict=True):
        for number, param in zip(saved["params"], live["params"], strict=True):
            names[number] = name_of[id(param)]
    return {
        "state": {names[number]: entry for number, entry in state["state"].items()},
        "param_groups": [{**group, "params": [names[n] for n in group["params"]]} for group in state["param_groups"]],
    }


class RekeyedThroughGroups(ModelParallelStrategy):
    """Upstream's ``ModelParallelStrategy`` with :func:`names_through_groups` in place of
    ``_rekey_optimizer_state_if_needed`` (which numbers ``module.parameters()`` in module order)."""

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        optimizers = iter(self.optimizers)  # upstream re-keys each optimizer's state in this order

        def rekey(state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
            return names_through_groups(state, module, next(optimizers))

        with mock.patch.object(fabric_model_parallel, "_rekey_optimizer_state_if_needed", rekey):
            return super().load_checkpoint(checkpoint_path, weights_only)


class FabricRekeyedThroughGroups(FabricModelParallelStrategy):
    """The same change on Fabric's ``ModelParallelStrategy`` (``fabric.load`` of a full file)."""

    def load_checkpoint(self, path: Any, state: Any = None, strict: bool = True, **kwargs: Any) -> dict[str, Any]:
        optimizers = iter([obj for obj in (state or {}).values() if isinstance(obj, Optimizer)])

        def rekey(optimizer_state: dict[str, Any], module: nn.Module) -> dict[str, Any]:
            return names_through_groups(optimizer_state, module, next(optimizers))

        with mock.patch.object(fabric_model_parallel, "_rekey_optimizer_state_if_needed", rekey):
            return super().load_checkpoint(path, state, strict, **kwargs)


def reproduce(root: Path, cls: type) -> Outcome:
    """A ``ddp`` file of a model whose Adam lists the second layer's group first, resumed under ``cls``."""
    fit(lambda: "ddp", root / "ddp", epochs=1, model_class=SameShapeLayers)
    saved = root / "ddp" / "epoch=0.ckpt"
    strategy = lambda: cls(data_parallel_size=2, tensor_parallel_size=1, save_distributed_checkpoint=False)  # noqa: E731
    fit(strategy, root / "resumed", ckpt_path=saved, model_class=SameShapeLayers)
    worst, saved_lrs, restored_lrs = _optimizer_difference(saved, root / "resumed" / "restored.ckpt")
    return Outcome(
        worst == 0 and saved_lrs == restored_lrs,
        f"restored Adam moments differ from the saved ones by up to {worst:.3g}; learning rates per group"
        f" {restored_lrs} (saved {saved_lrs})",
    )


# The test for upstream's tests_pytorch/strategies/test_model_parallel_integration.py


class _GroupsInReverse(BoringModel):
    """Two layers of one shape whose optimizer lists the second layer first, with a learning rate each."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Sequential(nn.Linear(32, 32), nn.Linear(32, 32))

    def configure_model(self) -> None:
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            fully_shard(self.layer, mesh=self.trainer.strategy.device_mesh["data_parallel"])

    def configure_optimizers(self) -> Any:
        first, second = self.layer
        return torch.optim.Adam([{"params": second.parameters(), "lr": 0.01}, {"params": first.parameters()}], lr=0.1)


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _resume_and_compare(root: Path, strategy: ModelParallelStrategy) -> None:
    saved = torch.load(root / "ddp.ckpt", weights_only=True)["optimizer_states"][0]
    model = _GroupsInReverse()
    with contextlib.suppress(StopIteration):
        model.on_train_start = _stop  # type: ignore[method-assign]
        trainer(strategy, root).fit(model, ckpt_path=root / "ddp.ckpt")
    optimizer = model.trainer.optimizers[0]
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        assert group["lr"] == saved_group["lr"]
        for number, param in zip(saved_group["params"], group["params"], strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(_full(optimizer.state[param][key]), saved["state"][number][key])


def _stop() -> None:
    raise StopIteration  # the restored state is what the test compares: no step after the restore


def _save_under_ddp(root: Path) -> None:
    fitted = trainer("ddp", root)
    fitted.fit(_GroupsInReverse())
    fitted.save_checkpoint(root / "ddp.ckpt")


def test_load_full_checkpoint_with_param_groups_in_another_order(
    tmp_path: Path, cls: type = RekeyedThroughGroups
) -> None:
    on_two_ranks(lambda: _save_under_ddp(tmp_path))
    on_two_ranks(lambda: _resume_and_compare(tmp_path, cls(data_parallel_size=2, tensor_parallel_size=1)))


def _shard(module: nn.Module, mesh: Any) -> nn.Module:
    fully_shard(module.layer, mesh=mesh["data_parallel"])
    return module


def _fabric_load_and_compare(root: Path, cls: type) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=cls(_shard, data_parallel_size=2, tensor_parallel_size=1))
    fabric.launch()
    fabric.seed_everything(1)
    model = fabric.setup_module(_GroupsInReverse())
    first, second = model.layer
    optimizer = torch.optim.Adam([{"params": second.parameters(), "lr": 0.01}, {"params": first.parameters()}])
    optimizer = fabric.setup_optimizers(optimizer)
    fabric.load(root / "plain.ckpt", {"model": model, "optimizer": optimizer})
    saved = torch.load(root / "plain.ckpt", weights_only=True)["optimizer"]
    for saved_group, group in zip(saved["param_groups"], optimizer.param_groups, strict=True):
        assert group["lr"] == saved_group["lr"]
        for number, param in zip(saved_group["params"], group["params"], strict=True):
            torch.testing.assert_close(_full(optimizer.state[param]["exp_avg"]), saved["state"][number]["exp_avg"])


def _plain_checkpoint(path: Path) -> None:
    """A file in torch's layout (as ``ddp`` or a single device writes it): one Adam step on ``_GroupsInReverse``."""
    torch.manual_seed(0)
    model = _GroupsInReverse()
    first, second = model.layer
    optimizer = torch.optim.Adam([{"params": second.parameters(), "lr": 0.01}, {"params": first.parameters()}])
    model(torch.randn(4, 32)).sum().backward()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def test_fabric_load_full_checkpoint_with_param_groups_in_another_order(
    tmp_path: Path, cls: type = RekeyedThroughGroups
) -> None:
    fabric_cls = FabricRekeyedThroughGroups if cls is RekeyedThroughGroups else FabricModelParallelStrategy
    _plain_checkpoint(tmp_path / "plain.ckpt")
    on_two_ranks(lambda: _fabric_load_and_compare(tmp_path, fabric_cls))


PROPOSAL = Proposal(
    slug="optimizer-state-order",
    title="ModelParallelStrategy puts optimizer state on the wrong parameters when loading a full checkpoint whose"
    " param groups list parameters in another order than the module",
    kind="bug",
    issues=(),
    severity="silent wrong training",
    status=f"open: `_rekey_optimizer_state_if_needed` still calls `FSDP.rekey_optim_state_dict(..., PARAM_NAME,"
    f" module)` on {UPSTREAM_MAIN}; no Lightning issue found (the same re-keying in torch's FSDP1 is"
    " pytorch/pytorch#113673)",
    template={
        "Bug description": "Resuming a full checkpoint (a `ddp` file, or `ModelParallelStrategy("
        "save_distributed_checkpoint=False)`'s own) under `ModelParallelStrategy` restores each parameter's optimizer"
        " state and each group's hyper-parameters onto other parameters when the optimizer's param groups list"
        " parameters in another order than `module.parameters()` (any no-weight-decay recipe does). Nothing is"
        " reported when the shapes agree; training continues from wrong moments and learning rates.",
        "Reproduction": "Two `nn.Linear(32, 32)`; `Adam([{'params': second.parameters(), 'lr': 0.01},"
        " {'params': first.parameters()}], lr=0.1)`. Fit under `Trainer(strategy='ddp')`, save; resume under"
        " `ModelParallelStrategy` (`fully_shard` in `configure_model`) and compare `optimizer.state[p]` with the"
        " saved state of the same parameter.",
        "Expected": "The saved state of each parameter on that parameter; each group's learning rate on its group.",
        "Actual": "The state of `first` restored onto `second` and the other way round; the learning rates of the"
        " groups swapped.",
        "Environment": "pytorch-lightning 2.6.6, torch 2.13, 2 CPU processes (gloo); the code path is the same on"
        " CUDA.",
    },
    change="`src/lightning/fabric/strategies/model_parallel.py`, `_rekey_optimizer_state_if_needed`: torch numbers a"
    " plain optimizer's parameters by their place in `param_groups` (group by group), and"
    " `FSDP.rekey_optim_state_dict(..., PARAM_NAME, module)` reads the numbers as positions in"
    " `module.parameters()`. The change maps the `j`-th number of saved group `g` to the name of the `j`-th"
    " parameter of the live optimizer's group `g` (the optimizer is passed in; `_load_checkpoint` has it), which is"
    " how torch's own `Optimizer.load_state_dict` pairs them. Here: `names_through_groups`, applied by patching the"
    " function for one `load_checkpoint` call.",
    cost="Behaviour: files whose groups follow the module's order load as before; the others now load right. A"
    " file whose groups do not match the optimizer's (count or length) raises instead of loading silently wrong."
    " Nothing else reads the function.",
    fix=(names_through_groups, RekeyedThroughGroups.load_checkpoint),  # Fabric's override is the same lines
    released=ModelParallelStrategy,
    changed=RekeyedThroughGroups,
    reproduce=reproduce,
    tests=(
        test_load_full_checkpoint_with_param_groups_in_another_order,
        test_fabric_load_full_checkpoint_with_param_groups_in_another_order,
    ),
    upstream_test_file="tests_pytorch/strategies/test_model_parallel_integration.py",
    notes=(
        "The Fabric test goes into upstream's `tests_fabric/strategies/test_model_parallel_integration.py`; the change"
        " is in Fabric's `_load_checkpoint`, which both strategies call.",
    ),
)
