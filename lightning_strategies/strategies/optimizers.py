"""Re-creating the optimizers that ``configure_optimizers()`` returned, for wrappers that need other ones.

Sharded DDP needs OSS optimizers, FSDP needs optimizers over the parameters the wrapper created. Both keep the user's
optimizer type, param groups, hyper-parameters and defaults, and point the LR schedulers at the new optimizer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch.optim import Optimizer

from .._lightning import LRSchedulerConfig


def rebuild_optimizer(optimizer: Optimizer, param_groups: list[dict[str, Any]], index: int) -> Optimizer:
    """Creates ``type(optimizer)(param_groups, **optimizer.defaults)``.

    Args:
        optimizer: The optimizer ``configure_optimizers()`` returned (it must not hold state yet).
        param_groups: The new groups: hyper-parameters and ``"params"``.
        index: Position of the optimizer, for error messages.

    Returns:
        The new optimizer.

    Raises:
        ValueError: The optimizer already holds state, which would be lost.
        TypeError: The optimizer's class cannot be constructed from its own ``defaults``.
    """
    kind = type(optimizer).__name__
    if optimizer.state:
        raise ValueError(
            f"Optimizer {index} ({kind}) already holds state before training started; the strategy has to re-create"
            " it over the parameters that train and would lose that state. Create it without state in"
            " configure_optimizers()."
        )
    try:
        return type(optimizer)(param_groups, **optimizer.defaults)
    except TypeError as error:
        raise TypeError(
            f"Optimizer {index} ({kind}) cannot be re-created as {kind}(param_groups, **defaults) ({error}). Give it a"
            " constructor that accepts its own defaults."
        ) from error


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
