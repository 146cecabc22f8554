"""Forward redirection: run a LightningModule method *through* the wrapper's ``forward``.

Wrappers (sharded DDP, FSDP) do their work in ``forward``: syncing buffers, gathering parameters, registering
gradient hooks. Lightning calls ``training_step``, not ``forward``, so the module's ``forward`` is swapped for a
function that calls the step, the wrapper is called, and the swap is undone. Unlike upstream's version, the original
``forward`` is restored even when the wrapper raises before or after reaching the module, so a failed step never
leaves a LightningModule whose ``forward`` runs ``training_step``.
"""

from __future__ import annotations

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
