"""The base every strategy of this package builds on: a direct reference to the LightningModule.

``connect(model)`` keeps ``model`` as ``self.lightning_module`` for the whole run, and ``self.model`` is the wrapper
built around it. Nothing here finds the module by unwrapping. Checkpoint state leaves through
``lightning_module_state_dict``/``optimizer_state`` in canonical form and enters through
``load_model_state_dict``/``load_optimizer_state_dict``, validated before anything changes. A subclass only says how
to wrap and how to read/write its sharded state; see ``docs/`` ("Writing your own strategy").

This module holds the processes, the wrapping and the steps; the class also inherits the checkpoint flow
(``checkpointing``), the precision-plugin routing (``precision``) and failure handling (``failures``).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, ClassVar, Literal

import torch
import torch.distributed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from .._lightning import (
    CheckpointIO,
    ClusterEnvironment,
    Precision,
    TBroadcast,
    TrainerFn,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _optimizers_to_device,
    _StrategyRegistry,
    _sync_ddp_if_available,
    _sync_module_states,
    _WrappingCheckpointIO,
    evaluate_under_no_grad,
    given_checkpoint_io,
    layer_sync_of,
    pl,
    reset_seed,
    set_checkpoint_io,
    set_launcher,
    trainer_of,
)
from .agreement import agree_on_resume_path, forget_resume_path_check, options_fingerprint, require_agreement
from .async_saves import AsyncSaves
from .atomic_io import AtomicTorchCheckpointIO
from .buffers import RankZeroBuffers
from .checkpointing import CheckpointFlow, StateDictType
from .failures import FailureHandling, leave_the_process_group_at_exit
from .launcher import HAND_BACK_OPTIONS, CanonicalStateLauncher, HandBack, StoreAwareScriptLauncher
from .meta_init import has_meta_tensors, refuse_meta_tensors
from .precision import GradientRouting
from .redirection import ForwardRedirection
from .sharded_format import ShardedFormat
from .stops import RequeueAtStepBoundary, StopVerdict
from .store_saves import Downloads

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

__all__ = ["DirectReferenceStrategy", "StartMethod", "StateDictType"]


class DirectReferenceStrategy(FailureHandling, GradientRouting, CheckpointFlow):
    """Multi-process strategy that wraps the LightningModule directly and never unwraps it.

    Subclasses set ``strategy_name`` and implement :meth:`configure_for_fit`; they override the ``_canonical_*`` and
    ``_load_*`` hooks where their wrapper shards state. Three parts live in modules of their own and are inherited:
    the checkpoint flow (:class:`~.checkpointing.CheckpointFlow`), what runs through the precision plugin
    (:class:`~.precision.GradientRouting`) and the handling of failures and stops (:class:`~.failures.FailureHandling`).

    Args:
        accelerator: The accelerator (set by the Trainer when omitted).
        parallel_devices: Devices of this node (set by the Trainer when omitted).
        cluster_environment: Cluster environment (set by the Trainer when omitted).
        checkpoint_io: Checkpoint IO plugin.
        precision_plugin: Precision plugin.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        timeout: Timeout of collective operations.
        start_method: ``"popen"`` (one script per rank), ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        hand_back: What a fork/spawn fit hands back to the main process: ``"checkpoint"`` (everything
            ``trainer.save_checkpoint`` needs there, costing one canonical copy of the optimizer states in the main
            process) or ``"weights"`` (the weights only, as upstream).
        async_save: Write checkpoints in a background thread while training goes on: only gathering (full files) or
            copying this rank's shards to the CPU (sharded directories) blocks the step; the save is committed when
            the ranks next meet (the next save, the end of ``fit``, ``teardown``). See :mod:`.async_saves`.
    """

    #: Registry name, also written into each checkpoint's metadata block.
    strategy_name: ClassVar[str] = "direct_reference"
    #: Whether steps broadcast rank 0's changing buffers first (see :class:`RankZeroBuffers`); set by subclasses
    #: whose wrapper does not.
    _broadcast_buffers: bool = False
    #: Whether setup gives meta-device tensors memory (after sharding); strategies that cannot refuse them.
    _materialises_meta_tensors: ClassVar[bool] = False
    # False where the wrapper cannot gather parameters inside `torch.inference_mode()` (torch FSDP): the evaluation
    # loops then run under `torch.no_grad()`, as Lightning does for its FSDPStrategy.
    _evaluates_in_inference_mode: ClassVar[bool] = True

    def __init__(
        self,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: StartMethod = "popen",
        hand_back: HandBack = "checkpoint",
        async_save: bool = False,
    ) -> None:
        if hand_back not in HAND_BACK_OPTIONS:
            raise ValueError(f"hand_back must be one of {', '.join(map(repr, HAND_BACK_OPTIONS))}, got {hand_back!r}.")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._redirect = ForwardRedirection()
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method: StartMethod = start_method
        self._hand_back: HandBack = hand_back
        self._async_save = async_save
        self._async_saves = AsyncSaves(self)
        self._checkpoint_source = "the checkpoint"
        self._sharded_reader: ShardedFormat | None = None  # the format restoring the directory being loaded
        self._store_downloads = Downloads()  # local copies of stored sharded saves being restored
        self._resumed_store_save: tuple[str, str] | None = None
        self._failure_timeout: float | None = None
        self._failed = False
        self._stop_verdict: StopVerdict | None = None
        self._stops = 0
        self._inside_steps = 0  # > 0 inside a *_step or an optimizer step; stays > 0 when one raised
        self._requeue = RequeueAtStepBoundary()
        self._rank_zero_buffers = RankZeroBuffers(enabled=self._broadcast_buffers)

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO plugin; by default one whose local saves are atomic (never a torn file)."""
        given = given_checkpoint_io(self)
        if given is None:
            set_checkpoint_io(self, AtomicTorchCheckpointIO())
        elif isinstance(given, _WrappingCheckpointIO):
            # A wrapper given without the IO it wraps (`plugins=[AsyncCheckpointIO()]`) writes through ours (fsynced,
            # what killed saves left is removed), as the strategy does without it. A no-op when it wraps one.
            given.checkpoint_io = AtomicTorchCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        set_checkpoint_io(self, io)

    # ------------------------------------------------------------------ the direct reference

    def require_lightning_module(self) -> pl.LightningModule:
        """Returns the LightningModule passed to the Trainer.

        Raises:
            RuntimeError: The strategy is used outside a Trainer run (no module connected yet).
        """
        module = self.lightning_module
        if module is None:
            raise RuntimeError(
                f"{type(self).__name__} has no LightningModule yet; the Trainer connects it in fit, validate, test"
                " and predict."
            )
        return module

    # ------------------------------------------------------------------ processes and collectives

    @property
    @override
    def root_device(self) -> torch.device:
        devices = self.parallel_devices
        if not devices:
            raise RuntimeError(f"{type(self).__name__} has no devices; pass it to a Trainer before use.")
        return devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Number of nodes taking part in training."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Number of processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Always ``True``: tells the Trainer to add a ``DistributedSampler``."""
        return True

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def process_group_backend(self) -> str | None:
        """The ``torch.distributed`` backend in use (``None`` before setup)."""
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        if self.cluster_environment is None:
            raise RuntimeError(f"{type(self).__name__} needs a cluster environment; pass it to a Trainer before use.")
        if self._start_method == "popen":
            set_launcher(self, StoreAwareScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes))
        else:
            set_launcher(self, CanonicalStateLauncher(self, self._start_method, source=self, hand_back=self._hand_back))

    @override
    def setup_environment(self) -> None:
        self._failed = False
        self._stop_verdict = None
        self._inside_steps = 0
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        if self._process_group_backend is None:
            self._process_group_backend = _get_default_process_group_backend_for_device(self.root_device)
        if self.cluster_environment is None:
            raise RuntimeError(f"{type(self).__name__} needs a cluster environment; pass it to a Trainer before use.")
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )
        leave_the_process_group_at_exit()
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        if trainer is not None:  # SLURM's requeue signal saves between steps
            self._requeue.install(trainer, getattr(self.cluster_environment, "auto_requeue", False) is True)

    # ------------------------------------------------------------------ ranks must agree

    def options_fingerprint(self) -> dict[str, Any]:
        """What every rank's strategy must agree on: its class and every option that has a value to compare.

        Plain values, dtypes, devices, enums, classes, dataclasses (fsdp2's ``MixedPrecisionPolicy``) and containers
        of these are compared by value; objects without one (modules, process groups, plugins) are left out.
        """
        return options_fingerprint(self, self.precision_plugin)

    def require_agreement(self, values: Mapping[str, Any], what: str, fix: str) -> None:
        """Checks that every rank passes the same ``values`` (a collective: every rank must call it).

        Args:
            values: This rank's values, by name.
            what: What they are, for the error message.
            fix: How to make them agree, for the error message.

        Raises:
            RanksDisagreeError: On every rank, naming each value that differs from rank 0's and the ranks involved.
        """
        require_agreement(values, what, fix)

    def set_world_ranks(self) -> None:
        """Derives global rank and world size from node rank, local rank and the process count."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # The one `rank_zero_only` that Lightning, Fabric and lightning_utilities share reads its rank from here.
        vars(utils_rank_zero_only)["rank"] = self.global_rank

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: TBroadcast, src: int = 0) -> TBroadcast:
        if not _distributed_is_initialized():
            return obj
        container = [obj]
        torch.distributed.broadcast_object_list(container, src)
        return container[0]

    @override
    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    @override
    def model_to_device(self) -> None:
        self.require_lightning_module().to(self.root_device)

    # ------------------------------------------------------------------ wrapping

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        if self.accelerator is None:
            raise RuntimeError(f"{type(self).__name__} has no accelerator; pass it to a Trainer before use.")
        if not self._materialises_meta_tensors:  # every rank alike, before any collective
            refuse_meta_tensors(self.require_lightning_module(), self.strategy_name)
        # Before wrapping: different options (say, another state_dict_type) would make the ranks wrap and shard
        # differently, and their collectives would never meet.
        self.require_agreement(
            self.options_fingerprint(), "the strategy's options", "configure the strategy the same way"
        )
        agree_on_resume_path(trainer, self.require_agreement, then=self.before_restore)
        self.accelerator.setup(trainer)
        if not self._evaluates_in_inference_mode:
            evaluate_under_no_grad(trainer)
        module = self.require_lightning_module()
        fitting = trainer.state.fn == TrainerFn.FITTING
        layer_sync = layer_sync_of(self)
        if fitting and layer_sync is not None:
            layer_sync.apply(module)  # converts submodules in place, e.g. to SyncBatchNorm
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        if fitting:
            # Strategies whose wrapper keeps each rank's own buffers set `_broadcast_buffers` (ddp's semantics).
            self._rank_zero_buffers = RankZeroBuffers(enabled=self._broadcast_buffers)
            self.configure_for_fit(trainer)
        else:
            self.configure_for_evaluation(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def before_restore(self, checkpoint_path: str | None) -> None:
        """Hook: runs on every rank after setup, before the Trainer restores ``checkpoint_path`` (``None``: nothing).

        Args:
            checkpoint_path: The checkpoint every rank agreed to restore, or ``None``.
        """

    def configure_for_fit(self, trainer: pl.Trainer) -> None:
        """Wraps ``self.lightning_module`` into ``self.model`` and creates ``self.optimizers``.

        Call ``self.setup_optimizers(trainer)`` at the point where the module's parameters are the ones that train
        (after wrapping, for wrappers that replace parameters).

        Args:
            trainer: The Trainer that is fitting.
        """
        raise NotImplementedError(f"{type(self).__name__} must implement configure_for_fit().")

    def configure_for_evaluation(self, trainer: pl.Trainer) -> None:
        """Prepares validate/test/predict without fit. Default: no wrapper, every rank gets rank 0's weights.

        Args:
            trainer: The Trainer that is evaluating or predicting.
        """
        _sync_module_states(self.require_lightning_module())

    @override
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self._requeue.at_step_boundary(self.root_device)

    @override
    def on_train_start(self) -> None:
        if self._async_save:
            self._async_saves.open()  # saves from here to on_train_end run in the background
        super().on_train_start()

    @override
    def on_train_end(self) -> None:
        self._async_saves.end_of_training()  # the pending asynchronous save is committed, or its error raised
        super().on_train_end()

    @override
    def teardown(self) -> None:
        try:  # while the ranks are together: commits the pending asynchronous save (after a failure: drops it)
            self._async_saves.close(self._failed, self.failure_timeout)
        finally:
            self._release_after_run()

    def _release_after_run(self) -> None:
        self._requeue.remove()
        self._store_downloads.clear()
        module = self.lightning_module
        trainer = trainer_of(module) if module is not None else None
        if isinstance(self.launcher, CanonicalStateLauncher) and trainer is not None:
            self.launcher.capture_end_of_fit(trainer)  # while the wrapper can still gather
        if trainer is not None:  # a run that ended before the Trainer restored anything
            forget_resume_path_check(trainer)
        self._give_back_precision_plugin()
        if module is not None:
            self.model = module  # drop the wrapper; the direct reference is all that is left
        if module is None or not has_meta_tensors(module):
            super().teardown()
            return
        # Lightning's teardown moves the module to the CPU. A meta module (refused in setup, or in the launching
        # process of a run that failed before handing weights back) cannot move, and that error would hide the run's
        # own: it stays where it is.
        vars(module)["cpu"] = lambda: module
        try:
            super().teardown()
        finally:
            del vars(module)["cpu"]

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Skips gradient synchronisation while accumulating; the default wrapper has nothing to skip."""
        yield None

    @contextmanager
    def full_parameters(self) -> Generator[None, None, None]:
        """Inside, the LightningModule's parameter attributes hold the full parameters on every rank.

        For reading parameters in hooks and callbacks (``self.head.weight.norm()`` in ``on_train_batch_end``) under
        any strategy. Every rank must enter it, outside forward and backward. Strategies whose module keeps its
        parameters whole need nothing; ``fsdp_fairscale`` gathers its flattened parameters here.
        """
        yield None

    # ------------------------------------------------------------------ steps go through the wrapper

    def _step(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        module = self.require_lightning_module()
        training = method_name == "training_step"
        self._inside_steps += 1  # not undone when the step raises: a stop there is a stop mid-step
        self._rank_zero_buffers.before_step(module, training)
        output = self._run_step(method_name, *args, **kwargs)
        self._rank_zero_buffers.after_step(module, training)
        self._inside_steps -= 1
        return output

    @override
    def optimizer_step(
        self, optimizer: Optimizer, closure: Callable[[], Any], model: Any | None = None, **kwargs: Any
    ) -> Any:
        self._inside_steps += 1  # backward and the update run in here: a stop inside leaves state mid-update
        result = super().optimizer_step(optimizer, closure, model, **kwargs)
        self._inside_steps -= 1
        return result

    def _run_step(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Hook: runs one ``*_step`` of the LightningModule. Default: through the wrapper, by forward redirection."""
        module = self.require_lightning_module()
        wrapper = self.model
        if wrapper is None or wrapper is module:
            return getattr(module, method_name)(*args, **kwargs)
        # After validation Lightning restores train mode on the LightningModule's submodules only; the wrapper around
        # it would stay in eval mode, and ShardedDataParallel, for one, then silently stops reducing gradients. The
        # wrapper's own flag follows the module's (its children are the module's own).
        wrapper.training = module.training
        return self._redirect(wrapper, module, method_name, *args, **kwargs)

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._step("training_step", *args, **kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._step("validation_step", *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._step("test_step", *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._step("predict_step", *args, **kwargs)

    # ------------------------------------------------------------------ registry

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``<strategy_name>``, ``<strategy_name>_spawn`` and ``<strategy_name>_fork``."""
        for suffix, start_method in (("", "popen"), ("_spawn", "spawn"), ("_fork", "fork")):
            strategy_registry.register(
                cls.strategy_name + suffix,
                cls,
                description=f"{cls.__name__} with start_method={start_method!r}",
                override=True,
                start_method=start_method,
            )
