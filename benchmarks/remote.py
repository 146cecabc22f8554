"""Checkpoint locations on a store (``s3://...``) next to local paths: the fsspec filesystem behind a URL, and
removing an earlier checkpoint wherever it is."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from .measure import barrier


def is_url(target: str | Path) -> bool:
    """Whether ``target`` names a store location (``s3://bucket/key``) rather than a local path."""
    return "://" in str(target)


def filesystem(url: str) -> Any:
    """The fsspec filesystem that Lightning's checkpoint IO uses for ``url`` (``fsspec.core.url_to_fs``; s3fs reads
    the credentials and the endpoint from the ``AWS_*`` environment variables)."""
    import fsspec

    return fsspec.core.url_to_fs(url)[0]


def remove(target: str | Path) -> None:
    """Rank 0 removes an earlier checkpoint at ``target`` (a file or a directory, local or on the store), so that a
    save writes a new one; all ranks wait."""
    if dist.get_rank() == 0:
        if is_url(target):
            fs = filesystem(str(target))
            if fs.exists(str(target)):
                fs.rm(str(target), recursive=True)
            fs.invalidate_cache()
        else:
            path = Path(target)
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()
    barrier()
