"""Jobs against a real S3 server (moto's standalone server over HTTP, see conftest.py).

A full job, a resume after one shard object is deleted, a shard write interrupted midway (a
writer that fails, and a writer process SIGKILLed during a multipart upload: no partial object
is ever visible), an actor killed mid-shard, the endpoint from the spec's storage_options, and
explicit credentials that never reach _job.json, _manifest.json, Parquet metadata or the logs.
The fake family of tests/test_runtime.py keeps each job to a few seconds.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from specray.runtime import fs
from specray.runtime.plan import shard_relpath
from specray.runtime.store import RunStore
from tests.conftest import boto3_client
from tests.test_runtime import REPO_ROOT, _flaky_job, fake_family, fake_job, run  # noqa: F401 (fixture)

AWS_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_ENDPOINT_URL",
           "AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE", "AWS_EC2_METADATA_DISABLED")
NUM_SHARDS = 3  # fake_job: 24 samples, batch 4, 2 batches per shard
ARMS = ("target_only", "fake_sd")


@pytest.fixture(scope="module")
def ray_s3(moto_server, fake_family):  # noqa: F811
    """A local Ray whose workers see the moto endpoint and fake credentials.

    Workers inherit the driver's environment only if Ray starts after the moto fixture set it;
    passing the AWS variables as runtime_env env_vars makes that explicit (and is what a cluster
    needs: ``ray job submit --runtime-env-json '{"env_vars": {...}}'``).
    """
    import ray

    env = {name: os.environ[name] for name in AWS_ENV if name in os.environ}
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, runtime_env={
        "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                     "OMP_NUM_THREADS": "1", **env},
        "worker_process_setup_hook": "tests.test_runtime.install_fake_family",
    })
    yield ray
    ray.shutdown()


def _bucket(uri: str) -> str:
    return uri[len("s3://"):].split("/", 1)[0]


def _objects(endpoint: str, bucket: str, prefix: str = "") -> dict[str, dict]:
    client = boto3_client(endpoint)
    found = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
        for item in page.get("Contents", []):
            found[item["Key"][len(prefix):].lstrip("/")] = item
    return found


def _images(store: RunStore) -> dict[tuple[str, int], bytes]:
    rows = []
    for relpath in store.list_files("samples"):
        rows += store.read_table(relpath).select(["arm", "sample_id", "image"]).to_pylist()
    keys = [(r["arm"], r["sample_id"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (arm, sample_id) appears twice"
    return {(r["arm"], r["sample_id"]): r["image"]["bytes"] for r in rows}


@pytest.fixture(scope="module")
def s3_run(ray_s3, moto_server, tmp_path_factory):
    """The fake job written to S3, and the same job written locally (the reference bytes)."""
    client = boto3_client(moto_server)
    bucket = "specray-s3-jobs"
    client.create_bucket(Bucket=bucket)
    uri = f"s3://{bucket}/runs/fake"
    result = run(fake_job(uri))
    local = tmp_path_factory.mktemp("local") / "run"
    run(fake_job(local))
    return uri, result, local


def test_full_job_on_s3_matches_a_local_run(s3_run, moto_server):
    uri, result, local = s3_run
    objects = _objects(moto_server, _bucket(uri), "runs/fake")
    expected = {shard_relpath(arm, k, NUM_SHARDS) for arm in ARMS for k in range(NUM_SHARDS)}
    assert set(objects) == expected | {"_job.json", "_manifest.json"}  # no temp objects, no probes
    assert result.tasks_run == NUM_SHARDS and result.manifest["num_rows"] == 48

    store = RunStore(uri)
    manifest = store.read_json("_manifest.json")
    for entry in manifest["shards"]:
        assert hashlib.sha256(store.read_bytes(entry["path"])).hexdigest() == entry["sha256"]
    images = _images(store)
    assert len(images) == 48 and images == _images(RunStore(str(local)))  # same bytes as on local disk
    # pyarrow's native S3 filesystem reads the same run (endpoint from AWS_ENDPOINT_URL).
    pafs, path = fs.pyarrow_filesystem(fs.join(uri, shard_relpath("fake_sd", 0, NUM_SHARDS)))
    assert pq.read_table(path, filesystem=pafs).num_rows == 8


def test_resume_on_s3_recomputes_only_the_deleted_shard(s3_run, moto_server):
    uri, _, _ = s3_run
    client = boto3_client(moto_server)
    bucket, prefix = _bucket(uri), "runs/fake"
    before = _objects(moto_server, bucket, prefix)
    victim = shard_relpath("fake_sd", 1, NUM_SHARDS)
    original = client.get_object(Bucket=bucket, Key=f"{prefix}/{victim}")["Body"].read()
    client.delete_object(Bucket=bucket, Key=f"{prefix}/{victim}")
    client.delete_object(Bucket=bucket, Key=f"{prefix}/_manifest.json")  # as after a crash

    result = run(fake_job(uri))
    assert result.tasks_run == 1 and result.tasks_skipped == NUM_SHARDS - 1 and result.rows_written == 8
    after = _objects(moto_server, bucket, prefix)
    assert set(after) == set(before)
    for key, item in before.items():  # every other shard object is untouched (same ETag and time)
        if key.endswith(".parquet") and key != victim:
            assert (after[key]["ETag"], after[key]["LastModified"]) == (item["ETag"], item["LastModified"])
    # The recomputed shard holds the same rows: identical PNG bytes and statistics; only the wall
    # times (and the id of the actor that ran it) differ.
    redone = client.get_object(Bucket=bucket, Key=f"{prefix}/{victim}")["Body"].read()
    timing = {"batch_wall_time_s", "sample_wall_time_s", "actor"}
    tables = [pq.read_table(io.BytesIO(data)) for data in (original, redone)]
    columns = [c for c in tables[0].column_names if c not in timing]
    assert tables[1].select(columns).equals(tables[0].select(columns))
    assert tables[1].column("image").to_pylist() == tables[0].column("image").to_pylist()


def test_failing_writer_leaves_no_object_and_aborts_the_upload(s3_bucket, moto_server, monkeypatch):
    """A multipart shard write that fails after its first part: nothing visible, upload aborted."""
    import s3fs

    uri = fs.join(s3_bucket, "run")
    store = RunStore(uri)
    store.part_size = 5 * 1024 * 1024  # S3's minimum part size: 12 MiB is three parts
    original = s3fs.core.S3File._upload_chunk
    calls = []

    def fail_on_second_part(self, final=False):
        calls.append(final)
        if len(calls) == 2:
            raise ConnectionError("injected network failure during part 2")
        return original(self, final)

    monkeypatch.setattr(s3fs.core.S3File, "_upload_chunk", fail_on_second_part)
    relpath = shard_relpath("sd", 0, 1)
    with pytest.raises(ConnectionError, match="part 2"):
        store.commit_bytes(relpath, os.urandom(12 * 1024 * 1024))
    monkeypatch.undo()
    client = boto3_client(moto_server)
    assert _objects(moto_server, _bucket(s3_bucket)) == {}
    assert client.list_multipart_uploads(Bucket=_bucket(s3_bucket)).get("Uploads", []) == []
    assert not store.is_committed(relpath)
    store.commit_bytes(relpath, b"complete")  # the retry commits normally
    assert store.read_bytes(relpath) == b"complete"


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    import s3fs
    from specray.runtime.store import RunStore

    original = s3fs.core.S3File._upload_chunk
    def pause_after_first_part(self, final=False):
        result = original(self, final)
        if len(self.parts or []) == 1 and not final:
            print("PART-1-UPLOADED", flush=True)
            time.sleep(300)  # killed here, midway through the shard
        return result
    s3fs.core.S3File._upload_chunk = pause_after_first_part
    store = RunStore(sys.argv[1])
    store.part_size = 5 * 1024 * 1024
    store.commit_bytes(sys.argv[2], b"x" * (12 * 1024 * 1024))
    print("COMMITTED", flush=True)
""")


def test_writer_killed_during_upload_leaves_no_object(s3_bucket, moto_server):
    """SIGKILL a writer process between multipart parts: the shard never becomes visible."""
    uri = fs.join(s3_bucket, "run")
    relpath = shard_relpath("sd", 0, 1)
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, uri, relpath], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "PART-1-UPLOADED", proc.stderr.read() if proc.poll() is not None else line
        client = boto3_client(moto_server)
        uploads = client.list_multipart_uploads(Bucket=_bucket(s3_bucket)).get("Uploads", [])
        assert [u["Key"] for u in uploads] == [f"run/{relpath}"]  # the write really is midway
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert _objects(moto_server, _bucket(s3_bucket)) == {}  # the parts are invisible; no object
    store = RunStore(uri)
    assert not store.is_committed(relpath) and store.list_files() == []


@pytest.mark.slow
def test_actor_killed_mid_shard_on_s3(ray_s3, s3_bucket, moto_server, tmp_path):
    """The worker process exits mid-shard (twice); the shard is rerun elsewhere and written once."""
    markers = tmp_path / "markers"
    markers.mkdir()
    uri = fs.join(s3_bucket, "flaky")
    result = run(_flaky_job(uri, markers, "exit", times=1))
    assert result.retries == 2
    images = _images(RunStore(uri))
    assert len(images) == 3 * 24
    assert all(images[("flaky", s)] == images[("target_only", s)] for s in range(24))
    assert len(_objects(moto_server, _bucket(s3_bucket), "flaky")) == 3 * NUM_SHARDS + 2


def test_endpoint_from_spec_storage_options(ray_s3, s3_bucket, moto_server, monkeypatch):
    """No AWS_ENDPOINT_URL in the driver: the spec's storage_options.endpoint_url is used (and stored)."""
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    uri = fs.join(s3_bucket, "spec-endpoint")
    job = fake_job(uri, storage_options={"endpoint_url": moto_server, "region_name": "us-east-1"})
    job["conditions"] = {**job["conditions"], "per_class": 1}
    result = run(job)
    assert result.manifest["num_rows"] == 8
    assert result.manifest["spec"]["storage_options"]["endpoint_url"] == moto_server
    assert len(_objects(moto_server, _bucket(s3_bucket), "spec-endpoint")) == 2 + 2


def test_explicit_credentials_never_reach_the_outputs_or_logs(ray_s3, s3_bucket, moto_auth, capfd, caplog):
    """moto enforces IAM: only the explicit keys work, and neither key appears in anything written."""
    from specray.runtime.coordinator import run_job
    from specray.spec import load_job

    uri = fs.join(s3_bucket, "secret-run")
    keys = moto_auth.allowed
    job = fake_job(uri)
    job["conditions"] = {**job["conditions"], "per_class": 1}
    options = keys.storage_options(moto_auth.endpoint)
    with caplog.at_level("DEBUG", logger="specray"):
        result = run_job(load_job(job), storage_options=options, show_progress=True)
    assert result.manifest["num_rows"] == 8
    store = RunStore(uri, options)
    texts = {name: store.read_bytes(name) for name in ("_job.json", "_manifest.json")}
    for relpath in store.list_files("samples"):
        metadata = pq.ParquetFile(io.BytesIO(store.read_bytes(relpath))).metadata
        texts[relpath] = json.dumps({k.decode(): v.decode() for k, v in (metadata.metadata or {}).items()}).encode()
        texts[relpath + ":bytes"] = store.read_bytes(relpath)
    captured = capfd.readouterr()
    texts["stdout+stderr"] = (captured.out + captured.err + caplog.text).encode()
    for secret in (keys.secret_access_key, keys.access_key_id):
        leaks = [name for name, text in texts.items() if secret.encode() in text]
        assert leaks == [], f"a credential appears in {leaks}"
    assert "progress: 8/8 samples" in captured.err
    # A job file that carries credentials is refused before anything runs.
    from specray.spec import SpecError

    with pytest.raises(SpecError, match=r"^storage_options.secret: credentials are never read from a job file"):
        load_job({**job, "storage_options": {"secret": keys.secret_access_key}})


def test_dataset_partition_published_on_s3(ray_s3, s3_bucket, moto_server):
    """Dataset mode on S3: shards are published by server-side copy; the staging run is removed."""
    from specray.runtime.dataset import run_dataset_job
    from specray.spec import load_job

    uri = fs.join(s3_bucket, "datasets", "nightly")
    job = fake_job(uri)
    job["conditions"] = {**job["conditions"], "per_class": 1}  # 4 samples: one shard per arm
    job["dataset"] = {"partition": "date", "date": "2026-11-29"}
    result = run_dataset_job(load_job(job), show_progress=False)
    objects = _objects(moto_server, _bucket(s3_bucket), "datasets/nightly")
    assert sorted(objects) == ["README.md", "data/date=2026-11-29/_partition.json",
                               "data/date=2026-11-29/fake_sd-00000-of-00001.parquet",
                               "data/date=2026-11-29/target_only-00000-of-00001.parquet"]
    store = RunStore(uri)
    for entry in result.record["files"]:
        data = store.read_bytes(entry["path"])
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
        assert pq.read_table(io.BytesIO(data)).num_rows == 4
    assert "| 2026-11-29 | fake-test | 7 | 8 |" in store.read_bytes("README.md").decode()
