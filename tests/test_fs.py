"""specray.runtime.fs: local + S3 (moto server over HTTP) atomic writes, listing, writability checks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specray.runtime import fs
from tests.conftest import boto3_client

MIB = 2**20
PART = 5 * MIB  # S3's (and moto's) minimum multipart part size


class WriterCrash(RuntimeError):
    """Raised by a test writer midway through a write."""


def _bucket_of(uri: str) -> str:
    return uri[len("s3://"):].split("/", 1)[0]


def _pending_uploads(endpoint: str, bucket: str) -> list[dict]:
    return boto3_client(endpoint).list_multipart_uploads(Bucket=bucket).get("Uploads", [])


def _visible_keys(endpoint: str, bucket: str) -> list[str]:
    listing = boto3_client(endpoint).list_objects_v2(Bucket=bucket)
    return [item["Key"] for item in listing.get("Contents", [])]


# ------------------------------------------------------------------------------------- URIs


def test_resolve_and_join_local_and_s3(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    local_fs, path = fs.resolve("out/run")
    assert path == str(tmp_path / "out" / "run")  # absolute-ised
    assert fs.resolve(f"file://{tmp_path}/x")[1] == str(tmp_path / "x")
    assert type(local_fs).__name__ == "LocalFileSystem"
    assert fs.join("s3://bucket/prefix/", "samples", "arm=a/", "shard-0.parquet") == (
        "s3://bucket/prefix/samples/arm=a/shard-0.parquet"
    )
    assert fs.join("s3://bucket", "x") == "s3://bucket/x"
    assert fs.join("/tmp/out", "samples", "a.parquet") == "/tmp/out/samples/a.parquet"


@pytest.mark.parametrize("bad", ["gs://bucket/x", "s3://", "s3:///key", ""])
def test_unsupported_or_malformed_uri_is_named(bad):
    with pytest.raises(fs.StorageError) as info:
        fs.resolve(bad)
    message = str(info.value)
    assert repr(bad) in message or bad == ""
    assert "s3://" in message  # says what is allowed / expected


def test_endpoint_override_precedence(monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://generic:1")
    assert fs.s3_endpoint() == "http://generic:1"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://s3-specific:2")
    assert fs.s3_endpoint() == "http://s3-specific:2"
    assert fs.s3_endpoint({"endpoint_url": "http://explicit:3"}) == "http://explicit:3"
    assert fs.s3_endpoint({"client_kwargs": {"endpoint_url": "http://ck:4"}}) == "http://ck:4"
    s3, path = fs.resolve("s3://bucket/a/b", {"endpoint_url": "http://explicit:3"}, fresh=True)
    assert path == "bucket/a/b"
    assert s3.client_kwargs["endpoint_url"] == "http://explicit:3"


# ------------------------------------------------------------------------------ local files


def test_local_atomic_write_read_list_remove(tmp_path):
    base = str(tmp_path / "run")
    shard = fs.join(base, "samples", "arm=a", "shard-0-of-2.parquet")
    fs.atomic_write_bytes(shard, b"first")
    fs.atomic_write_bytes(shard, b"second")  # overwrite replaces atomically
    fs.atomic_write_bytes(fs.join(base, "samples", "arm=b", "shard-1-of-2.parquet"), b"b")
    fs.atomic_write_bytes(fs.join(base, "_manifest.json"), b"{}")
    (tmp_path / "run" / "samples" / "arm=a" / ".shard-9.parquet.tmp-abc").write_bytes(b"partial")

    assert fs.exists(shard) and fs.read_bytes(shard) == b"second"
    assert fs.list_files(fs.join(base, "samples"), ".parquet") == [
        shard,
        fs.join(base, "samples", "arm=b", "shard-1-of-2.parquet"),
    ]  # sorted, recursive, hidden temp files never listed
    assert fs.list_files(fs.join(base, "does-not-exist"), ".parquet") == []
    leftovers = [p.name for p in (tmp_path / "run" / "samples" / "arm=a").iterdir()]
    assert sorted(leftovers) == [".shard-9.parquet.tmp-abc", "shard-0-of-2.parquet"]  # no temp of ours left
    fs.remove(shard)
    assert not fs.exists(shard)
    fs.remove(shard)  # missing is fine by default
    with pytest.raises(FileNotFoundError):
        fs.remove(shard, missing_ok=False)


def test_local_writer_failure_leaves_old_object_and_no_temp(tmp_path):
    target = str(tmp_path / "shard.parquet")
    fs.atomic_write_bytes(target, b"committed")
    with pytest.raises(WriterCrash):
        with fs.atomic_writer(target) as handle:
            handle.write(b"half of a new shard")
            raise WriterCrash("midway")
    assert fs.read_bytes(target) == b"committed"
    assert os.listdir(tmp_path) == ["shard.parquet"]


def test_local_killed_writer_leaves_no_visible_file(tmp_path):
    target = str(tmp_path / "samples" / "shard-0.parquet")
    script = textwrap.dedent(
        f"""
        import sys, time
        from specray.runtime import fs
        with fs.atomic_writer({target!r}) as handle:
            handle.write(b"x" * 100_000)
            handle.flush()
            print("WRITING", flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "WRITING"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not fs.exists(target)
    assert fs.list_files(str(tmp_path), ".parquet") == []
    # The dead writer's temp file is dot-prefixed: present on disk, invisible to readers.
    assert [name.startswith(".shard-0.parquet.tmp-") for name in os.listdir(tmp_path / "samples")] == [True]


def test_check_writable_local_ok_and_leaves_nothing(tmp_path):
    fs.check_writable(str(tmp_path))  # existing directory
    fresh = tmp_path / "a" / "b" / "c"
    fs.check_writable(str(fresh))
    assert os.listdir(tmp_path) == []  # created directories and probe removed again


def test_check_writable_local_file_where_directory_should_be(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_bytes(b"not a directory")
    for uri in (str(blocker), str(blocker / "run1"), f"file://{blocker}/run1/deeper"):
        with pytest.raises(fs.StorageError) as info:
            fs.check_writable(uri)
        message = str(info.value)
        assert repr(uri) in message and "file" in message and str(blocker) in message
    assert blocker.read_bytes() == b"not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_check_writable_local_permission_denied(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(fs.StorageError, match="permission denied"):
        fs.check_writable(str(locked / "run"))


def test_redact_strips_credentials_but_keeps_stats():
    options = {
        "key": "AKIAEXAMPLE",
        "secret": "s3cr3t",
        "client_kwargs": {"endpoint_url": "http://user:pw@minio:9000/"},
        "AWS_SESSION_TOKEN": "tok",
        "secretAccessKey": "x",
        "db_password": "pw",
        "aws_access_key_id": "AKIA2",
        "num_tokens": 64,
        "max_tokens": [1, 2],
        "region_name": "us-east-1",
    }
    cleaned = fs.redact({"storage_options": options, "arms": [options]})
    for entry in (cleaned["storage_options"], cleaned["arms"][0]):
        for name in ("key", "secret", "AWS_SESSION_TOKEN", "secretAccessKey", "db_password", "aws_access_key_id"):
            assert entry[name] == fs.REDACTED
        assert entry["num_tokens"] == 64 and entry["max_tokens"] == [1, 2] and entry["region_name"] == "us-east-1"
        assert entry["client_kwargs"]["endpoint_url"] == f"http://{fs.REDACTED}@minio:9000/"
    assert options["key"] == "AKIAEXAMPLE"  # input untouched
    text = repr(cleaned)
    assert not any(s in text for s in ("AKIAEXAMPLE", "s3cr3t", "user:pw", "'tok'"))


# -------------------------------------------------------------------------------------- S3


def test_s3_atomic_write_read_list_remove_via_env_endpoint(s3_bucket):
    # The endpoint comes from AWS_ENDPOINT_URL (set by the moto_server fixture), creds from the env chain.
    shard = fs.join(s3_bucket, "run", "samples", "arm=a", "shard-0-of-2.parquet")
    other = fs.join(s3_bucket, "run", "samples", "arm=b", "shard-1-of-2.parquet")
    assert not fs.exists(shard)
    fs.atomic_write_bytes(shard, b"shard-a")
    fs.atomic_write_bytes(other, b"shard-b")
    fs.atomic_write_bytes(fs.join(s3_bucket, "run", "_manifest.json"), b"{}")
    assert fs.exists(shard) and fs.read_bytes(shard) == b"shard-a"
    assert fs.list_files(fs.join(s3_bucket, "run", "samples"), ".parquet") == [shard, other]
    assert fs.list_files(fs.join(s3_bucket, "run"), ".json") == [fs.join(s3_bucket, "run", "_manifest.json")]
    assert fs.list_files(fs.join(s3_bucket, "nothing-here"), ".parquet") == []
    fs.remove(shard)
    assert not fs.exists(shard)
    assert fs.list_files(fs.join(s3_bucket, "run", "samples"), ".parquet") == [other]


def test_s3_listing_sees_objects_written_by_another_client(s3_bucket, moto_server):
    prefix = fs.join(s3_bucket, "samples")
    assert fs.list_files(prefix) == []  # would populate a listing cache if one were used
    boto3_client(moto_server).put_object(Bucket=_bucket_of(s3_bucket), Key="samples/shard-0.parquet", Body=b"1")
    assert fs.list_files(prefix, ".parquet") == [fs.join(prefix, "shard-0.parquet")]
    assert fs.exists(fs.join(prefix, "shard-0.parquet"))


def test_s3_endpoint_from_storage_options_and_pyarrow(s3_bucket, moto_server, monkeypatch):
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    options = {"endpoint_url": moto_server}
    uri = fs.join(s3_bucket, "table", "part-0.parquet")
    table = pa.table({"sample_id": pa.array([0, 1, 2], pa.int64()), "image": [b"a", b"b", b"c"]})

    arrow_fs, path = fs.pyarrow_filesystem(uri, options)
    assert path == f"{_bucket_of(s3_bucket)}/table/part-0.parquet"
    pq.write_table(table, path, filesystem=arrow_fs)  # pyarrow's own S3 client against moto
    assert fs.list_files(fs.join(s3_bucket, "table"), ".parquet", options) == [uri]

    with fs.atomic_writer(fs.join(s3_bucket, "table", "part-1.parquet"), options) as handle:
        pq.write_table(table, handle)  # streaming writer path used by the store
    for name in ("part-0.parquet", "part-1.parquet"):
        read_back = pq.read_table(f"{_bucket_of(s3_bucket)}/table/{name}", filesystem=arrow_fs)
        assert read_back.equals(table)


def test_s3_writer_failure_between_parts_leaves_no_object(s3_bucket, moto_server):
    bucket = _bucket_of(s3_bucket)
    target = fs.join(s3_bucket, "samples", "shard-0.parquet")
    with pytest.raises(WriterCrash):
        with fs.atomic_writer(target, block_size=PART) as handle:
            handle.write(os.urandom(PART))
            handle.write(os.urandom(PART))  # two full parts are now uploaded
            uploads = _pending_uploads(moto_server, bucket)
            assert [u["Key"] for u in uploads] == ["samples/shard-0.parquet"]  # we really are midway
            assert _visible_keys(moto_server, bucket) == []
            raise WriterCrash("between parts")
    assert not fs.exists(target)
    assert _visible_keys(moto_server, bucket) == []
    assert _pending_uploads(moto_server, bucket) == []  # the multipart upload was aborted

    # A successful write of the same size becomes visible in one step, complete.
    payload = os.urandom(2 * PART + 123)
    with fs.atomic_writer(target, block_size=PART) as handle:
        handle.write(payload)
    assert fs.read_bytes(target) == payload


@pytest.mark.parametrize("client", ["fsspec", "pyarrow"])
def test_negative_control_plain_streams_publish_partial_object(s3_bucket, moto_server, client):
    """The failure mode atomic_writer avoids, shown for both plain writers (so the check above can see it)."""
    uri = fs.join(s3_bucket, "partial.bin")
    if client == "fsspec":
        s3, path = fs.resolve(uri)
        opened = s3.open(path, "wb", block_size=PART)  # fsspec's __exit__ closes, i.e. commits, on error
    else:
        arrow_fs, path = fs.pyarrow_filesystem(uri)
        opened = arrow_fs.open_output_stream(path)  # so does pyarrow's
    with pytest.raises(WriterCrash):
        with opened as handle:
            handle.write(os.urandom(PART + 10))
            raise WriterCrash("midway")
    assert _visible_keys(moto_server, _bucket_of(s3_bucket)) == ["partial.bin"]


def test_s3_killed_writer_process_leaves_no_visible_object(s3_bucket, moto_server):
    bucket = _bucket_of(s3_bucket)
    target = fs.join(s3_bucket, "samples", "shard-3.parquet")
    script = textwrap.dedent(
        f"""
        import os, time
        from specray.runtime import fs
        with fs.atomic_writer({target!r}, block_size={PART}) as handle:
            handle.write(os.urandom({PART}))
            handle.write(os.urandom({PART}))
            print("PARTS_UPLOADED", flush=True)
            time.sleep(60)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "PARTS_UPLOADED"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    assert not fs.exists(target)
    assert _visible_keys(moto_server, bucket) == []
    assert fs.list_files(s3_bucket) == []
    # A SIGKILLed writer cannot abort its upload: the parts stay as an invisible, incomplete upload
    # (an S3 lifecycle rule AbortIncompleteMultipartUpload reclaims them).
    assert [u["Key"] for u in _pending_uploads(moto_server, bucket)] == ["samples/shard-3.parquet"]


def test_check_writable_s3_ok_and_probe_removed(s3_bucket):
    fs.check_writable(fs.join(s3_bucket, "runs", "r1"))
    assert fs.list_files(s3_bucket) == [] and _visible_keys(os.environ["AWS_ENDPOINT_URL"], _bucket_of(s3_bucket)) == []


def test_check_writable_s3_missing_bucket(moto_server):
    uri = "s3://specray-no-such-bucket-0001/runs/r1"
    with pytest.raises(fs.StorageError) as info:
        fs.check_writable(uri)
    message = str(info.value)
    assert repr(uri) in message and "'specray-no-such-bucket-0001' does not exist" in message


def test_check_writable_s3_unreachable_endpoint(s3_bucket):
    uri = fs.join(s3_bucket, "run")
    with pytest.raises(fs.StorageError) as info:
        fs.check_writable(uri, {"endpoint_url": f"http://127.0.0.1:{_closed_port()}"})
    assert repr(uri) in str(info.value) and "cannot connect" in str(info.value)


def _closed_port() -> int:
    from tests.conftest import free_port

    return free_port()  # nothing listens there once the probe socket is closed


def test_check_writable_s3_credentials_refused(s3_bucket, moto_auth, monkeypatch):
    """moto enforces IAM auth (moto-api/reset-auth 0): unknown key, bad signature, and no permission."""
    uri = fs.join(s3_bucket, "runs", "r1")
    endpoint = moto_auth.endpoint
    fs.check_writable(uri, moto_auth.allowed.storage_options(endpoint))  # positive control

    cases = {
        "InvalidAccessKeyId": {"key": "AKIAUNKNOWNKEY000000", "secret": "unknown-secret-value"},
        "SignatureDoesNotMatch": {"key": moto_auth.allowed.access_key_id, "secret": "wrong-secret-value-123"},
        "AccessDenied": moto_auth.denied.storage_options(endpoint),
    }
    for code, options in cases.items():
        options = {**options, "endpoint_url": endpoint}
        with pytest.raises(fs.StorageError) as info:
            fs.check_writable(uri, options)
        message = str(info.value)
        assert repr(uri) in message and "credentials refused" in message and code in message
        assert options["secret"] not in message and options["key"] not in message

    # Credentials from the environment chain (what users do), changed after earlier S3 use in this
    # process: the check must not reuse a cached filesystem built with the old keys.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_auth.denied.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_auth.denied.secret_access_key)
    with pytest.raises(fs.StorageError, match="AccessDenied") as info:
        fs.check_writable(uri)
    assert moto_auth.denied.secret_access_key not in str(info.value)
    assert _visible_keys_as(moto_auth, _bucket_of(s3_bucket)) == []  # nothing was written


def _visible_keys_as(auth, bucket: str) -> list[str]:
    client = boto3_client(
        auth.endpoint,
        aws_access_key_id=auth.allowed.access_key_id,
        aws_secret_access_key=auth.allowed.secret_access_key,
    )
    return [item["Key"] for item in client.list_objects_v2(Bucket=bucket).get("Contents", [])]


def test_check_writable_s3_no_credentials(s3_bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    uri = fs.join(s3_bucket, "run")
    started = time.monotonic()
    with pytest.raises(fs.StorageError) as info:
        fs.check_writable(uri)
    assert repr(uri) in str(info.value) and "NoCredentialsError" in str(info.value)
    assert time.monotonic() - started < 10
