"""Forward redirection: run a LightningModule method *through* the wrapper's ``forward``.

Wrappers (sharded DDP, FSDP) do their work in ``forward``: syncing buffers, gathering parameters, registering
gradient hooks. Lightning calls ``training_step``, not ``forward``, so the module's ``forward`` is swapped for a
function that calls the step, the wrapper is called, and the swap is undone. Unlike upstream's version, the original
``forward`` is restored even when the wrapper raises before or after reaching the module, so a failed step never
leaves a LightningModule whose ``forward`` runs ``training_step``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any

from torch.nn import Module


class ForwardRedirection:
    """Calls ``getattr(module, method_name)(*args, **kwargs)`` through ``wrapper(*args, **kwargs)``.

    The wrapper must eventually call ``module(...)`` (as every data-parallel wrapper does); the arguments it passes on
    are the ones the method receives.
    """

    def __call__(self, wrapper: Module, module: Module, method_name: str, *args: Any, **kwargs: Any) -> Any:
        """Redirects one call.

        Args:
            wrapper: The module that wraps ``module`` (or ``module`` itself, to run its forward hooks).
            module: The LightningModule.
            method_name: The step to call, e.g. ``"training_step"``.
            *args: Positional arguments of the step.
            **kwargs: Keyword arguments of the step.

        Returns:
            What the step returned, as passed back by the wrapper.

        Raises:
            ValueError: ``method_name`` is ``"forward"``, which needs no redirection.
        """
        if method_name == "forward":
            raise ValueError("ForwardRedirection is for steps; call the wrapper directly to run `forward`.")
        own_attributes = vars(module)
        had_instance_forward = "forward" in own_attributes
        instance_forward = own_attributes.get("forward")

        def restore_forward() -> None:
            if had_instance_forward:
                own_attributes["forward"] = instance_forward
            else:
                own_attributes.pop("forward", None)

        def redirected_forward(*inner_args: Any, **inner_kwargs: Any) -> Any:
            # Restore first: the step itself may call `self(...)`, which must reach the real forward.
            restore_forward()
            output = getattr(module, method_name)(*inner_args, **inner_kwargs)
            self.on_after_inner_forward(wrapper, module)
            return output

        own_attributes["forward"] = redirected_forward
        try:
            output = wrapper(*args, **kwargs)
        finally:
            restore_forward()
        self.on_after_outer_forward(wrapper, module)
        return output

    def on_after_inner_forward(self, wrapper: Module, module: Module) -> None:
        """Called inside the wrapper's forward, right after the step returned."""

    def on_after_outer_forward(self, wrapper: Module, module: Module) -> None:
        """Called after the wrapper's forward returned."""


class SubmoduleCallRouting:
    """Runs a step outside the wrapper's forward; module calls it makes from there go through the wrapper's forward.

    A wrapper that gathers parameters in its ``forward`` (FSDP) needs that forward around every computation with the
    module's parameters, and a step that runs backward itself (manual optimization) cannot run inside it. While
    :meth:`routing` is active, a call of the LightningModule (``self(...)``) or of any of its submodules
    (``self.model(**batch)``, ``self.encoder(x)``, ``self.discriminator(x)``) made outside the wrapper's forward is
    run through it: the wrapper's forward is called with the call's arguments and, in place of the module's own
    ``forward``, runs the submodule. Calls made inside the wrapper's forward (the submodules the module's ``forward``
    uses) run as they are. A step whose only module call is ``self(...)`` therefore runs the wrapper's forward once,
    exactly as a hand-written loop does.

    Each routed call is a forward of its own: its backward hooks only see the gradients that reach its outputs. A
    step that makes several module calls (``self.decoder(self.encoder(x))``) is trained exactly, but the wrapper may
    gather its parameters again in backward for each call (FSDP2: one more all-gather per extra call). Calling a
    submodule directly while the parameters are still gathered would save that, but backward would then miss the
    hooks that reduce its gradients whenever its output does not reach the loss through a routed call's output.

    Args:
        wrapper: The module whose ``forward`` must be around every call; the LightningModule itself where the wrapper
            is made of hooks on it (FSDP2), or the wrapper object around it.
        module: The LightningModule.
    """

    def __init__(self, wrapper: Module, module: Module) -> None:
        self._wrapper = wrapper
        self.lightning_module = module
        self._module_call: Callable[..., Any] = module._call_impl
        self._inside = False

    @contextmanager
    def routing(self) -> Generator[None, None, None]:
        """Routes the module's and its submodules' calls for the duration of the block (one step)."""
        # A module's calls all go through `self._call_impl` (hooks included), looked up on the instance first: an
        # instance attribute of that name intercepts the call before any hook of the submodule runs (FSDP's own
        # hooks on a sharded submodule must not run before the root's). Removed again when the step ends.
        patched: list[Module] = []
        try:
            self._module_call = self.lightning_module._call_impl
            for submodule in self.lightning_module.modules():
                route = self._call_module if submodule is self.lightning_module else self._call_submodule
                vars(submodule)["_call_impl"] = functools.partial(route, submodule._call_impl)
                patched.append(submodule)
            yield None
        finally:
            for submodule in patched:
                vars(submodule).pop("_call_impl", None)
            self._inside = False

    def _call_module(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._inside:
            return call(*args, **kwargs)
        self._inside = True
        try:
            if self._wrapper is self.lightning_module:
                return call(*args, **kwargs)  # the module's own call runs the wrapper's hooks
            return self._wrapper(*args, **kwargs)  # the wrapper calls the module back, which then runs as it is
        finally:
            self._inside = False

    def _call_submodule(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._inside:
            return call(*args, **kwargs)
        own_attributes = vars(self.lightning_module)
        had_instance_forward = "forward" in own_attributes
        instance_forward = own_attributes.get("forward")

        def run_the_submodule(*inner_args: Any, **inner_kwargs: Any) -> Any:
            if had_instance_forward:
                own_attributes["forward"] = instance_forward
            else:
                own_attributes.pop("forward", None)
            return call(*inner_args, **inner_kwargs)

        own_attributes["forward"] = run_the_submodule
        try:
            return self._call_module(self._module_call, *args, **kwargs)
        finally:
            if had_instance_forward:
                own_attributes["forward"] = instance_forward
            else:
                own_attributes.pop("forward", None)
