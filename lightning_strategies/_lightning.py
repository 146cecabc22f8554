"""The one module that imports Lightning, and the one that names Lightning's internals.

Every other module takes Lightning's names from here, public and private alike. Below the imports, each private
attribute, method or hook of Lightning that the package reads, patches or overrides is named once, in a small function
or constant with the reason it is needed: when Lightning renames one, what breaks is listed in this file
(``tests/test_private_names.py`` fails on a Lightning private name used anywhere else).

Which package the names come from depends on the copy of the code this module belongs to (see ``_flavour``):
``pytorch_lightning``/``lightning_fabric`` under ``lightning_strategies``, ``lightning.pytorch``/``lightning.fabric``
under ``lightning_strategies.lightning``. Type checkers see the ``pytorch_lightning`` names; both packages are
generated from the same source, so their signatures agree.
"""

from __future__ import annotations

import importlib
import inspect
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch
from torch.optim import Optimizer

from lightning_strategies.checkpoint.remote import keep_for_this_process

from ._flavour import flavour_of

FLAVOUR = flavour_of(__name__)


def _load(package: str, module: str, name: str) -> Any:
    return getattr(importlib.import_module(f"{package}.{module}"), name)


if TYPE_CHECKING:
    import pytorch_lightning as pl
    from lightning_fabric.plugins import CheckpointIO, ClusterEnvironment
    from lightning_fabric.strategies.registry import _StrategyRegistry
    from lightning_fabric.utilities.cloud_io import _load as _load_with_fsspec
    from lightning_fabric.utilities.cloud_io import get_filesystem
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
    from pytorch_lightning.plugins import LayerSync
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
    _load_with_fsspec = _load(_FABRIC, "utilities.cloud_io", "_load")
    get_filesystem = _load(_FABRIC, "utilities.cloud_io", "get_filesystem")
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
    LayerSync = _load(_PYTORCH, "plugins", "LayerSync")
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


# ------------------------------------------------------------------ Lightning's internals, each named once


def load_weights_only(load: Callable[..., dict[str, Any]], path: _PATH, **options: Any) -> dict[str, Any]:
    """Calls a ``CheckpointIO.load_checkpoint`` (bound method) with ``weights_only=True`` where it takes that argument.

    Lightning's plugins take ``weights_only`` from 2.5 on. Those of 2.4 have no such argument: they are called as
    Lightning 2.4 calls them and load as they do (its ``TorchCheckpointIO`` unpickles anything; this package's default
    plugin reads weights-only through :func:`load_file_weights_only` on every Lightning).
    """
    try:
        takes_weights_only = "weights_only" in inspect.signature(load).parameters
    except (TypeError, ValueError):  # a callable without a signature: called as Lightning 2.5+ calls it
        takes_weights_only = True
    if takes_weights_only:
        return load(path, weights_only=True, **options)
    return load(path, **options)


def autocast_caches_casts(plugin: Precision, device_type: str) -> bool:
    """Whether ``plugin``'s training steps run under a ``torch.autocast`` that caches its casts of parameters.

    Lightning's ``MixedPrecision`` autocasts with ``torch.autocast``'s default ``cache_enabled=True`` up to 2.5 and
    with ``cache_enabled=False`` from 2.6 on. With the cache, a leaf parameter used by several low-precision ops in a
    step is cast once, and the gradients of its uses are summed in low precision before the cast's backward; without
    it each use's gradient is cast to float32 before they are summed. Asked of the plugin itself (entering its
    training-step context once), so that a plugin that overrides its autocast is answered for as it runs.
    """
    with plugin.train_step_context():
        return torch.is_autocast_enabled(device_type) and torch.is_autocast_cache_enabled()


def load_file_weights_only(path: _PATH, map_location: Any) -> dict[str, Any]:
    """What ``TorchCheckpointIO.load_checkpoint(path, map_location, weights_only=True)`` does from Lightning 2.5 on, on
    every Lightning: 2.4's takes no ``weights_only`` and its loader defaults to ``weights_only=False``.

    Raises:
        FileNotFoundError: Nothing is at ``path`` (local or remote).
    """
    if not get_filesystem(path).exists(path):
        raise FileNotFoundError(f"Checkpoint file not found: {path}")
    loaded: dict[str, Any] = _load_with_fsspec(path, map_location=map_location, weights_only=True)
    return loaded


def join_background_writes(io: AsyncCheckpointIO) -> None:
    """Waits for the writes ``io`` runs in its background thread and leaves it able to write again.

    Raises:
        BaseException: The error of a write that failed, as ``io.teardown()`` raises it.
    """
    try:
        io.teardown()
    finally:
        # Lightning 2.5 and newer start a new writer at the next save (`_ensure_setup`); 2.4 makes its executor once in
        # `__init__`, and a save after `teardown` would fail with "cannot schedule new futures after shutdown".
        if not hasattr(io, "_ensure_setup"):
            io._executor = ThreadPoolExecutor(max_workers=1)


def evaluate_under_no_grad(trainer: pl.Trainer) -> None:
    """Runs the trainer's validation, test and predict loops under ``torch.no_grad()`` instead of inference mode.

    Lightning does this for its own ``FSDPStrategy`` only (torch FSDP cannot all-gather parameters inside
    ``torch.inference_mode()``, pytorch/pytorch#95957), and always under gloo, which is why CPU runs never show it.
    """
    for loop in (trainer.validate_loop, trainer.test_loop, trainer.predict_loop):  # fit's own runs under no_grad
        loop.inference_mode = False


#: Private methods of Lightning's classes that the package's classes override: Lightning offers no public hook there.
#: ``Strategy._configure_launcher`` picks the launcher (``DirectReferenceStrategy``: the subprocess launcher, or one
#: that hands canonical state back); the ``_MultiProcessingLauncher`` methods run a worker and hand its results back
#: (``CanonicalStateLauncher``). A test checks that Lightning still has each one.
OVERRIDDEN_PRIVATE_METHODS: dict[type[Any], tuple[str, ...]] = {
    Strategy: ("_configure_launcher",),
    _MultiProcessingLauncher: ("_wrapping_function", "_collect_rank_zero_results", "_recover_results_in_main_process"),
}

#: The attribute of the Trainer's signal connector holding SLURM's requeue handler, which ``RequeueAtStepBoundary``
#: shadows on the instance so that the requeue save waits for a step boundary.
REQUEUE_HANDLER_ATTRIBUTE = "_slurm_sigusr_handler_fn"


def trainer_of(module: pl.LightningModule) -> pl.Trainer | None:
    """The Trainer ``module`` is attached to, or ``None`` (``module.trainer`` raises when there is none)."""
    return module._trainer


def raw_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer a ``LightningOptimizer`` wraps (manual optimization hands those out); others as they are."""
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def set_device_mesh(module: pl.LightningModule, mesh: Any) -> None:
    """Gives ``module`` the device mesh its ``device_mesh`` property returns (read in ``configure_model``)."""
    module._device_mesh = mesh


def set_launcher(strategy: Strategy, launcher: Any) -> None:
    """Sets the launcher a strategy's ``_configure_launcher`` picked (``strategy.launcher`` reads it)."""
    strategy._launcher = launcher


def launched_strategy(launcher: _MultiProcessingLauncher) -> ParallelStrategy:
    """The strategy whose processes ``launcher`` starts."""
    return launcher._strategy


def given_checkpoint_io(strategy: Strategy) -> CheckpointIO | None:
    """The checkpoint IO plugin given to ``strategy`` (``None`` before one is given or made)."""
    return strategy._checkpoint_io


def set_checkpoint_io(strategy: Strategy, io: CheckpointIO) -> None:
    """Gives ``strategy`` its checkpoint IO plugin (what Lightning's setter does, also from a subclass's property)."""
    strategy._checkpoint_io = io


def given_precision_plugin(strategy: Strategy) -> Precision | None:
    """The precision plugin instance ``strategy`` owns, or ``None`` (``strategy.precision_plugin`` makes a new one)."""
    return strategy._precision_plugin


def layer_sync_of(strategy: ParallelStrategy) -> LayerSync | None:
    """The layer sync (e.g. ``SyncBatchNorm`` conversion) the Trainer gave ``strategy``, or ``None``."""
    return strategy._layer_sync


def checkpoint_connector(trainer: pl.Trainer) -> Any | None:
    """The Trainer's checkpoint connector, whose ``resume_start`` starts every restore (``None`` if it has none)."""
    return getattr(trainer, "_checkpoint_connector", None)


def dump_checkpoint(trainer: pl.Trainer, with_training_state: bool) -> dict[str, Any]:
    """The checkpoint ``trainer.save_checkpoint`` would write now, as a dict (every rank runs the dump's hooks).

    ``with_training_state=False`` is Lightning's ``weights_only`` dump: no optimizer, scheduler or loop state.
    """
    dumped: dict[str, Any] = trainer._checkpoint_connector.dump_checkpoint(not with_training_state)
    return dumped


def signal_connector(trainer: Any) -> Any | None:
    """The Trainer's signal connector (which holds SLURM's requeue handler), or ``None``."""
    return getattr(trainer, "_signal_connector", None)


def last_saved_checkpoint(callback: Any) -> str:
    """The path a ``ModelCheckpoint`` saved last (``""`` when none, or for other checkpoint callbacks)."""
    return str(getattr(callback, "_last_checkpoint_saved", "") or "")


def route_precision_plugin(
    plugin: Precision,
    clip_grad_by_norm: Callable[[Optimizer, int | float], None] | None,
    after_closure: Callable[[pl.LightningModule, Any], None] | None,
) -> None:
    """Makes the plugin instance a strategy owns call the strategy where Lightning offers strategies no hook.

    Args:
        plugin: The strategy's own precision plugin instance (the class and other instances are untouched).
        clip_grad_by_norm: Replaces the plugin's norm clipping (``None``: kept).
        after_closure: Replaces ``Precision._after_closure``, which runs ``on_before_optimizer_step`` and clips
            gradients after the closure (``None``: kept).
    """
    if clip_grad_by_norm is not None:
        vars(plugin)["clip_grad_by_norm"] = clip_grad_by_norm
    if after_closure is not None:
        vars(plugin)["_after_closure"] = after_closure


def unroute_precision_plugin(plugin: Precision) -> None:
    """Undoes :func:`route_precision_plugin`: the plugin's own methods again."""
    vars(plugin).pop("clip_grad_by_norm", None)
    vars(plugin).pop("_after_closure", None)


def call_before_optimizer_step_hooks(trainer: pl.Trainer, optimizer: Any) -> None:
    """Runs ``on_before_optimizer_step`` of the callbacks, then of the LightningModule, as ``_after_closure`` does."""
    _trainer_call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
    _trainer_call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)


def clip_gradients(plugin: Precision, model: pl.LightningModule, optimizer: Any, trainer: pl.Trainer) -> None:
    """Clips gradients with the Trainer's ``gradient_clip_val`` and ``gradient_clip_algorithm``, as
    ``_after_closure`` does."""
    plugin._clip_gradients(
        model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
    )


__all__ = [
    "FLAVOUR",
    "OVERRIDDEN_PRIVATE_METHODS",
    "REQUEUE_HANDLER_ATTRIBUTE",
    "_PATH",
    "AsyncCheckpointIO",
    "CheckpointIO",
    "ClusterEnvironment",
    "LRSchedulerConfig",
    "LayerSync",
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
    "autocast_caches_casts",
    "call_before_optimizer_step_hooks",
    "checkpoint_connector",
    "clip_gradients",
    "dump_checkpoint",
    "evaluate_under_no_grad",
    "given_checkpoint_io",
    "given_precision_plugin",
    "is_overridden",
    "join_background_writes",
    "last_saved_checkpoint",
    "launched_strategy",
    "layer_sync_of",
    "load_file_weights_only",
    "load_weights_only",
    "pl",
    "raw_optimizer",
    "reset_seed",
    "route_precision_plugin",
    "set_checkpoint_io",
    "set_device_mesh",
    "set_launcher",
    "signal_connector",
    "trainer_of",
    "unroute_precision_plugin",
]


def reopen_callback_filesystems(trainer: pl.Trainer) -> None:
    """In a forked worker: gives each callback that holds an fsspec filesystem (``ModelCheckpoint._fs``) a new one.

    An asynchronous filesystem such as ``s3fs`` opened in the main process refuses to work in a fork ("This class is
    not fork-safe"): its event loop belongs to the parent. ``ModelCheckpoint(dirpath="s3://...")`` opens one when it is
    built, so every fork fit that saves to a store needs a fresh one in the workers (upstream's ``ddp_fork`` too).
    """
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        filesystem = getattr(callback, "_fs", None)
        opened_in = getattr(filesystem, "_pid", None)
        if filesystem is None or opened_in is None or opened_in == os.getpid():
            continue
        rebuild, arguments = filesystem.__reduce__()  # fsspec's own recipe: the class and its storage options
        keep_for_this_process(filesystem)  # closing the parent's would close its connections in the parent too
        callback._fs = rebuild(*arguments)


class _LastCheckpointsAsUrls:
    """A ``ModelCheckpoint``'s ``_find_last_checkpoints`` for a ``dirpath`` on a store: Lightning's own listing, with
    each path made a URL a restore can read by ``to_urls`` (``ckpt_path="last"`` otherwise trained from scratch: the
    listing drops the scheme). A picklable callable, so that spawned workers get it with the callback."""

    def __init__(self, callback: Any, to_urls: Callable[[set[str], Callable[[str], str]], set[str]]) -> None:
        self.callback, self.to_urls = callback, to_urls

    def __call__(self, trainer: pl.Trainer) -> set[str]:
        found: set[str] = type(self.callback)._find_last_checkpoints(self.callback, trainer)
        return self.to_urls(found, self.callback._fs.unstrip_protocol)


def find_last_checkpoints_as_urls(callback: Any, to_urls: Callable[[set[str], Callable[[str], str]], set[str]]) -> None:
    """Makes ``callback`` (a ``ModelCheckpoint`` whose ``dirpath`` is a URL) name its ``last*.ckpt`` by URL (see
    :class:`_LastCheckpointsAsUrls`); on that one callback only, once."""
    if not isinstance(vars(callback).get("_find_last_checkpoints"), _LastCheckpointsAsUrls):
        callback._find_last_checkpoints = _LastCheckpointsAsUrls(callback, to_urls)
