"""The command line: bad input exits non-zero naming the field and writes nothing; run -> reduce."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import yaml
from click.testing import CliRunner

from specray.cli import specray
from tests.test_runtime import fake_family, fake_job, images_by_key, ray_local  # noqa: F401  (fixtures)


def _write(tmp_path, job: dict):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def test_bad_spec_exits_2_naming_the_field_in_a_subprocess(tmp_path):
    """The installed entry point, no fixtures: an unknown family and a malformed file."""
    out = tmp_path / "out"
    job = {"output": str(out), "arms": [
        {"name": "a", "family": "discrete_ar", "method": "target_only", "target": "digits-gpt-target"},
        {"name": "b", "family": "no_such_family", "method": "sd", "target": "digits-gpt-target"}]}
    proc = subprocess.run([sys.executable, "-m", "specray.cli", "run", str(_write(tmp_path, job)), "--no-reduce"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "error: arms[1].family: unknown family 'no_such_family'; allowed: " in proc.stderr
    assert "discrete_ar" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("arms: [\n")
    proc = subprocess.run([sys.executable, "-m", "specray.cli", "validate", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not valid YAML at line" in proc.stderr


BAD = [
    ("arms[1].params.gamma", lambda j: j["arms"][1].update(params={"gamma": 0})),
    ("arms[1].name", lambda j: j["arms"][1].update(name="target_only")),
    ("arms[1].method", lambda j: j["arms"][1].update(method="nope")),
    ("arms[0].target", lambda j: j["arms"][0].update(target="missing-preset")),
    ("conditions.classes[0]", lambda j: j["conditions"].update(classes=[9])),
    ("conditions.per_class", lambda j: j["conditions"].update(per_class=0)),
    ("batch_size", lambda j: j.update(batch_size=-1)),
]


@pytest.mark.parametrize("field,mutate", BAD, ids=[b[0] for b in BAD])
def test_bad_spec_run_exits_2_and_writes_nothing(fake_family, tmp_path, field, mutate):  # noqa: F811
    out = tmp_path / "out"
    job = fake_job(out)
    mutate(job)
    result = CliRunner().invoke(specray, ["run", str(_write(tmp_path, job)), "--no-reduce"])
    assert result.exit_code == 2
    assert f"error: {field}: " in result.stderr
    assert not out.exists()


def test_bad_overrides_are_named(fake_family, tmp_path):  # noqa: F811
    out = tmp_path / "out"
    path = _write(tmp_path, fake_job(out))
    result = CliRunner().invoke(specray, ["run", str(path), "--per-class", "0"])
    assert result.exit_code == 2 and "conditions.per_class" in result.stderr
    result = CliRunner().invoke(specray, ["run", str(path), "--num-cpus", "0"])
    assert result.exit_code == 2 and "--num-cpus" in result.stderr
    assert not out.exists()


def test_validate_prints_the_plan(fake_family, tmp_path):  # noqa: F811
    result = CliRunner().invoke(specray, ["validate", str(_write(tmp_path, fake_job(tmp_path / "o")))])
    assert result.exit_code == 0 and "24 samples x 2 arms, 3 shards of 8" in result.stdout


def test_run_then_reduce(ray_local, tmp_path, monkeypatch):  # noqa: F811
    calls = []
    reducer = types.ModuleType("specray.eval.reduce")
    reducer.reduce_run = lambda run_dir, *, print_table=True, storage_options=None, partial=False: calls.append(
        (run_dir, print_table)) or {}
    monkeypatch.setitem(sys.modules, "specray.eval.reduce", reducer)

    no_fid = tmp_path / "no_fid"
    result = CliRunner().invoke(specray, ["run", str(_write(tmp_path, fake_job(no_fid, actors=1))), "--quiet"])
    assert result.exit_code == 0 and "eval.fid is false: not scoring" in result.stdout and calls == []

    out = tmp_path / "out"
    path = _write(tmp_path, fake_job(tmp_path / "ignored", eval={"fid": True}))
    result = CliRunner().invoke(specray, ["run", str(path), "--output", str(out), "--actors", "1",
                                          "--per-class", "2", "--quiet"])
    assert result.exit_code == 0, result.output
    assert "wrote 16 rows" in result.stdout
    assert calls == [(str(out), True)]
    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["spec"]["actors"] == 1 and manifest["layout"]["num_samples"] == 8
    assert len(images_by_key(out)) == 16

    assert CliRunner().invoke(specray, ["reduce", str(out)]).exit_code == 0 and len(calls) == 2
    missing = CliRunner().invoke(specray, ["report", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "_manifest.json" in missing.stderr


@pytest.mark.parametrize("given, expected", [(None, "4"), ("12", "12")])
def test_importing_specray_first_stops_openblas_spinning_unless_told_otherwise(given, expected):
    """numpy loaded after ``import specray`` gets OPENBLAS_THREAD_TIMEOUT=4 (its workers sleep at once instead
    of holding the cores torch's threads wait for in the reducer); a value the user set is kept."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_THREAD_TIMEOUT"}
    if given is not None:
        env["OPENBLAS_THREAD_TIMEOUT"] = given
    code = "import os, specray, numpy; print(os.environ['OPENBLAS_THREAD_TIMEOUT'])"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == expected
