"""Faults: killed actors, a lost node, a killed driver, CUDA / out-of-memory errors, exhausted retries.

Everything runs on one ``ray.cluster_utils.Cluster`` (a head that runs no actors and two worker
nodes of 1 CPU each) with the ``faulty`` test family (tests/runtime_families.py): the fake
family's sampler with a per-batch sleep inside actors, so shards last long enough to be
interrupted. Each test compares the committed output with a reference written in-process
(ShardWorker, no Ray, no sleep, no faults): exactly one row per (arm, sample_id), and PNG bytes
equal to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from specray.runtime.plan import ShardPlan
from specray.runtime.store import TEMP_MARKER, RunStore
from specray.spec import load_job
from tests import runtime_families as families
from tests.test_runtime import REPO_ROOT, all_files, images_by_key

pytestmark = pytest.mark.slow

SLEEP_S = 0.4  # per batch inside actors: a 2-batch, 2-arm shard lasts ~1.6 s
ARMS = [{"name": "target_only", "method": "target_only", "params": {"sleep_s": SLEEP_S}},
        {"name": "fake_sd", "method": "fake_sd", "params": {"gamma": 3, "sleep_s": SLEEP_S}}]
NUM_SAMPLES = 48  # 12 per class x 4 classes; batch 4, 2 batches per shard -> 6 shards


@pytest.fixture(scope="module")
def cluster():
    """Head (0 CPUs: it runs only the driver) + 2 worker nodes of 1 CPU; node death noticed within ~2 s."""
    import ray
    from ray.cluster_utils import Cluster

    families.install()
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "include_dashboard": False,
        "_system_config": {"health_check_initial_delay_ms": 0, "health_check_period_ms": 500,
                           "health_check_failure_threshold": 3}})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    ray.init(address=cluster.address, runtime_env=families.ray_runtime_env(), configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster, workers
    ray.shutdown()
    cluster.shutdown()
    families.uninstall()


def reference_images(job: dict, tmp_path: Path) -> dict:
    """The job's images from an in-process run (no Ray, no sleep, no faults)."""
    from specray.runtime.actor import ShardWorker
    from specray.runtime.coordinator import plan_tasks

    out = tmp_path / "reference"
    arms = [{**arm, "params": {k: v for k, v in arm["params"].items() if k in ("gamma",)}}
            for arm in job["arms"]]
    arms = [{**arm, "method": "target_only" if arm["method"] == "faulty" else arm["method"]} for arm in arms]
    spec = load_job({**job, "output": str(out), "arms": arms})
    worker = ShardWorker(spec)
    for task in plan_tasks(spec, ShardPlan.of(spec), RunStore(str(out)))[0]:
        worker.run_task(task)
    return images_by_key(out)


def assert_complete_and_equal(out: Path, expected: dict, arms: list[str]) -> None:
    keys = images_by_key(out)  # also asserts that no (arm, sample_id) appears twice
    assert sorted(keys) == sorted((arm, sid) for arm in arms for sid in range(NUM_SAMPLES))
    assert keys == expected
    assert not [f for f in all_files(out) if TEMP_MARKER in f]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["num_rows"] == len(arms) * NUM_SAMPLES


def run(job: dict, **kwargs):
    from specray.runtime.coordinator import run_job

    return run_job(load_job(job), show_progress=kwargs.pop("show_progress", False), **kwargs)


class BusyKiller(threading.Thread):
    """SIGKILLs ``kills`` worker processes that are in the middle of a batch, ``gap_s`` apart."""

    def __init__(self, busy_dir: Path, kills: int, gap_s: float, first_after_s: float = 1.0):
        super().__init__(daemon=True)
        self.busy_dir, self.kills, self.gap_s, self.first_after_s = busy_dir, kills, gap_s, first_after_s
        self.killed: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        self.stop.wait(self.first_after_s)
        while len(self.killed) < self.kills and not self.stop.is_set():
            for marker in sorted(self.busy_dir.glob("busy-*")):
                pid = int(marker.name.split("-")[1])
                if pid in self.killed:
                    continue
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                self.killed.append(pid)
                self.stop.wait(self.gap_s)
                break
            self.stop.wait(0.05)


def test_sigkilled_actors_mid_shard_are_replaced_and_output_is_exact(cluster, tmp_path, capfd):
    busy = tmp_path / "busy"
    busy.mkdir()
    arms = [{**a, "params": {**a["params"], "busy_dir": str(busy)}} for a in ARMS]
    job = families.job(families.FAULTY, tmp_path / "run", arms)
    killer = BusyKiller(busy, kills=3, gap_s=1.0)
    killer.start()
    try:
        result = run(job, show_progress=True)
    finally:
        killer.stop.set()
        killer.join()
    assert len(killer.killed) == 3, "the job ended before three workers could be killed mid-shard"
    assert result.retries == 3 and result.actors_replaced == 3
    assert_complete_and_equal(tmp_path / "run", reference_images(job, tmp_path), ["target_only", "fake_sd"])
    # Progress (non-tty: plain lines on stderr) shows the retries and the final count.
    err = capfd.readouterr().err
    assert f"progress: {2 * NUM_SAMPLES}/{2 * NUM_SAMPLES} samples (100.0%)" in err
    assert "retries 3" in err and "samples/s" in err and "ETA" in err


def test_a_removed_node_does_not_fail_the_job(cluster, tmp_path):
    c, workers = cluster
    busy = tmp_path / "busy"
    busy.mkdir()
    arms = [{**a, "params": {**a["params"], "busy_dir": str(busy)}} for a in ARMS]
    job = families.job(families.FAULTY, tmp_path / "run", arms)
    out = tmp_path / "run"
    victim = workers[1]
    removed = threading.Event()

    def remove_when_busy() -> None:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(list((out / "samples").rglob("*.parquet")) if out.exists() else []) < 2:
            time.sleep(0.05)
        while time.monotonic() < deadline and len(list(busy.glob("busy-*"))) < 2:  # both actors mid-shard
            time.sleep(0.02)
        c.remove_node(victim, allow_graceful=False)
        removed.set()

    remover = threading.Thread(target=remove_when_busy, daemon=True)
    remover.start()
    try:
        result = run(job)
    finally:
        remover.join()
        workers[1] = c.add_node(num_cpus=1)  # the spot node comes back for the next tests
        c.wait_for_nodes()
    assert removed.is_set()
    assert result.retries >= 1 and result.actors_replaced >= 1
    assert_complete_and_equal(out, reference_images(job, tmp_path), ["target_only", "fake_sd"])


DRIVER = """
import json, sys
sys.path.insert(0, {root!r})
import ray
from tests import runtime_families as families
families.install()
ray.init(address={address!r}, runtime_env=families.ray_runtime_env(), configure_logging=False)
from specray.runtime.coordinator import run_job
from specray.spec import load_job
run_job(load_job(json.loads({job!r})), show_progress=True)
print("DRIVER FINISHED", flush=True)
"""


def test_killed_driver_rerun_skips_committed_shards_and_matches(cluster, tmp_path):
    c, _ = cluster
    out = tmp_path / "run"
    job = families.job(families.FAULTY, out, ARMS)
    script = DRIVER.format(root=str(REPO_ROOT), address=c.address, job=json.dumps(job))
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as log:
        driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and driver.poll() is None:
            if out.exists() and len(list((out / "samples").rglob("*.parquet"))) >= 4:  # 2 of 6 shards, both arms
                break
            time.sleep(0.05)
        assert driver.poll() is None, f"driver ended early:\n{log_path.read_text()[-3000:]}"
        driver.send_signal(signal.SIGKILL)
        driver.wait(timeout=30)
    finally:
        if driver.poll() is None:
            driver.kill()
    committed_at_kill = len(list((out / "samples").rglob("*.parquet")))
    assert not (out / "_manifest.json").exists() and committed_at_kill < 12
    assert "DRIVER FINISHED" not in log_path.read_text()

    result = run(job)
    assert result.tasks_skipped >= 2 and result.tasks_run <= 4
    assert_complete_and_equal(out, reference_images(job, tmp_path), ["target_only", "fake_sd"])


def test_cuda_and_oom_errors_replace_the_actor(cluster, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    arms = [ARMS[0], {"name": "faulty", "method": "faulty",
                      "params": {"sleep_s": SLEEP_S, "marker_dir": str(markers), "times": 1,
                                 "faults": {"5": "oom", "30": "cuda"}}}]
    job = families.job(families.FAULTY, tmp_path / "run", arms)
    result = run(job)
    assert result.retries == 2 and result.actors_replaced == 2  # replaced, not retried in a broken state
    expected = reference_images(job, tmp_path)
    assert_complete_and_equal(tmp_path / "run", expected, ["target_only", "faulty"])
    assert all(expected[("faulty", s)] == expected[("target_only", s)] for s in range(NUM_SAMPLES))
    # The retried shards ran on replacement actors: 2 original + 2 replacements may appear, never a dead one twice.
    actors = set(pq.read_table(tmp_path / "run" / "samples", partitioning=None).column("actor").to_pylist())
    assert 1 <= len(actors) <= 4 and all(":" in a for a in actors)


def test_exhausted_retries_name_the_shard_then_a_rerun_completes(cluster, tmp_path):
    """One actor, shards in order: shards 1-5 commit, shard 6 hits OOM twice with max_shard_retries=1."""
    from specray.runtime.coordinator import ShardFailedError

    markers = tmp_path / "markers"
    markers.mkdir()
    arms = [{"name": "target_only", "method": "target_only", "params": {}},
            {"name": "faulty", "method": "faulty",
             "params": {"marker_dir": str(markers), "times": 2, "faults": {str(NUM_SAMPLES - 3): "oom"}}}]
    out = tmp_path / "run"
    job = families.job(families.FAULTY, out, arms, max_shard_retries=1, actors=1)
    with pytest.raises(ShardFailedError, match=r"shard 6/6 \[target_only,faulty\] .* failed 2 times "
                                               r"\(max_shard_retries=1\); last error: DeviceFailure: .*CUDA out of "
                                               r"memory") as info:
        run(job)
    assert "rerun the job to resume" in str(info.value)
    assert not (out / "_manifest.json").exists()
    assert not [f for f in all_files(out) if TEMP_MARKER in f]
    committed = sorted((out / "samples").rglob("*.parquet"))
    assert len(committed) == 2 * 5  # shards 1-5 of both arms, each complete and readable
    for path in committed:
        table = pq.read_table(path)
        assert table.num_rows == 8 and max(table.column("sample_id").to_pylist()) < 40
    partial = images_by_key(out)
    expected = reference_images(job, tmp_path)
    assert all(expected[key] == image for key, image in partial.items())

    # The cause is gone (the fault fires only twice): a rerun resumes and completes.
    result = run(job)
    assert (result.tasks_skipped, result.tasks_run, result.retries) == (5, 1, 0)
    assert_complete_and_equal(out, expected, ["target_only", "faulty"])


def test_driver_touches_no_cuda_after_jobs(cluster):
    import torch

    assert not torch.cuda.is_initialized()
