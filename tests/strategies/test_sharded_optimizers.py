"""How configure_optimizers() results become fairscale OSS optimizers (one process, world size 1)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fairscale.optim import OSS

from lightning_strategies.fairscale.sharded_ddp import _to_oss
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
    sharded = _to_oss(plain)

    assert isinstance(sharded, OSS)
    assert isinstance(sharded.optim, torch.optim.Adam)
    assert [group["lr"] for group in sharded.param_groups] == [0.5, 0.1]
    assert all(group["betas"] == (0.8, 0.9) for group in sharded.param_groups)
    assert [len(group["params"]) for group in sharded.param_groups] == [2, 2]


def test_the_original_param_group_dicts_are_not_shared(single_process_group: None) -> None:
    plain = torch.optim.SGD(_groups(), lr=0.1)
    sharded = _to_oss(plain)

    sharded.param_groups[0]["lr"] = 9.0
    assert plain.param_groups[0]["lr"] == 0.5


def test_an_oss_optimizer_is_kept_as_it_is(single_process_group: None) -> None:
    already = OSS(_groups(), optim=torch.optim.SGD, lr=0.1)
    assert _to_oss(already) is already


def test_the_shard_optimizer_is_a_twin_of_the_users_not_a_new_construction(single_process_group: None) -> None:
    # torch 2.13's AdamW keeps `decoupled_weight_decay` in its defaults but does not take it as an argument.
    plain = torch.optim.AdamW(_groups(), lr=0.1, weight_decay=0.05)
    sharded = _to_oss(plain)

    assert type(sharded.optim) is torch.optim.AdamW
    assert sharded.optim.defaults == plain.defaults
    assert [group["weight_decay"] for group in sharded.param_groups] == [0.05, 0.05]


def test_a_users_optimizer_with_its_own_constructor_arguments_is_sharded(single_process_group: None) -> None:
    sharded = _to_oss(ScaledSGD(_groups()))

    assert type(sharded.optim) is ScaledSGD
    assert sharded.optim.defaults["scale"] == 2.0


def test_the_twin_does_not_step_the_original_optimizer(single_process_group: None) -> None:
    groups = _groups()
    plain = torch.optim.SGD(groups, lr=0.1)
    torch.optim.lr_scheduler.StepLR(plain, step_size=1)  # wraps plain.step on the instance
    sharded = _to_oss(plain)
    for group in groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)

    sharded.step()
    assert not getattr(plain, "_opt_called", False)


class PlainMomentum(torch.optim.Optimizer):
    """A user's optimizer whose defaults lack torch's `differentiable`."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, {"lr": lr})


def test_the_twin_keeps_the_param_group_keys_of_a_users_optimizer(single_process_group: None) -> None:
    plain = PlainMomentum(_groups())
    sharded = _to_oss(plain)

    # Checkpoints of a plain optimizer and of the sharded one must hold the same param group keys.
    assert set(sharded.optim.param_groups[0]) == set(plain.param_groups[0])
    assert plain.defaults == {"lr": 0.1}


class KeepsItsParameters(torch.optim.SGD):
    """An optimizer that remembers its parameters outside param_groups (as torch's LBFGS does)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1)
        self.remembered = [p for group in self.param_groups for p in group["params"]]


def test_an_optimizer_keeping_its_parameters_in_an_attribute_is_refused(single_process_group: None) -> None:
    with pytest.raises(ValueError, match=r"KeepsItsParameters keeps its parameters in attribute\(s\) remembered"):
        _to_oss(KeepsItsParameters(_groups()))
