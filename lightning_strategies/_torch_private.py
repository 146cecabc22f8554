"""Every torch name private to torch that this package uses, each looked up when it is needed.

A torch release may move a private name without notice. Looked up here, such a move costs one feature with an error
that names the fix, not the import of the whole package; whoever moves to another torch release reads this module to
see what may break. ``tests/test_backend_homes.py`` fails when a private torch name (``torch.x._y``, ``from torch.x
import _y``) is used anywhere else. They exist in torch 2.13 (CI) and 2.11 (the GPU machine's, docs/gpu.md). Nothing
here imports Lightning: both bindings share this module.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

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


def collectives_run() -> int | None:
    """How many collectives this rank has run on the default group (``None`` where the backend does not count).

    Raises:
        RuntimeError, AttributeError, ValueError: No default group (or torch moved it).
    """
    group = torch.distributed.distributed_c10d._get_default_group()
    count = getattr(group, "_get_sequence_number_for_group", None)  # may go; then the count is not compared
    return int(count()) if count is not None else None


def default_store() -> Any:
    """The key-value store of the default process group (the rendezvous store)."""
    return torch.distributed.distributed_c10d._get_default_store()


def torch_function_subclass_disabled() -> AbstractContextManager[Any]:
    """A block in which a tensor subclass's ``__torch_function__`` is not called (torch's subclassing recipe)."""
    disabled: AbstractContextManager[Any] = torch._C.DisableTorchFunctionSubclass()
    return disabled


def dcp_set_element(root: dict[str, Any], path: Sequence[str | int], value: Any) -> None:
    """``torch.distributed.checkpoint``'s ``set_element``: puts ``value`` at ``path`` of a nested state dict."""
    from torch.distributed.checkpoint._traverse import set_element

    set_element(root, tuple(path), value)


def dcp_flatten_state_dict(state: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``torch.distributed.checkpoint``'s ``flatten_state_dict``: the flat keys DCP stores a nested state dict under,
    and the mapping back to the nested paths."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, mappings = flatten_state_dict(state)
    return dict(flat), dict(mappings)
