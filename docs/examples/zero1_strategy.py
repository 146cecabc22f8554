"""ZeRO-1 on torch's ZeroRedundancyOptimizer: DDP's whole parameters and gradients, optimizer state sharded by rank.

Checkpoints hold canonical state (the model's own keys, torch's optimizer layout), so they resume under ``ddp`` and
under every strategy of lightning_strategies, and theirs resume here. Run it to check it with the conformance kit.
"""

from __future__ import annotations

import tempfile
from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_strategies import DirectReferenceStrategy, ShardedFormat
from lightning_strategies.checkpoint.dcp import dcp_stamps
from lightning_strategies.strategies.optimizers import retarget_schedulers
from lightning_strategies.testing import assert_strategy_conforms


class Zero1Strategy(DirectReferenceStrategy):
    """DDP whose optimizers are ``ZeroRedundancyOptimizer`` s: each rank steps and keeps the state of its partition.

    Args:
        state_dict_type: ``"full"`` (one canonical file, written by rank 0) or ``"sharded"`` (a directory into which
            each rank writes its own partition of the optimizer state).
        **kwargs: ``DirectReferenceStrategy``'s arguments (``start_method``, ...).
    """

    strategy_name = "zero1"

    def __init__(self, state_dict_type: str = "full", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._state_dict_type = self._checked_state_dict_type(state_dict_type)

    def configure_for_fit(self, trainer: Any) -> None:
        self.model = DistributedDataParallel(self.require_lightning_module())  # wraps the module itself
        self.setup_optimizers(trainer)  # configure_optimizers() over the parameters that train
        sharded: list[Optimizer] = []
        for optimizer in self.optimizers:  # each becomes a ZeRO optimizer of the same class and param groups
            zero = ZeroRedundancyOptimizer([dict(group) for group in optimizer.param_groups], type(optimizer))
            retarget_schedulers(self.lr_scheduler_configs, optimizer, zero)  # the LR schedulers now drive it
            sharded.append(zero)
        self.optimizers = sharded

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        # Gradient accumulation: DDP skips the all-reduce until the last backward before a step.
        with self.model.no_sync() if isinstance(self.model, DistributedDataParallel) else nullcontext():
            yield

    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            return super()._canonical_optimizer_state(optimizer)
        optimizer.consolidate_state_dict(to=0)  # every rank sends its partition to rank 0 (a collective)
        if not self.is_global_zero:
            return {}
        state = optimizer.state_dict()  # integer-keyed through the param groups: torch's canonical layout
        optimizer._all_state_dicts = []  # type: ignore[attr-defined]  # rank 0 would keep this copy until the next save
        return state

    def _load_canonical_optimizer_state(self, optimizer: Optimizer, state: Mapping[str, Any]) -> None:
        # Every rank is given the whole state and keeps its partition. ZeRO sets the other ranks' entries of the dict
        # it is given to None: it gets a copy, so the checkpoint stays whole.
        optimizer.load_state_dict({**state, "state": dict(state["state"])})

    def sharded_format(self) -> Zero1Shards:
        return Zero1Shards(self)


class Zero1Shards(ShardedFormat):
    """``state_dict_type="sharded"``: a ``torch.distributed.checkpoint`` directory in the layout ``fsdp2`` writes.

    The model is written once (every rank holds it whole); each rank writes its own optimizer partition, keyed by
    parameter name. ``lightning-strategies consolidate`` turns it into a full file; ``fsdp2`` reads it in place.
    """

    collective_write = True  # torch's save returns on rank 0 once every rank's files are written

    def __init__(self, strategy: Zero1Strategy) -> None:
        self.strategy = strategy

    def model_state(self) -> dict[str, Any]:
        return self.strategy.require_lightning_module().state_dict()  # the same on every rank: written from rank 0

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not isinstance(optimizer, ZeroRedundancyOptimizer):
            raise TypeError(f"Zero1Shards saves ZeroRedundancyOptimizers, not {type(optimizer).__name__}.")
        module = self.strategy.require_lightning_module()
        names = {param: name for name, param in module.named_parameters()}
        groups = [{**group, "params": [names[param] for param in group["params"]]} for group in optimizer.param_groups]
        owned = {names[param]: dict(entries) for param, entries in optimizer.optim.state.items()}  # this partition
        return {"state": owned, "param_groups": groups}

    def write(self, checkpoint: Mapping[str, Any], directory: Path, staging: Path, save_id: str) -> None:
        state = {"state_dict": checkpoint["state_dict"], **dcp_stamps(save_id, self.strategy.global_rank)}
        for index, optimizer_state in enumerate(checkpoint.get("optimizer_states", [])):
            state[f"optimizer_{index}"] = optimizer_state
        dcp_save(state, checkpoint_id=staging, planner=DefaultSavePlanner(dedup_save_to_lowest_rank=True))

    # Restore: nothing here. ShardedFormat's defaults make it write-only: the base class consolidates every sharded
    # directory (this one, fsdp2's, upstream's) into full canonical state on each rank, and
    # `_load_canonical_optimizer_state` keeps this rank's partition of it. Reading only this rank's partition in place
    # would mean implementing reads_in_place, open, holds_optimizer_states, problem, load_model and load_optimizers.


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as workdir:
        report = assert_strategy_conforms(lambda: Zero1Strategy(start_method="fork"), workdir)
    print(report)  # one line per check; raises ConformanceError naming the failed checks instead
