"""``lightning-strategies consolidate``: one full canonical checkpoint file from a sharded checkpoint directory.

The directory may be ours (``fsdp_fairscale`` rank files, ``fsdp2``'s ``torch.distributed.checkpoint`` layout) or
upstream Lightning's (``ModelParallelStrategy``, ``FSDPStrategy`` with ``state_dict_type="sharded"``). The work is
:func:`lightning_strategies.checkpoint.consolidation.consolidate`, on the CPU, without a process group, tensor by
tensor; this module adds the paths, the progress bar and the atomic write.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning_strategies.checkpoint import METADATA_KEY, CheckpointError
from lightning_strategies.checkpoint.atomic import atomic_torch_save
from lightning_strategies.checkpoint.consolidation import consolidate
from lightning_strategies.checkpoint.sharded import open_sharded

from ._common import CommandError, Progress, existing_input, writable_output


@dataclass
class Consolidation:
    """What ``consolidate`` wrote.

    Attributes:
        out: The full checkpoint.
        format: ``"fairscale FSDP local shards"`` or ``"torch.distributed.checkpoint"``.
        metadata: The metadata block of the output.
        tensors: Model tensors written.
        optimizer_tensors: Optimizer-state tensors written.
    """

    out: Path
    format: str
    metadata: dict[str, Any]
    tensors: int
    optimizer_tensors: int


# ---------------------------------------------------------------------------------------------- command


def consolidate_checkpoint(
    directory: Path, out: Path, *, force: bool = False, show_progress: bool = True
) -> Consolidation:
    """Writes one full canonical checkpoint from a sharded checkpoint directory.

    Args:
        directory: A sharded checkpoint directory (``meta.pt``) of ``fsdp_fairscale``, ``fsdp2`` or upstream Lightning.
        out: The checkpoint file to write (atomically).
        force: Replace ``out`` if it exists.
        show_progress: Show a progress bar over tensors on stderr.

    Returns:
        What was written.

    Raises:
        UsageError: Bad paths.
        CommandError: The directory is incomplete or not a sharded checkpoint of ours.
    """
    existing_input(directory, directory=True)
    writable_output(out, directory, force=force)
    try:
        sharded = open_sharded(directory)
        result = consolidate(sharded, lambda total: Progress(total, "consolidating", show_progress))
    except (CheckpointError, FileNotFoundError) as error:
        raise CommandError(f"{error} Nothing was written.") from error
    try:
        atomic_torch_save(result.checkpoint, out)
    except OSError as error:
        raise CommandError(str(error)) from error
    metadata = result.checkpoint[METADATA_KEY]
    return Consolidation(out, sharded.format, metadata, result.tensors, result.optimizer_tensors)
