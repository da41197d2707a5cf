"""Every real-checkpoint job in jobs/checkpoints/ validates, and its arms run end to end through
`specray run` on CPU with the tiny release-format fixtures in place of the released files (a few
samples per arm), and the reducer reports them. Class-label jobs and prompt jobs (LlamaGen t2i on
COCO captions: the small COCO-layout captions fixture and a T5 with random weights) alike."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specray.spec import SpecError, load_job
from tests.checkpoint_fixtures import tiny_t5_folder, with_tiny_checkpoints

REPO = Path(__file__).resolve().parents[1]
ALL_JOBS = sorted((REPO / "jobs" / "checkpoints").glob("*.yaml"))
JOBS = [p for p in ALL_JOBS if yaml.safe_load(p.read_text())["conditions"]["kind"] == "class_labels"]
PROMPT_JOBS = [p for p in ALL_JOBS if p not in JOBS]
CAPTIONS = REPO / "tests" / "fixtures" / "captions_val2017_small.json"
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


# ---- prompt jobs (LlamaGen text-to-image) --------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    return tiny_t5_folder(tmp_path_factory.mktemp("t5"))


def with_tiny_prompts(job: dict, output: str, t5: Path) -> dict:
    """A prompt job on the tiny fixtures: the COCO-layout captions fixture (first caption of each of its
    4 images, 2 samples each), the random T5 (16 wide, as the tiny t2i GPT's caption_dim), no
    alignment score (the digits score reads digit captions only; CLIP needs a model folder)."""
    tiny = with_tiny_checkpoints(job, output, [0], 1, 4)
    tiny["conditions"] = {**job["conditions"], "source": str(CAPTIONS), "captions": "first", "repeats": 2,
                          "encoder_path": str(t5)}
    tiny["eval"]["options"]["alignment"] = "none"
    return tiny


def test_prompt_jobs_are_the_t2i_release():
    assert [p.stem for p in PROMPT_JOBS] == ["llamagen_t2i_xl_coco"]
    job = raw(PROMPT_JOBS[0])
    assert job["conditions"]["encoder"] == "t5" and job["conditions"]["source"].endswith("captions_val2017.json")
    assert all(a["target"]["format"] == "llamagen-t2i" for a in job["arms"])


@pytest.mark.parametrize("path", PROMPT_JOBS, ids=lambda p: p.stem)
def test_prompt_job_refuses_absent_files(path, tmp_path):
    """Without the captions file, the T5 folder and the released files the job is refused before anything runs."""
    with pytest.raises(SpecError) as info:
        load_job({**raw(path), "output": str(tmp_path / "run")})
    assert "does not exist" in str(info.value) or "is not a folder" in str(info.value)


@pytest.mark.parametrize("path", PROMPT_JOBS, ids=lambda p: p.stem)
def test_prompt_job_validates_on_the_tiny_checkpoints(path, tmp_path, tiny_t5):
    job = raw(path)
    spec = load_job(with_tiny_prompts(job, str(tmp_path / "run"), tiny_t5))
    assert [a.name for a in spec.arms] == [a["name"] for a in job["arms"]]
    assert spec.conditions.prompts.num_prompts == 4 and spec.num_samples == 8
    assert spec.arms[0].params["cfg_scale"] == 7.5 and spec.arms[0].params["top_k"] == 1000  # the official sampler


@pytest.mark.slow
@pytest.mark.parametrize("path", PROMPT_JOBS, ids=lambda p: p.stem)
def test_prompt_job_runs_end_to_end_and_is_reduced(path, tmp_path, tiny_t5):
    """The t2i job's arms (target_only, sd, LANTERN++, COOL-SD) through `specray run`: T5 features in the
    actor, the caption prefix in the GPT, VQ-decoded images, prompt columns in the rows, the report."""
    job = with_tiny_prompts(raw(path), str(tmp_path / "run"), tiny_t5)
    for arm in job["arms"]:
        arm["target"] = {**arm["target"], "output_size": None}
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job))
    proc = subprocess.run([sys.executable, "-m", "specray.cli", "run", str(job_file), "--num-cpus", "2", "--quiet"],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    assert {a["arm"] for a in report["arms"]} == {a["name"] for a in job["arms"]}
    assert all(a["num_samples"] == 8 for a in report["arms"])
    import pyarrow.parquet as pq

    rows = pq.read_table(tmp_path / "run" / "samples", partitioning=None,
                         columns=["arm", "prompt_id", "prompt", "height", "num_tokens"]).to_pylist()
    assert len(rows) == 8 * len(job["arms"]) and all(r["prompt"] and r["height"] == 8 for r in rows)
    assert all(r["num_tokens"] == 16 for r in rows)
