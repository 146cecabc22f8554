"""The two torch names this package uses that are private to torch, each looked up when it is needed.

A torch release may move a private name without notice. Looked up here, such a move costs one feature with an error
that names the fix, not the import of the whole package. Both exist in torch 2.13 (CI); torch 2.11 is the GPU
machine's (docs/gpu.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import Module


def composable_activation_checkpoint() -> Callable[[Module], Module] | None:
    """torch's composable activation checkpointing (what ``fully_shard`` composes with); ``None`` when it moved."""
    try:
        from torch.distributed._composable.checkpoint_activation import checkpoint
    except ImportError:
        return None
    wrap: Callable[[Module], Module] = checkpoint
    return wrap


def abort_process_group() -> None:
    """Ends the default process group at once, without waiting for pending collectives (NCCL's abort).

    Where torch has no abort under the known name, the group is destroyed instead: that may wait for a collective
    that a dead peer never joins, up to the process-group timeout, but it never leaves the group alive.
    """
    abort: Callable[[], None] | None = getattr(torch.distributed.distributed_c10d, "_abort_process_group", None)
    if abort is None:
        torch.distributed.destroy_process_group()
    else:
        abort()
