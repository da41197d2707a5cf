"""Where a discrete arm's model calls cost more than their shape prices, model by model.

``bench/discrete.py``'s ``ovh`` (an arm's time over the sum of its calls' shape prices) mixes three things:
the loop's own work, what a call costs more in the loop's order than back to back with itself (right after
the other model's calls, or the call that grows its cache), and whatever the shape prices miss of the calls
themselves. This script takes the last two apart. Each batch's calls, recorded in an untimed pass
(``bench/discrete.py``'s ``count_calls``), are made again in their order as the replays make them
(:class:`~bench.pricing.CallRecording`), each one timed; right after it the same call is made ``--again``
more times on the same state (its cache lengths set back first) and the median of those taken. Per arm and
model (``target``, ``draft``; the head arms' ``target_f`` and ``head``), the calls' total per batch:

- ``in order``: each call where the loop's order puts it;
- ``again``: each call made right after itself: its cost warm, in place, at its own shape;
- ``priced``: ``bench/discrete.py``'s shape prices of the same calls, timed in this run the way that bench
  times them;

and ``in order / again`` (what the order costs: no price of a shape alone can see it) and ``again / priced``
(what the shape prices miss of the calls; 1.00: nothing). Process CPU time, one torch thread.

    python bench/in_place.py [--batch 32] [--arms "target_only,sd,eagle sd"] [--reps 3] [--again 4]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import discrete  # noqa: E402
from bench.pricing import batches_of, parse_shape, shape_cost  # noqa: E402
from specray.methods.discrete.eagle_loop import HeadStream, TargetStream  # noqa: E402
from specray.methods.discrete.loop import GuidedModel, generation_context  # noqa: E402
from specray.models.discrete_ar import load_pair  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402
from specray.runtime.heap import keep_freed_memory  # noqa: E402

ROLES = {TargetStream: "target_f", HeadStream: "head"}


def role_of(stream: Any, pair: Any) -> str:
    """The bench's name of the model a stream calls (as ``bench/discrete.py`` counts its shapes)."""
    if isinstance(stream, GuidedModel):
        return "target" if stream.model is pair.target else "draft"
    return ROLES[type(stream)]


def time_in_place(recording: Any, pair: Any, again: int) -> tuple[dict[str, float], dict[str, float]]:
    """One replay of ``recording``: per model, the seconds its calls took in order, and made again right after."""
    in_order: dict[str, float] = {}
    warm: dict[str, float] = {}

    def make(stream: Any, call: Callable[[], Any]) -> Any:
        state = recording.state(stream)
        before = state.clone()
        start = time.process_time()
        out = call()
        took = time.process_time() - start
        after = state.clone()
        repeats = []
        for _ in range(again):
            state.copy_(before)  # the same call on the same state: the K/V it writes are the same
            start = time.process_time()
            call()
            repeats.append(time.process_time() - start)
        state.copy_(after)
        role = role_of(stream, pair)
        in_order[role] = in_order.get(role, 0.0) + took
        warm[role] = warm.get(role, 0.0) + statistics.median(repeats)
        return out

    with generation_context():
        recording.replay(make)
    return in_order, warm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--arms", default="target_only,sd,eagle sd",
                    help=f"comma-separated rows of bench/discrete.py: {', '.join(name for name, *_ in discrete.ARMS)}")
    ap.add_argument("--reps", type=int, default=3, help="replays of each arm's batch (the median is taken)")
    ap.add_argument("--again", type=int, default=4, help="times each call is made again right after itself")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    arms = {name: (method, params, draft) for name, method, params, draft in discrete.ARMS}
    chosen = [name.strip() for name in args.arms.split(",")]
    unknown = [name for name in chosen if name not in arms]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; choose among {list(arms)}")
    for name in ("batch", "reps", "again"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    keep_freed_memory()
    pairs = {draft: load_pair(discrete.TARGET, draft, "cpu") for draft in (discrete.DRAFT, discrete.HEAD)}
    work = batches_of(args.batch, args.batch)[:1]  # one batch: every class but at batch 1
    print(f"# specray in-place bench: {discrete.TARGET} at batch {args.batch} on {device_name(torch.device('cpu'))} "
          f"(1 thread, torch {torch.__version__}), gamma={args.gamma}, seed={args.seed}; per batch, medians of "
          f"{args.reps} replays, each call made again {args.again} times")
    counted = {}
    for name in chosen:
        method, params, draft = arms[name]
        params = {**params, **({} if method == "target_only" or "tree" in params else {"gamma": args.gamma})}
        discrete.run_arm(discrete.run_batch, method, params, pairs[draft], work, args.seed)  # warm-up
        counted[name] = discrete.count_calls(method, params, pairs[draft], work, args.seed)
    shapes = discrete.shapes_to_time([counts for counts, _, _ in counted.values()], args.batch)
    timer = discrete.cost_timer(pairs, args.batch, args.gamma, shapes)
    runs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {name: [] for name in chosen}
    for _ in range(args.reps):  # prices and replays in turns: both see the same load
        for name in chosen:
            runs[name].append(time_in_place(counted[name][2][0], pairs[arms[name][2]], args.again))
        timer.step(len(shapes))
    costs = timer.costs()["cpu"]
    header = f"{'arm':<17} {'model':<9} {'calls':>6} {'in order':>10} {'again':>10} {'priced':>10} {'order/again':>12} " \
             f"{'again/priced':>13}"
    print(header)
    print("-" * len(header))
    for name in chosen:
        counts = counted[name][0]
        priced: dict[str, float] = {}
        calls: dict[str, int] = {}
        for key, n in counts.shapes.items():
            role = parse_shape(key)[0]
            priced[role] = priced.get(role, 0.0) + n * shape_cost(key, costs, args.batch)
            calls[role] = calls.get(role, 0) + n
        rows = {role: (statistics.median(o[role] for o, _ in runs[name]),
                       statistics.median(w[role] for _, w in runs[name]), priced[role]) for role in priced}
        if len(rows) > 1:
            rows["all"] = tuple(sum(r[i] for r in rows.values()) for i in range(3))
            calls["all"] = sum(calls.values())
        for role, (order, warm, price) in rows.items():
            print(f"{name:<17} {role:<9} {calls[role]:>6} {order * 1e3:>7.2f} ms {warm * 1e3:>7.2f} ms "
                  f"{price * 1e3:>7.2f} ms {order / warm:>12.3f} {warm / price:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
