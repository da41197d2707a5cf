"""Speculative diffusion benchmark on the built-in digits DDPM.

For K in {100, 1000} and batch in {1, 32}: target_only DDPM vs token / block verification
x Frozen / Free / independent-draft-model drafters (gamma = 7, residual sampler for block,
reflection for token). Prints per configuration:

- ``BE``: block efficiency, mean denoising steps advanced per verification round;
- ``steps/call``: K / target calls per sample (= SampleStats.mean_acceptance_length);
- ``calls``: sequential target calls per sample, and ``states``: target states evaluated;
- ``speedup``: measured wall clock of target_only / wall clock of the method (same samples);
- ``pred``: speedup predicted from the measured acceptance and per-call costs: the loop's
  actual network calls are recorded (batch size of each, which the acceptance determines),
  and each is priced at the latency measured for that batch size in isolation (grid
  1..256, linear interpolation); target_only priced the same way. This is the cost model of
  spec_diffusion.md 2.4 evaluated on the real ragged call pattern;
- ``eff``: measured speedup / predicted speedup (1.0 = the loop adds no overhead beyond the
  network calls the cost model counts).

Run: ``OMP_NUM_THREADS=1 python bench/diffusion.py [--device cuda] [--samples 2] [--out bench.json]``.
Sample counts are small (one batch per configuration); numbers are indicative.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specray.methods.diffusion import loop as diffusion_loop
from specray.models.diffusion import load_pair

ARMS = [(method, drafter) for method in ("spec_token", "spec_block") for drafter in ("frozen", "free", "model")]


def call_latency(model, n: int, device: torch.device, reps: int = 5) -> float:
    x = torch.randn(n, 1, 8, 8, device=device)
    t = torch.full((n,), 500, dtype=torch.int64, device=device)
    y = torch.zeros(n, dtype=torch.int64, device=device)
    model(x, t, y)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        model(x, t, y)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class CallRecorder(torch.nn.Module):
    """Wraps a denoiser and records the batch size of every call (the loop's actual call pattern)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model
        self.sizes: list[int] = []

    def forward(self, x, timesteps, labels, guidance_scale=1.0):
        self.sizes.append(int(x.shape[0]))
        return self.model(x, timesteps, labels, guidance_scale)


GRID = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def interpolate(latency: dict[int, float], n: int) -> float:
    """Per-call latency at batch n, linear between the measured grid points."""
    if n <= 0:
        return 0.0
    lower = max(g for g in GRID if g <= n) if n >= 1 else 1
    upper = min((g for g in GRID if g >= n), default=GRID[-1])
    if upper == lower:
        return latency[lower] * (n / lower if n > GRID[-1] else 1.0)
    w = (n - lower) / (upper - lower)
    return (1 - w) * latency[lower] + w * latency[upper]


def run(pair, method: str, params: dict, labels: torch.Tensor, ids: torch.Tensor, seed: int):
    if pair.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = diffusion_loop.run_batch(method, params, pair, labels, ids, seed)
    if pair.device.type == "cuda":
        torch.cuda.synchronize()
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--target", default="digits-ddpm")
    parser.add_argument("--draft", default="digits-ddpm-draft")
    parser.add_argument("--steps", type=int, nargs="+", default=[100, 1000])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--samples", type=int, default=1, help="batches per configuration (batch 1: samples)")
    parser.add_argument("--gamma", type=int, default=7)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(1) if args.device == "cpu" else None
    device = torch.device(args.device)
    pair = load_pair(args.target, args.draft, device)
    # per-call latency on a grid of batch sizes, measured once up front
    target_latency = {n: call_latency(pair.target, n, device) for n in GRID}
    draft_latency = {n: call_latency(pair.draft, n, device) for n in GRID}
    cache = {("target", n): v for n, v in target_latency.items()} | {("draft", n): v for n, v in draft_latency.items()}
    target_rec, draft_rec = CallRecorder(pair.target), CallRecorder(pair.draft)
    pair.target, pair.draft = target_rec, draft_rec

    def predicted_calls_time() -> float:
        """Sum of the measured per-call latencies over the calls the loop actually made."""
        t = sum(interpolate(target_latency, n) for n in target_rec.sizes) + sum(interpolate(draft_latency, n) for n in draft_rec.sizes)
        target_rec.sizes.clear()
        draft_rec.sizes.clear()
        return t

    rows = []
    print(f"device={device} gamma={args.gamma} batches/config={args.samples} (small sample counts: indicative numbers)")
    header = f"{'K':>5} {'B':>3} {'method':<11} {'drafter':<7} {'BE':>6} {'steps/call':>10} {'calls':>7} {'states':>7} {'wall_s':>8} {'speedup':>7} {'pred':>6} {'eff':>5}"
    for K in args.steps:
        for B in args.batches:
            print(header)
            base_time = 0.0
            base_pred_time = 0.0
            results = {}
            for rep in range(args.samples):
                labels = torch.arange(rep * B, (rep + 1) * B) % 10
                ids = torch.arange(rep * B, (rep + 1) * B)
                predicted_calls_time()
                _, wall = run(pair, "target_only", {"num_steps": K}, labels, ids, args.seed)
                base_time += wall
                base_pred_time += predicted_calls_time()
                for method, drafter in ARMS:
                    params = {"num_steps": K, "drafter": drafter, "gamma": args.gamma}
                    result, wall = run(pair, method, params, labels, ids, args.seed)
                    acc = results.setdefault((method, drafter), {"wall": 0.0, "stats": [], "pred_time": 0.0})
                    acc["wall"] += wall
                    acc["pred_time"] += predicted_calls_time()
                    acc["stats"].extend(result.stats)
            rows.append({"K": K, "B": B, "method": "target_only", "drafter": None, "wall_s": base_time, "speedup": 1.0})
            print(f"{K:>5} {B:>3} {'target_only':<11} {'-':<7} {1.0:>6.2f} {1.0:>10.2f} {K:>7} {K:>7} {base_time:>8.2f} {1.0:>7.2f} {1.0:>6.2f} {1.0:>5.2f}")
            for (method, drafter), acc in results.items():
                stats = acc["stats"]
                mean = lambda f: sum(f(s) for s in stats) / len(stats)  # noqa: E731
                be = mean(lambda s: s.extra["block_efficiency"])
                calls = mean(lambda s: s.target_calls)
                states = mean(lambda s: s.extra["states_evaluated"])
                speedup = base_time / acc["wall"]
                pred = base_pred_time / acc["pred_time"]
                row = {"K": K, "B": B, "method": method, "drafter": drafter, "block_efficiency": be,
                       "steps_per_target_call": K / calls, "target_calls": calls, "states_evaluated": states,
                       "wall_s": acc["wall"], "speedup": speedup, "predicted_speedup": pred, "efficiency": speedup / pred,
                       "n_samples": len(stats)}
                rows.append(row)
                print(f"{K:>5} {B:>3} {method:<11} {drafter:<7} {be:>6.2f} {K / calls:>10.2f} {calls:>7.1f} {states:>7.1f} "
                      f"{acc['wall']:>8.2f} {speedup:>7.2f} {pred:>6.2f} {speedup / pred:>5.2f}")
            for drafter in ("frozen", "free", "model"):
                tok, blk = results[("spec_token", drafter)], results[("spec_block", drafter)]
                print(f"      block vs token ({drafter}): wall clock {tok['wall'] / blk['wall'] - 1:+.1%}")
    print("per-call latency (s):", {f"{k[0]}[{k[1]}]": round(v, 5) for k, v in sorted(cache.items())})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "latency": {f"{k[0]}[{k[1]}]": v for k, v in cache.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
