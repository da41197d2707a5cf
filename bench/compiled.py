"""The compiled decode path (``compile: true``) against the eager one, side by side in one run.

For each batch size and arm (target_only, sd and cool_sd, gamma 4, CFG 1.5, on digits-gpt-target with the
draft digits-gpt-draft) it runs the same samples and seeds through two copies of the pair, one
eager and one with :func:`specray.models.compiled.compile_pair`, and prints:

- ``compile_s``: the first (compiling) batch of the compiled copy, wall seconds (far less when
  torch's on-disk cache already holds the graphs from an earlier run);
- ``eager`` / ``compiled``: ms per sample, median over repetitions (interleaved, the order
  alternating), process CPU time on a CPU device (wall time on CUDA);
- ``ratio``: median over repetitions of eager time / compiled time (> 1: compiled is faster);
- ``differ``: samples whose tokens or statistics differ between the two paths (of ``samples``);
  both are exact samplers of the same law, but last-bit differences can change a residual draw
  (see :mod:`specray.models.compiled`).

    python bench/compiled.py [--batches 1,32] [--reps 5] [--samples-b1 4] [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.discrete import DRAFT, TARGET  # noqa: E402
from bench.pricing import batches_of, since, stamp, sync  # noqa: E402
from specray.methods.discrete.loop import generate_tokens  # noqa: E402
from specray.models.compiled import compile_pair  # noqa: E402
from specray.models.discrete_ar import load_pair  # noqa: E402

ARMS = (("target_only", {}), ("sd", {"gamma": 4}), ("cool_sd", {"gamma": 4}))


def run(method: str, params: dict, pair, work: list, seed: int, clock: str) -> tuple[float, list]:
    """Seconds (``clock``) for every batch of ``work``, and the tokens and stats of each batch."""
    sync(pair.device)
    start = stamp()
    outputs = [generate_tokens(method, params, pair, labels, sids, seed) for labels, sids in work]
    sync(pair.device)
    return since(start)[clock], outputs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--samples-b1", type=int, default=4, help="samples at batch 1 (one batch at larger sizes)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    clock = "cpu" if device.type == "cpu" else "wall"
    eager, compiled = load_pair(TARGET, DRAFT, device), load_pair(TARGET, DRAFT, device)
    compile_pair(compiled)
    print(f"# eager vs compiled decode: {TARGET} / {DRAFT} on {device}, torch {torch.__version__}, {clock} clock, "
          f"{args.reps} reps")
    print(f"{'batch':>5} {'method':<12} {'compile_s':>9} {'eager':>10} {'compiled':>10} {'ratio':>6} {'differ':>8}")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        work = batches_of(args.samples_b1 if batch == 1 else batch, batch)
        for method, params in ARMS:
            run(method, params, eager, work[:1], args.seed, clock)  # warm-up
            began = time.perf_counter()
            run(method, params, compiled, work[:1], args.seed, clock)  # compiles each call shape once
            compile_s = time.perf_counter() - began
            times = {"eager": [], "compiled": []}
            differ = 0
            for rep in range(args.reps):
                order = [("eager", eager), ("compiled", compiled)][:: 1 if rep % 2 == 0 else -1]
                outs = {}
                for name, pair in order:
                    elapsed, outs[name] = run(method, params, pair, work, args.seed, clock)
                    times[name].append(elapsed / (len(work) * batch))
                differ = max(differ, sum(  # the same on every repetition (both paths are deterministic)
                    not torch.equal(te[b], tc[b]) or se[b] != sc[b]
                    for (te, se), (tc, sc) in zip(outs["eager"], outs["compiled"]) for b in range(te.shape[0])))
            ratio = statistics.median(e / c for e, c in zip(times["eager"], times["compiled"]))
            samples = len(work) * batch
            row = {"batch": batch, "method": method, "compile_s": compile_s, "samples": samples, "differ": differ,
                   "ratio": ratio,
                   **{f"{k}_s_per_sample": statistics.median(v) for k, v in times.items()}}
            rows.append(row)
            print(f"{batch:>5} {method:<12} {compile_s:>9.1f} {row['eager_s_per_sample'] * 1e3:>8.2f}ms "
                  f"{row['compiled_s_per_sample'] * 1e3:>8.2f}ms {ratio:>6.2f} {differ:>4}/{samples}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(device), "clock": clock, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
