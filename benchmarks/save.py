"""Benchmark 2: ``trainer.save_checkpoint`` against the wrapper's own gather + ``torch.save``, time and peak RSS;
and ``fsdp2`` against upstream's ``ModelParallelStrategy`` and ``FSDPStrategy``, a full checkpoint and a sharded one
each."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from . import by_hand
from .config import UPSTREAM_PAIRS, UPSTREAM_PEER, Config, shards_itself, upstream_results_key
from .lightning_side import strategy_for, trainer, wrapped_by_strategy
from .measure import barrier, timed_with_peak
from .models import dataset, lightning_loader, new_model, workload

SAVE_STEPS = 2  # steps before saving, so the optimizer holds state
#: The strategy's save; the wrapper's API + torch.save (the goal's baseline); the same written atomically + fsync.
SIDES = ("ours", "hand", "hand_atomic")


def checkpoint_paths(workdir: Path, strategy: str) -> tuple[Path, Path]:
    """Where the strategy's checkpoint and the hand-written one are saved (shared by both ranks)."""
    directory = workdir / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"{strategy}-ours.ckpt", directory / f"{strategy}-hand.ckpt"


class _SaveBoth(pl.Callback):
    """At the end of the epoch saves ``repeats`` times each way, alternating which goes first."""

    def __init__(self, strategy: str, paths: tuple[Path, Path], repeats: int) -> None:
        self.strategy = strategy
        self.paths = paths
        self.repeats = repeats
        self.results: dict[str, list[dict[str, float]]] = {side: [] for side in SIDES}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        ours, hand = self.paths
        atomic = hand.with_name(hand.name + ".atomic")
        wrapped = wrapped_by_strategy(self.strategy, trainer)
        actions = {
            "ours": lambda: trainer.save_checkpoint(ours),
            "hand": lambda: by_hand.save(wrapped, hand),
            "hand_atomic": lambda: by_hand.save(wrapped, atomic, atomic=True),
        }
        for repeat in range(self.repeats):
            shift = repeat % len(SIDES)
            for side in SIDES[shift:] + SIDES[:shift]:
                seconds, added = timed_with_peak(actions[side])
                self.results[side].append({"seconds": seconds, "rss_added_bytes": float(added)})


def save_checkpoints(config: Config, strategy: str, workdir: Path, repeats: int) -> dict[str, Any]:
    """Trains ``SAVE_STEPS`` steps with ``strategy`` and saves both ways ``repeats`` times at the end of the epoch."""
    paths = checkpoint_paths(workdir, strategy)
    data = dataset(config.width, config.batch_size * dist.get_world_size() * SAVE_STEPS)
    saver = _SaveBoth(strategy, paths, repeats)
    trainer(strategy, [saver], max_epochs=1).fit(
        new_model(config.width, config.depth), train_dataloaders=lightning_loader(data, config.batch_size)
    )
    sizes = {side: path.stat().st_size for side, path in zip(("ours", "hand"), paths, strict=True)}
    sizes["hand_atomic"] = sizes["hand"]
    return {**saver.results, "checkpoint_bytes": sizes}


def upstream_pair_names() -> list[str]:
    """The strategies of :data:`UPSTREAM_PAIRS`, each once, per checkpoint kind ours before upstream's."""
    kinds = dict.fromkeys(kind for pairs in UPSTREAM_PAIRS.values() for kind in pairs)
    names = [name for kind in kinds for pairs in UPSTREAM_PAIRS.values() for name in pairs[kind]]
    return list(dict.fromkeys(names))


def upstream_pair_path(workdir: Path, strategy: str, model: str = "mlp") -> Path:
    """Where ``strategy`` of :data:`UPSTREAM_PAIRS` saves its checkpoint of ``model`` (a file or a directory)."""
    directory = workdir / "checkpoints"
    directory.mkdir(parents=True, exist_ok=True)
    return directory / f"pair-{model}-{strategy}.ckpt"


def bytes_on_disk(path: Path) -> int:
    """Size of a checkpoint file, or of every file under a checkpoint directory."""
    if path.is_dir():
        return sum(file.stat().st_size for file in path.rglob("*") if file.is_file())
    return path.stat().st_size


def _remove(path: Path) -> None:
    """Rank 0 removes an earlier checkpoint at ``path``, so every save writes a new one; all ranks wait."""
    if dist.get_rank() == 0:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    barrier()


class _SaveOnce(pl.Callback):
    """At the end of the epoch saves once with ``trainer.save_checkpoint``, timed, with the peak RSS it adds."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sample: dict[str, float] = {}

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        seconds, added = timed_with_peak(lambda: trainer.save_checkpoint(self.path))
        self.sample = {"seconds": seconds, "rss_added_bytes": float(added)}


def save_once(config: Config, strategy: str, path: Path, model: str = "mlp") -> dict[str, float]:
    """Trains ``SAVE_STEPS`` steps of ``model`` with ``strategy`` (a name of :data:`UPSTREAM_PAIRS`) and saves once."""
    work = workload(config, model)
    data = work.data(work.batch_size * dist.get_world_size() * SAVE_STEPS)
    model = work.new_model(shards_itself=shards_itself(strategy))
    saver = _SaveOnce(path)
    _remove(path)
    trainer(strategy_for(strategy, model), [saver], max_epochs=1).fit(
        model, train_dataloaders=lightning_loader(data, work.batch_size)
    )
    return saver.sample


def save_against_upstream(config: Config, workdir: Path, model: str = "mlp") -> dict[str, Any]:
    """After one unmeasured save per strategy, one fit of ``model`` and save per strategy of :data:`UPSTREAM_PAIRS` and
    repeat, in an order that rotates each repeat."""
    names = upstream_pair_names()
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    # Not measured: the first DCP save of a model in a process adds about 2 MB of RSS more than the saves after it,
    # whichever strategy makes it, and would be charged to whichever side the rotation puts first.
    for name in names:
        save_once(config, name, upstream_pair_path(workdir, name, model), model)
    for repeat in range(config.repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            samples[name].append(save_once(config, name, upstream_pair_path(workdir, name, model), model))
    sizes = {name: bytes_on_disk(upstream_pair_path(workdir, name, model)) for name in names}
    return {"samples": samples, "checkpoint_bytes": sizes}


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Save timings and peak RSS per strategy (and, when ``fsdp2`` is compared, every strategy of
    :data:`UPSTREAM_PAIRS` on each model of ``config.upstream_checkpoint_models``, see :func:`upstream_results_key`)."""
    results = {strategy: save_checkpoints(config, strategy, workdir, config.repeats) for strategy in config.strategies}
    if UPSTREAM_PEER in config.strategies:
        for model in config.upstream_checkpoint_models:
            results[upstream_results_key(model)] = save_against_upstream(config, workdir, model)
    return results
