"""Canonical model state is validated before loading; errors name every problem; failures change nothing."""

from __future__ import annotations

import pytest
import torch

from lightning_strategies.checkpoint import ModelStateMismatchError, check_model_state, load_model_state
from lightning_strategies.testing import ConformanceModel


@pytest.fixture
def model() -> ConformanceModel:
    torch.manual_seed(0)
    return ConformanceModel()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.state_dict().items()}


def _unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(value, before[key]) for key, value in model.state_dict().items())


def test_a_matching_state_loads(model: ConformanceModel) -> None:
    state = {key: torch.zeros_like(value) for key, value in model.state_dict().items()}
    load_model_state(model, state)
    assert all(float(value.abs().sum()) == 0 for value in model.state_dict().values())


def test_missing_keys_are_named_and_nothing_is_loaded(model: ConformanceModel) -> None:
    before = _snapshot(model)
    state = {key: torch.zeros_like(value) for key, value in before.items() if key != "head.bias"}

    with pytest.raises(ModelStateMismatchError, match=r"missing keys \(1\): 'head.bias'"):
        load_model_state(model, state, source="ckpt.pt")
    assert _unchanged(model, before)


def test_unexpected_keys_are_named_and_nothing_is_loaded(model: ConformanceModel) -> None:
    before = _snapshot(model)
    state = {**before, "extra.weight": torch.zeros(3)}

    with pytest.raises(ModelStateMismatchError, match=r"unexpected keys \(1\): 'extra.weight'"):
        load_model_state(model, {key: torch.zeros_like(value) for key, value in state.items()})
    assert _unchanged(model, before)


def test_a_wrong_shape_names_the_key_and_both_shapes(model: ConformanceModel) -> None:
    before = _snapshot(model)
    state = {key: torch.zeros_like(value) for key, value in before.items()}
    state["encoder.weight"] = torch.zeros(3, 3)

    with pytest.raises(
        ModelStateMismatchError, match=r"'encoder.weight': checkpoint has shape \(3, 3\), model expects"
    ):
        load_model_state(model, state)
    assert _unchanged(model, before)


def test_an_integer_tensor_where_floats_belong_is_refused(model: ConformanceModel) -> None:
    state = {key: torch.zeros_like(value) for key, value in model.state_dict().items()}
    state["head.bias"] = torch.zeros(4, dtype=torch.int64)

    with pytest.raises(ModelStateMismatchError, match=r"'head.bias': checkpoint has dtype torch.int64"):
        check_model_state(model.state_dict(), state)


def test_another_floating_point_precision_is_accepted(model: ConformanceModel) -> None:
    state = {key: value.to(torch.bfloat16) for key, value in model.state_dict().items()}
    check_model_state(model.state_dict(), state)


def test_keys_behind_a_wrapper_prefix_are_recognised_in_the_error(model: ConformanceModel) -> None:
    state = {f"_forward_module.{key}": value for key, value in model.state_dict().items()}

    with pytest.raises(ModelStateMismatchError, match=r"wrapper prefix '_forward_module.'"):
        check_model_state(model.state_dict(), state)


def test_non_strict_loading_allows_missing_and_unexpected_keys(model: ConformanceModel) -> None:
    state = {"head.bias": torch.ones(4), "unrelated": torch.ones(1)}
    load_model_state(model, state, strict=False)
    assert torch.equal(model.head.bias.detach(), torch.ones(4))


def test_non_strict_loading_still_refuses_wrong_shapes(model: ConformanceModel) -> None:
    with pytest.raises(ModelStateMismatchError, match=r"'head.bias'"):
        load_model_state(model, {"head.bias": torch.ones(5)}, strict=False)


def test_long_key_lists_are_cut_with_a_count(model: ConformanceModel) -> None:
    state = {f"junk.{index}": torch.zeros(1) for index in range(25)}
    with pytest.raises(ModelStateMismatchError, match=r"and 15 more"):
        check_model_state(model.state_dict(), {**model.state_dict(), **state})
