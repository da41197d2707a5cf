"""Prompt jobs end to end: validation, the plan, the actor's encoding, determinism, resume, the reducer.

The runs use ``digits-gpt-text-draft`` as both target and draft (one layer: seconds per shard on a
CPU), with 12 of the built-in prompts (``builtin:digits-captions``) repeated 3 times.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from specray.spec import SpecError, load_job

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TINY = "digits-gpt-text-draft"


def prompt_job(output, **conditions) -> dict:
    return {
        "job_id": "prompts", "seed": 3, "output": str(output), "batch_size": 6, "shard_batches": 2,
        "conditions": {"kind": "prompts", "source": "builtin:digits-captions", "subset": {"first": 12},
                       "repeats": 3, **conditions},
        "arms": [{"name": "target_only", "family": "discrete_ar", "method": "target_only", "target": TINY,
                  "draft": TINY},
                 {"name": "sd", "family": "discrete_ar", "method": "sd", "target": TINY, "draft": TINY}],
    }


def images_by_prompt(output: Path) -> dict[tuple[str, str, int], bytes]:
    rows = pq.read_table(output / "samples", partitioning=None,
                         columns=["arm", "prompt_id", "repeat", "image"]).to_pylist()
    keys = [(r["arm"], r["prompt_id"], r["repeat"]) for r in rows]
    assert len(keys) == len(set(keys)), "an (arm, prompt_id, repeat) appears twice"
    return {k: r["image"]["bytes"] for k, r in zip(keys, rows)}


# ---- validation (torch-free, before Ray) ---------------------------------------------------------


def test_a_prompt_job_validates_with_its_prompt_set_in_the_fingerprint(tmp_path):
    spec = load_job(prompt_job(tmp_path / "run"))
    assert spec.num_samples == 36 and spec.conditions.prompts.num_prompts == 12
    assert spec.conditions.prompts.encoder == "minilm"  # the presets' own encoder
    recorded = spec.to_dict()["conditions"]
    assert recorded["digest"] == spec.conditions.prompts.digest and recorded["subset"] == {"first": 12}
    again = load_job({**prompt_job(tmp_path / "run"), "conditions": recorded})  # a recorded job loads again
    assert again.fingerprint() == spec.fingerprint()
    other = load_job(prompt_job(tmp_path / "run", subset={"first": 11}))
    assert other.fingerprint() != spec.fingerprint()
    # the same prompts from a file elsewhere: the same samples, so the same fingerprint
    source = tmp_path / "p.jsonl"
    rows = [json.loads(line) for line in
            (Path(__file__).parents[1] / "specray/data/digits_captions_heldout.jsonl").read_text().splitlines()[:12]]
    source.write_text("".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}) + "\n" for r in rows))
    moved = load_job(prompt_job(tmp_path / "run", source=str(source), subset=None))
    assert moved.fingerprint() == spec.fingerprint()


@pytest.mark.parametrize("change,field,words", [
    ({"source": None}, "conditions.source", "is required for prompts"),
    ({"format": "xml"}, "conditions.format", "must be one of auto, coco"),
    ({"subset": {"first": 0}}, "conditions.subset.first", "must be an integer >= 1"),
    ({"subset": {"head": 3}}, "conditions.subset", "must be {first: N} or {sample: N, seed: S}"),
    ({"repeats": 0}, "conditions.repeats", "must be an integer >= 1"),
    ({"encoder": "clip"}, "conditions.encoder", "must be one of minilm, t5"),
    ({"encoder": "t5"}, "conditions.encoder_path", "must be a non-empty string"),
    ({"encoder_path": "/x"}, "conditions.encoder_path", "only the t5 encoder reads a folder"),
    ({"source": "builtin:nope"}, "conditions.source", "unknown built-in prompt set"),
    ({"source": "/nonexistent/p.jsonl"}, "conditions.source", "does not exist"),
    ({"source": "s3://key:secret@bucket/p.jsonl"}, "conditions.source", "carries credentials"),
    ({"per_class": 3}, "conditions", "unknown field"),
    ({"digest": "0" * 16}, "conditions.digest", "the prompt set changed"),
])
def test_bad_prompt_conditions_are_refused_by_field(tmp_path, change, field, words):
    job = prompt_job(tmp_path / "run", **change)
    job["conditions"] = {k: v for k, v in job["conditions"].items() if v is not None}
    with pytest.raises(SpecError) as caught:
        load_job(job)
    assert caught.value.field_path.startswith(field) and words in caught.value.message, str(caught.value)
    assert "secret" not in str(caught.value)


def test_a_malformed_prompt_file_is_refused_naming_its_column(tmp_path):
    source = tmp_path / "p.jsonl"
    source.write_text('{"id": 1, "prompt": "a seven"}\n{"id": 1, "prompt": "a one"}\n')
    with pytest.raises(SpecError, match=r"^conditions\.id: .*duplicate prompt id '1'"):
        load_job(prompt_job(tmp_path / "run", source=str(source), subset=None))


def test_models_must_match_the_condition_kind(tmp_path):
    job = prompt_job(tmp_path / "run")
    job["arms"][1]["draft"] = "digits-gpt-draft"
    with pytest.raises(SpecError, match=r"^arms\[1\]\.draft: 'digits-gpt-draft' is class-conditioned but "
                                        r"conditions\.kind is 'prompts'"):
        load_job(job)
    job = prompt_job(tmp_path / "run")
    job["conditions"] = {"kind": "class_labels", "per_class": 2}
    with pytest.raises(SpecError, match=r"^arms\[0\]\.target: .* is text-conditioned but conditions\.kind is "
                                        r"'class_labels'"):
        load_job(job)


def test_a_text_to_image_release_takes_prompts_only(tmp_path):
    from tests.checkpoint_fixtures import llamagen_t2i_draft, llamagen_t2i_target

    job = prompt_job(tmp_path / "run")
    job["arms"] = [{"name": "t2i", "family": "discrete_ar", "method": "target_only", "target": llamagen_t2i_target(),
                    "draft": llamagen_t2i_draft()}]
    job["conditions"] = {"kind": "class_labels", "per_class": 2, "classes": [0, 1]}
    with pytest.raises(SpecError, match=r"^arms\[0\]\.target: .* is text-conditioned but conditions\.kind is "
                                        r"'class_labels'"):
        load_job(job)


def test_the_plan_shows_prompt_i_mod_p_and_lists_each_shards_prompts(tmp_path):
    import torch

    from specray.runtime.plan import ShardPlan

    plan = ShardPlan.of(load_job(prompt_job(tmp_path / "run")))  # 36 samples, shards of 12, 12 prompts
    assert plan.layout()["num_prompts"] == 12 and plan.num_shards == 3
    assert plan.labels(torch.arange(30, 36)).tolist() == [6, 7, 8, 9, 10, 11]
    assert [sorted(plan.prompt_indices(s)) for s in plan.shards()] == [list(range(12))] * 3
    small = ShardPlan(36, 6, 1, None, 12)
    assert small.prompt_indices(small.shard(3)) == [6, 7, 8, 9, 10, 11]


# ---- the actor: one encoder call per shard -------------------------------------------------------


def test_prompts_are_encoded_once_per_actor_per_shard(tmp_path):
    from specray.runtime.actor import ShardWorker
    from specray.runtime.coordinator import plan_tasks
    from specray.runtime.plan import ShardPlan
    from specray.runtime.store import RunStore

    job = prompt_job(tmp_path / "run", subset={"first": 24}, repeats=1)  # 24 prompts: 2 shards of 12
    spec = load_job(job)
    worker = ShardWorker(spec)
    tasks, _ = plan_tasks(spec, ShardPlan.of(spec), RunStore(spec.output))
    assert len(tasks) == 2 and all(len(t.prompts) == 12 for t in tasks)
    worker.run_task(tasks[0])
    cache = worker._prompt_cache
    assert (cache.calls, cache.encoded) == (1, 12)  # both arms, both batches: one call
    worker.run_task(tasks[1])
    assert (cache.calls, cache.encoded) == (2, 24)
    rows = pq.read_table(tmp_path / "run" / "samples" / "sd", partitioning=None).to_pylist()
    assert [r["sample_id"] for r in rows] == list(range(24))
    assert all(r["class_label"] == -1 and r["repeat"] == 0 for r in rows)
    assert [r["prompt_id"] for r in rows] == list(spec.prompt_set().ids)


# ---- runs through Ray: determinism, resume, the reducer --------------------------------------------


@pytest.fixture(scope="module")
def ray_cpus():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, runtime_env={
        "env_vars": {"PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}})
    yield
    ray.shutdown()


def _run(job: dict, **kwargs):
    from specray.runtime.coordinator import run_job

    return run_job(load_job(job), show_progress=False, **kwargs)


@pytest.mark.slow
def test_prompt_runs_are_byte_identical_across_actor_counts_and_shard_sizes_and_resume(ray_cpus, tmp_path):
    reference = tmp_path / "a"
    _run(prompt_job(reference), actors=2)
    wide = tmp_path / "b"
    _run({**prompt_job(wide), "shard_batches": 3}, actors=1)
    expected = images_by_prompt(reference)
    assert len(expected) == 2 * 36 and images_by_prompt(wide) == expected
    # A killed run: one shard file and the manifest gone. The rerun makes only that shard again.
    missing = reference / "samples" / "sd" / "shard-00001-of-00003.parquet"
    missing.unlink()
    (reference / "_manifest.json").unlink()
    kept = {p: p.stat().st_mtime_ns for p in (reference / "samples").rglob("*.parquet")}
    result = _run(prompt_job(reference), actors=2)
    assert result.tasks_run == 1 and missing.exists()
    assert all(p.stat().st_mtime_ns == t for p, t in kept.items())
    assert images_by_prompt(reference) == expected


@pytest.mark.slow
def test_the_reducer_scores_alignment_with_the_shuffled_control(ray_cpus, tmp_path):
    from specray.eval.reduce import reduce_run

    out = tmp_path / "run"
    _run(prompt_job(out, subset={"first": 40}, repeats=1), actors=1)
    report = reduce_run(str(out), print_table=False)
    by_arm = {a["arm"]: a for a in report["arms"]}
    for arm in ("target_only", "sd"):
        align = by_arm[arm]["alignment"]
        assert align["scorer"] == "digits" and align["num_samples"] == 40
        assert align["ci"][0] <= align["value"] <= align["ci"][1]
        assert 0.0 <= align["shuffled"] <= 1.0
    diff = by_arm["sd"]["alignment"]["diff_vs_baseline"]
    assert diff["baseline"] == "target_only" and diff["ci"][0] <= diff["value"] <= diff["ci"][1]
    markdown = (out / "report" / "report.md").read_text()
    assert "## Text-image alignment" in markdown and "| sd |" in markdown


@pytest.mark.slow
def test_the_nightly_prompt_dataset_opens_with_an_image_column_and_text_prompts(ray_cpus, tmp_path):
    datasets = pytest.importorskip("datasets")
    from specray.runtime.dataset import run_dataset_job
    from specray.spec import read_job_file

    job = read_job_file(Path(__file__).parents[1] / "jobs" / "nightly_prompts.yaml")
    job["output"] = str(tmp_path / "nightly")
    job["conditions"] = {**job["conditions"], "subset": {"first": 12}, "repeats": 1}
    job["arms"] = [{**job["arms"][0], "target": TINY, "draft": TINY}]  # the one-layer model: fast
    job["dataset"] = {**job["dataset"], "date": "2026-11-30"}
    result = run_dataset_job(load_job(job), show_progress=False)
    assert result.num_rows == 12 and result.partition == "date=2026-11-30"
    files = sorted(str(p) for p in (tmp_path / "nightly" / "data").rglob("*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert isinstance(ds.features["image"], datasets.Image) and ds.features["prompt"].dtype == "string"
    assert ds[0]["image"].size == (8, 8) and ds[0]["prompt"] == load_job(job).prompt_set().texts[0]
    card = (tmp_path / "nightly" / "README.md").read_text()
    assert "Conditioned on text prompts: 12 prompts from `builtin:digits-captions`" in card
