"""The part of a sharded checkpoint directory that every strategy writes the same way: ``meta.pt``.

A sharded checkpoint is a directory. Its shards are the strategy's business (one file per rank, or a
``torch.distributed.checkpoint`` layout); ``meta.pt`` holds everything else Lightning saved (loops, schedulers,
callbacks, hyper-parameters) and the metadata block, so loading can refuse a directory it cannot use before reading
any shard.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_strategies.checkpoint.errors import CheckpointFormatError
from lightning_strategies.checkpoint.io import read_checkpoint
from lightning_strategies.checkpoint.metadata import METADATA_KEY, CheckpointMetadata

if TYPE_CHECKING:  # the checkpoint package itself never imports Lightning (both flavours share it)
    from lightning_fabric.plugins import CheckpointIO

SHARDED_META_FILE = "meta.pt"
# fsdp_fairscale's sharded directories: one file per rank. Each holds a layout block (which canonical parameters each
# flat shard holds and how the optimizer's flat state maps onto them), so `lightning-strategies consolidate` rebuilds
# canonical state without a process group.
SHARDED_RANK_FILE = "rank{rank}.pt"
SHARDED_RANK_FILE_PATTERN = re.compile(r"^rank(\d+)\.pt$")
SHARDED_LAYOUT_KEY = "flat_layout"
SHARDED_LAYOUT_VERSION = 1
SHARDED_STATE_KEYS = ("state_dict", "optimizer_states")


def write_sharded_meta(
    checkpoint_io: CheckpointIO, checkpoint: dict[str, Any], metadata: CheckpointMetadata, directory: Path
) -> None:
    """Writes ``directory/meta.pt``: the checkpoint without its sharded state, plus the metadata block (rank 0 only)."""
    rest = {key: value for key, value in checkpoint.items() if key not in SHARDED_STATE_KEYS}
    rest[METADATA_KEY] = metadata.to_dict()
    checkpoint_io.save_checkpoint(rest, directory / SHARDED_META_FILE)


def read_sharded_meta(directory: Path) -> tuple[dict[str, Any], CheckpointMetadata, str]:
    """Reads and checks ``directory/meta.pt``.

    Args:
        directory: The sharded checkpoint directory.

    Returns:
        The rest of the checkpoint, its metadata, and how error messages name the directory.

    Raises:
        CheckpointFormatError: No ``meta.pt``, or one that does not describe a sharded checkpoint.
    """
    source = f"Sharded checkpoint {str(directory)!r}"
    meta_path = directory / SHARDED_META_FILE
    if not meta_path.exists():
        raise CheckpointFormatError(
            f"{source} has no {SHARDED_META_FILE}: its save did not finish ({SHARDED_META_FILE} is written last, once"
            " every rank wrote its shards) or it is not a sharded checkpoint. Resume from an earlier checkpoint."
        )
    meta = read_checkpoint(meta_path)
    metadata = CheckpointMetadata.read(meta, source=source)
    if metadata is None or metadata.state_dict_type != "sharded":
        raise CheckpointFormatError(f"{source}: {SHARDED_META_FILE} does not describe a sharded checkpoint.")
    return meta, metadata, source
