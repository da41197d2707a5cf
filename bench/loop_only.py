"""The discrete loops' own work with nothing between it: each arm's batches run again with every model call
replaced by the value it returned, in turns with the batches run as they are.

``bench/discrete.py``'s ``loop`` column is the time outside the model calls as a run pays it: right after a model
call, whose weights and code have just passed through the core's caches and predictors (the digits target's 2.6 MB
of weights, more than the development machine's 2 MB of L2 a core, at every call). This script times the same work
alone. An arm's batches run once with each model call (``bench/discrete.py``'s ``MODEL_CALLS``) recording its value;
then, in turns, the batches run as they are and run with each call handing back its recorded value instead (the same
images and statistics: checked on the first such run), so that nothing but the loop's own work runs. Per arm,
process CPU time in ms per target call (medians over ``--reps``, one torch thread):

- ``run``: the batches as they run; ``calls``: the time inside their model calls; ``between``: the rest, the
  loop's work as the run pays it (``bench/discrete.py``'s ``loop``);
- ``alone``: the batches with each model call handing back its value, each timed right after an untimed such run of
  the same batch: the loop's work warm, and a figure a change to the loop can be judged by without the calls' noise;
- ``between/alone``: what the loop's work costs more between model calls than alone (median of the paired ratios).

    python bench/loop_only.py [--batch 1] [--samples 12] [--reps 5] [--arms "target_only,sd,eagle sd"]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import discrete  # noqa: E402
from bench.pricing import batches_of, run_arm, run_in_turns  # noqa: E402
from specray.methods.discrete.loop import run_batch  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402
from specray.runtime.heap import keep_freed_memory  # noqa: E402

ALONE = " alone"  # the suffix of an arm's name for its runs with the calls handing back their values


@contextmanager
def calls_replaced(replacement: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[None]:
    """Within the block, each model call (``bench/discrete.py``'s ``MODEL_CALLS``) is ``replacement(original)``."""
    originals = {cls: getattr(cls, name) for cls, name in discrete.MODEL_CALLS.items()}
    try:
        for cls, name in discrete.MODEL_CALLS.items():
            setattr(cls, name, replacement(originals[cls]))
        yield
    finally:
        for cls, name in discrete.MODEL_CALLS.items():
            setattr(cls, name, originals[cls])


def record_values(method: str, params: dict[str, Any], pair: Any, unit: tuple, seed: int
                  ) -> tuple[list[Any], int, Any]:
    """One batch run as it is, every model call's value kept in order; returns the values, the target calls among
    them and the batch's result."""
    values: list[Any] = []
    targets = 0

    def recording(original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(stream: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal targets
            targets += discrete.model_role(stream, pair) in ("target", "target_f")
            values.append(original(stream, *args, **kwargs))
            return values[-1]
        return recorded

    with calls_replaced(recording):
        result = run_batch(method, params, pair, *unit, seed)
    return values, targets, result


def run_alone(method: str, params: dict[str, Any], pair: Any, labels: torch.Tensor, sample_ids: torch.Tensor,
              seed: int, values: list[Any]) -> Any:
    """The batch run with each model call handing back its recorded value, in order; refuses a run that makes more
    calls than were recorded, or fewer (its loop then went another way)."""
    handed = iter(values)

    def hand_back(stream: Any, *args: Any, **kwargs: Any) -> Any:
        value = next(handed, None)
        if value is None:
            raise RuntimeError(f"{method}: the run made more model calls than the {len(values)} recorded")
        return value

    with calls_replaced(lambda original: hand_back):
        result = run_batch(method, params, pair, labels, sample_ids, seed)
    if next(handed, None) is not None:
        raise RuntimeError(f"{method}: the run made fewer model calls than the {len(values)} recorded")
    return result


def same_result(a: Any, b: Any) -> bool:
    """Whether two batches' images and statistics are the same."""
    return torch.equal(a.images, b.images) and a.stats == b.stats


def bench(arms: list[tuple[str, str, dict[str, Any], Any]], work: list, reps: int, seed: int
          ) -> dict[str, dict[str, float]]:
    """Per arm (name, method, params, pair): ms per target call of ``run``, ``calls``, ``between`` and ``alone``
    (medians over ``reps``) and ``between/alone`` (the median of the paired ratios)."""
    recorded: dict[str, list[tuple[list[Any], int]]] = {}
    for name, method, params, pair in arms:
        recorded[name] = []
        for unit in work:
            values, targets, result = record_values(method, params, pair, unit, seed)
            if not same_result(result, run_alone(method, params, pair, *unit, seed, values)):
                raise RuntimeError(f"{name}: the run with its calls handing back their values made other images or "
                                   "statistics; its loop reads something a model call changes besides its value")
            recorded[name].append((values, targets))
    by_name = {name: (method, params, pair) for name, method, params, pair in arms}
    names = [n for name, *_ in arms for n in (name, name + ALONE)]
    position = {name: 0 for name in names}  # the next batch of each name's runs (run_in_turns goes batch by batch)

    def run(name: str, unit: tuple) -> dict[str, float]:
        arm = name.removesuffix(ALONE)
        method, params, pair = by_name[arm]
        values = recorded[arm][position[name] % len(work)][0]
        position[name] += 1
        if name.endswith(ALONE):  # once untimed, then timed: the work warm, not after the other arms' runs
            run_alone(method, params, pair, *unit, seed, values)
            return run_arm(lambda *a: run_alone(*a, values), method, params, pair, [unit], seed)[0]
        return run_arm(run_batch, method, params, pair, [unit], seed)[0]

    elapsed, outside = run_in_turns(names, work, reps, run, lambda: None, discrete.MODEL_CALLS)
    out = {}
    for name, *_ in arms:
        targets = sum(t for _, t in recorded[name])

        def per_rep(runs: list[dict[str, float]]) -> list[float]:  # ms per target call, repetition by repetition
            return [sum(r["cpu"] for r in runs[i : i + len(work)]) / targets * 1e3
                    for i in range(0, len(runs), len(work))]

        run_ms, between_ms, alone_ms = per_rep(elapsed[name]), per_rep(outside[name]), per_rep(elapsed[name + ALONE])
        out[name] = {"run": statistics.median(run_ms),
                     "calls": statistics.median(r - b for r, b in zip(run_ms, between_ms)),
                     "between": statistics.median(between_ms), "alone": statistics.median(alone_ms),
                     "between/alone": statistics.median(b / a for b, a in zip(between_ms, alone_ms)),
                     "target_calls": targets}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--samples", type=int, default=None, help="samples (default 12 at batch 1, else 2 batches)")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default=None, help="comma-separated rows of bench/discrete.py (default: all)")
    args = ap.parse_args(argv)

    rows = {name: (method, params, draft) for name, method, params, draft in discrete.ARMS}
    chosen = list(rows) if args.arms is None else [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in rows]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; the rows of bench/discrete.py are {list(rows)}")
    if args.batch < 1 or args.reps < 1 or (args.samples is not None and args.samples < 1):
        ap.error("--batch, --samples and --reps must be at least 1")
    torch.set_num_threads(1)
    device = torch.device("cpu")
    heap = "kept" if keep_freed_memory() else "glibc's default"
    pairs = {draft: discrete.load_pair(discrete.TARGET, draft, device) for draft in {rows[name][2] for name in chosen}}
    arms = [(name, rows[name][0], discrete.arm_params(*rows[name][:2], args.gamma), pairs[rows[name][2]])
            for name in chosen]
    samples = args.samples or (12 if args.batch == 1 else 2 * args.batch)
    work = batches_of(samples, args.batch)
    print(f"# specray loop-only bench: {discrete.TARGET} with {discrete.DRAFT} or {discrete.HEAD} on "
          f"{device_name(device)}, batch {args.batch}, {samples} samples, {args.reps} repetitions, gamma={args.gamma}, "
          f"seed={args.seed}, heap {heap}; ms of process CPU time per target call")
    results = bench(arms, work, args.reps, args.seed)
    print(f"{'arm':<18}{'run':>8}{'calls':>8}{'between':>9}{'alone':>8}{'between/alone':>15}")
    for name, r in results.items():
        print(f"{name:<18}{r['run']:>8.3f}{r['calls']:>8.3f}{r['between']:>9.3f}{r['alone']:>8.3f}"
              f"{r['between/alone']:>15.2f}")
    print("# between: the time outside the model calls in the runs; alone: the same batches with each call handing "
          "back its recorded value (the same images and statistics)")


if __name__ == "__main__":
    main()
