"""One writer per output: the lease (specray/runtime/lease.py) on a local folder and on S3 (moto)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from specray.runtime.lease import LeaseLostError, OutputBusyError, OutputLease
from specray.runtime.store import LEASE_NAME, TEMP_MARKER, RunStore
from specray.spec import load_job
from tests import runtime_families as families
from tests.test_runtime import REPO_ROOT, all_files, images_by_key


@pytest.fixture(scope="module")
def ray_faulty():
    import ray

    families.install()
    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False,
             runtime_env=families.ray_runtime_env())
    yield
    ray.shutdown()
    families.uninstall()


def _slow_job(out: Path) -> dict:
    arms = [{"name": "target_only", "method": "target_only", "params": {"sleep_s": 0.3}},
            {"name": "fake_sd", "method": "fake_sd", "params": {"gamma": 3, "sleep_s": 0.3}}]
    return families.job(families.FAULTY, out, arms, actors=1)


def _lease_record(out: Path) -> dict | None:
    """The lease's record, or None while the file is missing or not yet written."""
    try:
        return json.loads((out / LEASE_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None


def test_two_concurrent_runs_one_refuses_the_other_completes(ray_faulty, tmp_path):
    from specray.cli import specray
    from specray.runtime.coordinator import run_job

    out = tmp_path / "run"
    job = _slow_job(out)
    first: dict = {}

    def first_run() -> None:
        try:
            first["result"] = run_job(load_job(job), show_progress=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertions below
            first["error"] = exc

    thread = threading.Thread(target=first_run)
    thread.start()
    # The driver creates and locks the lease file, then writes its record: wait for the record, not the file.
    deadline = time.monotonic() + 120
    while (holder := _lease_record(out)) is None and time.monotonic() < deadline and thread.is_alive():
        time.sleep(0.02)
    assert holder is not None, first

    # The second run of the same job into the same output: refused, naming the holder.
    began = time.monotonic()
    with pytest.raises(OutputBusyError) as info:
        run_job(load_job(job), show_progress=False)
    assert time.monotonic() - began < 30
    assert info.value.field_path == "output"
    assert "is being written by another run" in info.value.message and f"pid {os.getpid()}" in info.value.message
    assert holder["job_id"] == job["job_id"] and holder["pid"] == os.getpid()
    # ... and through the command line: exit 2, the reason on stderr.
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    cli = CliRunner().invoke(specray, ["run", str(path), "--no-reduce", "--quiet"])
    assert cli.exit_code == 2 and cli.stderr.startswith("error: output: ") and "another run" in cli.stderr
    assert thread.is_alive(), "the first run ended before the second was tried; make its shards slower"

    thread.join(timeout=300)
    assert "error" not in first, first.get("error")
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["num_rows"] == 2 * 48 and first["result"].tasks_run == first["result"].num_tasks
    for entry in manifest["shards"]:  # the manifest's checksums match the files on disk
        data = (out / entry["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == entry["sha256"] and len(data) == entry["bytes"]
    assert len(images_by_key(out)) == 2 * 48  # each (arm, sample) once
    assert LEASE_NAME not in all_files(out) and not [f for f in all_files(out) if TEMP_MARKER in f]


HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from specray.runtime.lease import OutputLease
from specray.runtime.store import RunStore
lease = OutputLease(RunStore({out!r}), job_id="holder", fingerprint="f00d").acquire()
print("held", flush=True)
time.sleep(300)
"""


def test_a_local_lease_is_taken_over_at_once_after_its_holder_died(tmp_path):
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER.format(root=str(REPO_ROOT), out=str(out))],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(OutputBusyError, match=rf"job 'holder' \(pid {holder.pid} on "):
            OutputLease(RunStore(str(out)), job_id="second", fingerprint="beef").acquire()
        holder.send_signal(signal.SIGKILL)  # no clean-up runs: the lease file stays behind
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
    assert (out / LEASE_NAME).exists()
    with OutputLease(RunStore(str(out)), job_id="second", fingerprint="beef") as lease:  # the kernel freed the lock
        assert json.loads((out / LEASE_NAME).read_text())["run_id"] == lease.record["run_id"]
    assert not (out / LEASE_NAME).exists()


def test_a_refused_lease_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "a" / "b" / "run"
    with OutputLease(RunStore(str(out)), job_id="first", fingerprint="f"):
        with pytest.raises(OutputBusyError):
            OutputLease(RunStore(str(out)), job_id="second", fingerprint="f").acquire()
        assert (out / LEASE_NAME).exists()
    assert not (tmp_path / "a").exists()  # the holder made the folders and removed them, empty, on release


def test_s3_lease_conditional_put_refuses_renews_and_is_taken_over_after_death(s3_bucket, moto_server):
    """ttl 2 s: the holder renews every 0.5 s. While it does, nobody takes over; once it stops (dead), the
    next run takes over with If-Match on the stale ETag and the old holder learns it lost the lease."""
    uri = f"{s3_bucket}/runs/leased"
    first = OutputLease(RunStore(uri), job_id="first", fingerprint="f", ttl_s=2.0).acquire()
    with pytest.raises(OutputBusyError, match="job 'first'") as info:
        OutputLease(RunStore(uri), job_id="second", fingerprint="f", ttl_s=2.0).acquire()
    assert "renewed 0 s ago" in str(info.value) or "renewed 1 s ago" in str(info.value)
    time.sleep(3.0)  # longer than the ttl, but the holder renews: still refused
    with pytest.raises(OutputBusyError):
        OutputLease(RunStore(uri), job_id="second", fingerprint="f", ttl_s=2.0).acquire()
    assert not first.lost.is_set()

    first._stop.set()  # the holder dies: it stops renewing and never releases
    first._renewer.join(timeout=10)
    time.sleep(3.5)
    second = OutputLease(RunStore(uri), job_id="second", fingerprint="f", ttl_s=2.0).acquire()
    third = OutputLease(RunStore(uri), job_id="third", fingerprint="f", ttl_s=2.0)
    with pytest.raises(OutputBusyError):  # the lease is fresh again: a third run is refused
        third.acquire()

    # The first holder comes back (a paused process): its next renewal is refused, so it stops.
    first._stop.clear()
    first._renew_loop_once = threading.Thread(target=first._renew_loop, daemon=True)
    first._renew_loop_once.start()
    first._renew_loop_once.join(timeout=10)
    assert first.lost.is_set()
    with pytest.raises(LeaseLostError, match="taken over by another run"):
        first.check()
    first.held = False  # what run_job's clean-up does with a lost lease: leave it to its new holder

    # Two runs taking over the same stale lease: the conditional put lets exactly one win.
    second._stop.set()
    second._renewer.join(timeout=10)
    store = RunStore(uri)
    bucket, key = second._bucket_key
    stale = store.fs.call_s3("head_object", Bucket=bucket, Key=key)["ETag"]
    winner = OutputLease(RunStore(uri), job_id="winner", fingerprint="f")
    loser = OutputLease(RunStore(uri), job_id="loser", fingerprint="f")
    winner._put(IfMatch=stale)
    with pytest.raises(Exception) as race:
        loser._put(IfMatch=stale)
    from specray.runtime.fs import _error_code

    assert _error_code(race.value) in ("PreconditionFailed", "412")
    second.held = False
    store.fs.call_s3("delete_object", Bucket=bucket, Key=key)
