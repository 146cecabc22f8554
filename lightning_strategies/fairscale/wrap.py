"""How FairScaleFSDPStrategy wraps a module: flat parameters by class, tied parameters kept together, guarded views.

- One flat parameter has one set of hyper-parameters and one ``requires_grad``. fairscale's flatten wrapper can hold
  several flat parameters; :class:`ClassifiedFSDP` gives it one per class of parameters (by default: per
  ``requires_grad``; during fit: per optimizer param group and ``requires_grad``), so a layer's weight and bias can
  be in different param groups and frozen parameters can sit next to trained ones.
- A parameter shared by two submodules must be sharded by one FSDP instance, or each instance trains its own copy:
  :func:`tie_safe_policy` never wraps a submodule whose parameters are also used outside it, and
  :func:`require_ties_kept` refuses a model whose ties were split anyway.
- Between steps a flattened module's parameter attributes are views of freed storage; reading one crashes the
  process or returns garbage. :class:`ViewGuard` puts :class:`NotGatheredParameter` placeholders there, which raise
  an error that names ``trainer.strategy.full_parameters()``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
from fairscale.nn.data_parallel import FullyShardedDataParallel, TrainingState
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter, FlattenParamsWrapper
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap
from torch import Tensor
from torch.nn import Module, Parameter
from torch.optim import Optimizer

from lightning_strategies._torch_private import torch_function_subclass_disabled
from lightning_strategies.checkpoint.model_state import COMPILED_SEGMENT
from lightning_strategies.fairscale._private import (
    FlattenHooks,
    FSDPHooks,
    cached_process_groups,
    drop_cached_process_groups,
    free_full_params,
    has_cpu_gradient_buffer,
    lazy_init,
    param_infos,
    replace_flatten_wrapper,
    shared_param_infos,
    use_fp32_param_shard,
)
from lightning_strategies.fairscale.layout import (
    FlatUnit,
    canonical_name,
    fsdp_instances,
    join_name,
    tied_aliases,
)

from ..strategies.full_gradients import FairScaleUnitView
from .gradients import record_gradient_arrivals

ParamClass = Callable[[Parameter], Hashable]


def by_requires_grad(param: Parameter) -> Hashable:
    """The default class of a parameter: trained or frozen (fairscale flattens only equal ``requires_grad``)."""
    return param.requires_grad


def by_param_group(optimizers: Sequence[Optimizer]) -> ParamClass:
    """The class of a parameter during fit: its optimizer's param group (its hyper-parameters) and ``requires_grad``
    (fairscale flattens only equal ones), so a layer's weight and bias may be in different groups and frozen weights
    sit next to trained ones."""
    group_of = {
        id(param): (index, group_index)
        for index, optimizer in enumerate(optimizers)
        for group_index, group in enumerate(optimizer.param_groups)
        for param in group["params"]
    }

    def param_class(param: Parameter) -> Hashable:
        return group_of.get(id(param)), param.requires_grad

    return param_class


class _ClassifiedFlattenParamsWrapper(FlattenHooks):
    """A flatten wrapper that splits the one parameter list FSDP gives it into one list per class of parameters."""

    param_class: ParamClass = by_requires_grad  # set for the duration of one FSDP constructor call

    def __init__(self, module: Module, param_list: Any = None, flat_param_names: Any = None) -> None:
        params: list[Parameter] = [param for group in param_list or [] for param in group]
        if params and flat_param_names is None:
            classes: dict[Hashable, list[Parameter]] = {}
            for param in params:
                classes.setdefault(type(self).param_class(param), []).append(param)
            param_list = list(classes.values())
        super().__init__(module, param_list=param_list, flat_param_names=flat_param_names)

    def unflatten_params_as_views(self) -> None:
        super().unflatten_params_as_views()
        if torch.is_grad_enabled():
            for flat in self.flat_params:
                record_gradient_arrivals(flat)


@contextmanager
def _flatten_by(param_class: ParamClass) -> Iterator[None]:
    """While an FSDP is constructed, its flatten wrapper gets one parameter list per class instead of one in all.

    ``FullyShardedDataParallel.__init__`` passes all its parameters as a single list to ``FlattenParamsWrapper``,
    which itself accepts a list of lists (one flat parameter each). The name is replaced in fairscale's module by a
    subclass for the duration of one constructor call only (isinstance checks keep holding).
    """
    _ClassifiedFlattenParamsWrapper.param_class = param_class
    original = replace_flatten_wrapper(_ClassifiedFlattenParamsWrapper)
    try:
        yield
    finally:
        replace_flatten_wrapper(original)
        _ClassifiedFlattenParamsWrapper.param_class = by_requires_grad


_REDUCED = "_lightning_strategies_reduced"


class ClassifiedFSDP(FSDPHooks):
    """A ``FullyShardedDataParallel`` that flattens each class of parameters into a flat parameter of its own.

    Args:
        module: The module to wrap.
        param_class: The class of each parameter; parameters of one class share a flat parameter (in the order
            the classes first appear). Default: :func:`by_requires_grad`.
        **kwargs: ``FullyShardedDataParallel``'s options.
    """

    def __init__(self, module: Module, *, param_class: ParamClass = by_requires_grad, **kwargs: Any) -> None:
        self._finalizing = False
        with _flatten_by(param_class):
            super().__init__(module, **kwargs)

    def use_full_params(self) -> None:
        # fairscale's pre-backward hook of an instance that keeps its parameters gathered after forward (the root, or
        # reshard_after_forward=False) asserts they still are. With several forward passes before one backward pass
        # (a manual-optimization step calls `self.encoder(x)` and `self.head(h)`, each a pass of the root) the
        # post-backward hook of a parameter the later pass used frees them before the earlier pass's backward begins:
        # gather them again instead (a collective every rank reaches in the same backward pass).
        if not self.has_full_params:
            self.rebuild_full_params()
        super().use_full_params()

    def assert_state(self, state: Any) -> None:
        # At the end of a backward pass fairscale asserts that every instance holding parameters that require
        # gradients got one (BACKWARD_POST). Under ddp (find_unused_parameters=True) a submodule whose parameters get
        # no gradient (called under no_grad, its output detached, or not called) trains on: such an instance has
        # nothing to reduce and is simply finished (IDLE or BACKWARD_PRE is its true state).
        expected = [state] if isinstance(state, TrainingState) else list(state)
        idle = (TrainingState.IDLE, TrainingState.BACKWARD_PRE)
        if self._finalizing and expected == [TrainingState.BACKWARD_POST] and self.training_state in idle:
            return
        super().assert_state(state)

    def wait_for_post_backward(self) -> None:
        instances = [instance for instance in self.modules() if isinstance(instance, ClassifiedFSDP)]
        for instance in instances:
            lazy_init(instance)  # an instance whose module was never called has no gathering buffers to free yet
            instance._finalizing = True
        # With move_grads_to_cpu fairscale gives every parameter its CPU gradient buffer as .grad after a synchronised
        # backward pass, one that got no gradient in it too (zeros, or the last step's values): weight decay and
        # momentum then moved it where ddp leaves it alone. Such a parameter keeps the .grad it had before the pass.
        synced = self.syncs_gradients
        before = [
            (param, param.grad)
            for instance in instances
            for param in instance.params
            if synced and param.requires_grad and has_cpu_gradient_buffer(param)
        ]
        if synced:
            # fairscale reshards every instance after a synchronised backward pass except the root, whose parameters
            # the pass may have gathered again after their post-backward hook had resharded them (above), and whose
            # frozen or unused parameters no hook reshards: the optimizer must step shards, so the root reshards too
            # (before fairscale checks that each gradient shard fits its parameter).
            free_full_params(self)
            use_fp32_param_shard(self)
        try:
            super().wait_for_post_backward()
        finally:
            for instance in instances:
                instance._finalizing = False
        for param, grad in before:
            if not vars(param).pop(_REDUCED, False):
                param.grad = grad

    def post_reduction_hook(self, param: Parameter, reduced_grad: Tensor) -> None:
        vars(param)[_REDUCED] = True  # this backward pass reduced a gradient for it
        super().post_reduction_hook(param, reduced_grad)


class WrapRequests:
    """Submodules that ``fairscale.nn.wrap`` marked in ``configure_model``, wrapped once the optimizers exist.

    Wrapping flattens: a submodule wrapped in ``configure_model`` would show ``configure_optimizers()`` a flat
    parameter (``..._fsdp_wrapped_module.flat_param_0``) instead of its weights and biases, and param groups chosen
    by name would silently take the wrong parameters. So ``wrap`` only marks the submodule (it returns it
    unchanged), and :meth:`apply` wraps the marked ones, innermost first, when the strategy wraps the model.
    """

    def __init__(self) -> None:
        self.requests: list[tuple[Module, dict[str, Any]]] = []

    def marker(self) -> type:
        """The ``wrapper_cls`` for ``enable_wrap``: calling it records the submodule and its options."""
        requests = self.requests

        class MarkedForWrapping:
            def __new__(cls, module: Module, **overrides: Any) -> Module:  # type: ignore[misc]
                requests.append((module, overrides))
                return module

        return MarkedForWrapping

    def apply(self, model: Module, make: Callable[..., Module]) -> bool:
        """Wraps every marked submodule of ``model`` with ``make(submodule, **overrides)``; whether any was."""
        path_of = {id(submodule): path for path, submodule in model.named_modules()}
        marked = [(path_of[id(module)], overrides) for module, overrides in self.requests if path_of.get(id(module))]
        self.requests.clear()
        for path, overrides in sorted(marked, key=lambda item: -item[0].count(".")):  # innermost first
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            setattr(parent, name, make(getattr(parent, name), **overrides))
        return bool(marked)


def tie_safe_policy(model: Module, min_num_params: int) -> Callable[..., bool]:
    """fairscale's ``default_auto_wrap_policy``, except that a submodule sharing parameters with others stays unwrapped.

    Wrapping such a submodule would flatten its copy of the shared parameter apart from the other users' (GPT-2's
    ``wte`` and ``lm_head``): training would silently untie them. Its parameters go to the nearest wrapped ancestor
    that holds every user (in the end the root).

    Args:
        model: The whole module being wrapped (every user of every parameter).
        min_num_params: As in ``default_auto_wrap_policy``.

    Returns:
        The policy for ``fairscale.nn.wrap.auto_wrap``.
    """
    uses = Counter(id(param) for _, param in model.named_parameters(remove_duplicate=False))
    # Modules inside a submodule compiled with torch.compile (registered below its `_orig_mod`): dynamo would trace
    # a wrapper's forward inside the compiled one, and fails on it. The compiled submodule is wrapped whole or not.
    compiled = {id(inner) for path, inner in model.named_modules() if COMPILED_SEGMENT in path.split(".")}

    def policy(module: Module, recurse: bool, **sizes: Any) -> bool:
        # `sizes`: fairscale's counts of parameters not yet wrapped and whether the module is the root, by keyword.
        if id(module) in compiled:
            return False
        if not default_auto_wrap_policy(module=module, recurse=recurse, min_num_params=min_num_params, **sizes):
            return False
        if recurse:
            return True
        inside = Counter(id(param) for _, param in module.named_parameters(remove_duplicate=False))
        return all(count == uses[key] for key, count in inside.items() if key in uses)

    return policy


def require_ties_kept(before: Mapping[str, str], root: Module) -> None:
    """Refuses a wrapped model in which parameters that were tied before wrapping are no longer one parameter.

    Args:
        before: :func:`~lightning_strategies.fairscale.layout.tied_aliases` of the module before wrapping.
        root: The wrapped model.

    Raises:
        ValueError: Naming the split names and the fix.
    """
    after = tied_aliases(root)
    split = [(alias, holder) for alias, holder in before.items() if after.get(alias) != holder]
    if split:
        pairs = "; ".join(f"{alias!r} and {holder!r}" for alias, holder in split[:3])
        raise ValueError(
            f"Tied parameters were wrapped into different FSDP instances ({pairs}{' ...' if len(split) > 3 else ''}):"
            " each instance would train its own copy. A submodule wrapped in configure_model (fairscale.nn.wrap)"
            " shares a parameter with a module outside it. Wrap a module that holds every user of the shared"
            " parameter, or leave that submodule to the strategy's auto-wrapping (it keeps shared parameters"
            " together)."
        )


def wrap_model(
    module: Module, kwargs: Mapping[str, Any], requests: WrapRequests, auto_wrap_min_params: int | None
) -> tuple[ClassifiedFSDP, str]:
    """Wraps ``module``: the submodules marked with ``fairscale.nn.wrap`` (else, unless the user wrapped some, the
    large ones, keeping shared parameters together), then the root.

    Args:
        module: The LightningModule.
        kwargs: The options of every ``ClassifiedFSDP``.
        requests: The submodules marked in ``configure_model``.
        auto_wrap_min_params: The size from which a submodule gets its own FSDP; ``None``: the root only.

    Returns:
        The root, and what chose the nested instances (for error messages).

    Raises:
        ValueError: Parameters tied before wrapping are no longer one parameter (see :func:`require_ties_kept`).
    """
    user_wrapped = any(isinstance(child, FullyShardedDataParallel) for child in module.modules())
    ties = tied_aliases(module)

    def wrap_marked(child: Module, **given: Any) -> ClassifiedFSDP:
        return ClassifiedFSDP(child, **{**kwargs, **given})

    requested = requests.apply(module, wrap_marked)
    if not (user_wrapped or requested) and auto_wrap_min_params is not None:
        policy = tie_safe_policy(module, auto_wrap_min_params)
        with enable_wrap(wrapper_cls=ClassifiedFSDP, **kwargs):
            for name, child in list(module.named_children()):
                setattr(module, name, auto_wrap(child, auto_wrap_policy=policy))
    root = ClassifiedFSDP(module, **kwargs)
    require_ties_kept(ties, root)
    wrapped_by = "fairscale.nn.wrap" if user_wrapped or requested else f"auto_wrap_min_params={auto_wrap_min_params}"
    return root, wrapped_by


class NotGatheredParameterError(RuntimeError):
    """A flattened module's parameter attribute was used between steps, where it holds no value."""


class NotGatheredParameter(Tensor):
    """Stands in a module's parameter attribute while fairscale FSDP holds only this rank's flat shard.

    Its shape, dtype and device are those of the full parameter; computing with it raises
    :class:`NotGatheredParameterError` naming the way to the full values.
    """

    parameter_name: str

    _DESCRIBING = frozenset({"shape", "dtype", "device", "size", "dim", "numel", "requires_grad", "ndim", "is_meta"})

    @classmethod
    def create(cls, name: str, shape: torch.Size, dtype: torch.dtype) -> NotGatheredParameter:
        """A placeholder (no memory: a meta tensor) for the parameter ``name``."""
        placeholder = torch.empty(shape, dtype=dtype, device="meta").as_subclass(cls)
        placeholder.parameter_name = name
        return placeholder

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None
    ) -> Any:
        described = getattr(getattr(func, "__self__", None), "__name__", None) or getattr(func, "__name__", "")
        if described in cls._DESCRIBING or described == "__repr__":
            with torch_function_subclass_disabled():
                return func(*args, **(kwargs or {}))
        names = sorted({arg.parameter_name for arg in args if isinstance(arg, NotGatheredParameter)})
        raise NotGatheredParameterError(
            f"{', '.join(map(repr, names)) or 'A parameter'} holds no value here: fsdp_fairscale keeps only each rank's"
            " shard of the flattened parameters between steps (only the module's forward and backward see them"
            " whole). Read parameters in hooks and callbacks inside `with trainer.strategy.full_parameters():`"
            " (on every rank), or pass flatten_parameters=False to keep them as (sharded) parameters."
        )


class ViewGuard:
    """Puts :class:`NotGatheredParameter` placeholders where a flattened module's parameter views would dangle."""

    def __init__(self, root: FullyShardedDataParallel) -> None:
        self._placeholders: list[tuple[Module, str, NotGatheredParameter]] = []
        for prefix, instance in fsdp_instances(root):
            for param in instance.params:
                if not isinstance(param, FlatParameter):
                    continue
                shapes = dict(zip(param.metadata()[0], param.metadata()[1], strict=True))
                placeholder_of: dict[tuple[int, str], NotGatheredParameter] = {}
                for path, owner, name in param_infos(param):
                    full_name = f"{path}.{name}" if path else name
                    display = join_name(prefix, canonical_name(full_name))
                    placeholder = NotGatheredParameter.create(display, shapes[full_name], param.dtype)
                    placeholder_of[(id(owner), name)] = placeholder
                    self._placeholders.append((owner, name, placeholder))
                for _, _, owner, name, holder, holder_name in shared_param_infos(param):
                    shared = placeholder_of[(id(holder), holder_name)]  # tied attributes stay one object
                    self._placeholders.append((owner, name, shared))

    def guard(self) -> None:
        """Replaces every flattened parameter attribute by its placeholder (no collective, no memory)."""
        for owner, name, placeholder in self._placeholders:
            if name not in owner._parameters:  # inside summon_full_params they are real parameters: leave them
                setattr(owner, name, placeholder)


class UnitBypassedError(RuntimeError):
    """A submodule sharded by a nested FSDP instance ran outside that instance's forward (parameters not gathered)."""


_GATHERED_STATES = ("FORWARD", "BACKWARD_PRE", "SUMMON_FULL_PARAMS")


class UnitCallGuard:
    """Refuses a call of a submodule sharded by a nested FSDP instance, made outside that instance's forward.

    fairscale gathers an instance's parameters in that instance's forward only. A step that reaches a submodule of a
    wrapped child without calling the child (``self.model.encode(x)``, a method; ``self.model.stem(x)``) computed with
    1-D shards (``mat2 must be a matrix``) or, flattened, with no values at all. A forward pre-hook on each module
    that owns such parameters names the call, the instance and the fix before anything is computed. The hooks are
    removed after the first optimizer step (a step's calls are its code: the first one has made them all).
    """

    def __init__(self, root: FullyShardedDataParallel, wrapped_by: str) -> None:
        self._handles: list[Any] = []
        self._wrapped_by = wrapped_by
        nearest: dict[int, tuple[str, FullyShardedDataParallel]] = {}
        for prefix, instance in fsdp_instances(root):  # outer before inner: the innermost instance wins
            if instance is root:
                continue
            for module in instance.modules():
                nearest[id(module)] = (prefix, instance)
        if not nearest:
            return
        for path, module in root.named_modules():
            found = nearest.get(id(module))
            if found is None or isinstance(module, (FullyShardedDataParallel, FlattenParamsWrapper)):
                continue
            owns = bool(module._parameters) or any(
                isinstance(param, FlatParameter) and any(owner is module for _, owner, _ in param_infos(param))
                for param in found[1].params
            )
            if owns or any(isinstance(value, NotGatheredParameter) for value in vars(module).values()):
                hook = partial(self._require_gathered, canonical_name(path), found[0], found[1])
                self._handles.append(module.register_forward_pre_hook(hook))

    def _require_gathered(
        self, name: str, unit_name: str, instance: FullyShardedDataParallel, module: Module, args: Any
    ) -> None:
        if instance.training_state.name in _GATHERED_STATES:
            return
        raise UnitBypassedError(
            f"{name!r} ran outside the forward of {unit_name!r}, the FSDP unit that shards its parameters"
            f" ({self._wrapped_by} wrapped it): fairscale gathers a unit's parameters in its own"
            f" forward only, and this call reaches {name!r} without calling {unit_name!r} (through one of its methods,"
            f" or directly). Call {unit_name!r} itself (its forward), or wrap the root only (auto_wrap_min_params=None,"
            " nothing marked with fairscale.nn.wrap): every call in a step then sees full parameters."
        )

    def remove(self) -> None:
        """Removes the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def unit_view(unit: FlatUnit) -> FairScaleUnitView:
    """What the full-gradients context needs of a unit: where its original parameters live on their modules."""
    param = unit.param
    owners: list[tuple[Module, str]] = []
    shared: list[tuple[Module, str, int]] = []
    if isinstance(param, FlatParameter):
        owners = [(owner, name) for _, owner, name in param_infos(param)]
        position = {(id(owner), name): index for index, (owner, name) in enumerate(owners)}
        for _, _, owner, name, source, source_name in shared_param_infos(param):
            shared.append((owner, name, position[(id(source), source_name)]))
    instance = unit.instance
    return FairScaleUnitView(
        param,
        unit.shapes,
        owners,
        shared,
        rank=instance.rank,
        world_size=instance.world_size,
        group=instance.process_group,
        flat=isinstance(param, FlatParameter),
    )


def forget_stale_fairscale_groups() -> None:
    """Drops fairscale's process-group cache when it holds groups of a process group that no longer exists.

    fairscale caches the groups FSDP uses for the life of the process, keyed by name and ranks only. After a process
    group is destroyed and created again (a second run in one process, or a worker forked from a process that ran
    one) the cached groups are dead and every collective on them fails with "Group ... is not registered".
    """
    try:
        for group in cached_process_groups():
            torch.distributed.get_global_rank(group, 0)
    except (ValueError, RuntimeError):
        drop_cached_process_groups()
