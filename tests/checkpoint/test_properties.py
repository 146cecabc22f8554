"""Property-based tests (hypothesis) for key canonicalisation, flat sharding and optimizer re-keying."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from lightning_strategies.checkpoint import (
    WRAPPER_PREFIXES,
    ModelStateMismatchError,
    OptimizerStateMismatchError,
    check_model_state,
    check_optimizer_state,
    load_model_state,
    param_group_shapes,
    strip_wrapper_segments,
)
from lightning_strategies.checkpoint.flat import local_shard, shard_size, split_full
from lightning_strategies.checkpoint.optimizer_state import canonical_to_name_keyed, name_keyed_to_canonical
from tests.support.property_settings import PROPERTY

SEGMENTS = tuple(prefix.rstrip(".") for prefix in WRAPPER_PREFIXES)

# Path segments of user modules: identifiers, including ones that merely look like a wrapper's attribute.
LOOKALIKES = [
    "modules",
    "my_module",
    "module_",
    "_module",
    "module1",
    "orig_mod",
    "_fsdp_wrapped",
    "fpw_module",
    "Module",
]
user_segment = st.one_of(
    st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True).filter(lambda part: part not in SEGMENTS),
    st.sampled_from(LOOKALIKES),
    st.integers(0, 12).map(str),  # nn.Sequential / ModuleList children
)
canonical_name = st.lists(user_segment, min_size=1, max_size=5).map(".".join)
wrapper_segment = st.sampled_from(SEGMENTS)


@st.composite
def wrapped_name(draw: st.DrawFn) -> tuple[str, str]:
    """A canonical name and the same name with wrapper segments inserted anywhere (nested, repeated, in front)."""
    parts = draw(st.lists(user_segment, min_size=1, max_size=5))
    wrapped: list[str] = []
    for part in parts:
        wrapped.extend(draw(st.lists(wrapper_segment, max_size=3)))
        wrapped.append(part)
    return ".".join(parts), ".".join(wrapped)


# ------------------------------------------------------------------ key canonicalisation


@PROPERTY
@given(st.lists(st.one_of(user_segment, wrapper_segment), min_size=1, max_size=8).map(".".join))
def test_stripping_wrapper_segments_is_idempotent(name: str) -> None:
    once = strip_wrapper_segments(name, SEGMENTS)
    assert strip_wrapper_segments(once, SEGMENTS) == once


@PROPERTY
@given(wrapped_name())
def test_any_nesting_of_wrapper_segments_strips_back_to_the_canonical_name(names: tuple[str, str]) -> None:
    canonical, wrapped = names
    assert strip_wrapper_segments(wrapped, SEGMENTS) == canonical


@PROPERTY
@given(canonical_name)
def test_names_that_only_contain_a_prefix_like_substring_are_left_alone(name: str) -> None:
    assert strip_wrapper_segments(name, SEGMENTS) == name


@st.composite
def model_states(draw: st.DrawFn) -> dict[str, torch.Tensor]:
    """A canonical state: unique names mapped to small tensors of random shapes and dtypes."""
    names = draw(st.lists(canonical_name, min_size=1, max_size=6, unique=True))
    state = {}
    for name in names:
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64, torch.bool]))
        state[name] = torch.zeros(shape, dtype=dtype)
    return state


@PROPERTY
@given(model_states())
def test_a_state_with_the_expected_keys_shapes_and_dtypes_is_accepted(expected: dict[str, torch.Tensor]) -> None:
    check_model_state(expected, {key: value.clone() for key, value in expected.items()})


@PROPERTY
@given(model_states(), st.sampled_from(WRAPPER_PREFIXES))
def test_a_state_read_through_a_wrapper_is_refused_naming_the_prefix(
    expected: dict[str, torch.Tensor], prefix: str
) -> None:
    wrapped = {prefix + key: value for key, value in expected.items()}
    with pytest.raises(ModelStateMismatchError, match="wrapper prefix") as refused:
        check_model_state(expected, wrapped)
    assert repr(prefix) in str(refused.value)
    stripped = {strip_wrapper_segments(key, SEGMENTS): value for key, value in wrapped.items()}
    check_model_state(expected, stripped)  # the repair the message suggests works


@PROPERTY
@given(model_states(), st.data())
def test_a_missing_key_or_a_wrong_shape_is_refused_naming_the_key(
    expected: dict[str, torch.Tensor], data: st.DataObject
) -> None:
    key = data.draw(st.sampled_from(sorted(expected)))
    missing = {name: value for name, value in expected.items() if name != key}
    with pytest.raises(ModelStateMismatchError, match="missing keys") as refused:
        check_model_state(expected, missing)
    assert repr(key) in str(refused.value)
    reshaped = {**expected, key: torch.zeros(expected[key].numel() + 1, dtype=expected[key].dtype)}
    with pytest.raises(ModelStateMismatchError, match="mismatched tensors") as refused:
        check_model_state(expected, reshaped)
    assert repr(key) in str(refused.value)


@PROPERTY
@given(
    st.lists(st.integers(1, 5), min_size=2, max_size=5),
    st.integers(0, 64),
    st.sampled_from(["shape", "missing", "extra", "good"]),
)
def test_load_model_state_loads_exactly_or_leaves_the_module_unchanged(
    widths: list[int], seed: int, corruption: str
) -> None:
    torch.manual_seed(seed)
    module = nn.Sequential(*(nn.Linear(a, b) for a, b in itertools.pairwise(widths)))
    before = {key: value.clone() for key, value in module.state_dict().items()}
    state = {key: torch.randn_like(value) for key, value in before.items()}
    victim = sorted(state)[seed % len(state)]
    if corruption == "shape":
        state[victim] = torch.randn(state[victim].numel() + 1)
    elif corruption == "missing":
        del state[victim]
    elif corruption == "extra":
        state["module." + victim] = state[victim]
    if corruption == "good":
        load_model_state(module, state)
        assert all(torch.equal(module.state_dict()[key], value) for key, value in state.items())
        return
    with pytest.raises(ModelStateMismatchError, match="nothing was loaded"):
        load_model_state(module, state)
    assert all(torch.equal(module.state_dict()[key], value) for key, value in before.items())


# ------------------------------------------------------------------ flat shards

shapes = st.lists(st.lists(st.integers(0, 4), max_size=3).map(torch.Size), min_size=1, max_size=6)


@PROPERTY
@given(shapes, st.integers(0, 2**16))
def test_split_full_of_the_concatenation_gives_back_every_tensor(sizes: list[torch.Size], seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(size, generator=generator) for size in sizes]
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    parts = split_full(flat, sizes)
    assert [part.shape for part in parts] == sizes
    assert all(torch.equal(part, tensor) for part, tensor in zip(parts, tensors, strict=True))


@PROPERTY
@given(shapes, st.integers(1, 9))
def test_local_shards_of_all_ranks_concatenate_to_the_padded_full_tensor(
    sizes: list[torch.Size], world_size: int
) -> None:
    tensors = [torch.arange(size.numel(), dtype=torch.float32).reshape(size) + 1 for size in sizes]
    flat = torch.cat([tensor.reshape(-1) for tensor in tensors])
    shards = [local_shard(tensors, rank, world_size) for rank in range(world_size)]
    size = shard_size(flat.numel(), world_size)
    assert all(shard.numel() == size for shard in shards)
    joined = torch.cat(shards)
    assert joined.numel() == size * world_size and 0 <= joined.numel() - flat.numel() < world_size
    assert torch.equal(joined[: flat.numel()], flat)
    assert not joined[flat.numel() :].any()  # the padding is zeros
    assert all(torch.equal(a, b) for a, b in zip(split_full(joined[: flat.numel()], sizes), tensors, strict=True))


# ------------------------------------------------------------------ optimizer re-keying


@st.composite
def canonical_optimizer_states(draw: st.DrawFn) -> tuple[dict[str, Any], list[str]]:
    """A canonical optimizer state over random param groups, and the parameters' names in group order."""
    group_sizes = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
    total = sum(group_sizes)
    names = draw(st.lists(canonical_name, min_size=total, max_size=total, unique=True))
    groups, start = [], 0
    for number, size in enumerate(group_sizes):
        lr = draw(st.floats(1e-5, 1.0))
        groups.append({"lr": lr, "betas": (0.9, 0.999), "tag": number, "params": list(range(start, start + size))})
        start += size
    with_state = draw(st.lists(st.integers(0, max(total - 1, 0)), unique=True, max_size=total)) if total else []
    state = {
        index: {"step": torch.tensor(float(index)), "exp_avg": torch.full((2,), float(index))}
        for index in sorted(with_state)
    }
    return {"state": state, "param_groups": groups}, names


@PROPERTY
@given(canonical_optimizer_states())
def test_rekeying_index_to_name_to_index_round_trips(case: tuple[dict[str, Any], list[str]]) -> None:
    state, names = case
    by_name = canonical_to_name_keyed(state, names)
    assert set(by_name["state"]) <= set(names)
    assert [len(group["params"]) for group in by_name["param_groups"]] == [
        len(group["params"]) for group in state["param_groups"]
    ]
    back = name_keyed_to_canonical(by_name, names)
    assert back["param_groups"] == state["param_groups"]
    assert list(back["state"]) == sorted(state["state"])
    assert all(back["state"][index] is entries for index, entries in state["state"].items())


@PROPERTY
@given(canonical_optimizer_states(), st.randoms(use_true_random=False))
def test_rekeying_name_to_index_ignores_the_order_of_named_state(
    case: tuple[dict[str, Any], list[str]], random: Any
) -> None:
    state, names = case
    by_name = canonical_to_name_keyed(state, names)
    items = list(by_name["state"].items())
    random.shuffle(items)  # torch's API orders the named state by module traversal, not by group order
    back = name_keyed_to_canonical({**by_name, "state": dict(items)}, names)
    assert list(back["state"]) == sorted(state["state"])


@PROPERTY
@given(st.lists(st.lists(st.lists(st.integers(1, 3), max_size=2), min_size=1, max_size=3), min_size=1, max_size=3))
def test_a_real_optimizer_state_fits_its_optimizer_and_not_one_with_other_groups(
    group_shapes: list[list[list[int]]],
) -> None:
    groups = [{"params": [nn.Parameter(torch.randn(shape)) for shape in group]} for group in group_shapes]
    optimizer = torch.optim.Adam(groups, lr=0.1)
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.ones_like(param)
    optimizer.step()
    state = optimizer.state_dict()
    check_optimizer_state(state, optimizer, param_group_shapes(optimizer))
    fewer = {**state, "param_groups": state["param_groups"][:-1]}
    with pytest.raises(OptimizerStateMismatchError, match="param group"):
        check_optimizer_state(fewer, optimizer, param_group_shapes(optimizer))
    index = next(iter(state["state"]))
    flat = {**state, "state": {**state["state"], index: {**state["state"][index], "exp_avg": torch.zeros(7, 7)}}}
    with pytest.raises(OptimizerStateMismatchError, match="shape"):
        check_optimizer_state(flat, optimizer, param_group_shapes(optimizer))
