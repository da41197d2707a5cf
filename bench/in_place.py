"""Where a speculative arm's model calls cost more than their shape prices, model by model.

A family bench's ``ovh`` (an arm's time over the sum of its calls' shape prices) mixes three things: the
loop's own work, what a call costs more in the loop's order than back to back with itself (right after the
other model's calls or a call of another shape, or the call that grows its cache), and whatever the shape
prices miss of the calls themselves. This script takes the last two apart, for the discrete family
(``bench/discrete.py``) or diffusion (``bench/diffusion.py``). Each batch's calls, recorded in that bench's
untimed counting pass, are made again in their order as its replays make them
(:class:`~bench.pricing.CallRecording`), each one timed; right after it the same call is made ``--again``
more times on the same state (a discrete call's cache lengths set back first; a denoiser keeps none) and the
median of those taken. Per arm and model (``target``, ``draft``; the discrete head arms' ``target_f`` and
``head``), the calls' total per batch:

- ``in order``: each call where the loop's order puts it;
- ``again``: each call made right after itself: its cost warm, in place, at its own shape;
- ``priced``: the family bench's shape prices of the same calls, timed in this run the way it times them;

and ``in order / again`` (what the order costs: no price of a shape alone can see it) and ``again / priced``
(what the shape prices miss of the calls; 1.00: nothing). Process CPU time, one torch thread.

    python bench/in_place.py [--family discrete|diffusion] [--batch 32] [--arms "target_only,sd,eagle sd"]
                             [--reps 3] [--again 4] [--gamma 4 (diffusion: 7)] [--steps 100 (diffusion's K)]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import diffusion, discrete  # noqa: E402
from bench.pricing import batches_of, parse_shape, run_arm, shape_cost  # noqa: E402
from specray.methods.discrete.loop import generation_context  # noqa: E402
from specray.runtime.hardware import device_name  # noqa: E402
from specray.runtime.heap import keep_freed_memory  # noqa: E402


@dataclass
class Family:
    """What this script needs of a family bench."""

    arms: dict[str, tuple[str, dict[str, Any], Any]]  # row name -> (method, params, pair)
    run_batch: Callable[..., Any]
    count_calls: Callable[..., tuple]  # the bench's counting pass: (counts, stats, recordings)
    # the arms' counts -> (time the next round of shape prices, then {shape key: price} from the rounds timed)
    prices: Callable[[list[Any]], tuple[Callable[[], None], Callable[[], Callable[[str], float]]]]
    role_of: Callable[[Any, Any], str]  # (a called object, its arm's pair) -> the bench's name of its model
    context: Callable[[], contextlib.AbstractContextManager]  # what the loops make their calls in


def discrete_family(gamma: int, batch: int) -> Family:
    pairs = {draft: discrete.load_pair(discrete.TARGET, draft, "cpu") for draft in (discrete.DRAFT, discrete.HEAD)}
    arms = {name: (method, discrete.arm_params(method, params, gamma), pairs[draft])
            for name, method, params, draft in discrete.ARMS}

    def prices(counts: list[Any]) -> tuple[Callable[[], None], Callable[[], Callable[[str], float]]]:
        shapes = discrete.shapes_to_time(counts, batch)
        timer = discrete.cost_timer(pairs, batch, gamma, shapes)
        return (lambda: timer.step(len(shapes)),
                lambda: functools.partial(shape_cost, costs=timer.costs()["cpu"], batch=batch))

    return Family(arms, discrete.run_batch, discrete.count_calls, prices, discrete.model_role, generation_context)


def diffusion_family(gamma: int, num_steps: int) -> Family:
    pair = diffusion.load_pair(diffusion.TARGET, diffusion.DRAFT, "cpu")
    arms = {name: (method, diffusion.arm_params(method, drafter, num_steps, gamma), pair)
            for name, method, drafter in diffusion.ARMS}

    def prices(counts: list[Any]) -> tuple[Callable[[], None], Callable[[], Callable[[str], float]]]:
        guidance = arms["target_only"][1].get("guidance_scale", 1.0)  # as the diffusion bench prices them
        timer = diffusion.cost_timer(pair, diffusion.rows_to_time(counts), guidance)
        return (lambda: timer.step(len(timer.calls)),
                lambda: functools.partial(diffusion.shape_cost, costs=timer.costs()["cpu"]))

    return Family(arms, diffusion.run_batch, diffusion.count_calls, prices, diffusion.model_role,
                  contextlib.nullcontext)


def time_in_place(recording: Any, role_of: Callable[[Any], str], again: int,
                  context: Callable[[], contextlib.AbstractContextManager] = generation_context,
                  ) -> tuple[dict[str, float], dict[str, float]]:
    """One replay of ``recording`` in ``context()``: per model, the seconds its calls took in order, and made
    again right after themselves (the median of ``again``)."""
    in_order: dict[str, float] = {}
    warm: dict[str, float] = {}

    def make(obj: Any, call: Callable[[], Any]) -> Any:
        state = recording.state(obj)  # None: the model keeps no state between calls
        before = None if state is None else state.clone()
        start = time.process_time()
        out = call()
        took = time.process_time() - start
        after = None if state is None else state.clone()
        repeats = []
        for _ in range(again):
            if state is not None:
                state.copy_(before)  # the same call on the same state: the K/V it writes are the same
            start = time.process_time()
            call()
            repeats.append(time.process_time() - start)
        if state is not None:
            state.copy_(after)
        role = role_of(obj)
        in_order[role] = in_order.get(role, 0.0) + took
        warm[role] = warm.get(role, 0.0) + statistics.median(repeats)
        return out

    with context():
        recording.replay(make)
    return in_order, warm


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("discrete", "diffusion"), default="discrete")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--arms", default=None, help="comma-separated rows of the family bench (default: discrete "
                    "'target_only,sd,eagle sd', diffusion 'target_only,token frozen,block model')")
    ap.add_argument("--reps", type=int, default=3, help="replays of each arm's batch (the median is taken)")
    ap.add_argument("--again", type=int, default=4, help="times each call is made again right after itself")
    ap.add_argument("--gamma", type=int, default=None, help="draft length (default: discrete 4, diffusion 7)")
    ap.add_argument("--steps", type=int, default=100, help="diffusion: denoising steps K")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("batch", "reps", "again", "steps", "gamma"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    torch.set_num_threads(1)
    keep_freed_memory()
    discrete_run = args.family == "discrete"
    gamma = args.gamma or (4 if discrete_run else 7)
    family = discrete_family(gamma, args.batch) if discrete_run else diffusion_family(gamma, args.steps)
    chosen = [name.strip() for name in (args.arms or ("target_only,sd,eagle sd" if discrete_run else
                                                      "target_only,token frozen,block model")).split(",")]
    unknown = [name for name in chosen if name not in family.arms]
    if unknown:
        ap.error(f"--arms: unknown {unknown}; the {args.family} bench's rows are {list(family.arms)}")
    work = batches_of(args.batch, args.batch)[:1]  # one batch (at batch 1, one sample)
    print(f"# specray in-place bench: the {args.family} family at batch {args.batch} on "
          f"{device_name(torch.device('cpu'))} (1 thread, torch {torch.__version__}), gamma={gamma}"
          f"{'' if discrete_run else f', K={args.steps}'}, seed={args.seed}; per batch, medians of {args.reps} "
          f"replays, each call made again {args.again} times")
    counted = {}
    for name in chosen:
        method, params, pair = family.arms[name]
        run_arm(family.run_batch, method, params, pair, work, args.seed)  # warm-up
        counted[name] = family.count_calls(method, params, pair, work, args.seed)
    step, prices = family.prices([counts for counts, _, _ in counted.values()])
    runs: dict[str, list[tuple[dict[str, float], dict[str, float]]]] = {name: [] for name in chosen}
    for _ in range(args.reps):  # prices and replays in turns: both see the same load
        for name in chosen:
            role_of = functools.partial(family.role_of, pair=family.arms[name][2])
            runs[name].append(time_in_place(counted[name][2][0], role_of, args.again, family.context))
        step()
    price = prices()
    header = (f"{'arm':<17} {'model':<9} {'calls':>6} {'in order':>10} {'again':>10} {'priced':>10} "
              f"{'order/again':>12} {'again/priced':>13}")
    print(header)
    print("-" * len(header))
    for name in chosen:
        priced: dict[str, float] = {}
        calls: dict[str, int] = {}
        for key, n in counted[name][0].shapes.items():
            role = parse_shape(key)[0]
            priced[role] = priced.get(role, 0.0) + n * price(key)
            calls[role] = calls.get(role, 0) + n
        rows = {role: (statistics.median(o[role] for o, _ in runs[name]),
                       statistics.median(w[role] for _, w in runs[name]), priced[role]) for role in priced}
        if len(rows) > 1:
            rows["all"] = tuple(sum(r[i] for r in rows.values()) for i in range(3))
            calls["all"] = sum(calls.values())
        for role, (order, warm, cost) in rows.items():
            print(f"{name:<17} {role:<9} {calls[role]:>6} {order * 1e3:>7.2f} ms {warm * 1e3:>7.2f} ms "
                  f"{cost * 1e3:>7.2f} ms {order / warm:>12.3f} {warm / cost:>13.3f}", flush=True)


if __name__ == "__main__":
    main()
