"""Each scoped CPU patch for fairscale FSDP is needed (its scenario fails without it) and is undone afterwards."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from torch import nn

from lightning_strategies.fairscale import cpu as fairscale_cpu
from lightning_strategies.fairscale.wrap import forget_stale_fairscale_groups

Scenario = Callable[[], Any]


def _model(**kwargs: Any) -> FSDP:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    return FSDP(inner, compute_device=torch.device("cpu"), **kwargs)


def _forward() -> Any:
    return _model()(torch.ones(3, 4)).sum()


def _backward() -> None:
    _forward().backward()


def _full_state_dict() -> None:
    model = _model()
    model(torch.ones(3, 4)).sum().backward()
    model.state_dict()


def _clip_grad_norm() -> None:
    model = _model()
    model(torch.ones(3, 4)).sum().backward()
    model.clip_grad_norm_(0.1)


def _offload() -> None:
    model = _model(cpu_offload=True, move_grads_to_cpu=True)
    model(torch.ones(3, 4)).sum().backward()


def _adam_state_gather() -> bool:
    """fairscale's own full optimizer-state gather keeps Adam's two moments apart."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    optimizer.step()
    full = model.gather_full_optim_state_dict(optimizer)
    if dist.get_rank() != 0:
        return True
    first = full["state"][0]
    return not torch.equal(first["exp_avg"], first["exp_avg_sq"])


def _worker(rank: int, port: int, scenario: Scenario, skip: frozenset[str], pin: bool, results: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    # A worker forked from a process that ran fairscale FSDP before inherits fairscale's cache of process groups of
    # a group that no longer exists (as the strategy's own runs would, which drop it the same way).
    forget_stale_fairscale_groups()
    try:
        with fairscale_cpu.fairscale_cpu_support(pin_memory=pin, skip=skip):
            outcome = scenario()
        results.put((rank, "ok" if outcome is not False else "wrong result"))
    except Exception as error:
        results.put((rank, f"{type(error).__name__}: {error}"[:300]))
    finally:
        dist.destroy_process_group()


def _run(scenario: Scenario, port: int, skip: frozenset[str] = frozenset(), pin: bool = False) -> list[str]:
    context = mp.get_context("fork")
    results = context.SimpleQueue()
    processes = [context.Process(target=_worker, args=(rank, port, scenario, skip, pin, results)) for rank in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=60)
        if process.is_alive():
            process.kill()
    outcomes: dict[int, str] = {}
    while not results.empty():
        rank, outcome = results.get()
        outcomes[rank] = outcome
    return [outcomes.get(rank, "no result (hung or crashed)") for rank in range(2)]


SCENARIOS: dict[str, tuple[Scenario, bool]] = {
    "setup_streams": (_forward, False),
    "current_stream": (_backward, False),
    "record_stream": (_full_state_dict, False),
    "synchronize": (_full_state_dict, False),
    "calc_grad_norm": (_clip_grad_norm, False),
    "list_collectives": (_backward, False),
    "gather_optim_state": (_adam_state_gather, False),
    "pin_memory": (_offload, True),
}


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_the_scenario_works_with_every_patch(scenario: str, loopback_rendezvous: int) -> None:
    function, pin = SCENARIOS[scenario]
    assert _run(function, loopback_rendezvous, pin=pin) == ["ok", "ok"]


@pytest.mark.parametrize("patch", sorted(SCENARIOS))
def test_the_scenario_fails_without_its_patch(patch: str, loopback_rendezvous: int) -> None:
    function, pin = SCENARIOS[patch]
    outcomes = _run(function, loopback_rendezvous, skip=frozenset({patch}), pin=pin)
    assert outcomes != ["ok", "ok"], f"{patch} seems unnecessary: {outcomes}"


def test_every_patch_has_a_scenario() -> None:
    assert set(fairscale_cpu.patch_names()) == set(SCENARIOS)


def test_uninstall_restores_every_original() -> None:
    originals = {patch.name: getattr(patch.target, patch.attribute) for patch in fairscale_cpu.PATCHES}
    with fairscale_cpu.fairscale_cpu_support(pin_memory=True) as installed:
        assert installed
        assert FSDP._setup_streams is not originals["setup_streams"]
    assert not fairscale_cpu.is_installed()
    for patch in fairscale_cpu.PATCHES:
        assert getattr(patch.target, patch.attribute) is originals[patch.name], patch.name
    assert torch.Tensor.pin_memory is not fairscale_cpu.PIN_MEMORY_PATCH.replacement


def test_nested_installs_are_counted() -> None:
    assert fairscale_cpu.install()
    assert fairscale_cpu.install()
    fairscale_cpu.uninstall()
    assert fairscale_cpu.is_installed()
    fairscale_cpu.uninstall()
    assert not fairscale_cpu.is_installed()


def test_nothing_is_patched_where_cuda_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not fairscale_cpu.install()
    assert not fairscale_cpu.is_installed()
