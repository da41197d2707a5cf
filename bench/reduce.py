"""Reducer benchmark: throughput (images/s of decode + feature extraction + statistics) and peak memory
at 10k and 50k samples per arm, on synthetic runs of real digits images written as Parquet shards.

    OMP_NUM_THREADS=1 python bench/reduce.py            # 10k and 50k, 2 arms each
    python bench/reduce.py --sizes 2000 --arms 1        # quick

Each size runs in its own subprocess so peak RSS (``resource.getrusage``) is that size's alone;
``tracemalloc`` gives the peak of Python/numpy allocations during ``reduce_run`` itself. The reducer
runs in streaming mode (``image_budget_bytes=0``: FID from streamed float64 moments; the default
also keeps up to 256 MiB of raw images per arm for torch-fidelity's own ``calculate_metrics``
cross-check, which is the one part that grows with N until the budget). Memory must not scale with N.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_one(n: int, num_arms: int, replicates: int) -> dict:
    import resource
    import tracemalloc

    import torch

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    from specray.eval.reduce import ReduceOptions, reduce_run
    from tests.eval_synthetic import SyntheticArm, write_run

    arms = [SyntheticArm("target_only"),
            SyntheticArm("sd", method="sd", image_offset=700, seconds_per_sample=0.004,
                         accepted_per_position=[12, 9, 6, 3], spec_steps=16)][:num_arms]
    with tempfile.TemporaryDirectory() as tmp:
        began = time.perf_counter()
        write_run(tmp, arms, per_class=n // 10, batch_size=50, shard_batches=20)
        write_s = time.perf_counter() - began
        parquet_bytes = sum(p.stat().st_size for p in Path(tmp).rglob("*.parquet"))
        options = ReduceOptions(image_budget_bytes=0, bootstrap_replicates=replicates, plots=False)
        from specray.eval.shards import read_manifest
        from specray.eval.verify import verify_files
        from specray.runtime.store import RunStore

        verify_times = []
        for _ in range(3):  # the pre-scoring verification alone (reduce_run repeats it), median of 3
            began = time.perf_counter()
            store = RunStore(tmp)
            verify_files(store, read_manifest(store))
            verify_times.append(time.perf_counter() - began)
        verify_s = sorted(verify_times)[1]
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        tracemalloc.start()
        began = time.perf_counter()
        report = reduce_run(tmp, print_table=False, options=options)
        wall = time.perf_counter() - began
        _, traced_peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rows = report["num_rows"]
    return {
        "samples_per_arm": n, "arms": num_arms, "rows": rows, "bootstrap_replicates": replicates,
        "parquet_mib": parquet_bytes / 2**20, "write_s": write_s,
        "extract_and_stats_s": report["throughput"]["feature_extraction_s"],
        "images_per_s": report["throughput"]["images_per_s"],
        "reduce_wall_s": wall, "images_per_s_end_to_end": rows / wall,
        "verify_s": verify_s, "verify_share_of_reduce": verify_s / wall,
        "tracemalloc_peak_mib": traced_peak / 2**20,
        "peak_rss_mib": rss_after / 1024, "rss_before_reduce_mib": rss_before / 1024,
        "fid": {a["arm"]: round(a["fid"]["value"], 3) for a in report["arms"]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 50_000])
    parser.add_argument("--arms", type=int, default=2, choices=(1, 2))
    parser.add_argument("--replicates", type=int, default=200, help="FID bootstrap replicates (reducer default 200)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(run_one(args.one, args.arms, args.replicates)))
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    results = []
    for n in args.sizes:
        out = subprocess.run([sys.executable, __file__, "--one", str(n), "--arms", str(args.arms),
                              "--replicates", str(args.replicates)], env=env, capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    header = ("samples/arm", "rows", "parquet MiB", "verify s", "extract+stats s", "images/s", "reduce wall s",
              "end-to-end img/s", "tracemalloc peak MiB", "peak RSS MiB")
    print("  ".join(header))
    for r in results:
        print("  ".join(str(v).rjust(len(h)) for v, h in zip(
            (r["samples_per_arm"], r["rows"], f"{r['parquet_mib']:.1f}", f"{r['verify_s']:.2f}",
             f"{r['extract_and_stats_s']:.1f}",
             f"{r['images_per_s']:.0f}", f"{r['reduce_wall_s']:.1f}", f"{r['images_per_s_end_to_end']:.0f}",
             f"{r['tracemalloc_peak_mib']:.1f}", f"{r['peak_rss_mib']:.0f}"), header)))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
