"""Pre-scoring checks: each crafted break of a run is refused with RunCheckError before any scoring."""

from __future__ import annotations

import pytest
import torch

from specray.eval.checks import RunCheckError, check_run
from specray.eval.reduce import reduce_run
from specray.eval.shards import read_manifest
from specray.runtime.store import RunStore
from tests.eval_synthetic import SyntheticArm, write_run

torch.set_num_threads(1)
ARMS = [SyntheticArm("target_only"), SyntheticArm("sd", method="sd", image_offset=300, params={"gamma": 2},
                                                  accepted_per_position=[5, 3], spec_steps=10)]


def _check(root: str):
    store = RunStore(root)
    return check_run(store, read_manifest(store))


def test_a_good_run_passes(tmp_path):
    write_run(str(tmp_path), ARMS, per_class=6, batch_size=10, shard_batches=2)
    summaries = _check(str(tmp_path))
    assert {s.rows for s in summaries.values()} == {60}
    assert summaries["sd"].class_counts == {c: 6 for c in range(10)}


def _breaks(name: str):
    def drop_last(arm, rows):
        return rows[:-1] if arm == "sd" else rows

    def duplicate(arm, rows):
        if arm != "sd":
            return rows
        dup = dict(rows[7])
        return rows[:-1] + [dup]  # count stays N, sample_id 7 twice, N-1 missing

    def relabel(arm, rows):
        if arm == "sd":
            rows[3] = {**rows[3], "class_label": 4}  # class 3 -> 4: balance 5/7
        return rows

    def mixed_seed(arm, rows):
        if arm == "sd":
            rows[0] = {**rows[0], "seed": 99}
        return rows

    return {"count": drop_last, "duplicates": duplicate, "labels": relabel, "seeds": mixed_seed}[name]


@pytest.mark.parametrize("check", ["count", "duplicates", "labels", "seeds"])
def test_each_break_is_refused(tmp_path, check):
    write_run(str(tmp_path), ARMS, per_class=6, batch_size=10, shard_batches=2, mutate_rows=_breaks(check))
    with pytest.raises(RunCheckError) as info:
        _check(str(tmp_path))
    assert info.value.check == check
    assert "'sd'" in str(info.value)
    # reduce_run refuses before scoring: no report is written
    with pytest.raises(RunCheckError):
        reduce_run(str(tmp_path), print_table=False)
    assert not (tmp_path / "report" / "report.json").exists()


def test_count_check_against_spec_n(tmp_path):
    """The spec asks per_class=6 x 10 = 60, the layout claims 50: refused as a label/count mismatch."""
    write_run(str(tmp_path), ARMS, per_class=6, batch_size=10, shard_batches=2)
    store = RunStore(str(tmp_path))
    manifest = store.read_json("_manifest.json")
    manifest["layout"]["num_samples"] = 50
    store.write_json("_manifest.json", manifest)
    with pytest.raises(RunCheckError, match="per_class=6"):
        _check(str(tmp_path))


def test_unbalanced_spec_classes(tmp_path):
    """Rows whose labels follow a different class list than the spec's are refused (label check)."""
    write_run(str(tmp_path), ARMS, per_class=6, batch_size=10, shard_batches=2)
    store = RunStore(str(tmp_path))
    manifest = store.read_json("_manifest.json")
    manifest["spec"]["conditions"]["classes"] = [1, 0, 2, 3, 4, 5, 6, 7, 8, 9]
    store.write_json("_manifest.json", manifest)
    with pytest.raises(RunCheckError) as info:
        _check(str(tmp_path))
    assert info.value.check == "labels"


def test_replicas_with_the_same_seed_are_refused(tmp_path):
    arms = [SyntheticArm("target_only"), SyntheticArm("replica", params={"seed_offset": 0}, image_offset=100)]
    write_run(str(tmp_path), arms, per_class=3, batch_size=10, shard_batches=1)
    with pytest.raises(RunCheckError, match="seed replicas") as info:
        _check(str(tmp_path))
    assert info.value.check == "seeds"
    # the same arms with distinct offsets pass
    arms[1].params = {"seed_offset": 1}
    write_run(str(tmp_path / "ok"), arms, per_class=3, batch_size=10, shard_batches=1)
    assert set(_check(str(tmp_path / "ok"))) == {"target_only", "replica"}
