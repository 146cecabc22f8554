"""The base every strategy of this package builds on: a direct reference to the LightningModule.

``connect(model)`` keeps ``model`` as ``self.lightning_module`` for the whole run, and ``self.model`` is the wrapper
built around it. Nothing here finds the module by unwrapping. Checkpoint state leaves through
``lightning_module_state_dict``/``optimizer_state`` in canonical form and enters through
``load_model_state_dict``/``load_optimizer_state_dict``, validated before anything changes. A subclass only says how
to wrap and how to read/write its sharded state; see ``docs/`` ("Writing your own strategy").
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import (
    FORMAT_VERSION,
    METADATA_KEY,
    CheckpointMetadata,
    canonical_keys,
    check_optimizer_states,
    load_model_state,
    param_group_shapes,
    read_checkpoint,
    require_full_checkpoint,
    to_cpu_state,
)
from lightning_strategies.checkpoint.atomic import raise_if_disk_full, replace_directory
from lightning_strategies.checkpoint.consolidation import consolidate
from lightning_strategies.checkpoint.errors import CheckpointFormatError
from lightning_strategies.checkpoint.optimizer_state import numbered_through_groups
from lightning_strategies.checkpoint.sharded import (
    ShardedCheckpoint,
    new_save_id,
    open_sharded,
    remove_stale_saves,
    sharded_directory,
    staging_directory,
    write_sharded_meta,
)
from lightning_strategies.checkpoint.training_state import holds_optimizer_state, resume_without_optimizer_state

from .._lightning import (
    _PATH,
    CheckpointIO,
    ClusterEnvironment,
    LightningOptimizer,
    ParallelStrategy,
    Precision,
    TBroadcast,
    TrainerFn,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _optimizer_to_device,
    _optimizers_to_device,
    _StrategyRegistry,
    _SubprocessScriptLauncher,
    _sync_ddp_if_available,
    _sync_module_states,
    _trainer_call,
    _WrappingCheckpointIO,
    evaluate_under_no_grad,
    is_overridden,
    pl,
    reset_seed,
)
from .agreement import (
    agree_on_resume_path,
    agree_on_sharded_save,
    forget_resume_path_check,
    options_fingerprint,
    refuse_unless_every_rank_fits,
    require_agreement,
    require_same_save_path,
)
from .async_saves import AsyncSaves
from .atomic_io import AtomicTorchCheckpointIO, finish_background_writes, synchronous_checkpoint_io
from .buffers import RankZeroBuffers
from .failures import (
    default_failure_timeout,
    leave_the_process_group_at_exit,
    leave_the_process_group_now,
    stop_started_ranks,
)
from .launcher import HAND_BACK_OPTIONS, CanonicalStateLauncher, HandBack
from .meta_init import has_meta_tensors, refuse_meta_tensors
from .precision import install_agreeing_scaler, remove_agreeing_scaler
from .redirection import ForwardRedirection
from .sharded_format import ShardedFormat
from .stops import (
    CheckpointRefusedError,
    RequeueAtStepBoundary,
    StopVerdict,
    agree_on_stop,
    last_checkpoints,
    refusal_message,
    stop_record,
)

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]
StateDictType = Literal["full", "sharded"]


class DirectReferenceStrategy(ParallelStrategy):
    """Multi-process strategy that wraps the LightningModule directly and never unwraps it.

    Subclasses set ``strategy_name`` and implement :meth:`configure_for_fit`; they override the ``_canonical_*`` and
    ``_load_*`` hooks where their wrapper shards state.

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
    #: ``"full"`` (one canonical file) or ``"sharded"`` (a directory in the format :meth:`sharded_format` describes);
    #: strategies that save sharded take it as an option (see :meth:`_checked_state_dict_type`).
    _state_dict_type: StateDictType = "full"

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
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicTorchCheckpointIO()
        elif isinstance(self._checkpoint_io, _WrappingCheckpointIO):
            # A wrapper given without the IO it wraps (`plugins=[AsyncCheckpointIO()]`) writes through ours (fsynced,
            # what killed saves left is removed), as the strategy does without it. A no-op when it wraps one.
            self._checkpoint_io.checkpoint_io = AtomicTorchCheckpointIO()
        return super().checkpoint_io

    @checkpoint_io.setter
    def checkpoint_io(self, io: CheckpointIO) -> None:
        self._checkpoint_io = io

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
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = CanonicalStateLauncher(self, self._start_method, source=self, hand_back=self._hand_back)

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
        if module is not None and module._trainer is not None:  # SLURM's requeue signal saves between steps
            self._requeue.install(module._trainer, getattr(self.cluster_environment, "auto_requeue", False) is True)

    # ------------------------------------------------------------------ failures: every rank goes down, none waits

    @property
    def failure_timeout(self) -> float:
        """Seconds the launching process of a failed run waits for the ranks it started before it kills them.

        Defaults to ``$LIGHTNING_STRATEGIES_FAILURE_TIMEOUT`` or 10. It bounds only the failure path: collectives keep
        the process-group ``timeout`` (long, so a slow gather of a large checkpoint is not mistaken for a failure).
        A rank that waits in a collective with this process is only released when this process ends (gloo keeps the
        connections of a destroyed group open while a wrapper still holds the group), so it is killed then.
        """
        return self._failure_timeout if self._failure_timeout is not None else default_failure_timeout()

    @failure_timeout.setter
    def failure_timeout(self, seconds: float) -> None:
        if not seconds > 0:
            raise ValueError(f"failure_timeout must be a positive number of seconds, got {seconds!r}.")
        self._failure_timeout = seconds

    @property
    def failed(self) -> bool:
        """Whether the current run ended with an exception in this process (then teardown runs no collective)."""
        return self._failed

    @override
    def on_exception(self, exception: BaseException) -> None:
        """Leaves the process group at once and stops the ranks this process started.

        A rank that raised must not enter another collective: its peers may wait in a different one, and gloo pairs
        them up wrongly or waits for the whole process-group timeout (the fairscale FSDP teardown gathered parameters
        and hung here). Once this process ends, every peer's pending or next collective fails at once ("Connection
        closed by peer"), so the peers raise and go down too; the ranks this process started (subprocess launcher)
        get ``failure_timeout`` seconds to end on their own and are killed after that.
        """
        super().on_exception(exception)
        if self._stopped_together(exception):
            return  # every rank stopped here: the group stays, and saves and teardown work as after a fit
        self._leave_after_failure()

    def _leave_after_failure(self) -> None:
        if self._failed:
            return
        self._failed = True
        leave_the_process_group_now()
        launcher = self._launcher
        children = list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []
        stop_started_ranks(children, self.failure_timeout, owner=type(self).__name__)

    def _stopped_together(self, exception: BaseException) -> bool:
        """Whether every rank stopped with ``exception`` at the same point (see :mod:`.stops`); decided once per run."""
        if self._stop_verdict is None:
            module = self.lightning_module
            trainer = module._trainer if module is not None else None
            step = trainer.global_step if trainer is not None else -1
            record = stop_record(exception, step, between_steps=self._inside_steps == 0)
            self._stop_verdict = agree_on_stop(record, self._stops)
            self._stops += 1
        return self._stop_verdict.together

    def require_save_possible(self) -> None:
        """Refuses a save that cannot be written whole, before any collective (every save starts here).

        After an exception a save goes ahead only when every rank stopped at the same point; otherwise, or when this
        process left the process group, or when it is the launching process of a fork/spawn run whose workers failed
        (it holds none of their state), :class:`~lightning_strategies.strategies.stops.CheckpointRefusedError` says
        why and where the last complete checkpoint is. A refusing rank leaves the process group at once, so that the
        ranks waiting for it in a collective go down instead of hanging.

        Raises:
            CheckpointRefusedError: The save cannot be written; nothing was.
        """
        launcher = self._launcher
        failed_workers = isinstance(launcher, CanonicalStateLauncher) and launcher.workers_failed
        if failed_workers and not _distributed_is_initialized():
            raise CheckpointRefusedError(
                refusal_message(
                    "the run failed in its worker processes, and this launching process holds none of their state (it"
                    " would save the weights it started with)",
                    [],
                    where="Resume from the last checkpoint the workers wrote (their ModelCheckpoint's dirpath).",
                )
            )
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if trainer is None or (not trainer.interrupted and not self._failed and self._stop_verdict is None):
            return  # no exception in this run: the common case costs nothing
        reason = ""
        if self._stop_verdict is None and trainer.interrupted and not self._failed:
            exception = sys.exc_info()[1]  # an on_exception hook (OnExceptionCheckpoint) runs inside Lightning's except
            if exception is not None and not self._stopped_together(exception):
                reason = self._stop_verdict.reason if self._stop_verdict is not None else ""
        elif self._stop_verdict is not None and not self._stop_verdict.together:
            reason = self._stop_verdict.reason
        elif self._failed:
            reason = "this process left the run's process group when the run failed"
        if not reason:
            return
        self._leave_after_failure()
        raise CheckpointRefusedError(refusal_message(reason, last_checkpoints(trainer)))

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
        if fitting and self._layer_sync is not None:
            self._layer_sync.apply(module)  # converts submodules in place, e.g. to SyncBatchNorm
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
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        if self.gradients_are_sharded and self._precision_plugin is not None:
            # Lightning clips through the precision plugin and offers strategies no hook for it. With sharded
            # gradients torch's clip_grad_norm_ would compute a different norm on every rank, so the plugin instance
            # this strategy owns routes norm clipping to the strategy until teardown.
            vars(self._precision_plugin)["clip_grad_by_norm"] = self.clip_grad_by_norm
            # Likewise each rank's loss scaler sees only its own gradients: under fp16 it would skip steps and
            # back off alone (and a rank that skips a sharded optimizer's step leaves the others in its broadcast).
            install_agreeing_scaler(self._precision_plugin)
        if self._precision_plugin is not None and self._completes_gradients():
            # Lightning calls `on_before_optimizer_step` (where its docs compute `grad_norm(self)`) from the plugin,
            # and offers strategies no hook around it: the plugin instance this strategy owns runs the hooks inside
            # `complete_gradients()` until teardown, and only when a hook is overridden (no collective otherwise).
            vars(self._precision_plugin)["_after_closure"] = self._after_closure

    def _completes_gradients(self) -> bool:
        return type(self).complete_gradients is not DirectReferenceStrategy.complete_gradients

    @contextmanager
    def complete_gradients(self) -> Generator[None, None, None]:
        """Within the block, the LightningModule's parameters hold their complete gradients on every rank, as in ddp.

        ``on_before_optimizer_step`` runs inside it when the LightningModule or a callback overrides that hook, so
        ``pytorch_lightning.utilities.grad_norm(self, norm_type)`` there logs what it logs under ``ddp``. Changes the
        block makes to gradients in place are kept. Every rank must enter it (it may run collectives). The default
        strategy holds whole gradients already and does nothing.
        """
        yield None

    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        """Replaces the precision plugin's ``_after_closure``: the same hooks and clipping, the hooks inside
        :meth:`complete_gradients` (clipping stays outside: it acts on the sharded gradients that step)."""
        trainer = model.trainer
        callbacks: list[pl.Callback] = getattr(trainer, "callbacks", [])
        hooked = is_overridden("on_before_optimizer_step", model, pl.LightningModule) or any(
            is_overridden("on_before_optimizer_step", callback, pl.Callback) for callback in callbacks
        )
        with self.complete_gradients() if hooked else nullcontext():
            _trainer_call._call_callback_hooks(trainer, "on_before_optimizer_step", optimizer)
            _trainer_call._call_lightning_module_hook(trainer, "on_before_optimizer_step", optimizer)
        self.precision_plugin._clip_gradients(
            model, optimizer, trainer.gradient_clip_val, gradient_clip_algorithm=trainer.gradient_clip_algorithm
        )

    @property
    def gradients_are_sharded(self) -> bool:
        """Whether each rank holds only part of the gradients after backward (then norms need a collective)."""
        return False

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        """Clips gradients by their total norm across all ranks; used when ``gradients_are_sharded``.

        Args:
            optimizer: The optimizer whose parameters' gradients are clipped.
            clip_val: The maximum total norm.
        """
        raise NotImplementedError(f"{type(self).__name__} shards gradients and must implement clip_grad_by_norm().")

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
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if isinstance(self._launcher, CanonicalStateLauncher) and trainer is not None:
            self._launcher.capture_end_of_fit(trainer)  # while the wrapper can still gather
        if trainer is not None:  # a run that ended before the Trainer restored anything
            forget_resume_path_check(trainer)
        if self._precision_plugin is not None:
            vars(self._precision_plugin).pop("clip_grad_by_norm", None)
            remove_agreeing_scaler(self._precision_plugin)
            vars(self._precision_plugin).pop("_after_closure", None)
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

    # ------------------------------------------------------------------ state out: canonical, rank 0 only

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The model state a checkpoint holds: by default :meth:`full_model_state`."""
        self.require_save_possible()  # the first thing a save asks for: before any of its collectives
        if self._saves_sharded:  # every rank keeps its own part: no gather
            return self._require_sharded_format().model_state()
        return self.full_model_state()

    def full_model_state(self) -> dict[str, Any]:
        """Canonical model state on global rank 0 (the unwrapped module's keys, full CPU tensors); ``{}`` elsewhere.

        Every rank must call it: subclasses may gather with collectives. Submodules compiled with ``torch.compile``
        add no ``_orig_mod`` segment: the keys are the uncompiled module's (see ``checkpoint.canonical_keys``).
        """
        state = self._canonical_model_state()
        return canonical_keys(state) if self.is_global_zero else {}

    def _canonical_model_state(self) -> dict[str, Any]:
        """Hook: the canonical model state on rank 0. Default: the module holds whole tensors, read them directly."""
        if not self.is_global_zero:
            return {}
        return to_cpu_state(self.require_lightning_module().state_dict())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Canonical optimizer state (torch's integer-keyed layout over the whole model) on rank 0; ``{}`` elsewhere.

        Every rank must call it: sharded optimizers gather with collectives.
        """
        raw = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
        if self._saves_sharded:
            return self._require_sharded_format().optimizer_state(raw)
        state = self._canonical_optimizer_state(raw)
        return state if self.is_global_zero else {}

    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Hook: canonical state of one optimizer on rank 0. Default: a plain optimizer is already canonical."""
        return optimizer.state_dict() if self.is_global_zero else {}

    def checkpoint_metadata(self) -> CheckpointMetadata:
        """The ``checkpoint["lightning_strategies"]`` block this strategy writes."""
        return CheckpointMetadata(
            format_version=FORMAT_VERSION,
            strategy=self.strategy_name,
            world_size=self.world_size,
            state_dict_type=self._state_dict_type,
        )

    # ------------------------------------------------------------------ the sharded format

    def sharded_format(self) -> ShardedFormat | None:
        """Hook: a new :class:`ShardedFormat` describing this strategy's sharded directories; ``None`` (the default)
        when it writes none. Directories it does not read in place (and every directory, with ``None``) are
        consolidated and loaded as full checkpoints."""
        return None

    @staticmethod
    def _checked_state_dict_type(state_dict_type: str) -> StateDictType:
        """``state_dict_type`` as given to a strategy's constructor, checked.

        Raises:
            ValueError: Neither ``"full"`` nor ``"sharded"``.
        """
        if state_dict_type == "full":
            return "full"
        if state_dict_type == "sharded":
            return "sharded"
        raise ValueError(f"state_dict_type must be 'full' or 'sharded', got {state_dict_type!r}.")

    @property
    def _saves_sharded(self) -> bool:
        return self._state_dict_type == "sharded"

    def _require_sharded_format(self) -> ShardedFormat:
        sharded = self.sharded_format()
        if sharded is None:
            raise NotImplementedError(
                f"{type(self).__name__} has state_dict_type='sharded' but describes no sharded format: implement"
                " sharded_format(), or save with state_dict_type='full'."
            )
        return sharded

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        if self._async_saves.save(checkpoint, filepath, storage_options):
            return  # its files are written in the background; committed when the ranks next meet
        if self._saves_sharded:
            sharded = self._require_sharded_format()
            directory = Path(filepath)
            write = partial(sharded.write, checkpoint, directory)
            self.save_sharded(checkpoint, directory, write, collective_write=sharded.collective_write)
            return
        require_same_save_path(filepath)  # a rank's different path would be silently ignored
        if isinstance(self._launcher, CanonicalStateLauncher):  # the main process after a fork/spawn fit
            checkpoint = self._launcher.complete_checkpoint(checkpoint)
        if self.is_global_zero:
            stamped = {**checkpoint, METADATA_KEY: self.checkpoint_metadata().to_dict()}
            self.checkpoint_io.save_checkpoint(stamped, filepath, storage_options=storage_options)

    @property
    def sharded_checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO that writes the files of a sharded directory: ``checkpoint_io`` without
        ``AsyncCheckpointIO`` (the directory is swapped in right after the writes, so they must be done then)."""
        return synchronous_checkpoint_io(self.checkpoint_io)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Removes a checkpoint (``ModelCheckpoint`` removes the ones it no longer keeps) on global rank 0.

        A checkpoint that is not there yet may still be written by ``AsyncCheckpointIO`` in the background (saves
        are atomic: the path appears when its write is done); the removal waits for that write, which would
        otherwise put it there afterwards. While an asynchronous save (``async_save=True``) is pending, the removal
        waits until that save is committed: an old checkpoint goes only once the new one is complete.
        """
        if self._async_saves.defer_removal(partial(self.remove_checkpoint, filepath)):
            return  # removed once the pending asynchronous save is complete
        if self.is_global_zero and ("://" in str(filepath) or not os.path.lexists(filepath)):
            finish_background_writes(self.checkpoint_io)
        super().remove_checkpoint(filepath)

    def save_sharded(
        self,
        checkpoint: dict[str, Any],
        directory: Path,
        write_shards: Callable[[Path, str], None],
        *,
        collective_write: bool = False,
    ) -> None:
        """Writes a sharded checkpoint directory atomically: the previous save stays until this one is whole.

        The ranks check that they save to the same directory and take rank 0's save id (one all-gather); every rank
        writes its shards (stamped with the id and its rank) into a sibling staging directory; rank 0 adds
        ``meta.pt`` and swaps the staging directory in (an atomic exchange on Linux). A failure or a kill at any
        point leaves the previous complete checkpoint at ``directory``; a full disk is reported as
        :class:`~lightning_strategies.checkpoint.atomic.DiskFullError`.

        Args:
            checkpoint: What Lightning dumped; its state entries are the ranks' shards.
            directory: The checkpoint directory.
            write_shards: Writes this rank's shards into the staging directory it is given, stamped with the save id
                it is given (a collective for some formats).
            collective_write: ``write_shards`` returns on rank 0 only once every rank's shards are written
                (``torch.distributed.checkpoint.save`` does: its last step gathers every rank's write results), so
                rank 0 needs no barrier before it swaps the directory in.

        Raises:
            BaseException: A write failed, or (with ``AsyncCheckpointIO``) an earlier background write had failed.
        """
        # Shards in different directories: none of them complete.
        save_id = agree_on_sharded_save(directory, new_save_id())
        staging = staging_directory(directory, save_id)
        if self.is_global_zero:
            remove_stale_saves(directory, keep=staging)
        staging.mkdir(parents=True, exist_ok=True)  # by every rank: none waits for another before writing
        try:
            write_shards(staging, save_id)
            # With AsyncCheckpointIO: an earlier background write's error is raised by this save (as the plugin's own
            # next save would raise it), and the writes of a plugin below another wrapper are done before the swap.
            finish_background_writes(self.checkpoint_io)
            if not collective_write:
                self.barrier("sharded checkpoint shards written")
            if self.is_global_zero:
                meta_io = self.sharded_checkpoint_io
                write_sharded_meta(meta_io, checkpoint, self.checkpoint_metadata(), staging, save_id)
                finish_background_writes(meta_io)
                replace_directory(staging, directory, save_id)
        except BaseException as error:
            if self.is_global_zero:
                shutil.rmtree(staging, ignore_errors=True)
            raise_if_disk_full(error, directory)
            raise
        self.barrier("sharded checkpoint complete")

    # ------------------------------------------------------------------ state in: validated, then loaded

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        # Restore into the wrapped model, after the optimizers exist: a checkpoint whose optimizer states do not fit
        # is then refused before the model's weights are touched.
        return True

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        self._sharded_reader = None
        directory = sharded_directory(checkpoint_path)
        if directory is not None:
            sharded = open_sharded(directory)
            reader = self.sharded_format()
            if reader is None or not reader.reads_in_place(sharded):
                return self._load_consolidated(sharded)
            self._checkpoint_source = sharded.source
            opened = reader.open(sharded)
            self._sharded_reader = reader
            return opened
        # Checkpoints never run code when loaded: weights_only is always True.
        self._checkpoint_source = f"Checkpoint {str(checkpoint_path)!r}"
        checkpoint = read_checkpoint(
            checkpoint_path, load=lambda: self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=True)
        )
        require_full_checkpoint(checkpoint, source=self._checkpoint_source)
        states = checkpoint.get("optimizer_states")
        if isinstance(states, list):  # upstream's full files number parameters in the module's order
            checkpoint["optimizer_states"] = [numbered_through_groups(state) for state in states]
        return checkpoint

    def _load_consolidated(self, sharded: ShardedCheckpoint) -> dict[str, Any]:
        """A sharded directory this strategy does not read in place (another strategy's, upstream Lightning's):
        every rank builds the full canonical checkpoint in memory, as ``lightning-strategies consolidate`` would."""
        self._checkpoint_source = (
            f"{sharded.source} (written by {sharded.metadata.strategy} at world size {sharded.world_size})"
        )
        return consolidate(sharded).checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        # Sharded parameters (DTensors) are neither read nor written inside `torch.inference_mode()`, where
        # `trainer.test(ckpt_path=...)` restores: every restore runs outside it.
        with torch.inference_mode(False):
            if self._sharded_reader is not None:
                self._load_sharded_model_state(self._sharded_reader, checkpoint, strict)
            else:
                self._load_full_model_state(checkpoint, strict)

    def _load_sharded_model_state(self, reader: ShardedFormat, checkpoint: Mapping[str, Any], strict: bool) -> None:
        # Every rank checks its part (and the optimizer states it will restore); the ranks agree before any weight
        # changes, so a part that does not fit on one rank leaves every rank's weights as they were.
        refuse_unless_every_rank_fits(
            reader.problem(checkpoint, strict, self._restoring_sharded_optimizer_states(checkpoint))
        )
        if not reader.holds_optimizer_states(checkpoint):
            self._resume_without_optimizer_state(checkpoint)  # one warning; the optimizers start fresh
        reader.load_model(checkpoint, strict)

    def _load_full_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        source = self._checkpoint_source
        require_full_checkpoint(checkpoint, source=source)
        if "state_dict" not in checkpoint:
            raise CheckpointFormatError(f"{source} has no 'state_dict' (keys: {', '.join(sorted(checkpoint))}).")
        trainer = self.require_lightning_module()._trainer
        if trainer is not None and self._restoring_optimizers(trainer):
            if holds_optimizer_state(checkpoint):
                # Refuse a checkpoint whose optimizer states do not fit *before* changing the weights.
                self._check_optimizer_states(checkpoint["optimizer_states"])
            else:
                self._resume_without_optimizer_state(checkpoint)
        state = checkpoint["state_dict"]
        if isinstance(state, Mapping):  # older files (and upstream's) hold compiled submodules' `_orig_mod` keys
            state = canonical_keys(state)
        self._load_canonical_model_state(state, strict=strict)

    def _resume_without_optimizer_state(self, checkpoint: Mapping[str, Any]) -> None:
        """A fit restores a checkpoint that holds no optimizer state (weights-only, full file or sharded directory):
        one warning naming what is not restored; the optimizers and LR schedulers start fresh. Elsewhere nothing."""
        trainer = self.require_lightning_module()._trainer
        if trainer is None or not self._restoring_optimizers(trainer):
            return
        schedulers = [type(config.scheduler).__name__ for config in trainer.lr_scheduler_configs]
        resume_without_optimizer_state(checkpoint, len(self.optimizers), schedulers, self._checkpoint_source)

    def _restoring_optimizers(self, trainer: pl.Trainer) -> bool:
        return trainer.state.fn == TrainerFn.FITTING and self.lightning_restore_optimizer

    def _restoring_sharded_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        """Whether a sharded load restores the optimizer states it holds (the Trainer fits and restores them)."""
        trainer = self.require_lightning_module()._trainer
        reader = self._sharded_reader
        holds = reader.holds_optimizer_states(checkpoint) if reader is not None else "optimizer_states" in checkpoint
        return trainer is not None and self._restoring_optimizers(trainer) and holds

    def _load_canonical_model_state(self, state: Mapping[str, Any], strict: bool) -> None:
        """Hook: puts canonical model state into the (wrapped) model. Default: the module holds whole tensors."""
        load_model_state(self.require_lightning_module(), state, strict=strict, source=self._checkpoint_source)

    def _canonical_param_shapes(self, optimizer: Optimizer) -> list[list[torch.Size]]:
        """Hook: canonical shapes of each param group's parameters. Default: the optimizer's own parameters."""
        return param_group_shapes(optimizer)

    def _raw_optimizers(self) -> list[Optimizer]:
        return [opt._optimizer if isinstance(opt, LightningOptimizer) else opt for opt in self.optimizers]

    def _check_optimizer_states(self, states: Any) -> None:
        optimizers = self._raw_optimizers()
        shapes = [self._canonical_param_shapes(optimizer) for optimizer in optimizers]
        check_optimizer_states(states, optimizers, shapes, source=self._checkpoint_source)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        with torch.inference_mode(False):
            reader, self._sharded_reader = self._sharded_reader, None  # the restore ends here
            if reader is None:
                self._load_full_optimizer_states(checkpoint)
            elif reader.holds_optimizer_states(checkpoint):  # else the optimizers start fresh (warned about)
                reader.load_optimizers(checkpoint)

    def _load_full_optimizer_states(self, checkpoint: Mapping[str, Any]) -> None:
        states = checkpoint["optimizer_states"]
        if not holds_optimizer_state(checkpoint):
            return  # warned about in load_model_state_dict: the optimizers start fresh
        self._check_optimizer_states(states)
        for optimizer, state in zip(self._raw_optimizers(), states, strict=True):
            self._load_canonical_optimizer_state(optimizer, state)
            _optimizer_to_device(optimizer, self.root_device)

    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        """Hook: puts one canonical optimizer state into the (possibly sharded) optimizer."""
        optimizer.load_state_dict(dict(state))

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
