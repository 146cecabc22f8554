"""Sharded checkpoint directories: how they are written, and the one safe reader for them.

A sharded checkpoint is a directory. Its shards are the strategy's business (one file per rank, or a
``torch.distributed.checkpoint`` layout); ``meta.pt`` holds everything else Lightning saved (loops, schedulers,
callbacks, hyper-parameters) and the metadata block, so loading can refuse a directory it cannot use before reading
any shard.

One save, one directory: a save is written into a sibling directory and swapped in when complete, so the path holds
the previous complete save until the new one is complete. Rank 0 draws a save id; ``meta.pt`` and every rank's shard
carry it (and their rank), and :func:`open_sharded`/:func:`read_rank_file` refuse, naming the file, shards of another
save. Strategies, ``inspect`` and ``consolidate`` read directories only through this module and
:mod:`lightning_strategies.checkpoint.dcp`: nothing in a directory runs code, and what is read is bounded by the files
that are there (never by a number written in a file).
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal

import torch
from torch import Tensor

from lightning_strategies.checkpoint.dcp import (
    DCP_METADATA_FILE,
    DcpLayout,
    check_dcp_files,
    dcp_world_size,
    read_dcp_metadata,
    regular_file,
)
from lightning_strategies.checkpoint.errors import CheckpointFormatError
from lightning_strategies.checkpoint.io import read_checkpoint
from lightning_strategies.checkpoint.metadata import FORMAT_VERSION, METADATA_KEY, CheckpointMetadata
from lightning_strategies.checkpoint.model_state import WRAPPER_PREFIXES, strip_wrapper_segments

if TYPE_CHECKING:  # the checkpoint package itself never imports Lightning (both flavours share it)
    from lightning_fabric.plugins import CheckpointIO
    from torch.distributed.checkpoint.metadata import Metadata

SHARDED_META_FILE = "meta.pt"
# fsdp_fairscale's sharded directories: one file per rank. Each holds a layout block (which canonical parameters each
# flat shard holds and how the optimizer's flat state maps onto them), so `lightning-strategies consolidate` rebuilds
# canonical state without a process group.
SHARDED_RANK_FILE = "rank{rank}.pt"
SHARDED_RANK_FILE_PATTERN = re.compile(r"^rank(\d+)\.pt$")
SHARDED_LAYOUT_KEY = "flat_layout"
SHARDED_LAYOUT_VERSION = 1
SHARDED_STATE_KEYS = ("state_dict", "optimizer_states")
#: ``meta.pt`` and every rank file: ``{"save_id": str, "world_size": int}`` (+ ``"rank": int`` in rank files).
SHARDED_SAVE_KEY: Final = "sharded_save"
# Wrapper attribute names that never name a user's submodule: removed from buffer keys of fairscale rank files.
INNER_WRAPPER_SEGMENTS = tuple(prefix.rstrip(".") for prefix in WRAPPER_PREFIXES if prefix.startswith("_"))
_SAVING = ".saving-"

ShardedFormatName = Literal["fairscale FSDP local shards", "torch.distributed.checkpoint"]


def new_save_id() -> str:
    """A fresh save id (rank 0 draws it and broadcasts it)."""
    return uuid.uuid4().hex


def save_stamp(save_id: str, world_size: int, rank: int | None = None) -> dict[str, Any]:
    """The ``sharded_save`` block: which save a file belongs to (and, for a shard, whose rank it is)."""
    block: dict[str, Any] = {"save_id": save_id, "world_size": world_size}
    if rank is not None:
        block["rank"] = rank
    return block


def staging_directory(target: Path, save_id: str) -> Path:
    """The sibling directory a save writes into before it is swapped in at ``target``."""
    return target.with_name(f".{target.name}{_SAVING}{save_id}")


def remove_stale_saves(target: Path, keep: Path | None = None) -> None:
    """Removes what killed saves of ``target`` left next to it (their staging and replaced directories).

    A replaced directory is kept when ``target`` is missing: a save died between its two renames and the replaced
    directory is the previous complete checkpoint, which loaders still find. ``keep`` is the staging directory of
    the save under way, which other ranks may already be writing into.
    """
    if not target.parent.exists():
        return
    for sibling in target.parent.iterdir():
        if sibling == keep:
            continue
        staging = sibling.name.startswith(f".{target.name}{_SAVING}")
        replaced = sibling.name.startswith(f".{target.name}.replaced-")
        if staging or (replaced and target.exists()):
            shutil.rmtree(sibling, ignore_errors=True)


def resolve_sharded_directory(path: Path) -> Path:
    """``path``, or the previous complete save of it when a save died while swapping it in (see ``replace_directory``).

    Raises:
        FileNotFoundError: Neither exists.
    """
    if path.exists() or path.is_symlink():
        return path
    replaced = sorted(path.parent.glob(f".{path.name}.replaced-*")) if path.parent.exists() else []
    if len(replaced) == 1 and (replaced[0] / SHARDED_META_FILE).exists():
        return replaced[0]
    raise FileNotFoundError(f"Checkpoint {str(path)!r} does not exist.")


def write_sharded_meta(
    checkpoint_io: CheckpointIO,
    checkpoint: dict[str, Any],
    metadata: CheckpointMetadata,
    directory: Path,
    save_id: str,
) -> None:
    """Writes ``directory/meta.pt``: the checkpoint without its sharded state, plus the metadata and save blocks."""
    rest = {key: value for key, value in checkpoint.items() if key not in SHARDED_STATE_KEYS}
    rest[METADATA_KEY] = metadata.to_dict()
    rest[SHARDED_SAVE_KEY] = save_stamp(save_id, metadata.world_size)
    checkpoint_io.save_checkpoint(rest, directory / SHARDED_META_FILE)


@dataclass(frozen=True)
class ShardedCheckpoint:
    """A sharded directory whose ``meta.pt`` was read and checked (shards are read on demand, checked each).

    Attributes:
        directory: The directory read (the path given, or the previous save of it; see ``resolve_sharded_directory``).
        meta: ``meta.pt``: what Lightning saved besides the sharded state.
        metadata: Its metadata block (``state_dict_type == "sharded"``); for upstream Lightning's directories, which
            have none, one that names the upstream strategy (see :data:`UPSTREAM_WRITERS`).
        save_id: The save every shard must belong to; ``None`` for upstream Lightning's directories (no save ids).
        format: ``"fairscale FSDP local shards"`` (``rank<r>.pt``) or ``"torch.distributed.checkpoint"``.
        source: How error messages name the directory.
    """

    directory: Path
    meta: dict[str, Any]
    metadata: CheckpointMetadata
    save_id: str | None
    format: ShardedFormatName
    source: str

    @property
    def world_size(self) -> int:
        """The world size of the run that saved."""
        return self.metadata.world_size

    @property
    def upstream(self) -> bool:
        """Whether upstream Lightning wrote it (``ModelParallelStrategy`` or ``FSDPStrategy``), not this package."""
        return self.save_id is None


def _save_block(data: Mapping[str, Any], where: str) -> dict[str, Any]:
    block = data.get(SHARDED_SAVE_KEY)
    if (
        not isinstance(block, Mapping)
        or not isinstance(block.get("save_id"), str)
        or not isinstance(block.get("world_size"), int)
    ):
        raise CheckpointFormatError(
            f"{where} carries no save id ({SHARDED_SAVE_KEY!r}): it was written by an older lightning_strategies or"
            " assembled by hand, so its shards cannot be shown to belong to one save. Resume it with the version"
            " that wrote it and save again."
        )
    return dict(block)


def open_sharded(path: Path, source: str | None = None) -> ShardedCheckpoint:
    """Reads and checks ``path/meta.pt`` and finds the directory's format.

    Args:
        path: The sharded checkpoint directory.
        source: How error messages name it (a stored save read from a local copy is named by its URL); by default
            ``Sharded checkpoint '<path>'``.

    Returns:
        The directory, ready for :func:`read_rank_file` / :func:`check_sharded_files`.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        CheckpointFormatError: No ``meta.pt``, one that does not describe a sharded checkpoint of a save of ours, or
            no shards.
    """
    directory = resolve_sharded_directory(path)
    source = source if source is not None else f"Sharded checkpoint {str(path)!r}"
    if not directory.is_dir():
        raise CheckpointFormatError(f"{source} is not a directory.")
    meta_path = directory / SHARDED_META_FILE
    if not meta_path.exists() and not meta_path.is_symlink():
        raise CheckpointFormatError(
            f"{source} has no {SHARDED_META_FILE}: its save did not finish ({SHARDED_META_FILE} is written last, once"
            " every rank wrote its shards) or it is not a sharded checkpoint. Resume from an earlier checkpoint."
        )
    regular_file(meta_path, source)
    meta = read_checkpoint(meta_path)
    metadata = CheckpointMetadata.read(meta, source=source)
    if metadata is None:
        return _open_upstream(directory, meta, source)
    if metadata.state_dict_type != "sharded":
        raise CheckpointFormatError(f"{source}: {SHARDED_META_FILE} does not describe a sharded checkpoint.")
    block = _save_block(meta, f"{source}: {SHARDED_META_FILE}")
    if block["world_size"] != metadata.world_size:
        raise CheckpointFormatError(f"{source}: {SHARDED_META_FILE} contradicts itself about the world size.")
    sharded_format: ShardedFormatName
    if (directory / DCP_METADATA_FILE).exists() or (directory / DCP_METADATA_FILE).is_symlink():
        sharded_format = "torch.distributed.checkpoint"
    elif any(SHARDED_RANK_FILE_PATTERN.match(name) for name in os.listdir(directory)):
        sharded_format = "fairscale FSDP local shards"
    else:
        raise CheckpointFormatError(
            f"{source} has {SHARDED_META_FILE} but no shards (rank<r>.pt files or a {DCP_METADATA_FILE})."
        )
    meta.pop(SHARDED_SAVE_KEY)
    return ShardedCheckpoint(directory, meta, metadata, block["save_id"], sharded_format, source)


#: The ``strategy`` named in the metadata of upstream Lightning's directories, by where they keep the model.
UPSTREAM_WRITERS: Final = {"state_dict": "lightning:ModelParallelStrategy", "model": "lightning:FSDPStrategy"}


def _open_upstream(directory: Path, meta: dict[str, Any], source: str) -> ShardedCheckpoint:
    """A directory whose ``meta.pt`` has no block of ours: upstream Lightning's DCP directory, or refused."""
    if not (directory / DCP_METADATA_FILE).exists() and not (directory / DCP_METADATA_FILE).is_symlink():
        raise CheckpointFormatError(
            f"{source}: {SHARDED_META_FILE} has no {METADATA_KEY!r} block and there is no {DCP_METADATA_FILE}: neither"
            " a sharded checkpoint of this package nor one of upstream Lightning (ModelParallelStrategy,"
            " FSDPStrategy)."
        )
    dcp = read_dcp_metadata(directory, source)
    layout = DcpLayout.of(dcp, source)
    metadata = CheckpointMetadata(FORMAT_VERSION, UPSTREAM_WRITERS[layout.model_key], dcp_world_size(dcp), "sharded")
    return ShardedCheckpoint(directory, meta, metadata, None, "torch.distributed.checkpoint", source)


def rank_file_paths(sharded: ShardedCheckpoint) -> list[Path]:
    """``rank0.pt`` .. ``rank<W-1>.pt`` of a fairscale directory, each checked to be there (bounded by the listing).

    Raises:
        CheckpointFormatError: A rank file is missing, or files of ranks outside the world size are there.
    """
    present = {
        int(match[1]) for name in os.listdir(sharded.directory) if (match := SHARDED_RANK_FILE_PATTERN.match(name))
    }
    world_size = sharded.world_size
    if len(present) != world_size or any(rank >= world_size for rank in present):
        # Never range(world_size): that number comes from a file. The first few missing ranks are named.
        missing = [rank for rank in range(min(world_size, len(present) + 3)) if rank not in present]
        extra = sorted(rank for rank in present if rank >= world_size)
        details = []
        absent = world_size - len([rank for rank in present if rank < world_size])
        if absent:
            names = ", ".join(SHARDED_RANK_FILE.format(rank=rank) for rank in missing[:3])
            more = f" and {absent - len(missing[:3])} more" if absent > len(missing[:3]) else ""
            details.append(
                f"lacks {names}{more} ({absent} of the {world_size} rank files its save wrote): a rank did not finish"
                " saving"
            )
        if extra:
            details.append(f"has rank file(s) of ranks beyond world size {world_size} ({extra[:3]})")
        raise CheckpointFormatError(f"{sharded.source} " + " and ".join(details) + ". Use another checkpoint.")
    return [sharded.directory / SHARDED_RANK_FILE.format(rank=rank) for rank in sorted(present)]


def read_rank_file(sharded: ShardedCheckpoint, rank: int, *, mmap: bool = False) -> dict[str, Any]:
    """Reads ``rank<rank>.pt`` safely and checks that it is that rank's shard of this save.

    Args:
        sharded: The directory, from :func:`open_sharded`.
        rank: Whose file.
        mmap: Memory-map the tensors (read when used), for offline tools.

    Returns:
        The shard, without its save block.

    Raises:
        CheckpointFormatError: The file is missing, not a regular file, unreadable, of another save or rank.
    """
    path = sharded.directory / SHARDED_RANK_FILE.format(rank=rank)
    regular_file(path, sharded.source)
    shard = read_checkpoint(path, mmap=mmap)
    where = f"{sharded.source}: {path.name}"
    block = _save_block(shard, where)
    if block["save_id"] != sharded.save_id:
        raise CheckpointFormatError(
            f"{where} belongs to another save (id {block['save_id']!r}) than {SHARDED_META_FILE} ({sharded.save_id!r}):"
            " files of different saves were mixed. Use another checkpoint."
        )
    if block.get("rank") != rank or block["world_size"] != sharded.world_size:
        raise CheckpointFormatError(
            f"{where} holds the shard of rank {block.get('rank')!r} of {block['world_size']}, not of rank {rank} of"
            f" {sharded.world_size}: rank files were renamed or swapped. Use another checkpoint."
        )
    shard.pop(SHARDED_SAVE_KEY)
    return shard


def read_dcp_files(sharded: ShardedCheckpoint) -> Metadata:
    """Reads a DCP directory's ``.metadata`` safely and checks every ``.distcp`` file against this save.

    Raises:
        CheckpointFormatError: As :func:`~lightning_strategies.checkpoint.dcp.check_dcp_files`.
    """
    metadata = read_dcp_metadata(sharded.directory, sharded.source)
    check_dcp_files(sharded.directory, metadata, sharded.save_id, sharded.world_size, sharded.source)
    return metadata


def fairscale_model_layout(local_state: Mapping[str, Any], layout: Mapping[str, Any]) -> dict[str, Tensor]:
    """Canonical names, shapes and dtypes (as meta tensors) of the full model a fairscale rank file is a shard of."""
    result: dict[str, Tensor] = {}
    unit_keys = set()
    try:
        for unit in layout["units"]:
            unit_keys.add(unit["key"])
            dtype = local_state[unit["key"]].dtype
            for name, shape in zip(unit["names"], unit["shapes"], strict=True):
                result[str(name)] = torch.empty(tuple(shape), dtype=dtype, device="meta")
    except (KeyError, TypeError, ValueError, AttributeError, RuntimeError) as error:
        raise CheckpointFormatError(
            f"The rank file's {SHARDED_LAYOUT_KEY!r} block is malformed ({error!r})."
        ) from error
    # A tied parameter is held once, under its first name; its other names describe the same tensor.
    aliases = layout.get("aliases", {})
    if not isinstance(aliases, Mapping):
        raise CheckpointFormatError(f"The rank file's {SHARDED_LAYOUT_KEY!r} block has malformed 'aliases'.")
    for alias, holder in aliases.items():
        if holder in result:
            result[str(alias)] = result[holder]
    for key, value in local_state.items():
        if key not in unit_keys and key not in aliases and isinstance(value, Tensor):
            name = strip_wrapper_segments(key, INNER_WRAPPER_SEGMENTS)
            result[name] = torch.empty(value.shape, dtype=value.dtype, device="meta")
    return result


def read_sharded_meta(directory: Path) -> tuple[dict[str, Any], CheckpointMetadata, str]:
    """``meta.pt``, its metadata and the directory's name for messages (see :func:`open_sharded`)."""
    sharded = open_sharded(directory)
    return sharded.meta, sharded.metadata, sharded.source


def sharded_directory(path: str | Path) -> Path | None:
    """The sharded directory to read for ``path``, or ``None`` when ``path`` is a file (a full checkpoint)."""
    if "://" in str(path):
        return None
    candidate = Path(path)
    if candidate.is_dir():
        return candidate
    if candidate.exists():
        return None
    try:
        return resolve_sharded_directory(candidate)
    except FileNotFoundError:
        return None  # the full loader names the missing path
