"""Benchmark of CSpD on the built-in continuous presets (digits-mar-target / digits-mar-draft).

Prints, per configuration (batch size × mode × alignment × pre-fill × window):
acceptance rate α, mean acceptance length (tokens per target call), speedup
over target_only (wall time, same samples and seeds), and efficiency =
measured speedup / speedup predicted from the measured call counts (which
follow from α in the sequential window) and measured per-call costs of each
model (target-only wall time per step of the target and of the draft).

    OMP_NUM_THREADS=1 python bench/continuous.py [--device cpu] [--gamma 4] [--samples 32]
"""

from __future__ import annotations

import argparse
import time

import torch

from specray.methods.continuous.loop import run_batch
from specray.models.continuous_ar import load_pair


def timed(method: str, params: dict, pair, batch: int, samples: int, seed: int = 0):
    stats, wall = [], 0.0
    for start in range(0, samples, batch):
        sids = torch.arange(start, start + batch)
        labels = sids % 10
        t = time.perf_counter()
        out = run_batch(method, params, pair, labels, sids, seed)
        wall += time.perf_counter() - t
        stats += out.stats
    return wall, stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--samples", type=int, default=32, help="samples per configuration (batch 1 uses --samples-b1)")
    ap.add_argument("--samples-b1", type=int, default=4)
    ap.add_argument("--batches", default="1,32")
    args = ap.parse_args()
    dev = torch.device(args.device)
    pair = load_pair("digits-mar-target", "digits-mar-draft", dev)
    draft_as_target = load_pair("digits-mar-draft", None, dev)
    print(f"{'bs':>3} {'mode':>6} {'window':>10} {'align':>5} {'prefill':>7} {'alpha':>6} {'len':>5} "
          f"{'speedup':>7} {'predicted':>9} {'eff':>5} {'tries':>5} {'caps':>4}")
    for batch in [int(b) for b in args.batches.split(",")]:
        n = args.samples_b1 if batch == 1 else args.samples
        run_batch("target_only", {}, pair, torch.arange(batch) % 10, torch.arange(batch), 99)  # warm-up
        t_target, _ = timed("target_only", {}, pair, batch, n)
        t_draft, _ = timed("target_only", {}, draft_as_target, batch, n)
        cost_t, cost_d = t_target / 16, t_draft / 16  # per call, per configuration's whole sample set
        print(f"# bs={batch}: target_only {t_target / n * 1000:.1f} ms/sample; draft step/target step cost c = {cost_d / cost_t:.3f}")
        configs = []
        for mode in ("paper", "exact"):
            for no_align in (False, True):
                configs.append({"mode": mode, "no_align": no_align, "prefill_ratio": 0.05, "window": "mar"})
            configs.append({"mode": mode, "no_align": False, "prefill_ratio": 0.0, "window": "mar"})
        configs.append({"mode": "code", "no_align": False, "prefill_ratio": 0.05, "window": "mar"})
        configs.append({"mode": "code", "no_align": True, "prefill_ratio": 0.05, "window": "mar"})
        configs.append({"mode": "exact", "no_align": False, "prefill_ratio": 0.05, "window": "sequential"})
        for cfg in configs:
            params = {**cfg, "gamma": args.gamma}
            wall, stats = timed("cspd", params, pair, batch, n)
            drafted = sum(s.num_draft_tokens for s in stats)
            alpha = sum(s.num_accepted_draft_tokens for s in stats) / max(drafted, 1)
            length = sum(s.num_tokens for s in stats) / sum(s.target_calls for s in stats)
            # per-batch call counts (rows of a batch run in lockstep: the max row's calls cost the batch)
            n_batches = n // batch
            tc = sum(max(s.target_calls for s in stats[i * batch:(i + 1) * batch]) for i in range(n_batches)) / n_batches
            dc = sum(max(s.draft_calls for s in stats[i * batch:(i + 1) * batch]) for i in range(n_batches)) / n_batches
            predicted = t_target / (tc * cost_t + dc * cost_d)
            speedup = t_target / wall
            tries = [s.extra["mean_resample_tries"] for s in stats if s.extra["resampled_tokens"]]
            caps = sum(s.extra["resample_cap_hits"] for s in stats)
            print(f"{batch:>3} {cfg['mode']:>6} {cfg['window']:>10} {str(not cfg['no_align']):>5} {cfg['prefill_ratio']:>7.2f} "
                  f"{alpha:>6.3f} {length:>5.2f} {speedup:>7.2f} {predicted:>9.2f} {speedup / predicted:>5.2f} "
                  f"{(sum(tries) / len(tries) if tries else 0):>5.2f} {caps:>4}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
