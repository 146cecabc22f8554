"""What a benchmark run does: sizes, repeats and the compared strategies."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

#: The strategies of this package that the benchmarks compare with hand-written loops.
STRATEGIES: tuple[str, ...] = ("ddp_sharded", "fsdp_fairscale", "fsdp2")
#: Models the overhead benchmark can train (``benchmarks.models.workload``).
MODELS: tuple[str, ...] = ("mlp", "gpt2")
#: Benchmarks in the order they run.
BENCHMARKS: tuple[str, ...] = ("overhead", "save", "resume", "memory", "scaling", "async_save")
#: The benchmark of checkpoints on a store (``--store s3``): remote saves, resumes and asynchronous saves against
#: plain s3fs transfers of the same bytes, on a SeaweedFS server the run starts (``benchmarks/store.py``).
STORE_BENCHMARK = "store"
#: Stores ``--store`` can start.
STORES: tuple[str, ...] = ("s3",)
#: Seconds each benchmark of a full run may take before the ranks are stopped: about twice what each took on the
#: shared 2-core machine under load (a full run took 622 s without ``async_save``, which alone took 519 s at a load
#: average of 11-12 with 5 saves per fit; it saves 12 times now). A run's limit is the sum over its benchmarks (3000 s
#: for a full run); ``--timeout`` overrides it.
TIME_LIMIT_S: dict[str, float] = {
    "overhead": 400,
    "save": 400,
    "resume": 400,
    "memory": 150,
    "scaling": 250,
    "async_save": 1400,
    STORE_BENCHMARK: 900,
}

#: The strategy of this package that upstream Lightning's ``ModelParallelStrategy`` and ``FSDPStrategy`` are compared
#: with.
UPSTREAM_PEER = "fsdp2"
#: Upstream's ``ModelParallelStrategy`` (data parallel over every rank, distributed checkpoint directory).
MODEL_PARALLEL = "model_parallel"
#: The same, saving one full checkpoint file (``save_distributed_checkpoint=False``).
MODEL_PARALLEL_FULL = "model_parallel_full"
#: Upstream's ``FSDPStrategy`` (torch FSDP1) with the test suite's CPU fixes (``tests.support.upstream_runs``),
#: saving one full checkpoint file (``state_dict_type="full"``, its default).
UPSTREAM_FSDP = "fsdp"
#: The same with ``state_dict_type="sharded"``: a ``torch.distributed.checkpoint`` directory.
UPSTREAM_FSDP_SHARDED = "fsdp_sharded"
#: ``FSDP2Strategy(state_dict_type="sharded")``: a sharded checkpoint directory.
FSDP2_SHARDED = "fsdp2_sharded"
#: ``fsdp2`` resuming its full file read whole, as before the file was mapped: through Lightning's own
#: ``TorchCheckpointIO``, which takes no ``mmap`` (resume benchmark only; it saves nothing of its own).
FSDP2_READ_WHOLE = "fsdp2_read_whole"
#: The upstream strategies ``fsdp2`` is compared with (keyed by a benchmark name of each) and their label in figures.
#: ``FSDPStrategy`` is compared on the model state only (memory, save, resume), not on step time.
UPSTREAM_LABELS: dict[str, str] = {
    MODEL_PARALLEL: "upstream ModelParallelStrategy",
    UPSTREAM_FSDP: "upstream FSDPStrategy",
}
#: Per upstream strategy and checkpoint kind, the strategy of ours and upstream's that save it (save and resume
#: benchmarks): a full file each (``fsdp2``'s default; ``save_distributed_checkpoint=False``; ``FSDPStrategy``'s
#: default) and a sharded directory each (``ModelParallelStrategy``'s default; ``state_dict_type="sharded"``).
UPSTREAM_PAIRS: dict[str, dict[str, tuple[str, str]]] = {
    MODEL_PARALLEL: {"full": (UPSTREAM_PEER, MODEL_PARALLEL_FULL), "sharded": (FSDP2_SHARDED, MODEL_PARALLEL)},
    UPSTREAM_FSDP: {"full": (UPSTREAM_PEER, UPSTREAM_FSDP), "sharded": (FSDP2_SHARDED, UPSTREAM_FSDP_SHARDED)},
}


def upstream_results_key(model: str) -> str:
    """Where a benchmark's results hold the comparison with upstream on ``model`` (the MLP's key predates GPT-2's)."""
    return "vs_upstream" if model == "mlp" else f"vs_upstream_{model}"


def is_model_parallel(strategy: str) -> bool:
    """Whether a benchmark's strategy name is upstream's ``ModelParallelStrategy``."""
    return strategy in (MODEL_PARALLEL, MODEL_PARALLEL_FULL)


def is_upstream_fsdp(strategy: str) -> bool:
    """Whether a benchmark's strategy name is upstream's ``FSDPStrategy``."""
    return strategy in (UPSTREAM_FSDP, UPSTREAM_FSDP_SHARDED)


def shards_itself(strategy: str) -> bool:
    """Whether the model must shard itself in ``configure_model`` under the strategy: upstream's
    ``ModelParallelStrategy``, and ``FSDPStrategy``, whose CPU runs need the model to wrap its layers."""
    return is_model_parallel(strategy) or is_upstream_fsdp(strategy)


@dataclass(frozen=True)
class Config:
    """Sizes and repeats of one run; the same object reaches every rank (as JSON).

    Attributes:
        smoke: A tiny run that only checks that everything works.
        repeats: Repeats of each compared variant (overhead, save, resume); variants alternate within a repeat.
        warmup_steps: Steps of each fit that are not timed.
        timed_steps: Timed steps of each fit in the overhead benchmark.
        width: Width of the benchmark MLP (overhead, save, resume, memory).
        depth: Linear layers of the benchmark MLP.
        batch_size: Samples per rank and step.
        scaling_params: Approximate parameter counts of the scaling benchmark's models.
        scaling_width: Width of the scaling models (depth grows with size, so tensors grow in number and size).
        scaling_repeats: Save/load repeats per model size.
        async_saves: Saves of each fit of the asynchronous save benchmark (12 steps apart): each adds a few steps that
            run beside a background write, and its step-time ratio is a median over those (5 saves gave 5-16 such
            steps, whose median moved by ±0.05 between runs of the same code).
        overhead_models: Models of the overhead benchmark: ``mlp`` (every strategy, hand loops, upstream ``ddp``
            and ``ModelParallelStrategy``) and ``gpt2`` (``fsdp2``, its hand loop and ``ModelParallelStrategy``).
        upstream_checkpoint_models: Models of the save and resume comparisons against upstream's strategies:
            ``mlp`` and ``gpt2``.
        gpt2_vocab: Vocabulary of the overhead benchmark's GPT-2.
        gpt2_width: Embedding width (``n_embd``) of the GPT-2.
        gpt2_layers: Transformer blocks of the GPT-2.
        gpt2_heads: Attention heads of the GPT-2.
        gpt2_sequence: Tokens per GPT-2 sample.
        gpt2_batch_size: GPT-2 samples per rank and step.
        strategies: Strategies of this package to compare.
        benchmarks: Benchmarks to run.
        store_url: Where the store benchmark saves (``s3://<bucket>``, a bucket of the server the run started; its
            credentials reach the ranks as environment variables, never through the configuration).
        store_repeats: Repeats of each side of the store benchmark's saves and resumes (its uploads vary more than
            local writes).
        store_saves: Asynchronous saves of each fit of the store benchmark (``async_saves`` for local files).
    """

    smoke: bool = False
    repeats: int = 5
    warmup_steps: int = 3
    timed_steps: int = 20
    width: int = 1024
    depth: int = 4
    batch_size: int = 64
    scaling_params: tuple[int, ...] = (1_000_000, 10_000_000, 50_000_000, 100_000_000)
    scaling_width: int = 1024
    scaling_repeats: int = 2
    async_saves: int = 12
    overhead_models: tuple[str, ...] = MODELS
    upstream_checkpoint_models: tuple[str, ...] = MODELS
    gpt2_vocab: int = 8192
    gpt2_width: int = 256
    gpt2_layers: int = 6
    gpt2_heads: int = 4
    gpt2_sequence: int = 64
    gpt2_batch_size: int = 4
    strategies: tuple[str, ...] = STRATEGIES
    benchmarks: tuple[str, ...] = BENCHMARKS
    store_url: str | None = None
    store_repeats: int = 7
    store_saves: int = 8

    def to_json(self) -> dict[str, Any]:
        """The configuration as JSON-compatible values."""
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Config:
        """Reads what :meth:`to_json` wrote."""
        tuples = {key: tuple(value) for key, value in data.items() if isinstance(value, list)}
        return cls(**{**data, **tuples})

    def write(self, path: Path) -> None:
        """Writes the configuration to ``path`` for the workers."""
        path.write_text(json.dumps(self.to_json()))

    @classmethod
    def read(cls, path: Path) -> Config:
        """Reads a configuration written by :meth:`write`."""
        return cls.from_json(json.loads(path.read_text()))


FULL = Config()
SMOKE = Config(
    smoke=True,
    repeats=1,
    warmup_steps=1,
    timed_steps=2,
    width=64,
    depth=2,
    batch_size=8,
    scaling_params=(20_000, 40_000, 80_000),
    scaling_width=64,
    scaling_repeats=1,
    async_saves=1,
    store_repeats=1,
    store_saves=1,
    gpt2_vocab=128,
    gpt2_width=32,
    gpt2_layers=2,
    gpt2_heads=2,
    gpt2_sequence=16,
    gpt2_batch_size=4,
)


def config_for(
    smoke: bool,
    benchmarks: tuple[str, ...] | None = None,
    strategies: tuple[str, ...] | None = None,
    overhead_models: tuple[str, ...] | None = None,
) -> Config:
    """The full or smoke configuration, optionally restricted to some benchmarks, strategies and overhead models."""
    config = SMOKE if smoke else FULL
    if benchmarks:
        config = replace(config, benchmarks=benchmarks)
    if strategies:
        config = replace(config, strategies=strategies)
    if overhead_models:
        config = replace(config, overhead_models=overhead_models)
    return config


def time_limit_s(config: Config) -> float:
    """Seconds the ranks of a run of ``config`` may take: the sum of :data:`TIME_LIMIT_S` over its benchmarks."""
    return sum(TIME_LIMIT_S[name] for name in config.benchmarks)
