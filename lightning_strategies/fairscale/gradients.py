"""What ``fsdp_fairscale`` does about gradients around a step, so that parameters end each step as under ``ddp``.

- A flat parameter's gradient is one tensor: an original parameter that got no gradient in a step has a zero slice in
  it where ``ddp`` leaves its gradient ``None``. :class:`GradientlessCheck` decides before each optimizer step which
  such parameters the step would move (refused) or leaves alone (:func:`keep_untouched` puts them back).
- :func:`gradients_set_aside` takes the shards' gradients off the flat parameters for a step's forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from fairscale.nn.misc.flatten_params_wrapper import FlatParameter
from torch import Tensor
from torch.nn import Parameter
from torch.optim import Optimizer

from lightning_strategies.fairscale.layout import FlatUnit, OptimizerLayout

from .wrap import gradient_arrivals

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


def moves_without_gradient(optimizer: Optimizer, group: Mapping[str, Any], had_gradient: bool) -> str | None:
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


def counts_steps(optimizer: Optimizer, group: Mapping[str, Any]) -> bool:
    """Whether ``optimizer`` counts, for a parameter of ``group``, the steps it took without a gradient."""
    return type(optimizer) not in _STEP_COUNT_FREE or bool(group.get("lr_decay", 0))


class GradientlessCheck:
    """Which parameters sharing a flat parameter had gradients in the fit's steps so far, and the check that uses it.

    Attributes:
        history: Per original parameter of a shared flat parameter: 1 had a gradient at a step, 2 had none at a step.
        checked: Whether the fit's first optimizer step was checked.
    """

    def __init__(self) -> None:
        self.history: dict[str, int] = {}
        self.checked = False

    def before_step(
        self,
        optimizer: Optimizer,
        optimizers: Sequence[Optimizer],
        layouts: Mapping[int, OptimizerLayout],
        device: torch.device,
    ) -> None:
        """Before a step: a parameter that shares a flat parameter and got no gradient (on any rank) is left alone as
        under ddp when it never had one (:func:`keep_untouched`); every rank raises if it had one and the step would
        move it (momentum), or if a step-counting optimizer steps it after steps it skipped (see ``_STEP_COUNT_FREE``).


        Hooks on the module's parameter views record on each rank which parameters a gradient reached; one
        all-reduce of those flags per step (every rank, for every optimizer that steps shared flat parameters: the
        same decision everywhere) combines them. Checked at every step: a parameter used in some batches only
        (a conditional branch) is the same case as one never used.

        Args:
            optimizer: The optimizer about to step.
            optimizers: Every optimizer of the run.
            layouts: The layout of each optimizer over flat parameters, by ``id``.
            device: Where the flags are all-reduced.

        Raises:
            RuntimeError: On every rank, naming the parameters the step would move where ddp leaves them alone.
        """
        if id(optimizer) not in layouts:
            return
        # At the fit's first step every optimizer's parameters that hold gradients are judged, so that a refusal comes
        # before any optimizer stepped (a two-optimizer step gives both networks gradients in its first pass); later,
        # each optimizer's own parameters before its step.
        first = not self.checked
        self.checked = True
        judged = [candidate for candidate in optimizers if first or candidate is optimizer]
        tracked = [
            (candidate, unit, group)
            for candidate in judged
            if id(candidate) in layouts
            for group, units in zip(candidate.param_groups, layouts[id(candidate)].group_units, strict=True)
            for unit in units
            if isinstance(unit.param, FlatParameter) and len(unit.names) > 1
        ]
        if not tracked:  # decided by the wrapping alone: the same on every rank
            return
        flags = [
            flag for _, unit, _ in tracked for flag in (gradient_arrivals(unit.param) or [False] * len(unit.names))
        ]
        arrived = torch.tensor(flags, dtype=torch.float32, device=device)
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
                        self.history[name] = self.history.get(name, 0) | 1
                continue
            for name, has_gradient in zip(unit.names, got, strict=True):
                history = self.history.get(name, 0)
                if has_gradient:
                    if history & 2 and counts_steps(candidate, group):
                        problems.append(
                            f"{name!r} (gets a gradient after steps without one: {type(candidate).__name__} counted"
                            " those steps for it, ddp does not)"
                        )
                    if stepped:
                        self.history[name] = history | 1
                    continue
                why = moves_without_gradient(candidate, group, had_gradient=bool(history & 1))
                if why is not None and not history & 1:
                    if stepped:  # never had a gradient: put back what the step changes (see keep_untouched)
                        untouched.append((unit, unit.names.index(name)))
                elif why is not None:
                    problems.append(f"{name!r} (no gradient; {why} would move it)")
                if stepped:
                    self.history[name] = history | 2
        if problems:
            shown = "; ".join(problems[:4]) + (f"; and {len(problems) - 4} more" if len(problems) > 4 else "")
            raise RuntimeError(
                "fsdp_fairscale with flattened parameters cannot train parameters that had gradients and get none in"
                " a step while others flattened with them do (pass flatten_parameters=False to FairScaleFSDPStrategy,"
                f" or give every parameter a gradient in each step): {shown}. fairscale gives them a zero gradient"
                " slice where ddp gives them none and leaves them alone; this optimizer step was not taken."
            )
        if untouched:
            keep_untouched(optimizer, untouched)


def keep_untouched(optimizer: Optimizer, untouched: list[tuple[FlatUnit, int]]) -> None:
    """Around this step of ``optimizer``: parameters that never had a gradient end it as they began, as under ddp.

    Each is a slice of a flat parameter whose gradient slice is zero; the step (weight decay) would move it and
    write its optimizer state. This rank's part of each slice is copied before the step and written back after it
    (state that the step created is zeroed there: ddp has none). Exact while the parameter gets no gradient;
    Adam's step count, shared by the flat parameter, is refused once it does (``counts_steps``).
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


@contextmanager
def gradients_set_aside(units: Sequence[FlatUnit]) -> Iterator[None]:
    """Takes the flat parameters' gradients off them for a step's forward and puts them back after.

    Between steps a flat parameter holds this rank's shard and the gradient of that shard; in forward its data is
    the full parameter while the gradient stays the shard's. ``torch.compile`` describes each parameter of a
    compiled submodule with its gradient, and fails on that one ("attempting to assign a gradient of size").
    A gradient accumulated under ``no_sync`` is the full one: it fits the gathered parameter and stays.
    """
    units = [unit for unit in units if unit.param.grad is not None and unit.param.grad.shape == unit.param.shape]
    gradients = [unit.param.grad for unit in units]
    for unit in units:
        unit.param.grad = None
    try:
        yield None
    finally:
        for unit, gradient in zip(units, gradients, strict=True):
            unit.param.grad = gradient


def clip_by_total_norm(units: Sequence[FlatUnit], clip_val: float, device: torch.device, group: Any) -> None:
    """Scales the units' gradient shards so that their norm, summed over every rank's shards, is at most
    ``clip_val`` (one all-reduce over ``group``)."""
    grads = [unit.param.grad for unit in units if unit.param.grad is not None]
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for grad in grads:
        squares += grad.detach().float().pow(2).sum().to(device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(squares, group=group)
    coefficient = torch.clamp(float(clip_val) / (squares.sqrt() + 1e-6), max=1.0)
    for grad in grads:
        grad.detach().mul_(coefficient.to(grad.device, grad.dtype))
