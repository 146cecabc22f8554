"""One full canonical checkpoint from a sharded checkpoint directory, without a process group.

Used by ``lightning-strategies consolidate`` (written to a file) and by every strategy that is handed a sharded
directory it does not read natively (each rank builds the full state in memory, then loads it like a full file).
Works tensor by tensor: the output and the tensor being assembled are all that is held in memory (rank files are
memory-mapped; ``torch.distributed.checkpoint`` items are read one at a time).

The result is what the strategy would have written with ``state_dict_type="full"``: canonical model state, torch's
optimizer layout, the same Lightning entries (loops, schedulers, callbacks) and a metadata block saying ``"full"``.

- fairscale FSDP (``fsdp_fairscale``): ``rank<r>.pt`` per rank, each with its flat shards and the layout block
  (``flat_layout``) that names the canonical parameters each flat shard holds.
- ``torch.distributed.checkpoint`` directories: ours (``fsdp2``), upstream Lightning's ``ModelParallelStrategy`` and
  ``FSDPStrategy`` (see :class:`~lightning_strategies.checkpoint.dcp.DcpLayout`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from lightning_strategies._torch_private import dcp_set_element
from lightning_strategies.checkpoint.dcp import DcpLayout, dcp_tensor_count, iter_dcp_items
from lightning_strategies.checkpoint.errors import CheckpointError, CheckpointFormatError
from lightning_strategies.checkpoint.flat import split_full
from lightning_strategies.checkpoint.metadata import METADATA_KEY, CheckpointMetadata
from lightning_strategies.checkpoint.model_state import strip_wrapper_segments
from lightning_strategies.checkpoint.optimizer_state import name_keyed_to_canonical
from lightning_strategies.checkpoint.sharded import (
    INNER_WRAPPER_SEGMENTS,
    SHARDED_LAYOUT_KEY,
    ShardedCheckpoint,
    rank_file_paths,
    read_dcp_files,
    read_rank_file,
)

SUPPORTED_LAYOUT_VERSION = 1


class Tally(Protocol):
    """Counts tensors done (a progress bar, or nothing)."""

    def advance(self, count: int = 1) -> None:
        """Counts ``count`` more tensors done."""

    def close(self) -> None:
        """Ends the count."""


class _Silent:
    def advance(self, count: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


#: Makes a :class:`Tally` for a number of tensors.
TallyFactory = Callable[[int], Tally]


@dataclass
class ConsolidatedState:
    """The full canonical state of a sharded directory.

    Attributes:
        checkpoint: The full checkpoint: ``meta.pt``'s entries, ``state_dict``, ``optimizer_states`` (when the save
            had optimizer state) and a metadata block with ``state_dict_type="full"``.
        tensors: Model tensors.
        optimizer_tensors: Optimizer-state tensors.
    """

    checkpoint: dict[str, Any]
    tensors: int
    optimizer_tensors: int


def consolidate(
    sharded: ShardedCheckpoint, tally: TallyFactory | None = None, *, model_only: bool = False
) -> ConsolidatedState:
    """Builds the full canonical checkpoint of a sharded directory in memory.

    Args:
        sharded: The directory, from :func:`~lightning_strategies.checkpoint.sharded.open_sharded`.
        tally: Makes a progress count over tensors (default: none).
        model_only: Read the model state only (for an export): no ``optimizer_states`` in the result, and the
            optimizer's shards are not read.

    Returns:
        The checkpoint and what it holds.

    Raises:
        CheckpointFormatError: The directory is incomplete, mixed, damaged or inconsistent; named, nothing returned.
    """
    factory = tally if tally is not None else (lambda total: _Silent())
    try:
        if sharded.format == "torch.distributed.checkpoint":
            state, optimizer_states, optimizer_tensors = _dcp(sharded, factory, model_only)
        else:
            state, optimizer_states, optimizer_tensors = _fairscale(sharded, factory, model_only)
    except CheckpointError:
        raise
    except (KeyError, IndexError, TypeError, ValueError, AttributeError, RuntimeError, OSError) as error:
        # What the checks cannot see (damaged bytes inside a shard, a layout block edited by hand): named.
        raise CheckpointFormatError(
            f"{sharded.source}: its shards are damaged or inconsistent ({type(error).__name__}: {error}). Use another"
            " checkpoint."
        ) from error
    metadata = sharded.metadata
    full = CheckpointMetadata(metadata.format_version, metadata.strategy, metadata.world_size, "full").to_dict()
    checkpoint = {**sharded.meta, "state_dict": state, METADATA_KEY: full}
    if optimizer_states:  # the shards always hold a list; an empty one means the save had no optimizer state
        checkpoint["optimizer_states"] = optimizer_states
    return ConsolidatedState(checkpoint, len(state), optimizer_tensors)


def _numel(shapes: Sequence[Sequence[int]]) -> int:
    return sum(math.prod(shape) for shape in shapes)


def _cut(pieces: Sequence[Tensor], shapes: Sequence[Sequence[int]], what: str) -> list[Tensor]:
    """Concatenates the ranks' padded flat chunks, drops the padding and cuts the canonical tensors out."""
    if any(piece.dim() != 1 or piece.numel() != pieces[0].numel() for piece in pieces):
        raise CheckpointFormatError(
            f"{what}: the ranks' shards are not equal-sized 1-D chunks ({[p.shape for p in pieces]})."
        )
    numel = _numel(shapes)
    if pieces[0].numel() * len(pieces) < numel:
        raise CheckpointFormatError(f"{what}: the shards hold fewer elements than the {numel} of the parameters.")
    return split_full(torch.cat(list(pieces))[:numel], [torch.Size(shape) for shape in shapes])


# ---------------------------------------------------------------------------------------------- fairscale


def _same_layout(layout: Mapping[str, Any], other: Mapping[str, Any]) -> bool:
    return all(layout.get(key) == other.get(key) for key in ("version", "world_size", "units", "optimizers", "aliases"))


def _fairscale(
    sharded: ShardedCheckpoint, tally: TallyFactory, model_only: bool = False
) -> tuple[dict[str, Any], list[Any], int]:
    directory, world_size = sharded.directory, sharded.world_size
    # Each file checked to be this save's shard of its rank; memory-mapped: a shard's bytes are read when its tensors
    # are concatenated, not all up front.
    shards = [read_rank_file(sharded, rank, mmap=True) for rank in range(len(rank_file_paths(sharded)))]
    layouts: list[Mapping[str, Any]] = []
    for shard in shards:
        layout = shard.get(SHARDED_LAYOUT_KEY)
        if isinstance(layout, Mapping):
            layouts.append(layout)
    if len(layouts) != len(shards):
        raise CheckpointFormatError(
            f"{directory}: the rank files hold no {SHARDED_LAYOUT_KEY!r} block (written by an older"
            " lightning_strategies), so the flat shards cannot be cut into parameters offline. Resume it with"
            f" fsdp_fairscale at world size {world_size} and save with state_dict_type='full'."
        )
    layout = layouts[0]
    if layout.get("version", 0) > SUPPORTED_LAYOUT_VERSION:
        raise CheckpointFormatError(
            f"{directory}: layout version {layout['version']} is newer than this lightning_strategies."
        )
    for rank, other in enumerate(layouts[1:], start=1):
        if not _same_layout(layout, other):
            raise CheckpointFormatError(
                f"{directory}: rank{rank}.pt describes another layout than rank0.pt: they come from different models"
                " or wrappings."
            )
    units = layout["units"]
    for unit in units:
        if unit["world_size"] != world_size:
            raise CheckpointFormatError(
                f"{directory}: {unit['key']!r} is sharded over {unit['world_size']} of the {world_size} ranks (a"
                " process group smaller than the world); only world-sharded parameters can be consolidated."
            )
    unit_keys = {unit["key"] for unit in units}
    # A tied parameter is held once, under its first name; its other names are written with the same tensor.
    aliases: dict[str, str] = dict(layout.get("aliases", {}))
    buffers = [key for key in shards[0]["state_dict"] if key not in unit_keys and key not in aliases]
    rank_optimizer_states = [shard.get("optimizer_states", []) for shard in shards]
    # A weights-only save wrote no optimizer state; its layout still lists the optimizers of its run.
    optimizer_layouts = layout["optimizers"] if any(rank_optimizer_states) and not model_only else []
    optimizer_total = sum(
        len(units[unit_index]["names"]) * len(rank_optimizer_states[0][index]["state"].get(flat_index, {}))
        for index, optimizer_layout in enumerate(optimizer_layouts)
        for flat_index, unit_index in enumerate(optimizer_layout["units"])
    )
    model_total = sum(len(unit["names"]) for unit in units) + len(buffers)
    bar = tally(model_total + optimizer_total)
    try:
        state: dict[str, Any] = {}
        for unit in units:
            pieces = [shard["state_dict"][unit["key"]] for shard in shards]
            parts = _cut(pieces, unit["shapes"], f"{directory}: model tensor {unit['key']!r}")
            state.update(zip(unit["names"], parts, strict=True))
            bar.advance(len(parts))
        for alias, holder in aliases.items():
            if holder not in state:
                raise CheckpointFormatError(
                    f"{directory}: the tied parameter {alias!r} names {holder!r}, which no unit holds."
                )
            state[alias] = state[holder]
        for key in buffers:
            value = shards[0]["state_dict"][key]
            state[strip_wrapper_segments(key, INNER_WRAPPER_SEGMENTS)] = (
                value.clone() if isinstance(value, Tensor) else value
            )
            bar.advance()
        optimizer_states = []
        for index, optimizer_layout in enumerate(optimizer_layouts):
            rank_states = [states[index] for states in rank_optimizer_states]
            optimizer_states.append(_fairscale_optimizer(rank_states, optimizer_layout, units, index, bar, directory))
    finally:
        bar.close()
    return state, optimizer_states, optimizer_total


def _fairscale_optimizer(
    rank_states: Sequence[Mapping[str, Any]],
    layout: Mapping[str, Any],
    units: Sequence[Mapping[str, Any]],
    optimizer_index: int,
    bar: Tally,
    directory: Any,
) -> dict[str, Any]:
    """The canonical state of one optimizer from the ranks' flat states (as the strategy's gather builds it)."""
    group_names: list[list[str]] = layout["group_names"]
    index = {name: position for position, name in enumerate(name for names in group_names for name in names)}
    state: dict[int, dict[str, Any]] = {}
    for flat_index, unit_index in enumerate(layout["units"]):
        unit = units[unit_index]
        entries = rank_states[0]["state"].get(flat_index, {})
        for key, value in entries.items():
            if isinstance(value, Tensor) and value.dim() > 0:
                pieces = [rank_state["state"][flat_index][key] for rank_state in rank_states]
                what = f"{directory}: optimizer {optimizer_index} state {key!r}"
                parts: list[Any] = _cut(pieces, unit["shapes"], what)
            else:  # a scalar such as Adam's step: one independent copy per parameter
                parts = [value.detach().clone() if isinstance(value, Tensor) else value for _ in unit["names"]]
            for name, part in zip(unit["names"], parts, strict=True):
                state.setdefault(index[name], {})[key] = part
            bar.advance(len(parts))
    groups = [
        {**{key: value for key, value in group.items() if key != "params"}, "params": [index[n] for n in names]}
        for group, names in zip(rank_states[0]["param_groups"], group_names, strict=True)
    ]
    return {"state": dict(sorted(state.items())), "param_groups": groups}


# ---------------------------------------------------------------------------------------------- DCP


def _dcp(
    sharded: ShardedCheckpoint, tally: TallyFactory, model_only: bool = False
) -> tuple[dict[str, Any], list[Any], int]:
    directory = sharded.directory
    metadata = read_dcp_files(sharded)  # .metadata read safely; every .distcp file there, whole, of this save
    layout = DcpLayout.of(metadata, sharded.source)
    paths: dict[str, tuple[Any, ...]] = dict(metadata.planner_data or {})
    if model_only:  # the optimizer's items are left unread
        model_items = {
            key: item
            for key, item in metadata.state_dict_metadata.items()
            if layout.optimizer_index(str(paths.get(key, tuple(key.split(".", 1)))[0])) is None
        }
        metadata = dataclasses.replace(metadata, state_dict_metadata=model_items)
    values: dict[str, Any] = {}
    bar = tally(dcp_tensor_count(metadata))
    try:
        for key, value in iter_dcp_items(directory, metadata):
            values[key] = value
            bar.advance(int(isinstance(value, Tensor)))
    finally:
        bar.close()
    state: dict[str, Any] = {}
    optimizers: dict[int, dict[str, Any]] = {}
    for key, value in values.items():
        path = paths.get(key, tuple(key.split(".", 1)))
        if path[0] == layout.model_key and len(path) >= 2:  # deeper: a module's extra state, flattened by DCP
            dcp_set_element(state, (str(path[1]), *path[2:]), value)
            continue
        optimizer_index = layout.optimizer_index(str(path[0]))
        if optimizer_index is None or len(path) != 4 or path[1] not in ("state", "param_groups"):
            raise CheckpointFormatError(
                f"{directory}: unexpected item {key!r} (path {path}); not a checkpoint of {layout.writer}."
            )
        optimizer = optimizers.setdefault(optimizer_index, {"state": {}, "param_groups": {}})
        if path[1] == "state":
            optimizer["state"].setdefault(str(path[2]), {})[str(path[3])] = value
        else:
            optimizer["param_groups"].setdefault(int(path[2]), {})[str(path[3])] = value
    optimizer_states = [_by_index(optimizers[index], directory, index) for index in sorted(optimizers)]
    optimizer_tensors = sum(
        isinstance(value, Tensor)
        for optimizer in optimizer_states
        for entries in optimizer["state"].values()
        for value in entries.values()
    )
    return state, optimizer_states, optimizer_tensors


def _by_index(by_name: Mapping[str, Any], directory: Any, optimizer_index: int) -> dict[str, Any]:
    """torch keys sharded optimizer state by parameter name; canonical state counts parameters through the groups."""
    groups = [by_name["param_groups"][position] for position in sorted(by_name["param_groups"])]
    names = [name for group in groups for name in group.get("params", [])]
    unknown = sorted(set(by_name["state"]) - set(names))
    if unknown:
        raise CheckpointFormatError(
            f"{directory}: optimizer {optimizer_index} has state for {unknown[:3]}, which no param group lists."
        )
    return name_keyed_to_canonical({"state": by_name["state"], "param_groups": groups}, names)
