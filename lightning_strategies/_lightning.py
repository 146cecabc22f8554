"""The one module that imports Lightning; every other module takes Lightning's names from here.

Which package the names come from depends on the copy of the code this module belongs to (see ``_flavour``):
``pytorch_lightning``/``lightning_fabric`` under ``lightning_strategies``, ``lightning.pytorch``/``lightning.fabric``
under ``lightning_strategies.lightning``. Type checkers see the ``pytorch_lightning`` names; both packages are
generated from the same source, so their signatures agree.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._flavour import flavour_of

FLAVOUR = flavour_of(__name__)


def _load(package: str, module: str, name: str) -> Any:
    return getattr(importlib.import_module(f"{package}.{module}"), name)


if TYPE_CHECKING:
    import pytorch_lightning as pl
    from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning_fabric.strategies.registry import _StrategyRegistry
    from lightning_fabric.utilities.distributed import (
        _distributed_is_initialized,
        _get_default_process_group_backend_for_device,
        _init_dist_connection,
        _sync_ddp_if_available,
    )
    from lightning_fabric.utilities.optimizer import _optimizer_to_device, _optimizers_to_device
    from lightning_fabric.utilities.seed import reset_seed
    from lightning_fabric.utilities.types import _PATH
    from pytorch_lightning.callbacks import ModelCheckpoint
    from pytorch_lightning.core.optimizer import LightningOptimizer
    from pytorch_lightning.overrides.distributed import _sync_module_states
    from pytorch_lightning.plugins.io import AsyncCheckpointIO, TorchCheckpointIO
    from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO
    from pytorch_lightning.plugins.precision import Precision
    from pytorch_lightning.strategies import Strategy, StrategyRegistry
    from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher
    from pytorch_lightning.strategies.launchers.multiprocessing import _MultiProcessingLauncher, _WorkerOutput
    from pytorch_lightning.strategies.parallel import ParallelStrategy
    from pytorch_lightning.strategies.strategy import TBroadcast
    from pytorch_lightning.trainer import call as _trainer_call
    from pytorch_lightning.trainer.states import TrainerFn
    from pytorch_lightning.utilities.model_helpers import is_overridden
    from pytorch_lightning.utilities.types import LRSchedulerConfig
else:
    pl = importlib.import_module(FLAVOUR.pytorch)
    _FABRIC, _PYTORCH = FLAVOUR.fabric, FLAVOUR.pytorch
    CheckpointIO = _load(_FABRIC, "plugins", "CheckpointIO")
    ClusterEnvironment = _load(_FABRIC, "plugins", "ClusterEnvironment")
    _StrategyRegistry = _load(_FABRIC, "strategies.registry", "_StrategyRegistry")
    _distributed_is_initialized = _load(_FABRIC, "utilities.distributed", "_distributed_is_initialized")
    _get_default_process_group_backend_for_device = _load(
        _FABRIC, "utilities.distributed", "_get_default_process_group_backend_for_device"
    )
    _init_dist_connection = _load(_FABRIC, "utilities.distributed", "_init_dist_connection")
    _sync_ddp_if_available = _load(_FABRIC, "utilities.distributed", "_sync_ddp_if_available")
    _optimizer_to_device = _load(_FABRIC, "utilities.optimizer", "_optimizer_to_device")
    _optimizers_to_device = _load(_FABRIC, "utilities.optimizer", "_optimizers_to_device")
    reset_seed = _load(_FABRIC, "utilities.seed", "reset_seed")
    _PATH = _load(_FABRIC, "utilities.types", "_PATH")
    ModelCheckpoint = _load(_PYTORCH, "callbacks", "ModelCheckpoint")
    LightningOptimizer = _load(_PYTORCH, "core.optimizer", "LightningOptimizer")
    _sync_module_states = _load(_PYTORCH, "overrides.distributed", "_sync_module_states")
    TorchCheckpointIO = _load(_PYTORCH, "plugins.io", "TorchCheckpointIO")
    AsyncCheckpointIO = _load(_PYTORCH, "plugins.io", "AsyncCheckpointIO")
    _WrappingCheckpointIO = _load(_PYTORCH, "plugins.io.wrapper", "_WrappingCheckpointIO")
    Precision = _load(_PYTORCH, "plugins.precision", "Precision")
    Strategy = _load(_PYTORCH, "strategies", "Strategy")
    StrategyRegistry = _load(_PYTORCH, "strategies", "StrategyRegistry")
    _SubprocessScriptLauncher = _load(_PYTORCH, "strategies.launchers", "_SubprocessScriptLauncher")
    _MultiProcessingLauncher = _load(_PYTORCH, "strategies.launchers.multiprocessing", "_MultiProcessingLauncher")
    _WorkerOutput = _load(_PYTORCH, "strategies.launchers.multiprocessing", "_WorkerOutput")
    ParallelStrategy = _load(_PYTORCH, "strategies.parallel", "ParallelStrategy")
    TBroadcast = _load(_PYTORCH, "strategies.strategy", "TBroadcast")
    TrainerFn = _load(_PYTORCH, "trainer.states", "TrainerFn")
    _trainer_call = importlib.import_module(f"{_PYTORCH}.trainer.call")
    is_overridden = _load(_PYTORCH, "utilities.model_helpers", "is_overridden")
    LRSchedulerConfig = _load(_PYTORCH, "utilities.types", "LRSchedulerConfig")


def evaluate_under_no_grad(trainer: pl.Trainer) -> None:
    """Runs the trainer's validation, test and predict loops under ``torch.no_grad()`` instead of inference mode.

    Lightning does this for its own ``FSDPStrategy`` only (torch FSDP cannot all-gather parameters inside
    ``torch.inference_mode()``, pytorch/pytorch#95957), and always under gloo, which is why CPU runs never show it.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):  # fit's own runs under no_grad
        loop.inference_mode = False


__all__ = [
    "FLAVOUR",
    "_PATH",
    "AsyncCheckpointIO",
    "CheckpointIO",
    "ClusterEnvironment",
    "LRSchedulerConfig",
    "LightningOptimizer",
    "ModelCheckpoint",
    "ParallelStrategy",
    "Precision",
    "Strategy",
    "StrategyRegistry",
    "TBroadcast",
    "TorchCheckpointIO",
    "TrainerFn",
    "_MultiProcessingLauncher",
    "_StrategyRegistry",
    "_SubprocessScriptLauncher",
    "_WorkerOutput",
    "_WrappingCheckpointIO",
    "_distributed_is_initialized",
    "_get_default_process_group_backend_for_device",
    "_init_dist_connection",
    "_optimizer_to_device",
    "_optimizers_to_device",
    "_sync_ddp_if_available",
    "_sync_module_states",
    "_trainer_call",
    "evaluate_under_no_grad",
    "is_overridden",
    "pl",
    "reset_seed",
]
