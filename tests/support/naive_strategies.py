"""Deliberately broken strategies: the regression cases the conformance kit must catch.

``NaiveShardedStrategy`` repeats issue 13500's two defects on fairscale sharded DDP: it takes the model state from
the wrapper instead of from the LightningModule (keys carry the wrapper's ``module.`` prefix), and it writes rank 0's
local optimizer shard as if it were the whole optimizer state.
"""

from __future__ import annotations

from typing import Any

from fairscale.optim import OSS
from torch.optim import Optimizer

from tests.support.flavour import ours


class NaiveShardedStrategy(ours.ShardedDDPStrategy):  # type: ignore[misc]
    strategy_name = "naive_sharded"

    def _canonical_model_state(self) -> dict[str, Any]:
        wrapper = self.model
        if wrapper is None or not self.is_global_zero:
            return {}
        return dict(wrapper.state_dict())

    def _canonical_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if isinstance(optimizer, OSS):
            return dict(optimizer.optim.state_dict())
        return super()._canonical_optimizer_state(optimizer)
