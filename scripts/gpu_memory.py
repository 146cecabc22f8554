"""CUDA memory of one strategy at world size 1: the bytes of parameters, gradients and optimizer state on the GPU,
and how much ``torch.cuda.max_memory_allocated`` rises while ``Trainer.save_checkpoint`` runs.

``python scripts/gpu_memory.py STRATEGY`` prints one JSON object. It trains a stack of wide linear layers (Adam) for
two steps on ``cuda:0`` and measures after the last step, while everything is still on the GPU. One strategy per
process: a process group, CUDA caching allocator statistics and fairscale's patches stay out of the next measurement.
``--rehearse`` runs it on the CPU (counting host bytes, no peak) to check the script itself where no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_strategies  # noqa: F401  (registers the strategy names)


class WideModel(pl.LightningModule):
    """``layers`` linear layers of ``width`` x ``width`` with ReLU between them, trained with Adam."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        for _ in range(layers):
            blocks += [nn.Linear(width, width), nn.ReLU()]
        self.net = nn.Sequential(*blocks[:-1])
        self.width = width

    def forward(self, inputs: Tensor) -> Tensor:
        output: Tensor = self.net(inputs)
        return output

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor:
        inputs, targets = batch
        return nn.functional.mse_loss(self(inputs), targets)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=1e-4)

    def train_dataloader(self) -> DataLoader[Any]:
        generator = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(16, self.width, generator=generator), torch.randn(16, self.width))
        return DataLoader(data, batch_size=8)


def _bytes(tensors: list[Tensor], device_type: str) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's shard on this rank
        if local.device.type == device_type:
            total += local.numel() * local.element_size()
    return total


class MeasureAtTheEnd(pl.Callback):
    """After the last step: bytes of what training keeps on the device, then the peak rise during a save."""

    def __init__(self, path: Path, device_type: str) -> None:
        self.path = path
        self.device_type = device_type
        self.figures: dict[str, Any] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        parameters = list(trainer.strategy.model.parameters())  # what the wrapper trains (flat or sharded)
        gradients = [p.grad for p in parameters if p.grad is not None]
        optimizer = trainer.optimizers[0]
        # fairscale's OSS keeps this rank's state in the optimizer it shards for (its own `state` stays empty).
        held = getattr(optimizer, "optim", optimizer).state.values()
        state = [v for s in held for v in s.values() if torch.is_tensor(v)]
        figures: dict[str, Any] = {
            "parameter_bytes": _bytes(parameters, self.device_type),
            "gradient_bytes": _bytes(gradients, self.device_type),
            "optimizer_state_bytes": _bytes(state, self.device_type),
        }
        figures["training_state_bytes"] = sum(figures.values())
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            figures["peak_while_training_bytes"] = torch.cuda.max_memory_allocated()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            trainer.save_checkpoint(self.path)
            torch.cuda.synchronize()
            figures["allocated_before_save_bytes"] = before
            figures["save_peak_rise_bytes"] = torch.cuda.max_memory_allocated() - before
            figures["allocated_after_save_bytes"] = torch.cuda.memory_allocated()
        else:
            trainer.save_checkpoint(self.path)
        figures["checkpoint_file_bytes"] = self.path.stat().st_size if self.path.exists() else None
        self.figures = figures


def measure(strategy: str, *, width: int, layers: int, rehearse: bool) -> dict[str, Any]:
    """Trains two steps with ``strategy`` on one device and returns the figures (see the module's docstring)."""
    device_type = "cpu" if rehearse else "cuda"
    pl.seed_everything(0, verbose=False)
    model = WideModel(width, layers)
    with tempfile.TemporaryDirectory() as directory:
        recorder = MeasureAtTheEnd(Path(directory) / "memory.ckpt", device_type)
        trainer = pl.Trainer(
            accelerator="cpu" if rehearse else "gpu",
            devices=1,
            strategy=strategy,
            max_epochs=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[recorder],
        )
        trainer.fit(model)
    parameters = sum(p.numel() for p in model.parameters())
    return {
        "strategy": strategy,
        "device": torch.cuda.get_device_name(0) if not rehearse else "cpu (rehearsal)",
        "parameters": parameters,
        "model_bytes_fp32": parameters * 4,
        **recorder.figures,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("strategy")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rehearse", action="store_true", help="on the CPU, to check this script without a GPU")
    args = parser.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    print(json.dumps(measure(args.strategy, width=args.width, layers=args.layers, rehearse=args.rehearse)))


if __name__ == "__main__":
    main()
