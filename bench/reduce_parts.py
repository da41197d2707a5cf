"""What each of the reducer's fast paths saves, side by side on a committed run (e.g. a fid50k run).

    python bench/reduce_parts.py /tmp/specray-scale-50k --threads 1 --turns 2

``specray reduce`` of a copy of RUN_DIR (its report is left alone), once per variant, each in its own
process, the variants taking turns and the order rotating by turn:

- ``all``: the code as it is;
- ``no memo``: torch-fidelity's pass computes its features again (``specray/eval/forward_memo.py`` off);
- ``png by PIL``: every image decoded by PIL (``specray/runtime/png_batch.py`` off);
- ``openblas spin``: OpenBLAS's default spin timeout (``OPENBLAS_THREAD_TIMEOUT=28``), not specray's 4;
- ``none``: all three off, the reducer before them.

It prints each variant's median wall time over the turns, its ratio to ``all``, and whether its report
is the same as ``all``'s to the last bit (every field but the timing ones under ``throughput``).
``--threads``: the reducer's threads (``OMP_NUM_THREADS``), 1 as in the 50k job's driver.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {  # name -> (memo, batch PNG decoding, specray's OpenBLAS spin timeout)
    "all": (True, True, True),
    "no memo": (False, True, True),
    "png by PIL": (True, False, True),
    "openblas spin": (True, True, False),
    "none": (False, False, False),
}
OPENBLAS_DEFAULT_TIMEOUT = "28"  # 2**28 cycles, OpenBLAS's own default


def reduce_once(run_dir: str, variant: str) -> dict:
    """In this process: patch the variant's paths off, reduce, return the wall time and the report's digest."""
    sys.path.insert(0, str(ROOT))
    import specray  # noqa: F401  first: it sets OpenBLAS's spin timeout before numpy loads (unless given)
    from specray.eval import reduce
    from specray.runtime import images

    memo, batch_png, _ = VARIANTS[variant]
    if not memo:
        reduce._second_pass_memo = lambda *args: contextlib.nullcontext()
    if not batch_png:
        images.decode_png_batch = lambda blobs: None
    began = time.perf_counter()
    report = reduce.reduce_run(run_dir, print_table=False, show_progress=False)
    wall = time.perf_counter() - began
    report.pop("throughput", None)  # the timing fields
    digest = hashlib.sha256(json.dumps(report, sort_keys=True, default=str).encode()).hexdigest()
    return {"wall_s": wall, "report_sha256": digest, "fid": {a["arm"]: a["fid"]["value"] for a in report["arms"]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", nargs="?", help="a committed run (its _manifest.json and shards)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each reduce (default 1)")
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    parser.add_argument("--one", nargs=2, metavar=("DIR", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(reduce_once(*args.one)))
        return
    if args.run_dir is None or not (Path(args.run_dir) / "_manifest.json").is_file():
        sys.exit(f"error: run_dir: {args.run_dir} has no _manifest.json (give a committed run's directory)")
    if "all" not in args.variants:
        args.variants = ["all", *args.variants]
    results: dict[str, list[dict]] = {name: [] for name in args.variants}
    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp) / "run"
        shutil.copytree(args.run_dir, copy, ignore=shutil.ignore_patterns("report"))
        for turn in range(args.turns):
            order = args.variants[turn % len(args.variants):] + args.variants[: turn % len(args.variants)]
            for name in order:
                env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
                       "OPENBLAS_THREAD_TIMEOUT": "4" if VARIANTS[name][2] else OPENBLAS_DEFAULT_TIMEOUT}
                out = subprocess.run([sys.executable, __file__, "--one", str(copy), name], env=env,
                                     capture_output=True, text=True)
                if out.returncode != 0:
                    sys.exit(f"error: the {name!r} reduce failed:\n{out.stderr[-3000:]}")
                results[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"turn {turn + 1}: {name}: {results[name][-1]['wall_s']:.1f} s", file=sys.stderr, flush=True)
    reference = statistics.median(r["wall_s"] for r in results["all"])
    same = results["all"][0]["report_sha256"]
    print(f"specray reduce of {args.run_dir} ({args.threads} thread(s), {args.turns} turn(s), median wall)")
    print(f"{'variant':<14} {'wall s':>7} {'x all':>6}  same report")
    for name, runs in results.items():
        wall = statistics.median(r["wall_s"] for r in runs)
        print(f"{name:<14} {wall:7.1f} {wall / reference:6.2f}  {all(r['report_sha256'] == same for r in runs)}")


if __name__ == "__main__":
    main()
