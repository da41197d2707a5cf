"""Where a speculative round's own work sits, in place: the time between its model calls, gap by gap.

The family benches' loop column is a round's time outside its model calls, in one figure. This script splits it. The
model calls and the loop's round functions are wrapped to note the time as each starts and ends, and every gap between
two notes is named by them: ``T`` a target call, ``D`` a draft call, ``<`` a start, ``>`` an end, and the round
functions below.

The diffusion family (``--family diffusion``, the default): the denoisers' ``forward`` and the round ``R``
(``loop._round``). So, in a full round:

- ``R< T<`` / ``R< D<``: the round's start up to its first call (its draws, the eps buffer);
- ``T> T<``: a Frozen round's drafts, between its first target call and the verify call;
- ``D> D<``: the model drafter's step between two draft calls; ``D> T<``: its last step, up to the verify call;
- ``T> R>``: what follows the verify call (the ratios, the verdict, resampling, the commit);
- ``R> R<``: the loop between two rounds (setting the next one up);
- ``R> T<`` and ``T> R<``: between a batch's last round and the next batch's first (the final step's call, the
  images, the next batch's start), a fraction of a time a round.

The digits presets (``digits-ddpm``, ``digits-ddpm-draft``), K = ``--steps``, gamma 7.

The discrete family's draft-GPT chains (``--family discrete``): the GPTs' calls (``GuidedModel.forward``, the call
``bench/discrete.py`` prices), the plan ``N`` (``_next_round``), the decision ``V`` (``_decide``) and the commit ``C``
(``_commit``). So, in a full round: ``N< N>`` the plan, ``N> D<`` up to the first draft call, ``D> D<`` between the
draft calls (a draw each), ``D> T<`` up to the verify call, ``T> V<``, ``V< V>`` the decision, ``C< C>`` the commit and
``C> N<`` the loop up to the next plan. The digits presets (``digits-gpt-target``, ``digits-gpt-draft``), gamma
``--gamma``, CFG 1.5 as the bench's arms.

A call's own Python around what is wrapped falls in the gaps. Per arm and gap: how often a round it occurs, its median
in µs, and its total per round in µs, the largest first; then the rounds a batch (a round takes every unfinished row of
the batch). One torch thread, the wall clock (``time.perf_counter_ns``: run it with nothing else running), ``--reps``
timed batches after ``--warm`` untimed ones.

    python bench/round_segments.py [--family diffusion] [--arms "token frozen,block free,token model"] [--batch 1]
                                   [--steps 100] [--reps 8] [--warm 3]
    python bench/round_segments.py --family discrete [--arms "sd,block,cool_sd d=2.0"] [--gamma 4] [--batch 1]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import diffusion, discrete  # noqa: E402
from bench.pricing import batches_of  # noqa: E402
from specray.methods.diffusion import loop  # noqa: E402
from specray.methods.discrete import loop as discrete_loop  # noqa: E402
from specray.models import discrete_ar  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402

GAMMA = 7
SPECULATIVE = {name: (method, drafter) for name, method, drafter in diffusion.ARMS if drafter is not None}
# The discrete bench's draft-GPT chains: (method, params) by row name (the head arms run another loop).
CHAINS = {name: (method, params) for name, method, params, draft in discrete.ARMS
          if draft == discrete.DRAFT and method != "target_only"}
Note = tuple[str, int]  # ("T<", ns): what started or ended, and when


def gaps_by_kind(notes: list[Note], round_note: str = "R<") -> tuple[dict[str, list[float]], int]:
    """The gaps between consecutive notes in µs, by their two notes (a call's own time, from its start to its end,
    left out), and the number of rounds (of ``round_note``, one a round)."""
    gaps: dict[str, list[float]] = {}
    for (first, start), (then, end) in zip(notes, notes[1:]):
        if first[0] in "TD" and first[1] == "<" and then == first[0] + ">":
            continue  # inside a call
        gaps.setdefault(f"{first} {then}", []).append((end - start) / 1e3)
    return gaps, sum(1 for what, _ in notes if what == round_note)


def _noted(function, name, notes: list[Note]):
    """``function`` noting its start and end as ``name(args)`` (a letter) + ``<`` / ``>``."""
    def timed(*args, **kwargs):
        letter = name(args) if callable(name) else name
        notes.append((letter + "<", time.perf_counter_ns()))
        out = function(*args, **kwargs)
        notes.append((letter + ">", time.perf_counter_ns()))
        return out
    return timed


@contextlib.contextmanager
def noting(pair, notes: list[Note]) -> Iterator[None]:
    """Note the start and end of every denoiser ``forward`` of ``pair`` and of every ``loop._round``."""
    rounds = loop._round
    for model, name in ((pair.target, "T"), (pair.draft, "D")):
        model.forward = _noted(model.forward, name, notes)  # an instance attribute over the class's method
    loop._round = _noted(rounds, "R", notes)
    try:
        yield
    finally:
        loop._round = rounds
        for model in (pair.target, pair.draft):
            del model.forward


@contextlib.contextmanager
def noting_chain(pair, notes: list[Note]) -> Iterator[None]:
    """Note the start and end of every ``GuidedModel.forward`` (``T`` on ``pair``'s target, else ``D``) and of every
    ``_next_round`` (``N``), ``_decide`` (``V``) and ``_commit`` (``C``) of the discrete loop."""
    wrapped = {(discrete_loop.GuidedModel, "forward"): lambda args: "T" if args[0].model is pair.target else "D",
               (discrete_loop, "_next_round"): "N", (discrete_loop, "_decide"): "V", (discrete_loop, "_commit"): "C"}
    originals = {key: getattr(*key) for key in wrapped}
    for (owner, attr), name in wrapped.items():
        setattr(owner, attr, _noted(originals[owner, attr], name, notes))
    try:
        yield
    finally:
        for (owner, attr), original in originals.items():
            setattr(owner, attr, original)


def _diffusion_arm(name: str, args, pair, batches, notes: list[Note]) -> None:
    method, drafter = SPECULATIVE[name]
    params = diffusion.arm_params(method, drafter, args.steps, GAMMA)
    with torch.inference_mode(), noting(pair, notes):
        for i, (labels, sample_ids) in enumerate(batches):
            if i == args.warm:
                notes.clear()
            loop.run_batch(method, params, pair, labels, sample_ids, args.seed)


def _chain_arm(name: str, args, pair, batches, notes: list[Note]) -> None:
    method, params = CHAINS[name]
    with noting_chain(pair, notes):
        for i, (labels, sample_ids) in enumerate(batches):
            if i == args.warm:
                notes.clear()
            discrete_loop.run_batch(method, {**params, "gamma": args.gamma}, pair, labels, sample_ids, args.seed)


class Family(NamedTuple):
    arms: dict  # the speculative rows of its bench, by name
    default_arms: str
    bench: str  # where the arms come from
    round_note: str  # the note that comes once a round
    load: Callable[[], Any]  # its model pair
    run_arm: Callable[..., None]


FAMILIES = {
    "diffusion": Family(SPECULATIVE, "token frozen,block free,token model", "bench/diffusion.py", "R<",
                        lambda: diffusion.load_pair(diffusion.TARGET, diffusion.DRAFT, "cpu"), _diffusion_arm),
    "discrete": Family(CHAINS, "sd,block,cool_sd d=2.0", "bench/discrete.py (its draft-GPT chains)", "V<",
                       lambda: discrete_ar.load_pair(discrete.TARGET, discrete.DRAFT, "cpu"), _chain_arm),
}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=list(FAMILIES), default="diffusion")
    ap.add_argument("--arms", default=None, help="comma-separated speculative rows of the family's bench (default: "
                    + "; ".join(f"{name}: {family.default_arms}" for name, family in FAMILIES.items()) + ")")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100, help="denoising steps K (diffusion)")
    ap.add_argument("--gamma", type=int, default=4, help="drafts a round (discrete)")
    ap.add_argument("--reps", type=int, default=8, help="timed batches")
    ap.add_argument("--warm", type=int, default=3, help="untimed batches first")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("batch", "steps", "gamma", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.warm < 0:
        ap.error(f"--warm must be at least 0, got {args.warm}")
    family = FAMILIES[args.family]
    chosen = [name.strip() for name in (args.arms or family.default_arms).split(",")]
    unknown = [name for name in chosen if name not in family.arms]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; the speculative rows of {family.bench} are {list(family.arms)}")
    torch.set_num_threads(1)
    pair = family.load()
    batches = batches_of(args.batch * (args.warm + args.reps), args.batch)
    shape = f"K={args.steps}, gamma={GAMMA}" if args.family == "diffusion" else f"gamma={args.gamma}"
    print(f"# specray round segments: the {args.family} family at batch {args.batch} on "
          f"{device_name(torch.device('cpu'))} (1 thread, torch {torch.__version__}), {shape}, seed={args.seed}; "
          f"{args.reps} timed batches after {args.warm}, wall clock")
    header = f"{'arm':<14} {'gap':<7} {'a round':>8} {'median us':>10} {'us a round':>11}"
    for name in chosen:
        notes: list[Note] = []
        family.run_arm(name, args, pair, batches, notes)
        gaps, rounds = gaps_by_kind(notes, family.round_note)
        print(f"\n{header}\n{'-' * len(header)}")
        for gap, times in sorted(gaps.items(), key=lambda item: -sum(item[1])):
            print(f"{name:<14} {gap:<7} {len(times) / rounds:>8.2f} {statistics.median(times):>10.1f} "
                  f"{sum(times) / rounds:>11.1f}")
        print(f"{name:<14} {'rounds':<7} {rounds / args.reps:>8.1f} a batch")


if __name__ == "__main__":
    main()
