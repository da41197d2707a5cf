"""The large run: the fid50k job (digits presets; target_only, sd, cool_sd) at a chosen size.

Runs ``jobs/fid50k.yaml`` with ``per_class`` overridden (5000 per class = 50k samples, 150k rows)
on a local Ray, this process being the driver, and prints the wall time, the throughput and the
driver's peak resident memory. The driver holds only shard ranges and counters, so its peak RSS
must not grow with the sample count: compare ``--per-class 500`` with ``--per-class 5000``.

Then, as ``specray run`` does (unless ``--no-reduce`` or the job's ``eval.fid: false``), it scores
the run with the reducer and prints the reducer's wall time and the job's: generation plus reduce,
the time a user of ``specray run`` waits.

It then reads the committed rows back and prints each arm's seconds in batches (the sum and the
median batch, on the actors) and each actor's busy seconds. Two runs of one job differ by the
machine's state as well as by the code: an arm whose code a change leaves alone (``target_only``,
usually) measures the machine, and the wall time not spent in batches measures the runtime.

    OMP_NUM_THREADS=1 python bench/scale.py --per-class 500 --output /tmp/specray-scale-5k
    nohup python bench/scale.py --per-class 5000 --output /tmp/specray-scale-50k > scale50k.log 2>&1 &

A rerun on the same output resumes (skips committed shards); use a fresh output to time a run.
``--batch-size`` / ``--shard-batches`` override the job's (compare batch sizes on the same samples:
``--batch-size 64 --shard-batches 8`` keeps 512 samples per shard, as the job's 128 x 4 does).
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def current_rss_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


class RssSampler(threading.Thread):
    """Samples the driver's RSS once a second: peak during the run, and the value at each quarter."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.samples: list[tuple[float, float]] = []
        self.stop = threading.Event()

    def run(self) -> None:
        started = time.monotonic()
        while not self.stop.wait(1.0):
            self.samples.append((time.monotonic() - started, current_rss_mb()))


def batch_seconds(output: str, batch_size: int) -> dict[str, dict[str, float]]:
    """Per arm, its batches' count, summed seconds and median seconds; per actor (``"actor:NAME"``),
    its summed seconds. A batch is counted once, keyed as the reducer's speedups key it (actor,
    shard, batch), though each of its rows carries its wall time."""
    import numpy as np

    from specray.eval.shards import iter_shard_batches, read_manifest
    from specray.eval.speedup import BatchTimes, record_batch_times
    from specray.runtime.store import RunStore

    store = RunStore(output)
    times: dict[str, BatchTimes] = {}
    for entry in read_manifest(store).shards:
        arm_times = times.setdefault(entry.arm, BatchTimes())
        for batch in iter_shard_batches(store, entry):
            sample_ids = batch.column("sample_id").to_numpy().astype(np.int64)
            record_batch_times(arm_times, batch, entry.shard, sample_ids, batch_size)
    numbers: dict[str, dict[str, float]] = {}
    busy: dict[str, float] = {}
    for arm, arm_times in times.items():
        walls = list(arm_times.walls.values())
        numbers[arm] = {"batches": len(walls), "seconds": float(sum(walls)), "median_batch_s": float(np.median(walls))}
        for (actor, _, _), wall in arm_times.walls.items():
            busy[actor] = busy.get(actor, 0.0) + wall
    for actor, seconds in sorted(busy.items()):
        numbers[f"actor:{actor}"] = {"seconds": seconds}
    return numbers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-class", type=int, default=500)
    parser.add_argument("--output", default="/tmp/specray-scale")
    parser.add_argument("--job", default=str(ROOT / "jobs" / "fid50k.yaml"))
    parser.add_argument("--batch-size", type=int, default=None, help="override the job's batch_size")
    parser.add_argument("--shard-batches", type=int, default=None, help="override the job's shard_batches")
    parser.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    parser.add_argument("--no-reduce", action="store_true", help="time the generation only, as `specray run --no-reduce`")
    parser.add_argument("--json", help="also write the numbers here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    import specray  # noqa: F401  before torch loads numpy: specray/__init__.py sets OpenBLAS's spin timeout
    # isort: split
    import torch

    from specray.runtime.coordinator import run_job
    from specray.spec import load_job

    gpus = {} if torch.cuda.is_available() else {"num_gpus_per_actor": 0}  # the job asks for GPUs; run on CPUs here
    spec = load_job(args.job, per_class=args.per_class, output=args.output, batch_size=args.batch_size,
                    shard_batches=args.shard_batches, **gpus)
    rss_before = current_rss_mb()
    sampler = RssSampler()
    sampler.start()
    began = time.perf_counter()
    result = run_job(spec, num_cpus=args.num_cpus, show_progress=True)
    wall = time.perf_counter() - began
    sampler.stop.set()
    sampler.join()
    during = [mb for _, mb in sampler.samples]
    numbers = {
        "job": spec.job_id, "per_class": args.per_class, "samples": spec.num_samples, "arms": len(spec.arms),
        "rows": result.manifest["num_rows"], "rows_written": result.rows_written, "shards": len(result.manifest["shards"]),
        "actors": result.actors, "machine": result.manifest["timings"]["device_names"], "retries": result.retries,
        "wall_time_s": round(wall, 1),
        "rows_per_s": round(result.rows_written / wall, 1),
        "driver_rss_before_mb": round(rss_before, 1),
        "driver_rss_max_sampled_mb": round(max(during), 1) if during else None,
        "driver_rss_end_mb": round(current_rss_mb(), 1),
        "driver_peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if spec.eval.fid and not args.no_reduce:
        from specray.eval.reduce import reduce_run

        began = time.perf_counter()
        reduce_run(spec.output, print_table=True, storage_options=spec.storage_options or None)
        numbers["reduce_wall_s"] = round(time.perf_counter() - began, 1)
        numbers["job_wall_s"] = round(wall + numbers["reduce_wall_s"], 1)
    numbers["batch_seconds"] = batch_seconds(spec.output, spec.batch_size)
    print(json.dumps(numbers, indent=2))
    for name, row in numbers["batch_seconds"].items():
        if name.startswith("actor:"):
            print(f"{name}: {row['seconds']:.1f} s in batches of {numbers['wall_time_s']} s wall")
        else:
            print(f"{name}: {row['batches']} batches, {row['seconds']:.1f} s, median batch {row['median_batch_s']:.3f} s")
    print(f"wall time {wall / 60:.1f} min for {numbers['rows']} rows ({numbers['rows_per_s']} rows/s, "
          f"{result.actors} actors on {', '.join(numbers['machine']) or 'no new actors'}); "
          f"driver peak RSS {numbers['driver_peak_rss_mb']} MB")
    if "job_wall_s" in numbers:
        print(f"reduce {numbers['reduce_wall_s']} s: the job (generation and reduce) took "
              f"{numbers['job_wall_s'] / 60:.1f} min")
    if args.json:
        Path(args.json).write_text(json.dumps(numbers, indent=2) + "\n")


if __name__ == "__main__":
    main()
