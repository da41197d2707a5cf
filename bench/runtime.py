"""Runtime overhead and scaling: ``specray run`` (the runtime) against an in-process loop.

Same model pair (the digits presets), same method, batch size, samples and seed:

- ``in-process``: ``load_pair`` + ``run_batch`` over the batches in this process, one torch thread
  (what one actor gets with ``num_cpus_per_actor: 1``); nothing is encoded or written;
- ``runtime, 1 actor`` / ``runtime, 2 actors``: :func:`specray.runtime.coordinator.run_job` (what
  ``specray run`` calls) on a local Ray that is already up: actor start, model load, generation,
  PNG encoding, Parquet commit, manifest. Ray's own start-up is timed separately.

Each configuration runs ``--reps`` times, interleaved; medians are reported, with
``runtime/in-process`` throughput (aim >= 0.9) and the 1 -> 2 actor scaling (ideal 2.0 on an idle
machine with >= 2 free cores; other processes on the machine lower it).

    OMP_NUM_THREADS=1 python bench/runtime.py [--samples 2560] [--batch-size 64] [--method sd] [--reps 1]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FAMILY, TARGET, DRAFT = "discrete_ar", "digits-gpt-target", "digits-gpt-draft"


def job_dict(method: str, samples: int, batch_size: int, shard_batches: int, actors: int, output: str) -> dict:
    if samples % 10:
        raise SystemExit("--samples must be a multiple of 10 (the digits classes)")
    return {"job_id": "bench-runtime", "seed": 0, "output": output, "batch_size": batch_size,
            "shard_batches": shard_batches, "actors": actors, "num_cpus_per_actor": 1,
            "conditions": {"kind": "class_labels", "per_class": samples // 10, "classes": "all"},
            "arms": [{"name": method, "family": FAMILY, "method": method, "target": TARGET, "draft": DRAFT}],
            "eval": {"fid": False}}


def in_process(spec) -> float:
    """Wall seconds of load_pair + run_batch over every batch of ``spec``, in this process."""
    from specray.families import family
    from specray.runtime.plan import ShardPlan

    torch.set_num_threads(1)
    arm = spec.arms[0]
    began = time.perf_counter()
    pair = family(FAMILY).load_pair()(TARGET, DRAFT, torch.device("cpu"))
    run_batch = family(FAMILY).loop()
    for shard in ShardPlan.of(spec).shards():
        for start, stop in shard.batch_ranges():
            sample_ids, labels = ShardPlan.of(spec).batch(start, stop)
            run_batch(arm.method, arm.params, pair, labels, sample_ids, spec.seed)
    return time.perf_counter() - began


def runtime(spec) -> tuple[float, float]:
    """(wall seconds of run_job, seconds until its first actor was up)."""
    from specray.runtime.coordinator import run_job

    shutil.rmtree(spec.output, ignore_errors=True)
    began = time.perf_counter()
    result = run_job(spec, show_progress=False)
    wall = time.perf_counter() - began
    assert result.rows_written == spec.num_samples, result
    return wall, result.actor_startup_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2560)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--shard-batches", type=int, default=4)
    parser.add_argument("--method", default="sd")
    parser.add_argument("--reps", type=int, default=1)
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    import ray

    from specray.spec import load_job

    scratch = tempfile.mkdtemp(prefix="specray-bench-runtime-")
    specs = {name: load_job(job_dict(args.method, args.samples, args.batch_size, args.shard_batches, actors,
                                     os.path.join(scratch, name)))
             for name, actors in (("runtime, 1 actor", 1), ("runtime, 2 actors", 2))}
    began = time.perf_counter()
    ray.init(num_cpus=2, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}})
    ray_start = time.perf_counter() - began
    walls: dict[str, list[float]] = {"in-process": [], **{name: [] for name in specs}}
    startups: dict[str, list[float]] = {name: [] for name in specs}
    try:
        for _ in range(args.reps):
            walls["in-process"].append(in_process(specs["runtime, 1 actor"]))
            for name, spec in specs.items():
                wall, startup = runtime(spec)
                walls[name].append(wall)
                startups[name].append(startup)
    finally:
        ray.shutdown()
        shutil.rmtree(scratch, ignore_errors=True)

    median = {name: statistics.median(values) for name, values in walls.items()}
    rate = {name: args.samples / wall for name, wall in median.items()}
    numbers = {"method": args.method, "samples": args.samples, "batch_size": args.batch_size,
               "shard_size": args.batch_size * args.shard_batches, "reps": args.reps, "cpus": os.cpu_count(),
               "load_average_1m": os.getloadavg()[0], "ray_start_s": round(ray_start, 2),
               "wall_s": {k: [round(v, 2) for v in vs] for k, vs in walls.items()},
               "samples_per_s": {k: round(v, 2) for k, v in rate.items()},
               "runtime_1_actor_over_in_process": round(rate["runtime, 1 actor"] / rate["in-process"], 3),
               "scaling_1_to_2_actors": round(rate["runtime, 2 actors"] / rate["runtime, 1 actor"], 3),
               "actor_startup_s": {k: [round(v, 2) for v in vs] for k, vs in startups.items()}}
    # Steady state: the same wall time less the actor start-up (worker process, imports), a fixed cost per job.
    steady = {name: args.samples / (median[name] - statistics.median(startups[name])) for name in specs}
    numbers["steady_samples_per_s"] = {k: round(v, 2) for k, v in steady.items()}
    numbers["steady_runtime_1_actor_over_in_process"] = round(steady["runtime, 1 actor"] / rate["in-process"], 3)
    numbers["steady_scaling_1_to_2_actors"] = round(steady["runtime, 2 actors"] / steady["runtime, 1 actor"], 3)
    print(f"{args.samples} samples, method {args.method}, batch {args.batch_size}, shards of "
          f"{numbers['shard_size']}, median of {args.reps}; load average {numbers['load_average_1m']:.1f} on "
          f"{numbers['cpus']} CPUs; Ray start {ray_start:.1f} s (not included below)")
    print(f"{'configuration':<20}{'wall s':>10}{'samples/s':>12}{'actor start s':>15}{'steady samples/s':>18}")
    for name in walls:
        start = f"{statistics.median(startups[name]):.2f}" if name in startups else "-"
        stead = f"{steady[name]:.2f}" if name in steady else "-"
        print(f"{name:<20}{median[name]:>10.2f}{rate[name]:>12.2f}{start:>15}{stead:>18}")
    print(f"runtime (1 actor) / in-process throughput: {numbers['runtime_1_actor_over_in_process']:.3f}  (aim >= 0.9)")
    print(f"scaling 1 -> 2 actors: {numbers['scaling_1_to_2_actors']:.3f}x  (ideal 2.0 with 2 free cores)")
    print(f"without actor start-up: runtime/in-process {numbers['steady_runtime_1_actor_over_in_process']:.3f}, "
          f"scaling {numbers['steady_scaling_1_to_2_actors']:.3f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=2) + "\n")


if __name__ == "__main__":
    main()
