"""The hooks of :class:`~lightning_strategies.DirectReferenceStrategy` that a strategy of its own overrides.

One list, in one place: ``docs/own-strategy.md``'s hook table documents exactly these (a test keeps the two equal).
Everything else in the base class (the save/load flow, the launcher, collectives, failure handling) is meant to be
inherited as it is.
"""

from __future__ import annotations

from typing import Final

#: Names of the methods, properties and class attributes of ``DirectReferenceStrategy`` meant to be overridden, in
#: the order the documentation's table lists them.
OVERRIDABLE_HOOKS: Final[tuple[str, ...]] = (
    # wrapping
    "strategy_name",
    "configure_for_fit",
    "configure_for_evaluation",
    "before_restore",
    "_run_step",
    "_broadcast_buffers",
    "_materialises_meta_tensors",
    "_evaluates_in_inference_mode",
    # gradients and parameters
    "block_backward_sync",
    "gradients_are_sharded",
    "clip_grad_by_norm",
    "complete_gradients",
    "full_parameters",
    # canonical state out and in
    "_canonical_model_state",
    "_canonical_optimizer_state",
    "_load_canonical_model_state",
    "_load_canonical_optimizer_state",
    "_canonical_param_shapes",
    "checkpoint_metadata",
    # sharded checkpoints
    "_state_dict_type",
    "sharded_format",
)
