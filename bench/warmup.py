"""How a model call's cost recovers after other work: the calls right after a switch against the same call warm.

A family bench prices each call shape back to back with its own kind (``bench/pricing.py``), while a
speculative loop switches between its draft and target calls every round. On some machines a call costs
more for a while after other work, well past what refilling the CPU's caches would take. By default this script
measures that on the discrete family's GPT calls at batch 32, position 56 (``digits-gpt-target``,
``digits-gpt-draft``, CFG 1.5, one torch thread, process CPU time): the call, on a cache of its own, is
warmed with ``--warm`` calls, then, after each kind of other work, ``--calls`` calls of it are timed one by one:

- ``another cache``: the same model's calls on another cache of its own (what pricing four positions in
  one timed block did: every call followed another position's);
- ``the other model``: the other GPT's calls on its cache (what a speculative loop's rounds do);
- ``Python alone``: the interpreter's own arithmetic for as long (no torch call, next to no memory touched);
- ``one small op``: one in-place add on 8 floats, made again and again for as long (one short path of torch's code);
- ``asleep``: the process asleep for as long (no work of its own at all).

"As long" is half the warm-up's time, or each of ``--away-ms`` in turn (the penalty against the time away).
``--model draft`` times the draft GPT instead, and the other model is then the target. ``--other-rows`` gives the
other model's calls another number of rows than ``--batch``.

``--family diffusion`` times the diffusion family's denoiser calls instead (``digits-ddpm``, ``digits-ddpm-draft``,
as ``bench/diffusion.py`` prices them: ``--batch`` rows at random steps, no guidance), whose other work is then
``other inputs`` (the same model on other rows) in place of another cache. A speculative diffusion round with the
model drafter makes its draft's calls on the batch's rows and verifies on up to gamma times as many:
``--family diffusion --model draft --batch 32 --other-rows 224`` is the draft's first call after such a verify.

Each row prints the median over ``--reps`` switches of call k's cost over the warm cost (the median of
the last calls of the warm-up), for k = 1.. ``--calls``: 1.00 is no penalty.

``--small-calls`` times three calls of a few microseconds instead, each the first after ``--away-ms`` of the
interpreter's arithmetic (default 0.05 to 5 ms) against the same call warm (after ``--warm`` calls of itself): one
in-place torch add on 8 floats, one NumPy add on 64 floats, and the interpreter's own ``sum(range(50))``, which
needs no vector unit. Wall clock (a vDSO read), medians of ``--reps``: whatever the code, a first call after time
away pays more the longer that time.

    python bench/warmup.py [--calls 12] [--reps 8] [--warm 40] [--batch 32] [--position 56] [--model target]
                           [--away-ms 0.15,0.5,1.5] [--family discrete] [--other-rows BATCH]
    python bench/warmup.py --small-calls [--reps 8] [--warm 40] [--away-ms 0.05,0.2,0.5,1,1.5,3,5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.diffusion import denoiser_call  # noqa: E402
from bench.pricing import time_call  # noqa: E402
from specray.methods.discrete.loop import GuidedModel, generation_context  # noqa: E402
from specray.methods.discrete.params import SD  # noqa: E402
from specray.models import diffusion, discrete_ar  # noqa: E402
from specray.models.pair import ModelPair  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402
from specray.runtime.heap import keep_freed_memory  # noqa: E402


def gpt_call(model: torch.nn.Module, batch: int, position: int, max_len: int) -> Callable[[], object]:
    """One CFG call of one token per row at ``position`` on a cache of its own, as target_only's loop makes it."""
    stream = GuidedModel(model, batch, SD(), max_len)
    idx = torch.arange(batch)
    tokens = torch.randint(0, model.config.vocab_size, (batch, 1), generator=torch.Generator().manual_seed(0))
    positions = torch.full((batch, 1), position)
    return lambda: stream.forward(idx, tokens, positions, all_rows=True, prefix=False)


def gpt_call_of(pair: ModelPair, model: torch.nn.Module, rows: int, position: int, seed: int) -> Callable[[], object]:
    """:func:`gpt_call` of ``model`` (of ``pair``) on ``rows`` rows (its tokens are seeded on their own)."""
    return gpt_call(model, rows, position, pair.target.max_seq_len)


def denoiser_call_of(pair: ModelPair, model: torch.nn.Module, rows: int, position: int,
                     seed: int) -> Callable[[], object]:
    """A call of the denoiser ``model`` (of ``pair``) on ``rows`` rows at random steps, no guidance, its inputs drawn
    from ``seed``, as ``bench/diffusion.py`` prices it (``position`` has no meaning here)."""
    steps = pair.info["scheduler"].config.num_train_timesteps
    return denoiser_call(model, rows, steps, pair.info["image_shape"], 1.0, torch.Generator().manual_seed(seed),
                         pair.device)


@dataclass(frozen=True)
class Family:
    target: str
    draft: str
    load_pair: Callable[..., ModelPair]
    context: Callable[[], contextlib.AbstractContextManager]  # what the family's loops run their calls in
    call: Callable[..., Callable[[], object]]  # (pair, model, rows, position, seed) -> one call
    same_model: str  # the row of the timed model's calls on other data
    where: str  # the calls' place, for the header ({position}: --position)


FAMILIES = {
    "discrete": Family("digits-gpt-target", "digits-gpt-draft", discrete_ar.load_pair, generation_context, gpt_call_of,
                       "another cache", "position {position}"),
    "diffusion": Family("digits-ddpm", "digits-ddpm-draft", diffusion.load_pair, contextlib.nullcontext,
                        denoiser_call_of, "other inputs", "random steps"),
}


def timed(call: Callable[[], object]) -> float:
    """Process CPU time of one call (the benches' clock on a CPU)."""
    return time_call(call, torch.device("cpu"), calls=1, timings=1, warmup=0)["cpu"]


def python_alone(seconds: float) -> None:
    """The interpreter's own work for ``seconds``: integer arithmetic, no torch call (the clock read is a vDSO call,
    not a system call as the process clock's is)."""
    end = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < end:
        for i in range(200):
            total += i * 3 % 7


def one_small_op(seconds: float) -> None:
    """One in-place add on 8 floats, again and again for ``seconds`` (the clock read as in :func:`python_alone`)."""
    x = torch.zeros(8)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(20):
            x.add_(1.0)


SMALL_CALLS_AWAY_MS = (0.05, 0.2, 0.5, 1.0, 1.5, 3.0, 5.0)


def small_calls() -> dict[str, Callable[[], object]]:
    """Calls of a few microseconds, each on its own code: torch's dispatch and kernel, NumPy's, the interpreter's."""
    floats = torch.zeros(8)
    array = np.zeros(64, dtype=np.float32)
    return {"torch add, 8 floats": lambda: floats.add_(1.0),
            "NumPy add, 64 floats": lambda: np.add(array, 1.0, out=array),
            "sum(range(50))": lambda: sum(range(50))}


def first_call_after(call: Callable[[], object], away: float, warm: int) -> tuple[float, float]:
    """Seconds of ``call`` warm (after ``warm`` calls of itself) and of the first call after ``away`` seconds of the
    interpreter's arithmetic (:func:`python_alone`); wall clock, which reads in nanoseconds without a system call."""
    for _ in range(warm):
        call()
    start = time.perf_counter()
    call()
    warm_cost = time.perf_counter() - start
    python_alone(away)
    start = time.perf_counter()
    call()
    return warm_cost, time.perf_counter() - start


def report_small_calls(away: list[float], reps: int, warm: int) -> None:
    """The ``--small-calls`` table: per call, its warm cost and its first call's after each time away, in µs
    (medians of ``reps``), with the ratio."""
    calls = small_calls()
    print(f"# specray warm-up bench: small calls on {device_name(torch.device('cpu'))} (1 thread, torch "
          f"{torch.__version__}); the first call after the interpreter's arithmetic against the same call warm, "
          f"wall clock, median of {reps}")
    print("| call | warm | " + " | ".join(f"after {seconds * 1e3:g} ms" for seconds in away) + " |")
    print("|---" * (len(away) + 2) + "|")
    for name, call in calls.items():
        warm_costs, cells = [], []
        for seconds in away:
            runs = [first_call_after(call, seconds, warm) for _ in range(reps)]
            warm_costs += [w for w, _ in runs]
            cells.append(statistics.median(c for _, c in runs))
        warm_cost = statistics.median(warm_costs)
        row = [f"{cost * 1e6:.1f} µs ({cost / warm_cost:.2f}×)" for cost in cells]
        print(f"| {name} | {warm_cost * 1e6:.1f} µs | " + " | ".join(row) + " |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=12, help="calls timed after each switch")
    ap.add_argument("--reps", type=int, default=8, help="switches of each kind")
    ap.add_argument("--warm", type=int, default=40, help="calls warming the timed call before each switch")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--position", type=int, default=56)
    ap.add_argument("--model", choices=("target", "draft"), default="target", help="the model whose calls are timed")
    ap.add_argument("--family", choices=tuple(FAMILIES), default="discrete",
                    help="whose models: the discrete family's GPTs or the diffusion family's denoisers")
    ap.add_argument("--other-rows", type=int, default=None, help="rows of the other model's calls (default --batch)")
    ap.add_argument("--away-ms", default=None,
                    help="comma-separated times away from the call, in ms (default: half the warm-up's time; "
                         "with --small-calls 0.05 to 5 ms)")
    ap.add_argument("--small-calls", action="store_true",
                    help="time calls of a few microseconds (a torch add, a NumPy add, the interpreter's sum) after "
                         "time away instead of a GPT's")
    args = ap.parse_args(argv)
    try:
        away = None if args.away_ms is None else [float(ms) / 1e3 for ms in args.away_ms.split(",")]
    except ValueError:
        ap.error(f"--away-ms takes comma-separated numbers of milliseconds, got {args.away_ms!r}")
    if away is not None and any(s <= 0 for s in away):
        ap.error(f"--away-ms takes times above 0, got {args.away_ms!r}")
    for name in ("calls", "reps", "warm", "batch", "other_rows"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    if args.small_calls:
        report_small_calls(away or [ms / 1e3 for ms in SMALL_CALLS_AWAY_MS], args.reps, args.warm)
        return
    keep_freed_memory()
    family = FAMILIES[args.family]
    pair = family.load_pair(family.target, family.draft, torch.device("cpu"))
    timed_model, other_model = (pair.target, pair.draft) if args.model == "target" else (pair.draft, pair.target)
    other_rows = args.other_rows or args.batch
    subject = family.call(pair, timed_model, args.batch, args.position, seed=0)
    others = {family.same_model: family.call(pair, timed_model, args.batch, args.position, seed=1),
              "the other model": family.call(pair, other_model, other_rows, args.position, seed=2)}
    work = {"Python alone": python_alone, "one small op": one_small_op, "asleep": time.sleep}
    timed_name = family.target if args.model == "target" else family.draft
    where = family.where.format(position=args.position)
    print(f"# specray warm-up bench: {timed_name} at batch {args.batch}, {where}, the other model on {other_rows} "
          f"rows, on {device_name(torch.device('cpu'))} (1 thread, torch {torch.__version__}); call k after a switch / "
          f"warm cost, median of {args.reps} switches")
    cases = [(name, seconds) for seconds in (away or [None]) for name in (*others, *work)]
    with family.context():
        rows: dict[tuple[str, float | None], list[list[float]]] = {case: [] for case in cases}
        warm_costs = []
        for _ in range(args.reps):
            for name, seconds in cases:
                warm = [timed(subject) for _ in range(args.warm)]
                warm_cost = statistics.median(warm[-args.warm // 4:])
                warm_costs.append(warm_cost)
                span = sum(warm[-args.warm // 2:]) if seconds is None else seconds  # half the warm-up's time
                if name in work:
                    work[name](span)
                else:
                    spent = 0.0
                    while spent < span:
                        spent += timed(others[name])
                rows[name, seconds].append([timed(subject) / warm_cost for _ in range(args.calls)])
    print(f"warm cost {statistics.median(warm_costs) * 1e3:.2f} ms a call")
    print("| after | away | " + " | ".join(f"call {k + 1}" for k in range(args.calls)) + " | mean |")
    print("|---" * (args.calls + 3) + "|")
    for (name, seconds), runs in rows.items():
        by_call = [statistics.median(run[k] for run in runs) for k in range(args.calls)]
        span = "half the warm-up" if seconds is None else f"{seconds * 1e3:g} ms"
        cells = [span, *(f"{r:.2f}" for r in by_call), f"{statistics.mean(by_call):.2f}"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
