"""torch FSDP2 (``fully_shard``): parameters become DTensors in place; no wrapper object, no key prefixes.

The migration path off fairscale: the same contract, canonical checkpoints through torch's distributed state-dict
API, and sharded checkpoints through ``torch.distributed.checkpoint`` that reshard to another world size.
"""

from __future__ import annotations

from collections.abc import Generator, Iterable, Mapping
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import torch
from torch import Tensor
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import (
    canonical_key,
    canonical_keys,
    check_model_state,
)
from lightning_strategies.checkpoint.optimizer_state import canonical_to_name_keyed

from .._lightning import CheckpointIO, ClusterEnvironment, Precision, pl, set_device_mesh
from .._torch_private import composable_activation_checkpoint
from .base import DirectReferenceStrategy, StartMethod
from .dtensor_state import load_into_module, local_parts
from .fsdp2_sharding import is_sharded, on_device, shard_kwargs, shard_module, step_bypassed_the_module
from .fsdp2_shards import DcpShards
from .full_gradients import full_dtensor_gradients
from .gather import gather_many_to_rank0
from .launcher import HandBack
from .meta_init import (
    has_meta_tensors,
    materialise_meta_tensors,
    refuse_uninitialised,
    uninitialised_meta_tensors,
)
from .optimizers import OptimizerNeed, refuse_unsupported_optimizers, step_on_local_shards, steps_on_local_shards
from .redirection import SubmoduleCallRouting

# What fully_shard's DTensor shards take away from an optimizer's math (see optimizers.OptimizerNeed).
_REFUSED_OPTIMIZER_NEEDS = {
    OptimizerNeed.WHOLE_PARAMETERS: (
        "fully_shard gives each rank a shard of every parameter, on which torch's implementation fails or computes"
        " other numbers than on the whole parameter"
    ),
    OptimizerNeed.ALL_PARAMETERS_AS_ONE: (
        "although its steps on DTensor shards reduce globally, its state holds vectors over all parameters (search"
        " directions, the previous gradient) that fsdp2's checkpoints can neither gather into torch's layout nor"
        " shard again"
    ),
    OptimizerNeed.SPARSE_GRADIENTS: "fully_shard reduces and shards gradients as dense DTensors",
}


class FSDP2Strategy(DirectReferenceStrategy):
    """Fully sharded data parallel training with torch's ``fully_shard`` (FSDP2).

    ``fully_shard`` is applied to the LightningModule in place: first to submodules chosen by class
    (``shard_module_classes``) or size (``min_num_params``), bottom-up, then to the module itself. Modules the user
    sharded in ``configure_model`` (use ``strategy.device_mesh``) are kept. There is no wrapper object, so
    ``strategy.model is strategy.lightning_module``, and steps are called directly: the step's own ``self(...)``
    runs the root's FSDP hooks once, as in a hand-written loop. Optimizers are created after sharding, over the
    DTensor parameters.

    It also takes the arguments every strategy of this package shares (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
    ``start_method``, ``hand_back``, ``async_save``), with the same defaults and meaning as
    :class:`~lightning_strategies.DirectReferenceStrategy`, which documents them.

    Args:
        shard_module_classes: Submodule classes that get their own ``fully_shard`` (e.g. transformer blocks).
        min_num_params: Also shard submodules holding at least this many parameters not yet sharded below them.
        reshard_after_forward: Free gathered parameters after forward (ZeRO-3) or keep them until backward.
            ``None`` (default) is torch's own choice: ``True`` for submodules, ``False`` for the root, whose
            parameters backward needs first (forcing ``True`` on the root all-gathers them twice per step).
        mixed_precision: ``MixedPrecisionPolicy`` (``param_dtype=torch.bfloat16`` runs on CPU).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in host memory (pinned only on CUDA).
        activation_checkpointing: Submodule classes whose activations are recomputed in backward.
        state_dict_type: ``"full"`` (one canonical file) or ``"sharded"`` (a ``torch.distributed.checkpoint``
            directory that resumes at any world size).
        broadcast_buffers: Give every rank global rank 0's buffers that change in training (BatchNorm running
            statistics) before each forward, as ``ddp`` does; ``False`` keeps each rank's own (no collective).

    Raises:
        ValueError: An unknown ``state_dict_type``.
    """

    strategy_name = "fsdp2"
    _materialises_meta_tensors = True
    _evaluates_in_inference_mode = False

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
        shard_module_classes: Iterable[type[Module]] = (),
        min_num_params: int | None = None,
        reshard_after_forward: bool | None = None,
        mixed_precision: MixedPrecisionPolicy | None = None,
        cpu_offload: bool = False,
        activation_checkpointing: Iterable[type[Module]] = (),
        state_dict_type: Literal["full", "sharded"] = "full",
        broadcast_buffers: bool = True,
        async_save: bool = False,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            hand_back=hand_back,
            async_save=async_save,
        )
        self._shard_module_classes = tuple(shard_module_classes)
        self._min_num_params = min_num_params
        self._reshard_after_forward = reshard_after_forward
        self._mixed_precision = mixed_precision or MixedPrecisionPolicy()
        self._cpu_offload = cpu_offload
        self._activation_checkpointing = tuple(activation_checkpointing)
        if self._activation_checkpointing and composable_activation_checkpoint() is None:
            raise ValueError(
                f"activation_checkpointing needs torch.distributed._composable.checkpoint_activation, which torch"
                f" {torch.__version__} does not have. Leave activation_checkpointing empty and call"
                " torch.utils.checkpoint.checkpoint in your module's forward, or use torch 2.13 or 2.14."
            )
        self._state_dict_type = self._checked_state_dict_type(state_dict_type)
        self._broadcast_buffers = broadcast_buffers
        self._device_mesh: DeviceMesh | None = None
        self._model_parallel_mesh: DeviceMesh | None = None
        self._left_for_the_restore: dict[str, str] = {}
        self._routing: SubmoduleCallRouting | None = None

    # ------------------------------------------------------------------ environment and sharding

    @property
    def device_mesh(self) -> DeviceMesh:
        """The 1-D data-parallel mesh (for ``fully_shard(..., mesh=strategy.device_mesh)`` in ``configure_model``).

        It is the ``"data_parallel"`` dimension of :attr:`model_parallel_mesh`.
        """
        if self._device_mesh is None:
            self._device_mesh = self.model_parallel_mesh["data_parallel"]
        return self._device_mesh

    @property
    def model_parallel_mesh(self) -> DeviceMesh:
        """The mesh upstream ``ModelParallelStrategy`` gives the LightningModule as ``self.device_mesh``.

        Dimensions ``("data_parallel", "tensor_parallel")`` of sizes ``(world_size, 1)``: code written for
        ``ModelParallelStrategy`` (``fully_shard(layer, mesh=self.device_mesh["data_parallel"])`` in
        ``configure_model``) runs unchanged. Set on the LightningModule in ``setup_environment``.
        """
        if self._model_parallel_mesh is None:
            self._model_parallel_mesh = init_device_mesh(
                self.root_device.type, (self.world_size, 1), mesh_dim_names=("data_parallel", "tensor_parallel")
            )
        return self._model_parallel_mesh

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        module = self.lightning_module
        if module is not None:  # read in configure_model, which the Trainer calls next
            set_device_mesh(module, self.model_parallel_mesh)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` creates tensors on the meta device (no memory anywhere).

        Setup shards the model first and then materialises it: each rank allocates its shards only and initialises
        them with the owning modules' ``reset_parameters()``; a ``ckpt_path`` restore then fills them. Without
        ``empty_init`` tensors are created as by every strategy (on this process's device, initialised).
        """
        if not empty_init:
            with super().tensor_init_context(empty_init):
                yield None
            return
        with torch.device("meta"), self.precision_plugin.tensor_init_context():
            yield None

    @override
    def _run_step(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        # Steps are called directly and their own `self(...)` runs FSDP's hooks once. (Calling them through the
        # module's `__call__` instead re-enters the hooks when the step calls `self(...)`: the nested post-forward
        # leaves the root's parameters resharded, one more all-gather per step.) A step that calls submodules instead
        # (`self.model(**batch)`, `self.encoder(x)`) has those calls run through the module's own call, so the root's
        # hooks (all-gather, lazy init before any sharded submodule's) run around them too.
        module = self.require_lightning_module()
        if self._routing is None or self._routing.lightning_module is not module:
            self._routing = SubmoduleCallRouting(module, module)
        called: list[bool] = []
        handle = module.register_forward_pre_hook(lambda *_: called.append(True))
        try:
            with self._routing.routing():
                output = getattr(module, method_name)(*args, **kwargs)
        except RuntimeError as error:
            if "mixed torch.Tensor and DTensor" not in str(error):
                raise
            raise RuntimeError(self._step_bypassed_the_module(method_name)) from error
        finally:
            handle.remove()
        if not called:
            raise RuntimeError(self._step_bypassed_the_module(method_name))
        return output

    def _step_bypassed_the_module(self, method_name: str) -> str:
        return step_bypassed_the_module(type(self).__name__, self.require_lightning_module(), method_name)

    def _shard(self, module: pl.LightningModule) -> None:
        device = self.root_device
        kwargs = shard_kwargs(
            self.device_mesh, self._reshard_after_forward, self._mixed_precision, self._cpu_offload, device
        )
        shard_module(module, kwargs, self._shard_module_classes, self._min_num_params, self._activation_checkpointing)

    @override
    def model_to_device(self) -> None:
        if self._cpu_offload:  # offloaded parameters stay on the host; FSDP moves what it computes with
            return
        module = self.require_lightning_module()
        if has_meta_tensors(module):  # fully_shard moves the others; the meta ones get memory after sharding
            return
        if is_sharded(module) and on_device(module, self.root_device):
            # Sharded by an earlier run in this process (`trainer.test` after `trainer.fit`): `.to()` would swap every
            # DTensor parameter for itself, which torch refuses inside `torch.inference_mode()`.
            return
        super().model_to_device()

    def _shard_and_materialise(self, trainer: pl.Trainer) -> pl.LightningModule:
        """Shards the LightningModule, then gives its meta tensors (``empty_init=True``) memory: each rank's shards."""
        module = self.require_lightning_module()
        # Every rank alike, before sharding: what no restore could fill (non-persistent buffers) is refused now, the
        # rest once the Trainer says whether it restores a checkpoint (before_restore).
        refuse_uninitialised(uninitialised_meta_tensors(module, restored=True), self.strategy_name)
        self._left_for_the_restore = uninitialised_meta_tensors(module, restored=False)
        self._shard(module)
        device = torch.device("cpu") if self._cpu_offload else self.root_device
        materialise_meta_tensors(module, device, self.device_mesh)
        return module

    @override
    def before_restore(self, checkpoint_path: str | None) -> None:
        left, self._left_for_the_restore = self._left_for_the_restore, {}
        # Materialised tensors whose modules have no reset_parameters() hold uninitialised memory until a strict
        # restore fills them: refused, on every rank alike, before anything reads them.
        if left and (checkpoint_path is None or not self.require_lightning_module().strict_loading):
            refuse_uninitialised(left, self.strategy_name)

    @override
    def configure_for_fit(self, trainer: pl.Trainer) -> None:
        module = self._shard_and_materialise(trainer)
        self.setup_optimizers(trainer)  # after sharding: configure_optimizers() sees the DTensor parameters
        refuse_unsupported_optimizers(self.strategy_name, self.optimizers, module, _REFUSED_OPTIMIZER_NEEDS)
        for optimizer in self.optimizers:
            if steps_on_local_shards(optimizer):
                step_on_local_shards(optimizer)
        self.model = module

    @override
    def configure_for_evaluation(self, trainer: pl.Trainer) -> None:
        self.model = self._shard_and_materialise(trainer)

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        module = self.lightning_module
        if not isinstance(module, FSDPModule):
            yield None
            return
        module.set_requires_gradient_sync(False)
        try:
            yield None
        finally:
            module.set_requires_gradient_sync(True)

    @contextmanager
    @override
    def complete_gradients(self) -> Generator[None, None, None]:
        # Gradients are DTensor shards: each becomes one full plain tensor for the block.
        with full_dtensor_gradients(self.require_lightning_module().parameters()):
            yield None

    @contextmanager
    @override
    def full_parameters(self) -> Generator[None, None, None]:
        """The LightningModule's parameters as plain full tensors, on every rank, for reading them in hooks.

        Outside forward and backward a sharded module's parameters are DTensors holding this rank's shard, and
        ``float(param.norm())`` gives this rank's part. Inside, every sharded submodule is unsharded (all-gathered)
        and its parameter attributes are the full tensors; they are resharded on exit. Every rank must enter it.
        """
        module = self.lightning_module
        units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)] if module is not None else []
        for unit in units:
            unit.unshard()
        try:
            yield None
        finally:
            for unit in units:
                unit.reshard()

    @override
    def teardown(self) -> None:
        # Lightning's teardown moves the module to the CPU, for a sharded one by swapping each DTensor parameter,
        # which torch refuses inside `torch.inference_mode()` (a `trainer.test` called there): it runs outside it.
        with torch.inference_mode(False):
            super().teardown()
        self._device_mesh = None
        self._model_parallel_mesh = None
        self._routing = None

    # ------------------------------------------------------------------ model state

    @override
    def _canonical_model_state(self) -> dict[str, Any]:
        # The module's own state_dict holds DTensor shards under canonical keys (fully_shard adds no prefix); they are
        # gathered to rank 0 only, many per transfer (torch's full state-dict API all-gathers on every rank).
        own = self.require_lightning_module().state_dict()
        gathered = gather_many_to_rank0(list(own.values()))
        return dict(zip(own, gathered, strict=True)) if self.is_global_zero else {}

    def _expected_model_state(self) -> dict[str, Any]:
        """Canonical keys with meta tensors of the global shapes (a DTensor's shape is the global one); entries that
        are not tensors (``get_extra_state``) as they are. Canonical, as torch's distributed state-dict API names
        them too: a compiled submodule's entries without ``_orig_mod``."""
        return canonical_keys(
            {
                key: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, Tensor) else value
                for key, value in self.require_lightning_module().state_dict().items()
            }
        )

    @override
    def _load_canonical_model_state(self, state: Mapping[str, Any], strict: bool) -> None:
        check_model_state(self._expected_model_state(), state, strict=strict, source=self._checkpoint_source)
        module = self.require_lightning_module()
        current = get_model_state_dict(module)
        local = local_parts(state, current, copy=False)  # views: each part is copied once, into its shard
        if local is None:  # a layout local_part_like does not cut: torch's full loader (it scatters from rank 0)
            set_model_state_dict(module, dict(state), options=StateDictOptions(full_state_dict=True, strict=strict))
            return
        load_into_module(module, local, current)

    # ------------------------------------------------------------------ optimizer state

    def _names(self, optimizer: Optimizer) -> list[list[str]]:
        # Canonical names, as torch's distributed state-dict API keys optimizer state (no `_orig_mod`).
        name_of = {id(param): canonical_key(name) for name, param in self.require_lightning_module().named_parameters()}
        return [[name_of[id(param)] for param in group["params"]] for group in optimizer.param_groups]

    @override
    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        # The optimizer's own state_dict is already in the canonical layout (parameters numbered through the groups,
        # hyperparameters as given); only its DTensor entries are shards, gathered to rank 0 many per transfer.
        own = optimizer.state_dict()
        entries = [(index, key, value) for index, values in own["state"].items() for key, value in values.items()]
        gathered = gather_many_to_rank0([value for _, _, value in entries])
        if not self.is_global_zero:
            return {}
        state: dict[int, dict[str, Any]] = {index: {} for index in own["state"]}
        for (index, key, _), full in zip(entries, gathered, strict=True):
            state[index][key] = full
        return {"state": state, "param_groups": own["param_groups"]}

    @override
    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        # Every rank read the whole state: each cuts its parts and the optimizer loads them in its own layout (torch's
        # full loader would scatter every tensor from rank 0 and first step the optimizer once to create its state).
        params = [param for group in optimizer.param_groups for param in group["params"]]
        parts = {
            index: local_parts(entries, dict.fromkeys(entries, params[int(index)]))
            for index, entries in state["state"].items()
        }
        if all(part is not None for part in parts.values()):
            optimizer.load_state_dict({"state": parts, "param_groups": state["param_groups"]})
            return
        names = [name for group in self._names(optimizer) for name in group]
        by_name = canonical_to_name_keyed(state, names)
        set_optimizer_state_dict(
            self.require_lightning_module(),
            optimizer,
            optim_state_dict=by_name,
            options=StateDictOptions(full_state_dict=True, strict=False),  # checked; stateless parameters allowed
        )
        # torch's loader re-packs hyperparameters (Adam's ``betas`` tuple comes back a list): set them as saved.
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update({key: value for key, value in saved.items() if key != "params"})

    # ------------------------------------------------------------------ sharded checkpoints (DCP)

    @override
    def sharded_format(self) -> DcpShards:
        return DcpShards(self)
