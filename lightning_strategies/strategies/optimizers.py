"""Re-creating the optimizers that ``configure_optimizers()`` returned, for wrappers that need other ones.

Sharded DDP needs OSS optimizers, FSDP needs optimizers over the parameters the wrapper created. Neither calls the
optimizer's constructor again: ``type(optimizer)(params, **optimizer.defaults)`` fails for classes whose ``defaults``
hold keys their constructor does not take (torch 2.13's ``AdamW``, many users' own optimizers), and loses whatever
the constructor did besides storing hyper-parameters (``Adagrad``'s initial sums). A *twin* is made instead: the same
object's attributes over other parameters. State the optimizer already held goes to the twin in canonical form,
through the strategy's own loader.

Not every optimizer's math survives sharding. :func:`refuse_unsupported_optimizers` names, before any collective,
the optimizers a strategy cannot step exactly (an optimizer that needs each parameter whole, one that treats all
parameters as one vector, sparse gradients), and :func:`step_on_local_shards` runs element-wise optimizers that
DTensor cannot dispatch on the local shards of ``fully_shard``'s parameters.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from .._lightning import LRSchedulerConfig

# Instance attributes that belong to one optimizer object and must not travel to its twin: an LR scheduler wraps the
# optimizer's ``step`` on the instance (the wrapper calls the original object), and marks it once stepped.
_OBJECT_BOUND = ("step", "_opt_called")


def twin_optimizer(optimizer: Optimizer, param_groups: Iterable[dict[str, Any]]) -> Optimizer:
    """An optimizer of the same class and attributes as ``optimizer``, over ``param_groups`` and without state.

    The constructor is not called again, so a user's subclass with constructor arguments of its own is twinned as
    it is, and the twin's hyper-parameters are exactly the original's. Hooks registered on the original are copied.

    Args:
        optimizer: The optimizer ``configure_optimizers()`` returned.
        param_groups: The new groups: hyper-parameters and ``"params"``; missing hyper-parameters come from
            ``optimizer.defaults``.

    Returns:
        The twin. Its ``state`` is empty: load the original's (``optimizer.state_dict()``) where it had any.

    Raises:
        ValueError: An attribute of ``optimizer`` (besides ``param_groups`` and ``state``) refers to its parameters:
            the twin would step other parameters than that attribute names.
    """
    _refuse_parameter_attributes(optimizer)
    # Not copy.copy: it runs Optimizer.__setstate__, which adds "differentiable" to the defaults (shared with the
    # original) of a user's class that has none, and the twin's param groups would then differ from the original's.
    twin = object.__new__(type(optimizer))
    attributes = vars(twin)
    attributes.update(vars(optimizer))
    for name in _OBJECT_BOUND:
        attributes.pop(name, None)
    for name, value in vars(optimizer).items():
        if name.startswith("_optimizer_") and isinstance(value, OrderedDict):  # step/state-dict hooks
            attributes[name] = OrderedDict(value)
    attributes["defaults"] = dict(optimizer.defaults)
    attributes["state"] = defaultdict(dict)
    attributes["param_groups"] = []
    for group in param_groups:
        twin.add_param_group(dict(group))
    return twin


def retarget_schedulers(configs: Sequence[LRSchedulerConfig], old: Optimizer, new: Optimizer) -> None:
    """Points every LR scheduler (and the schedulers it chains) that drove ``old`` at ``new``."""
    if old is new:
        return
    for config in configs:
        _retarget(config.scheduler, old, new)


def _retarget(scheduler: Any, old: Optimizer, new: Optimizer) -> None:
    for inner in getattr(scheduler, "_schedulers", ()):
        _retarget(inner, old, new)
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        # torch wraps the optimizer's step at scheduler creation to warn about a scheduler stepping first; the new
        # optimizer was not wrapped, so mark it the way torch does, or every run would warn falsely.
        _mark_step_tracked(new)


def _mark_step_tracked(optimizer: Optimizer) -> None:
    step = optimizer.step
    if getattr(step, "_wrapped_by_lr_sched", False):
        return

    def tracked_step(*args: Any, **kwargs: Any) -> Any:
        vars(optimizer)["_opt_called"] = True
        return step(*args, **kwargs)

    vars(tracked_step)["_wrapped_by_lr_sched"] = True
    vars(optimizer)["step"] = tracked_step


def _refuse_parameter_attributes(optimizer: Optimizer) -> None:
    """Refuses an optimizer that keeps its parameters in an attribute of its own (it would outlive the twinning)."""
    params = {id(param) for group in optimizer.param_groups for param in group["params"]}

    def refers(value: Any) -> bool:
        if isinstance(value, Tensor):
            return id(value) in params
        if isinstance(value, list | tuple | set | frozenset):
            return any(refers(item) for item in value)
        if isinstance(value, Mapping):
            return any(refers(item) for item in value.values())
        return False

    holding = [
        name for name, value in vars(optimizer).items() if name not in ("param_groups", "state") and refers(value)
    ]
    if holding:
        raise ValueError(
            f"{type(optimizer).__name__} keeps its parameters in attribute(s) {', '.join(holding)} besides"
            " param_groups. The strategy steps a twin of it with new param_groups (this rank's OSS shard, or the flat"
            " parameters FSDP trains), so those attributes would name parameters the twin does not step. Read the"
            " parameters from self.param_groups in step()."
        )


class OptimizerNeed(enum.Enum):
    """What an optimizer's math needs that some strategies' sharding takes away."""

    #: The update of a parameter depends on the whole tensor and its shape (factored moments, orthogonalization,
    #: the parameter's own RMS): a shard or a flat 1-D piece of it gives different math.
    WHOLE_PARAMETERS = "whole_parameters"
    #: All parameters are one vector (dot products, line search) and the closure runs a data-dependent number of
    #: times per step: on shards, every rank would decide differently and their collectives would not meet.
    ALL_PARAMETERS_AS_ONE = "all_parameters_as_one"
    #: Sparse gradients (``nn.Embedding(sparse=True)``), which the wrappers reduce and shard as dense tensors only.
    SPARSE_GRADIENTS = "sparse_gradients"


#: The fix for each need: where it is met (tests/strategies/test_every_optimizer.py runs each there against ddp), or
#: what else.
FIXES: dict[OptimizerNeed, str] = {
    OptimizerNeed.WHOLE_PARAMETERS: (
        "Use ddp_sharded (OSS steps whole parameters) or ddp for this optimizer, or an element-wise optimizer (Adam,"
        " AdamW, SGD, ...) with this strategy"
    ),
    OptimizerNeed.ALL_PARAMETERS_AS_ONE: (
        "Use ddp (every rank steps all parameters) for this optimizer, or an element-wise optimizer (Adam, AdamW,"
        " SGD, ...) with this strategy"
    ),
    OptimizerNeed.SPARSE_GRADIENTS: (
        "Use ddp for sparse gradients, or nn.Embedding(sparse=False) with a dense optimizer (Adam, AdamW, SGD, ...)"
    ),
}


def _torch_optimizer(name: str) -> type[Optimizer] | None:
    found = getattr(torch.optim, name, None)  # Adafactor and Muon are recent: absent from older torch releases
    return found if isinstance(found, type) and issubclass(found, Optimizer) else None


#: torch.optim classes (by name) whose math sharding can change, and why. Subclasses inherit their base's needs.
OPTIMIZER_NEEDS: dict[str, tuple[OptimizerNeed, str]] = {
    "Adafactor": (
        OptimizerNeed.WHOLE_PARAMETERS,
        "factors each matrix's second moment into row and column means and scales each update by the RMS of the"
        " whole parameter",
    ),
    "Muon": (OptimizerNeed.WHOLE_PARAMETERS, "orthogonalizes each 2-D update over the whole matrix"),
    "LBFGS": (
        OptimizerNeed.ALL_PARAMETERS_AS_ONE,
        "treats all parameters as one vector and calls the closure a data-dependent number of times per step",
    ),
    "SparseAdam": (OptimizerNeed.SPARSE_GRADIENTS, "steps sparse gradients only"),
}


def optimizer_needs(optimizer: Optimizer) -> tuple[OptimizerNeed, str] | None:
    """What ``optimizer`` needs from the strategy beyond element-wise shards, and why; ``None`` for nothing.

    Args:
        optimizer: The optimizer ``configure_optimizers()`` returned.

    Returns:
        The need and a sentence saying why: what the optimizer's class declares as ``sharding_need`` (an
        ``(OptimizerNeed, "why")`` class attribute, for users' own optimizers), else the entry of
        :data:`OPTIMIZER_NEEDS` for the torch classes there and their subclasses.
    """
    declared = getattr(type(optimizer), "sharding_need", None)
    if isinstance(declared, tuple) and len(declared) == 2 and isinstance(declared[0], OptimizerNeed):
        return declared[0], str(declared[1])
    for name, need in OPTIMIZER_NEEDS.items():
        cls = _torch_optimizer(name)
        if cls is not None and isinstance(optimizer, cls):
            return need
    return None


def _sparse_gradient_modules(module: Module) -> list[str]:
    return [
        name or type(module).__name__
        for name, submodule in module.named_modules()
        if isinstance(submodule, torch.nn.Embedding | torch.nn.EmbeddingBag) and submodule.sparse
    ]


def refuse_unsupported_optimizers(
    strategy_name: str,
    optimizers: Sequence[Optimizer],
    module: Module,
    refused: Mapping[OptimizerNeed, str],
) -> None:
    """Raises before training when an optimizer (or the module's sparse gradients) needs what the strategy lacks.

    Every rank runs the same ``configure_optimizers()``, so every rank raises here, before any collective.

    Args:
        strategy_name: The strategy's registry name, for the message.
        optimizers: The optimizers ``configure_optimizers()`` returned.
        module: The LightningModule (checked for sparse embeddings).
        refused: The needs this strategy cannot meet, each with what it does instead (a clause of the message).

    Raises:
        ValueError: Naming the optimizer, what its math needs, what the strategy does, and where it works.
    """
    for index, optimizer in enumerate(optimizers):
        found = optimizer_needs(optimizer)
        if found is not None and found[0] in refused:
            need, why = found
            raise ValueError(
                f"{strategy_name} cannot train optimizer {index} ({type(optimizer).__name__}) exactly: it {why}, and"
                f" {refused[need]}. {FIXES[need]}."
            )
    sparse = _sparse_gradient_modules(module)
    if sparse and OptimizerNeed.SPARSE_GRADIENTS in refused:
        need = OptimizerNeed.SPARSE_GRADIENTS
        raise ValueError(
            f"{strategy_name} cannot train {', '.join(sparse[:3])}: sparse=True gives sparse gradients, and"
            f" {refused[need]}. {FIXES[need]}."
        )


# ---------------------------------------------------------------------------- element-wise steps on local shards

#: torch.optim classes (by name) whose math is element by element but whose implementation uses in-place indexing
#: that DTensor cannot dispatch on a shard (Rprop: ``sign[sign.gt(0)] = etaplus``).
LOCAL_SHARD_OPTIMIZERS = ("Rprop",)


def steps_on_local_shards(optimizer: Optimizer) -> bool:
    """Whether ``optimizer`` is element-wise and must step the local shards of DTensor parameters (see above)."""
    classes = [cls for cls in map(_torch_optimizer, LOCAL_SHARD_OPTIMIZERS) if cls is not None]
    return any(isinstance(optimizer, cls) for cls in classes)


def step_on_local_shards(optimizer: Optimizer) -> None:
    """Makes ``optimizer.step`` update the local shards of its DTensor parameters with plain tensors.

    Exact for element-wise optimizers: each element's update reads that element's parameter, gradient and state
    only, all of which the local shard holds. No collective is added. The closure (forward and backward, where
    FSDP reduces the gradients) runs first, on the DTensor parameters; then the optimizer's own step runs on plain
    views of the shards, with its state entries viewed the same way, and new state entries of a shard's shape become
    DTensors like their parameter (so checkpoints gather them as for any optimizer).

    Args:
        optimizer: An element-wise optimizer over DTensor parameters.
    """
    inner: Callable[..., Any] = optimizer.step

    def local_step(closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _local_view(optimizer):
            inner()
        return loss

    if getattr(inner, "_wrapped_by_lr_sched", False):  # keeps torch's "scheduler stepped first" check quiet
        vars(local_step)["_wrapped_by_lr_sched"] = True
    vars(optimizer)["step"] = local_step


def _local_tensor(value: Any) -> Any:
    return value.to_local() if isinstance(value, DTensor) else value


@contextmanager
def _local_view(optimizer: Optimizer) -> Generator[None, None, None]:
    """Swaps the optimizer's DTensor parameters (and their gradients and state) for plain views of the local shards."""
    groups = [group["params"] for group in optimizer.param_groups]
    state = optimizer.state
    pairs: list[tuple[Any, Tensor]] = []
    local_state: defaultdict[Any, dict[str, Any]] = defaultdict(dict)
    with torch.no_grad():
        for group in optimizer.param_groups:
            local_params = []
            for param in group["params"]:
                # A plain view of the shard shares its storage: in-place updates reach the DTensor.
                local = param.to_local().detach() if isinstance(param, DTensor) else param
                if local is not param and param.grad is not None:
                    local.grad = _local_tensor(param.grad)
                if param in state:
                    local_state[local] = {key: _local_tensor(value) for key, value in state[param].items()}
                pairs.append((param, local))
                local_params.append(local)
            group["params"] = local_params
        vars(optimizer)["state"] = local_state
    try:
        yield None
    finally:
        with torch.no_grad():
            for group, params in zip(optimizer.param_groups, groups, strict=True):
                group["params"] = params
            for param, local in pairs:
                if local is not param:
                    local.grad = None
                if local in local_state:
                    state[param] = {key: _as_shard_of(value, param, local) for key, value in local_state[local].items()}
            vars(optimizer)["state"] = state


def _as_shard_of(value: Any, param: Tensor, local: Tensor) -> Any:
    """A state entry of the shard's shape as a DTensor placed like its parameter; other entries as they are."""
    if (
        isinstance(param, DTensor)
        and isinstance(value, Tensor)
        and not isinstance(value, DTensor)
        and value.dim() > 0
        and value.shape == local.shape
    ):
        return DTensor.from_local(
            value, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return value
