"""A model state for inference, written the way Hugging Face's ``save_pretrained`` writes it: safetensors files.

One ``model.safetensors``, or, past ``max_shard_size``, ``model-00001-of-0000N.safetensors`` shards and a
``model.safetensors.index.json`` that maps every key to its shard (``transformers``' ``from_pretrained`` reads both).
Each file carries the header metadata ``{"format": "pt"}`` that ``from_pretrained`` requires.

- Tied weights (keys whose tensors are one tensor: the same storage, offset, shape and strides, or names the model
  registers for one parameter, given as ``tied_hints``) are written once, under their first key, as ``save_pretrained``
  does (GPT-2 keeps ``transformer.wte.weight`` and drops ``lm_head.weight``); ``from_pretrained`` ties them again from
  the model's config.
- ``submodule`` keeps one submodule's keys and strips its prefix (``model.`` for a LightningModule that holds the
  Hugging Face model as ``self.model``).
- ``dtype`` converts floating-point tensors (integer and boolean buffers keep theirs).

Memory: the shards are written one after the other, each converted when it is written; besides the input state only
one shard's converted tensors are held. Nothing here imports Lightning; ``safetensors`` is imported when a file is
written (``pip install 'lightning-strategies[export]'``).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_strategies.checkpoint.errors import CheckpointError
from lightning_strategies.checkpoint.tensors import tensor_defect

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: ``save_pretrained``'s default ``max_shard_size`` ("5GB").
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
#: The names ``--dtype`` accepts.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
INSTALL_HINT = "pip install 'lightning-strategies[export]'"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20}
_UNITS.update({"GIB": 2**30, "TIB": 2**40})
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


class ExportError(CheckpointError):
    """The model state cannot be exported: no key under the submodule, a value that is not a full dense tensor, or an
    output directory that holds another export."""


class Tally(Protocol):
    """Counts tensors written (a progress bar, or nothing)."""

    def advance(self, count: int = 1) -> None:
        """Counts ``count`` more tensors written."""

    def close(self) -> None:
        """Ends the count."""


@dataclass
class Export:
    """What :func:`write_safetensors` wrote.

    Attributes:
        directory: The output directory.
        files: The file names written, the index last when there is one.
        tensors: Tensors written (tied ones once).
        total_size: Bytes of tensor data written.
        tied: ``{dropped key: the key it is written under}``.
        dtype: The output dtype of floating-point tensors, or ``None`` when they keep theirs.
    """

    directory: Path
    files: list[str] = field(default_factory=list)
    tensors: int = 0
    total_size: int = 0
    tied: dict[str, str] = field(default_factory=dict)
    dtype: torch.dtype | None = None


def require_safetensors() -> ModuleType:
    """``safetensors.torch``, or an error that names the extra that installs it.

    Raises:
        ImportError: ``safetensors`` is not installed.
    """
    try:
        return importlib.import_module("safetensors.torch")
    except ImportError as error:
        raise ImportError(f"Exporting to safetensors needs the safetensors package: {INSTALL_HINT}") from error


def parse_size(value: str | int) -> int:
    """A shard size in bytes: ``5GB`` (10**9, as Hugging Face counts), ``500MiB`` (2**20), or a number of bytes.

    Raises:
        ValueError: Not a size, or not positive.
    """
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", value.upper())
        if match is None:
            raise ValueError(f"expected a size such as 5GB, 500MB, 2GiB or a number of bytes, got {value!r}")
        size = int(float(match.group(1)) * _UNITS[match.group(2) or ""])
    if size < 1:
        raise ValueError(f"a shard size must be at least 1 byte, got {value!r}")
    return size


def parse_dtype(value: str | torch.dtype | None) -> torch.dtype | None:
    """The output dtype named by ``value`` (``bf16``, ``float16``, ``torch.float32`` ...), or ``None``.

    Raises:
        ValueError: Not a floating-point dtype this export writes.
    """
    if value is None or isinstance(value, torch.dtype):
        if isinstance(value, torch.dtype) and value not in DTYPES.values():
            raise ValueError(f"dtype must be one of float32, float16, bfloat16, got {value}")
        return value
    name = value.strip().lower().removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {value!r}")
    return DTYPES[name]


def _listing(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(repr(name) for name in names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def select_tensors(state: Mapping[str, Any], submodule: str | None = None) -> dict[str, Tensor]:
    """The tensors to export: every key of ``state``, or those of ``submodule`` with its prefix stripped.

    Raises:
        ExportError: No key lies under ``submodule``; a value is not a tensor (a module's extra state), not a full
            tensor (a ``DTensor`` shard) or has no values to write (meta, sparse, an oversized view), named by key.
    """
    prefix = f"{submodule.strip('.')}." if submodule else ""
    selected = {key[len(prefix) :]: value for key, value in state.items() if key.startswith(prefix)}
    if not selected:
        tops = sorted({str(key).split(".", 1)[0] for key in state})
        raise ExportError(
            f"No key of the model state lies under the submodule {submodule!r} (no key starts with {prefix!r}); its"
            f" top-level names are {_listing(tops, 8) or 'none: the state is empty'}."
        )
    not_tensors = [key for key, value in selected.items() if not isinstance(value, Tensor)]
    if not_tensors:
        kinds = ", ".join(f"{prefix}{key!s} ({type(selected[key]).__name__})" for key in not_tensors[:3])
        raise ExportError(
            f"{len(not_tensors)} value(s) of the model state are not tensors: {kinds}. safetensors stores tensors only"
            " (a module's get_extra_state()); export the submodule that holds the weights (--submodule)."
        )
    partial = [key for key, value in selected.items() if type(value) not in (Tensor, torch.nn.Parameter)]
    if partial:
        kinds = ", ".join(f"{prefix}{key} ({type(selected[key]).__name__})" for key in partial[:3])
        raise ExportError(
            f"{len(partial)} tensor(s) of the model state are not plain full tensors: {kinds}. A sharded state"
            " (DTensor, ShardedTensor) holds one rank's part: export a full checkpoint, or consolidate a sharded one."
        )
    defects = {key: reason for key, value in selected.items() if (reason := tensor_defect(value))}
    if defects:
        named = "; ".join(f"{prefix}{key!r} {reason}" for key, reason in list(defects.items())[:3])
        raise ExportError(f"{len(defects)} tensor(s) hold no values to write: {named}.")
    return selected


def _identity(tensor: Tensor) -> tuple[Any, ...]:
    return (
        tensor.device,
        tensor.untyped_storage().data_ptr(),
        tensor.storage_offset(),
        tuple(tensor.shape),
        tensor.stride(),
        tensor.dtype,
    )


def tied_keys(tensors: Mapping[str, Tensor], hints: Mapping[str, str] | None = None) -> dict[str, str]:
    """Keys whose tensor is another key's tensor, each mapped to the first such key (the one that is written).

    Args:
        tensors: The tensors to export, in state order.
        hints: ``{alias: holder}`` of parameters the module registers under several names (see
            :func:`~lightning_strategies.checkpoint.model_state.tied_parameter_aliases`), for states in which tied
            tensors arrive as separate copies; each is used only when both keys hold equal tensors.

    Returns:
        ``{dropped key: kept key}``.
    """
    first: dict[tuple[Any, ...], str] = {}
    tied: dict[str, str] = {}
    for key, tensor in tensors.items():
        if tensor.numel() == 0:  # empty tensors may share a null storage without being one tensor
            continue
        identity = _identity(tensor)
        if identity in first:
            tied[key] = first[identity]
        else:
            first[identity] = key
    order = {key: position for position, key in enumerate(tensors)}
    for alias, holder in (hints or {}).items():
        if alias not in tensors or holder not in tensors or alias in tied:
            continue
        holder = tied.get(holder, holder)
        left, right = tensors[alias], tensors[holder]
        same = left.shape == right.shape and left.dtype == right.dtype and bool(torch.equal(left, right))
        if same and alias != holder:
            kept, dropped = (holder, alias) if order[holder] < order[alias] else (alias, holder)
            tied[dropped] = kept
            tied.update({key: kept for key, value in tied.items() if value == dropped})
    return tied


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_size: int) -> list[list[str]]:
    """Groups keys into shards in order, as ``save_pretrained`` does: a new shard when the next tensor would take the
    current one past ``max_shard_size``; a tensor larger than that alone in its shard."""
    shards: list[list[str]] = []
    current: list[str] = []
    current_size = 0
    for key, size in sizes:
        if size > max_shard_size:
            shards.append([key])
            continue
        if current and current_size + size > max_shard_size:
            shards.append(current)
            current, current_size = [], 0
        current.append(key)
        current_size += size
    if current:
        shards.append(current)
    return shards


def _export_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(
        path
        for path in directory.iterdir()
        if path.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.match(path.name) is not None
    )


def check_output_directory(directory: Path, *, force: bool) -> None:
    """Checks that an export may be written into ``directory``.

    Raises:
        ExportError: It is a file, or it holds an export and ``force`` is not set.
    """
    if directory.exists() and not directory.is_dir():
        raise ExportError(f"OUT {str(directory)!r} is a file; an export is a directory (model.safetensors and more).")
    existing = _export_files(directory)
    if existing and not force:
        raise ExportError(
            f"OUT {str(directory)!r} already holds an export ({', '.join(path.name for path in existing[:3])}); pass"
            " --force to replace it, or choose another directory."
        )


def _to_output(tensor: Tensor, dtype: torch.dtype | None) -> Tensor:
    target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    return tensor.detach().to(device="cpu", dtype=target).contiguous()


def _unshared(shard: dict[str, Tensor]) -> dict[str, Tensor]:
    """safetensors refuses tensors of one shard that share memory; those left (views into one storage that are not
    one tensor, e.g. slices of a fused weight) are copied."""
    owners: dict[int, int] = {}
    for tensor in shard.values():
        if tensor.numel():
            pointer = tensor.untyped_storage().data_ptr()
            owners[pointer] = owners.get(pointer, 0) + 1
    return {
        key: tensor.clone() if tensor.numel() and owners[tensor.untyped_storage().data_ptr()] > 1 else tensor
        for key, tensor in shard.items()
    }


def write_safetensors(
    state: Mapping[str, Any],
    directory: Path,
    *,
    submodule: str | None = None,
    dtype: str | torch.dtype | None = None,
    max_shard_size: str | int = DEFAULT_MAX_SHARD_SIZE,
    tied_hints: Mapping[str, str] | None = None,
    force: bool = False,
    tally: Callable[[int], Tally] | None = None,
) -> Export:
    """Writes ``state`` (canonical model state: full tensors) into ``directory`` as Hugging Face safetensors.

    The files are written into a staging directory inside ``directory`` and moved into place when all are written;
    an export that fails leaves ``directory`` as it was.

    Args:
        state: The model state, e.g. a checkpoint's ``state_dict``.
        directory: The output directory (created when missing; ``config.json`` and other files there are kept).
        submodule: Keep only this submodule's keys, without its prefix (e.g. ``"model"``).
        dtype: Convert floating-point tensors to this dtype (``"bf16"``, ``torch.float16`` ...).
        max_shard_size: Largest shard in bytes (``"5GB"``, ``"500MiB"``, an int); past it the state is sharded.
        tied_hints: ``{alias: holder}`` of tied parameters, keyed like ``state`` (before ``submodule`` is stripped),
            for states whose tied tensors arrive as copies (a ``torch.distributed.checkpoint`` directory stores each
            name's copy); used only where both keys hold equal tensors.
        force: Replace an export already in ``directory``.
        tally: Makes a progress count over the tensors written.

    Returns:
        What was written.

    Raises:
        ExportError: Nothing to export, a value that cannot be written (named), or an existing export without
            ``force``.
        ImportError: ``safetensors`` is not installed (the message names the extra).
        ValueError: A bad ``dtype`` or ``max_shard_size``.
    """
    save_file = require_safetensors().save_file
    out_dtype = parse_dtype(dtype)
    limit = parse_size(max_shard_size)
    check_output_directory(directory, force=force)
    tensors = select_tensors(state, submodule)
    prefix = f"{submodule.strip('.')}." if submodule else ""
    hints = {
        alias[len(prefix) :]: holder[len(prefix) :]
        for alias, holder in (tied_hints or {}).items()
        if alias.startswith(prefix) and holder.startswith(prefix)
    }
    tied = tied_keys(tensors, hints)
    kept = [key for key in tensors if key not in tied]

    def size(tensor: Tensor) -> int:
        target = out_dtype if out_dtype is not None and tensor.is_floating_point() else tensor.dtype
        return math.prod(tensor.shape) * torch.empty((), dtype=target).element_size()

    shards = plan_shards([(key, size(tensors[key])) for key in kept], limit)
    count = len(shards)
    names = [SINGLE_FILE] if count == 1 else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    result = Export(directory, tied=tied, dtype=out_dtype)
    directory.mkdir(parents=True, exist_ok=True)
    staging = directory / f".export-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir()
    bar = tally(len(kept)) if tally is not None else None
    try:
        weight_map: dict[str, str] = {}
        for name, keys in zip(names, shards, strict=True):
            shard = _unshared({key: _to_output(tensors[key], out_dtype) for key in keys})
            save_file(shard, str(staging / name), metadata={"format": "pt"})
            result.total_size += sum(tensor.numel() * tensor.element_size() for tensor in shard.values())
            del shard
            weight_map.update(dict.fromkeys(keys, name))
            if bar is not None:
                bar.advance(len(keys))
        result.files = list(names)
        if count > 1:
            index = {
                "metadata": {
                    "total_parameters": sum(tensors[key].numel() for key in kept),
                    "total_size": result.total_size,
                },
                "weight_map": dict(sorted(weight_map.items())),
            }
            (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            result.files.append(INDEX_FILE)
        for old in _export_files(directory):  # a previous export's shards would be read with the new index
            old.unlink()
        for name in result.files:
            os.replace(staging / name, directory / name)
    finally:
        if bar is not None:
            bar.close()
        shutil.rmtree(staging, ignore_errors=True)
    result.tensors = len(kept)
    return result
