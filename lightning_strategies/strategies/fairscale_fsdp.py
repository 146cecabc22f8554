"""fairscale FullyShardedDataParallel: parameters, gradients and optimizer state sharded across ranks.

This is the strategy of Lightning issue 13500. Its checkpoints are canonical because state is gathered through the
root wrapper (model) and from the flat shards the optimizer actually steps (optimizer), re-keyed by parameter name
into torch's layout; loading goes the other way. Where each canonical parameter lives is modelled in
:mod:`lightning_strategies.checkpoint.flat_layout`; how the model is wrapped, in :mod:`.fairscale_wrap`.
"""

from __future__ import annotations

import inspect
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Literal

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter
from fairscale.nn.wrap import auto_wrap, enable_wrap
from lightning_utilities.core.rank_zero import rank_zero_warn
from torch import Tensor
from torch.distributed.constants import default_pg_timeout
from torch.nn import Module, Parameter
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies import fairscale_cpu
from lightning_strategies.checkpoint import (
    canonical_keys,
    check_model_state,
    to_cpu_state,
    to_module_keys,
)
from lightning_strategies.checkpoint.flat import gather_full, local_shard, split_full
from lightning_strategies.checkpoint.flat_layout import (
    FAIRSCALE_SEGMENTS,
    FlatUnit,
    OptimizerLayout,
    canonical_name,
    flat_units,
    join_name,
    optimizer_layout,
    parameter_names,
    persistent_buffers,
    tied_aliases,
)

from .._lightning import CheckpointIO, ClusterEnvironment, Precision, _StrategyRegistry, pl
from .base import DirectReferenceStrategy, StartMethod
from .fairscale_shards import FairScaleLocalShards
from .fairscale_wrap import (
    ClassifiedFSDP,
    ParamClass,
    UnitCallGuard,
    ViewGuard,
    WrapRequests,
    by_requires_grad,
    forget_stale_fairscale_groups,
    gradient_arrivals,
    gradients_kept_as_ddp,
    require_ties_kept,
    tie_safe_policy,
    unit_view,
)
from .full_gradients import full_fairscale_parameters
from .launcher import CanonicalStateLauncher, HandBack
from .optimizers import OptimizerNeed, refuse_unsupported_optimizers, retarget_schedulers, twin_optimizer
from .redirection import SubmoduleCallRouting

FSDP = FullyShardedDataParallel

FSDP_KWARGS = frozenset(inspect.signature(FSDP.__init__).parameters) - {"self", "module", "compute_device"}

# What stepping flat 1-D shards takes away from an optimizer's math (see optimizers.OptimizerNeed).
_REFUSED_OPTIMIZER_NEEDS = {
    OptimizerNeed.WHOLE_PARAMETERS: (
        "fairscale FSDP steps 1-D shards of flat parameters that concatenate the module's parameters (with"
        " flatten_parameters=False still a 1-D shard of each): no shape, no whole tensor"
    ),
    OptimizerNeed.ALL_PARAMETERS_AS_ONE: (
        "each rank steps only its shard, so each rank would compute other directions and run the closure, with"
        " its collectives, a different number of times (a hang)"
    ),
    OptimizerNeed.SPARSE_GRADIENTS: "fairscale FSDP flattens and shards gradients as dense tensors",
}

# A flat parameter's gradient is one tensor: an original parameter that got no gradient in a step has a zero slice in
# it where ddp leaves its gradient None (and the optimizer skips it). Which optimizers then still step it as ddp does:
# - without weight decay, every update of these is proportional to the gradients the parameter had so far, so a
#   parameter that never had one does not move;
_ZERO_GRADIENT_INERT = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.Adadelta,
        torch.optim.Rprop,
    }
)
# - these do not count the steps a parameter took part in (momentum buffers and sums start from zero either way), so a
#   parameter that skipped steps moves as under ddp once it gets gradients (Adam's bias correction counts every step
#   of the flat parameter instead);
_STEP_COUNT_FREE = frozenset({torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad})


def _moves_without_gradient(optimizer: Optimizer, group: Mapping[str, Any], had_gradient: bool) -> str | None:
    """Why a zero gradient slice moves a parameter (``None``: it does not), for a parameter of ``group``."""
    kind = type(optimizer)
    if group.get("weight_decay", 0):
        return f"weight_decay={group['weight_decay']}"
    if kind not in _ZERO_GRADIENT_INERT:
        return f"{kind.__name__} (not known to leave a parameter with zero gradients alone)"
    if had_gradient and not (
        kind is torch.optim.Adagrad or (kind in (torch.optim.SGD, torch.optim.RMSprop) and not group.get("momentum"))
    ):
        return "the momentum or running averages of its earlier gradients"
    return None


def _counts_steps(optimizer: Optimizer, group: Mapping[str, Any]) -> bool:
    return type(optimizer) not in _STEP_COUNT_FREE or bool(group.get("lr_decay", 0))


class FairScaleFSDPStrategy(DirectReferenceStrategy):
    """Fully sharded data parallel training with fairscale ``FullyShardedDataParallel``.

    The LightningModule is wrapped in a root FSDP (large submodules first, by ``auto_wrap_min_params``, never apart
    from the other users of a shared parameter; or the submodules ``fairscale.nn.wrap`` marked in ``configure_model``).
    ``configure_optimizers()`` is written as usual (any param groups, tied and frozen parameters, schedulers): its
    optimizers are copied over the flat parameters FSDP trains, one per param group and ``requires_grad`` in each FSDP
    instance. Between steps, read parameters inside :meth:`full_parameters`. Checkpoints are canonical
    (``state_dict_type="full"``, default) or one file per rank (``"sharded"``). With ``accelerator="cpu"`` the scoped
    patches of :mod:`lightning_strategies.fairscale_cpu` are applied while the strategy runs.

    Args:
        accelerator: The accelerator (set by the Trainer when omitted).
        parallel_devices: Devices of this node (set by the Trainer when omitted).
        cluster_environment: Cluster environment (set by the Trainer when omitted).
        checkpoint_io: Checkpoint IO plugin.
        precision_plugin: Precision plugin.
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default chosen from the device.
        timeout: Timeout of collective operations.
        start_method: ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
        hand_back: After a fork/spawn fit, ``"checkpoint"`` (the main process can save a complete checkpoint) or
            ``"weights"`` (weights only, less memory in the main process).
        auto_wrap_min_params: Submodules with at least this many parameters get their own FSDP; ``None`` wraps only
            the root. Ignored when ``configure_model`` already wrapped submodules.
        state_dict_type: ``"full"`` (one canonical file) or ``"sharded"`` (a directory, one file per rank).
        broadcast_buffers: Give every rank global rank 0's buffers that change in training (BatchNorm running
            statistics) before each forward, as ``ddp`` does; ``False`` keeps each rank's own (no collective).
        async_save: Write checkpoints in a background thread while training goes on (see the user guide,
            "Asynchronous saves"); only gathering or staging to the CPU blocks the step.
        **fsdp_kwargs: Passed to every ``FullyShardedDataParallel``: ``flatten_parameters``,
            ``reshard_after_forward``, ``mixed_precision``, ``compute_dtype``, ``fp32_reduce_scatter``,
            ``bucket_cap_mb``, ``cpu_offload``, ``move_grads_to_cpu``, ``state_dict_on_rank_0_only`` (default
            ``True`` here), ...

    Raises:
        TypeError: A keyword argument that ``FullyShardedDataParallel`` does not take.
        ValueError: An unknown ``state_dict_type``.
    """

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
        unknown = sorted(set(fsdp_kwargs) - FSDP_KWARGS)
        if unknown:
            raise TypeError(
                f"FairScaleFSDPStrategy got keyword argument(s) {', '.join(unknown)} that fairscale's"
                f" FullyShardedDataParallel does not take. It takes: {', '.join(sorted(FSDP_KWARGS))}"
                " (compute_device is set from the Trainer's device)."
            )
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
        # Per original parameter of a shared flat parameter: 1 had a gradient at a step, 2 had none at a step.
        self._gradient_history: dict[str, int] = {}
        self._gradients_checked = False  # whether the fit's first optimizer step was checked

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
            self._cpu_patched = fairscale_cpu.install(pin_memory=pin_memory)
            if self._cpu_patched:
                rank_zero_warn("fairscale FSDP runs on the CPU through scoped patches: for development and testing.")

    def _wrapper_kwargs(self) -> dict[str, Any]:
        return {**self._fsdp_kwargs, "compute_device": self.root_device}

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

    def _wrap(self, module: pl.LightningModule, param_class: ParamClass = by_requires_grad) -> FSDP:
        # Remember the module tree as it was, so teardown can put back every child this strategy wrapped.
        self._original_children = [
            (parent, name, child) for parent in module.modules() for name, child in parent.named_children()
        ]
        kwargs = {**self._wrapper_kwargs(), "param_class": param_class}
        user_wrapped = any(isinstance(child, FSDP) for child in module.modules())
        ties = tied_aliases(module)
        # The order of the plain module's state_dict, for the canonical state gathered unit by unit (references only).
        self._state_key_order = [] if user_wrapped else list(canonical_keys(module.state_dict(keep_vars=True)))

        def wrap_marked(child: Module, **given: Any) -> FSDP:
            return ClassifiedFSDP(child, **{**kwargs, **given})

        requested = self._wrap_requests.apply(module, wrap_marked)
        if not (user_wrapped or requested) and self._auto_wrap_min_params is not None:
            policy = tie_safe_policy(module, self._auto_wrap_min_params)
            with enable_wrap(wrapper_cls=ClassifiedFSDP, **kwargs):
                for name, child in list(module.named_children()):
                    setattr(module, name, auto_wrap(child, auto_wrap_policy=policy))
        root = ClassifiedFSDP(module, **kwargs)
        require_ties_kept(ties, root)
        self._units = flat_units(root)
        self._aliases = tied_aliases(root)
        self._view_guard = ViewGuard(root)
        self._view_guard.guard()
        if self._unit_guard is not None:
            self._unit_guard.remove()
        wrapped_by = (
            "fairscale.nn.wrap" if user_wrapped or requested else f"auto_wrap_min_params={self._auto_wrap_min_params}"
        )
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
        self._gradient_history = {}
        self._gradients_checked = False
        self.setup_optimizers(trainer)  # the user's optimizers, over the parameters as configure_optimizers saw them
        refuse_unsupported_optimizers(self.strategy_name, self.optimizers, module, _REFUSED_OPTIMIZER_NEEDS)
        group_of = {
            id(param): (index, group_index)
            for index, optimizer in enumerate(self.optimizers)
            for group_index, group in enumerate(optimizer.param_groups)
            for param in group["params"]
        }

        def param_class(param: Parameter) -> tuple[Any, bool]:
            # One flat parameter per param group (its hyper-parameters) and requires_grad (fairscale flattens only
            # equal ones): a layer's weight and bias may be in different groups, frozen weights next to trained ones.
            return group_of.get(id(param)), param.requires_grad

        root = self._wrap(module, param_class)
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
        layout = self._layouts.get(id(getattr(optimizer, "_optimizer", optimizer)))
        if layout is None:
            self._root().clip_grad_norm_(clip_val)
            return
        grads = [unit.param.grad for unit in layout.flat_units if unit.param.grad is not None]
        squares = torch.zeros((), dtype=torch.float32, device=self.root_device)
        for grad in grads:
            squares += grad.detach().float().pow(2).sum().to(self.root_device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(squares, group=self._root().process_group)
        coefficient = torch.clamp(float(clip_val) / (squares.sqrt() + 1e-6), max=1.0)
        for grad in grads:
            grad.detach().mul_(coefficient.to(grad.device, grad.dtype))

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
            with self._gradients_set_aside():  # back before Lightning's zero_grad and backward
                return super()._run_step(method_name, *args, **kwargs)
        with self._guarding_views(), self._gradients_set_aside():
            return super()._run_step(method_name, *args, **kwargs)

    @contextmanager
    def _gradients_set_aside(self) -> Generator[None, None, None]:
        """Takes the flat parameters' gradients off them for a step's forward and puts them back after.

        Between steps a flat parameter holds this rank's shard and the gradient of that shard; in forward its data is
        the full parameter while the gradient stays the shard's. ``torch.compile`` describes each parameter of a
        compiled submodule with its gradient, and fails on that one ("attempting to assign a gradient of size").
        A gradient accumulated under ``no_sync`` is the full one: it fits the gathered parameter and stays.
        """
        units = [
            unit for unit in self._units if unit.param.grad is not None and unit.param.grad.shape == unit.param.shape
        ]
        gradients = [unit.param.grad for unit in units]
        for unit in units:
            unit.param.grad = None
        try:
            yield None
        finally:
            for unit, gradient in zip(units, gradients, strict=True):
                unit.param.grad = gradient

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
        self._refuse_gradientless_flat_parameters(optimizer)
        if self._unit_guard is not None:  # the first step made every call the steps make (see UnitCallGuard)
            self._unit_guard.remove()
            self._unit_guard = None
        super()._after_closure(model, optimizer)

    def _refuse_gradientless_flat_parameters(self, optimizer: Optimizer) -> None:
        """Before a step: a parameter that shares a flat parameter and got no gradient (on any rank) is left alone as
        under ddp when it never had one (:meth:`_keep_untouched`); every rank raises if it had one and the step would
        move it (momentum), or if a step-counting optimizer steps it after steps it skipped (see ``_STEP_COUNT_FREE``).

        Hooks on the module's parameter views record on each rank which parameters a gradient reached; one
        all-reduce of those flags per step (every rank, for every optimizer that steps shared flat parameters: the
        same decision everywhere) combines them. Checked at every step: a parameter used in some batches only
        (a conditional branch) is the same case as one never used.
        """
        if id(optimizer) not in self._layouts:
            return
        # At the fit's first step every optimizer's parameters that hold gradients are judged, so that a refusal comes
        # before any optimizer stepped (a two-optimizer step gives both networks gradients in its first pass); later,
        # each optimizer's own parameters before its step.
        first = not self._gradients_checked
        self._gradients_checked = True
        judged = [candidate for candidate in self.optimizers if first or candidate is optimizer]
        tracked = [
            (candidate, unit, group)
            for candidate in judged
            if id(candidate) in self._layouts
            for group, units in zip(candidate.param_groups, self._layouts[id(candidate)].group_units, strict=True)
            for unit in units
            if isinstance(unit.param, FlatParameter) and len(unit.names) > 1
        ]
        if not tracked:  # decided by the wrapping alone: the same on every rank
            return
        flags = [
            flag for _, unit, _ in tracked for flag in (gradient_arrivals(unit.param) or [False] * len(unit.names))
        ]
        arrived = torch.tensor(flags, dtype=torch.float32, device=self.root_device)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.all_reduce(arrived)
        combined = (arrived > 0).tolist()
        problems: list[str] = []
        untouched: list[tuple[FlatUnit, int]] = []
        position = 0
        for candidate, unit, group in tracked:
            got = combined[position : position + len(unit.names)]
            position += len(unit.names)
            stepped = candidate is optimizer  # the others' history is written at their own steps
            if unit.param.grad is None or not unit.param.requires_grad or all(got):
                if unit.param.grad is not None and stepped:
                    for name in unit.names:
                        self._gradient_history[name] = self._gradient_history.get(name, 0) | 1
                continue
            for name, has_gradient in zip(unit.names, got, strict=True):
                history = self._gradient_history.get(name, 0)
                if has_gradient:
                    if history & 2 and _counts_steps(candidate, group):
                        problems.append(
                            f"{name!r} (gets a gradient after steps without one: {type(candidate).__name__} counted"
                            " those steps for it, ddp does not)"
                        )
                    if stepped:
                        self._gradient_history[name] = history | 1
                    continue
                why = _moves_without_gradient(candidate, group, had_gradient=bool(history & 1))
                if why is not None and not history & 1:
                    if stepped:  # never had a gradient: put back what the step changes (see _keep_untouched)
                        untouched.append((unit, unit.names.index(name)))
                elif why is not None:
                    problems.append(f"{name!r} (no gradient; {why} would move it)")
                if stepped:
                    self._gradient_history[name] = history | 2
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise RuntimeError(
                "fsdp_fairscale with flattened parameters cannot train parameters that had gradients and get none in"
                " a step while others flattened with them do (pass flatten_parameters=False to FairScaleFSDPStrategy,"
                f" or give every parameter a gradient in each step): {shown}. fairscale gives them a zero gradient"
                " slice where ddp gives them none and leaves them alone; this optimizer step was not taken."
            )
        if untouched:
            self._keep_untouched(optimizer, untouched)

    @staticmethod
    def _keep_untouched(optimizer: Optimizer, untouched: list[tuple[FlatUnit, int]]) -> None:
        """Around this step of ``optimizer``: parameters that never had a gradient end it as they began, as under ddp.

        Each is a slice of a flat parameter whose gradient slice is zero; the step (weight decay) would move it and
        write its optimizer state. This rank's part of each slice is copied before the step and written back after it
        (state that the step created is zeroed there: ddp has none). Exact while the parameter gets no gradient;
        Adam's step count, shared by the flat parameter, is refused once it does (``_counts_steps``).
        """
        saved: list[tuple[Parameter, Tensor, slice, Tensor, dict[str, Tensor]]] = []
        for unit, index in untouched:
            shard = unit.local_shard
            start = unit.instance.rank * shard.numel()
            offset = sum(shape.numel() for shape in unit.shapes[:index])
            begin = max(offset, start) - start
            end = min(offset + unit.shapes[index].numel(), start + shard.numel()) - start
            if begin >= end:
                continue  # another rank holds it
            part = slice(begin, end)
            state = {
                key: value[part].clone()
                for key, value in optimizer.state.get(unit.param, {}).items()
                if isinstance(value, Tensor) and value.shape == shard.shape
            }
            saved.append((unit.param, shard, part, shard[part].clone(), state))
        if not saved:
            return

        def write_back(stepped: Optimizer, args: Any, kwargs: Any) -> None:
            handle.remove()
            for param, shard, part, values, state in saved:
                shard[part].copy_(values)
                for key, value in stepped.state.get(param, {}).items():
                    if isinstance(value, Tensor) and value.shape == shard.shape:
                        value[part].copy_(state[key]) if key in state else value[part].zero_()

        handle = optimizer.register_step_post_hook(write_back)

    def _unshard_into_module(self) -> None:
        """Gives the LightningModule back its own full parameters and submodules, as before setup.

        The process goes on running the user's script (one script per rank, or a single process), so the module must
        work again: every rank gathers the full parameters once, the original parameters are registered again with
        them (tied ones as one parameter again), and the children this strategy wrapped (its own choice or marked
        with ``fairscale.nn.wrap``) replace their wrappers. Submodules wrapped in FSDP by hand stay wrapped.
        """
        root = self._root()
        flattened: list[tuple[Module, str, Tensor, bool]] = []
        tied: list[tuple[Module, str, Module, str]] = []
        sharded: list[tuple[Parameter, Tensor]] = []
        with root.summon_full_params(recurse=True, volatile=True):
            for unit in self._units:
                if isinstance(unit.param, FlatParameter):
                    for _, owner, name in unit.param._param_infos:
                        full = getattr(owner, name).detach().clone()
                        flattened.append((owner, name, full, unit.param.requires_grad))
                    shared = unit.param._shared_param_infos
                    tied += [(owner, name, holder, of) for *_, owner, name, holder, of in shared]
                else:
                    sharded.append((unit.param, unit.param.detach().clone()))
        for owner, name, full, requires_grad in flattened:
            if hasattr(owner, name):
                delattr(owner, name)
            owner.register_parameter(name, Parameter(full, requires_grad=requires_grad))
        for owner, name, holder, holder_name in tied:  # one parameter again, as before wrapping
            if hasattr(owner, name):
                delattr(owner, name)
            owner.register_parameter(name, getattr(holder, holder_name))
        for param, full in sharded:
            param.data = full
        for parent, name, child in self._original_children:
            if getattr(parent, name, None) is not child:
                setattr(parent, name, child)
            vars(child).pop("_unflattened_param_views", None)
        vars(self.require_lightning_module()).pop("_unflattened_param_views", None)

    @override
    def teardown(self) -> None:
        in_place = not isinstance(self.launcher, CanonicalStateLauncher)
        # After a failure the process group is gone (see on_exception): the module keeps its shards.
        if in_place and isinstance(self.model, FSDP) and not self.failed:
            self._unshard_into_module()  # before the root goes and while the CPU patches are in place
        super().teardown()  # gathers the final weights for the launcher: the patches must still be in place
        # The layouts stay until the next setup: after an in-place fit the optimizers still hold flat shards, and
        # `trainer.save_checkpoint` after `fit` gathers them into canonical state through these layouts.
        self._units, self._original_children, self._view_guard = [], [], None
        if self._unit_guard is not None:
            self._unit_guard.remove()
            self._unit_guard = None
        self._routing = None  # it holds the root wrapper, which the run no longer needs
        if self._cpu_patched:
            fairscale_cpu.uninstall()
            self._cpu_patched = False

    # ------------------------------------------------------------------ model state

    def _expected_model_state(self) -> dict[str, Any]:
        """Canonical keys with meta tensors of the canonical shapes and dtypes (no memory, no collective); a module's
        extra state (``get_extra_state``) as it is now."""
        expected: dict[str, Any] = {
            join_name(canonical_name(name), "_extra_state"): module.get_extra_state()
            for name, module in self._root().named_modules()
            if type(module).get_extra_state is not Module.get_extra_state
        }
        for unit in self._units:
            for name, shape in zip(unit.names, unit.shapes, strict=True):
                expected[name] = torch.empty(shape, dtype=unit.param.dtype, device="meta")
        for key, buffer in persistent_buffers(self._root()):
            expected[key] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")
        for alias, holder in self._aliases.items():  # a plain module's state_dict names a tied parameter each time
            expected[alias] = expected[holder]
        return expected

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
        # Each flat shard is gathered to rank 0 only and cut into the parameters it holds (fairscale's state_dict
        # would gather every full parameter on every rank); buffers are whole on every rank.
        state: dict[str, Any] = {}
        for unit in self._units:
            full = gather_full(unit.local_shard, unit.numel, unit.instance.process_group)
            if full is not None:
                state.update(zip(unit.names, split_full(full.cpu(), unit.shapes, copy=False), strict=True))
        if not self.is_global_zero:
            return {}
        for key, buffer in persistent_buffers(root):
            state[key] = buffer.detach().cpu().clone()
        for alias, holder in self._aliases.items():  # the same tensor, as in a plain module's state_dict
            state[alias] = state[holder]
        if set(self._state_key_order) == set(state):
            state = {key: state[key] for key in self._state_key_order}
        return state

    @override
    def _load_canonical_model_state(self, state: Mapping[str, Any], strict: bool) -> None:
        root = self._root()
        check_model_state(self._expected_model_state(), state, strict=strict, source=self._checkpoint_source)
        with self._guarding_views():  # the keys the root's state_dict uses (a compiled submodule's `_orig_mod`)
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
        layout = self._layout_of(optimizer)
        index = layout.index
        state: dict[int, dict[str, Any]] = {}
        for unit in layout.flat_units:
            for key, value in optimizer.state.get(unit.param, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0:
                    full = gather_full(value, unit.numel, unit.instance.process_group)
                    # Views of the gathered buffer: the canonical state adds no second full copy.
                    parts = split_full(full.cpu(), unit.shapes, copy=False) if full is not None else []
                else:  # a scalar such as Adam's step: one independent copy per parameter (steps count in place)
                    parts = [value.detach().cpu().clone() if isinstance(value, Tensor) else value for _ in unit.names]
                for name, part in zip(unit.names, parts, strict=False):
                    state.setdefault(index[name], {})[key] = part
        if not self.is_global_zero:
            return {}
        groups = [
            {**{key: value for key, value in group.items() if key != "params"}, "params": [index[n] for n in names]}
            for group, names in zip(optimizer.param_groups, layout.group_names, strict=True)
        ]
        return {"state": dict(sorted(state.items())), "param_groups": groups}

    @override
    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        layout = self._layout_of(optimizer)
        index = layout.index
        flat_state: dict[int, dict[str, Any]] = {}
        for flat_index, unit in enumerate(layout.flat_units):
            entries = [state["state"].get(index[name]) for name in unit.names]
            present = [entry for entry in entries if entry]
            if not present:
                continue
            flat_state[flat_index] = {}
            for key in dict.fromkeys(key for entry in present for key in entry):
                sample = next(entry[key] for entry in present if key in entry)
                if isinstance(sample, Tensor) and sample.dim() > 0:
                    # A parameter that never had a gradient has no state in a plain optimizer: zeros stand in.
                    tensors = [
                        entry[key] if entry and key in entry else torch.zeros(shape, dtype=sample.dtype)
                        for entry, shape in zip(entries, unit.shapes, strict=True)
                    ]
                    shard = local_shard(tensors, unit.instance.rank, unit.instance.world_size)
                    flat_state[flat_index][key] = shard.to(unit.param.device)
                else:
                    flat_state[flat_index][key] = sample.clone() if isinstance(sample, Tensor) else sample
        flat_groups = []
        position = 0
        for group, units in zip(state["param_groups"], layout.group_units, strict=True):
            hyper = {key: value for key, value in group.items() if key != "params"}
            flat_groups.append({**hyper, "params": list(range(position, position + len(units)))})
            position += len(units)
        optimizer.load_state_dict({"state": flat_state, "param_groups": flat_groups})

    # ------------------------------------------------------------------ sharded checkpoints

    @override
    def sharded_format(self) -> FairScaleLocalShards:
        return FairScaleLocalShards(self)
