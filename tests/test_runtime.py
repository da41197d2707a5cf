"""Runtime: shard plan, store, coordinator and actors, on a local Ray with 2 CPUs.

The end-to-end tests use a small "fake" family defined in this module (a
per-pixel categorical sampler over a seeded linear model, keyed by
``specray.rng`` exactly like the real loops) so they exercise the runtime in
a few seconds each and are independent of the model families. Ray workers get
it through ``worker_process_setup_hook``. The real discrete family is run end
to end by ``test_discrete_family_end_to_end`` when its presets are trained.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Literal

import pyarrow.parquet as pq
import pytest
import torch

from specray import rng
from specray.families import Family, Method, register_family, resolve, unregister_family
from specray.methods.common import GenerationResult, SampleStats
from specray.methods.params import Gamma, MethodParams
from specray.models.pair import ModelPair
from specray.runtime.hardware import device_name
from specray.runtime.images import encode_png
from specray.runtime.plan import ShardPlan, shard_relpath
from specray.runtime.store import SAMPLE_SCHEMA, TEMP_MARKER, TEMP_TAG_PREFIX
from specray.spec import SpecError, load_job
from tests.test_parquet_reads import refuse_dataset_reads

REPO_ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------- the fake family

FAKE_FAMILY = "fake"
NUM_CLASSES = 4
IMAGE_SIDE = 6
LEVELS = 17

class FakeTargetOnly(MethodParams):
    @property
    def lossless(self) -> bool:
        return True


class FakeSD(MethodParams):
    gamma: Gamma = 2


class Flaky(MethodParams):
    marker_dir: str = ""
    fail_sample_ids: list[int] = []
    fail_mode: Literal["raise", "exit"] = "raise"
    times: int = 1


UNLOADABLE = "fake-unloadable"  # a preset whose loader refuses it, the same way on every actor


def load_pair(target: str, draft: str | None, device: torch.device) -> ModelPair:
    if UNLOADABLE in (target, draft):
        raise ValueError(f"{UNLOADABLE}: the loader refuses this checkpoint (unsupported key layout)")

    def model(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Linear(NUM_CLASSES, IMAGE_SIDE * IMAGE_SIDE * LEVELS).to(device)

    return ModelPair(FAKE_FAMILY, target, draft, model(1), model(2) if draft else None, device, {})


def run_batch(method, params, pair, labels, sample_ids, seed) -> GenerationResult:
    method, params = resolve(FAKE_FAMILY, method, params)
    if method.name == "flaky":
        _maybe_fail(params, sample_ids)
    onehot = torch.nn.functional.one_hot(labels, NUM_CLASSES).float().to(pair.device)
    with torch.no_grad():
        logits = pair.target(onehot).view(len(labels), IMAGE_SIDE * IMAGE_SIDE, LEVELS)
    probs = torch.softmax(logits.double(), dim=-1)
    positions = torch.arange(IMAGE_SIDE * IMAGE_SIDE)
    tokens = rng.categorical(probs, seed, sample_ids[:, None], "target", positions[None, :])
    images = (tokens * 255 // (LEVELS - 1)).to(torch.uint8).view(-1, IMAGE_SIDE, IMAGE_SIDE).cpu()
    num_tokens = IMAGE_SIDE * IMAGE_SIDE
    gamma = getattr(params, "gamma", 0)
    stats = []
    for sid in sample_ids.tolist():
        accepted = int(rng.uniform(seed, sid, "accept") * gamma * 10) if gamma else 0
        calls = num_tokens if not gamma else -(-num_tokens // (gamma + 1))
        stats.append(SampleStats(num_tokens=num_tokens, num_spec_steps=calls if gamma else 0,
                                 num_draft_tokens=10 * gamma, num_accepted_draft_tokens=accepted,
                                 accepted_per_position=[accepted // max(gamma, 1)] * gamma, target_calls=calls,
                                 draft_calls=calls * gamma, extra={"fake": True}))
    return GenerationResult(images=images, stats=stats)


def _maybe_fail(params: Flaky, sample_ids: torch.Tensor) -> None:
    """Fail the first ``times`` attempts at a batch holding one of ``fail_sample_ids`` (marker files count)."""
    for sid in params.fail_sample_ids:
        if sid in sample_ids.tolist():
            marker = Path(params.marker_dir) / f"attempts-{sid}"
            attempts = int(marker.read_text()) if marker.exists() else 0
            if attempts < params.times:
                marker.write_text(str(attempts + 1))
                if params.fail_mode == "exit":
                    os._exit(1)  # the worker process dies mid-shard, like a SIGKILL
                raise RuntimeError(f"injected failure at sample {sid} (attempt {attempts + 1})")


FAKE = Family(
    name=FAKE_FAMILY, summary="a per-pixel categorical sampler for runtime tests",
    methods={"target_only": Method("target_only", FakeTargetOnly), "fake_sd": Method("fake_sd", FakeSD),
             "flaky": Method("flaky", Flaky)},
    loop=lambda: run_batch, load_pair=lambda: load_pair, trainer=lambda: None,
)


def install_fake_family() -> None:
    """Register the fake family and its presets (idempotent; runs in the driver and every worker)."""
    from specray.models.presets import PRESETS, Preset, _load_all

    _load_all()
    register_family(FAKE)
    for name, role in (("fake-target", "target"), ("fake-draft", "draft"), (UNLOADABLE, "target")):
        PRESETS.setdefault(name, Preset(name, FAKE_FAMILY, role, {"num_classes": NUM_CLASSES}))


def uninstall_fake_family() -> None:
    from specray.models.presets import PRESETS

    unregister_family(FAKE_FAMILY)
    for name in ("fake-target", "fake-draft", UNLOADABLE):
        PRESETS.pop(name, None)


def fake_job(output: Path, **fields) -> dict:
    job = {
        "job_id": "fake-test",
        "seed": 7,
        "output": str(output),
        "conditions": {"kind": "class_labels", "per_class": 6, "classes": "all"},
        "batch_size": 4,
        "shard_batches": 2,
        "actors": 2,
        "arms": [
            {"name": "target_only", "family": FAKE_FAMILY, "method": "target_only",
             "target": "fake-target", "draft": "fake-draft"},
            {"name": "fake_sd", "family": FAKE_FAMILY, "method": "fake_sd",
             "target": "fake-target", "draft": "fake-draft", "params": {"gamma": 3}},
        ],
        "eval": {"fid": False},
    }
    if "shard_size" in fields:
        del job["shard_batches"]
    job.update(fields)
    return job


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def fake_family():
    install_fake_family()
    yield
    uninstall_fake_family()


@pytest.fixture(scope="module")
def ray_local(fake_family):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, runtime_env={
        "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                     "OMP_NUM_THREADS": "1"},
        "worker_process_setup_hook": f"{__name__}.install_fake_family",
    })
    yield ray
    ray.shutdown()


def run(job: dict, **kwargs):
    from specray.runtime.coordinator import run_job

    return run_job(load_job(job), show_progress=False, **kwargs)


def images_by_key(output: Path) -> dict[tuple[str, int], bytes]:
    # '.'-prefixed temp files would be skipped by the dataset reader.
    table = pq.read_table(output / "samples", partitioning=None)
    rows = table.select(["arm", "sample_id", "image"]).to_pylist()
    keys = [(r["arm"], r["sample_id"]) for r in rows]
    assert len(keys) == len(set(keys)), "a (arm, sample_id) appears twice"
    return {(r["arm"], r["sample_id"]): r["image"]["bytes"] for r in rows}


def all_files(output: Path) -> list[str]:
    return sorted(str(p.relative_to(output)) for p in output.rglob("*") if p.is_file())


# ---------------------------------------------------------------- plan (no Ray)


@pytest.mark.parametrize("num_samples,batch_size,shard_batches", [(24, 4, 2), (25, 4, 3), (7, 8, 1), (100, 7, 4)])
def test_plan_covers_every_sample_once_in_batch_aligned_shards(num_samples, batch_size, shard_batches):
    plan = ShardPlan(num_samples, batch_size, shard_batches, classes=(0, 1, 2))
    seen = []
    batches = []
    for shard in plan.shards():
        assert shard.start % batch_size == 0
        batches.extend(shard.batch_ranges())
        seen.extend(range(shard.start, shard.stop))
    assert seen == list(range(num_samples))
    assert len(plan.shards()) == plan.num_shards == -(-plan.num_batches // shard_batches)
    # Batch composition is a function of batch size alone, not of the shard size.
    for other in (1, 2, 5):
        regrouped = [b for s in ShardPlan(num_samples, batch_size, other, (0, 1, 2)).shards() for b in s.batch_ranges()]
        assert regrouped == batches
    sample_ids, labels = plan.batch(0, min(6, num_samples))
    assert labels.tolist() == [i % 3 for i in sample_ids.tolist()]


def test_shard_names_are_deterministic_and_sortable():
    assert shard_relpath("sd", 3, 12) == "samples/sd/shard-00003-of-00012.parquet"
    names = [shard_relpath("a", k, 120000) for k in (2, 10, 100000)]
    assert names == sorted(names)


def test_png_encoding_is_deterministic():
    image = (torch.arange(64).view(8, 8) * 4).to(torch.uint8).numpy()
    assert encode_png(image) == encode_png(image.copy())
    import io

    from PIL import Image

    assert (torch.from_numpy(__import__("numpy").array(Image.open(io.BytesIO(encode_png(image))))) ==
            torch.from_numpy(image)).all()


@pytest.mark.parametrize("mode", ["L", "RGB", "P", "1", "I;16", "LA", "RGBA"])
@pytest.mark.parametrize("fmt", ["PNG", "TIFF"])
def test_decode_image_gives_every_mode_as_converting_it_does(mode, fmt):
    """decode_image reads PNGs without probing other formats and grey / RGB images without converting
    them: the same arrays as converting every image (grey modes to L, the rest to RGB), for PNG and for a
    format it has to probe (TIFF)."""
    import io

    import numpy as np
    from PIL import Image

    from specray.runtime.images import decode_image

    pixels = np.random.default_rng(0).integers(0, 256, (5, 7, 4), dtype=np.uint8)
    base = Image.fromarray(pixels if "A" in mode else pixels[..., :3])  # RGBA or RGB
    image = base.convert(mode if mode != "I;16" else "I").convert(mode)
    buffer = io.BytesIO()
    image.save(buffer, format=fmt)
    with Image.open(io.BytesIO(buffer.getvalue())) as opened:
        want = np.asarray(opened.convert("L") if opened.mode in ("L", "P", "1", "I;16") else opened.convert("RGB"))
    got = decode_image(buffer.getvalue())
    assert got.dtype == np.uint8 and got.shape == want.shape and np.array_equal(got, want)
    assert got.ndim == (2 if mode in ("L", "P", "1", "I;16") else 3)


# ---------------------------------------------------------------- end to end (Ray)


@pytest.fixture(scope="module")
def reference_run(ray_local, tmp_path_factory):
    """The fake job with 2 actors and 2-batch shards; other tests compare against it."""
    out = tmp_path_factory.mktemp("reference") / "run"
    result = run(fake_job(out, actors=2, shard_batches=2))
    return out, result


def test_end_to_end_writes_all_shards_and_manifest(reference_run):
    out, result = reference_run
    plan = ShardPlan(24, 4, 2, (0, 1, 2, 3))
    expected = sorted([shard_relpath(arm, k, plan.num_shards) for arm in ("target_only", "fake_sd")
                       for k in range(plan.num_shards)] + ["_job.json", "_manifest.json"])
    assert all_files(out) == expected  # no temp files, nothing else
    assert result.tasks_run == plan.num_shards and result.retries == 0 and result.actors == 2

    table = pq.read_table(out / shard_relpath("fake_sd", 0, plan.num_shards))
    assert table.schema.names == SAMPLE_SCHEMA.names
    assert table.schema.field("image").type == SAMPLE_SCHEMA.field("image").type
    row = table.to_pylist()[0]
    assert row["job_id"] == "fake-test" and row["arm"] == "fake_sd" and row["seed"] == 7
    assert row["image"]["bytes"].startswith(b"\x89PNG") and (row["height"], row["width"]) == (6, 6)
    assert len(row["accepted_per_position"]) == 3 and json.loads(row["params"]) == {"gamma": 3}
    assert json.loads(row["extra_stats"]) == {"fake": True}
    assert row["sample_wall_time_s"] == pytest.approx(row["batch_wall_time_s"] / row["batch_size"])
    assert row["device"] == "cpu" and row["mean_acceptance_length"] == pytest.approx(36 / 9)

    manifest = json.loads((out / "_manifest.json").read_text())
    assert manifest["num_rows"] == 48 and len(manifest["shards"]) == 2 * plan.num_shards
    for entry in manifest["shards"]:
        data = (out / entry["path"]).read_bytes()
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
        assert entry["rows"] == pq.ParquetFile(out / entry["path"]).metadata.num_rows
    assert manifest["spec"]["arms"][1]["params"] == {"gamma": 3}
    assert set(manifest["versions"]) >= {"specray", "torch", "ray", "pyarrow"}
    # The devices of the actors that came up before the last shard committed: under load the second
    # actor may still be starting when the first has run all 3 shards (seen in CI).
    assert manifest["timings"]["devices"] in (["cpu"], ["cpu", "cpu"])
    assert manifest["timings"]["device_names"] == [device_name("cpu")]  # one machine, named once

    keys = images_by_key(out)
    assert sorted(keys) == sorted((arm, sid) for arm in ("target_only", "fake_sd") for sid in range(24))


@pytest.mark.slow
def test_samples_folder_opens_in_one_call_with_every_reader(reference_run, tmp_path):
    """pandas, pyarrow.dataset, duckdb and Hugging Face datasets each read the whole run in one call."""
    import datasets
    import duckdb
    import pandas as pd
    import pyarrow.dataset as ds

    out, _ = reference_run
    samples = str(out / "samples")
    expected = sorted((arm, sid) for arm in ("target_only", "fake_sd") for sid in range(24))
    frames = {
        "pandas": pd.read_parquet(samples),
        "pyarrow.parquet": pq.read_table(samples).to_pandas(),
        "pyarrow.dataset": ds.dataset(samples).to_table().to_pandas(),
        "pyarrow.dataset hive": ds.dataset(samples, partitioning="hive").to_table().to_pandas(),
        "duckdb": duckdb.sql(f"select * from read_parquet('{samples}/*/*.parquet')").df(),
        "datasets": datasets.load_dataset("parquet", data_dir=samples, split="train",
                                          cache_dir=str(tmp_path / "hf-cache")).to_pandas(),
    }
    for reader, frame in frames.items():
        assert list(frame.columns) == SAMPLE_SCHEMA.names, reader
        assert sorted(zip(frame["arm"], frame["sample_id"])) == expected, reader
        assert frame["arm"].map(type).eq(str).all(), reader  # a plain string column, no partition key beside it


def test_resume_refuses_an_output_with_the_old_arm_folders(fake_family, tmp_path):
    from specray.runtime.coordinator import check_resume, job_record
    from specray.runtime.store import RunStore

    out = tmp_path / "run"
    spec = load_job(fake_job(out))
    store = RunStore(str(out))
    store.write_json("_job.json", job_record(spec, ShardPlan.of(spec)))
    store.commit_bytes("samples/arm=target_only/shard-00000-of-00003.parquet", b"old layout")
    with pytest.raises(SpecError, match=r"^output: .*samples/arm=<arm>/ folders .*Choose another output"):
        check_resume(spec, ShardPlan.of(spec), store)


def test_images_identical_across_reruns_actor_counts_and_shard_sizes(reference_run, tmp_path):
    expected = images_by_key(reference_run[0])
    variants = {
        "same job again": fake_job(tmp_path / "b", actors=2, shard_batches=2),
        "1 actor, 3-batch shards": fake_job(tmp_path / "c", actors=1, shard_batches=3),
        "2 actors, 1-batch shards": fake_job(tmp_path / "d", actors=2, shard_size=4),
    }
    for what, job in variants.items():
        run(job)
        assert images_by_key(Path(job["output"])) == expected, what


def test_compare_samples_finds_identical_runs_and_a_changed_image(reference_run, tmp_path, monkeypatch):
    import pyarrow as pa
    from click.testing import CliRunner

    from specray.cli import specray

    run(fake_job(tmp_path / "other_layout", actors=1, shard_batches=3))
    refuse_dataset_reads(monkeypatch)  # the command must exit cleanly (specray.runtime.store.read_parquet)
    same = CliRunner().invoke(specray, ["compare", "--samples", str(reference_run[0]), str(tmp_path / "other_layout")])
    assert same.exit_code == 0 and same.output.rstrip().endswith("identical"), same.output
    assert "fake_sd: 24 samples, images differ: 0, acceptance statistics differ: 0" in same.output
    changed = tmp_path / "changed"
    shutil.copytree(reference_run[0], changed)
    shard = sorted((changed / "samples" / "fake_sd").glob("*.parquet"))[0]
    table = pq.ParquetFile(shard).read()
    images = table.column("image").to_pylist()
    images[0] = images[1]
    pq.write_table(table.set_column(table.schema.get_field_index("image"), "image",
                                    pa.array(images, type=table.schema.field("image").type)), shard)
    different = CliRunner().invoke(specray, ["compare", "--samples", str(reference_run[0]), str(changed)])
    assert different.exit_code == 1 and "fake_sd: 24 samples, images differ: 1, acceptance statistics differ: 0" \
        in different.output, different.output


def test_in_process_worker_matches_actors_and_seed_matters(reference_run, tmp_path):
    """ShardWorker without Ray gives the actors' bytes; another seed gives other images (negative control)."""
    from specray.runtime.actor import ShardWorker
    from specray.runtime.coordinator import plan_tasks
    from specray.runtime.store import RunStore

    expected = images_by_key(reference_run[0])
    for seed, out in ((7, tmp_path / "same"), (8, tmp_path / "other")):
        spec = load_job(fake_job(out, seed=seed))
        tasks, _ = plan_tasks(spec, ShardPlan.of(spec), RunStore(str(out)))
        worker = ShardWorker(spec)
        for task in tasks:
            worker.run_task(task)
    assert images_by_key(tmp_path / "same") == expected
    other = images_by_key(tmp_path / "other")
    assert sum(other[k] != expected[k] for k in expected) > len(expected) // 2


def test_progress_moves_once_per_batch_of_every_arm(ray_local, tmp_path, capsys, monkeypatch):
    """Not a terminal: plain lines; with no minimum interval there is one per batch of each arm (4 rows)."""
    import re

    monkeypatch.setenv("SPECRAY_PROGRESS_INTERVAL_S", "0")
    from specray.runtime.coordinator import run_job

    run_job(load_job(fake_job(tmp_path / "run", actors=2, shard_batches=3)), show_progress=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("progress: ")]
    done = [int(re.match(r"progress: (\d+)/48 samples", line).group(1)) for line in lines]
    assert done[0] == 0 and done[-1] == 48
    moved = sorted(set(done))
    assert moved == list(range(0, 49, 4)), done  # every batch of every arm shows: 12 steps of 4 rows
    assert "\r" not in "".join(lines)


def test_resume_recomputes_only_the_missing_shard(reference_run, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference_run[0], out)
    before = images_by_key(out)
    missing = out / shard_relpath("fake_sd", 1, 3)
    missing.unlink()
    (out / "_manifest.json").unlink()  # as after a crash: the manifest is written last
    # A writer of this job killed mid-commit leaves a temp named with the job's fingerprint; another
    # program's dot-file that merely looks like a temp is not the run's to remove.
    tag = f"{TEMP_TAG_PREFIX}{load_job(fake_job(out)).fingerprint()}"
    (out / "samples" / "fake_sd" / f".shard-00001-of-00003.parquet{TEMP_MARKER}{tag}-{'0' * 32}").write_bytes(b"partial")
    foreign = out / "samples" / "fake_sd" / f".notes{TEMP_MARKER}dead"
    foreign.write_bytes(b"not ours")
    untouched = {p: p.stat().st_mtime_ns for p in (out / "samples").rglob("*.parquet")}

    result = run(fake_job(out))
    assert result.tasks_run == 1 and result.tasks_skipped == 2
    assert result.rows_written == 8  # only the missing arm of that shard ran
    assert missing.exists() and (out / "_manifest.json").exists()
    assert {p: p.stat().st_mtime_ns for p in untouched} == untouched
    assert images_by_key(out) == before
    assert [f for f in all_files(out) if TEMP_MARKER in f] == [str(foreign.relative_to(out))]  # ours is gone
    foreign.unlink()

    again = run(fake_job(out))  # a complete run: nothing to do, manifest rewritten
    assert again.tasks_run == 0 and again.manifest["num_rows"] == 48


def test_resume_refuses_an_incompatible_spec(fake_family, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "_job.json").write_text("{}")
    from specray.runtime.coordinator import check_resume, job_record
    from specray.runtime.store import RunStore

    spec = load_job(fake_job(out))
    store = RunStore(str(out))
    store.write_json("_job.json", job_record(spec, ShardPlan.of(spec)))
    check_resume(spec, ShardPlan.of(spec), store)  # the same spec may resume
    cases = {
        "seed": fake_job(out, seed=1),
        "shard layout": fake_job(out, shard_batches=3),
        # Another CPU thread count rounds otherwise: its samples must not mix with these.
        "intra_op_threads was 1, now 2": fake_job(out, num_cpus_per_actor=2),
        "arm 'fake_sd' changed": fake_job(out, arms=[fake_job(out)["arms"][0],
                                                     {**fake_job(out)["arms"][1], "params": {"gamma": 2}}]),
        "arm 'fake_sd' is no longer": fake_job(out, arms=fake_job(out)["arms"][:1]),
    }
    for words, job in cases.items():
        changed = load_job(job)
        with pytest.raises(SpecError, match=words) as info:
            check_resume(changed, ShardPlan.of(changed), store)
        assert info.value.field_path == "output"
    # Adding an arm is compatible: the new arm's shards are simply missing.
    bigger = load_job(fake_job(out, arms=fake_job(out)["arms"] + [
        {"name": "sd2", "family": FAKE_FAMILY, "method": "fake_sd", "target": "fake-target", "draft": "fake-draft"}]))
    check_resume(bigger, ShardPlan.of(bigger), store)
    # Another fraction of one CPU is still one thread: the same samples, so it may resume.
    half = load_job(fake_job(out, num_cpus_per_actor=0.5))
    assert half.sample_determining() == spec.sample_determining()
    check_resume(half, ShardPlan.of(half), store)
    # A run written by compiled kernels (the fake family has none: its record says so) resumed eagerly.
    compiled = job_record(spec, ShardPlan.of(spec))
    compiled["sample_determining"]["compile"] = True
    store.write_json("_job.json", compiled)
    with pytest.raises(SpecError, match="compile was True, now False"):
        check_resume(spec, ShardPlan.of(spec), store)


def _flaky_job(out: Path, markers: Path, mode: str, times: int, **fields) -> dict:
    job = fake_job(out, **fields)
    job["arms"].append({"name": "flaky", "family": FAKE_FAMILY, "method": "flaky", "target": "fake-target",
                        "draft": "fake-draft", "params": {"marker_dir": str(markers), "fail_sample_ids": [5, 17],
                                                          "fail_mode": mode, "times": times}})
    return job


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["raise", "exit"])
def test_failed_shards_are_retried_on_another_actor(ray_local, tmp_path, mode):
    markers = tmp_path / "markers"
    markers.mkdir()
    out = tmp_path / "run"
    result = run(_flaky_job(out, markers, mode, times=1))
    assert result.retries == 2  # samples 5 and 17 each failed once
    keys = images_by_key(out)
    assert len(keys) == 3 * 24
    assert all(keys[("flaky", s)] == keys[("target_only", s)] for s in range(24))  # same sampler, same seed
    assert not [f for f in all_files(out) if TEMP_MARKER in f]


def test_exhausted_retries_fail_naming_the_shard_and_keep_committed_output(ray_local, tmp_path):
    from specray.runtime.coordinator import ShardFailedError

    markers = tmp_path / "markers"
    markers.mkdir()
    out = tmp_path / "run"
    with pytest.raises(ShardFailedError, match=r"shard [13]/3 \[.*flaky\] .*failed 2 times \(max_shard_retries=1\)"):
        run(_flaky_job(out, markers, "raise", times=99, max_shard_retries=1, actors=1))
    assert not (out / "_manifest.json").exists()
    committed = [f for f in all_files(out) if f.endswith(".parquet")]
    assert committed and not [f for f in all_files(out) if TEMP_MARKER in f]
    for f in committed:
        assert pq.ParquetFile(out / f).metadata.num_rows == 8


@pytest.mark.slow
def test_discrete_family_end_to_end(ray_local, tmp_path):
    """The real discrete loop and presets, two arms, tiny: the runtime contract holds for them too."""
    from specray.models.presets import get_preset

    try:
        ready = get_preset("digits-gpt-target").weights_path.exists() and get_preset("digits-gpt-draft").weights_path.exists()
    except KeyError:
        ready = False
    if not ready:
        pytest.skip("discrete presets are not trained yet")
    job = {"job_id": "discrete-tiny", "seed": 3, "output": str(tmp_path / "a"),
           "conditions": {"per_class": 1, "classes": [0, 3, 7]}, "batch_size": 2, "shard_batches": 1, "actors": 2,
           "arms": [{"name": m, "family": "discrete_ar", "method": m, "target": "digits-gpt-target",
                     "draft": "digits-gpt-draft"} for m in ("target_only", "sd")],
           "eval": {"fid": False}}
    run(job)
    run({**job, "output": str(tmp_path / "b"), "actors": 1, "shard_batches": 2})
    first, second = images_by_key(tmp_path / "a"), images_by_key(tmp_path / "b")
    assert len(first) == 6 and first == second


def test_assigned_device_follows_ray_gpu_ids(monkeypatch):
    import ray

    from specray.runtime.actor import assigned_device

    monkeypatch.setattr(ray, "is_initialized", lambda: True)  # as inside a Ray worker (else: CPU, Ray not started)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert assigned_device() == torch.device("cpu")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # Ray narrows visibility: GPU 3 is cuda:0 here
    assert assigned_device() == torch.device("cuda:0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # visibility not narrowed: use the id itself
    assert assigned_device() == torch.device("cuda:3")


def test_default_actor_count_is_what_the_cluster_offers(fake_family, tmp_path):
    from specray.runtime.coordinator import default_actor_count

    spec = load_job(fake_job(tmp_path / "o"))
    assert default_actor_count(spec, {"CPU": 16.0}) == 16
    assert default_actor_count(load_job(fake_job(tmp_path / "o", num_cpus_per_actor=4)), {"CPU": 16.0}) == 4
    gpu = load_job(fake_job(tmp_path / "o", num_gpus_per_actor=0.5))
    assert default_actor_count(gpu, {"CPU": 16.0, "GPU": 2.0}) == 4
    with pytest.raises(SpecError, match="^num_gpus_per_actor: .*cluster has 0"):
        default_actor_count(gpu, {"CPU": 16.0})
    with pytest.raises(SpecError, match="^num_cpus_per_actor: .*cluster has 2.0 CPUs"):
        default_actor_count(load_job(fake_job(tmp_path / "o", num_cpus_per_actor=4)), {"CPU": 2.0})
