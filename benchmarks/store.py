"""Benchmark ``store`` (``python -m benchmarks --store s3``): checkpoints on an S3 store against plain s3fs transfers
of the same bytes, in the same fit and the same run.

Per strategy and checkpoint format (upstream ``ddp``'s full file as a reference):

- *save*: ``trainer.save_checkpoint("s3://...")`` against uploading the bytes a local save of the same state wrote
  (``fs.put_file`` from the local file, and ``fs.pipe`` of the bytes already in memory), each rank sending the files
  it wrote (a full file: rank 0; a sharded directory: each rank its own shard files, rank 0 the rest), and the local
  save itself; the peak RSS each rank adds (the remote full save on rank 0 against the file's size);
- *resume*: ``fit(ckpt_path="s3://...")`` to the first step against a fresh fit and a resume from the local copy, and
  against downloading what a resume at the same world size reads (``fs.cat_file``: every rank the whole full file; of
  a sharded directory each rank its own shard files and the others), and, for a sharded directory, every file on
  every rank (informational);
- *async*: the asynchronous save benchmark (``benchmarks.async_save``) with the saves on the store.

A save or resume the package refuses (a sharded save to a URL before the store supports it) is recorded with its
error ("not supported: ...") and the run goes on.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch.distributed as dist
from pytorch_lightning.strategies import Strategy

from . import async_save
from .config import Config
from .lightning_side import trainer
from .measure import barrier, timed, timed_with_peak
from .models import BenchModule, lightning_loader, workload
from .remote import filesystem, remove
from .resume import first_step
from .save import SAVE_STEPS, bytes_on_disk

#: Upstream ``ddp``'s full file (Lightning's ``TorchCheckpointIO`` through fsspec), then every format of ours.
VARIANTS: tuple[tuple[str, str], ...] = (("ddp", "full"), *async_save.FORMATS)
#: The sides of a save: ours to the store, ours to a local file, and the plain uploads of the local file's bytes.
SAVE_SIDES = ("remote", "local", "put_file", "pipe")
#: The sides of a resume: a fresh fit, resumed from the store, resumed from the local copy, the plain download of what
#: a resume at the same world size needs, and (sharded directories) of every file by every rank.
RESUME_SIDES = ("fresh", "remote", "local", "download", "download_all")
#: A rank's own file of a sharded directory: torch DCP's ``__<rank>_0.distcp``, fairscale's ``rank<rank>.pt``.
_SHARD_FILE = re.compile(r"^(?:__(\d+)_\d+\.distcp|rank(\d+)\.pt)$")


def _owner(name: str) -> int | None:
    """The rank whose shard file ``name`` is, or ``None`` for a file every rank reads (metadata, commit marker)."""
    match = _SHARD_FILE.match(name)
    return None if match is None else int(match.group(1) or match.group(2))


#: Steps between two asynchronous saves on the store: an upload of the MLP's 50 MB took 0.3 s alone and up to 0.8 s
#: beside training (the server's own CPU time, 0.375 s per upload, competes for the same 2 cores), longer than the
#: local benchmark's 12 steps, whose saves then mostly waited for the upload before (the blocked time measured the
#: queue, not the save).
STORE_STEPS_BETWEEN_SAVES = 24
#: The same in a smoke run (tiny checkpoints; it checks that everything runs).
SMOKE_STEPS_BETWEEN_SAVES = 2


def variant_key(name: str, state_dict_type: str) -> str:
    """How results name a variant: ``fsdp2/sharded``."""
    return f"{name}/{state_dict_type}"


def build_strategy(name: str, state_dict_type: str, module: BenchModule) -> str | Strategy:
    """The strategy of a variant (``ddp`` by its registered name)."""
    return "ddp" if name == "ddp" else async_save.format_strategy(name, state_dict_type, module)


def _error(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".splitlines()[0][:300]


def agreed_error(error: str | None) -> str | None:
    """The first rank's error of an action every rank ran (``None`` when every rank succeeded)."""
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    return next((found for found in errors if found is not None), None)


def own_files(local: Path, rank: int) -> list[tuple[Path, str]]:
    """The files of a local checkpoint that ``rank`` wrote, with their path inside it: a full file is rank 0's; in a
    sharded directory a ``__<rank>_*`` file is that rank's and every other file rank 0's."""
    if local.is_file():
        return [(local, "")] if rank == 0 else []
    files = sorted(path for path in local.rglob("*") if path.is_file())
    return [(path, path.relative_to(local).as_posix()) for path in files if (_owner(path.name) or 0) == rank]


def _join(target: str, relative: str) -> str:
    return f"{target}/{relative}" if relative else target


class _StoreSaves(pl.Callback):
    """At the end of the epoch: one unmeasured local and remote save each, then ``repeats`` rounds of the save sides in
    an order that rotates each round, each timed between barriers with the peak RSS it adds; a last remote save is
    kept for the resumes."""

    def __init__(self, local: Path, url: str, repeats: int) -> None:
        self.local, self.url, self.repeats = local, url, repeats
        self.samples: dict[str, list[dict[str, float]]] = {side: [] for side in SAVE_SIDES}
        self.error: str | None = None
        self.checkpoint_bytes = 0

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        rank = dist.get_rank()
        remove(self.local)
        trainer.save_checkpoint(self.local)
        barrier()
        self.checkpoint_bytes = bytes_on_disk(self.local)
        files = own_files(self.local, rank)
        fs = filesystem(self.url)
        self.error = self._remote_save(trainer, f"{self.url}/warm.ckpt")
        remove(f"{self.url}/warm.ckpt")
        for repeat in range(self.repeats):
            shift = repeat % len(SAVE_SIDES)
            for side in SAVE_SIDES[shift:] + SAVE_SIDES[:shift]:
                if side == "remote" and self.error is not None:
                    continue
                target: str | Path = f"{self.url}/{side}-{repeat}.ckpt"
                action: Callable[[], Any]
                if side == "remote":
                    action = lambda target=target: trainer.save_checkpoint(target)  # noqa: E731
                elif side == "local":
                    target = self.local.with_name(f"{self.local.name}-{repeat}")
                    action = lambda target=target: trainer.save_checkpoint(target)  # noqa: E731
                elif side == "put_file":
                    action = lambda target=target: [fs.put_file(str(p), _join(str(target), r)) for p, r in files]  # noqa: E731
                else:
                    blobs = {_join(str(target), relative): path.read_bytes() for path, relative in files}
                    action = lambda blobs=blobs: fs.pipe(blobs) if blobs else None  # noqa: E731
                seconds, added = timed_with_peak(action)
                self.samples[side].append({"seconds": seconds, "rss_added_bytes": float(added)})
                blobs = {}
                remove(target)
        if self.error is None:
            self.error = self._remote_save(trainer, f"{self.url}/resume.ckpt")

    def _remote_save(self, trainer: pl.Trainer, url: str) -> str | None:
        try:
            trainer.save_checkpoint(url)
            error = None
        except Exception as raised:  # a format the store does not take yet is refused on every rank
            error = _error(raised)
        return agreed_error(error)


def _download_sources(url: str, rank: int) -> tuple[list[str], list[str]]:
    """What a rank downloads for the plain sides of a resume: the whole full file (both sides); of a sharded
    directory its own shard files and every file that is no shard file (the metadata every rank reads, the commit
    marker), and every file."""
    fs = filesystem(url)
    fs.invalidate_cache()
    if fs.isfile(url):
        return [url], []
    every = sorted(fs.find(url))
    return [found for found in every if _owner(found.rsplit("/", 1)[-1]) in (None, rank)], every


def _download(url: str, sources: list[str]) -> None:
    fs = filesystem(url)
    blobs = [fs.cat_file(source) for source in sources]
    del blobs


def measure_variant(config: Config, name: str, kind: str, workdir: Path) -> dict[str, Any]:
    """The save and resume sides of one variant (its async fits are measured in :func:`run`)."""
    key = variant_key(name, kind)
    url = f"{config.store_url}/{key.replace('/', '-')}"
    local = workdir / "checkpoints" / f"store-{key.replace('/', '-')}.ckpt"
    local.parent.mkdir(parents=True, exist_ok=True)
    work = workload(config)
    data = work.data(work.batch_size * dist.get_world_size() * SAVE_STEPS)
    saver = _StoreSaves(local, url, config.store_repeats)
    module = work.new_model()
    trainer(build_strategy(name, kind, module), [saver], max_epochs=1).fit(
        module, train_dataloaders=lightning_loader(data, work.batch_size)
    )
    result: dict[str, Any] = {"save": saver.samples, "checkpoint_bytes": saver.checkpoint_bytes, "error": saver.error}
    resume: dict[str, list[float]] = {side: [] for side in RESUME_SIDES}
    remote = f"{url}/resume.ckpt"
    error = saver.error
    sources, every = _download_sources(remote, dist.get_rank()) if error is None else ([], [])

    def build(module: BenchModule) -> str | Strategy:
        return build_strategy(name, kind, module)

    for repeat in range(config.store_repeats):
        shift = repeat % len(RESUME_SIDES)
        for side in RESUME_SIDES[shift:] + RESUME_SIDES[:shift]:
            if side in ("remote", "download", "download_all") and error is not None:
                continue
            if side == "download_all" and not agreed_error("directory" if every else None):
                continue  # a full file: every rank downloads all of it on the download side already
            if side.startswith("download"):
                chosen = sources if side == "download" else every
                resume[side].append(timed(lambda chosen=chosen: _download(remote, chosen)))
                continue
            checkpoint = {"fresh": None, "remote": remote, "local": local}[side]
            try:
                resume[side].append(first_step(config, name, checkpoint, build=build)[0])
            except Exception as raised:  # a resume from the store the package does not do yet
                if side != "remote":
                    raise
                error = agreed_error(_error(raised))
    result["resume"] = resume
    result["resume_error"] = error
    remove(url)
    remove(local)
    return result


def run(config: Config, workdir: Path) -> dict[str, Any]:
    """Save, resume and asynchronous saves on the store for every variant of the configured strategies."""
    if config.store_url is None:
        raise ValueError("The store benchmark needs a store: python -m benchmarks --store s3")
    results: dict[str, Any] = {}
    # Upstream ddp is the reference of a measured run; a smoke run checks the package's own paths only.
    reference = () if config.smoke else ("ddp",)
    variants = [(name, kind) for name, kind in VARIANTS if name in (*reference, *config.strategies)]
    for name, kind in variants:
        results[variant_key(name, kind)] = measure_variant(config, name, kind, workdir)
    for name, kind in variants:
        if name == "ddp":
            continue  # upstream's ddp saves synchronously only
        row = results[variant_key(name, kind)]
        if row["error"] is not None:
            row["async"] = {"error": row["error"]}
            continue
        url = f"{config.store_url}/{variant_key(name, kind).replace('/', '-')}"
        try:
            row["async"] = async_save.measure(
                config,
                name,
                kind,
                "mlp",
                config.store_saves,
                workdir,
                store_url=url,
                interval=SMOKE_STEPS_BETWEEN_SAVES if config.smoke else STORE_STEPS_BETWEEN_SAVES,
            )
        except Exception as raised:
            row["async"] = {"error": agreed_error(_error(raised))}
        remove(url)
    return results
