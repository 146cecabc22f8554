"""Submodules compiled with ``torch.compile`` (``self.encoder = torch.compile(self.encoder)``) train and checkpoint
under every strategy as the uncompiled module does.

torch's ``OptimizedModule`` registers the module it compiled as its child ``_orig_mod``, so the module's own
``state_dict()`` names the encoder's weight ``encoder._orig_mod.linear.weight``; upstream ``ddp`` writes that key.
Checkpoints here hold the uncompiled module's keys (``encoder.linear.weight``), and either kind of checkpoint (ours,
or an older or upstream one with ``_orig_mod``) resumes strict into either kind of module, exactly. Training with the
compiled submodule ends where upstream ``ddp`` with the same compiled module ends. The tests compile with
``backend="eager"``: dynamo traces, no C++ compiler runs.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pytorch_lightning.strategies import DDPStrategy
from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.checkpoint.sharded import SHARDED_LAYOUT_KEY
from lightning_strategies.cli.convert import convert_checkpoint
from lightning_strategies.cli.inspection import inspect_path
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from lightning_strategies.testing.models import FEATURES, HIDDEN
from tests.support.helpers import (
    SaveAtTrainEnd,
    assert_same_checkpoint_state,
    assert_same_weights,
    canonical_checkpoint,
    fit,
    new_model,
)

# Each strategy, with full and (for the FSDP ones) sharded checkpoints, by the name the tests use.
STRATEGIES: dict[str, Callable[[], Any]] = {
    "ddp_sharded": lambda: ShardedDDPStrategy(start_method="fork"),
    "fsdp_fairscale": lambda: FairScaleFSDPStrategy(start_method="fork"),
    "fsdp_fairscale-sharded": lambda: FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"),
    "fsdp2": lambda: FSDP2Strategy(start_method="fork"),
    "fsdp2-sharded": lambda: FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
}
# Wrapping that puts the compiled submodule into an FSDP unit of its own (fairscale wraps it whole; fsdp2 shards the
# layer inside it and the head).
OWN_UNITS: dict[str, Callable[[], Any]] = {
    "fsdp_fairscale-auto-wrapped": lambda: FairScaleFSDPStrategy(start_method="fork", auto_wrap_min_params=1),
    "fsdp2-per-layer": lambda: FSDP2Strategy(start_method="fork", min_num_params=1),
}


def ddp() -> DDPStrategy:
    return DDPStrategy(start_method="fork")


class ScaledLinear(nn.Module):
    """A linear layer and a buffer: the compiled submodule holds a parameter and a buffer key."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, HIDDEN)
        self.register_buffer("scale", torch.full((HIDDEN,), 0.5))

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.linear(inputs) * self.scale
        return output


class Uncompiled(ConformanceModel):
    """The conformance model with a :class:`ScaledLinear` encoder (the same weights for the same seed)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder: nn.Module = ScaledLinear()


class CompiledInInit(Uncompiled):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = torch.compile(self.encoder, backend="eager")


class CompiledInConfigureModel(Uncompiled):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.compiled = False

    def configure_model(self) -> None:
        if not self.compiled:  # configure_model runs in every fit
            self.encoder = torch.compile(self.encoder, backend="eager")
            self.compiled = True


UNCOMPILED_KEYS = list(Uncompiled().state_dict())


def save_after_one_epoch(strategy: Any, directory: Path, cls: type[ConformanceModel]) -> Path:
    """Trains ``cls`` for one epoch and saves at its end (a file, or a directory for sharded strategies)."""
    path = directory / "saved.ckpt"
    fit(strategy, new_model(cls=cls), max_epochs=1, callbacks=[SaveAtTrainEnd(path)])
    return path


def stored_names(path: Path) -> list[str]:
    """Every model and layout name stored in a checkpoint as written (file, rank files, or DCP metadata)."""
    if path.is_file():
        return list(torch.load(path, weights_only=True)["state_dict"])
    if (path / ".metadata").is_file():
        return list(FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    names: list[str] = []
    for rank_file in sorted(path.glob("rank*.pt")):
        shard = torch.load(rank_file, weights_only=True)
        names += list(shard["state_dict"])
        names += [name for unit in shard[SHARDED_LAYOUT_KEY]["units"] for name in unit["names"]]
        names += [
            name
            for optimizer in shard[SHARDED_LAYOUT_KEY]["optimizers"]
            for group in optimizer["group_names"]
            for name in group
        ]
    assert names, f"nothing found in {path}"
    return names


@pytest.fixture(scope="module")
def saves(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One epoch's checkpoint of each strategy with a compiled and an uncompiled encoder, and upstream ddp's."""
    root = tmp_path_factory.mktemp("compiled")
    found = {"ddp": save_after_one_epoch(ddp(), root / "ddp", CompiledInInit)}
    for name, strategy in STRATEGIES.items():
        for cls in (CompiledInInit, Uncompiled):
            found[f"{name}-{cls.__name__}"] = save_after_one_epoch(strategy(), root / f"{name}-{cls.__name__}", cls)
    return found


def test_upstream_ddp_writes_the_orig_mod_keys_these_tests_are_about(saves: dict[str, Path]) -> None:
    assert "encoder._orig_mod.linear.weight" in stored_names(saves["ddp"])
    assert "encoder.linear.weight" in UNCOMPILED_KEYS


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_checkpoint_of_a_module_compiled_in_init_holds_the_uncompiled_modules_keys(
    saves: dict[str, Path], name: str
) -> None:
    path = saves[f"{name}-CompiledInInit"]
    assert [key for key in stored_names(path) if "_orig_mod" in key] == []
    assert sorted(canonical_checkpoint(path)["state_dict"]) == sorted(UNCOMPILED_KEYS)
    if path.is_file():  # in the uncompiled module's order too (a directory's order is its format's)
        assert list(canonical_checkpoint(path)["state_dict"]) == list(
            canonical_checkpoint(saves[f"{name}-Uncompiled"])["state_dict"]
        )


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_checkpoint_of_a_module_compiled_in_configure_model_holds_the_uncompiled_modules_keys(
    tmp_path: Path, name: str
) -> None:
    path = save_after_one_epoch(STRATEGIES[name](), tmp_path, CompiledInConfigureModel)
    assert [key for key in stored_names(path) if "_orig_mod" in key] == []
    assert sorted(canonical_checkpoint(path)["state_dict"]) == sorted(UNCOMPILED_KEYS)


@pytest.mark.parametrize(
    ("written_by", "resumed_into"),
    [
        ("CompiledInInit", Uncompiled),
        ("Uncompiled", CompiledInInit),
        ("ddp", CompiledInInit),
        ("ddp", Uncompiled),
    ],
    ids=["compiled-into-uncompiled", "uncompiled-into-compiled", "ddp-into-compiled", "ddp-into-uncompiled"],
)
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_a_checkpoint_resumes_strict_into_either_kind_of_module_exactly(
    tmp_path: Path, saves: dict[str, Path], name: str, written_by: str, resumed_into: type[ConformanceModel]
) -> None:
    saved = saves["ddp"] if written_by == "ddp" else saves[f"{name}-{written_by}"]
    restored = tmp_path / "restored.ckpt"
    resumed = new_model(seed=11, cls=resumed_into)
    assert resumed.strict_loading
    fit(STRATEGIES[name](), resumed, ckpt_path=saved, max_epochs=2, callbacks=[SaveAfterRestore(restored)])
    # What the resumed run holds before its first step is what was saved (upstream's keys read canonically).
    if written_by == "ddp":
        assert_same_ddp_state(saved, restored)
    else:
        assert_same_checkpoint_state(saved, restored)


def assert_same_ddp_state(ddp_file: Path, restored: Path) -> None:
    """``assert_same_checkpoint_state`` for upstream ddp's file, whose compiled keys hold ``_orig_mod``."""
    canonical = restored.parent / "ddp-canonical.ckpt"
    checkpoint = torch.load(ddp_file, weights_only=True)
    state = {key.replace("._orig_mod.", "."): value for key, value in checkpoint["state_dict"].items()}
    torch.save({**checkpoint, "state_dict": state}, canonical)
    assert_same_checkpoint_state(canonical, restored)


@pytest.fixture(scope="module")
def ddp_trained() -> ConformanceModel:
    model = new_model(cls=CompiledInInit)
    fit(ddp(), model, max_epochs=2)
    return model


@pytest.mark.parametrize("name", [name for name in STRATEGIES if not name.endswith("-sharded")] + list(OWN_UNITS))
def test_training_with_a_compiled_submodule_ends_where_ddp_ends(ddp_trained: ConformanceModel, name: str) -> None:
    model = new_model(cls=CompiledInInit)
    fit({**STRATEGIES, **OWN_UNITS}[name](), model, max_epochs=2)  # validation after each epoch included
    # The main process's module got the trained weights back (its own keys hold `_orig_mod`).
    assert_same_weights(ddp_trained, model, atol=1e-5)


@pytest.fixture(scope="module")
def ddp_trained_accumulating() -> ConformanceModel:
    model = new_model(cls=CompiledInInit)
    fit(ddp(), model, max_epochs=2, accumulate_grad_batches=2)
    return model


@pytest.mark.parametrize("name", list(OWN_UNITS))
def test_accumulating_gradients_with_a_compiled_submodule_ends_where_ddp_ends(
    ddp_trained_accumulating: ConformanceModel, name: str
) -> None:
    # The second micro-batch's forward runs while the first one's gradients are held (and, under fairscale, while
    # the full parameter is gathered next to a shard's gradient); dynamo recompiles after the first optimizer step.
    model = new_model(cls=CompiledInInit)
    fit(OWN_UNITS[name](), model, max_epochs=2, accumulate_grad_batches=2)
    assert_same_weights(ddp_trained_accumulating, model, atol=1e-5)


def test_inspect_names_the_orig_mod_keys_of_an_older_file_and_convert_removes_them(
    tmp_path: Path, saves: dict[str, Path]
) -> None:
    report = inspect_path(saves["ddp"])
    [finding] = [finding for finding in report.errors if finding.code == "wrapper-prefix"]
    assert "'_orig_mod.'" in finding.message and "torch.compile" in finding.message
    assert "'encoder._orig_mod." in finding.message  # names a key
    assert f"lightning-strategies convert {saves['ddp']}" in finding.message and finding.repairable

    out = tmp_path / "converted.ckpt"
    conversion = convert_checkpoint(saves["ddp"], out)
    assert any("'_orig_mod.'" in repair for repair in conversion.repairs)
    assert sorted(stored_names(out)) == sorted(UNCOMPILED_KEYS)
    assert not inspect_path(out).errors


def test_keys_map_to_nested_and_wrapped_compiled_submodules() -> None:
    from lightning_strategies.checkpoint import canonical_keys, to_module_keys

    outer = nn.Sequential(nn.Linear(2, 2), torch.compile(nn.Sequential(nn.Linear(2, 2)), backend="eager"))
    module = nn.ModuleDict({"plain": nn.Linear(2, 2), "outer": torch.compile(outer, backend="eager")})
    own = list(module.state_dict())
    assert "outer._orig_mod.1._orig_mod.0.weight" in own
    canonical = canonical_keys(module.state_dict())
    assert sorted(canonical) == sorted(
        ["outer.0.weight", "outer.0.bias", "outer.1.0.weight", "outer.1.0.bias", "plain.weight", "plain.bias"]
    )
    assert list(to_module_keys(canonical, module)) == own
    assert list(to_module_keys(module.state_dict(), module)) == own  # older files' keys too
    wrapper = nn.ModuleDict({"_fsdp_wrapped_module": module})  # a wrapper whose state_dict hides its segment
    assert list(to_module_keys(canonical, wrapper, hidden=("_fsdp_wrapped_module",))) == own
