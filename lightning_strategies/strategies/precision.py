"""fp16 loss scaling when each rank holds only part of the gradients.

A loss scaler skips the optimizer step and lowers its scale when it finds an inf or NaN in the gradients it checks.
torch's ``GradScaler`` checks the gradients this process holds. Under data parallel training those are the same on
every rank, but where gradients are sharded each rank checks only its own part: an overflow in one rank's shard makes
that rank alone skip the step, the ranks' scales drift apart, and a rank that skips ``OSS.step`` leaves the others
waiting in its broadcast. The strategy therefore swaps the precision plugin's scaler, for the run, for an
:class:`AgreeingGradScaler`, which all-reduces the found-inf flag so that every rank makes the same decision.

:class:`GradientRouting` (``DirectReferenceStrategy`` inherits it) is everything a strategy routes through the
precision plugin instance it owns, where Lightning offers strategies no hook: that scaler, norm clipping across ranks
(``gradients_are_sharded``, ``clip_grad_by_norm``) and ``on_before_optimizer_step`` inside ``complete_gradients()``.
The patches themselves are named in ``_lightning`` and undone at teardown.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.amp.grad_scaler import GradScaler
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.optim import Optimizer
from typing_extensions import override

from .._lightning import (
    ParallelStrategy,
    Precision,
    call_before_optimizer_step_hooks,
    clip_gradients,
    given_precision_plugin,
    is_overridden,
    pl,
    route_precision_plugin,
    unroute_precision_plugin,
)

# Scalers that decide per process and are replaced for the run (their settings and state carried over).
_REPLACEABLE: tuple[type[GradScaler], ...] = (GradScaler, torch.cuda.amp.GradScaler)


class AgreeingGradScaler(ShardedGradScaler):
    """A loss scaler whose skip-or-step decision is the same on every rank, standing in for a user's ``GradScaler``.

    torch's ``ShardedGradScaler`` all-reduces the found-inf flag over the default process group after unscaling and
    accepts fp16 gradients. In addition, an fp16 gradient of an fp32 parameter (fairscale FSDP with
    ``mixed_precision=True`` leaves those on a single process) becomes an fp32 gradient before it is unscaled: the
    optimizer steps fp32 parameters with it, and unscaling in fp16 would flush small gradients to zero.

    Args:
        replaced: The scaler this one stands in for; its settings and state (scale, growth tracker) are taken over
            now and handed back by :meth:`hand_back`.
    """

    def __init__(self, replaced: GradScaler) -> None:
        super().__init__(device=replaced._device, enabled=replaced.is_enabled())
        self.load_state_dict(replaced.state_dict())
        self.replaced = replaced

    @override
    def unscale_(self, optimizer: Optimizer) -> None:
        if self.is_enabled():
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        grad = param.grad
                        if grad is not None and grad.dtype != param.dtype and param.dtype.is_floating_point:
                            param.grad = grad.to(param.dtype)
        super().unscale_(optimizer)

    def hand_back(self) -> GradScaler:
        """Returns the replaced scaler, holding this one's state (so a save or run after this one continues it)."""
        if self.is_enabled():
            self.replaced.load_state_dict(self.state_dict())
        return self.replaced


def install_agreeing_scaler(plugin: Precision, agreeing: tuple[type[GradScaler], ...] = (ShardedGradScaler,)) -> None:
    """Makes ``plugin`` (the instance the strategy owns) scale losses with an :class:`AgreeingGradScaler`.

    Nothing changes for a plugin without an enabled scaler (32-bit, bf16) or with a scaler that agrees already.

    Args:
        plugin: The strategy's precision plugin, e.g. Lightning's ``MixedPrecision("16-mixed", ...)``.
        agreeing: Scaler classes that all-reduce found-inf across ranks by themselves, kept as they are (the
            strategy's :attr:`GradientRouting.agreeing_scalers`).

    Raises:
        TypeError: The plugin's scaler is of another class, whose decisions this package cannot make agree.
    """
    scaler: Any = getattr(plugin, "scaler", None)
    if not isinstance(scaler, GradScaler) or not scaler.is_enabled() or isinstance(scaler, agreeing):
        return
    if type(scaler) not in _REPLACEABLE:
        raise TypeError(
            f"The precision plugin's loss scaler is a {type(scaler).__qualname__}. With sharded gradients every rank"
            " must take the same skip-or-step decision, and this scaler's cannot be made to agree. Pass a"
            " torch.amp.GradScaler (the strategy replaces it for the run by one that all-reduces found-inf) or a"
            " subclass of one of the scalers that agree by themselves: "
            + ", ".join(f"{cls.__module__}.{cls.__qualname__}" for cls in agreeing)
            + "."
        )
    plugin.scaler = AgreeingGradScaler(scaler)  # type: ignore[attr-defined]  # the scaler-holding plugins' attribute


def remove_agreeing_scaler(plugin: Precision) -> None:
    """Puts back the scaler that :func:`install_agreeing_scaler` replaced, holding the run's final state."""
    scaler = getattr(plugin, "scaler", None)
    if isinstance(scaler, AgreeingGradScaler):
        plugin.scaler = scaler.hand_back()  # type: ignore[attr-defined]


class GradientRouting(ParallelStrategy):
    """Gradient hooks a strategy runs through its precision plugin: norm clipping, loss scaling, complete gradients.

    Not a strategy of its own: ``DirectReferenceStrategy`` inherits it; subclasses override
    :meth:`gradients_are_sharded`, :meth:`clip_grad_by_norm` and :meth:`complete_gradients`, and extend
    :attr:`agreeing_scalers` with their backend's own sharded scaler.
    """

    #: Loss scaler classes that all-reduce found-inf across ranks by themselves: a user's scaler of one of these
    #: classes is kept; a plain ``GradScaler`` is replaced for the run by an :class:`AgreeingGradScaler`.
    agreeing_scalers: tuple[type[GradScaler], ...] = (ShardedGradScaler,)

    @override
    def setup_precision_plugin(self) -> None:
        super().setup_precision_plugin()
        plugin = given_precision_plugin(self)
        if plugin is None:
            return
        if self.gradients_are_sharded:
            # Lightning clips through the precision plugin and offers strategies no hook for it. With sharded
            # gradients torch's clip_grad_norm_ would compute a different norm on every rank, so the plugin instance
            # this strategy owns routes norm clipping to the strategy until teardown.
            route_precision_plugin(plugin, clip_grad_by_norm=self.clip_grad_by_norm, after_closure=None)
            # Likewise each rank's loss scaler sees only its own gradients: under fp16 it would skip steps and
            # back off alone (and a rank that skips a sharded optimizer's step leaves the others in its broadcast).
            install_agreeing_scaler(plugin, self.agreeing_scalers)
        if self._completes_gradients():
            # Lightning calls `on_before_optimizer_step` (where its docs compute `grad_norm(self)`) from the plugin,
            # and offers strategies no hook around it: the plugin instance this strategy owns runs the hooks inside
            # `complete_gradients()` until teardown, and only when a hook is overridden (no collective otherwise).
            route_precision_plugin(plugin, clip_grad_by_norm=None, after_closure=self._after_closure)

    def _give_back_precision_plugin(self) -> None:
        """At teardown: the precision plugin's own norm clipping, ``_after_closure`` and loss scaler again."""
        plugin = given_precision_plugin(self)
        if plugin is not None:
            unroute_precision_plugin(plugin)
            remove_agreeing_scaler(plugin)

    def _completes_gradients(self) -> bool:
        return type(self).complete_gradients is not GradientRouting.complete_gradients

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
            call_before_optimizer_step_hooks(trainer, optimizer)
        clip_gradients(self.precision_plugin, model, optimizer, trainer)

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
