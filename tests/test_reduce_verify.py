"""The reducer trusts nothing: each damaged run is refused by name before anything is scored, in
bounded time and memory, with no report written; ``--partial`` scores what verifies and says what
is missing. Runs are synthetic (tests/eval_synthetic.py: real digits, the runtime's writer)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from specray.cli import specray
from specray.eval.checks import RunCheckError
from specray.eval.reduce import reduce_run
from specray.eval.shards import ManifestError
from tests.eval_synthetic import SyntheticArm, write_run

torch.set_num_threads(1)
ARMS = [SyntheticArm("target_only"),
        SyntheticArm("sd", method="sd", image_offset=300, params={"gamma": 2}, accepted_per_position=[5, 3],
                     spec_steps=10, seconds_per_sample=0.006)]
MAX_REFUSAL_S = 20.0  # refusals read each file once (no features, no bootstrap)
MAX_REFUSAL_MB = 64.0  # Python allocations while refusing (tracemalloc peak)


@pytest.fixture(scope="module")
def good_run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("good") / "run"
    write_run(str(root), ARMS, per_class=4, batch_size=10, shard_batches=1)  # 40 samples, 4 shards per arm
    return root


def copy_run(good: Path, tmp_path: Path) -> Path:
    root = tmp_path / "run"
    shutil.copytree(good, root)
    return root


def manifest_of(root: Path) -> dict:
    return json.loads((root / "_manifest.json").read_text())


def save_manifest(root: Path, manifest: dict) -> None:
    (root / "_manifest.json").write_text(json.dumps(manifest))


def entry(manifest: dict, arm: str, shard: int) -> dict:
    return next(e for e in manifest["shards"] if e["arm"] == arm and e["shard"] == shard)


def relist(manifest: dict, root: Path, arm: str, shard: int) -> None:
    """Make the manifest's checksum and size match whatever the file now holds (an adversary's edit)."""
    item = entry(manifest, arm, shard)
    data = (root / item["path"]).read_bytes()
    item.update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def refused(root: Path, check: str = "files") -> str:
    """reduce_run refuses (bounded time and memory) and writes no report; returns the message."""
    tracemalloc.start()
    began = time.monotonic()
    try:
        with pytest.raises((RunCheckError, ManifestError)) as info:
            reduce_run(str(root), print_table=False)
        seconds = time.monotonic() - began
        peak_mb = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert seconds < MAX_REFUSAL_S and peak_mb < MAX_REFUSAL_MB, (seconds, peak_mb)
    if isinstance(info.value, RunCheckError):
        assert info.value.check == check, str(info.value)
    assert not (root / "report").exists()
    return str(info.value)


def test_a_sound_run_verifies_and_scores(good_run, tmp_path):
    root = copy_run(good_run, tmp_path)
    report = reduce_run(str(root), print_table=False)
    assert report["partial"] is None and [a["num_samples"] for a in report["arms"]] == [40, 40]


def test_wrong_checksums_are_refused_naming_the_files(good_run, tmp_path):
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    for item in manifest["shards"]:
        item["sha256"] = "0" * 64
    save_manifest(root, manifest)
    message = refused(root)
    assert "8 shard file(s) fail verification" in message
    assert "samples/sd/shard-00003-of-00004.parquet: its sha256 does not match the manifest" in message


def test_a_shard_swapped_for_another_arms_is_refused_even_with_matching_checksums(good_run, tmp_path):
    """Before: the swapped arm's speedup silently changed. Now the file's own identity gives it away."""
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    shutil.copyfile(root / entry(manifest, "sd", 1)["path"], root / entry(manifest, "target_only", 1)["path"])
    relist(manifest, root, "target_only", 1)
    save_manifest(root, manifest)
    message = refused(root)
    assert ("samples/target_only/shard-00001-of-00004.parquet: holds job 5ynthet1c0000000 arm 'sd' shard 1/4, "
            "but the manifest lists it as job 5ynthet1c0000000 arm 'target_only' shard 1/4") in message
    # And a file from another job (same arm and shard, another fingerprint) is refused the same way.
    other = tmp_path / "other"
    write_run(str(other), ARMS, per_class=4, batch_size=10, shard_batches=1, seed=5)
    root2 = copy_run(good_run, tmp_path / "b")
    manifest = manifest_of(root2)
    manifest["fingerprint"] = "another0job00000"
    save_manifest(root2, manifest)
    assert "holds job 5ynthet1c0000000" in refused(root2)


@pytest.mark.parametrize("path", ["../outside.parquet", "/etc/hostname", "samples/sd/../../../x.parquet",
                                  "s3://elsewhere/x.parquet", "samples/sd/shard-00000-of-00004.parquet"])
def test_manifest_paths_outside_the_run_or_not_its_own_are_refused(good_run, tmp_path, path):
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    entry(manifest, "target_only", 0)["path"] = path
    save_manifest(root, manifest)
    message = refused(root)
    where = "is not this run's name for it" if path.startswith("samples/sd/shard") else "points outside the run"
    assert f"{path}: the manifest's path {where}" in message


def test_a_symlink_out_of_the_run_is_refused(good_run, tmp_path):
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    target = root / entry(manifest, "sd", 2)["path"]
    outside = tmp_path / "outside.parquet"
    shutil.move(target, outside)
    os.symlink(outside, target)
    assert "resolves outside the run folder" in refused(root)


@pytest.mark.parametrize("damage", ["garbage", "truncated", "deleted", "empty"])
def test_damaged_or_missing_shards_are_named(good_run, tmp_path, damage):
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    path = root / entry(manifest, "sd", 2)["path"]
    if damage == "deleted":
        path.unlink()
    else:
        data = path.read_bytes()
        path.write_bytes({"garbage": b"PAR1 this is not parquet at all PAR1", "truncated": data[: len(data) // 2],
                          "empty": b""}[damage])
        relist(manifest, root, "sd", 2)  # even with a manifest that agrees, the file is not a shard
        save_manifest(root, manifest)
    message = refused(root)
    assert "samples/sd/shard-00002-of-00004.parquet: " in message
    expected = "missing: the file does not exist" if damage == "deleted" else "is not a readable Parquet file"
    assert expected in message


@pytest.mark.parametrize("text,words", [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object"),
                                        ('{"shards": 5}', "field 'shards' must be a list"),
                                        ('{"shards": [{"arm": "a", "path": 7}]}', "shards[0].path must be a str"),
                                        ('{"shards": [], "arms": [3]}', "every entry of 'arms'")])
def test_a_manifest_that_is_not_one_is_named(good_run, tmp_path, text, words):
    root = copy_run(good_run, tmp_path)
    (root / "_manifest.json").write_text(text)
    message = refused(root)
    assert "_manifest.json" in message and words in message
    result = CliRunner().invoke(specray, ["reduce", str(root)])
    assert result.exit_code == 2 and "Traceback" not in result.output and words in result.stderr


def test_a_manifest_that_lists_too_little_is_refused(good_run, tmp_path):
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    manifest["shards"] = [e for e in manifest["shards"] if not (e["arm"] == "sd" and e["shard"] == 3)]
    save_manifest(root, manifest)
    assert "samples/sd/shard-00003-of-00004.parquet: not listed in the manifest" in refused(root)


def test_partial_report_scores_what_verifies_and_lists_what_is_missing(good_run, tmp_path):
    root = copy_run(good_run, tmp_path)
    manifest = manifest_of(root)
    (root / entry(manifest, "sd", 2)["path"]).unlink()
    result = CliRunner().invoke(specray, ["reduce", str(root), "--partial"])
    assert result.exit_code == 0, result.output
    assert "partial report: 1 shard file(s) not scored" in result.stderr
    report = json.loads((root / "report" / "report.json").read_text())
    missing = report["partial"]["missing"]
    assert [(m["arm"], m["shard"], m["problem"]) for m in missing] == [("sd", 2, "missing: the file does not exist")]
    assert report["partial"]["shards_scored"] == {"target_only": [0, 1, 2, 3], "sd": [0, 1, 3]}
    assert {a["arm"]: a["num_samples"] for a in report["arms"]} == {"target_only": 40, "sd": 30}
    markdown = (root / "report" / "report.md").read_text()
    assert "**Partial report.** 1 shard file(s)" in markdown and "`samples/sd/shard-00002-of-00004.parquet`" in markdown
    # Without --partial the same run is refused: nothing scored.
    shutil.rmtree(root / "report")
    result = CliRunner().invoke(specray, ["reduce", str(root)])
    assert result.exit_code == 2 and "specray reduce --partial" in result.stderr
    assert not (root / "report").exists()


def test_tiny_runs_are_scored_or_refused_by_name(tmp_path):
    """A valid job of a few samples: bootstrap replicates that draw fewer than two samples are dropped."""
    few = tmp_path / "few"
    write_run(str(few), ARMS, per_class=1, classes=(0, 1), batch_size=2, shard_batches=1)
    report = reduce_run(str(few), print_table=False)
    for arm in report["arms"]:
        assert arm["num_samples"] == 2 and arm["fid"]["value"] > 0
    one = tmp_path / "one"
    write_run(str(one), ARMS, per_class=1, classes=(3,), batch_size=1, shard_batches=1)
    assert "FID and its bootstrap need at least 2" in refused(one, check="size")
