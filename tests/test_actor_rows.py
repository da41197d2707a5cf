"""Rows the actor writes: the ``actor`` column, and arms with a ``seed_offset`` (no Ray: ShardWorker in-process)."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from specray.runtime.plan import ShardPlan
from specray.runtime.store import RunStore
from specray.spec import SpecError, load_job
from tests.test_runtime import FAKE_FAMILY, fake_job, images_by_key


@pytest.fixture(scope="module", autouse=True)
def fake_family():
    from tests.test_runtime import install_fake_family, uninstall_fake_family

    install_fake_family()
    yield
    uninstall_fake_family()


def run_in_process(job: dict) -> Path:
    from specray.runtime.actor import ShardWorker
    from specray.runtime.coordinator import plan_tasks

    spec = load_job(job)
    worker = ShardWorker(spec)
    for task in plan_tasks(spec, ShardPlan.of(spec), RunStore(spec.output))[0]:
        worker.run_task(task)
    return Path(spec.output)


def replica_arms(offsets: list[int]) -> list[dict]:
    return [{"name": f"target_only_s{k}", "family": FAKE_FAMILY, "method": "target_only", "target": "fake-target",
             "draft": "fake-draft", "seed_offset": k} for k in offsets]


def test_rows_name_the_actor_that_generated_them(tmp_path):
    out = run_in_process(fake_job(tmp_path / "run"))
    actors = set(pq.read_table(out / "samples", partitioning=None).column("actor").to_pylist())
    assert actors == {f"local:{os.getpid()}"}


def test_seed_offset_shifts_the_sample_seed_and_only_it(tmp_path):
    """Replica arms at offsets 0 and 2 = target_only of jobs with seed 7 and seed 9, byte for byte."""
    replicas = run_in_process(fake_job(tmp_path / "replicas", seed=7, arms=replica_arms([0, 2])))
    table = pq.read_table(replicas / "samples", partitioning=None)
    seeds = dict(zip(table.column("arm").to_pylist(), table.column("seed").to_pylist()))
    assert seeds == {"target_only_s0": 7, "target_only_s2": 9}
    got = images_by_key(replicas)
    for seed, arm in ((7, "target_only_s0"), (9, "target_only_s2")):
        plain = images_by_key(run_in_process(fake_job(tmp_path / f"seed{seed}", seed=seed, arms=replica_arms([0]))))
        assert all(got[(arm, sid)] == plain[("target_only_s0", sid)] for sid in range(24))
    # Negative control: the two replicas really differ (most images).
    assert sum(got[("target_only_s0", s)] != got[("target_only_s2", s)] for s in range(24)) > 12


def test_seed_offset_validation_and_fingerprints(tmp_path):
    base = load_job(fake_job(tmp_path / "o", arms=replica_arms([0])))
    without = fake_job(tmp_path / "o", arms=replica_arms([0]))
    del without["arms"][0]["seed_offset"]
    assert load_job(without).arms[0].fingerprint() == base.arms[0].fingerprint()  # 0 = absent: old runs resume
    assert load_job(fake_job(tmp_path / "o", arms=replica_arms([3]))).arms[0].fingerprint() != base.arms[0].fingerprint()
    for bad in (-1, 1.5, "2"):
        arms = replica_arms([0])
        arms[0]["seed_offset"] = bad
        with pytest.raises(SpecError, match=r"^arms\[0\]\.seed_offset: must be an integer >= 0") as info:
            load_job(fake_job(tmp_path / "o", arms=arms))
        assert info.value.field_path == "arms[0].seed_offset"
    assert load_job(base.to_dict()).arms[0].seed_offset == 0  # to_dict round-trips the field
