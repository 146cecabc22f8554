"""Manual optimization, steps that call submodules and gradient logging train as under upstream ``ddp``.

Each behaviour runs under ``ddp_sharded``, ``fsdp_fairscale`` (default options) and ``fsdp2`` and is compared with
``ddp`` (weights within 1e-5, logged norms within 1e-5 relative).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.distributed as dist
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from pytorch_lightning.utilities import grad_norm
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.testing import SaveAfterRestore
from lightning_strategies.testing.models import FEATURES, HIDDEN, OUTPUTS, make_dataset
from tests.support.helpers import assert_same_weights, fit

STRATEGIES = ["ddp_sharded_fork", "fsdp_fairscale_fork", "fsdp2_fork"]


def ddp() -> DDPStrategy:
    """Upstream ddp; a GAN step leaves the other network's parameters without gradients, which ddp must be told."""
    return DDPStrategy(start_method="fork", find_unused_parameters=True)


def seeded(cls: type[pl.LightningModule], **kwargs: Any) -> pl.LightningModule:
    pl.seed_everything(3, verbose=False)
    return cls(**kwargs)


def regression_data() -> DataLoader[Any]:
    return DataLoader(make_dataset(32), batch_size=4)


# ---------------------------------------------------------------------------------------------- the modules


class ManualRegressor(pl.LightningModule):
    """One optimizer stepped by hand; optionally clips with ``self.clip_gradients``, or accumulates two batches."""

    def __init__(self, clip: float | None = None, accumulate: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.encoder = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        self.clip = clip
        self.accumulate = accumulate

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.head(torch.tanh(self.encoder(inputs)))
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        optimizer = self.optimizers()
        assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
        loss = nn.functional.mse_loss(self(inputs), targets)
        self.manual_backward(loss / self.accumulate)  # synchronised every time, as in the Lightning docs
        if (batch_idx + 1) % self.accumulate == 0:
            if self.clip is not None:
                self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
            optimizer.step()
            optimizer.zero_grad()
        return loss.detach()

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader[Any]:
        return regression_data()


class GAN(pl.LightningModule):
    """The two-optimizer GAN of Lightning's manual-optimization docs: two backward passes per step.

    Args:
        toggle: Use ``toggle_optimizer``/``untoggle_optimizer`` around each network's update (as the docs do).
    """

    def __init__(self, toggle: bool = True) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.toggle = toggle
        self.generator = nn.Sequential(nn.Linear(OUTPUTS, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, FEATURES))
        self.discriminator = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))

    def forward(self, noise: Tensor) -> Tensor:
        output: Tensor = self.generator(noise)
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> None:
        real, noise = batch
        optimizers = self.optimizers()
        assert isinstance(optimizers, list)
        generator_optimizer, discriminator_optimizer = optimizers
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        loss = nn.functional.binary_cross_entropy_with_logits

        with self._toggled(generator_optimizer):
            generator_loss = loss(self.discriminator(self(noise)), ones)
            self.manual_backward(generator_loss)
            generator_optimizer.step()
            generator_optimizer.zero_grad()

        with self._toggled(discriminator_optimizer):
            fake = self(noise).detach()
            discriminator_loss = (loss(self.discriminator(real), ones) + loss(self.discriminator(fake), zeros)) / 2
            self.manual_backward(discriminator_loss)
            discriminator_optimizer.step()
            discriminator_optimizer.zero_grad()

    def _toggled(self, optimizer: Any) -> Any:
        module = self

        class Toggled:
            def __enter__(self) -> None:
                if module.toggle:
                    module.toggle_optimizer(optimizer)

            def __exit__(self, *exc: object) -> None:
                if module.toggle:
                    module.untoggle_optimizer(optimizer)

        return Toggled()

    def configure_optimizers(self) -> Any:
        return (
            torch.optim.Adam(self.generator.parameters(), lr=0.01),
            torch.optim.Adam(self.discriminator.parameters(), lr=0.02),
        )

    def train_dataloader(self) -> DataLoader[Any]:
        return regression_data()  # (real samples, noise)


class QuickstartStyle(pl.LightningModule):
    """A step that calls its submodules (``self.encoder(x)``), never ``self(...)``: Lightning's quickstart."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.Tanh())
        self.decoder = nn.Linear(HIDDEN, OUTPUTS)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.decoder(self.encoder(inputs)), targets)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.02)

    def train_dataloader(self) -> DataLoader[Any]:
        return regression_data()


class HuggingFaceStyle(pl.LightningModule):
    """A tiny GPT-2 (tied embeddings, dropout 0) trained with ``self.model(input_ids=..., labels=...)``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
        )
        self.model = GPT2LMHeadModel(config)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        (tokens,) = batch
        loss: Tensor = self.model(input_ids=tokens, labels=tokens).loss
        return loss

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    def train_dataloader(self) -> DataLoader[Any]:
        tokens = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(5))
        return DataLoader(TensorDataset(tokens), batch_size=4)


class LogsGradNorm(pl.LightningModule):
    """Logs ``grad_norm(self, norm_type=2)`` in ``on_before_optimizer_step``, as Lightning's docs show."""

    def __init__(self, scale_gradients: float | None = None) -> None:
        super().__init__()
        self.encoder = nn.Linear(FEATURES, HIDDEN)
        self.head = nn.Linear(HIDDEN, OUTPUTS)
        self.scale_gradients = scale_gradients

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.head(torch.tanh(self.encoder(inputs)))
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)

    def on_before_optimizer_step(self, optimizer: Any) -> None:
        self.log_dict(grad_norm(self, norm_type=2))
        if self.scale_gradients is not None:
            for param in self.parameters():
                if param.grad is not None:
                    param.grad.mul_(self.scale_gradients)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader[Any]:
        return regression_data()


# ---------------------------------------------------------------------------------------------- manual optimization


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_manual_optimization_trains_as_under_ddp(strategy: str) -> None:
    reference, model = seeded(ManualRegressor), seeded(ManualRegressor)
    fit(ddp(), reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_manual_clip_gradients_clips_by_the_total_norm_as_under_ddp(strategy: str) -> None:
    reference, model = seeded(ManualRegressor, clip=0.05), seeded(ManualRegressor, clip=0.05)
    fit(ddp(), reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_manual_backward_accumulating_over_two_batches_trains_as_under_ddp(strategy: str) -> None:
    # Two synchronised backward passes add into the gradients before a step: under ddp_sharded the owner rank's
    # gradient from the first pass was averaged again by the second.
    reference, model = seeded(ManualRegressor, accumulate=2), seeded(ManualRegressor, accumulate=2)
    fit(ddp(), reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_two_optimizer_gan_with_toggled_optimizers_trains_as_under_ddp(strategy: str) -> None:
    reference, model = seeded(GAN), seeded(GAN)
    fit(ddp(), reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_two_optimizer_gan_without_toggling_trains_as_under_ddp(strategy: str) -> None:
    # Without toggling, the generator's backward pass leaves gradients on the discriminator that its own pass adds to.
    reference, model = seeded(GAN, toggle=False), seeded(GAN, toggle=False)
    fit(ddp(), reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


def test_ddp_sharded_refuses_manual_optimization_with_gradient_buckets_and_names_the_option() -> None:
    strategy = ShardedDDPStrategy(start_method="fork", reduce_buffer_size=2**20)
    with pytest.raises(Exception, match=r"reduce_buffer_size=0"):
        fit(strategy, seeded(ManualRegressor), max_epochs=1)


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [
        ("ddp_sharded_fork", "ddp_fork"),
        ("fsdp_fairscale_fork", "fsdp2_fork"),
        ("fsdp2_fork", "ddp_sharded_fork"),
        ("ddp_fork", "fsdp_fairscale_fork"),
    ],
)
def test_a_gan_checkpoint_resumes_exactly_under_another_strategy(
    tmp_path: Path, saved_by: str, resumed_by: str
) -> None:
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "saved", filename="{epoch}", save_top_k=-1)
    saving = ddp() if saved_by == "ddp_fork" else saved_by
    fit(saving, seeded(GAN), callbacks=[checkpoints], max_epochs=1, enable_checkpointing=True)
    saved = tmp_path / "saved" / "epoch=0.ckpt"
    restored = tmp_path / "restored.ckpt"
    resuming = ddp() if resumed_by == "ddp_fork" else resumed_by
    fit(resuming, seeded(GAN), ckpt_path=saved, callbacks=[SaveAfterRestore(restored)], max_epochs=2)

    before, after = torch.load(saved, weights_only=True), torch.load(restored, weights_only=True)
    assert before["state_dict"].keys() == after["state_dict"].keys()
    for key, value in before["state_dict"].items():
        assert torch.equal(value, after["state_dict"][key]), key
    assert len(before["optimizer_states"]) == len(after["optimizer_states"]) == 2
    for expected, got in zip(before["optimizer_states"], after["optimizer_states"], strict=True):
        assert expected["state"].keys() == got["state"].keys()
        for index, entries in expected["state"].items():
            for name, value in entries.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][index][name])), (index, name)


# ---------------------------------------------------------------------------------------- steps calling submodules


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_step_that_calls_submodules_trains_as_under_ddp(strategy: str) -> None:
    reference, model = seeded(QuickstartStyle), seeded(QuickstartStyle)
    fit("ddp_fork", reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_hugging_face_gpt2_step_calling_self_model_trains_as_under_ddp(strategy: str) -> None:
    pytest.importorskip("transformers")
    reference, model = seeded(HuggingFaceStyle), seeded(HuggingFaceStyle)
    fit("ddp_fork", reference, max_epochs=1)
    fit(strategy, model, max_epochs=1)
    assert_same_weights(model, reference, atol=1e-5)


def test_a_hugging_face_gpt2_step_trains_under_fsdp2_with_its_blocks_sharded_apart() -> None:
    transformers = pytest.importorskip("transformers")
    reference, model = seeded(HuggingFaceStyle), seeded(HuggingFaceStyle)
    fit("ddp_fork", reference, max_epochs=1)
    blocks = {transformers.models.gpt2.modeling_gpt2.GPT2Block}
    fit(FSDP2Strategy(start_method="fork", shard_module_classes=blocks), model, max_epochs=1)
    assert_same_weights(model, reference, atol=1e-5)


_ALL_GATHERS: list[int] = []  # all-gathers this process ran (each forked rank counts its own)


class AllGathersPerStep(pl.Callback):
    """Writes, per rank, how many all-gathers each training step ran."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.counts: list[int] = []
        self.start = 0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self.start = len(_ALL_GATHERS)

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.counts.append(len(_ALL_GATHERS) - self.start)

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        (self.directory / f"rank{trainer.global_rank}.txt").write_text(",".join(map(str, self.counts)))


@pytest.fixture
def counted_all_gathers(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # FSDP2 all-gathers through `dist.all_gather_single` (torch 2.13), earlier versions `all_gather_into_tensor`.
    for name in ("all_gather_single", "all_gather_into_tensor"):
        original = getattr(dist, name, None)
        if original is not None:
            monkeypatch.setattr(dist, name, _counting(original))
    yield None


def _counting(collective: Any) -> Any:
    def counting(*args: Any, **kwargs: Any) -> Any:
        _ALL_GATHERS.append(1)
        return collective(*args, **kwargs)

    return counting


class SelfCallStyle(QuickstartStyle):
    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.decoder(self.encoder(inputs))
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)


class OneSubmoduleCall(QuickstartStyle):
    """The Hugging Face shape: the step makes one call, of the submodule that holds the model."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Sequential(self.encoder, self.decoder)

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self.model(inputs), targets)


@pytest.mark.parametrize(
    ("model_class", "all_gathers"),
    [(SelfCallStyle, 1), (OneSubmoduleCall, 1), (QuickstartStyle, 2)],
    ids=["self-call", "self-model-call", "two-submodule-calls"],
)
@pytest.mark.usefixtures("counted_all_gathers")
def test_fsdp2_all_gathers_once_per_step_and_once_more_per_further_submodule_call(
    tmp_path: Path, model_class: type[pl.LightningModule], all_gathers: int
) -> None:
    # The benchmarks' step time relies on it: the root's parameters are gathered once per step, by the step's one
    # module call, and stay gathered until backward. A second call's backward hooks gather them once more.
    fit(FSDP2Strategy(start_method="fork"), seeded(model_class), callbacks=[AllGathersPerStep(tmp_path)], max_epochs=1)
    for rank in range(2):
        counts = (tmp_path / f"rank{rank}.txt").read_text().split(",")
        assert counts == [str(all_gathers)] * 4, counts


# ---------------------------------------------------------------------------------------------- gradient logging


def logged_norms(strategy: Any, **kwargs: Any) -> dict[str, float]:
    trainer = fit(strategy, seeded(LogsGradNorm, **kwargs), max_epochs=1)
    return {key: float(value) for key, value in trainer.callback_metrics.items() if key.startswith("grad_")}


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_norm_logs_the_total_norm_of_ddp(strategy: str) -> None:
    expected = logged_norms("ddp_fork")["grad_2.0_norm_total"]
    assert logged_norms(strategy).get("grad_2.0_norm_total") == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize(
    "options", [{"auto_wrap_min_params": 50}, {"flatten_parameters": False}], ids=["nested-wrappers", "not-flattened"]
)
def test_grad_norm_logs_the_total_norm_of_ddp_with_other_fairscale_layouts(options: dict[str, Any]) -> None:
    expected = logged_norms("ddp_fork")["grad_2.0_norm_total"]
    got = logged_norms(FairScaleFSDPStrategy(start_method="fork", **options))
    assert got.get("grad_2.0_norm_total") == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_grad_norm_logs_each_parameters_norm_as_ddp(strategy: str) -> None:
    expected = logged_norms("ddp_fork")
    got = logged_norms(strategy)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-5), key


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_gradients_changed_in_on_before_optimizer_step_train_as_under_ddp(strategy: str) -> None:
    reference, model = seeded(LogsGradNorm, scale_gradients=0.5), seeded(LogsGradNorm, scale_gradients=0.5)
    fit("ddp_fork", reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(model, reference, atol=1e-5)


class _RecordsCompletion:
    def complete_gradients(self) -> Any:
        (self.directory / f"entered-rank{self.global_rank}").touch()  # type: ignore[attr-defined]
        return super().complete_gradients()  # type: ignore[misc]


class _ShardedRecording(_RecordsCompletion, ShardedDDPStrategy):
    def __init__(self, directory: Path) -> None:
        super().__init__(start_method="fork")
        self.directory = directory
        directory.mkdir()


class _FairScaleRecording(_RecordsCompletion, FairScaleFSDPStrategy):
    def __init__(self, directory: Path) -> None:
        super().__init__(start_method="fork")
        self.directory = directory
        directory.mkdir()


class _FSDP2Recording(_RecordsCompletion, FSDP2Strategy):
    def __init__(self, directory: Path) -> None:
        super().__init__(start_method="fork")
        self.directory = directory
        directory.mkdir()


@pytest.mark.parametrize("strategy_class", [_ShardedRecording, _FairScaleRecording, _FSDP2Recording])
def test_gradients_are_completed_only_when_a_hook_reads_them(tmp_path: Path, strategy_class: type[Any]) -> None:
    fit(strategy_class(tmp_path / "plain"), seeded(QuickstartStyle), max_epochs=1)
    fit(strategy_class(tmp_path / "hooked"), seeded(LogsGradNorm), max_epochs=1)
    assert not list((tmp_path / "plain").glob("entered-*"))  # no collective per step for a module that reads none
    assert sorted(path.name for path in (tmp_path / "hooked").glob("entered-*")) == ["entered-rank0", "entered-rank1"]
