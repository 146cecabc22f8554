"""``FairScaleFSDPStrategy``'s sharded checkpoints: one rank file of local flat shards per rank (the
"fairscale FSDP local shards" format), with the layout that turns them into canonical state offline."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import (
    CheckpointError,
    CheckpointFormatError,
    canonical_keys,
    check_model_state,
    check_optimizer_states,
    param_group_shapes,
    to_module_keys,
)
from lightning_strategies.checkpoint.sharded import (
    SHARDED_LAYOUT_KEY,
    SHARDED_LAYOUT_VERSION,
    SHARDED_RANK_FILE,
    SHARDED_SAVE_KEY,
    ShardedCheckpoint,
    fairscale_model_layout,
    rank_file_paths,
    read_rank_file,
    save_stamp,
)
from lightning_strategies.checkpoint.training_state import holds_optimizer_state
from lightning_strategies.fairscale._private import lazy_init
from lightning_strategies.fairscale.layout import FAIRSCALE_SEGMENTS, canonical_name, fsdp_instances

from ..strategies.sharded_format import ShardedFormat

if TYPE_CHECKING:
    from .fsdp import FairScaleFSDPStrategy

#: The name ``open_sharded`` gives this format.
FAIRSCALE_LOCAL_SHARDS = "fairscale FSDP local shards"


class FairScaleLocalShards(ShardedFormat):
    """Rank files of ``local_state_dict()`` flat shards and the flat optimizer states, read back in place at the same
    world size, wrapping and param groups (anything else is consolidated)."""

    writes_in_background = True

    def __init__(self, strategy: FairScaleFSDPStrategy) -> None:
        self.strategy = strategy
        self._source = "the rank file"  # this rank's file, once opened

    # ------------------------------------------------------------------ save

    @override
    def model_state(self) -> dict[str, Any]:
        return canonical_keys(self.strategy._root().local_state_dict())

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return dict(optimizer.state_dict())

    @override
    def write(self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str) -> None:
        self.background_writer(checkpoint, directory, staging, save_id, None)()

    @override
    def background_writer(
        self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str, process_group: Any
    ) -> Callable[[], None]:
        strategy = self.strategy
        shard = {
            "state_dict": checkpoint["state_dict"],
            "optimizer_states": checkpoint.get("optimizer_states", []),
            SHARDED_LAYOUT_KEY: self.layout(),  # read from the strategy now, in the foreground
            SHARDED_SAVE_KEY: save_stamp(save_id, strategy.world_size, strategy.global_rank),
        }
        rank_file = staging / SHARDED_RANK_FILE.format(rank=strategy.global_rank)
        return partial(strategy.sharded_checkpoint_io.save_checkpoint, shard, rank_file)

    def layout(self) -> dict[str, Any]:
        """What a rank file needs to be turned into canonical state offline (plain values, ``weights_only``-safe).

        ``units``: the flat shards in ``local_state_dict()`` (its key, the canonical names and shapes it holds, the
        size of its process group); ``optimizers``: for each optimizer, the canonical names of each param group and
        which unit each index of its flat state is; ``aliases``: the other keys of tied parameters.
        """
        strategy = self.strategy
        key_of = {id(param): canonical_name(name) for name, param in strategy._root().named_parameters()}
        position = {id(unit.param): index for index, unit in enumerate(strategy._units)}
        units = [
            {
                "key": key_of[id(unit.param)],
                "names": list(unit.names),
                "shapes": [list(shape) for shape in unit.shapes],
                "world_size": unit.instance.world_size,
            }
            for unit in strategy._units
        ]
        optimizers = []
        for optimizer in strategy._raw_optimizers():
            layout = strategy._layout_of(optimizer)
            optimizers.append(
                {
                    "group_names": [list(names) for names in layout.group_names],
                    "units": [position[id(unit.param)] for unit in layout.flat_units],
                }
            )
        return {
            "version": SHARDED_LAYOUT_VERSION,
            "rank": strategy.global_rank,
            "world_size": strategy.world_size,
            "units": units,
            "optimizers": optimizers,
            "aliases": dict(strategy._aliases),  # tied parameters' other keys -> the key that holds them
        }

    # ------------------------------------------------------------------ restore

    @override
    def reads_in_place(self, sharded: ShardedCheckpoint) -> bool:
        # Rank files hold flat shards of their world size only.
        strategy = self.strategy
        return (
            sharded.format == FAIRSCALE_LOCAL_SHARDS
            and sharded.metadata.strategy == strategy.strategy_name
            and sharded.metadata.world_size == strategy.world_size
        )

    @override
    def open(self, sharded: ShardedCheckpoint) -> dict[str, Any]:
        rank = self.strategy.global_rank
        rank_file_paths(sharded)  # every rank's file is there: a missing one is named on every rank
        shard = read_rank_file(sharded, rank)
        self._source = f"{sharded.source}: {SHARDED_RANK_FILE.format(rank=rank)}"
        if not holds_optimizer_state(shard):  # a weights-only save: resumed like a weights-only file
            shard.pop("optimizer_states", None)
        return {**sharded.meta, **shard}

    @override
    def holds_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        return holds_optimizer_state(checkpoint)

    @override
    def problem(
        self, checkpoint: Mapping[str, Any], strict: bool, restoring_optimizers: bool
    ) -> CheckpointError | None:
        strategy = self.strategy
        root = strategy._root()
        for _, instance in fsdp_instances(root):
            lazy_init(instance)  # local_state_dict and load_local_state_dict need every instance initialised
        where = self._source
        saved, own = checkpoint.get(SHARDED_LAYOUT_KEY), self.layout()
        try:
            if not isinstance(saved, Mapping):
                raise CheckpointFormatError(f"{where} holds no {SHARDED_LAYOUT_KEY!r} block.")
            optimizers = strategy._raw_optimizers()
            if restoring_optimizers and len(checkpoint["optimizer_states"]) != len(optimizers):
                # Named before the layout check (whose optimizers differ too): raises the count mismatch.
                check_optimizer_states(checkpoint["optimizer_states"], optimizers, [], source=where)
            # A weights-only save's layout still lists the optimizers of its run, which it did not save.
            compared = (
                "version",
                "world_size",
                "units",
                *(("optimizers",) if holds_optimizer_state(checkpoint) else ()),
            )
            if any(saved.get(key) != own[key] for key in compared):
                # Name the parameters that differ when the model differs; else the wrapping or param groups do.
                described = fairscale_model_layout(checkpoint.get("state_dict", {}), saved)
                check_model_state(strategy._expected_model_state(), described, source=where, shapes_only=True)
                raise CheckpointFormatError(
                    f"{where} was saved with another wrapping or other param groups (its flat parameters hold other"
                    " parameters); nothing was loaded. Use the same auto_wrap_min_params, flatten_parameters,"
                    " configure_model and configure_optimizers as the run that saved it, or consolidate it."
                )
            local = {  # entries that are not tensors (a module's extra state) as they are
                key: torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, Tensor) else value
                for key, value in root.local_state_dict().items()
            }
            saved_local = checkpoint.get("state_dict", {})
            if isinstance(saved_local, Mapping):  # a compiled submodule's buffers: canonical keys on both sides
                saved_local = canonical_keys(saved_local)
            check_model_state(canonical_keys(local), saved_local, strict=True, source=where)
            if restoring_optimizers:
                shapes = [param_group_shapes(optimizer) for optimizer in optimizers]
                check_optimizer_states(checkpoint["optimizer_states"], optimizers, shapes, source=where)
        except CheckpointError as error:
            return error
        return None

    @override
    def load_model(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        root = self.strategy._root()
        with self.strategy._guarding_views():
            root.load_local_state_dict(
                to_module_keys(checkpoint["state_dict"], root, FAIRSCALE_SEGMENTS), strict=strict
            )

    @override
    def load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        for optimizer, state in zip(self.strategy._raw_optimizers(), checkpoint["optimizer_states"], strict=True):
            optimizer.load_state_dict(dict(state))
