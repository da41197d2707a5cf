"""GPU pinning with fake GPU resources: a local Ray that advertises 2 GPUs (there is no CUDA here).

Actors ask Ray for ``num_gpus_per_actor`` (fractions allowed); Ray gives each worker its GPU ids and
narrows CUDA_VISIBLE_DEVICES to them; the worker places its models on ``cuda:<index of the assigned
id among the visible ones>``. Nothing loads on CUDA in these tests: the ``gpuprobe`` family
(tests/runtime_families.py) builds its models on the CPU but refuses a non-CUDA device and records,
per row, the device it was given and the GPU ids Ray assigned. The driver must not initialise CUDA.
"""

from __future__ import annotations

import collections
import json

import pyarrow.parquet as pq
import pytest
import torch

from specray.runtime.plan import ShardPlan
from specray.spec import load_job
from tests import runtime_families as families


@pytest.fixture(scope="module")
def ray_gpus():
    import ray

    families.install()
    ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False,
             runtime_env=families.ray_runtime_env())
    yield ray
    ray.shutdown()
    families.uninstall()


def gpu_job(output, num_gpus: float, **fields) -> dict:
    return families.job(families.GPUPROBE, output, [{"name": "target_only", "method": "target_only"}],
                        num_gpus_per_actor=num_gpus, num_cpus_per_actor=0, actors="auto", **fields)


def assignments(ray, spec, count: int) -> list[dict]:
    """Start ``count`` generation actors the way the coordinator does and ask each what it got."""
    from specray.runtime.actor import GenerationActor

    actors = [GenerationActor.options(num_cpus=spec.num_cpus_per_actor, num_gpus=spec.num_gpus_per_actor)
              .remote(spec, None) for _ in range(count)]
    try:
        return ray.get([a.gpu_assignment.remote() for a in actors], timeout=120)
    finally:
        for actor in actors:
            ray.kill(actor)


def test_one_gpu_per_actor_gives_distinct_devices(ray_gpus, tmp_path):
    spec = load_job(gpu_job(tmp_path / "o", 1))
    got = assignments(ray_gpus, spec, 2)
    assert sorted(a["gpu_ids"][0] for a in got) == ["0", "1"] and all(len(a["gpu_ids"]) == 1 for a in got)
    for a in got:
        # Ray narrowed visibility to the assigned GPU, so it is cuda:0 inside that process.
        assert a["cuda_visible_devices"] == a["gpu_ids"][0] and a["device"] == "cuda:0"
        assert a["cuda_initialized"] is False  # choosing the device does not touch CUDA


def test_half_a_gpu_per_actor_puts_two_actors_on_each_gpu(ray_gpus, tmp_path):
    spec = load_job(gpu_job(tmp_path / "o", 0.5))
    got = assignments(ray_gpus, spec, 4)
    per_gpu = collections.Counter(a["gpu_ids"][0] for a in got)
    assert per_gpu == {"0": 2, "1": 2}
    assert len({a["actor"] for a in got}) == 4 and {a["device"] for a in got} == {"cuda:0"}


def test_job_on_fake_gpus_pins_each_actor_and_driver_stays_off_cuda(ray_gpus, tmp_path):
    from specray.runtime.coordinator import default_actor_count, run_job

    out = tmp_path / "run"
    # 16 samples in 4 one-batch shards: one for each of the 4 actors.
    spec = load_job(gpu_job(out, 0.5, shard_batches=1, conditions={"kind": "class_labels", "per_class": 4,
                                                                   "classes": "all"}))
    assert ShardPlan.of(spec).num_shards == 4
    assert default_actor_count(spec, ray_gpus.cluster_resources()) == 4  # what the cluster offers: 2 GPUs / 0.5
    result = run_job(spec, show_progress=False)
    assert result.actors == 4 and set(result.manifest["timings"]["devices"]) == {"cuda:0"}
    assert result.manifest["timings"]["device_names"] == ["cuda (unavailable)"]  # named without touching CUDA

    table = pq.read_table(out / "samples", partitioning=None)
    assert table.num_rows == 16 and set(table.column("device").to_pylist()) == {"cuda:0"}
    gpus_of_actor: dict[str, set] = collections.defaultdict(set)
    for actor, extra in zip(table.column("actor").to_pylist(), table.column("extra_stats").to_pylist()):
        info = json.loads(extra)
        assert info["assigned_device"] == "cuda:0" and info["cuda_initialized"] is False
        assert info["cuda_visible_devices"] == ",".join(info["gpu_ids"])
        gpus_of_actor[actor].update(info["gpu_ids"])
    assert all(len(ids) == 1 for ids in gpus_of_actor.values())  # each actor keeps its one GPU
    actors_per_gpu = collections.Counter(next(iter(ids)) for ids in gpus_of_actor.values())
    assert max(actors_per_gpu.values()) <= 2  # never more actors on a GPU than 1 / 0.5
    assert not torch.cuda.is_initialized(), "the driver initialised CUDA"


def test_a_gpu_request_the_cluster_cannot_meet_fails_before_any_output(ray_gpus, tmp_path):
    from specray.runtime.coordinator import run_job
    from specray.spec import SpecError

    out = tmp_path / "run"
    with pytest.raises(SpecError, match="num_gpus_per_actor: asks for 4.0 GPU per actor but the cluster has 2.0"):
        run_job(load_job(gpu_job(out, 4)), show_progress=False)
    assert not (out / "samples").exists()
