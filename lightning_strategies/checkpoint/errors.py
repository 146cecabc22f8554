"""Errors raised when a checkpoint cannot be saved or restored.

All of them subclass :class:`RuntimeError`, which is what ``torch.nn.Module.load_state_dict`` raises for the same
problems, so code that already catches that keeps working.
"""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class: a checkpoint could not be read, validated or restored."""


class CheckpointFormatError(CheckpointError):
    """The file is not a readable checkpoint, or its metadata block says it cannot be loaded here."""


class ModelStateMismatchError(CheckpointError):
    """The checkpoint's model state does not fit the model: missing or unexpected keys, or other shapes."""


class OptimizerStateMismatchError(CheckpointError):
    """The checkpoint's optimizer states do not fit the optimizers returned by ``configure_optimizers``."""


class StoreError(CheckpointError):
    """An object store cannot be reached as a checkpoint URL asks (no such bucket, credentials refused, no fsspec
    backend for its scheme); nothing was written, the previous checkpoint is untouched."""
