"""Param groups that split a layer, tied and frozen parameters, reading parameters in hooks: under every strategy.

The recipe is the Hugging Face GPT-2 one: ``lm_head.weight is transformer.wte.weight``, AdamW with weight decay on
weights only (biases and LayerNorm weights in a group with ``weight_decay=0``), a warmup scheduler and a frozen
position embedding. Each strategy must train it as upstream ``ddp`` does, and checkpoints move between them exactly.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
from fairscale.nn.wrap import wrap
from pytorch_lightning.callbacks import ModelCheckpoint
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_strategies import FairScaleFSDPStrategy
from lightning_strategies.fairscale.layout import FlatUnit, optimizer_layout
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.support.helpers import RankRecorder, assert_same_weights, comparable_optimizer_state, fit, new_model

VOCABULARY = 64
SEQUENCE = 16


class GPT2Recipe(pl.LightningModule):
    """A tiny GPT-2 (no dropout) trained the usual way: no weight decay for biases and LayerNorms, warmup.

    Args:
        frozen: Freeze the position embedding (``wpe``).
        frozen_in_optimizer: Give the optimizer every parameter (``AdamW(self.parameters())``-style) instead of only
            the ones that train.
    """

    def __init__(self, frozen: bool = True, frozen_in_optimizer: bool = True) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            n_layer=2,
            n_embd=32,
            n_head=2,
            vocab_size=VOCABULARY,
            n_positions=SEQUENCE,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        self.model = GPT2LMHeadModel(config)
        if frozen:
            self.model.transformer.wpe.requires_grad_(False)
        self.frozen_in_optimizer = frozen_in_optimizer

    def forward(self, ids: Tensor) -> Tensor:
        loss: Tensor = self.model(input_ids=ids, labels=ids).loss
        return loss

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> Any:
        named = [(n, p) for n, p in self.named_parameters() if p.requires_grad or self.frozen_in_optimizer]
        no_decay = [p for n, p in named if n.endswith("bias") or ".ln_" in n]
        decay = [p for n, p in named if not (n.endswith("bias") or ".ln_" in n)]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-2
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return [optimizer], [{"scheduler": warmup, "interval": "step"}]

    def train_dataloader(self) -> DataLoader[Any]:
        tokens = torch.randint(0, VOCABULARY, (32, SEQUENCE), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(tokens), batch_size=4)


def gpt2(seed: int = 1, cls: type[GPT2Recipe] = GPT2Recipe, **kwargs: Any) -> GPT2Recipe:
    pytest.importorskip("transformers")
    pl.seed_everything(seed, verbose=False)
    return cls(**kwargs)


def fsdp(**kwargs: Any) -> FairScaleFSDPStrategy:
    return FairScaleFSDPStrategy(start_method="fork", **kwargs)


STRATEGIES = ["ddp_sharded_fork", "fsdp_fairscale_fork", "fsdp2_fork"]


def _trained_like_ddp(strategy: Any, atol: float = 1e-5, **kwargs: Any) -> GPT2Recipe:
    reference, model = gpt2(**kwargs), gpt2(**kwargs)
    fit("ddp_fork", reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(reference, model, atol=atol)
    return model


def _save_after_one_epoch(strategy: Any, directory: Path, **kwargs: Any) -> Path:
    checkpoints = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(strategy, gpt2(**kwargs), callbacks=[checkpoints], max_epochs=1, enable_checkpointing=True)
    return directory / "epoch=0.ckpt"


def _assert_same_checkpoint_state(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["state_dict"].keys() == after["state_dict"].keys()
    for key, value in before["state_dict"].items():
        assert torch.equal(value, after["state_dict"][key]), key
    expected = comparable_optimizer_state(before["optimizer_states"][0])
    got = comparable_optimizer_state(after["optimizer_states"][0])
    assert expected["params"] == got["params"] and expected["lrs"] == got["lrs"]
    assert expected["state"].keys() == got["state"].keys()
    for index, entries in expected["state"].items():
        for name, value in entries.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(got["state"][index][name])), (index, name)
    assert after["lr_schedulers"] == before["lr_schedulers"]


# ---------------------------------------------------------------------------------------------- the whole recipe


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_gpt2_recipe_with_default_options_trains_like_upstream_ddp(strategy: str) -> None:
    model = _trained_like_ddp(strategy)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight


@pytest.mark.parametrize(
    ("saved_by", "resumed_by"),
    [
        ("fsdp_fairscale_fork", "ddp_fork"),
        ("ddp_fork", "fsdp_fairscale_fork"),
        ("fsdp_fairscale_fork", "fsdp_fairscale_fork"),
        ("fsdp_fairscale_fork", "ddp_sharded_fork"),
        ("fsdp_fairscale_fork", "fsdp2_fork"),
        ("fsdp2_fork", "fsdp_fairscale_fork"),
        ("ddp_sharded_fork", "fsdp_fairscale_fork"),
        ("fsdp2_fork", "ddp_sharded_fork"),
    ],
)
def test_the_gpt2_recipe_resumes_exactly_under_another_strategy(tmp_path: Path, saved_by: str, resumed_by: str) -> None:
    saved = _save_after_one_epoch(saved_by, tmp_path / "saved")
    restored = tmp_path / "restored.ckpt"
    fit(resumed_by, gpt2(seed=11), ckpt_path=saved, callbacks=[SaveAfterRestore(restored)], max_epochs=2)
    _assert_same_checkpoint_state(torch.load(saved, weights_only=True), torch.load(restored, weights_only=True))


def test_a_resumed_gpt2_run_ends_with_the_uninterrupted_runs_weights(tmp_path: Path) -> None:
    uninterrupted = gpt2()
    fit("ddp_fork", uninterrupted, max_epochs=2)
    saved = _save_after_one_epoch("fsdp_fairscale_fork", tmp_path)
    # The same seed as the uninterrupted run: even ddp -> ddp ends 9e-3 away from it with another one, so something
    # seed-dependent outside checkpoints takes part; that every checkpointed state is restored is checked above.
    resumed = gpt2()
    fit("fsdp_fairscale_fork", resumed, ckpt_path=saved, max_epochs=2)
    assert_same_weights(uninterrupted, resumed, atol=1e-5)


# ---------------------------------------------------------------------------------------------- item: param groups


class GroupsInsideOneLayer(ConformanceModel):
    """Weight decay on the weights only: each layer's weight and bias are in different param groups."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(
            [
                {"params": [self.encoder.weight, self.head.weight], "weight_decay": 0.5},
                {"params": [self.encoder.bias, self.head.bias], "weight_decay": 0.0, "lr": 0.05},
            ],
            lr=0.02,
        )


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_param_groups_that_split_one_layer_train_like_upstream_ddp(strategy: str) -> None:
    reference, model = new_model(cls=GroupsInsideOneLayer), new_model(cls=GroupsInsideOneLayer)
    fit("ddp_fork", reference, max_epochs=2)
    fit(strategy, model, max_epochs=2)
    assert_same_weights(reference, model, atol=1e-5)


def test_each_param_group_of_one_layer_steps_a_flat_parameter_of_its_own(tmp_path: Path) -> None:
    def probe(trainer: pl.Trainer, module: pl.LightningModule) -> list[dict[str, Any]]:
        groups = trainer.optimizers[0].param_groups
        return [{"flat": len(g["params"]), "weight_decay": g["weight_decay"], "lr": g["lr"]} for g in groups]

    recorder = RankRecorder(tmp_path, "on_train_start", probe)
    fit("fsdp_fairscale_fork", new_model(cls=GroupsInsideOneLayer), callbacks=[recorder], max_epochs=1)
    for record in recorder.read():
        assert record == [{"flat": 1, "weight_decay": 0.5, "lr": 0.02}, {"flat": 1, "weight_decay": 0.0, "lr": 0.05}]


class WrapsABlockItself(GPT2Recipe):
    """Wraps a transformer block in configure_model, the fairscale way, and chooses param groups by name."""

    def configure_model(self) -> None:
        self.model.transformer.h[0] = wrap(self.model.transformer.h[0])


def test_param_groups_by_name_inside_a_submodule_the_user_wraps_train_like_upstream_ddp() -> None:
    # Wrapped in configure_model, the block would show configure_optimizers() one flat parameter named
    # "..._fsdp_wrapped_module.flat_param_0": no name ends with "bias", and its biases would be decayed.
    reference = gpt2()
    fit("ddp_fork", reference, max_epochs=2)
    pl.seed_everything(1, verbose=False)
    wrapped = WrapsABlockItself()
    fit(fsdp(), wrapped, max_epochs=2)
    assert_same_weights(reference, wrapped, atol=1e-5)


def test_a_unit_holding_parameters_of_several_groups_is_refused_naming_a_few_of_them() -> None:
    params = [nn.Parameter(torch.zeros(1)) for _ in range(40)]
    names = [f"layer{index}.{'weight' if index % 2 else 'bias'}" for index in range(40)]
    names_of = {id(param): [name] for param, name in zip(params, names, strict=True)}
    flattened_before = FlatUnit(nn.Parameter(torch.zeros(40)), names, [torch.Size([1])] * 40, None)  # type: ignore[arg-type]
    optimizer = torch.optim.AdamW([{"params": params[1::2], "weight_decay": 0.1}, {"params": params[::2]}])
    with pytest.raises(ValueError) as error:
        optimizer_layout(optimizer, names_of, [flattened_before], 0)
    assert "(group 1: layer0.bias, layer2.bias, layer4.bias and 17 more; group 0: layer1.weight," in str(error.value)
    assert "fairscale.nn.wrap in configure_model" in str(error.value)


# ---------------------------------------------------------------------------------------------- item: tied weights


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_full_checkpoint_holds_every_key_of_the_modules_state_dict_tied_ones_included(
    tmp_path: Path, strategy: str
) -> None:
    saved = _save_after_one_epoch(strategy, tmp_path)
    state = torch.load(saved, weights_only=True)["state_dict"]
    assert list(state) == list(gpt2().state_dict())
    assert torch.equal(state["model.lm_head.weight"], state["model.transformer.wte.weight"])


def _tie_probe(trainer: pl.Trainer, module: pl.LightningModule) -> bool:
    # fsdp_fairscale holds flat shards between steps: look at the parameters where the strategy shows them whole.
    full: AbstractContextManager[Any] = getattr(trainer.strategy, "full_parameters", nullcontext)()
    with full:
        return bool(module.model.lm_head.weight is module.model.transformer.wte.weight)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_loading_a_checkpoint_keeps_tied_parameters_one_tensor(tmp_path: Path, strategy: str) -> None:
    saved = _save_after_one_epoch("ddp_fork", tmp_path / "saved")
    recorder = RankRecorder(tmp_path, "on_train_start", _tie_probe)
    resumed = gpt2(seed=11)
    fit(strategy, resumed, ckpt_path=saved, callbacks=[recorder], max_epochs=2)
    assert recorder.read() == [True, True]
    assert resumed.model.lm_head.weight is resumed.model.transformer.wte.weight
    loaded = GPT2Recipe.load_from_checkpoint(_save_after_one_epoch(strategy, tmp_path / "again"))
    assert loaded.model.lm_head.weight is loaded.model.transformer.wte.weight


class OneGroup(GPT2Recipe):
    """Every parameter trains, in one param group: only the tie is left to get wrong."""

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_auto_wrapping_small_submodules_keeps_the_users_of_a_shared_parameter_together() -> None:
    reference, model = gpt2(cls=OneGroup, frozen=False), gpt2(cls=OneGroup, frozen=False)
    fit("ddp_fork", reference, max_epochs=2)
    fit(fsdp(auto_wrap_min_params=100), model, max_epochs=2)  # small: every block and embedding is large enough
    assert_same_weights(reference, model, atol=1e-5)


def test_an_in_process_fit_gives_the_module_back_with_its_parameters_still_tied() -> None:
    model = gpt2(cls=OneGroup, frozen=False)
    fit(FairScaleFSDPStrategy(), model, devices=1, max_epochs=1)
    assert model.model.lm_head.weight is model.model.transformer.wte.weight
    assert isinstance(model.model.lm_head.weight, nn.Parameter)


class WrapsOneUserOfTheTiedWeight(GPT2Recipe):
    def configure_model(self) -> None:
        self.model.transformer.wte = wrap(self.model.transformer.wte)


def test_wrapping_that_splits_tied_parameters_is_refused_naming_them_and_the_fix() -> None:
    pytest.importorskip("transformers")
    pl.seed_everything(1, verbose=False)
    with pytest.raises(Exception, match=r"'model.lm_head.weight' and 'model.transformer.wte.weight'.*holds every user"):
        fit(fsdp(), WrapsOneUserOfTheTiedWeight(), max_epochs=1)


# ---------------------------------------------------------------------------------------------- item: frozen weights


@pytest.mark.parametrize("frozen_in_optimizer", [True, False], ids=["in-optimizer", "filtered-out"])
@pytest.mark.parametrize(
    "strategy",
    [
        "ddp_sharded_fork",
        "fsdp_fairscale_fork",
        pytest.param({"flatten_parameters": False}, id="fsdp_fairscale-unflattened"),
        "fsdp2_fork",
    ],
)
def test_frozen_parameters_train_like_upstream_ddp_and_keep_their_values(
    strategy: Any, frozen_in_optimizer: bool
) -> None:
    chosen = fsdp(**strategy) if isinstance(strategy, dict) else strategy
    model = _trained_like_ddp(chosen, frozen_in_optimizer=frozen_in_optimizer)
    assert torch.equal(model.model.transformer.wpe.weight, gpt2().model.transformer.wpe.weight)


@pytest.mark.parametrize("flatten_parameters", [True, False], ids=["flattened", "unflattened"])
def test_frozen_parameters_save_and_resume_exactly(tmp_path: Path, flatten_parameters: bool) -> None:
    saved = _save_after_one_epoch(fsdp(flatten_parameters=flatten_parameters), tmp_path / "saved")
    restored = tmp_path / "restored.ckpt"
    strategy = fsdp(flatten_parameters=flatten_parameters)
    fit(strategy, gpt2(seed=11), ckpt_path=saved, callbacks=[SaveAfterRestore(restored)], max_epochs=2)
    before, after = torch.load(saved, weights_only=True), torch.load(restored, weights_only=True)
    _assert_same_checkpoint_state(before, after)
    assert torch.equal(after["state_dict"]["model.transformer.wpe.weight"], gpt2().model.transformer.wpe.weight)


# ---------------------------------------------------------------------------------------------- item: reading in hooks


class LargeHead(ConformanceModel):
    """A 1024x1024 layer whose weight a hook reads after every step."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.encoder = nn.Linear(8, 1024)
        self.head = nn.Linear(1024, 4)
        self.middle = nn.Linear(1024, 1024)

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.head(torch.tanh(self.middle(torch.tanh(self.encoder(inputs))))) * self.output_scale
        return output


class NormReader(pl.Callback):
    """Writes ``middle.weight.norm()`` after every training batch to ``<dir>/norms-rank<r>.json``."""

    def __init__(self, directory: Path, inside_full_parameters: bool) -> None:
        self.directory = directory
        self.inside_full_parameters = inside_full_parameters
        self.norms: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        full = getattr(trainer.strategy, "full_parameters", nullcontext)
        with full() if self.inside_full_parameters else nullcontext():
            self.norms.append(float(module.middle.weight.norm()))

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        (self.directory / f"norms-rank{trainer.global_rank}.json").write_text(json.dumps(self.norms))


def _norms(strategy: Any, directory: Path, inside_full_parameters: bool) -> list[float]:
    directory.mkdir()
    fit(strategy, new_model(cls=LargeHead), callbacks=[NormReader(directory, inside_full_parameters)], max_epochs=1)
    norms: list[float] = json.loads((directory / "norms-rank0.json").read_text())
    return norms


def test_reading_a_flattened_parameter_between_steps_raises_an_error_naming_full_parameters(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"'middle.weight' holds no value here.*trainer.strategy.full_parameters\(\)"):
        _norms("fsdp_fairscale_fork", tmp_path / "norms", inside_full_parameters=False)


@pytest.mark.parametrize(
    "strategy", [*STRATEGIES, pytest.param({"flatten_parameters": False}, id="fsdp_fairscale-unflattened")]
)
def test_inside_full_parameters_a_hook_reads_the_values_ddp_reads(tmp_path: Path, strategy: Any) -> None:
    expected = _norms("ddp_fork", tmp_path / "ddp", inside_full_parameters=False)
    chosen = fsdp(**strategy) if isinstance(strategy, dict) else strategy
    got = _norms(chosen, tmp_path / "full", inside_full_parameters=True)
    assert got == pytest.approx(expected, abs=1e-5)


def test_under_ddp_sharded_a_hook_reads_the_values_ddp_reads_without_full_parameters(tmp_path: Path) -> None:
    expected = _norms("ddp_fork", tmp_path / "ddp", inside_full_parameters=False)
    got = _norms("ddp_sharded_fork", tmp_path / "plain", inside_full_parameters=False)
    assert got == pytest.approx(expected, abs=1e-5)


def test_a_consolidated_sharded_checkpoint_holds_the_tied_keys_too(tmp_path: Path) -> None:
    from lightning_strategies.cli.consolidate import consolidate_checkpoint

    sharded = _save_after_one_epoch(fsdp(state_dict_type="sharded"), tmp_path / "sharded")
    full = _save_after_one_epoch("fsdp_fairscale_fork", tmp_path / "full")
    consolidate_checkpoint(sharded, tmp_path / "consolidated.ckpt", show_progress=False)
    consolidated = torch.load(tmp_path / "consolidated.ckpt", weights_only=True)["state_dict"]
    expected = torch.load(full, weights_only=True)["state_dict"]
    assert consolidated.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(consolidated[key], value), key


def test_a_parameter_that_is_not_gathered_still_tells_its_shape_dtype_and_device() -> None:
    from lightning_strategies.fairscale.wrap import NotGatheredParameter, NotGatheredParameterError

    placeholder = NotGatheredParameter.create("head.weight", torch.Size([4, 16]), torch.float32)
    assert (placeholder.shape, placeholder.dtype, placeholder.device.type) == ((4, 16), torch.float32, "meta")
    assert placeholder.dim() == 2 and placeholder.numel() == 64
    with pytest.raises(NotGatheredParameterError, match=r"'head\.weight' holds no value here"):
        placeholder.norm()
    with pytest.raises(NotGatheredParameterError):
        torch.ones(16) @ placeholder.T
