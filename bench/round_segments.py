"""Where a speculative diffusion round's own work sits, in place: the time between its model calls, gap by gap.

``bench/diffusion.py``'s ``loop/rnd`` is a round's time outside its model calls, in one figure. This script splits it.
The denoisers' ``forward`` and the round (``loop._round``) are wrapped to note the time as each starts and ends, and
every gap between two notes is named by them: ``R`` the round, ``T`` a target call, ``D`` a draft call, ``<`` a start,
``>`` an end. So, in a full round:

- ``R< T<`` / ``R< D<``: the round's start up to its first call (its draws, the eps buffer);
- ``T> T<``: a Frozen round's drafts, between its first target call and the verify call;
- ``D> D<``: the model drafter's step between two draft calls; ``D> T<``: its last step, up to the verify call;
- ``T> R>``: what follows the verify call (the ratios, the verdict, resampling, the commit);
- ``R> R<``: the loop between two rounds (setting the next one up);
- ``R> T<`` and ``T> R<``: between a batch's last round and the next batch's first (the final step's call, the
  images, the next batch's start), a fraction of a time a round.

A call's own Python (the eps closure's lookups, the module's call) falls in the gaps: only ``forward`` is inside. Per
arm and gap: how often a round it occurs, its median in µs, and its total per round in µs, the largest first; then the
rounds a batch (a round takes every unfinished row of the batch). The digits presets (``digits-ddpm``,
``digits-ddpm-draft``), K = ``--steps``, gamma 7, one torch thread, the wall clock (``time.perf_counter_ns``: run it
with nothing else running), ``--reps`` timed batches after ``--warm`` untimed ones.

    python bench/round_segments.py [--arms "token frozen,block free,token model"] [--batch 1] [--steps 100]
                                   [--reps 8] [--warm 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import diffusion  # noqa: E402
from bench.pricing import batches_of  # noqa: E402
from specray.methods.diffusion import loop  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402

GAMMA = 7
SPECULATIVE = {name: (method, drafter) for name, method, drafter in diffusion.ARMS if drafter is not None}
Note = tuple[str, int]  # ("T<", ns): what started or ended, and when


def gaps_by_kind(notes: list[Note]) -> tuple[dict[str, list[float]], int]:
    """The gaps between consecutive notes in µs, by their two notes (a call's own time, from its start to its end,
    left out), and the number of rounds."""
    gaps: dict[str, list[float]] = {}
    for (first, start), (then, end) in zip(notes, notes[1:]):
        if first[0] in "TD" and first[1] == "<" and then == first[0] + ">":
            continue  # inside a call
        gaps.setdefault(f"{first} {then}", []).append((end - start) / 1e3)
    return gaps, sum(1 for what, _ in notes if what == "R<")


@contextlib.contextmanager
def noting(pair, notes: list[Note]) -> Iterator[None]:
    """Note the start and end of every denoiser ``forward`` of ``pair`` and of every ``loop._round``."""
    def wrapped(function, name: str):
        def timed(*args, **kwargs):
            notes.append((name + "<", time.perf_counter_ns()))
            out = function(*args, **kwargs)
            notes.append((name + ">", time.perf_counter_ns()))
            return out
        return timed

    rounds = loop._round
    for model, name in ((pair.target, "T"), (pair.draft, "D")):
        model.forward = wrapped(model.forward, name)  # an instance attribute over the class's method
    loop._round = wrapped(rounds, "R")
    try:
        yield
    finally:
        loop._round = rounds
        for model in (pair.target, pair.draft):
            del model.forward


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="token frozen,block free,token model",
                    help=f"comma-separated rows of bench/diffusion.py, of {list(SPECULATIVE)}")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100, help="denoising steps K")
    ap.add_argument("--reps", type=int, default=8, help="timed batches")
    ap.add_argument("--warm", type=int, default=3, help="untimed batches first")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("batch", "steps", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warm < 0:
        ap.error(f"--warm must be at least 0, got {args.warm}")
    chosen = [name.strip() for name in args.arms.split(",")]
    unknown = [name for name in chosen if name not in SPECULATIVE]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; the speculative rows of bench/diffusion.py are {list(SPECULATIVE)}")
    torch.set_num_threads(1)
    pair = diffusion.load_pair(diffusion.TARGET, diffusion.DRAFT, "cpu")
    batches = batches_of(args.batch * (args.warm + args.reps), args.batch)
    print(f"# specray round segments: the diffusion family at batch {args.batch} on "
          f"{device_name(torch.device('cpu'))} (1 thread, torch {torch.__version__}), K={args.steps}, "
          f"gamma={GAMMA}, seed={args.seed}; {args.reps} timed batches after {args.warm}, wall clock")
    header = f"{'arm':<14} {'gap':<7} {'a round':>8} {'median us':>10} {'us a round':>11}"
    for name in chosen:
        method, drafter = SPECULATIVE[name]
        params = diffusion.arm_params(method, drafter, args.steps, GAMMA)
        notes: list[Note] = []
        with torch.inference_mode(), noting(pair, notes):
            for i, (labels, sample_ids) in enumerate(batches):
                if i == args.warm:
                    notes.clear()
                loop.run_batch(method, params, pair, labels, sample_ids, args.seed)
        gaps, rounds = gaps_by_kind(notes)
        print(f"\n{header}\n{'-' * len(header)}")
        for gap, times in sorted(gaps.items(), key=lambda item: -sum(item[1])):
            print(f"{name:<14} {gap:<7} {len(times) / rounds:>8.2f} {statistics.median(times):>10.1f} "
                  f"{sum(times) / rounds:>11.1f}")
        print(f"{name:<14} {'rounds':<7} {rounds / args.reps:>8.1f} a batch")


if __name__ == "__main__":
    main()
