"""Every real-checkpoint job in jobs/checkpoints/ validates, and its arms run end to end through
`specray run` on CPU with the tiny release-format fixtures in place of the released files (a few
samples per arm), and the reducer reports them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specray.spec import SpecError, load_job
from tests.checkpoint_fixtures import with_tiny_checkpoints

REPO = Path(__file__).resolve().parents[1]
JOBS = sorted((REPO / "jobs" / "checkpoints").glob("*.yaml"))
# (classes, samples per class) of the tiny validation.
TINY = {"llamagen-xl-fid50k": ([0, 3, 7], 2), "ddpm-cifar10-fid50k": ([0], 6), "mar-h-cspd-fid50k": ([1, 4], 2),
        "dit-xl2-fid50k": ([2, 5], 3)}


def raw(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.stem)
def test_job_names_the_released_files_and_refuses_them_when_absent(path, tmp_path):
    """Without the released files the job is refused before anything runs, naming the missing file."""
    job = raw(path)
    assert job["conditions"]["per_class"] * (len(job["conditions"].get("classes", [])) or 1000) >= 50_000 or \
        job["conditions"].get("classes") == "all"
    with pytest.raises(SpecError) as info:
        load_job({**job, "output": str(tmp_path / "run")})
    assert info.value.field_path.startswith("arms[0].") and "does not exist" in str(info.value)


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.stem)
def test_job_validates_on_the_tiny_checkpoints(path, tmp_path):
    job = raw(path)
    spec = load_job(with_tiny_checkpoints(job, str(tmp_path / "run"), *TINY[job["job_id"]], 2))
    assert [a.name for a in spec.arms] == [a["name"] for a in job["arms"]]
    assert all(a.params == spec.arms[i].params for i, a in enumerate(spec.arms))


@pytest.mark.slow
def test_every_job_runs_end_to_end_and_is_reduced(tmp_path):
    """All the jobs' arms in one `specray run` (one Ray start and one reduction instead of four, to keep CI
    short): each job's arms with their methods and parameters on the tiny fixtures, 6 samples of class 0
    per arm (the DDPM is unconditional: one class), then the reducer's report covers every arm."""
    arms = []
    for path in JOBS:
        job = with_tiny_checkpoints(raw(path), "unused", [0], 6, 3)
        for arm in job["arms"]:
            arm = {**arm, "name": f"{path.stem}.{arm['name']}"}
            if arm["target"].get("format") == "llamagen-c2i":
                arm["target"] = {**arm["target"], "output_size": None}  # one image size (8 px) for the grid
            arms.append(arm)
    combined = {**with_tiny_checkpoints(raw(JOBS[0]), str(tmp_path / "run"), [0], 6, 3), "job_id": "all-releases",
                "arms": arms}
    combined["eval"].pop("baseline", None)  # each arm's baseline: its family's and target's target_only
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(combined))
    proc = subprocess.run([sys.executable, "-m", "specray.cli", "run", str(job_file), "--num-cpus", "2", "--quiet"],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    results = {a["arm"]: a for a in report["arms"]}
    assert set(results) == {a["name"] for a in arms}
    for arm in results.values():
        assert arm["num_samples"] == 6 and arm["fid"]["value"] is not None
        if arm["method"] != "target_only":
            assert arm["baseline"] is not None and arm["baseline"].endswith(".target_only")
