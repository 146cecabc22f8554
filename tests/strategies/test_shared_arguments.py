"""The arguments every strategy shares are declared like Lightning's own strategies (explicitly, so ``help()``, IDEs and
LightningCLI see them), documented once in DirectReferenceStrategy, and reach it unchanged from every strategy."""

from __future__ import annotations

import inspect
import re
from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning_fabric.plugins.environments import LightningEnvironment

from lightning_strategies import DirectReferenceStrategy
from lightning_strategies._lightning import pl
from tests.support.helpers import STRATEGY_CLASSES

SHARED = [name for name in inspect.signature(DirectReferenceStrategy.__init__).parameters if name != "self"]


def _documented_arguments(cls: type) -> set[str]:
    text = inspect.getdoc(cls) or ""
    arguments = text.split("Args:\n", 1)[1].split("\n\n", 1)[0] if "Args:\n" in text else ""
    return set(re.findall(r"^    \**(\w+):", arguments, re.MULTILINE))


def test_the_base_documents_every_shared_argument() -> None:
    assert _documented_arguments(DirectReferenceStrategy) == set(SHARED)


@pytest.mark.parametrize("cls", STRATEGY_CLASSES.values(), ids=list(STRATEGY_CLASSES))
def test_each_strategy_takes_every_shared_argument_with_the_bases_default(cls: type) -> None:
    base = inspect.signature(DirectReferenceStrategy.__init__).parameters
    own = inspect.signature(cls.__init__).parameters
    for name in SHARED:
        assert name in own, f"{cls.__name__} does not take {name}"
        assert own[name].default == base[name].default, f"{cls.__name__}.{name}: default {own[name].default!r}"
        assert own[name].annotation == base[name].annotation, f"{cls.__name__}.{name}: {own[name].annotation}"
        assert own[name].kind == base[name].kind, f"{cls.__name__}.{name} is {own[name].kind}"


@pytest.mark.parametrize("cls", STRATEGY_CLASSES.values(), ids=list(STRATEGY_CLASSES))
def test_each_strategy_names_the_shared_arguments_and_documents_only_its_own(cls: type) -> None:
    text = inspect.getdoc(cls) or ""
    assert not _documented_arguments(cls) & set(SHARED), "documented again: say they are the base's"
    assert all(f"``{name}``" in text for name in SHARED)


def _given() -> dict[str, Any]:
    return {
        "accelerator": pl.accelerators.CPUAccelerator(),
        "parallel_devices": [torch.device("cpu")] * 3,
        "cluster_environment": LightningEnvironment(),
        "checkpoint_io": pl.plugins.TorchCheckpointIO(),
        "precision_plugin": pl.plugins.precision.Precision(),
        "process_group_backend": "gloo",
        "timeout": timedelta(seconds=7),
        "start_method": "fork",
        "hand_back": "weights",
        "async_save": True,
    }


@pytest.mark.parametrize("cls", STRATEGY_CLASSES.values(), ids=list(STRATEGY_CLASSES))
def test_each_strategy_hands_every_shared_argument_to_the_base(cls: type) -> None:
    given = _given()
    assert set(given) == set(SHARED)
    strategy = cls(**given)
    assert strategy.accelerator is given["accelerator"]
    assert strategy.parallel_devices == given["parallel_devices"]
    assert strategy.cluster_environment is given["cluster_environment"]
    assert strategy.checkpoint_io is given["checkpoint_io"]
    assert strategy.precision_plugin is given["precision_plugin"]
    assert strategy._process_group_backend == "gloo"
    assert strategy._timeout == given["timeout"]
    assert strategy._start_method == "fork"
    assert strategy._hand_back == "weights"
    assert strategy._async_save is True
