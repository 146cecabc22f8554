"""Checkpoints of a LightningModule with a compiled submodule hold ``_orig_mod.`` keys (upstream issue 20233)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any
from unittest import mock

import pytorch_lightning.strategies.fsdp as trainer_fsdp
import torch
from pytorch_lightning.demos.boring_classes import BoringModel
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from scripts.upstream_proposals.core import ISSUES, UPSTREAM_MAIN, Outcome, Proposal
from scripts.upstream_proposals.fsdp_cpu import FSDPStrategyOnCPU
from scripts.upstream_proposals.support import on_two_ranks, trainer
from tests.support.upstream_runs import ShardedByUser, fit

#: Path segments that wrappers add to a module's names (the compiled module's own, and FSDP1's).
_WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_fsdp_wrapped_module"})


def public_key(key: str) -> str:
    """``key`` as the uncompiled module names it: ``encoder._orig_mod.weight`` is ``encoder.weight``."""
    return ".".join(part for part in key.split(".") if part != "_orig_mod")


def compiled_keys(state: Mapping[str, Any], module: nn.Module) -> dict[str, Any]:
    """``state`` (public keys, or a file's ``_orig_mod`` keys) under the keys ``module`` expects: each key below a
    compiled submodule gets that submodule's ``_orig_mod`` segment back."""
    prefixes = sorted(
        (
            ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)
            for name, child in module.named_modules()
            if isinstance(child, OptimizedModule)
        ),
        key=len,
        reverse=True,
    )
    moved = {}
    for key, value in state.items():
        public = public_key(key)
        prefix = next((p for p in prefixes if p == "" or public.startswith(p + ".")), None)
        if prefix is None:
            moved[public] = value
        else:
            moved[f"{prefix}._orig_mod.{public[len(prefix) + 1 :]}" if prefix else f"_orig_mod.{public}"] = value
    return moved


class PublicKeysFSDPStrategy(FSDPStrategyOnCPU):
    """``FSDPStrategy`` (with the CPU fixes, to run here) saving the public keys of compiled submodules and loading
    either kind."""

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {public_key(key): value for key, value in super().lightning_module_state_dict().items()}

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        upstream_load = trainer_fsdp._load_raw_module_state

        def load(state_dict: dict[str, Any], module: nn.Module, **kwargs: Any) -> None:
            upstream_load(compiled_keys(state_dict, module), module, **kwargs)

        with mock.patch.object(trainer_fsdp, "_load_raw_module_state", load):
            return super().load_checkpoint(checkpoint_path, weights_only)


class _CompiledEncoder(ShardedByUser):
    """The conformance model with its encoder compiled in ``__init__`` (issue 20233's recipe), wrapped by the
    strategy (``configure_model`` does nothing)."""

    def __init__(self, compiled: bool = True) -> None:
        super().__init__()
        if compiled:
            self.encoder = torch.compile(self.encoder, backend="eager")

    def configure_model(self) -> None:
        pass


def reproduce(root: Path, cls: type) -> Outcome:
    """Fit the compiled model under ``cls(state_dict_type='full')``; load the file into the uncompiled model."""
    fit(lambda: cls(state_dict_type="full"), root, epochs=1, model_class=_CompiledEncoder)
    keys = sorted(torch.load(root / "epoch=0.ckpt", weights_only=True)["state_dict"])
    try:
        _CompiledEncoder.load_from_checkpoint(root / "epoch=0.ckpt", compiled=False)
    except RuntimeError as error:
        refusal = next((line.strip() for line in str(error).splitlines() if "key(s)" in line), str(error))
        return Outcome(False, f"keys {keys}; the uncompiled model refuses them ({refusal[:200]})")
    return Outcome(not any("_orig_mod" in key for key in keys), f"keys {keys}; the uncompiled model loads them")


# The tests for upstream's tests_pytorch/strategies/test_fsdp.py (and the other strategies' files)


class _CompiledBoringModel(BoringModel):
    def __init__(self, compiled: bool = True) -> None:
        super().__init__()
        if compiled:
            self.layer = torch.compile(self.layer, backend="eager")

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters())  # state to restore (plain SGD has none)


def _fit_and_save(root: Path, cls: type, ckpt_path: Path | None = None) -> None:
    fitted = trainer(
        cls(state_dict_type="full"), root / ("resumed" if ckpt_path else ""), max_epochs=2 if ckpt_path else 1
    )
    fitted.fit(_CompiledBoringModel(), ckpt_path=ckpt_path)
    fitted.save_checkpoint(root / ("resumed.ckpt" if ckpt_path else "compiled.ckpt"))


def test_compiled_submodule_checkpoint_loads_into_uncompiled_model(
    tmp_path: Path, cls: type = PublicKeysFSDPStrategy
) -> None:
    on_two_ranks(lambda: _fit_and_save(tmp_path, cls))
    assert list(torch.load(tmp_path / "compiled.ckpt", weights_only=True)["state_dict"]) == [
        "layer.weight",
        "layer.bias",
    ]
    _CompiledBoringModel.load_from_checkpoint(tmp_path / "compiled.ckpt", compiled=False)


def test_compiled_submodule_resumes_from_its_checkpoint(tmp_path: Path, cls: type = PublicKeysFSDPStrategy) -> None:
    on_two_ranks(lambda: _fit_and_save(tmp_path, cls))
    on_two_ranks(lambda: _fit_and_save(tmp_path, cls, ckpt_path=tmp_path / "compiled.ckpt"))
    saved, resumed = (torch.load(tmp_path / name, weights_only=True) for name in ("compiled.ckpt", "resumed.ckpt"))
    assert resumed["epoch"] == saved["epoch"] + 1
    assert list(resumed["state_dict"]) == list(saved["state_dict"])


PROPOSAL = Proposal(
    slug="compiled-keys",
    title="Checkpoints of a LightningModule with a compiled submodule hold `_orig_mod.` keys",
    kind="feature",
    issues=(20233,),
    severity="missing feature",
    status=f"open: `FSDPStrategy.lightning_module_state_dict` (and `Strategy`'s) return `model.state_dict()` as is on"
    f" {UPSTREAM_MAIN}; `ModelParallelStrategy` already writes public keys (torch's distributed state-dict API drops"
    " `_orig_mod`), and `_align_compiled_param_names_with_module` fixes only its optimizer re-keying",
    template={
        "Description & Motivation": "Lightning's docs recommend compiling a submodule (`self.model ="
        " torch.compile(self.model)`) rather than the LightningModule. The checkpoint then names every weight"
        " `model._orig_mod.<name>`, so `load_from_checkpoint` into the same class without compilation (inference,"
        " export, another machine) fails with missing and unexpected keys.",
        "Pitch": "Checkpoints hold the keys of the uncompiled module, whatever was compiled; a load into a compiled"
        " module accepts them (and old files' `_orig_mod` keys).",
        "Alternatives": "A user-side `on_save_checkpoint` that renames keys (every user, every strategy);"
        " `module.compile()` in place (changes the model's code); keeping an uncompiled reference (doubles the"
        " checkpoint, as the issue says).",
    },
    change="`src/lightning/pytorch/strategies/strategy.py` `Strategy.lightning_module_state_dict` and the overrides"
    " that call `state_dict()` themselves (`fsdp.py`, `deepspeed.py`): drop the `_orig_mod` segments from the keys;"
    " `Strategy.load_model_state_dict`, `FSDPStrategy.load_checkpoint` and `core/saving.py` `_load_state`: put them"
    " back where the receiving module has a compiled submodule (`compiled_keys`, which also takes old files'"
    " keys). Shown here on `FSDPStrategy` (with the CPU fixes of the proposal above, the only way it runs here):"
    " `PublicKeysFSDPStrategy`.",
    cost="Behaviour: new checkpoints of compiled submodules lose the `_orig_mod.` segment; a user who loads them with"
    " plain `torch.load` + `compiled.load_state_dict(...)` outside Lightning now needs the public keys (what"
    " torch's own distributed API and `OptimizedModule` discussions already move towards). Old files keep loading."
    " A user submodule literally named `_orig_mod` would be renamed: rare, worth a check that refuses collisions.",
    fix=(public_key, compiled_keys, PublicKeysFSDPStrategy),
    released=FSDPStrategyOnCPU,
    changed=PublicKeysFSDPStrategy,
    reproduce=reproduce,
    tests=(
        test_compiled_submodule_checkpoint_loads_into_uncompiled_model,
        test_compiled_submodule_resumes_from_its_checkpoint,
    ),
    upstream_test_file="tests_pytorch/strategies/test_fsdp.py",
    notes=(
        f"Issue: {ISSUES}20233. No Fabric test: the issue and the change are the Trainer's checkpoint of a"
        " `LightningModule` (`lightning_module_state_dict`) and `load_from_checkpoint`, which Fabric does not have;"
        " `fabric.save` and `fabric.load` store and restore `state_dict()` as the user's module names it, in every"
        " strategy (what `load_state_dict` of the same module expects), and Fabric already unwraps a top-level"
        " `torch.compile` in `setup_module` and `save`. Renaming keys in Fabric would change that contract: a"
        " proposal of its own.",
    ),
    released_label="Upstream as released, with the CPU change of the FSDPStrategy proposal (the only way it runs here)",
)
