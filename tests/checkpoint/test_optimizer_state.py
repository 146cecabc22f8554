"""Canonical optimizer states are checked against the optimizers before any is loaded."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from lightning_strategies.checkpoint import (
    OptimizerStateMismatchError,
    check_optimizer_state,
    check_optimizer_states,
    param_group_shapes,
)
from lightning_strategies.testing import ConformanceModel


def _trained_adam() -> tuple[ConformanceModel, torch.optim.Optimizer, dict[str, Any]]:
    torch.manual_seed(0)
    model = ConformanceModel()
    optimizer = model.configure_optimizers()["optimizer"]
    model(torch.ones(2, 8)).sum().backward()
    optimizer.step()
    return model, optimizer, optimizer.state_dict()


def _fresh(model: ConformanceModel, kind: str = "adam") -> torch.optim.Optimizer:
    model.optimizer_name = kind
    optimizer: torch.optim.Optimizer = model.configure_optimizers()["optimizer"]
    return optimizer


def test_a_plain_optimizers_state_passes() -> None:
    model, optimizer, state = _trained_adam()
    check_optimizer_state(state, _fresh(model), param_group_shapes(optimizer))


def test_a_different_number_of_optimizers_is_named() -> None:
    model, _, state = _trained_adam()
    fresh = _fresh(model)
    with pytest.raises(
        OptimizerStateMismatchError, match=r"holds 2 optimizer state\(s\).*returned 1 optimizer\(s\) \(Adam\)"
    ):
        check_optimizer_states([state, state], [fresh], [param_group_shapes(fresh)], source="ckpt")


def test_a_different_number_of_param_groups_is_named() -> None:
    model, optimizer, state = _trained_adam()
    merged = {**state, "param_groups": [{**state["param_groups"][0], "params": [0, 1, 2, 3]}]}
    with pytest.raises(OptimizerStateMismatchError, match=r"1 param group\(s\), the optimizer has 2"):
        check_optimizer_state(merged, _fresh(model), param_group_shapes(optimizer))


def test_one_ranks_shard_is_recognised_by_its_group_sizes() -> None:
    model, optimizer, state = _trained_adam()
    shard = {
        "state": {0: state["state"][0]},
        "param_groups": [{**g, "params": g["params"][:1]} for g in state["param_groups"]],
    }
    with pytest.raises(OptimizerStateMismatchError, match=r"param group 0 has 1 parameter.*one rank's shard"):
        check_optimizer_state(shard, _fresh(model), param_group_shapes(optimizer))


def test_state_of_another_optimizer_type_is_refused() -> None:
    model, optimizer, _ = _trained_adam()
    sgd = _fresh(model, "sgd")
    model(torch.ones(2, 8)).sum().backward()
    sgd.step()
    with pytest.raises(OptimizerStateMismatchError, match=r"lacks 'amsgrad', 'betas'.*another optimizer type"):
        check_optimizer_state(sgd.state_dict(), _fresh(model, "adam"), param_group_shapes(optimizer))


def test_flattened_state_is_refused_naming_the_parameter_and_shapes() -> None:
    model, optimizer, state = _trained_adam()
    state["state"][0]["exp_avg"] = state["state"][0]["exp_avg"].flatten()
    with pytest.raises(
        OptimizerStateMismatchError,
        match=r"'exp_avg' of parameter 0 has shape \(128,\), the parameter has shape \(16, 8\)",
    ):
        check_optimizer_state(state, _fresh(model), param_group_shapes(optimizer))


def test_state_for_an_unknown_parameter_index_is_refused() -> None:
    model, optimizer, state = _trained_adam()
    state["state"][17] = state["state"][0]
    with pytest.raises(OptimizerStateMismatchError, match=r"parameter index 17"):
        check_optimizer_state(state, _fresh(model), param_group_shapes(optimizer))


def test_an_empty_state_explains_it_was_kept_on_another_rank() -> None:
    model, optimizer, _ = _trained_adam()
    with pytest.raises(OptimizerStateMismatchError, match=r"only kept on another rank"):
        check_optimizer_state({}, _fresh(model), param_group_shapes(optimizer))
