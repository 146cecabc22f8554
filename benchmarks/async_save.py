"""Benchmark 6: how long a save blocks the step loop, synchronous against asynchronous (``async_save=True``), per
strategy and checkpoint format, and the memory the CPU staging copy of an asynchronous save adds."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy, ShardedDDPStrategy
from lightning_strategies.strategies.base import DirectReferenceStrategy

from .config import Config
from .lightning_side import trainer
from .models import BenchModule, lightning_loader, workload
from .remote import remove

#: (strategy, state_dict_type) of each variant; ``ddp_sharded`` writes full files only.
FORMATS: tuple[tuple[str, str], ...] = (
    ("ddp_sharded", "full"),
    ("fsdp_fairscale", "full"),
    ("fsdp_fairscale", "sharded"),
    ("fsdp2", "full"),
    ("fsdp2", "sharded"),
)
#: Variants also measured on the GPT-2 (the overhead benchmark trains it under ``fsdp2`` only).
GPT2_FORMATS: tuple[tuple[str, str], ...] = (("fsdp2", "full"), ("fsdp2", "sharded"))
#: Steps between two saves: enough for the background write of the one before to finish on a busy machine.
STEPS_BETWEEN_SAVES = 12
WARMUP_STEPS = 2


def variant_key(name: str, state_dict_type: str, model: str) -> str:
    """How results name a variant: ``fsdp2/sharded`` (MLP) or ``fsdp2/sharded@gpt2``."""
    return f"{name}/{state_dict_type}" + ("" if model == "mlp" else f"@{model}")


def format_strategy(
    name: str, state_dict_type: str, module: BenchModule, async_save: bool = False
) -> DirectReferenceStrategy:
    """The strategy of a variant: ``name`` with ``state_dict_type`` (``ddp_sharded`` has full files only)."""
    if name == "ddp_sharded":
        return ShardedDDPStrategy(async_save=async_save)
    if name == "fsdp_fairscale":
        return FairScaleFSDPStrategy(state_dict_type=state_dict_type, async_save=async_save)  # type: ignore[arg-type]
    return FSDP2Strategy(
        state_dict_type=state_dict_type,  # type: ignore[arg-type]
        shard_module_classes=module.block_classes(),
        async_save=async_save,
    )


def _writing(trainer: pl.Trainer) -> bool:
    saves = getattr(trainer.strategy, "_async_saves", None)
    return saves is not None and saves.writing


class _BlockedTimer(pl.Callback):
    """Saves every ``interval`` steps (``STEPS_BETWEEN_SAVES``) after the warm-up and records how long each save call
    blocked this rank (it includes waiting for and committing the save before it), and the staging copy's size.

    Also times every step after the warm-up (``on_train_batch_start`` to ``on_train_batch_end``, before the save there)
    with whether this rank's background write ran at the step's start and at its end — the steps a write runs
    alongside (two ranks on two cores: the write's thread competes for a core and for the GIL) — and whether the step
    before it saved (the same steps in the synchronous fit: a control for what follows a save anyway).
    """

    def __init__(self, path: Path | str, interval: int = STEPS_BETWEEN_SAVES) -> None:
        self.path = path
        self.interval = interval
        self.blocked: list[float] = []
        self.waited: list[float] = []  # of which: waiting for the save before (write, agreement, commit)
        self.started: list[float] = []  # of which: starting this one (staging copy included)
        self.write_cpu: list[float] = []  # CPU seconds of each save's background thread on this rank
        self.staged_bytes = 0
        self.end_of_fit_s = 0.0
        self._end_started = 0.0
        self.step_s: list[float] = []
        self.writing_at: list[tuple[bool, bool]] = []  # per timed step: this rank's write ran at its start, its end
        self.after_save: list[bool] = []  # per timed step: the step before it saved
        self._step_started = 0.0
        self._writing_at_start = False
        self._saved = False

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._writing_at_start = _writing(trainer)
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        step_s = time.perf_counter() - self._step_started
        step = trainer.global_step
        if step > WARMUP_STEPS:
            self.step_s.append(step_s)
            self.writing_at.append((self._writing_at_start, _writing(trainer)))
            self.after_save.append(self._saved)
        self._saved = False
        if step <= WARMUP_STEPS or (step - WARMUP_STEPS) % self.interval:
            return
        self._saved = True
        start = time.perf_counter()
        trainer.save_checkpoint(self.path)
        self.blocked.append(time.perf_counter() - start)
        saves = getattr(trainer.strategy, "_async_saves", None)
        if saves is not None and saves.pending:
            self.staged_bytes = saves.last_staged_bytes
            self.waited.append(saves.last_wait_s)
            self.started.append(saves.last_start_s)
            if len(self.started) > 1:  # this save finished the one before: its thread's CPU time is known
                self.write_cpu.append(saves.last_write_cpu_s)

    def on_train_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._end_started = time.perf_counter()  # the strategy's on_train_end (the last commit) runs after this

    def on_fit_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.end_of_fit_s = time.perf_counter() - self._end_started
        saves = getattr(trainer.strategy, "_async_saves", None)
        if saves is not None and self.started:  # the last save, finished at the end of training
            self.write_cpu.append(saves.last_write_cpu_s)


def measure(
    config: Config,
    name: str,
    state_dict_type: str,
    model: str,
    saves: int,
    workdir: Path,
    store_url: str | None = None,
    interval: int = STEPS_BETWEEN_SAVES,
) -> dict[str, Any]:
    """One fit with ``saves`` synchronous saves and one with as many asynchronous ones, ``interval`` steps apart;
    per-rank blocked seconds.

    With ``store_url`` the saves go to the store (``<store_url>/async/...``) instead of ``workdir``.
    """
    work = workload(config, model)
    steps = WARMUP_STEPS + saves * interval
    result: dict[str, Any] = {}
    for side, async_save in (("sync", False), ("async", True)):
        filename = f"async-bench-{variant_key(name, state_dict_type, model)}-{side}.ckpt"
        filename = filename.replace("/", "-").replace("@", "-")
        path: Path | str
        if store_url is not None:
            path = f"{store_url}/async/{filename}"
        else:
            path = workdir / "checkpoints" / filename
            path.parent.mkdir(parents=True, exist_ok=True)
        remove(path)
        module = work.new_model()
        timer = _BlockedTimer(path, interval)
        data = work.data(work.batch_size * dist.get_world_size() * steps)
        trainer(format_strategy(name, state_dict_type, module, async_save), [timer], max_steps=steps).fit(
            module, train_dataloaders=lightning_loader(data, work.batch_size)
        )
        result[side] = {
            "blocked_s": timer.blocked,
            "waited_s": timer.waited,
            "started_s": timer.started,
            "write_cpu_s": timer.write_cpu,
            "end_of_fit_s": timer.end_of_fit_s,
            "step_s": timer.step_s,
            "writing_at": timer.writing_at,
            "after_save": timer.after_save,
        }
        if async_save:
            result["staged_bytes"] = timer.staged_bytes
        remove(path)
    return result


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Blocked time per save, synchronous and asynchronous, for every format of the configured strategies (and the
    GPT-2 under ``fsdp2``, when the configuration trains it)."""
    saves = config.async_saves
    variants = [(name, kind, "mlp") for name, kind in FORMATS if name in config.strategies]
    if "gpt2" in config.upstream_checkpoint_models:
        variants += [(name, kind, "gpt2") for name, kind in GPT2_FORMATS if name in config.strategies]
    return {
        variant_key(name, kind, model): measure(config, name, kind, model, saves, workdir)
        for name, kind, model in variants
    }
