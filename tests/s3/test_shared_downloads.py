"""A restore from the store downloads each byte once per host: the ranks that see the same local scratch directory
share one copy, each fetching an equal share of its bytes, and a file missing on the store or of another size than
listed fails the download on every rank. The copy is removed once every rank has read it."""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed
from hypothesis import given
from hypothesis import strategies as st

from lightning_strategies.checkpoint import remote
from lightning_strategies.checkpoint.errors import CheckpointFormatError, StoreError
from lightning_strategies.checkpoint.remote import StoredFile, open_store, split_download
from lightning_strategies.strategies.store_saves import Downloads
from tests.support.property_settings import PROPERTY
from tests.support.ranks import run_as_ranks
from tests.support.s3_server import S3Server


def _file(name: str, size: int) -> StoredFile:
    return StoredFile(name, f"bucket/{name}", size, name)


@PROPERTY
@given(sizes=st.lists(st.integers(0, 10_000), max_size=6), parts=st.integers(1, 8))
def test_a_split_download_holds_every_byte_once_in_shares_of_equal_size(sizes: list[int], parts: int) -> None:
    files = [_file(f"f{index}", size) for index, size in enumerate(sizes)]
    shares = split_download(files, parts)

    assert len(shares) == parts
    fetched: dict[str, list[tuple[int, int]]] = {file.name: [] for file in files}
    for share in shares:
        for file, start, end in share:
            fetched[file.name].append((start, end))
    for file in files:  # the ranges of each file tile it exactly: no byte twice, none left out
        covered = sorted(fetched[file.name])
        assert covered[0][0] == 0 and covered[-1][1] == file.size
        assert all(before[1] == after[0] for before, after in itertools.pairwise(covered))
        assert file.size == 0 or all(start < end for start, end in covered)
    share_sizes = [sum(end - start for _, start, end in share) for share in shares]
    assert max(share_sizes) - min(share_sizes) <= 1


def test_a_download_is_split_into_at_least_one_share() -> None:
    with pytest.raises(ValueError, match="at least one share, not 0"):
        split_download([_file("f", 1)], 0)


SIZES = {"meta.pt": 0, "__0_0.distcp": 3 * 1024 * 1024 + 7, "__1_0.distcp": 1024 * 1024 - 3, ".metadata": 911}


def _uploaded(server: S3Server, bucket: str) -> tuple[str, list[StoredFile], dict[str, str]]:
    """Random files of ``SIZES`` on the store under ``<bucket>/save``, as a restore lists them, and their digests."""
    url = f"{bucket}/save"
    filesystem, digests, files = server.filesystem(), {}, []
    for name, size in SIZES.items():
        data = os.urandom(size)
        filesystem.pipe_file(f"{url}/{name}", data)
        digests[name] = hashlib.sha256(data).hexdigest()
        files.append(StoredFile(name, f"{url.removeprefix('s3://')}/{name}", size, f"{name} of the save"))
    return url, files, digests


def _fetch_on_each_rank(url: str, files: list[StoredFile]) -> dict[str, Any]:
    """On each rank: the bytes it fetched from the store, the digests of the copy it reads, and whether the copy is
    gone once the ranks are done with it."""
    torch.distributed.init_process_group("gloo")
    fetched = 0
    read_range = remote._read_range

    def counted(*arguments: Any) -> bytes:
        nonlocal fetched
        data = read_range(*arguments)
        fetched += len(data)
        return data

    remote._read_range = counted  # this forked rank's own module: nothing leaks to the test process
    downloads = Downloads()
    local = downloads.fetch(open_store(url), files, "copy")
    digests = {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in local.iterdir()}
    downloads.clear(barrier=torch.distributed.barrier)
    torch.distributed.barrier()
    return {"fetched": fetched, "digests": digests, "copy": str(local), "removed": not local.exists()}


def test_the_ranks_of_a_host_download_each_byte_once_into_one_copy(store: S3Server, s3_bucket: str) -> None:
    url, files, digests = _uploaded(store, s3_bucket)

    ranks = run_as_ranks(lambda: _fetch_on_each_rank(url, files), timeout=60)

    total = sum(SIZES.values())
    # Each rank fetched its half and the one byte past a file's end it asked for (the range that ends a file asks
    # for one more, so that a longer object is noticed): the store sends none.
    assert sorted(rank["fetched"] for rank in ranks) == [total // 2, total - total // 2]
    assert ranks[0]["copy"] == ranks[1]["copy"]
    assert all(rank["digests"] == digests for rank in ranks)
    assert all(rank["removed"] for rank in ranks)


def _fail_on_each_rank(url: str, files: list[StoredFile]) -> str:
    torch.distributed.init_process_group("gloo")
    downloads = Downloads()
    try:
        downloads.fetch(open_store(url), files, "copy")
    except CheckpointFormatError as error:
        downloads.clear(barrier=torch.distributed.barrier)
        return str(error)
    return "downloaded"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", r"__1_0\.distcp of the save is missing on the store"),
        ("shorter", r"__1_0\.distcp of the save holds 10 bytes, its commit marker says 1048573"),
        ("longer", r"__1_0\.distcp of the save holds more than 1048573 bytes, its commit marker says 1048573"),
    ],
)
def test_a_file_missing_or_of_another_size_on_the_store_fails_the_download_on_every_rank(
    store: S3Server, s3_bucket: str, change: str, message: str
) -> None:
    url, files, _ = _uploaded(store, s3_bucket)
    changed = f"{url}/__1_0.distcp"
    filesystem = store.filesystem()
    if change == "missing":
        filesystem.rm_file(changed)
    else:
        filesystem.pipe_file(changed, os.urandom(10 if change == "shorter" else SIZES["__1_0.distcp"] + 5))

    errors = run_as_ranks(lambda: _fail_on_each_rank(url, files), timeout=60)

    assert all(error != "downloaded" for error in errors), errors
    for error in errors:
        assert url in error and "Use another checkpoint" in error
        assert re.search(message, error), error


def _refused_on_each_rank(url: str, files: list[StoredFile]) -> str:
    torch.distributed.init_process_group("gloo")
    try:
        Downloads().fetch(open_store(url), files, "copy")
    except StoreError as error:
        return str(error)
    return "downloaded"


def test_a_scratch_directory_that_cannot_be_made_fails_the_download_on_every_rank_naming_tmpdir(
    store: S3Server, s3_bucket: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    url, files, _ = _uploaded(store, s3_bucket)
    missing = tmp_path / "not-there"
    monkeypatch.setattr("tempfile.tempdir", str(missing))  # the forked ranks inherit it

    errors = run_as_ranks(lambda: _refused_on_each_rank(url, files), timeout=60)

    for error in errors:
        assert f"cannot make its local copy in {str(missing)!r}" in error and "Point TMPDIR at" in error, error
