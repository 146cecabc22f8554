"""The S3 server of the tests: it stores what it is given, only for its credentials, in buckets that start empty."""

from __future__ import annotations

import os

import pytest

from tests.support.s3_server import S3Server


def test_put_and_get_with_credentials(s3_server: S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    data = os.urandom(1 << 16)
    fs.pipe(f"{s3_bucket}/dir/blob.bin", data)
    assert fs.cat(f"{s3_bucket}/dir/blob.bin") == data
    assert fs.ls(f"{s3_bucket}/dir", detail=False) == [f"{s3_bucket.removeprefix('s3://')}/dir/blob.bin"]


@pytest.mark.parametrize("who", ["anonymous", "wrong secret"])
def test_requests_without_the_credentials_are_refused(s3_server: S3Server, s3_bucket: str, who: str) -> None:
    import botocore.exceptions
    import s3fs

    s3_server.filesystem().pipe(f"{s3_bucket}/blob", b"secret")
    options = s3_server.storage_options()
    if who == "anonymous":
        options = {"anon": True, "client_kwargs": options["client_kwargs"]}
    else:
        options["secret"] = "not-the-secret"
    stranger = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    with pytest.raises(PermissionError):
        stranger.cat(f"{s3_bucket}/blob")
    with pytest.raises(PermissionError):
        stranger.pipe(f"{s3_bucket}/other", b"x")
    with pytest.raises(botocore.exceptions.ClientError) as refused:
        s3_server.client(anonymous=who == "anonymous", secret_key="not-the-secret").get_object(
            Bucket=s3_bucket.removeprefix("s3://"), Key="blob"
        )
    expected = "AccessDenied" if who == "anonymous" else "SignatureDoesNotMatch"
    assert refused.value.response["Error"]["Code"] == expected
    assert s3_server.filesystem().ls(s3_bucket, detail=False) == [f"{s3_bucket.removeprefix('s3://')}/blob"]


def test_a_fresh_bucket_starts_empty(s3_server: S3Server, s3_bucket: str) -> None:
    fs = s3_server.filesystem()
    assert fs.exists(s3_bucket)
    assert fs.ls(s3_bucket, detail=False) == []
    assert s3_bucket.removeprefix("s3://") != s3_server.bucket
