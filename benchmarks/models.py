"""The benchmark models and data, the same for Lightning runs and hand-written loops.

``mlp`` is a plain MLP (every benchmark); ``gpt2`` is a GPT-2 language model built from ``transformers.GPT2Config``
(nothing is downloaded), sharded per transformer block (the overhead benchmark). Both take ``(x, y)`` batches of
tensors, so the loaders and the hand-written step are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import pytorch_lightning as pl
import torch
from pytorch_lightning.strategies import FSDPStrategy, ModelParallelStrategy
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel, fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from .config import MODELS, Config

LEARNING_RATE = 1e-3


class BenchModule(pl.LightningModule):
    """What every benchmark model shares: ``(x, y)`` batches, ``loss(self(x), y)``, one optimizer.

    Attributes:
        optimizer_class: The optimizer, built with ``lr=LEARNING_RATE`` by Lightning and by the hand-written loops.
    """

    optimizer_class: ClassVar[type[torch.optim.Adam]] = torch.optim.Adam  # AdamW is an Adam subclass

    def block_classes(self) -> tuple[type[nn.Module], ...]:
        """Submodule classes that get their own ``fully_shard`` before the root (none: only the root is sharded)."""
        return ()

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The training loss of a forward's output."""
        raise NotImplementedError

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return self.loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return self.optimizer_class(self.parameters(), lr=LEARNING_RATE)


class BenchModel(BenchModule):
    """``depth`` square linear layers with ReLU between them, trained with MSE and Adam.

    Args:
        width: Features in and out of every layer.
        depth: Number of linear layers (parameter tensors: ``2 * depth``).
    """

    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for index in range(depth):
            layers.append(nn.Linear(width, width))
            if index < depth - 1:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.layers(x)  # type: ignore[no-any-return]

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return loss_of(output, target)


def loss_of(output: Tensor, target: Tensor) -> Tensor:
    """The training loss, shared by Lightning's ``training_step`` and the hand-written loops."""
    return nn.functional.mse_loss(output, target)


def new_model(width: int, depth: int, seed: int = 7) -> BenchModel:
    """A model with the same initial weights on every rank and in every variant."""
    torch.manual_seed(seed)
    return BenchModel(width, depth)


def parameter_count(width: int, depth: int) -> int:
    """Parameters of ``BenchModel(width, depth)``."""
    return depth * (width * width + width)


def depth_for(params: int, width: int) -> int:
    """The depth whose model has about ``params`` parameters at ``width``."""
    return max(1, round(params / parameter_count(width, 1)))


def dataset(width: int, samples: int, seed: int = 11) -> TensorDataset:
    """Random inputs and targets, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, width, generator=generator), torch.randn(samples, width, generator=generator)
    )


def lightning_loader(data: TensorDataset, batch_size: int) -> DataLoader[Any]:
    """What a user passes to ``Trainer.fit``; Lightning adds the ``DistributedSampler``."""
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def hand_loader(data: TensorDataset, batch_size: int, rank: int, world_size: int) -> DataLoader[Any]:
    """The loader Lightning builds from :func:`lightning_loader`, written by hand."""
    sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


class GPT2BenchModel(BenchModule):
    """A GPT-2 language model (tied ``wte``/``lm_head``, no dropout) trained with AdamW on next-token prediction.

    ``transformers`` is imported here, so runs of the MLP alone never import it.

    Args:
        vocab: Vocabulary size.
        width: Embedding width (``n_embd``).
        layers: Transformer blocks (``n_layer``), each sharded on its own.
        heads: Attention heads (``n_head``).
        sequence: Tokens per sample (``n_positions``).
    """

    optimizer_class = torch.optim.AdamW

    def __init__(self, vocab: int, width: int, layers: int, heads: int, sequence: int) -> None:
        from transformers import GPT2Config, GPT2LMHeadModel

        super().__init__()
        config = GPT2Config(  # type: ignore[no-untyped-call]
            vocab_size=vocab, n_positions=sequence, n_embd=width, n_layer=layers, n_head=heads, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0,
        )  # fmt: skip
        self.model = GPT2LMHeadModel(config)  # type: ignore[no-untyped-call]

    def block_classes(self) -> tuple[type[nn.Module], ...]:
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        return (GPT2Block,)

    def forward(self, x: Tensor) -> Tensor:
        logits: Tensor = self.model(input_ids=x).logits
        return logits

    def loss(self, output: Tensor, target: Tensor) -> Tensor:
        return nn.functional.cross_entropy(output.flatten(0, 1), target.flatten())


def shard_like_fsdp2(module: BenchModule, mesh: DeviceMesh) -> None:
    """``fully_shard`` where ``FSDP2Strategy`` puts it: each block of ``module.block_classes()`` (children first),
    then the root, all with ``fully_shard``'s defaults (what the strategy passes unless told otherwise).

    Does nothing to a module that is already sharded (a second fit of the same module).
    """
    if isinstance(module, FSDPModule):
        return
    blocks = module.block_classes()
    for submodule in reversed(list(module.modules())[1:]):
        if blocks and isinstance(submodule, blocks) and not isinstance(submodule, FSDPModule):
            fully_shard(submodule, mesh=mesh)
    fully_shard(module, mesh=mesh)


def wrap_like_fsdp2_with_fsdp1(module: BenchModule) -> None:
    """FSDP1 units where ``FSDP2Strategy`` puts ``fully_shard``, as a user of upstream's ``FSDPStrategy`` on the CPU
    wraps them in ``configure_model``: each block of ``module.block_classes()`` (children first), then each child of
    the LightningModule that holds parameters (the whole model: the MLP's ``layers``, the GPT-2's ``model``), all with
    ``device_id=torch.device("cpu")`` and ``use_orig_params=True`` (see ``tests/support/upstream_runs.py``: upstream
    passes the device index, ``None`` on the CPU, which FSDP1 refuses) and FSDP1's defaults otherwise.

    Does nothing to a module that is already wrapped (a second fit of the same module).
    """
    if any(isinstance(submodule, FullyShardedDataParallel) for submodule in module.modules()):
        return
    cpu = torch.device("cpu")
    blocks = module.block_classes()
    for parent in reversed(list(module.modules())):
        for name, child in parent.named_children():
            if blocks and isinstance(child, blocks):
                setattr(parent, name, FullyShardedDataParallel(child, device_id=cpu, use_orig_params=True))
    for name, child in module.named_children():
        if any(True for _ in child.parameters()):
            setattr(module, name, FullyShardedDataParallel(child, device_id=cpu, use_orig_params=True))


def _shard_under_upstream(module: BenchModule) -> None:
    strategy = module.trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        shard_like_fsdp2(module, strategy.device_mesh["data_parallel"])
    elif isinstance(strategy, FSDPStrategy):
        wrap_like_fsdp2_with_fsdp1(module)


class MLPForUpstream(BenchModel):
    """The MLP, sharding itself in ``configure_model`` as upstream's ``ModelParallelStrategy`` requires and as
    ``FSDPStrategy`` needs on the CPU."""

    def configure_model(self) -> None:
        _shard_under_upstream(self)


class GPT2ForUpstream(GPT2BenchModel):
    """GPT-2, sharding itself in ``configure_model`` as upstream's ``ModelParallelStrategy`` requires and as
    ``FSDPStrategy`` needs on the CPU."""

    def configure_model(self) -> None:
        _shard_under_upstream(self)


def token_dataset(vocab: int, sequence: int, samples: int, seed: int = 11) -> TensorDataset:
    """Random token sequences as ``(inputs, next tokens)``, identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (samples, sequence + 1), generator=generator)
    return TensorDataset(tokens[:, :-1].clone(), tokens[:, 1:].clone())


@dataclass(frozen=True)
class Workload:
    """One model as the benchmarks use it.

    Attributes:
        name: ``mlp`` or ``gpt2``.
        batch_size: Samples per rank and step.
        build: ``build(shards_itself)``: a new model (seeded by :meth:`new_model`); with ``True`` the class that
            shards itself in ``configure_model`` under upstream's ``ModelParallelStrategy`` and ``FSDPStrategy``.
        data: ``data(samples)``: the training data.
    """

    name: str
    batch_size: int
    build: Callable[[bool], BenchModule]
    data: Callable[[int], TensorDataset]

    def new_model(self, seed: int = 7, shards_itself: bool = False) -> BenchModule:
        """A model with the same initial weights on every rank and in every variant."""
        torch.manual_seed(seed)
        return self.build(shards_itself)


def workload(config: Config, name: str = "mlp") -> Workload:
    """The ``mlp`` or ``gpt2`` workload at the sizes of ``config``.

    Raises:
        ValueError: An unknown model name.
    """
    if name == "mlp":
        return Workload(
            name,
            config.batch_size,
            lambda upstream: (MLPForUpstream if upstream else BenchModel)(config.width, config.depth),
            lambda samples: dataset(config.width, samples),
        )
    if name == "gpt2":
        return Workload(
            name,
            config.gpt2_batch_size,
            lambda upstream: (GPT2ForUpstream if upstream else GPT2BenchModel)(
                config.gpt2_vocab, config.gpt2_width, config.gpt2_layers, config.gpt2_heads, config.gpt2_sequence
            ),
            lambda samples: token_dataset(config.gpt2_vocab, config.gpt2_sequence, samples),
        )
    raise ValueError(f"Unknown benchmark model {name!r}; known: {', '.join(MODELS)}.")
