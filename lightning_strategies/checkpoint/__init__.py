"""Canonical checkpoint state, shared by every strategy: model keys, optimizer layout, metadata, safe reading."""

from lightning_strategies.checkpoint.errors import (
    CheckpointError,
    CheckpointFormatError,
    ModelStateMismatchError,
    OptimizerStateMismatchError,
)
from lightning_strategies.checkpoint.io import read_checkpoint
from lightning_strategies.checkpoint.metadata import (
    FORMAT_VERSION,
    METADATA_KEY,
    CheckpointMetadata,
    require_full_checkpoint,
)
from lightning_strategies.checkpoint.model_state import (
    COMPILED_SEGMENT,
    WRAPPER_PREFIXES,
    canonical_key,
    canonical_keys,
    check_model_state,
    load_model_state,
    strip_wrapper_segments,
    to_cpu_state,
    to_module_keys,
)
from lightning_strategies.checkpoint.optimizer_state import (
    check_optimizer_state,
    check_optimizer_states,
    param_group_shapes,
    shallow_copy_state,
)

__all__ = [
    "COMPILED_SEGMENT",
    "FORMAT_VERSION",
    "METADATA_KEY",
    "WRAPPER_PREFIXES",
    "CheckpointError",
    "CheckpointFormatError",
    "CheckpointMetadata",
    "ModelStateMismatchError",
    "OptimizerStateMismatchError",
    "canonical_key",
    "canonical_keys",
    "check_model_state",
    "check_optimizer_state",
    "check_optimizer_states",
    "load_model_state",
    "param_group_shapes",
    "read_checkpoint",
    "require_full_checkpoint",
    "shallow_copy_state",
    "strip_wrapper_segments",
    "to_cpu_state",
    "to_module_keys",
]
