"""Benchmark of the diffusion family on the built-in presets: the target DDPM digits-ddpm, and the
separately trained smaller UNet digits-ddpm-draft for the ``model`` drafter.

For each number of steps K (``--steps``, default 100; 1000 optional, ten times longer) and batch size
(``--batches``, default 1 and 32) it runs target_only (ancestral sampling) and spec_token (reflection) /
spec_block (residual sampler) with the frozen, free and model drafters at gamma 7, and reports:

- ``BE``: block efficiency, denoising steps advanced per round; ``tgt``, ``draft``: sequential target and
  draft calls per sample; ``states``: target states evaluated per sample (CFG not doubled);
- ``speedup``: measured speedup over ``target_only``. All arms run on the same samples and seeds,
  interleaved batch by batch (every arm runs a batch before any runs the next; the order rotates every
  batch and repetition); the median over repetitions of the paired ratio target_only time / arm time;
- ``pred``: the speedup predicted from the calls the loop really made, each priced at its own shape.
  The calls (a :class:`Denoiser` forward: the UNet on every row fed, CFG included) are counted by
  wrapping that method in an untimed pass (which also warms every arm up), by shape: model (target or
  draft) and rows fed. The rows are the batch for target_only and the final step, the round's rows
  for a Frozen round's first call and the model drafter's calls, and the states to verify (up to
  gamma per row) for a verify call, fewer in the tail rounds as rows finish. Every shape used is timed
  in the same run, in rounds spread over it (one before every arm's batch, each shape in turn; the
  median over rounds): a grid of row counts (powers of two, the largest count used, and every count
  that makes >= 10 % of some arm's calls of that model), linear in between. Predicted time = sum over
  calls of the cost of the call's shape;
- ``eff`` = speedup / pred (1.0: no more loop overhead than target_only's own loop);
- ``eff 90%``: a 90 % confidence interval for ``eff``: the order statistics of the paired speedups that bound
  their median at 90 % or more (:func:`~bench.pricing.median_interval`; of 5 to 7 pairs, the lowest and the
  highest; of fewer, the same, short of 90 %), over ``pred``. The repetitions' noise, which the median hides: an
  interval under 0.95 puts the efficiency under 0.95 at that confidence, whichever way one rerun's median falls;
- ``ovh`` = time / predicted time of the arm's own calls (its loop overhead factor);
- ``run-eff``: the efficiency again, with every timed run split into the time inside its own denoiser
  calls and the rest (its loop): (share of the arm's time in calls) / (share of target_only's), medians
  over repetitions. Both shares come from the same runs, so this is robust to a machine whose load
  changes between the cost timings and the runs (CPU devices only: on a GPU a call returns before its
  work is done). ``eff`` and ``run-eff`` agree when the calls cost in the loop what they cost alone;
- ``loop/rnd``: the time outside the calls per loop iteration in ms (a round; target_only: a step),
  from the same split (on a GPU: time - predicted time), over the iterations, where a batch's
  iterations are its slowest row's rounds;
- ``pred-seq``: the speedup predicted by each batch's calls, recorded with their inputs in the
  untimed pass, made again in the same order with nothing between them and timed in turns with the
  runs (:class:`~bench.pricing.CallRecording`); ``eff-seq``: the median share of an arm's time its
  replay takes (replay time / run time per repetition, the two run next to each other) over
  target_only's, the cost of the loop's own work alone (``--no-replay`` skips the replays).

Both clocks are measured: wall time, and process CPU time, which leaves out the time the process
waits for a core on a shared machine (valid for single-threaded CPU runs only). The main columns use
``--clock`` (auto: cpu on a CPU device, wall on CUDA); the last two columns give the other clock.

    python bench/diffusion.py [--quick] [--no-replay] [--steps 100,1000] [--json out.json] [--device cpu] [--clock auto|wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pricing import (  # noqa: E402
    CLOCK_NAMES,
    CallRecording,
    InterleavedTimer,
    add_common_args,
    batches_of,
    efficiency_interval,
    finish_report,
    interval_text,
    paired_speedup,
    parse_shape,
    per_repetition,
    replay_name,
    replay_time,
    run_arm,
    run_in_turns,
    sequence_efficiency,
    sequence_speedup,
    shape_key,
    split_efficiency,
    start_report,
    with_replays,
)
from specray.methods.diffusion.loop import run_batch  # noqa: E402
from specray.models.diffusion import Denoiser, load_pair  # noqa: E402
from specray.models.pair import ModelPair  # noqa: E402

TARGET, DRAFT = "digits-ddpm", "digits-ddpm-draft"
ROLES = ("target", "draft")

# (row name, method, drafter); gamma and K come from the command line.
ARMS: list[tuple[str, str, str | None]] = [("target_only", "target_only", None)] + [
    (f"{method.removeprefix('spec_')} {drafter}", method, drafter)
    for method in ("spec_token", "spec_block") for drafter in ("frozen", "free", "model")
]


def linear_between(grid: dict[int, float], x: int) -> float:
    """``grid[x]`` if measured, else linear between the nearest measured points on either side."""
    if x in grid:
        return grid[x]
    lo = max(g for g in grid if g < x)
    hi = min(g for g in grid if g > x)
    return grid[lo] + (grid[hi] - grid[lo]) * (x - lo) / (hi - lo)


# ---- counting the calls -------------------------------------------------------------------------


@dataclass
class CallCounts:
    """Denoiser calls of one arm over the bench's samples, by shape, and the loop's iterations."""

    shapes: dict[str, int]  # shape_key(role, rows) -> calls
    iterations: int  # rounds (target_only: steps) summed over batches; a batch runs until its slowest row

    def total(self, role: str) -> int:
        return sum(n for key, n in self.shapes.items() if parse_shape(key)[0] == role)




def model_role(model: Denoiser, pair: ModelPair) -> str:
    """The bench's name of a denoiser of ``pair``: ``target`` or ``draft``."""
    return "target" if model is pair.target else "draft"


def count_calls(method: str, params: dict[str, Any], pair: ModelPair, work: list, seed: int,
                ) -> tuple[CallCounts, list, list[CallRecording]]:
    """Untimed pass with :meth:`Denoiser.forward` wrapped: every call counted by model and rows fed, and each
    batch's calls recorded in order (:class:`~bench.pricing.CallRecording`; the UNet keeps no state)."""
    counts: Counter[str] = Counter()
    original = Denoiser.forward

    def counted(self: Denoiser, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        counts[shape_key(model_role(self, pair), x.shape[0])] += 1
        return original(self, x, *args, **kwargs)

    Denoiser.forward = counted  # type: ignore[method-assign]
    stats, recordings = [], []
    try:
        for unit in work:
            with CallRecording({Denoiser: "forward"}) as recording:
                stats.append(run_arm(run_batch, method, params, pair, [unit], seed)[1])  # per batch
            recordings.append(recording)
    finally:
        Denoiser.forward = original  # type: ignore[method-assign]
    if method == "target_only":
        iterations = params["num_steps"] * len(work)
    else:
        iterations = sum(max(s.num_spec_steps for s in batch_stats) for batch_stats in stats)
    return (CallCounts(dict(sorted(counts.items())), iterations), [s for batch_stats in stats for s in batch_stats],
            recordings)


# ---- pricing the calls --------------------------------------------------------------------------


def rows_to_time(counts: list[CallCounts]) -> dict[str, list[int]]:
    """Per model, the row counts whose cost is measured: powers of two below the largest count used,
    the largest, and every count that makes at least 10 % of some arm's calls of that model."""
    out = {}
    for role in ROLES:
        used = [(parse_shape(key)[1], n, c.total(role)) for c in counts for key, n in c.shapes.items()
                if parse_shape(key)[0] == role]
        if not used:
            continue
        top = max(rows for rows, _, _ in used)
        common = {rows for rows, n, total in used if n >= 0.1 * total}
        out[role] = sorted({1 << k for k in range(top.bit_length()) if 1 << k < top} | common | {top})
    return out


def denoiser_call(model: Denoiser, rows: int, num_train_timesteps: int, image_shape: tuple[int, ...],
                  guidance_scale: float, gen: torch.Generator, device: torch.device) -> Any:
    """A zero-argument function making one denoiser call on ``rows`` rows, as the loops make it (under
    the denoiser's own ``no_grad``, not ``inference_mode``)."""
    x = torch.randn(rows, *image_shape, generator=gen).to(device)
    t = torch.randint(0, num_train_timesteps, (rows,), generator=gen).to(device)
    labels = (torch.arange(rows) % 10).to(device)
    return lambda: model(x, t, labels, guidance_scale)


def cost_timer(pair: ModelPair, rows: dict[str, list[int]], guidance_scale: float) -> InterleavedTimer:
    """Times every shape to price, a round (each shape once) before every arm's batch, so that the
    costs see the machine's load as the arms do; a shape's cost is the median over rounds."""
    gen = torch.Generator().manual_seed(0)
    steps = pair.info["scheduler"].config.num_train_timesteps
    calls = {shape_key(role, n): denoiser_call(pair.target if role == "target" else pair.draft, n, steps,
                                               pair.info["image_shape"], guidance_scale, gen, pair.device)
             for role, counts in rows.items() for n in counts}
    return InterleavedTimer(calls, pair.device, seconds=0.025, grad_mode=torch.no_grad)


def shape_cost(key: str, costs: dict[str, float]) -> float:
    """Cost of one call of shape ``key``: measured, or linear in rows between the nearest timed counts."""
    role, rows = parse_shape(key)
    grid = {parse_shape(k)[1]: c for k, c in costs.items() if parse_shape(k)[0] == role}
    return linear_between(grid, rows)


def predicted_time(counts: CallCounts, costs: dict[str, float]) -> float:
    """Sum over the arm's calls of each call's cost at its own shape."""
    return sum(n * shape_cost(key, costs) for key, n in counts.shapes.items())


# ---- the bench ----------------------------------------------------------------------------------


@dataclass
class ClockResult:
    """Timing of one arm under one clock."""

    s_per_sample: float  # median over repetitions
    speedup: float  # median over repetitions of (target_only time / this arm's time), same repetition
    predicted_speedup: float  # from the call counts and this clock's per-call costs
    efficiency: float  # speedup / predicted_speedup
    efficiency_interval: tuple[float, float]  # eff 90%: efficiency_interval of the paired speedups
    overhead: float  # median time / predicted time of the arm's own calls
    loop_s_per_iteration: float  # median time outside the calls (in-run split; else time - predicted time) / iterations
    run_efficiency: float | None  # efficiency with each run's own time in calls for the predicted (CPU only)
    sequence_predicted: float | None  # predicted speedup from the replays of the calls in sequence (None: --no-replay)
    sequence_efficiency: float | None  # the replays' share of the runs' time over target_only's
    reps_s: list[float] = field(default_factory=list)
    reps_loop_s: list[float] = field(default_factory=list)  # time outside the calls, per repetition (CPU only)


@dataclass
class ArmResult:
    name: str
    method: str
    params: dict[str, Any]
    num_steps: int
    batch: int
    samples: int
    block_efficiency: float
    target_calls: float  # per sample
    draft_calls: float  # per sample
    states_evaluated: float  # per sample
    calls: CallCounts
    clocks: dict[str, ClockResult]


def arm_params(method: str, drafter: str | None, num_steps: int, gamma: int) -> dict[str, Any]:
    return {"num_steps": num_steps} | ({} if drafter is None else {"drafter": drafter, "gamma": gamma})


def bench_config(pair: ModelPair, num_steps: int, batch: int, samples: int, reps: int, gamma: int,
                 seed: int, replay: bool = True) -> tuple[list[ArmResult], dict[str, dict[str, float]]]:
    work = batches_of(samples, batch)
    arms = [(name, method, arm_params(method, drafter, num_steps, gamma)) for name, method, drafter in ARMS]
    # The untimed counting pass doubles as the warm-up (allocator, kernels) of every arm.
    counted = {name: count_calls(method, params, pair, work, seed) for name, method, params in arms}
    rows = rows_to_time([c for c, _, _ in counted.values()])
    guidance = arms[0][2].get("guidance_scale", 1.0)

    split = pair.device.type == "cpu"
    call_costs = cost_timer(pair, rows, guidance)
    by_name = {name: (method, params) for name, method, params in arms}
    # Each arm's calls replayed in sequence take turns with the runs, as one more "arm" each.
    replays = {replay_name(name): name for name in by_name} if replay else {}
    unit_index = {id(unit): i for i, unit in enumerate(work)}

    def run(name: str, unit: Any) -> dict[str, float]:
        if name in replays:
            return replay_time(counted[replays[name]][2][unit_index[id(unit)]], pair.device)
        return run_arm(run_batch, *by_name[name], pair, [unit], seed)[0]

    names = with_replays(list(by_name)) if replay else list(by_name)
    runs, outside = run_in_turns(names, work, reps, run, lambda: call_costs.step(len(call_costs.calls)),
                                 {Denoiser: "forward"} if split else None)
    times = {name: per_repetition(r, len(work)) for name, r in runs.items()}
    loop_times = {name: per_repetition(r, len(work)) for name, r in outside.items()}
    costs = call_costs.costs()

    base_name = arms[0][0]
    results = []
    for name, method, params in arms:
        counts, stats, _ = counted[name]
        clocks = {}
        for clock in CLOCK_NAMES:
            mine = [t[clock] for t in times[name]]
            base = [t[clock] for t in times[base_name]]
            pred_time = predicted_time(counts, costs[clock])
            predicted = predicted_time(counted[base_name][0], costs[clock]) / pred_time
            speedup = paired_speedup(base, mine)
            loop = [t[clock] for t in loop_times[name]] if split else []
            sequence = sequence_speedup(times, base_name, name, clock) if replays else None
            clocks[clock] = ClockResult(
                s_per_sample=statistics.median(mine) / samples, speedup=speedup, predicted_speedup=predicted,
                efficiency=speedup / predicted,
                efficiency_interval=efficiency_interval(base, mine, predicted),
                overhead=statistics.median(mine) / pred_time,
                loop_s_per_iteration=(statistics.median(loop) if split else statistics.median(mine) - pred_time)
                / counts.iterations,
                run_efficiency=split_efficiency(loop, mine, [t[clock] for t in loop_times[base_name]], base)
                if split else None,
                sequence_predicted=sequence,
                sequence_efficiency=sequence_efficiency(times, base_name, name, clock) if replays else None,
                reps_s=mine, reps_loop_s=loop,
            )
        mean = lambda f: sum(f(s) for s in stats) / len(stats)  # noqa: E731
        results.append(ArmResult(
            name=name, method=method, params=params, num_steps=num_steps, batch=batch, samples=samples,
            block_efficiency=mean(lambda s: s.extra["block_efficiency"]), target_calls=mean(lambda s: s.target_calls),
            draft_calls=mean(lambda s: s.draft_calls), states_evaluated=mean(lambda s: s.extra["states_evaluated"]),
            calls=counts, clocks=clocks,
        ))
    return results, costs


def print_table(num_steps: int, batch: int, samples: int, reps: int, costs: dict[str, dict[str, float]],
                results: list[ArmResult], clock: str, gamma: int) -> None:
    other = next(c for c in CLOCK_NAMES if c != clock)
    c = costs[clock]
    timed = {role: sorted(parse_shape(k)[1] for k in c if parse_shape(k)[0] == role) for role in ROLES}

    def ms(role: str, rows: int) -> str:
        inside = timed[role] and timed[role][0] <= rows <= timed[role][-1]
        return f"{shape_cost(shape_key(role, rows), c) * 1e3:.2f} ms" if inside else "-"

    print(f"\n## K={num_steps}, batch {batch}: {samples} samples, {reps} reps, {clock} clock; per call: "
          f"target on {batch} rows {ms('target', batch)}, on {gamma * batch} rows {ms('target', gamma * batch)}, "
          f"draft on {batch} rows {ms('draft', batch)}")
    print(f"   rows timed: target {timed['target']}, draft {timed['draft']}; linear in between")
    header = (f"{'method':<13} {'BE':>5} {'tgt':>6} {'draft':>6} {'states':>7} {'ms/sample':>10} {'speedup':>8} "
              f"{'pred':>6} {'eff':>5} {'eff 90%':>9} {'ovh':>5} {'run-eff':>7} {'loop/rnd':>8} {'pred-seq':>8} "
              f"{'eff-seq':>7} | {'speedup':>8} {'eff':>5} ({other})")
    print(header)
    print("-" * len(header))
    for r in results:
        m, o = r.clocks[clock], r.clocks[other]
        run_eff = "-" if m.run_efficiency is None else f"{m.run_efficiency:.2f}"
        seq = ("-", "-") if m.sequence_predicted is None else (f"{m.sequence_predicted:.2f}", f"{m.sequence_efficiency:.2f}")
        print(f"{r.name:<13} {r.block_efficiency:>5.2f} {r.target_calls:>6.1f} {r.draft_calls:>6.1f} "
              f"{r.states_evaluated:>7.1f} {m.s_per_sample * 1e3:>10.1f} {m.speedup:>8.2f} {m.predicted_speedup:>6.2f} "
              f"{m.efficiency:>5.2f} {interval_text(m.efficiency_interval):>9} {m.overhead:>5.2f} {run_eff:>7} "
              f"{m.loop_s_per_iteration * 1e3:>8.2f} "
              f"{seq[0]:>8} {seq[1]:>7} | "
              f"{o.speedup:>8.2f} {o.efficiency:>5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, gamma=7)
    ap.add_argument("--steps", default=None, help="comma-separated numbers of steps K (default 100, quick 50)")
    ap.add_argument("--samples-b1", type=int, default=None, help="samples at batch 1 (default 3, quick 2)")
    ap.add_argument("--batches-large", type=int, default=1, help="number of batches at batch sizes > 1")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 6, quick 2)")
    ap.add_argument("--quick", action="store_true", help="K=50, fewer samples and repetitions")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip the replays of each arm's calls in sequence (pred-seq, eff-seq; about half the time)")
    args = ap.parse_args(argv)

    steps = [int(k) for k in (args.steps or ("50" if args.quick else "100")).split(",")]
    samples_b1 = args.samples_b1 or (2 if args.quick else 3)
    reps = args.reps or (2 if args.quick else 6)
    device, clock, report = start_report(args, target=TARGET, draft=DRAFT, configs=[])
    pair = load_pair(TARGET, DRAFT, device)
    print(f"# specray diffusion bench: {TARGET} vs {DRAFT} on {device}, {report['machine']} "
          f"({torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}), gamma={args.gamma}, seed={args.seed}, heap {report['heap']}")
    for num_steps in steps:
        for batch in [int(b) for b in args.batches.split(",")]:
            samples = samples_b1 if batch == 1 else batch * args.batches_large
            results, costs = bench_config(pair, num_steps, batch, samples, reps, args.gamma, args.seed, args.replay)
            print_table(num_steps, batch, samples, reps, costs, results, clock, args.gamma)
            report["configs"].append({"num_steps": num_steps, "batch": batch, "samples": samples, "reps": reps,
                                      "call_costs_s": costs, "arms": [asdict(r) for r in results]})
    took = finish_report(report, args.json)
    print(f"\n# BE: steps per round; tgt, draft: sequential calls per sample; states: target states per sample; "
          f"speedup: vs target_only, median of paired reps; pred: predicted from the calls, each priced at its "
          f"own shape; eff = speedup / pred; "
          f"eff 90%: a 90 % confidence interval for eff (the median paired speedup's, over pred); "
          f"ovh = time / predicted time; run-eff: eff from each run's own split "
          f"into calls and loop; loop/rnd: ms outside the calls per round (target_only: per step); pred-seq: "
          f"predicted from each arm's calls replayed in sequence with nothing between them; eff-seq: the replays' "
          f"share of the runs' time over target_only's. "
          f"Bench took {took:.0f} s." + (f"\n# wrote {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
