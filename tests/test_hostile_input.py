"""Hostile and careless job input: each class is refused by name, in bounded time and memory, and
nothing is written or removed outside what the run owns.

The command-line cases run ``specray`` in a subprocess and measure that process alone: wall time,
and peak resident memory from ``os.wait4`` (the child's own rusage, not the test process's).
Before the bounds, a per_class of 10^9 grew past 2 GB while planning and an 843-byte alias bomb
ran for minutes; the limits asserted here are an order of magnitude above what the refusals take
on this (shared, noisy) 2-core machine and far below what the unbounded code needed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from specray.spec import JOB_FILE_MAX_BYTES, MAX_SAMPLES, YAML_MAX_NODES, SpecError, load_job, read_job_file
from tests.test_runtime import REPO_ROOT, UNLOADABLE, fake_family, fake_job, ray_local, run  # noqa: F401
from tests.test_validation import base_job

SECRET = "wJalrXUtnFEMIK7MDENGbPxRfiCYzEXAMPLEKEY"  # a fake secret that must never be printed
MAX_WALL_S = 30.0  # per refused command, Python start-up included (~2 s here)
MAX_RSS_MB = 400.0  # the validating process as a whole (Python, click, pydantic, PyYAML)


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file and folder under ``root`` with its size and mtime: 'nothing written or removed'."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.stat().st_size if p.is_file() else -1, p.stat().st_mtime_ns)
            for p in sorted(root.rglob("*"))}


# The command's own peak memory: VmHWM of its address space, written when it exits. (getrusage's
# maxrss would also count the pytest process it was forked from.)
_MEASURED_CLI = """
import atexit, os, sys
def _peak():
    with open("/proc/self/status") as status, open(os.environ["SPECRAY_TEST_PEAK"], "w") as out:
        out.write(next(line for line in status if line.startswith("VmHWM")).split()[1])
atexit.register(_peak)
from specray.cli import main
main(sys.argv[1:])
"""


def specray_cli(*args: str, cwd: Path, env: dict | None = None) -> tuple[int, str, float, float]:
    """Run ``specray ARGS`` in a subprocess: (exit code, stderr, wall seconds, peak RSS in MB of that command)."""
    peak_file = cwd / f".peak-{time.monotonic_ns()}"
    began = time.monotonic()
    done = subprocess.run([sys.executable, "-c", _MEASURED_CLI, *args], cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, timeout=300, env={
                              **os.environ, "PYTHONPATH": str(REPO_ROOT), "SPECRAY_TEST_PEAK": str(peak_file),
                              **(env or {})})
    wall = time.monotonic() - began
    peak_mb = int(peak_file.read_text()) / 1024.0
    peak_file.unlink()
    return done.returncode, done.stderr.decode(), wall, peak_mb


def assert_refused(code: int, stderr: str, wall: float, rss: float, starts: str) -> None:
    assert code == 2, stderr
    assert stderr.startswith(f"error: {starts}"), stderr
    assert "Traceback" not in stderr
    assert wall < MAX_WALL_S, f"refusal took {wall:.1f} s"
    assert rss < MAX_RSS_MB, f"refusal used {rss:.0f} MB"


# ---------------------------------------------------------------- unbounded work before any check


def test_a_billion_samples_per_class_is_refused_before_planning(tmp_path):
    out = tmp_path / "out"
    job = base_job(out)
    job["conditions"]["per_class"] = 10**9
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    for command in (["validate", str(path)], ["run", str(path), "--no-reduce", "--quiet"]):
        code, stderr, wall, rss = specray_cli(*command, cwd=tmp_path)
        assert_refused(code, stderr, wall, rss, "conditions.per_class: ")
        assert "must be at most 100000000" in stderr
    job["conditions"]["per_class"] = MAX_SAMPLES // 10 + 1  # each value fine, the product too large
    path.write_text(yaml.safe_dump(job))
    code, stderr, wall, rss = specray_cli("run", str(path), "--no-reduce", cwd=tmp_path)
    assert_refused(code, stderr, wall, rss, "conditions.per_class: ")
    assert f"more than the {MAX_SAMPLES} a job may have" in stderr and "split it" in stderr
    code, stderr, wall, rss = specray_cli("run", str(path), "--per-class", str(10**12), cwd=tmp_path)
    assert_refused(code, stderr, wall, rss, "conditions.per_class: ")
    assert not out.exists()


def test_a_job_at_the_bounds_validates_in_bounded_time_and_memory(tmp_path):
    """Positive control: 100 million samples in 97,657 shards per arm are planned arithmetically."""
    job = base_job(tmp_path / "out")
    job.update(batch_size=1024, shard_batches=1)
    job["conditions"]["per_class"] = MAX_SAMPLES // 10
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    done = subprocess.run([sys.executable, "-c", _MEASURED_CLI, "validate", str(path)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "SPECRAY_TEST_PEAK": str(tmp_path / "peak")})
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("ok: validation: 100000000 samples x 2 arms, 97657 shards of 1024")
    assert int((tmp_path / "peak").read_text()) / 1024 < MAX_RSS_MB
    assert not (tmp_path / "out").exists()


def test_too_many_shards_is_refused_with_the_reason():
    job = base_job("/tmp/unused-output")
    job.update(batch_size=1, shard_batches=1)
    job["conditions"]["per_class"] = 20_000  # 200,000 one-sample shards per arm
    with pytest.raises(SpecError) as info:
        load_job(job)
    assert info.value.field_path == "shard_batches"
    assert "the manifest lists every file" in info.value.message and "make shards larger" in info.value.message


ALIAS_BOMB = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
job_id: bomb
output: runs/bomb
arms: [*i]
"""


def test_yaml_alias_bomb_is_refused_before_it_is_built(tmp_path):
    path = tmp_path / "bomb.yaml"
    path.write_text(ALIAS_BOMB)
    assert len(ALIAS_BOMB) < 1000  # 9^9 = 387 million strings once expanded
    code, stderr, wall, rss = specray_cli("validate", str(path), cwd=tmp_path)
    assert_refused(code, stderr, wall, rss, f"job file {str(path)!r} expands to more than {YAML_MAX_NODES} YAML nodes")
    # Aliases within the limit still work (positive control): one arm's fields reused by the next.
    job = base_job(tmp_path / "out")
    arms_text = ("arms:\n  - &arm {name: target_only, method: target_only, family: discrete_ar, "
                 "target: digits-gpt-target, draft: digits-gpt-draft}\n  - {<<: *arm, name: sd, method: sd}\n")
    path.write_text(yaml.safe_dump({k: v for k, v in job.items() if k != "arms"}) + arms_text)
    spec = load_job(read_job_file(path))
    assert [a.name for a in spec.arms] == ["target_only", "sd"]


@pytest.mark.parametrize("kind", ["recursive alias", "deep nesting", "huge integer", "bad date", "binary", "set",
                                  "non-string key", "nested non-string key", "not UTF-8"])
def test_odd_yaml_is_refused_by_name(tmp_path, kind):
    text = {
        "recursive alias": "job_id: x\noutput: o\narms: &a [*a]\n",
        "deep nesting": "job_id: x\noutput: o\narms: " + "[" * 100 + "]" * 100 + "\n",
        "huge integer": "job_id: x\noutput: o\nseed: " + "9" * 100_000 + "\narms: []\n",
        "bad date": "job_id: x\noutput: o\nseed: 2026-13-45\narms: []\n",
        "binary": "job_id: !!binary aGVsbG8=\noutput: o\narms: []\n",
        "set": "job_id: x\noutput: o\nstorage_options: {config_kwargs: !!set {a, b}}\narms: []\n",
        "non-string key": "job_id: x\noutput: o\n7: seven\narms: []\n",
        "nested non-string key": "job_id: x\noutput: o\neval: {options: {1: 2}}\narms: []\n",
        "not UTF-8": None,
    }[kind]
    path = tmp_path / "job.yaml"
    if text is None:
        path.write_bytes(b"job_id: \xff\xfe\n")
    else:
        path.write_text(text)
    began = time.monotonic()
    with pytest.raises(SpecError) as info:
        load_job(str(path))
    assert time.monotonic() - began < 10
    message = str(info.value)
    named = {"recursive alias": "refers to no complete anchor", "deep nesting": "nests deeper than",
             "huge integer": "holds a value YAML cannot build", "bad date": "holds a value YAML cannot build",
             "binary": "job_id: must be a string, number, boolean, list or mapping, got a bytes", "set": "storage_options.config_kwargs",
             "non-string key": "7: unknown field",
             "nested non-string key": "eval.options.1: a key of type int; keys must be strings", "not UTF-8": "is not UTF-8"}[kind]
    assert named in message, message
    assert len(message) < 500  # never echoes the file


def test_a_50_mb_job_file_is_refused_unread(tmp_path):
    path = tmp_path / "big.yaml"
    with open(path, "w") as handle:
        handle.write("job_id: big\noutput: runs/big\narms: []\ncomment: |\n")
        line = "  " + "x" * 1022 + "\n"
        for _ in range(50 * 1024):
            handle.write(line)
    code, stderr, wall, rss = specray_cli("validate", str(path), cwd=tmp_path)
    assert_refused(code, stderr, wall, rss, f"job file {str(path)!r} is larger than {JOB_FILE_MAX_BYTES // 1024} KiB")
    assert wall < 10  # the 50 MB are never read: 1 MiB + 1 byte is


def test_special_files_are_refused(tmp_path):
    with pytest.raises(SpecError, match="not a regular file"):
        read_job_file(Path("/dev/zero"))  # infinite: refused, not read
    with pytest.raises(SpecError, match="does not exist"):
        read_job_file(tmp_path)


# ---------------------------------------------------------------- names


@pytest.mark.parametrize("field,value", [("job_id", "runs\n"), ("job_id", "../up"), ("job_id", "a/b"),
                                         ("job_id", "x" * 129), ("arms[0].name", "target_only\n"),
                                         ("arms[0].name", ".hidden"), ("arms[0].name", "sd "),
                                         ("dataset.run_id", "r1\n")])
def test_names_are_matched_in_full(tmp_path, field, value):
    job = base_job(tmp_path / "out")
    if field == "job_id":
        job["job_id"] = value
    elif field.startswith("arms"):
        job["arms"][0]["name"] = value
    else:
        job["dataset"] = {"partition": "run", "run_id": value}
    with pytest.raises(SpecError) as info:
        load_job(job)
    assert info.value.field_path == field
    assert "letters, digits, '_', '-', '.'" in info.value.message
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- credentials


def test_credentials_in_an_output_url_are_refused_and_never_echoed(tmp_path):
    url = f"s3://AKIAEXAMPLE:{SECRET}@bucket/runs/r1"
    job = base_job(url)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    for command in (["validate", str(path)], ["run", str(path), "--no-reduce"],
                    ["run", str(tmp_path / "ok.yaml"), "--output", url, "--no-reduce"]):
        (tmp_path / "ok.yaml").write_text(yaml.safe_dump(base_job(tmp_path / "out")))
        code, stderr, wall, rss = specray_cli(*command, cwd=tmp_path)
        assert_refused(code, stderr, wall, rss, "output: ")
        assert SECRET not in stderr and "AKIAEXAMPLE" not in stderr
        assert "s3://<redacted>@bucket/runs/r1" in stderr and "AWS_ACCESS_KEY_ID" in stderr
    for command in (["reduce", url], ["report", url], ["compare", url, str(tmp_path)]):
        code, stderr, _wall, _rss = specray_cli(*command, cwd=tmp_path)
        assert code == 2 and SECRET not in stderr and "Traceback" not in stderr, stderr
        assert "s3://<redacted>@bucket/runs/r1" in stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # the S3 client's connection retries against a closed port take ~20 s here
def test_credentials_in_an_endpoint_are_refused_and_redacted_wherever_quoted(tmp_path):
    job = base_job("s3://bucket/runs/r1")
    job["storage_options"] = {"endpoint_url": f"http://minio:{SECRET}@127.0.0.1:9/"}
    with pytest.raises(SpecError) as info:
        load_job(job)
    assert info.value.field_path == "storage_options.endpoint_url"
    assert SECRET not in str(info.value) and "<redacted>@127.0.0.1:9" in str(info.value)
    assert "AWS_ACCESS_KEY_ID" in str(info.value)
    # An endpoint from the environment is not the job's to refuse, but every message that quotes it
    # is redacted (here: nothing listens on port 9, so the write check fails and names the endpoint).
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(base_job("s3://bucket/runs/r1")))
    code, stderr, _wall, _rss = specray_cli("run", str(path), "--no-reduce", cwd=tmp_path, env={
        "AWS_ENDPOINT_URL": f"http://minio:{SECRET}@127.0.0.1:9", "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_EC2_METADATA_DISABLED": "true"})
    assert code == 2 and SECRET not in stderr, stderr
    assert "<redacted>@127.0.0.1:9" in stderr and "Traceback" not in stderr


def test_redaction_helpers():
    from specray.urls import has_userinfo, redact_url, redact_urls

    assert has_userinfo("s3://k:s@b/p") and not has_userinfo("s3://b/p@2026") and not has_userinfo("runs/a@b")
    assert redact_url(f"https://u:{SECRET}@h:9000/x?X-Amz-Signature=abc&part=2") == \
        "https://<redacted>@h:9000/x?X-Amz-Signature=<redacted>&part=2"
    assert redact_urls(f"failed at s3://k:{SECRET}@bucket/x and http://h/ok") == \
        "failed at s3://<redacted>@bucket/x and http://h/ok"


# ---------------------------------------------------------------- checkpoints no loader reads


def _safetensors(path: Path, metadata: dict | None) -> Path:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"w": np.zeros((2, 2), dtype=np.float32)}, str(path), metadata=metadata)
    return path


def test_checkpoints_no_loader_reads_are_refused_at_validation(tmp_path):
    from specray.models.presets import PRESETS, Preset, get_preset

    folder = tmp_path / "ckpt_dir"
    folder.mkdir()
    cases = {
        "a directory": (str(folder), "is a directory"),
        "a .pt pickle": (str(tmp_path / "gpt.pt"), "no loader reads a .pt file"),
        "a .pth pickle": (str(tmp_path / "gpt.pth"), "no loader reads a .pth file"),
        "a .bin file": (str(tmp_path / "gpt.bin"), "no loader reads a .bin file"),
        "a .ckpt file": (str(tmp_path / "gpt.ckpt"), "no loader reads a .ckpt file"),
        "safetensors without config": (str(_safetensors(tmp_path / "bare.safetensors", None)),
                                       "has no JSON 'config' entry"),
        "safetensors with a broken config": (str(_safetensors(tmp_path / "bad.safetensors", {"config": "{nope"})),
                                             "has no JSON 'config' entry"),
        "a URL": ("s3://bucket/gpt.safetensors", "is a URL"),
        "another suffix": (str(tmp_path / "weights.npz"), "is not a .safetensors file"),
        "a preset without weights": ("digits-gpt-ghost", "has no weights file"),
    }
    (tmp_path / "weights.npz").write_bytes(b"x")
    for name in ("gpt.pt", "gpt.pth", "gpt.bin", "gpt.ckpt"):
        (tmp_path / name).write_bytes(b"\x80\x04 a pickle")
    PRESETS["digits-gpt-ghost"] = Preset("digits-gpt-ghost", "discrete_ar", "target",
                                         dict(get_preset("digits-gpt-target").config))
    try:
        for case, (ref, words) in cases.items():
            job = base_job(tmp_path / "out")
            job["arms"][0]["target"] = ref
            with pytest.raises(SpecError) as info:
                load_job(job)
            assert info.value.field_path == "arms[0].target", case
            assert words in info.value.message, (case, info.value.message)
    finally:
        PRESETS.pop("digits-gpt-ghost", None)
    # Positive control: a safetensors file with its config (the preset's own weights) validates.
    job = base_job(tmp_path / "out")
    job["arms"][0]["target"] = str(get_preset("digits-gpt-target").weights_path)
    assert load_job(job).arms[0].target.endswith("digits-gpt-target.safetensors")
    assert not (tmp_path / "out").exists()


def test_a_loader_refusal_fails_the_job_at_once_naming_the_shard(ray_local, tmp_path):  # noqa: F811
    """A deterministic failure is not retried: one attempt, the shard and the cause in the error."""
    from specray.runtime.coordinator import ShardFailedError

    job = fake_job(tmp_path / "run", actors=2, max_shard_retries=5)
    job["arms"][1]["target"] = UNLOADABLE
    job["arms"][1]["name"] = "broken"
    began = time.monotonic()
    with pytest.raises(ShardFailedError) as info:
        run(job)
    message = str(info.value)
    assert "is not retried" in message and "shard " in message and "[broken]" in message
    assert "the loader refuses this checkpoint" in message
    assert time.monotonic() - began < 60
    assert not (tmp_path / "run" / "_manifest.json").exists()


# ---------------------------------------------------------------- files the run did not make


def test_cleanup_removes_only_the_runs_own_temps(ray_local, tmp_path):  # noqa: F811
    from specray.runtime.store import TEMP_MARKER, TEMP_TAG_PREFIX

    out = tmp_path / "run"
    job = fake_job(out)
    run(job)
    foreign = [out / ".notes.tmp-1", out / "samples" / "fake_sd" / f".x.parquet{TEMP_MARKER}dead",
               out / "samples" / f".shard-00000-of-00003.parquet{TEMP_MARKER}{TEMP_TAG_PREFIX}0123456789abcdef-{'0' * 32}"]
    for path in foreign:
        path.write_bytes(b"not this run's")
    before = tree(out)

    # A rerun into the finished run touches no foreign file (and has nothing to generate).
    result = run(job)
    assert result.tasks_run == 0
    assert all(p.read_bytes() == b"not this run's" for p in foreign)
    # A refused job (another seed into this output) writes and removes nothing at all.
    with pytest.raises(SpecError, match="seed was 7, now 8"):
        run({**job, "seed": 8})
    after = tree(out)
    assert {k: v for k, v in after.items() if "_manifest" not in k and "_job" not in k} == \
        {k: v for k, v in before.items() if "_manifest" not in k and "_job" not in k}
    # The run's own leftover (named with its fingerprint) is what a rerun removes.
    own = out / "samples" / "fake_sd" / \
        f".shard-00000-of-00003.parquet{TEMP_MARKER}{TEMP_TAG_PREFIX}{load_job(job).fingerprint()}-{'a' * 32}"
    own.write_bytes(b"partial")
    run(job)
    assert not own.exists() and all(p.exists() for p in foreign)


# ---------------------------------------------------------------- the local Ray listens on loopback

LISTENERS = """
import json, os, sys
import psutil
sys.path.insert(0, {root!r})
from specray.runtime import coordinator
if sys.argv[1] == "all-interfaces":  # negative control: Ray's own choice
    coordinator._loopback_only = __import__("contextlib").nullcontext
started = coordinator.connect_ray(num_cpus=1)
import ray
ray.get(ray.remote(lambda: 1).remote())  # a worker is up and listening too
listening = set()
for process in [psutil.Process(), *psutil.Process().children(recursive=True)]:
    try:
        for conn in process.net_connections(kind="inet"):
            if conn.status == psutil.CONN_LISTEN:
                listening.add((process.name(), conn.laddr.ip))
    except psutil.Error:
        pass
ray.shutdown()
print(json.dumps(sorted(listening)))
"""


@pytest.mark.slow
def test_the_local_ray_listens_on_loopback_only(tmp_path):
    def listeners(mode: str) -> list:
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        out = subprocess.run([sys.executable, "-c", LISTENERS.format(root=str(REPO_ROOT)), mode], env=env,
                             capture_output=True, text=True, timeout=240, cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    loopback = listeners("loopback")
    names = {name for name, _ip in loopback}
    assert {"gcs_server", "raylet"} <= names, loopback
    assert all(ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for _name, ip in loopback), loopback
    # Negative control: without the switch Ray's servers listen on every interface.
    everywhere = listeners("all-interfaces")
    assert any(ip not in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for _name, ip in everywhere), everywhere
