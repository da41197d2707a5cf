"""`ray job submit` of jobs/submit.py to a local Ray head on loopback, end to end.

The head is started by this test (`ray start --head --block` on 127.0.0.1 with free ports and its
own --temp-dir, in its own process session) and stopped by signalling that session only: never
`ray stop`, which would stop every Ray instance on the machine. The job is tiny (the real discrete
presets, 4 samples x 2 arms); the test checks the exit status, the rows and manifest written, and
that the progress lines reach `ray job logs`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAD_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 300


# Ray's token authentication with a token of this test's own (never ~/.ray/auth_token): the head and
# every CLI call get it through the environment.
AUTH_TOKEN = uuid.uuid4().hex + uuid.uuid4().hex


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1",
               RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=AUTH_TOKEN)
    return env


def _ray_cli() -> list[str]:
    ray = shutil.which("ray")
    return [ray] if ray else [sys.executable, "-m", "ray.scripts.scripts"]


def _session_pids(marker: str) -> list[int]:
    """Processes whose command line names our --temp-dir (Ray's daemons for this head only)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def ray_head(tmp_path):
    """A Ray head on loopback with its own ports and temp dir; yields the dashboard URL."""
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    dashboard_port = free_port()
    ports = {"--port": free_port(), "--dashboard-port": dashboard_port, "--ray-client-server-port": free_port(),
             "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
             "--runtime-env-agent-port": free_port(), "--metrics-export-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port()}
    command = [*_ray_cli(), "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
               "--include-dashboard=true", "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}",
               "--disable-usage-stats", *[f"{flag}={port}" for flag, port in ports.items()]]
    log = open(tmp_path / "ray_head.log", "wb")
    head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            if head.poll() is not None:
                pytest.fail(f"ray start exited {head.returncode}:\n{(tmp_path / 'ray_head.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                    break
            except urllib.error.HTTPError:
                break  # it answers (401 when Ray's token authentication is on): the dashboard is up
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the Ray dashboard did not answer at {url} within {HEAD_START_TIMEOUT_S} s")
                time.sleep(1)
        yield url
    finally:
        head.send_signal(signal.SIGTERM)  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
        with_deadline = time.monotonic() + 15
        while _session_pids(temp_dir) and time.monotonic() < with_deadline:
            time.sleep(0.5)
        for pid in _session_pids(temp_dir):  # stragglers of this head only, by id
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def small_job(output: Path) -> dict:
    arm = {"family": "discrete_ar", "target": "digits-gpt-target", "draft": "digits-gpt-draft"}
    return {"job_id": "submit-test", "seed": 5, "output": "runs/ignored-overridden",
            "conditions": {"kind": "class_labels", "per_class": 1, "classes": [0, 3, 5, 7]},
            "batch_size": 2, "shard_batches": 1, "actors": 1, "num_cpus_per_actor": 1,
            "arms": [{"name": "target_only", "method": "target_only", **arm},
                     {"name": "sd", "method": "sd", "params": {"gamma": 3}, **arm}],
            "eval": {"fid": False}}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ray_job_submit_runs_the_job_and_logs_progress(ray_head, tmp_path):
    from specray.models.presets import get_preset

    if not get_preset("digits-gpt-target").weights_path.exists():
        pytest.skip("discrete presets are not trained")
    work = tmp_path / "work"  # the uploaded working dir: the entrypoint and the spec only
    (work / "jobs").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "jobs" / "submit.py", work / "jobs" / "submit.py")
    (work / "jobs" / "small.yaml").write_text(yaml.safe_dump(small_job(tmp_path / "out")))
    output = tmp_path / "out"
    submission = f"specray-test-{uuid.uuid4().hex[:8]}"
    ray = _ray_cli()
    submit = subprocess.run(
        [*ray, "job", "submit", "--address", ray_head, "--submission-id", submission, "--working-dir", str(work),
         "--", "python", "jobs/submit.py", "jobs/small.yaml", "--output", str(output), "--no-reduce"],
        capture_output=True, text=True, env=_env(), timeout=JOB_TIMEOUT_S)
    assert submit.returncode == 0, submit.stdout[-3000:] + submit.stderr[-3000:]
    status = subprocess.run([*ray, "job", "status", "--address", ray_head, submission],
                            capture_output=True, text=True, env=_env(), timeout=60)
    assert "succeeded" in (status.stdout + status.stderr).lower() and "failed" not in status.stdout.lower()
    logs = subprocess.run([*ray, "job", "logs", "--address", ray_head, submission],
                          capture_output=True, text=True, env=_env(), timeout=60).stdout
    assert "progress: 8/8 samples (100.0%)" in logs and "samples/s" in logs and "ETA" in logs
    assert "wrote 8 rows to" in logs

    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["num_rows"] == 8 and manifest["job_id"] == "submit-test"
    assert len(manifest["shards"]) == 2 * 2  # 2 arms x 2 shards of one batch
    table = pq.read_table(output / "samples", partitioning=None)
    keys = sorted(zip(table.column("arm").to_pylist(), table.column("sample_id").to_pylist()))
    assert keys == sorted((arm, sid) for arm in ("target_only", "sd") for sid in range(4))
    assert sorted(table.column("class_label").to_pylist()) == [0, 0, 3, 3, 5, 5, 7, 7]


def test_submit_entrypoint_rejects_bad_input_before_ray(tmp_path):
    """Exit 2 naming the field, nothing written, without a cluster (no RAY_ADDRESS needed)."""
    job = small_job(tmp_path / "out")
    job["arms"][1]["params"] = {"gamma": 0}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "submit.py"), str(path), "--output",
                           str(tmp_path / "out")], capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2 and "error: arms[1].params.gamma: " in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "jobs" / "submit.py"), str(path), "--date", "2026-01-01"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 2 and "error: dataset: --date / --run-id need a job with a dataset: section" in proc.stderr


def test_example_specs_validate_and_fid50k_is_5000_per_class():
    from specray.spec import SpecError, load_job

    for name in ("fid50k", "nightly", "compare"):
        try:
            spec = load_job(REPO_ROOT / "jobs" / f"{name}.yaml")
        except SpecError as exc:
            if "not available in this install" in str(exc):
                pytest.skip(str(exc))
            raise
        if name == "fid50k":
            assert spec.num_samples == 50_000 and spec.conditions.per_class == 5000
            assert [a.method for a in spec.arms] == ["target_only", "sd", "cool_sd"]
        if name == "nightly":
            assert spec.dataset is not None and spec.dataset.partition == "date"
        if name == "compare":
            assert len(spec.arms) >= 3 and spec.eval.baseline == "target_only"
