"""Re-creating the optimizers that ``configure_optimizers()`` returned, for wrappers that need other ones.

Sharded DDP needs OSS optimizers, FSDP needs optimizers over the parameters the wrapper created. Neither calls the
optimizer's constructor again: ``type(optimizer)(params, **optimizer.defaults)`` fails for classes whose ``defaults``
hold keys their constructor does not take (torch 2.13's ``AdamW``, many users' own optimizers), and loses whatever
the constructor did besides storing hyper-parameters (``Adagrad``'s initial sums). A *twin* is made instead: the same
object's attributes over other parameters. State the optimizer already held goes to the twin in canonical form,
through the strategy's own loader.
"""

from __future__ import annotations

import copy
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

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
    """
    twin = copy.copy(optimizer)
    attributes = vars(twin)
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
