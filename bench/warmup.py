"""How a model call's cost recovers after other work: the calls right after a switch against the same call warm.

A family bench prices each call shape back to back with its own kind (``bench/pricing.py``), while a
speculative loop switches between its draft and target calls every round. On some machines a call costs
more for a while after other work, well past what refilling the CPU's caches would take. This script
measures that on the discrete family's GPT calls at batch 32, position 56 (``digits-gpt-target``,
``digits-gpt-draft``, CFG 1.5, one torch thread, process CPU time): the call, on a cache of its own, is
warmed with ``--warm`` calls, then, after each kind of other work, ``--calls`` calls of it are timed one by one:

- ``another cache``: the same model's calls on another cache of its own (what pricing four positions in
  one timed block did: every call followed another position's);
- ``the other model``: the other GPT's calls on its cache (what a speculative loop's rounds do);
- ``asleep``: the process asleep for as long (no work of its own at all).

Each row prints the median over ``--reps`` switches of call k's cost over the warm cost (the median of
the last calls of the warm-up), for k = 1.. ``--calls``: 1.00 is no penalty.

    python bench/warmup.py [--calls 12] [--reps 8] [--warm 40] [--batch 32] [--position 56]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pricing import time_call  # noqa: E402
from specray.methods.discrete.loop import GuidedModel, generation_context  # noqa: E402
from specray.methods.discrete.params import SD  # noqa: E402
from specray.models.discrete_ar import load_pair  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402
from specray.runtime.heap import keep_freed_memory  # noqa: E402


def gpt_call(model: torch.nn.Module, batch: int, position: int, max_len: int) -> Callable[[], object]:
    """One CFG call of one token per row at ``position`` on a cache of its own, as target_only's loop makes it."""
    stream = GuidedModel(model, batch, SD(), max_len)
    idx = torch.arange(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    positions = torch.full((batch, 1), position)
    return lambda: stream.forward(idx, tokens, positions, all_rows=True, prefix=False)


def timed(call: Callable[[], object]) -> float:
    """Process CPU time of one call (the benches' clock on a CPU)."""
    return time_call(call, torch.device("cpu"), calls=1, timings=1, warmup=0)["cpu"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=12, help="calls timed after each switch")
    ap.add_argument("--reps", type=int, default=8, help="switches of each kind")
    ap.add_argument("--warm", type=int, default=40, help="calls warming the timed call before each switch")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--position", type=int, default=56)
    args = ap.parse_args(argv)
    for name in ("calls", "reps", "warm", "batch"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    keep_freed_memory()
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    max_len = pair.target.max_seq_len
    subject = gpt_call(pair.target, args.batch, args.position, max_len)
    others = {"another cache": gpt_call(pair.target, args.batch, args.position, max_len),
              "the other model": gpt_call(pair.draft, args.batch, args.position, max_len)}
    print(f"# specray warm-up bench: digits-gpt-target at batch {args.batch}, position {args.position}, on "
          f"{device_name(torch.device('cpu'))} (1 thread, torch {torch.__version__}); call k after a switch / warm cost, "
          f"median of {args.reps} switches")
    with generation_context():
        rows: dict[str, list[list[float]]] = {name: [] for name in (*others, "asleep")}
        warm_costs = []
        for _ in range(args.reps):
            for name in rows:
                warm = [timed(subject) for _ in range(args.warm)]
                warm_cost = statistics.median(warm[-args.warm // 4:])
                warm_costs.append(warm_cost)
                spent = 0.0
                if name == "asleep":
                    time.sleep(sum(warm[-args.warm // 2:]))  # as long as half the warm-up took
                else:
                    while spent < sum(warm[-args.warm // 2:]):
                        spent += timed(others[name])
                rows[name].append([timed(subject) / warm_cost for _ in range(args.calls)])
    print(f"warm cost {statistics.median(warm_costs) * 1e3:.2f} ms a call")
    print("| after | " + " | ".join(f"call {k + 1}" for k in range(args.calls)) + " | mean |")
    print("|---" * (args.calls + 2) + "|")
    for name, runs in rows.items():
        by_call = [statistics.median(run[k] for run in runs) for k in range(args.calls)]
        print(f"| {name} | " + " | ".join(f"{r:.2f}" for r in by_call) + f" | {statistics.mean(by_call):.2f} |")


if __name__ == "__main__":
    main()
