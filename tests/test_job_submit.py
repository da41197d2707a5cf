"""The README's cluster recipe, run as written against a local Ray head on loopback.

The head is started by this test as Ray 2.60 sets up token authentication (`ray get-auth-token
--generate`, then `ray start --head`, which turns token authentication on because a token exists),
with its own HOME (never the user's ~/.ray), free ports and its own --temp-dir, in its own process
session, and stopped by signalling that session only: never `ray stop`, which would stop every Ray
instance on the machine. Its PATH holds `ray` and a `python` without specray's dependencies (the
machine's system Python), the trap of a head started outside the environment: the recipe must not
depend on which `python` comes first. The `export` and `ray job submit` lines are read from
README.md and run by bash from a copy of the checkout, with only the job file, the output and the
dashboard address replaced. The job is tiny (the real discrete presets, 4 samples x 2 arms).
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
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tests.conftest import free_port

REPO_ROOT = Path(__file__).resolve().parents[1]
HEAD_START_TIMEOUT_S = 120
JOB_TIMEOUT_S = 300


README = REPO_ROOT / "README.md"
SUBMIT_TIMEOUT_S = 1200  # the first job on a node builds its runtime environment (a virtualenv + pip)


def _env() -> dict[str, str]:
    """The environment of the entrypoint test (no cluster): this interpreter's, no Ray address or auth."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0", PYTHONUNBUFFERED="1")
    return env


def _ray_cli() -> list[str]:
    ray = shutil.which("ray")
    return [ray] if ray else [sys.executable, "-m", "ray.scripts.scripts"]


def _cluster_env(root: Path) -> dict[str, str]:
    """A user's shell on the head: its own HOME, and a PATH with `ray` and the system `python` (no pyarrow)."""
    home, bin_dir = root / "home", root / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    home.mkdir(exist_ok=True)
    for name, target in (("ray", shutil.which("ray")), ("python", shutil.which("python3", path="/usr/bin:/bin"))):
        if target and not (bin_dir / name).exists():
            (bin_dir / name).symlink_to(target)
    keep = ("LANG", "LC_ALL", "TMPDIR", "SSL_CERT_FILE", "PIP_", "UV_")
    env = {k: v for k, v in os.environ.items() if k.startswith(keep)}
    env.update(HOME=str(home), PATH=f"{bin_dir}:/usr/bin:/bin", OMP_NUM_THREADS="1", RAY_USAGE_STATS_ENABLED="0",
               PYTHONUNBUFFERED="1")
    # The recipe is under test, not the CPU kernels: with its own HOME the job would compile them again
    # (about 45 s); they give torch's values, checked in test_decode_attention.
    env["SPECRAY_DECODE_KERNEL"] = "0"
    return env


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
    """A Ray head on loopback with token authentication, its own ports and temp dir; yields (URL, env)."""
    env = _cluster_env(tmp_path)
    subprocess.run(["ray", "get-auth-token", "--generate"], env=env, check=True, capture_output=True, timeout=120)
    assert (Path(env["HOME"]) / ".ray" / "auth_token").is_file()
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    dashboard_port = free_port()
    ports = {"--port": free_port(), "--dashboard-port": dashboard_port, "--ray-client-server-port": free_port(),
             "--dashboard-agent-listen-port": free_port(), "--dashboard-agent-grpc-port": free_port(),
             "--runtime-env-agent-port": free_port(), "--metrics-export-port": free_port(),
             "--node-manager-port": free_port(), "--object-manager-port": free_port()}
    command = ["ray", "start", "--head", "--block", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
               "--include-dashboard=true", "--num-cpus=2", "--num-gpus=0", f"--temp-dir={temp_dir}",
               "--disable-usage-stats", *[f"{flag}={port}" for flag, port in ports.items()]]
    log = open(tmp_path / "ray_head.log", "wb")
    head = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{dashboard_port}"
    try:
        deadline = time.monotonic() + HEAD_START_TIMEOUT_S
        while True:
            if head.poll() is not None:
                pytest.fail(f"ray start exited {head.returncode}:\n{(tmp_path / 'ray_head.log').read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/api/version", timeout=2):
                    break
            except urllib.error.HTTPError as exc:
                assert exc.code == 401, exc  # token authentication is on
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"the Ray dashboard did not answer at {url} within {HEAD_START_TIMEOUT_S} s")
                time.sleep(1)
        else:
            pytest.fail(f"{url}/api/version answered without a token: the head did not turn on token authentication")
        yield url, env
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


def readme_submit_lines() -> tuple[str, str]:
    """The README's `export RAY_ADDRESS=...` and `ray job submit ...` lines of the cluster recipe."""
    lines = [line.strip() for line in README.read_text().splitlines()]
    export = next(line for line in lines if line.startswith("export RAY_ADDRESS="))
    submit = next(line for line in lines if line.startswith("ray job submit "))
    return export, submit


def test_readme_recipe_names_the_runtime_env_and_token_mode():
    export, submit = readme_submit_lines()
    assert "RAY_AUTH_MODE=token" in export and "http://127.0.0.1:8265" in export
    assert "--runtime-env runtime_env.yaml" in submit and "-- python jobs/submit.py jobs/fid50k.yaml" in submit
    runtime_env = yaml.safe_load((REPO_ROOT / "runtime_env.yaml").read_text())
    assert runtime_env["working_dir"] == "." and runtime_env["pip"]["packages"] == ["${RAY_RUNTIME_ENV_CREATE_WORKING_DIR}"]


def _checkout_copy(dest: Path) -> Path:
    """The files of this checkout (tracked, and new ones git does not ignore), as a user's clone holds them."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


@pytest.mark.slow
@pytest.mark.timeout(SUBMIT_TIMEOUT_S + 300)
def test_readme_ray_job_submit_runs_on_a_token_authenticated_head(ray_head, tmp_path):
    from specray.models.presets import get_preset

    if not get_preset("digits-gpt-target").weights_path.exists():
        pytest.skip("discrete presets are not trained")
    url, env = ray_head
    checkout = _checkout_copy(tmp_path / "checkout")
    (checkout / "jobs" / "small.yaml").write_text(yaml.safe_dump(small_job(tmp_path / "out")))
    output = tmp_path / "out"
    export, submit = readme_submit_lines()
    export = export.replace("http://127.0.0.1:8265", url)
    submit = submit.replace("jobs/fid50k.yaml", "jobs/small.yaml").replace("s3://bucket/fid50k", str(output))

    # Negative control: without RAY_AUTH_MODE=token the client sends no token and the head refuses.
    refused = subprocess.run(["bash", "-c", f"ray job list --address {url}"], cwd=checkout, env=env,
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode != 0 and "Authentication required" in refused.stdout + refused.stderr

    run = subprocess.run(["bash", "-c", f"{export}\n{submit}"], cwd=checkout, env=env, capture_output=True,
                         text=True, timeout=SUBMIT_TIMEOUT_S)
    logs = run.stdout + run.stderr
    assert run.returncode == 0, logs[-5000:]
    assert "succeeded" in logs.lower()
    assert "progress: 8/8 samples (100.0%)" in logs and "samples/s" in logs and "ETA" in logs
    assert "wrote 8 rows to" in logs

    manifest = json.loads((output / "_manifest.json").read_text())
    assert manifest["num_rows"] == 8 and manifest["job_id"] == "submit-test"
    assert len(manifest["shards"]) == 2 * 2  # 2 arms x 2 shards of one batch
    table = pq.read_table(output / "samples")
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
