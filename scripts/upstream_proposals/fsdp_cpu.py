"""FSDPStrategy refuses the CPU, and past that refusal crashes in its full save."""

from __future__ import annotations

import contextlib
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import lightning_fabric.strategies.fsdp as fabric_fsdp
import pytorch_lightning.strategies.fsdp as trainer_fsdp
import torch
from lightning_fabric import Fabric
from lightning_fabric.strategies import FSDPStrategy as FabricFSDPStrategy
from pytorch_lightning.demos.boring_classes import BoringModel
from pytorch_lightning.strategies import FSDPStrategy
from torch import nn
from torch.distributed.fsdp import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    StateDictType,
)
from torch.distributed.fsdp.wrap import enable_wrap, wrap
from torch.optim import Optimizer

from scripts.upstream_findings import _Unwrapped
from scripts.upstream_proposals.core import ISSUES, UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import fit


def full_state_context(module: nn.Module, world_size: int, rank0_only: bool = True) -> Any:
    """Upstream's full state-dict context, offloading to the CPU only from an accelerator (on the CPU FSDP1's offload
    'moves' the gathered flat parameter onto the device it is on, gets the same storage back and frees it)."""
    offload = next(module.parameters()).device.type != "cpu"
    return FullyShardedDataParallel.state_dict_type(
        module,
        StateDictType.FULL_STATE_DICT,
        FullStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
        FullOptimStateDictConfig(offload_to_cpu=offload, rank0_only=rank0_only),
    )


@contextlib.contextmanager
def _offloading_from_accelerators_only() -> Iterator[None]:
    with mock.patch.object(trainer_fsdp, "_get_full_state_dict_context", full_state_context):
        yield


@contextlib.contextmanager
def _fabric_offloading_from_accelerators_only() -> Iterator[None]:
    with mock.patch.object(fabric_fsdp, "_get_full_state_dict_context", full_state_context):
        yield


class FSDPStrategyOnCPU(FSDPStrategy):
    """Upstream's ``FSDPStrategy`` with the CPU fixes: past the accelerator connector's refusal (which looks for this
    exact type), handing FSDP1 the device (``device_id=torch.device('cpu')``, where upstream passes the device index,
    ``None`` on the CPU), and full saves and loads through :func:`full_state_context`."""

    def _setup_model(self, model: nn.Module) -> nn.Module:
        if not any(isinstance(module, FullyShardedDataParallel) for module in model.modules()):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self.kwargs,
            )
        return super()._setup_model(model)

    @contextlib.contextmanager
    def model_sharded_context(self) -> Generator[None, None, None]:
        with enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self.kwargs,
        ):
            yield

    def lightning_module_state_dict(self) -> dict[str, Any]:
        with _offloading_from_accelerators_only():
            return super().lightning_module_state_dict()

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        with _offloading_from_accelerators_only():
            return super().optimizer_state(optimizer)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        with _offloading_from_accelerators_only():
            return super().load_checkpoint(checkpoint_path, weights_only)


class FabricFSDPStrategyOnCPU(FabricFSDPStrategy):
    """The same fixes on Fabric's ``FSDPStrategy``: past Fabric's connector (which looks for the exact type too),
    the device handed to FSDP1 in ``setup_module`` and ``module_sharded_context``, and full saves and loads through
    :func:`full_state_context`."""

    def setup_module(self, module: nn.Module) -> nn.Module:
        if not any(isinstance(child, FullyShardedDataParallel) for child in module.modules()):
            module = FullyShardedDataParallel(
                module=module,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=self.root_device,
                **self._fsdp_kwargs,
            )
        return super().setup_module(module)

    def module_sharded_context(self) -> Any:
        return enable_wrap(
            wrapper_cls=FullyShardedDataParallel,
            cpu_offload=self.cpu_offload,
            mixed_precision=self.mixed_precision_config,
            sharding_strategy=self.sharding_strategy,
            device_id=self.root_device,
            **self._fsdp_kwargs,
        )

    def save_checkpoint(self, *args: Any, **kwargs: Any) -> None:
        with _fabric_offloading_from_accelerators_only():
            super().save_checkpoint(*args, **kwargs)

    def load_checkpoint(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with _fabric_offloading_from_accelerators_only():
            return super().load_checkpoint(*args, **kwargs)


def reproduce(root: Path, cls: type) -> Outcome:
    """``Trainer(strategy=cls(state_dict_type='full'), accelerator='cpu', devices=2)`` fits a model it wraps itself
    and saves a full file, which ``torch.load`` reads back whole."""
    fit(lambda: cls(state_dict_type="full"), root, epochs=1, model_class=_Unwrapped)
    state = torch.load(root / "epoch=0.ckpt", weights_only=True)["state_dict"]
    shapes = {key: tuple(value.shape) for key, value in state.items() if key.endswith("weight")}
    return Outcome(bool(shapes), f"trained and saved a full file: {shapes}")


# The tests for upstream's tests_pytorch/strategies/test_fsdp.py


class _WrappedInConfigureModel(BoringModel):
    def configure_model(self) -> None:
        if not isinstance(self.layer, FullyShardedDataParallel):
            self.layer = wrap(self.layer)  # inside the strategy's enable_wrap: its options, its device


def _fit_and_save(root: Path, cls: type, wrapped_by_user: bool) -> None:
    model = _WrappedInConfigureModel() if wrapped_by_user else BoringModel()
    fitted = trainer(cls(state_dict_type="full"), root)
    fitted.fit(model)
    fitted.save_checkpoint(root / "full.ckpt")


def test_fsdp_trains_and_saves_on_cpu(tmp_path: Path, cls: type = FSDPStrategyOnCPU) -> None:
    on_two_ranks(lambda: _fit_and_save(tmp_path, cls, wrapped_by_user=False))
    state = torch.load(tmp_path / "full.ckpt", weights_only=True)["state_dict"]
    assert state["layer.weight"].shape == (2, 32)


def test_fsdp_wraps_in_configure_model_on_cpu(tmp_path: Path, cls: type = FSDPStrategyOnCPU) -> None:
    on_two_ranks(lambda: _fit_and_save(tmp_path, cls, wrapped_by_user=True))
    model = BoringModel.load_from_checkpoint(tmp_path / "full.ckpt")
    assert model.layer.weight.shape == (2, 32)


# The test for upstream's tests_fabric/strategies/test_fsdp_integration.py


def _fabric_step_and_save(root: Path, cls: type) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy=cls(state_dict_type="full"))
    fabric.launch()
    model = fabric.setup_module(nn.Linear(32, 2))
    optimizer = fabric.setup_optimizers(torch.optim.Adam(model.parameters()))
    fabric.backward(model(torch.randn(4, 32)).sum())
    optimizer.step()
    fabric.save(root / "full.ckpt", {"model": model, "optimizer": optimizer})


def test_fabric_fsdp_trains_and_saves_on_cpu(tmp_path: Path, cls: type = FabricFSDPStrategyOnCPU) -> None:
    on_two_ranks(lambda: _fabric_step_and_save(tmp_path, cls))
    state = torch.load(tmp_path / "full.ckpt", weights_only=True)
    assert state["model"]["weight"].shape == (2, 32)
    assert state["optimizer"]["state"]["weight"]["exp_avg"].shape == (2, 32)


PROPOSAL = Proposal(
    slug="fsdp-cpu",
    title="FSDPStrategy does not run on the CPU",
    kind="feature",
    issues=(21812,),
    severity="missing feature (past the refusal: a crash)",
    status=f"open: the connector's GPU-only check for `FSDPStrategy` is still there on {UPSTREAM_MAIN}; PR 21840"
    " (unmerged) addresses it",
    template={
        "Description & Motivation": "Every other strategy runs on the CPU with gloo, which is how users develop and"
        " how CI tests without GPUs; torch's FSDP1 supports the CPU (`device_id=torch.device('cpu')`). Lightning"
        " refuses `FSDPStrategy` with `accelerator='cpu'`, and a subclass that gets past the refusal fails twice"
        " more: FSDP1 refuses `device_id=None` (Lightning passes `root_device.index`, `None` on the CPU), and a full"
        " save then dies of SIGSEGV (Lightning asks for `offload_to_cpu=True`; on the CPU FSDP1 'moves' the gathered"
        " flat parameter to where it already is, gets the same storage back and frees it, and the state dict's"
        " clone reads freed memory).",
        "Pitch": "`Trainer(accelerator='cpu', devices=2, strategy='fsdp')` trains, saves full and sharded checkpoints"
        " and resumes them, as on CUDA.",
        "Alternatives": "`ModelParallelStrategy` (FSDP2) runs on the CPU already, but is a different API (the user"
        " shards in `configure_model`); `FSDPStrategy` users would have to rewrite their models to test on a CPU.",
    },
    change="Three changes. `src/lightning/pytorch/trainer/connectors/accelerator_connector.py`,"
    " `_check_strategy_and_fallback` (and Fabric's, `src/lightning/fabric/connector.py`): accept `cpu` for"
    " `FSDPStrategy` (the subclass here stands in for that: the check looks for the exact type)."
    " `src/lightning/pytorch/strategies/fsdp.py`, `_setup_model` and"
    " `model_sharded_context` (and Fabric's `setup_module`/`module_init_context`): `device_id=self.root_device`"
    " instead of `self.root_device.index` (torch accepts a device, CUDA included). `src/lightning/fabric/strategies/"
    "fsdp.py`, `_get_full_state_dict_context`: `offload_to_cpu` only when the parameters are not on the CPU already."
    " Here: `FSDPStrategyOnCPU` (the two overridden methods repeat upstream's call with the device), and"
    " `FabricFSDPStrategyOnCPU`, the same on Fabric's class (Fabric's connector refuses the CPU the same way).",
    cost="Behaviour on CUDA: none (the device object names the same device as its index; offload unchanged). On the"
    " CPU: works where it raised. Risk: FSDP1 on CPU is less exercised in torch than on CUDA (mixed precision and"
    " CPU offload options mean little there), so the docs should say it is for development and CI.",
    fix=(full_state_context, _offloading_from_accelerators_only, FSDPStrategyOnCPU),
    released=FSDPStrategy,
    changed=FSDPStrategyOnCPU,
    reproduce=reproduce,
    tests=(
        test_fsdp_trains_and_saves_on_cpu,
        test_fsdp_wraps_in_configure_model_on_cpu,
        test_fabric_fsdp_trains_and_saves_on_cpu,
    ),
    upstream_test_file="tests_pytorch/strategies/test_fsdp.py",
    notes=(
        f"Issue: {ISSUES}21812; PR 21840. The Fabric test goes into upstream's"
        " `tests_fabric/strategies/test_fsdp_integration.py`: `Fabric(accelerator='cpu', strategy='fsdp')` is refused"
        " the same way, and past the refusal Fabric's `setup_module` and full save fail as the Trainer's do.",
    ),
)
