"""The compiled paths (``compile: true``) against the eager ones, side by side in one run.

For each family, batch size and arm it runs the same samples and seeds through two copies of the
pair, one eager and one compiled, and prints:

- discrete (:func:`specray.models.compiled.compile_pair`, the decode steps): target_only, sd and
  cool_sd, gamma 4, CFG 1.5, on digits-gpt-target with the draft digits-gpt-draft;
- continuous (:func:`specray.models.compiled.compile_continuous_pair`, the diffusion heads):
  target_only and cspd, gamma 4, on digits-mar-target with the draft digits-mar-draft;

- ``compile_s``: the first (compiling) batch of the compiled copy, wall seconds (far less when
  torch's on-disk cache already holds the graphs from an earlier run);
- ``eager`` / ``compiled``: ms per sample, median over repetitions (interleaved, the order
  alternating), process CPU time on a CPU device (wall time on CUDA);
- ``ratio``: median over repetitions of eager time / compiled time (> 1: compiled is faster);
- ``ratio 90%``: a 90 % confidence interval for that median (:func:`~bench.pricing.ratio_interval`; of 5 to 7
  repetitions their lowest and highest ratio, of 15 the 4th to the 12th): "at least as fast" holds at that
  confidence where its lowest point is 1 or more;
- ``graphs`` (CUDA only): CUDA graphs recorded during the timed repetitions, which should be 0 once the first
  batch has recorded each shape; more means graphs recorded again batch after batch (a cache at a new address);
- ``differ``: samples whose output differs between the two paths (of ``samples``). Discrete: the
  tokens or statistics; both are exact samplers of the same law, but last-bit differences can
  change a residual draw (see :mod:`specray.models.compiled`). Continuous: the uint8 images or the
  acceptance counts (the float tokens always differ in the last bits).

    python bench/compiled.py [--families discrete,continuous] [--batches 1,32] [--reps 5] [--samples-b1 4]
                             [--device cpu] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pricing import batches_of, interval_text, paired_speedup, ratio_interval, since, stamp, sync  # noqa: E402
from specray.methods.continuous.loop import run_batch as run_continuous  # noqa: E402
from specray.methods.discrete.loop import generate_tokens  # noqa: E402
from specray.models import continuous_ar, discrete_ar  # noqa: E402
from specray.models.compiled import compile_continuous_pair, compile_pair  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402


def _discrete(method: str, params: dict, pair, labels: torch.Tensor, sids: torch.Tensor, seed: int) -> list:
    """Per sample: its tokens and statistics."""
    tokens, stats = generate_tokens(method, params, pair, labels, sids, seed)
    return [(tokens[b], stats[b]) for b in range(tokens.shape[0])]


def _continuous(method: str, params: dict, pair, labels: torch.Tensor, sids: torch.Tensor, seed: int) -> list:
    """Per sample: its uint8 image and acceptance counts (the float means in ``extra`` left out)."""
    out = run_continuous(method, params, pair, labels, sids, seed)
    counts = [{**vars(s), "extra": {k: v for k, v in s.extra.items() if not isinstance(v, float)}} for s in out.stats]
    return list(zip(out.images, counts))


# family: (target, draft, load_pair, compile, sample, arms)
FAMILIES = {
    "discrete": ("digits-gpt-target", "digits-gpt-draft", discrete_ar.load_pair, compile_pair, _discrete,
                 (("target_only", {}), ("sd", {"gamma": 4}), ("cool_sd", {"gamma": 4}))),
    "continuous": ("digits-mar-target", "digits-mar-draft", continuous_ar.load_pair, compile_continuous_pair,
                   _continuous, (("target_only", {}), ("cspd", {"gamma": 4}))),
}


def run(sample, method: str, params: dict, pair, work: list, seed: int, clock: str) -> tuple[float, list]:
    """Seconds (``clock``) for every batch of ``work``, and each sample's output."""
    sync(pair.device)
    start = stamp()
    outputs = [out for labels, sids in work for out in sample(method, params, pair, labels, sids, seed)]
    sync(pair.device)
    return since(start)[clock], outputs


def cuda_graph_recordings() -> Callable[[], int] | None:
    """A count of the CUDA graphs recorded from now on (torch's compile callbacks), or None without them."""
    try:
        from torch._dynamo.callback import CallbackTrigger, callback_handler
    except ImportError:
        return None
    count = 0

    def on_start(args) -> None:
        nonlocal count
        if args.callback_trigger == CallbackTrigger.CUDAGRAPH_RECORDING:
            count += 1

    callback_handler.register_start_callback(on_start)
    return lambda: count


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def summary(times: dict[str, list[float]]) -> dict:
    """The table's timing figures from each path's seconds per sample, repetition by repetition (``eager``,
    ``compiled``): the medians, the paired ratio and its interval, and the repetitions themselves."""
    eager, compiled = times["eager"], times["compiled"]
    return {"ratio": paired_speedup(eager, compiled), "ratio_interval": ratio_interval(eager, compiled),
            **{f"{k}_s_per_sample": statistics.median(v) for k, v in times.items()},
            **{f"{k}_reps_s_per_sample": list(v) for k, v in times.items()}}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--families", default="discrete,continuous", help=f"of {', '.join(FAMILIES)}")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--samples-b1", type=int, default=4, help="samples at batch 1 (one batch at larger sizes)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device(args.device)
    clock = "cpu" if device.type == "cpu" else "wall"
    print(f"# eager vs compiled: on {device}, {device_name(device)}, torch {torch.__version__}, {clock} clock, "
          f"{args.reps} reps")
    recordings = cuda_graph_recordings() if device.type == "cuda" else None
    print(f"{'family':<10} {'batch':>5} {'method':<12} {'compile_s':>9} {'eager':>10} {'compiled':>10} {'ratio':>6} "
          f"{'ratio 90%':>9} {'graphs':>6} {'differ':>8}")
    rows = []
    for family in args.families.split(","):
        target, draft, load_pair, compile_models, sample, arms = FAMILIES[family]
        eager, compiled = load_pair(target, draft, device), load_pair(target, draft, device)
        compile_models(compiled)
        for batch in (int(b) for b in args.batches.split(",")):
            work = batches_of(args.samples_b1 if batch == 1 else batch, batch)
            for method, params in arms:
                run(sample, method, params, eager, work[:1], args.seed, clock)  # warm-up
                began = time.perf_counter()
                run(sample, method, params, compiled, work[:1], args.seed, clock)  # compiles each graph once
                compile_s = time.perf_counter() - began
                times = {"eager": [], "compiled": []}
                differ = 0
                recorded_before = recordings() if recordings else None
                for rep in range(args.reps):
                    order = [("eager", eager), ("compiled", compiled)][:: 1 if rep % 2 == 0 else -1]
                    outs = {}
                    for name, pair in order:
                        elapsed, outs[name] = run(sample, method, params, pair, work, args.seed, clock)
                        times[name].append(elapsed / (len(work) * batch))
                    # the same on every repetition (both paths are deterministic)
                    differ = max(differ, sum(not _same(e, c) for e, c in zip(outs["eager"], outs["compiled"])))
                samples = len(work) * batch
                graphs = recordings() - recorded_before if recordings else None
                row = {"family": family, "batch": batch, "method": method, "compile_s": compile_s, "samples": samples,
                       "differ": differ, "cuda_graphs_recorded_in_reps": graphs, **summary(times)}
                rows.append(row)
                eager_ms, compiled_ms = (row[f"{k}_s_per_sample"] * 1e3 for k in ("eager", "compiled"))
                print(f"{family:<10} {batch:>5} {method:<12} {compile_s:>9.1f} {eager_ms:>8.2f}ms {compiled_ms:>8.2f}ms "
                      f"{row['ratio']:>6.2f} {interval_text(row['ratio_interval']):>9} "
                      f"{'-' if graphs is None else graphs:>6} {differ:>4}/{samples}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"device": str(device), "machine": device_name(device), "clock": clock,
                                         "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
