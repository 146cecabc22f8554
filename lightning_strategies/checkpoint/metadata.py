"""The ``checkpoint["lightning_strategies"]`` block: what wrote a checkpoint and in which form.

Loading reads it to give clear errors (a sharded checkpoint handed to a full loader, a file from a newer format),
never to guess how to interpret the state: the state itself is always canonical.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Final, Literal

from lightning_strategies.checkpoint.errors import CheckpointFormatError

METADATA_KEY: Final = "lightning_strategies"
FORMAT_VERSION: Final = 1

StateDictType = Literal["full", "sharded"]
_STATE_DICT_TYPES: Final = ("full", "sharded")


@dataclass(frozen=True)
class CheckpointMetadata:
    """Describes the writer of a checkpoint.

    Attributes:
        format_version: Version of the canonical checkpoint format (see ``FORMAT_VERSION``).
        strategy: Registry name of the strategy that wrote the checkpoint, e.g. ``"ddp_sharded"``.
        world_size: Number of processes that trained when the checkpoint was written.
        state_dict_type: ``"full"`` (one file, canonical state) or ``"sharded"`` (one file per rank).
    """

    format_version: int
    strategy: str
    world_size: int
    state_dict_type: StateDictType

    def to_dict(self) -> dict[str, Any]:
        """Returns the block as plain Python values, safe for ``torch.load(weights_only=True)``."""
        return asdict(self)

    @classmethod
    def read(cls, checkpoint: Mapping[str, Any], *, source: str = "the checkpoint") -> CheckpointMetadata | None:
        """Reads and validates the block of ``checkpoint``.

        Args:
            checkpoint: A loaded checkpoint dictionary.
            source: How to name the checkpoint in error messages (usually its path).

        Returns:
            The metadata, or ``None`` when the checkpoint has no block (written by upstream Lightning or by hand).

        Raises:
            CheckpointFormatError: The block is malformed or comes from a newer format than this package reads.
        """
        block = checkpoint.get(METADATA_KEY)
        if block is None:
            return None
        if not isinstance(block, Mapping):
            raise CheckpointFormatError(
                f"{source}: checkpoint[{METADATA_KEY!r}] should be a dict, found {type(block).__name__}."
            )
        fields = ("format_version", "strategy", "world_size", "state_dict_type")
        missing = [name for name in fields if name not in block]
        if missing:
            raise CheckpointFormatError(f"{source}: checkpoint[{METADATA_KEY!r}] lacks {', '.join(missing)}.")
        version, strategy, world_size, state_dict_type = (block[name] for name in fields)
        if not isinstance(version, int) or version < 1:
            raise CheckpointFormatError(f"{source}: invalid format_version {version!r} (expected an integer >= 1).")
        if version > FORMAT_VERSION:
            raise CheckpointFormatError(
                f"{source} uses checkpoint format version {version}, but this lightning_strategies reads versions up to"
                f" {FORMAT_VERSION}. Upgrade lightning_strategies to load it."
            )
        if state_dict_type not in _STATE_DICT_TYPES:
            raise CheckpointFormatError(
                f"{source}: state_dict_type {state_dict_type!r} is not one of {', '.join(_STATE_DICT_TYPES)}."
            )
        if not isinstance(world_size, int) or world_size < 1:
            raise CheckpointFormatError(f"{source}: invalid world_size {world_size!r}.")
        return cls(
            format_version=version, strategy=str(strategy), world_size=world_size, state_dict_type=state_dict_type
        )


def require_full_checkpoint(checkpoint: Mapping[str, Any], *, source: str = "the checkpoint") -> None:
    """Raises unless ``checkpoint`` holds full (not sharded) canonical state.

    Args:
        checkpoint: A loaded checkpoint dictionary.
        source: How to name the checkpoint in error messages.

    Raises:
        CheckpointFormatError: The metadata block is invalid or says the checkpoint is sharded.
    """
    metadata = CheckpointMetadata.read(checkpoint, source=source)
    if metadata is not None and metadata.state_dict_type != "full":
        raise CheckpointFormatError(
            f"{source} holds one rank's shard (state_dict_type={metadata.state_dict_type!r}, written by"
            f" {metadata.strategy!r} at world size {metadata.world_size}), not the full model. Consolidate it into a"
            " full checkpoint first, or resume with the same strategy and world size."
        )
