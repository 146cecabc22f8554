"""``FSDP2Strategy``'s sharded checkpoints: ``torch.distributed.checkpoint`` directories in upstream
``ModelParallelStrategy``'s layout (each reads the other's), resharded on load to the world size that reads them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.optim import Optimizer
from typing_extensions import override

from lightning_strategies.checkpoint import CheckpointError, check_model_state
from lightning_strategies.checkpoint.atomic import raise_if_disk_full
from lightning_strategies.checkpoint.dcp import (
    MODEL_PARALLEL_LAYOUT,
    DcpLayout,
    check_dcp_optimizer_states,
    dcp_model_layout,
    dcp_optimizer_count,
    dcp_stamps,
    rank_zero_save_planner,
    safe_dcp_load,
    saved_parameters_only,
    sliced_file_system_writer,
)
from lightning_strategies.checkpoint.optimizer_state import canonical_to_name_keyed
from lightning_strategies.checkpoint.sharded import ShardedCheckpoint, read_dcp_files

from .dtensor_state import load_into_module
from .sharded_format import ShardedFormat

if TYPE_CHECKING:
    from .fsdp2 import FSDP2Strategy

#: The name ``open_sharded`` gives this format.
DCP_FORMAT = "torch.distributed.checkpoint"


class DcpShards(ShardedFormat):
    """DCP directories: each rank writes its DTensor shards (whole tensors from rank 0); any world size reads them."""

    collective_write = True
    writes_in_background = True

    def __init__(self, strategy: FSDP2Strategy) -> None:
        self.strategy = strategy
        self._sharded: ShardedCheckpoint | None = None
        self._stored: Metadata | None = None
        # The templates the optimizer states load into, built by the check (building them steps each optimizer once).
        self._optimizer_templates: list[dict[str, Any]] | None = None

    # ------------------------------------------------------------------ save

    @override
    def model_state(self) -> dict[str, Any]:
        return dict(get_model_state_dict(self.strategy.require_lightning_module()))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not optimizer.state:  # before the first step torch's API steps the optimizer once (Adam's count ran ahead)
            names = [name for group in self.strategy._names(optimizer) for name in group]
            return canonical_to_name_keyed(optimizer.state_dict(), names)
        return dict(get_optimizer_state_dict(self.strategy.require_lightning_module(), optimizer))

    @override
    def write(self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str) -> None:
        self.background_writer(checkpoint, directory, staging, save_id, None)()

    @override
    def background_writer(
        self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str, process_group: Any
    ) -> Callable[[], None]:
        layout = MODEL_PARALLEL_LAYOUT  # upstream ModelParallelStrategy's: each reads the other's directories
        state = {
            layout.model_key: checkpoint["state_dict"],
            **{
                layout.optimizer_key(index): optimizer_state
                for index, optimizer_state in enumerate(checkpoint.get("optimizer_states", []))
            },
            **dcp_stamps(save_id, self.strategy.global_rank),
        }
        return partial(_dcp_write, state, directory, staging, process_group)

    # ------------------------------------------------------------------ restore

    @override
    def reads_in_place(self, sharded: ShardedCheckpoint) -> bool:
        return sharded.format == DCP_FORMAT

    @override
    def open(self, sharded: ShardedCheckpoint) -> dict[str, Any]:
        # .metadata read without running code; every .distcp file there, whole, and of this save.
        self._sharded, self._stored = sharded, read_dcp_files(sharded)
        if not self._holds_optimizer_states():  # weights-only: resumed like a weights-only file
            return {**sharded.meta, "state_dict": {}}
        # Lightning checks that optimizer states exist before asking the strategy to load them.
        return {**sharded.meta, "state_dict": {}, "optimizer_states": []}

    def _opened(self) -> tuple[ShardedCheckpoint, Metadata, DcpLayout]:
        if self._sharded is None or self._stored is None:
            raise RuntimeError("DcpShards: open() a sharded checkpoint before loading it.")
        return self._sharded, self._stored, DcpLayout.of(self._stored, self._sharded.source)

    def _holds_optimizer_states(self) -> bool:
        _, stored, layout = self._opened()
        return dcp_optimizer_count(stored, layout) > 0

    @override
    def holds_optimizer_states(self, checkpoint: Mapping[str, Any]) -> bool:
        return self._holds_optimizer_states()

    @override
    def problem(
        self, checkpoint: Mapping[str, Any], strict: bool, restoring_optimizers: bool
    ) -> CheckpointError | None:
        # Validated completely before any weight changes: DCP itself ignores keys the model lacks (an extra submodule
        # under strict loading) and would load the weights before finding that the optimizer state does not fit.
        sharded, stored, layout = self._opened()
        strategy = self.strategy
        try:
            saved_model = dcp_model_layout(stored, layout.model_key)
            expected = strategy._expected_model_state()
            check_model_state(expected, saved_model, strict=strict, source=sharded.source, shapes_only=True)
            if restoring_optimizers:
                module = strategy.require_lightning_module()
                templates = [get_optimizer_state_dict(module, optimizer) for optimizer in strategy._raw_optimizers()]
                self._optimizer_templates = saved_parameters_only(templates, stored, layout)
                check_dcp_optimizer_states(self._optimizer_templates, stored, layout, source=sharded.source)
        except CheckpointError as error:
            return error
        return None

    @override
    def load_model(self, checkpoint: Mapping[str, Any], strict: bool) -> None:
        sharded, stored, layout = self._opened()
        module = self.strategy.require_lightning_module()
        saved_model = dcp_model_layout(stored, layout.model_key)
        current = get_model_state_dict(module)
        model_state = {key: value for key, value in current.items() if key in saved_model}
        safe_dcp_load({layout.model_key: model_state}, sharded.directory)  # in place, resharded to this world size
        load_into_module(module, model_state, current)

    @override
    def load_optimizers(self, checkpoint: Mapping[str, Any]) -> None:
        sharded, stored, layout = self._opened()
        module = self.strategy.require_lightning_module()
        optimizers = self.strategy._raw_optimizers()
        # The templates the check built: the optimizers' states, which the model's load left as they were.
        templates = self._optimizer_templates or saved_parameters_only(
            [get_optimizer_state_dict(module, optimizer) for optimizer in optimizers], stored, layout
        )
        safe_dcp_load({layout.optimizer_key(i): template for i, template in enumerate(templates)}, sharded.directory)
        # Not strict: a parameter that had no state when saved (never a gradient) has none now, as under ddp.
        options = StateDictOptions(strict=False)
        for optimizer, state in zip(optimizers, templates, strict=True):
            set_optimizer_state_dict(module, optimizer, optim_state_dict=state, options=options)


def _dcp_write(state: dict[str, Any], directory: Path, staging: Path, process_group: Any) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into ``staging`` (a collective on ``process_group``, the
    default group when ``None``)."""
    try:
        # Buffers and other whole tensors from rank 0, as under ddp (each rank keeps its own running stats).
        dcp_save(
            state,
            storage_writer=sliced_file_system_writer(staging),
            planner=rank_zero_save_planner(),
            process_group=process_group,
        )
    except CheckpointException as error:  # does not survive the trip to the launching process: re-told
        raise_if_disk_full(error, directory)
        raise RuntimeError(f"Saving sharded checkpoint {str(directory)!r} failed: {error}") from None
