"""The zoo's LightningModules: real architectures from ``transformers`` config objects, each with its users' recipe.

Every model is tiny (well under 1 M parameters), has dropout 0 (so a resumed run can equal the uninterrupted one
exactly) and trains on deterministic synthetic data. Each step calls the Hugging Face model the way its users do,
``self.model(**batch)``, and logs ``train_loss`` (rank 0's, as users log it) and ``val_loss`` (averaged over ranks).
``transformers`` is imported when a model is built, not when this module is imported.

Every class can be built with no arguments (``lightning-strategies inspect --module tests.zoo.models:GPT2Module``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

BATCH_SIZE = 4
WORLD_SIZE = 2
STEPS_PER_EPOCH = 2
EPOCHS = 2
TRAIN_SAMPLES = BATCH_SIZE * WORLD_SIZE * STEPS_PER_EPOCH
VAL_SAMPLES = BATCH_SIZE * WORLD_SIZE  # one validation batch per rank
TOTAL_STEPS = STEPS_PER_EPOCH * EPOCHS

VOCAB = 256
SEQUENCE = 16
IMAGE = 16
CLASSES = 10


class DictDataset(Dataset[dict[str, Tensor]]):
    """Rows of a dict of equally long tensors; the default collate stacks them back into the dict a model takes."""

    def __init__(self, columns: Mapping[str, Tensor]) -> None:
        self.columns = dict(columns)
        self.length = len(next(iter(self.columns.values())))

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {name: column[index] for name, column in self.columns.items()}


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def causal_lm_data(samples: int, seed: int) -> DictDataset:
    """Token sequences; the labels are the inputs (the model shifts them), as in causal LM fine-tuning."""
    tokens = torch.randint(0, VOCAB, (samples, SEQUENCE), generator=_generator(seed))
    return DictDataset({"input_ids": tokens, "labels": tokens.clone()})


def masked_lm_data(samples: int, seed: int) -> DictDataset:
    """BERT pre-training rows: two segments (``token_type_ids``), padding at the end, 15 % of tokens masked."""
    generator = _generator(seed)
    tokens = torch.randint(5, VOCAB, (samples, SEQUENCE), generator=generator)
    lengths = torch.randint(SEQUENCE // 2, SEQUENCE + 1, (samples,), generator=generator)
    positions = torch.arange(SEQUENCE)
    attention_mask = (positions < lengths[:, None]).long()
    token_type_ids = (positions >= (lengths[:, None] // 2)).long() * attention_mask
    masked = (torch.rand(samples, SEQUENCE, generator=generator) < 0.15) & attention_mask.bool()
    masked[:, 1] = True  # at least one prediction per row
    labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
    input_ids = torch.where(masked, torch.full_like(tokens, 4), tokens)  # 4 plays [MASK]
    input_ids = torch.where(attention_mask.bool(), input_ids, torch.zeros_like(tokens))  # 0 plays [PAD]
    return DictDataset(
        {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids, "labels": labels}
    )


def image_data(samples: int, seed: int) -> DictDataset:
    """Images and class labels; each class shifts the images' mean, so there is something to learn."""
    generator = _generator(seed)
    labels = torch.randint(0, CLASSES, (samples,), generator=generator)
    pixels = torch.randn(samples, 3, IMAGE, IMAGE, generator=generator) + labels[:, None, None, None] / CLASSES
    return DictDataset({"pixel_values": pixels, "labels": labels})


def no_decay_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """The Hugging Face recipe: weight decay on weights only, none on biases and LayerNorm weights."""
    no_decay = ("bias", "LayerNorm.weight", "ln_1.weight", "ln_2.weight", "ln_f.weight")
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if not any(n.endswith(nd) for nd in no_decay)], "weight_decay": weight_decay},
        {"params": [p for n, p in named if any(n.endswith(nd) for nd in no_decay)], "weight_decay": 0.0},
    ]


class ZooModule(pl.LightningModule):
    """What every zoo model shares: ``self.model`` is the Hugging Face model; steps call ``self.model(**batch)``.

    Args:
        data_seed: Seed of the synthetic training data (validation uses ``data_seed + 1``).
    """

    #: The architecture and training recipe in one line, for the docs table.
    recipe = ""

    def __init__(self, data_seed: int = 0) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model = self.build()

    def build(self) -> nn.Module:
        """Builds the Hugging Face model from its config object (nothing is downloaded)."""
        raise NotImplementedError

    def dataset(self, samples: int, seed: int) -> DictDataset:
        """The model's synthetic data."""
        raise NotImplementedError

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss: Tensor = self.model(**batch).loss
        self.log("val_loss", loss, sync_dist=True)
        return loss

    def train_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(self.dataset(TRAIN_SAMPLES, self.hparams["data_seed"]), batch_size=BATCH_SIZE, shuffle=True)

    def val_dataloader(self) -> DataLoader[dict[str, Tensor]]:
        return DataLoader(self.dataset(VAL_SAMPLES, self.hparams["data_seed"] + 1), batch_size=BATCH_SIZE)


class GPT2Module(ZooModule):
    """GPT-2 (tied ``wte``/``lm_head``), AdamW with no-decay groups, linear warmup then decay."""

    recipe = "GPT-2, tied embeddings; AdamW with no-decay groups, linear warmup"

    def build(self) -> nn.Module:
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(
            vocab_size=VOCAB, n_positions=SEQUENCE, n_embd=64, n_layer=2, n_head=2, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        return GPT2LMHeadModel(config)

    def dataset(self, samples: int, seed: int) -> DictDataset:
        return causal_lm_data(samples, seed)

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        optimizer = torch.optim.AdamW(no_decay_groups(self.model, 0.1), lr=3e-3, betas=(0.9, 0.95))
        schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=TOTAL_STEPS + 1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class LlamaModule(ZooModule):
    """Llama (RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head), AdamW and a cosine schedule."""

    recipe = "Llama: RoPE, RMSNorm, SwiGLU, grouped-query attention, untied head; AdamW, cosine schedule"

    def build(self) -> nn.Module:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=SEQUENCE, tie_word_embeddings=False, attention_dropout=0.0,
        )  # fmt: skip
        return LlamaForCausalLM(config)

    def dataset(self, samples: int, seed: int) -> DictDataset:
        return causal_lm_data(samples, seed)

    def configure_optimizers(self) -> Any:
        from transformers import get_cosine_schedule_with_warmup

        optimizer = torch.optim.AdamW(self.parameters(), lr=2e-3, weight_decay=0.1, betas=(0.9, 0.95))
        schedule = get_cosine_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=TOTAL_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class BertModule(ZooModule):
    """BERT masked LM (decoder tied to the word embeddings, non-persistent ``position_ids``/``token_type_ids``
    buffers, two segments), AdamW with no-decay groups and linear warmup: the ``run_mlm`` recipe."""

    recipe = "BERT masked LM, tied decoder, non-persistent buffers, token_type_ids; AdamW with no-decay groups, warmup"

    def build(self) -> nn.Module:
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
            max_position_embeddings=SEQUENCE, type_vocab_size=2, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return BertForMaskedLM(config)

    def dataset(self, samples: int, seed: int) -> DictDataset:
        return masked_lm_data(samples, seed)

    def configure_optimizers(self) -> Any:
        from transformers import get_linear_schedule_with_warmup

        optimizer = torch.optim.AdamW(no_decay_groups(self.model, 0.01), lr=2e-3)
        schedule = get_linear_schedule_with_warmup(optimizer, num_warmup_steps=1, num_training_steps=TOTAL_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ViTModule(ZooModule):
    """ViT image classification, AdamW and torch's cosine annealing per step."""

    recipe = "ViT classifier; AdamW, cosine annealing"

    def build(self) -> nn.Module:
        from transformers import ViTConfig, ViTForImageClassification

        config = ViTConfig(
            image_size=IMAGE, patch_size=4, num_channels=3, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=128, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
        )  # fmt: skip
        return ViTForImageClassification(config)

    def dataset(self, samples: int, seed: int) -> DictDataset:
        return image_data(samples, seed)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.05)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=TOTAL_STEPS)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class ResNetModule(ZooModule):
    """ResNet (BatchNorm running statistics), SGD with Nesterov momentum and weight decay, MultiStepLR per epoch."""

    recipe = "ResNet with BatchNorm; SGD with Nesterov momentum, MultiStepLR"

    def build(self) -> nn.Module:
        from transformers import ResNetConfig, ResNetForImageClassification

        config = ResNetConfig(
            num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
            num_labels=CLASSES, downsample_in_first_stage=False,
        )  # fmt: skip
        return ResNetForImageClassification(config)

    def dataset(self, samples: int, seed: int) -> DictDataset:
        return image_data(samples, seed)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
        schedule = torch.optim.lr_scheduler.MultiStepLR(optimizer, milestones=[1], gamma=0.1)
        return [optimizer], [schedule]


def _block(module_path: str, name: str) -> Callable[[], type[nn.Module]]:
    def load() -> type[nn.Module]:
        import importlib

        block: type[nn.Module] = getattr(importlib.import_module(module_path), name)
        return block

    return load


@dataclass(frozen=True)
class ZooModel:
    """One row group of the zoo: a module class, the precision it trains in, and what the checks need to know.

    Attributes:
        name: Shown in test ids, failure messages and the docs table (e.g. ``"resnet bf16"``).
        module: The LightningModule class (built with no arguments).
        precision: The Trainer's ``precision``.
        block: The transformer/residual block class, for per-block sharding.
        tied: Pairs of checkpoint keys that are one tensor in the model.
        loss_rtol: Relative tolerance of logged losses against the uninterrupted ``ddp`` run.
        weights_atol: Absolute tolerance of final weights against the uninterrupted ``ddp`` run.
    """

    name: str
    module: type[ZooModule]
    precision: str = "32-true"
    block: Callable[[], type[nn.Module]] | None = None
    tied: tuple[tuple[str, str], ...] = ()
    loss_rtol: float = 1e-5
    weights_atol: float = 1e-5

    @property
    def id(self) -> str:
        """The name without spaces, for test ids and directories."""
        return self.name.replace(" ", "-")


ZOO: tuple[ZooModel, ...] = (
    ZooModel(
        "gpt2",
        GPT2Module,
        block=_block("transformers.models.gpt2.modeling_gpt2", "GPT2Block"),
        tied=(("model.lm_head.weight", "model.transformer.wte.weight"),),
    ),
    ZooModel("llama", LlamaModule, block=_block("transformers.models.llama.modeling_llama", "LlamaDecoderLayer")),
    ZooModel(
        "bert",
        BertModule,
        block=_block("transformers.models.bert.modeling_bert", "BertLayer"),
        tied=(
            ("model.cls.predictions.decoder.weight", "model.bert.embeddings.word_embeddings.weight"),
            ("model.cls.predictions.decoder.bias", "model.cls.predictions.bias"),
        ),
    ),
    ZooModel("vit", ViTModule, block=_block("transformers.models.vit.modeling_vit", "ViTLayer")),
    ZooModel("resnet", ResNetModule, block=_block("transformers.models.resnet.modeling_resnet", "ResNetBasicLayer")),
    ZooModel(
        "resnet bf16",
        ResNetModule,
        precision="bf16-mixed",
        block=_block("transformers.models.resnet.modeling_resnet", "ResNetBasicLayer"),
        loss_rtol=1e-2,
        weights_atol=1e-2,
    ),
)


def parameter_count(model: ZooModel) -> int:
    """Number of distinct parameters of the model (tied ones once)."""
    return sum(p.numel() for p in model.module().parameters())


def relative_difference(left: float, right: float) -> float:
    """``|left - right| / max(|right|, 1e-12)``; infinite when either is not finite."""
    if not (math.isfinite(left) and math.isfinite(right)):
        return math.inf
    return abs(left - right) / max(abs(right), 1e-12)
