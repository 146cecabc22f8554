"""The base every strategy of this package builds on: a direct reference to the LightningModule.

``connect(model)`` keeps ``model`` as ``self.lightning_module`` for the whole run, and ``self.model`` is the wrapper
built around it. Nothing here finds the module by unwrapping. Checkpoint state leaves through
``lightning_module_state_dict``/``optimizer_state`` in canonical form and enters through
``load_model_state_dict``/``load_optimizer_state_dict``, validated before anything changes. A subclass only says how
to wrap and how to read/write its sharded state; see ``docs/`` ("Writing your own strategy").
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import time
from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
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
    check_optimizer_states,
    load_model_state,
    param_group_shapes,
    read_checkpoint,
    require_full_checkpoint,
    to_cpu_state,
)
from lightning_strategies.checkpoint.errors import CheckpointFormatError
from lightning_strategies.checkpoint.sharded import SHARDED_META_FILE, write_sharded_meta

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
    pl,
    reset_seed,
)
from .atomic_io import AtomicTorchCheckpointIO
from .launcher import CanonicalStateLauncher
from .redirection import ForwardRedirection

StartMethod = Literal["popen", "spawn", "fork", "forkserver"]

#: Environment variable that sets the default ``failure_timeout`` (seconds) of every strategy of this package.
FAILURE_TIMEOUT_ENV = "LIGHTNING_STRATEGIES_FAILURE_TIMEOUT"
DEFAULT_FAILURE_TIMEOUT = 10.0


_leaving_at_exit = False


def _leave_the_process_group_at_exit() -> None:
    """Destroys the default process group when the interpreter exits, before C++ statics are torn down.

    A process that ends with its gloo process group alive (a spawned worker, or the user's script after ``fit``)
    aborted now and then at exit ("terminate called without an active exception", SIGABRT): the group's threads
    were still joinable when their objects were destroyed. Leaving the group from ``atexit`` joins them in order.
    """
    global _leaving_at_exit
    if _leaving_at_exit:
        return
    _leaving_at_exit = True

    def leave() -> None:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    atexit.register(leave)


class RanksDisagreeError(RuntimeError):
    """The processes of one run were given different settings (strategy options, checkpoint paths).

    Raised on every rank, before the disagreement could pair up mismatched collectives (a deadlock).
    """


# Attributes that hold run state, not options: they may differ between processes without harm.
_RUN_STATE = frozenset({"_checkpoint_source", "_failure_timeout", "_failed", "_final_model_state"})


def default_failure_timeout() -> float:
    """``$LIGHTNING_STRATEGIES_FAILURE_TIMEOUT`` in seconds if set, else 10.

    Raises:
        ValueError: The variable is set but not a positive number.
    """
    text = os.environ.get(FAILURE_TIMEOUT_ENV)
    if text is None:
        return DEFAULT_FAILURE_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{FAILURE_TIMEOUT_ENV}={text!r} must be a positive number of seconds, e.g. 10.")
    return value


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
    """

    #: Registry name, also written into each checkpoint's metadata block.
    strategy_name: ClassVar[str] = "direct_reference"

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
    ) -> None:
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
        self._checkpoint_source = "the checkpoint"
        self._final_model_state: dict[str, Any] | None = None
        self._failure_timeout: float | None = None
        self._failed = False

    @property
    @override
    def checkpoint_io(self) -> CheckpointIO:
        """The checkpoint IO plugin; by default one whose local saves are atomic (never a torn file)."""
        if self._checkpoint_io is None:
            self._checkpoint_io = AtomicTorchCheckpointIO()
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
            self._launcher = CanonicalStateLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        self._failed = False
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
        _leave_the_process_group_at_exit()

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
        self._failed = True
        if _distributed_is_initialized():
            if torch.distributed.get_backend() == "nccl":
                # NCCL's graceful shutdown waits for the pending collective, which a dead peer never joins.
                torch.distributed.distributed_c10d._abort_process_group()
            else:
                torch.distributed.destroy_process_group()
        self._stop_started_ranks()

    def _stop_started_ranks(self) -> None:
        """Waits up to ``failure_timeout`` for the ranks this process started (subprocess launcher), then kills them."""
        launcher = self._launcher
        children: list[subprocess.Popen[Any]] = (
            list(launcher.procs) if isinstance(launcher, _SubprocessScriptLauncher) else []
        )
        deadline = time.monotonic() + self.failure_timeout
        for local_rank, child in enumerate(children, start=1):
            try:
                child.wait(timeout=max(deadline - time.monotonic(), 0.0))
            except subprocess.TimeoutExpired:
                print(
                    f"[{type(self).__name__}] local rank {local_rank} (pid {child.pid}) did not end within"
                    f" failure_timeout={self.failure_timeout:g} s after this run failed; killing it.",
                    file=sys.stderr,
                    flush=True,
                )
                child.kill()
                child.wait()

    # ------------------------------------------------------------------ ranks must agree

    def options_fingerprint(self) -> dict[str, Any]:
        """What every rank's strategy must agree on: its class and the options that are plain values."""
        options: dict[str, Any] = {"class": f"{type(self).__module__}.{type(self).__qualname__}"}
        for name, value in sorted(vars(self).items()):
            if name in _RUN_STATE:
                continue
            if isinstance(value, tuple) and all(isinstance(item, type) for item in value):
                options[name.lstrip("_")] = tuple(item.__qualname__ for item in value)  # e.g. module classes to shard
            elif value is None or isinstance(value, bool | int | float | str | timedelta):
                options[name.lstrip("_")] = value
            elif isinstance(value, Mapping) and all(
                isinstance(item, bool | int | float | str) for item in value.values()
            ):
                options[name.lstrip("_")] = dict(sorted(value.items()))  # e.g. keyword arguments for the wrapper
        options["precision"] = type(self.precision_plugin).__qualname__
        return options

    def require_agreement(self, values: Mapping[str, Any], what: str, fix: str) -> None:
        """Checks that every rank passes the same ``values`` (a collective: every rank must call it).

        Args:
            values: This rank's values, by name.
            what: What they are, for the error message.
            fix: How to make them agree, for the error message.

        Raises:
            RanksDisagreeError: On every rank, naming each value that differs from rank 0's and the ranks involved.
        """
        if not _distributed_is_initialized() or torch.distributed.get_world_size() < 2:
            return
        everyone: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, dict(values))
        reference: dict[str, Any] = everyone[0]
        differences = [
            f"{key}: rank 0 has {reference.get(key)!r}, rank {rank} has {theirs.get(key)!r}"
            for rank, theirs in enumerate(everyone)
            for key in sorted(set(reference) | set(theirs))
            if theirs.get(key) != reference.get(key)
        ]
        if differences:
            raise RanksDisagreeError(
                f"The processes of this run disagree on {what}, so they cannot work together; nothing was done."
                f"\n  " + "\n  ".join(differences[:10]) + f"\nEvery process must get the same values: {fix}."
            )

    def _check_resume_path_agreement(self, trainer: pl.Trainer) -> None:
        """Makes the Trainer check, on every rank, that all ranks resume from the same ``ckpt_path`` (or none)."""
        connector = getattr(trainer, "_checkpoint_connector", None)
        resume_start = getattr(connector, "resume_start", None)
        if connector is None or resume_start is None or "resume_start" in vars(connector):
            return

        # The Trainer starts every restore (with a path or None) here on all ranks right after setup; a rank that
        # resumes while another starts afresh would otherwise wait in the load's collectives for ever.
        def agreeing_resume_start(checkpoint_path: _PATH | None = None, *args: Any, **kwargs: Any) -> Any:
            del vars(connector)["resume_start"]
            path = None if checkpoint_path is None else str(checkpoint_path)
            self.require_agreement(
                {"ckpt_path": path}, "the checkpoint to resume from", "pass the same ckpt_path to fit() on every rank"
            )
            return resume_start(checkpoint_path, *args, **kwargs)

        vars(connector)["resume_start"] = agreeing_resume_start

    def _require_same_save_path(self, filepath: _PATH) -> None:
        self.require_agreement(
            {"filepath": str(filepath)},
            "where to save the checkpoint",
            "call trainer.save_checkpoint(path) with the same path on every rank (compute it on rank 0 and"
            " broadcast it with trainer.strategy.broadcast(path))",
        )

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
        # Before wrapping: different options (say, another state_dict_type) would make the ranks wrap and shard
        # differently, and their collectives would never meet.
        self.require_agreement(
            self.options_fingerprint(), "the strategy's options", "configure the strategy the same way"
        )
        self._check_resume_path_agreement(trainer)
        self.accelerator.setup(trainer)
        module = self.require_lightning_module()
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync is not None:
            self._layer_sync.apply(module)  # converts submodules in place, e.g. to SyncBatchNorm
        self.precision_plugin.convert_module(module)
        self.model_to_device()
        if fitting:
            self.configure_for_fit(trainer)
        else:
            self.configure_for_evaluation(trainer)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

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

    def take_final_model_state(self) -> dict[str, Any]:
        """The canonical model state taken at the end of fit (see :meth:`teardown`); ``{}`` when there is none."""
        state, self._final_model_state = self._final_model_state or {}, None
        return state

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        trainer = module._trainer if module is not None else None
        if (
            isinstance(self._launcher, CanonicalStateLauncher)
            and trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and _distributed_is_initialized()  # a worker; the launching process tears down too after a failure
        ):
            # The launcher sends the trained weights to the main process after teardown, when the wrapper that
            # could gather them is gone: take them now, while every rank still holds its shard.
            self._final_model_state = self.full_model_state()
            # Leave together: a spawned rank that exits while its peer still finishes the gather's last collective
            # closes the peer's gloo connection under it, and the peer aborts (SIGABRT) on its way out.
            self.barrier("final model state gathered")
        if trainer is not None:  # a run that ended before the Trainer restored anything
            vars(trainer._checkpoint_connector).pop("resume_start", None)
        if self._precision_plugin is not None:
            vars(self._precision_plugin).pop("clip_grad_by_norm", None)
        if module is not None:
            self.model = module  # drop the wrapper; the direct reference is all that is left
        super().teardown()

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
        wrapper = self.model
        if wrapper is None or wrapper is module:
            return getattr(module, method_name)(*args, **kwargs)
        # After validation Lightning restores train mode on the LightningModule's submodules only; the wrapper
        # around it would stay in eval mode, and ShardedDataParallel, for one, then silently stops reducing
        # gradients. The wrapper's own flag follows the module's (its children are the module's own).
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
        return self.full_model_state()

    def full_model_state(self) -> dict[str, Any]:
        """Canonical model state on global rank 0 (the unwrapped module's keys, full CPU tensors); ``{}`` elsewhere.

        Every rank must call it: subclasses may gather with collectives.
        """
        state = self._canonical_model_state()
        return state if self.is_global_zero else {}

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
            state_dict_type="full",
        )

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None) -> None:
        self._require_same_save_path(filepath)  # a rank's different path would be silently ignored
        if self.is_global_zero:
            stamped = {**checkpoint, METADATA_KEY: self.checkpoint_metadata().to_dict()}
            self.checkpoint_io.save_checkpoint(stamped, filepath, storage_options=storage_options)

    def save_sharded(self, checkpoint: dict[str, Any], directory: Path, write_shards: Callable[[], None]) -> None:
        """Writes a sharded checkpoint directory whose ``meta.pt`` marks it complete.

        ``meta.pt`` is removed before any shard changes and written (atomically, by rank 0) after every rank wrote
        its shards, so a directory with ``meta.pt`` is never a mix of two saves or a partial one.

        Args:
            checkpoint: What Lightning dumped; its state entries are the ranks' shards.
            directory: The checkpoint directory.
            write_shards: Writes this rank's shards into ``directory`` (a collective for some formats).
        """
        self._require_same_save_path(directory)  # shards in different directories: none of them complete
        if self.is_global_zero:
            directory.mkdir(parents=True, exist_ok=True)
            (directory / SHARDED_META_FILE).unlink(missing_ok=True)
        self.barrier("sharded checkpoint started")
        write_shards()
        self.barrier("sharded checkpoint shards written")
        if self.is_global_zero:
            write_sharded_meta(self.checkpoint_io, checkpoint, self.checkpoint_metadata(), directory)
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
        # Checkpoints never run code when loaded: weights_only is always True.
        self._checkpoint_source = f"Checkpoint {str(checkpoint_path)!r}"
        checkpoint = read_checkpoint(
            checkpoint_path, load=lambda: self.checkpoint_io.load_checkpoint(checkpoint_path, weights_only=True)
        )
        require_full_checkpoint(checkpoint, source=self._checkpoint_source)
        return checkpoint

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        source = self._checkpoint_source
        require_full_checkpoint(checkpoint, source=source)
        if "state_dict" not in checkpoint:
            raise CheckpointFormatError(f"{source} has no 'state_dict' (keys: {', '.join(sorted(checkpoint))}).")
        if self._restoring_optimizers(checkpoint):
            # Refuse a checkpoint whose optimizer states do not fit *before* changing the weights.
            self._check_optimizer_states(checkpoint["optimizer_states"])
        self._load_canonical_model_state(checkpoint["state_dict"], strict=strict)

    def _restoring_optimizers(self, checkpoint: Mapping[str, Any]) -> bool:
        module = self.require_lightning_module()
        trainer = module._trainer
        return (
            trainer is not None
            and trainer.state.fn == TrainerFn.FITTING
            and self.lightning_restore_optimizer
            and "optimizer_states" in checkpoint
        )

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
        states = checkpoint["optimizer_states"]
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
