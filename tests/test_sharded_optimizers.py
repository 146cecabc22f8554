"""How configure_optimizers() results become fairscale OSS optimizers (one process, world size 1)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.optim import OSS

from lightning_strategies.strategies.sharded_ddp import _to_oss
from tests.conftest import free_loopback_port


@pytest.fixture
def single_process_group() -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_loopback_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class ScaledSGD(torch.optim.SGD):
    """An optimizer whose defaults hold a key its constructor does not take."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, lr=lr)
        self.defaults["scale"] = 2.0


def _groups() -> list[dict[str, Any]]:
    torch.manual_seed(0)
    encoder, head = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    return [{"params": list(encoder.parameters()), "lr": 0.5}, {"params": list(head.parameters())}]


def test_an_optimizer_becomes_oss_of_its_type_with_its_groups_and_defaults(single_process_group: None) -> None:
    plain = torch.optim.Adam(_groups(), lr=0.1, betas=(0.8, 0.9))
    sharded = _to_oss(plain, 0)

    assert isinstance(sharded, OSS)
    assert isinstance(sharded.optim, torch.optim.Adam)
    assert [group["lr"] for group in sharded.param_groups] == [0.5, 0.1]
    assert all(group["betas"] == (0.8, 0.9) for group in sharded.param_groups)
    assert [len(group["params"]) for group in sharded.param_groups] == [2, 2]


def test_the_original_param_group_dicts_are_not_shared(single_process_group: None) -> None:
    plain = torch.optim.SGD(_groups(), lr=0.1)
    sharded = _to_oss(plain, 0)

    sharded.param_groups[0]["lr"] = 9.0
    assert plain.param_groups[0]["lr"] == 0.5


def test_an_oss_optimizer_is_kept_as_it_is(single_process_group: None) -> None:
    already = OSS(_groups(), optim=torch.optim.SGD, lr=0.1)
    assert _to_oss(already, 0) is already


def test_an_optimizer_with_state_is_refused_naming_it(single_process_group: None) -> None:
    groups = _groups()
    plain = torch.optim.SGD(groups, lr=0.1, momentum=0.9)
    for group in groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    plain.step()

    with pytest.raises(ValueError, match=r"Optimizer 3 \(SGD\) already holds state"):
        _to_oss(plain, 3)


def test_an_optimizer_that_cannot_be_rebuilt_from_its_defaults_names_the_fix(single_process_group: None) -> None:
    with pytest.raises(TypeError, match=r"Optimizer 0 \(ScaledSGD\) cannot be sharded.*Build `fairscale.optim.OSS`"):
        _to_oss(ScaledSGD(_groups()), 0)
