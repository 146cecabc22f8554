"""fairscale FullyShardedDataParallel: parameters, gradients and optimizer state sharded across ranks.

This is the strategy of Lightning issue 13500. Its checkpoints are canonical because state is gathered through the
root wrapper (model) and from the flat shards the optimizer actually steps (optimizer), re-keyed by parameter name
into torch's layout; loading goes the other way (:mod:`.flat_state`). Where each canonical parameter lives is
modelled in :mod:`.layout`; how the model is wrapped, in :mod:`.wrap`; what happens to gradients around a step, in
:mod:`.gradients`.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.wrap import enable_wrap
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import canonical_keys, check_model_state, to_cpu_state, to_module_keys
from lightning_strategies.fairscale import cpu
from lightning_strategies.fairscale.layout import (
    FAIRSCALE_SEGMENTS,
    FlatUnit,
    OptimizerLayout,
    flat_units,
    optimizer_layout,
    parameter_names,
    tied_aliases,
)

from .._lightning import (
    CheckpointIO,
    ClusterEnvironment,
    Precision,
    _StrategyRegistry,
    autocast_caches_casts,
    pl,
    raw_optimizer,
)
from ..strategies.base import DirectReferenceStrategy, StartMethod
from ..strategies.full_gradients import full_fairscale_parameters
from ..strategies.launcher import CanonicalStateLauncher, HandBack
from ..strategies.optimizers import refuse_unsupported_optimizers, retarget_schedulers, twin_optimizer
from ..strategies.redirection import SubmoduleCallRouting
from .flat_state import (
    expected_model_state,
    gather_model_state,
    gather_optimizer_state,
    load_optimizer_state,
    local_model_state,
    unshard_into_module,
)
from .gradients import (
    AGREEING_SCALERS,
    GradientlessCheck,
    clip_by_total_norm,
    gradients_kept_as_ddp,
    gradients_set_aside,
)
from .options import (
    REFUSED_OPTIMIZER_NEEDS,
    refuse_flattening,
    refuse_unknown_fsdp_kwargs,
    unflattened_by_default,
)
from .shards import FairScaleLocalShards
from .wrap import (
    ParamClass,
    UnitCallGuard,
    ViewGuard,
    WrapRequests,
    by_param_group,
    by_requires_grad,
    forget_stale_fairscale_groups,
    unit_view,
    wrap_model,
)

FSDP = FullyShardedDataParallel


class FairScaleFSDPStrategy(DirectReferenceStrategy):
    """Fully sharded data parallel training with fairscale ``FullyShardedDataParallel``.

    The LightningModule is wrapped in a root FSDP (large submodules first, by ``auto_wrap_min_params``, never apart
    from the other users of a shared parameter; or the submodules ``fairscale.nn.wrap`` marked in ``configure_model``).
    ``configure_optimizers()`` is written as usual (any param groups, tied and frozen parameters, schedulers): its
    optimizers are copied over the flat parameters FSDP trains, one per param group and ``requires_grad`` in each FSDP
    instance. Between steps, read parameters inside :meth:`full_parameters`. Checkpoints are canonical
    (``state_dict_type="full"``, default) or one file per rank (``"sharded"``). With ``accelerator="cpu"`` the scoped
    patches of :mod:`lightning_strategies.fairscale.cpu` are applied while the strategy runs.

    It also takes the arguments every strategy of this package shares (``accelerator``, ``parallel_devices``,
    ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ``process_group_backend``, ``timeout``,
    ``start_method``, ``hand_back``, ``async_save``), with the same defaults and meaning as
    :class:`~lightning_strategies.DirectReferenceStrategy`, which documents them.

    Args:
        auto_wrap_min_params: Submodules with at least this many parameters get their own FSDP; ``None`` wraps only
            the root. Ignored when ``configure_model`` already wrapped submodules.
        state_dict_type: ``"full"`` (one canonical file) or ``"sharded"`` (a directory, one file per rank).
        broadcast_buffers: Give every rank global rank 0's buffers that change in training (BatchNorm running
            statistics) before each forward, as ``ddp`` does; ``False`` keeps each rank's own (no collective).
        **fsdp_kwargs: Passed to every ``FullyShardedDataParallel``: ``flatten_parameters``,
            ``reshard_after_forward``, ``mixed_precision``, ``compute_dtype``, ``fp32_reduce_scatter``,
            ``bucket_cap_mb``, ``cpu_offload``, ``move_grads_to_cpu``, ``state_dict_on_rank_0_only`` (default
            ``True`` here), ...

    Raises:
        TypeError: A keyword argument that ``FullyShardedDataParallel`` does not take.
        ValueError: An unknown ``state_dict_type``.
    """

    agreeing_scalers = AGREEING_SCALERS

    strategy_name = "fsdp_fairscale"

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
        auto_wrap_min_params: int | None = 100_000_000,
        state_dict_type: Literal["full", "sharded"] = "full",
        broadcast_buffers: bool = True,
        async_save: bool = False,
        **fsdp_kwargs: Any,
    ) -> None:
        refuse_unknown_fsdp_kwargs(fsdp_kwargs)
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
        self._fsdp_kwargs = {"state_dict_on_rank_0_only": True, **fsdp_kwargs}
        self._auto_wrap_min_params = auto_wrap_min_params
        self._state_dict_type = self._checked_state_dict_type(state_dict_type)
        self._broadcast_buffers = broadcast_buffers
        self._cpu_patched = False
        self._units: list[FlatUnit] = []
        self._aliases: dict[str, str] = {}  # tied parameters' other names -> the name that holds them
        self._wrap_requests = WrapRequests()
        self._view_guard: ViewGuard | None = None
        self._unit_guard: UnitCallGuard | None = None
        self._layouts: dict[int, OptimizerLayout] = {}
        self._routing: SubmoduleCallRouting | None = None
        self._original_children: list[tuple[Module, str, Module]] = []
        self._state_key_order: list[str] = []
        self._gradient_check = GradientlessCheck()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Registers ``fsdp_fairscale`` (and ``_spawn``, ``_fork``) and ``fsdp_fairscale_offload``."""
        super().register_strategies(strategy_registry)
        strategy_registry.register(
            "fsdp_fairscale_offload",
            cls,
            description="FairScaleFSDPStrategy with parameters and gradients offloaded to the CPU",
            override=True,
            cpu_offload=True,
            move_grads_to_cpu=True,
        )

    # ------------------------------------------------------------------ environment and wrapping

    @property
    def _offloads(self) -> bool:
        return bool(self._fsdp_kwargs.get("cpu_offload") or self._fsdp_kwargs.get("move_params_to_cpu"))

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        forget_stale_fairscale_groups()
        if self.root_device.type == "cpu" and not self._cpu_patched:
            pin_memory = self._offloads or bool(self._fsdp_kwargs.get("move_grads_to_cpu"))
            self._cpu_patched = cpu.install(pin_memory=pin_memory)
            if self._cpu_patched:
                rank_zero_warn("fairscale FSDP runs on the CPU through scoped patches: for development and testing.")

    def _wrapper_kwargs(self, unflattened: bool = False) -> dict[str, Any]:
        fsdp_kwargs = unflattened_by_default(self._fsdp_kwargs) if unflattened else self._fsdp_kwargs
        return {**fsdp_kwargs, "compute_device": self.root_device}

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """Inside ``configure_model``, ``fairscale.nn.wrap(submodule)`` marks a submodule for its own FSDP.

        It is wrapped (with this strategy's options and the ones given to ``wrap``) when the strategy wraps the
        model, after ``configure_optimizers()`` saw its parameters as they are.
        """
        self._wrap_requests = WrapRequests()
        with enable_wrap(wrapper_cls=self._wrap_requests.marker()):
            yield

    def _wrap(
        self, module: pl.LightningModule, param_class: ParamClass = by_requires_grad, unflattened: bool = False
    ) -> FSDP:
        # Remember the module tree as it was, so teardown can put back every child this strategy wrapped.
        self._original_children = [
            (parent, name, child) for parent in module.modules() for name, child in parent.named_children()
        ]
        user_wrapped = any(isinstance(child, FSDP) for child in module.modules())
        # The order of the plain module's state_dict, for the canonical state gathered unit by unit (references only).
        self._state_key_order = [] if user_wrapped else list(canonical_keys(module.state_dict(keep_vars=True)))
        kwargs = {**self._wrapper_kwargs(unflattened), "param_class": param_class}
        root, wrapped_by = wrap_model(module, kwargs, self._wrap_requests, self._auto_wrap_min_params)
        self._units = flat_units(root)
        self._aliases = tied_aliases(root)
        self._view_guard = ViewGuard(root)
        self._view_guard.guard()
        if self._unit_guard is not None:
            self._unit_guard.remove()
        self._unit_guard = UnitCallGuard(root, wrapped_by)
        return root

    @override
    def model_to_device(self) -> None:
        if not self._offloads:  # with offloading FSDP moves what it computes with itself
            super().model_to_device()

    @override
    def configure_for_fit(self, trainer: pl.Trainer) -> None:
        module = self.require_lightning_module()
        names_before = parameter_names(module)
        self._layouts = {}
        self._gradient_check = GradientlessCheck()
        self.setup_optimizers(trainer)  # the user's optimizers, over the parameters as configure_optimizers saw them
        refuse_unsupported_optimizers(self.strategy_name, self.optimizers, module, REFUSED_OPTIMIZER_NEEDS)
        # An autocast that caches its casts of parameters (Lightning's before 2.6) caches leaves only: flattened
        # parameters are views, whose gradients would be summed otherwise than ddp's (options.refuse_flattening).
        # Not on one rank: fairscale does not shard unflattened parameters there, which the flat layout needs.
        cached_casts = self.world_size > 1 and autocast_caches_casts(self.precision_plugin, self.root_device.type)
        root = self._wrap(module, by_param_group(self.optimizers), unflattened=cached_casts)
        if cached_casts:
            refuse_flattening(root)
        optimizers = []
        for index, optimizer in enumerate(self.optimizers):
            layout = optimizer_layout(optimizer, names_before, self._units, index)
            groups = [
                {**{key: value for key, value in group.items() if key != "params"}, "params": [u.param for u in units]}
                for group, units in zip(optimizer.param_groups, layout.group_units, strict=True)
            ]
            rebuilt = twin_optimizer(optimizer, groups)
            retarget_schedulers(self.lr_scheduler_configs, optimizer, rebuilt)
            self._layouts[id(rebuilt)] = layout
            if optimizer.state:  # created at construction (Adagrad's sums) or loaded by the user
                self._load_canonical_optimizer_state(rebuilt, optimizer.state_dict())
            optimizers.append(rebuilt)
        self.optimizers = optimizers
        self.model = root

    @override
    def configure_for_evaluation(self, trainer: pl.Trainer) -> None:
        self.model = self._wrap(self.require_lightning_module())

    def _root(self) -> FSDP:
        if not isinstance(self.model, FSDP):
            raise RuntimeError("FairScaleFSDPStrategy has no FSDP root yet: it is created in Trainer.fit/validate.")
        return self.model

    @contextmanager
    @override
    def block_backward_sync(self) -> Generator[None, None, None]:
        if isinstance(self.model, FSDP):
            with self.model.no_sync():
                yield None
        else:
            yield None

    @property
    @override
    def gradients_are_sharded(self) -> bool:
        return isinstance(self.model, FSDP)

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        # Each rank holds a shard of every gradient: the norm is summed across ranks. Over this optimizer's parameters
        # only, as Lightning clips under ddp: the root's clip_grad_norm_ took every gradient the root holds (another
        # optimizer's, left by a backward pass of a two-optimizer step) into the norm.
        # (Manual steps pass a LightningOptimizer.)
        layout = self._layouts.get(id(raw_optimizer(optimizer)))
        if layout is None:
            self._root().clip_grad_norm_(clip_val)
            return
        clip_by_total_norm(layout.flat_units, clip_val, self.root_device, self._root().process_group)

    @contextmanager
    @override
    def full_parameters(self) -> Generator[None, None, None]:
        """The LightningModule's full parameters, on every rank, for reading them in hooks and callbacks.

        Between steps each rank holds only its shard of the flattened parameters, and the module's parameter
        attributes raise an error naming this context. Inside it they are whole ``Parameter`` objects (gathered with
        ``summon_full_params``; changes are not written back). Every rank must enter it, outside forward and
        backward (e.g. in ``on_train_batch_end``).
        """
        if not isinstance(self.model, FSDP):
            yield None
            return
        with self._guarding_views(), self.model.summon_full_params(recurse=True, volatile=True):
            yield None

    @contextmanager
    def _guarding_views(self) -> Generator[None, None, None]:
        """Puts the placeholders back afterwards: fairscale leaves views of freed storage behind it."""
        try:
            yield None
        finally:
            if self._view_guard is not None:
                self._view_guard.guard()

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        # Strategy.backward, with the parameter attributes guarded as soon as backward freed the full parameters:
        # on_after_backward, on_before_optimizer_step and on_train_batch_end then get an error instead of a crash.
        module = self.require_lightning_module()
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        kept = gradients_kept_as_ddp(self.model) if isinstance(self.model, FSDP) else nullcontext()
        with self._guarding_views(), kept:
            self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def _run_step(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
        module = self.require_lightning_module()
        wrapper = self.model
        if method_name == "training_step" and not module.automatic_optimization and isinstance(wrapper, FSDP):
            return self._manual_optimization_step(module, wrapper, *args, **kwargs)
        if method_name == "training_step":  # backward still needs the views (activation checkpointing reads them)
            with gradients_set_aside(self._units):  # back before Lightning's zero_grad and backward
                return super()._run_step(method_name, *args, **kwargs)
        with self._guarding_views(), gradients_set_aside(self._units):
            return super()._run_step(method_name, *args, **kwargs)

    def _manual_optimization_step(self, module: pl.LightningModule, wrapper: FSDP, *args: Any, **kwargs: Any) -> Any:
        # Manual optimization runs backward (and optimizer steps) inside the step, which fairscale does not allow
        # inside the root's forward (its backward hooks assert that the forward has ended). The step runs on its own
        # instead, and every module call it makes (`self(...)`, `self.discriminator(x)`) goes through the root's
        # forward: gathered parameters, backward hooks, and parameters that an optimizer step just changed.
        if self._routing is None or self._routing.lightning_module is not module:
            self._routing = SubmoduleCallRouting(wrapper, module)
        wrapper.training = module.training
        with self._routing.routing():
            return module.training_step(*args, **kwargs)

    @contextmanager
    @override
    def complete_gradients(self) -> Generator[None, None, None]:
        # Flattening took the original parameters off their modules: they come back, full, with full gradients.
        if not isinstance(self.model, FSDP):
            yield None
            return
        with self._guarding_views(), full_fairscale_parameters([unit_view(unit) for unit in self._units]):
            yield None

    @override
    def _after_closure(self, model: pl.LightningModule, optimizer: Any) -> None:
        # A parameter sharing a flat parameter that got no gradient: left alone as under ddp, or refused.
        self._gradient_check.before_step(optimizer, self.optimizers, self._layouts, self.root_device)
        if self._unit_guard is not None:  # the first step made every call the steps make (see UnitCallGuard)
            self._unit_guard.remove()
            self._unit_guard = None
        super()._after_closure(model, optimizer)

    @override
    def teardown(self) -> None:
        in_place = not isinstance(self.launcher, CanonicalStateLauncher)
        # After a failure the process group is gone (see on_exception): the module keeps its shards.
        if in_place and isinstance(self.model, FSDP) and not self.failed:
            # Before the root goes and while the CPU patches are in place.
            unshard_into_module(self._root(), self._units, self._original_children, self.require_lightning_module())
        super().teardown()  # gathers the final weights for the launcher: the patches must still be in place
        # The layouts stay until the next setup: after an in-place fit the optimizers still hold flat shards, and
        # `trainer.save_checkpoint` after `fit` gathers them into canonical state through these layouts.
        self._units, self._original_children, self._view_guard = [], [], None
        if self._unit_guard is not None:
            self._unit_guard.remove()
            self._unit_guard = None
        self._routing = None  # it holds the root wrapper, which the run no longer needs
        if self._cpu_patched:
            cpu.uninstall()
            self._cpu_patched = False

    # ------------------------------------------------------------------ model state

    def _expected_model_state(self) -> dict[str, Any]:
        return expected_model_state(self._root(), self._units, self._aliases)

    @override
    def _canonical_model_state(self) -> dict[str, Any]:
        if not isinstance(self.model, FSDP):  # before setup or after teardown the module holds its full weights
            return super()._canonical_model_state()
        root = self._root()
        extra_state = any(type(module).get_extra_state is not Module.get_extra_state for module in root.modules())
        sub_groups = any(unit.instance.world_size != self.world_size for unit in self._units)
        if extra_state or sub_groups:
            # Extra state is only known to the modules' own state_dict, and a shard of a smaller group may not reach
            # global rank 0: both are gathered through the root wrapper.
            with self._guarding_views():
                gathered = root.state_dict()  # a collective: every rank calls it
            return to_cpu_state(gathered) if self.is_global_zero else {}
        return gather_model_state(root, self._units, self._aliases, self._state_key_order, self.is_global_zero)

    @override
    def _load_canonical_model_state(self, state: Mapping[str, Any], strict: bool) -> None:
        root = self._root()
        check_model_state(self._expected_model_state(), state, strict=strict, source=self._checkpoint_source)
        # Each rank cuts its flat shards from the state (only its part of a mapped file is read).
        local = local_model_state(root, self._units, state)
        with self._guarding_views():  # the keys the root's state_dict uses (a compiled submodule's `_orig_mod`)
            if local is not None:
                root.load_local_state_dict(to_module_keys(local, root, FAIRSCALE_SEGMENTS), strict=True)
            else:
                root.load_state_dict(to_module_keys(state, root, FAIRSCALE_SEGMENTS), strict=strict)

    # ------------------------------------------------------------------ optimizer state

    def _layout_of(self, optimizer: Optimizer) -> OptimizerLayout:
        layout = self._layouts.get(id(optimizer))
        if layout is None:
            raise RuntimeError(
                f"{type(optimizer).__name__} was not created by FairScaleFSDPStrategy; optimizers must come from"
                " configure_optimizers()."
            )
        return layout

    @override
    def _canonical_param_shapes(self, optimizer: Optimizer) -> list[list[torch.Size]]:
        return self._layout_of(optimizer).shapes

    @override
    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if id(optimizer) not in self._layouts:  # not rebuilt over flat parameters (a forked run's main process)
            return super()._canonical_optimizer_state(optimizer)
        return gather_optimizer_state(optimizer, self._layout_of(optimizer), self.is_global_zero)

    @override
    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        load_optimizer_state(optimizer, self._layout_of(optimizer), state)

    # ------------------------------------------------------------------ sharded checkpoints

    @override
    def sharded_format(self) -> FairScaleLocalShards:
        return FairScaleLocalShards(self)
