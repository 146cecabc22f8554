"""What Lightning 2.x's own strategy tests expect of FSDP, run under ``fsdp2`` (issue 28).

- Meta-device initialisation (upstream ``test_module_init_context``, ``test_meta_device_materialization``):
  ``trainer.init_module(empty_init=True)`` creates meta tensors, and setup materialises them after sharding with
  ``reset_parameters()``, each rank only its shards; a ``ckpt_path`` restore then fills them.
- ``trainer.test``/``trainer.predict`` after ``trainer.fit`` in the same process, inside ``torch.inference_mode()``
  (upstream ``_run_multiple_stages``).
- ``LightningModule.device_mesh`` as ``ModelParallelStrategy`` sets it (upstream ``test_setup_device_mesh``), so code
  written for ``ModelParallelStrategy`` runs under ``fsdp2`` unchanged.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable
from itertools import chain
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import DDPStrategy, ModelParallelStrategy
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from lightning_strategies import FSDP2Strategy
from lightning_strategies.testing import ConformanceModel
from lightning_strategies.testing.models import FEATURES, HIDDEN, OUTPUTS
from tests.conftest import trainer_kwargs
from tests.support import upstream_runs
from tests.support.helpers import RankRecorder, assert_same_weights, fit, new_model, train_and_save
from tests.support.ranks import run_as_ranks


def fsdp2(**kwargs: Any) -> FSDP2Strategy:
    return FSDP2Strategy(start_method="fork", **kwargs)


def ddp() -> DDPStrategy:
    return DDPStrategy(start_method="fork")


class Resettable(ConformanceModel):
    """The conformance model with a ``reset_parameters()`` for the buffer the LightningModule itself owns."""

    def reset_parameters(self) -> None:
        self.output_scale.fill_(0.5)


class BuiltOnMetaInConfigureModel(Resettable):
    """Builds its layers again on the meta device in ``configure_model`` (the hand-written way to a large model)."""

    def configure_model(self) -> None:
        if self._trainer is None:  # load_from_checkpoint builds a plain module
            return
        with torch.device("meta"):
            self.encoder = nn.Linear(FEATURES, HIDDEN)
            self.head = nn.Linear(HIDDEN, OUTPUTS)


class NoReset(nn.Module):
    """A module with a parameter (and, optionally, a non-persistent buffer) and no ``reset_parameters()``."""

    def __init__(self, non_persistent_buffer: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(HIDDEN))
        if non_persistent_buffer:
            self.register_buffer("table", torch.arange(HIDDEN, dtype=torch.float32), persistent=False)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs * self.weight


class WithNoReset(Resettable):
    def __init__(self, optimizer: str = "adam", non_persistent_buffer: bool = False) -> None:
        super().__init__(optimizer=optimizer)  # type: ignore[arg-type]
        self.scale = NoReset(non_persistent_buffer)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        output: torch.Tensor = self.head(self.scale(torch.tanh(self.encoder(inputs)))) * self.output_scale
        return output


def built(how: str, cls: type[ConformanceModel] = Resettable, seed: int = 11, **kwargs: Any) -> ConformanceModel:
    """A model built on the meta device: under ``trainer.init_module(empty_init=True)``, under ``torch.device('meta')``,
    or with its layers built there in ``configure_model``."""
    pl.seed_everything(seed, verbose=False)
    if how == "init_module":
        with pl.Trainer(strategy=fsdp2(), **trainer_kwargs()).init_module(empty_init=True):
            return cls(**kwargs)
    if how == "meta_device":
        with torch.device("meta"):
            return cls(**kwargs)
    return BuiltOnMetaInConfigureModel(**kwargs)


def _meta(model: nn.Module) -> list[str]:
    return [name for name, tensor in chain(model.named_parameters(), model.named_buffers()) if tensor.is_meta]


# ---------------------------------------------------------------------------------------------- init on the meta device


def test_init_module_with_empty_init_creates_meta_tensors_and_without_it_real_ones() -> None:
    trainer = pl.Trainer(strategy=fsdp2(), **trainer_kwargs())
    with trainer.init_module(empty_init=True):
        empty = Resettable()
    with trainer.init_module(empty_init=False):
        initialised = Resettable()

    assert _meta(empty) == ["encoder.weight", "encoder.bias", "head.weight", "head.bias", "output_scale"]
    assert _meta(initialised) == []


def _full_state(trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
    """Every rank's shard of each tensor and the whole tensor (a collective: every rank runs it)."""
    state: dict[str, Any] = {}
    for name, tensor in module.state_dict().items():
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        whole = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        state[name] = {"device": str(local.device), "local": local.tolist(), "full": whole.tolist()}
    return state


@pytest.mark.parametrize("how", ["init_module", "meta_device", "configure_model"])
def test_meta_tensors_hold_their_modules_reset_parameters_values_after_setup(tmp_path: Path, how: str) -> None:
    recorder = RankRecorder(tmp_path, "on_train_start", _full_state)
    fit(fsdp2(), built(how), callbacks=[recorder], max_steps=1)

    ranks = recorder.read()
    for state in ranks:
        assert {entry["device"] for entry in state.values()} == {"cpu"}
        assert state["output_scale"]["full"] == [0.5] * OUTPUTS  # the LightningModule's own reset_parameters()
    for name, fan_in in (("encoder", FEATURES), ("head", HIDDEN)):
        weight = torch.tensor(ranks[0][f"{name}.weight"]["full"])
        bias = torch.tensor(ranks[0][f"{name}.bias"]["full"])
        bound = 1 / math.sqrt(fan_in)  # nn.Linear.reset_parameters: U(-bound, bound) for both
        for tensor in (weight, bias):
            assert tensor.abs().max() <= bound, f"{name}: {tensor.abs().max()} is no value of U(-{bound}, {bound})"
        # Not zeros nor a constant: the spread of U(-bound, bound) (std bound / sqrt(3)), within sampling noise.
        assert 0.7 < float(weight.std()) / (bound / math.sqrt(3)) < 1.3
        # Each rank drew its own shard: rank 1's rows are not a copy of rank 0's.
        shard_0, shard_1 = (torch.tensor(rank[f"{name}.weight"]["local"]) for rank in ranks)
        assert not torch.equal(shard_0, shard_1)
    for name, entry in ranks[0].items():  # the ranks agree on every whole tensor (the buffer sent from rank 0)
        assert entry["full"] == ranks[1][name]["full"], name


@pytest.mark.parametrize("how", ["init_module", "meta_device", "configure_model"])
def test_a_meta_model_resumed_from_a_checkpoint_trains_like_ddp(tmp_path: Path, how: str) -> None:
    checkpoint = train_and_save(ddp(), tmp_path / "saved", cls=Resettable)
    expected = new_model(cls=Resettable, seed=11)
    fit(ddp(), expected, ckpt_path=checkpoint)
    model = built(how)
    fit(fsdp2(), model, ckpt_path=checkpoint)

    assert _meta(model) == []  # the weights handed back to this process filled the meta tensors here too
    assert_same_weights(expected, model, atol=1e-5)


class Tied(Resettable):
    """An embedding whose weight is the head's (tied input and output embeddings, as in GPT-2)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.embedding = nn.Embedding(OUTPUTS, HIDDEN)
        self.embedding.weight = self.head.weight


def test_tied_weights_stay_one_parameter_on_every_rank_and_in_this_process(tmp_path: Path) -> None:
    def tied(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
        return module.embedding.weight is module.head.weight

    checkpoint = train_and_save(ddp(), tmp_path / "saved", cls=Tied)
    expected = new_model(cls=Tied, seed=11)
    fit(ddp(), expected, ckpt_path=checkpoint)
    recorder = RankRecorder(tmp_path, "on_train_start", tied)
    model = built("init_module", Tied)
    fit(fsdp2(), model, ckpt_path=checkpoint, callbacks=[recorder])

    assert recorder.read() == [True, True]
    assert model.embedding.weight is model.head.weight  # materialised here for the weights handed back
    assert_same_weights(expected, model, atol=1e-5)


def test_a_module_without_reset_parameters_is_refused_at_fit_start_naming_the_fix() -> None:
    with pytest.raises(Exception, match=r"'scale\.weight' \(NoReset\).*Define reset_parameters\(\) on NoReset"):
        fit(fsdp2(), built("init_module", WithNoReset), max_steps=1)


def test_a_module_without_reset_parameters_trains_like_ddp_when_a_checkpoint_fills_it(tmp_path: Path) -> None:
    checkpoint = train_and_save(ddp(), tmp_path / "saved", cls=WithNoReset)
    expected = new_model(cls=WithNoReset, seed=11)
    fit(ddp(), expected, ckpt_path=checkpoint)
    model = built("init_module", WithNoReset)
    fit(fsdp2(), model, ckpt_path=checkpoint)

    assert_same_weights(expected, model, atol=1e-5)


def test_a_non_persistent_buffer_without_reset_parameters_is_refused_even_when_resuming(tmp_path: Path) -> None:
    checkpoint = tmp_path / "any.ckpt"
    checkpoint.touch()  # refused in setup, before the restore reads it
    model = built("init_module", WithNoReset, non_persistent_buffer=True)
    with pytest.raises(Exception, match=r"'scale\.table' \(NoReset\)") as refusal:
        fit(fsdp2(), model, ckpt_path=checkpoint, max_steps=1)
    assert "'scale.weight'" not in str(refusal.value)  # the checkpoint fills the parameter


@pytest.mark.parametrize("strategy", ["ddp_sharded_fork", "fsdp_fairscale_fork"])
@pytest.mark.parametrize("how", ["meta_device", "configure_model"])
def test_the_fairscale_strategies_refuse_a_meta_model_at_fit_start_naming_the_fix(strategy: str, how: str) -> None:
    model = built(how)
    name = strategy.removesuffix("_fork")
    with pytest.raises(Exception, match=rf"{name}: the model has tensors on the meta device.*strategy='fsdp2'"):
        fit(strategy, model, max_steps=1)


# ------------------------------------------------------------------------------- no rank materialises the whole model


class Wide(Resettable):
    """Four 128 x 128 layers: about 260 kB of parameters, far more than anything else setup allocates."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, 128), *(nn.Linear(128, 128) for _ in range(3)))
        self.head = nn.Linear(128, OUTPUTS)


def _model_bytes(module: nn.Module, *, full: bool) -> int:
    """Bytes of the module's tensors that hold memory on this rank (their local shards), or of the whole model."""
    total = 0
    for tensor in chain(module.parameters(), module.buffers()):
        if full:
            total += tensor.numel() * tensor.element_size()
        elif not tensor.is_meta:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            total += local.numel() * local.element_size()
    return total


class MeasuredFSDP2(FSDP2Strategy):
    """Writes, per rank, the peak bytes the model held during setup: what it held when setup started plus the peak of
    torch's CPU allocations during setup (torch's profiler counts every allocation and free)."""

    def __init__(self, directory: Path) -> None:
        super().__init__(start_method="fork", shard_module_classes={nn.Linear})
        self.directory = directory

    def setup(self, trainer: pl.Trainer) -> None:
        module = self.require_lightning_module()
        held = _model_bytes(module, full=False)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as profile:
            super().setup(trainer)
        # Each op's own allocations (positive) and each free ("[memory]", negative), in the order they happened.
        live = peak = 0
        for event in sorted(profile.events(), key=lambda event: event.time_range.start):
            live += event.self_cpu_memory_usage
            peak = max(peak, live)
        record = {"held": held, "setup_peak": peak, "full": _model_bytes(module, full=True)}
        (self.directory / f"memory-rank{self.global_rank}.json").write_text(json.dumps(record))


def test_no_rank_materialises_the_whole_model_during_setup(tmp_path: Path) -> None:
    with pl.Trainer(strategy=fsdp2(), **trainer_kwargs()).init_module(empty_init=True):
        model = Wide()
    fit(MeasuredFSDP2(tmp_path), model, max_steps=1)

    for rank in range(2):
        record = json.loads((tmp_path / f"memory-rank{rank}.json").read_text())
        peak = record["held"] + record["setup_peak"]
        # Half the model is this rank's shards; the whole model (or a rank's copy of it) would be twice that.
        assert peak < 0.7 * record["full"], f"rank {rank} held {peak} bytes of a {record['full']}-byte model"


# ------------------------------------------------------- test and predict after fit, in the process, in inference mode


def _fit_then_test_and_predict_in_inference_mode(
    strategy: Callable[[], Any], model_class: type[ConformanceModel] = ConformanceModel
) -> dict[str, Any]:
    """Runs on every rank (processes started from outside, as torchrun starts them): one process fits, tests and
    predicts with the same Trainer and module, the last two inside ``torch.inference_mode()`` as upstream's tests do."""
    pl.seed_everything(7, verbose=False)
    model = model_class()
    trainer = pl.Trainer(strategy=strategy(), **trainer_kwargs(max_epochs=1))
    trainer.fit(model)
    with torch.inference_mode():
        tested = trainer.test(model, verbose=False)
        predicted = trainer.predict(model)
    assert predicted is not None
    return {"test_loss": tested[0]["test_loss"], "predictions": torch.cat(predicted).tolist()}  # type: ignore[arg-type]


@functools.cache
def _ddp_in_inference_mode() -> list[dict[str, Any]]:
    return run_as_ranks(lambda: _fit_then_test_and_predict_in_inference_mode(lambda: "ddp"))


@pytest.mark.parametrize("strategy", ["fsdp2", "ddp_sharded", "fsdp_fairscale"])
def test_test_and_predict_after_fit_in_the_same_process_in_inference_mode_give_ddp_s_results(strategy: str) -> None:
    ranks = run_as_ranks(lambda: _fit_then_test_and_predict_in_inference_mode(lambda: strategy))

    for rank, expected in zip(ranks, _ddp_in_inference_mode(), strict=True):
        assert rank["test_loss"] == pytest.approx(expected["test_loss"], abs=1e-5)
        assert torch.allclose(torch.tensor(rank["predictions"]), torch.tensor(expected["predictions"]), atol=1e-5)


def _loops_inference_mode(strategy: str) -> dict[str, bool]:
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=1))
    trainer.fit(ConformanceModel())
    # (fit's own validation loop runs under no_grad by Lightning's design, whatever the strategy)
    return {"test": trainer.test_loop.inference_mode, "predict": trainer.predict_loop.inference_mode}


@pytest.mark.parametrize(("strategy", "inference_mode"), [("fsdp2", False), ("ddp_sharded", True)])
def test_fsdp2_runs_the_evaluation_loops_under_no_grad_as_lightning_does_for_its_fsdp(
    strategy: str, inference_mode: bool
) -> None:
    # Under NCCL Lightning evaluates inside `torch.inference_mode()`, where FSDP2's all-gather fails ("Inference
    # tensors do not track version counter", seen on an H200); gloo always gets no_grad, so CPU runs see only the flag.
    ranks = run_as_ranks(lambda: _loops_inference_mode(strategy))

    assert ranks == [{"test": inference_mode, "predict": inference_mode}] * 2


def _fit_then_test_a_checkpoint_in_inference_mode(strategy: Any, path: Path) -> float:
    """Every rank: fit, save, then ``trainer.test(ckpt_path=...)`` inside ``torch.inference_mode()`` (upstream's
    ``test_save_checkpoint_path_exists``-style flow): the restore runs in inference mode."""
    pl.seed_everything(7, verbose=False)
    model = ConformanceModel()
    trainer = pl.Trainer(strategy=strategy, **trainer_kwargs(max_epochs=1))
    trainer.fit(model)
    trainer.save_checkpoint(path)
    with torch.inference_mode():
        tested = trainer.test(model, ckpt_path=path, verbose=False)
    return float(tested[0]["test_loss"])


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_testing_a_checkpoint_in_inference_mode_after_fit_restores_it_under_fsdp2(
    state_dict_type: str, tmp_path: Path
) -> None:
    # The restore read the module's state (DTensor.detach), which torch refuses in inference mode.
    expected = run_as_ranks(lambda: _fit_then_test_a_checkpoint_in_inference_mode("ddp", tmp_path / "ddp.ckpt"))
    ours = run_as_ranks(
        lambda: _fit_then_test_a_checkpoint_in_inference_mode(
            FSDP2Strategy(state_dict_type=state_dict_type), tmp_path / "fsdp2.ckpt"
        )
    )

    assert ours == pytest.approx(expected, abs=1e-5)


# ------------------------------------------------------------------------------ code written for ModelParallelStrategy


class ReadsItsDeviceMesh(ConformanceModel):
    """Records in ``configure_model`` what ``self.device_mesh`` is, as upstream's ``test_setup_device_mesh`` checks."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        self.directory = directory

    def configure_model(self) -> None:
        mesh = self.device_mesh
        strategy = self.trainer.strategy
        record = None
        if mesh is not None:
            record = {
                "names": list(mesh.mesh_dim_names or ()),
                "shape": list(mesh.shape),
                "device": mesh.device_type,
                "data_parallel_is_the_strategy_s": isinstance(strategy, FSDP2Strategy)
                and mesh["data_parallel"] == strategy.device_mesh,
            }
        Path(self.directory, f"mesh-rank{self.global_rank}.json").write_text(json.dumps(record))


def test_configure_model_sees_model_parallel_strategy_s_device_mesh(tmp_path: Path) -> None:
    fit(fsdp2(), ReadsItsDeviceMesh(str(tmp_path)), max_steps=1)

    for rank in range(2):
        record = json.loads((tmp_path / f"mesh-rank{rank}.json").read_text())
        assert record == {
            "names": ["data_parallel", "tensor_parallel"],
            "shape": [2, 1],
            "device": "cpu",
            "data_parallel_is_the_strategy_s": True,
        }


class ShardedThroughItsDeviceMesh(ConformanceModel):
    """Written for ``ModelParallelStrategy`` as upstream's docs write it: ``fully_shard`` per layer and on the root,
    over ``self.device_mesh["data_parallel"]``."""

    def configure_model(self) -> None:
        if self._trainer is None:  # load_from_checkpoint builds a plain module
            return
        mesh = self.device_mesh["data_parallel"]
        for layer in (self.encoder, self.head):
            fully_shard(layer, mesh=mesh)
        fully_shard(self, mesh=mesh)


def test_code_written_for_model_parallel_strategy_trains_under_fsdp2_as_under_it(tmp_path: Path) -> None:
    upstream = upstream_runs.fit(
        lambda: ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1),
        tmp_path / "upstream",
        model_class=ShardedThroughItsDeviceMesh,
    )
    ours = upstream_runs.fit(lambda: "fsdp2", tmp_path / "ours", model_class=ShardedThroughItsDeviceMesh)

    assert len(ours) == len(upstream) > 0
    assert torch.allclose(torch.tensor(ours), torch.tensor(upstream), rtol=1e-5, atol=0)


class ShardedOnceThroughItsDeviceMesh(ShardedThroughItsDeviceMesh):
    """Shards in its first ``configure_model`` only (the Trainer calls the hook again for ``test`` and ``predict``)."""

    def configure_model(self) -> None:
        if not isinstance(self, FSDPModule):
            super().configure_model()


def test_model_parallel_strategy_fails_where_fsdp2_tests_and_predicts_after_fit_in_inference_mode() -> None:
    def model_parallel() -> ModelParallelStrategy:
        return ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)

    ours = run_as_ranks(
        lambda: _fit_then_test_and_predict_in_inference_mode(lambda: "fsdp2", ShardedOnceThroughItsDeviceMesh)
    )
    assert len(ours) == 2
    # A torch limit upstream does not work around (the user guide says so): setup moves the sharded module again.
    with pytest.raises(RuntimeError, match=r"_apply\(\): Couldn't swap FSDPLinear\.weight"):
        run_as_ranks(
            lambda: _fit_then_test_and_predict_in_inference_mode(model_parallel, ShardedOnceThroughItsDeviceMesh)
        )
