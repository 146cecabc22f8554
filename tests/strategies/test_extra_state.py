"""Modules with state that is not a tensor (``get_extra_state``) train, save and resume under every strategy."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.strategies import Strategy

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy
from lightning_strategies.testing import ConformanceModel
from tests.support.helpers import RankRecorder, assert_resume_restores_exactly, canonical_checkpoint, fit, new_model


class StepCounter(torch.nn.Module):
    """Holds state that is not a tensor: the number of training forwards it saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        self.seen += int(self.training)
        return inputs

    def get_extra_state(self) -> dict[str, int]:
        return {"seen": self.seen}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.seen = state["seen"]


class StepCountingModel(ConformanceModel):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counter = StepCounter()

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return super().forward(self.counter(inputs))


STRATEGIES: dict[str, Callable[[], str | Strategy]] = {
    "ddp": lambda: "ddp_fork",
    "ddp_sharded": lambda: "ddp_sharded_fork",
    "fsdp_fairscale": lambda: "fsdp_fairscale_fork",
    "fsdp_fairscale-sharded": lambda: FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"),
    "fsdp2": lambda: "fsdp2_fork",
    "fsdp2-sharded": lambda: FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_state_that_is_not_a_tensor_resumes_exactly(tmp_path: Path, strategy: str) -> None:
    # fsdp2 copies tensors into the module's own shards in place; the rest goes through torch's loader.
    make = STRATEGIES[strategy]
    _, restored = assert_resume_restores_exactly(tmp_path, make(), make(), cls=StepCountingModel)
    assert canonical_checkpoint(restored)["state_dict"]["counter._extra_state"]["seen"] > 0  # not a fresh counter


class RankSeededModel(StepCountingModel):
    """Each rank initialises other weights: the strategy must start every rank from rank 0's."""

    def configure_model(self) -> None:
        if self._trainer is not None:
            torch.manual_seed(100 + self.trainer.global_rank)
            self.encoder.reset_parameters()


def test_ddp_sharded_starts_every_rank_from_rank_0s_weights(tmp_path: Path) -> None:
    # fairscale's own start-up sync fails on extra state, so the strategy broadcasts the tensors itself.
    recorder = RankRecorder(tmp_path, "on_train_start", lambda trainer, module: module.encoder.weight.sum().item())
    fit("ddp_sharded_fork", new_model(cls=RankSeededModel), callbacks=[recorder], max_epochs=1)
    rank0, rank1 = recorder.read()
    assert rank0 == rank1
