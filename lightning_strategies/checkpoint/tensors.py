"""Which tensors of a checkpoint a reader can use: data on a real device, a dense layout, and no more elements than
the storage the file holds.

``torch.load(weights_only=True)`` restores what the file declares: a meta tensor (a shape, no data), a sparse
tensor, or a view whose size and strides describe far more elements than its storage holds (a stride-0 view of one
stored number can declare 2**40 elements). Anything that reads such a tensor's values (a NaN check, ``contiguous()``,
a safetensors write) materialises every declared element: terabytes from a file of a few kilobytes, and an allocator
traceback instead of an error. The checks here read only sizes, strides and storage sizes.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_strategies.checkpoint.model_state import unusable_tensor


def declared_elements_beyond_storage(tensor: Tensor) -> bool:
    """Whether ``tensor`` declares more elements than its storage holds (a broadcast or overlapping view).

    A dense tensor, a slice or a transposed view never does; ``x.expand(n)`` of a one-element ``x`` does. Reading
    its values materialises every declared element, which the file does not pay for.
    """
    if tensor.device.type == "meta" or tensor.layout != torch.strided:
        return False
    storage_elements = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
    return math.prod(tensor.shape) > storage_elements


def tensor_defect(tensor: Tensor) -> str:
    """Why nothing can read ``tensor``'s values as a dense tensor, or ``""`` when it can.

    Returns:
        ``"is a meta-device tensor ..."``, ``"has the sparse_coo layout ..."``, ``"declares N elements ..."`` or
        ``""``.
    """
    reason = unusable_tensor(tensor)
    if reason:
        return reason
    if declared_elements_beyond_storage(tensor):
        stored = tensor.untyped_storage().nbytes() // max(tensor.element_size(), 1)
        return (
            f"declares {math.prod(tensor.shape):,} elements (shape {tuple(tensor.shape)}, strides {tensor.stride()})"
            f" but its storage holds {stored:,}: a broadcast (stride-0) or overlapping view that every reader would"
            f" expand to {math.prod(tensor.shape) * tensor.element_size():,} bytes"
        )
    return ""
