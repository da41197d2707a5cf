"""Benchmark of CSpD on the built-in continuous presets (digits-mar-target with the draft digits-mar-draft).

For batch 1 and batch 32 and each arm (target_only; CSpD at gamma 4 in modes paper, exact and code,
with and without trajectory alignment, paper and exact also without pre-fill, all with MAR windows;
exact with sequential windows; default sampling) it reports:

- ``alpha``: draft acceptance rate; ``len``: mean acceptance length (tokens per target call, pre-fill
  included); ``tries``/``caps``: mean residual proposals per resampled token and cap hits;
- ``speedup``: measured speedup over ``target_only``. All arms run on the same samples and seeds,
  interleaved batch by batch (each batch runs under every arm in turn, the order rotating), after a
  warm-up; the median over repetitions and batches of the paired ratio target_only time / arm time
  on the same batch in the same repetition (pairs close in time: on a shared machine whose load comes
  and goes, most pairs see the same load);
- ``pred``: the speedup predicted from the arm's model calls, counted by shape in an untimed pass,
  and per-call costs measured in the same run at the same batch size. A call is what a model
  computes, each kind priced by its own shape (key ``model.kind:sizes:rows``):

  * ``cache``: a new content cache (the class entry), by cache slots and rows;
  * ``append``: tokens appended to the content stream, by tokens per row, cache slots and rows fed;
  * ``query``: the query stream's ``z`` for the slots asked, by slots per row, cache slots and rows;
  * ``head``: one token's diffusion-head chain per slot, by diffusion steps and slots sampled (the
    batch times the slots of a verify window; CFG doubles the head's rows inside the call).

  Every shape used is timed in the same run (the continuous loops always feed every row of the
  batch, so no shape needs interpolating), a few shapes before each arm's run so that the timings
  and the runs see the same stretches of a shared machine's load (at least 24 timings per shape,
  8 with ``--quick``, each of calls filling about 20 ms; the median). Predicted time = sum over calls of the cost of
  the call's shape; pred = predicted target_only time / predicted arm time;
- ``eff`` = speedup / pred (1.0: no more loop overhead than target_only's own loop);
- ``eff 90%``: a 90 % confidence interval for ``eff``: the order statistics of the paired speedups that bound
  their median at 90 % or more (:func:`~bench.pricing.median_interval`; of 5 to 7 pairs, the lowest and the
  highest; of fewer, the same, short of 90 %), over ``pred``. The repetitions' noise, which the median hides: an
  interval under 0.95 puts the efficiency under 0.95 at that confidence, whichever way one rerun's median falls;
- ``ovh`` = time / predicted time of the arm's own calls (its loop overhead factor);
- ``loop``: the loop's own time (outside the model calls, measured in the counting pass) per
  batch-level target call, in ms (a round: a target step or a window's verification), and
  ``loop%``: its share of the arm's time;
- ``pred-seq``: the speedup predicted by the calls as the arm makes them: each batch's calls, recorded
  in a second untimed pass (:class:`~bench.pricing.CallRecording`: the caches made anew by the
  replay's own ``new_cache`` calls, their lengths set back where the loop's truncation changed them),
  made again in order with nothing between them, taking turns with the runs; target_only's replay
  time over the arm's. A call there costs what it costs after the calls before it, as in the run;
- ``eff-seq``: the efficiency by the replays, what the loop's own work costs and nothing else: the
  median share of an arm's time its replay takes (replay time / run time, batch by batch; the two run
  next to each other) over target_only's (``--no-replay`` skips the replays, about half the time).

Both clocks are measured: wall time, and process CPU time, which leaves out the time the process
waits for a core on a shared machine (valid for single-threaded CPU runs only). The main columns use
``--clock`` (auto: cpu on a CPU device, wall on CUDA); the last two columns give the other clock.

    python bench/continuous.py [--quick] [--no-replay] [--json out.json] [--device cpu] [--gamma 4] [--samples 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
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
    optional,
    paired_speedup,
    parse_shape,
    per_repetition,
    predicted_time,
    replay_name,
    replay_time,
    run_arm,
    run_in_turns,
    sequence_efficiency,
    sequence_speedup,
    shape_key,
    since,
    stamp,
    start_report,
    sync,
    with_replays,
)
from specray.methods.continuous import loop  # noqa: E402
from specray.methods.continuous.params import TargetOnly  # noqa: E402
from specray.models.continuous_ar import ContentCache, ContinuousAR, load_pair  # noqa: E402
from specray.models.continuous_schedule import DiffusionSchedule  # noqa: E402
from specray.models.pair import ModelPair  # noqa: E402

TARGET, DRAFT = "digits-mar-target", "digits-mar-draft"

# (row name, method, params); CSpD arms get gamma from --gamma. Defaults: pre-fill 0.05, MAR windows.
ARMS: list[tuple[str, str, dict[str, Any]]] = [
    ("target_only", "target_only", {}),
    ("paper", "cspd", {"mode": "paper"}),
    ("paper no-align", "cspd", {"mode": "paper", "no_align": True}),
    ("paper prefill 0", "cspd", {"mode": "paper", "prefill_ratio": 0.0}),
    ("exact", "cspd", {"mode": "exact"}),
    ("exact no-align", "cspd", {"mode": "exact", "no_align": True}),
    ("exact prefill 0", "cspd", {"mode": "exact", "prefill_ratio": 0.0}),
    ("code", "cspd", {"mode": "code"}),
    ("code no-align", "cspd", {"mode": "code", "no_align": True}),
    ("exact sequential", "cspd", {"mode": "exact", "window": "sequential"}),
]



@dataclass
class CallCounts:
    """Batch-level model calls of one arm over the bench's samples, by shape."""

    shapes: dict[str, int]  # shape_key("model.kind", sizes..., rows) -> calls
    batch: int

    def total(self, role: str) -> int:
        """Calls of ``role`` ("target.head", ...)."""
        return sum(n for key, n in self.shapes.items() if parse_shape(key)[0] == role)


@dataclass
class ClockResult:
    """Timing of one arm under one clock."""

    s_per_sample: float  # median over repetitions
    speedup: float  # median over repetitions and batches of (target_only time / this arm's time), same batch
    predicted_speedup: float  # from the call counts and this clock's per-call costs
    efficiency: float  # speedup / predicted_speedup
    efficiency_interval: tuple[float, float]  # eff 90%: efficiency_interval of the paired speedups
    overhead: float  # median time / predicted time of the arm's own calls
    sequence_predicted: float | None  # predicted speedup from the replays of the calls in sequence (None: --no-replay)
    sequence_efficiency: float | None  # the replays' share of the runs' time over target_only's
    reps_s: list[float] = field(default_factory=list)  # per repetition (all batches)
    runs_s: list[float] = field(default_factory=list)  # per repetition and batch


@dataclass
class ArmResult:
    name: str
    method: str
    params: dict[str, Any]
    batch: int
    samples: int
    draft_acceptance_rate: float | None
    mean_acceptance_length: float
    mean_resample_tries: float
    resample_cap_hits: int
    calls: CallCounts
    loop_s: dict[str, float]  # time outside the model calls in the counting pass, per clock
    total_s: dict[str, float]  # the counting pass's time, per clock
    clocks: dict[str, ClockResult]




def count_calls(method: str, params: dict[str, Any], pair: ModelPair,
                work: list, seed: int) -> tuple[CallCounts, list, dict[str, float], dict[str, float]]:
    """Untimed pass with the model calls wrapped: every call counted by its real shape.

    The transformer's three entry points (:meth:`ContinuousAR.new_cache`, ``append_tokens``,
    ``query``) and the loop's per-slot head chain (``loop.head_chain``) are the calls; everything
    else the loop does is its overhead. Returns the counts, the stats, and per clock the time spent
    outside the calls and the whole pass's time.
    """
    counts: Counter[str] = Counter()
    in_calls = dict.fromkeys(CLOCK_NAMES, 0.0)
    new_cache, append_tokens, query, head_chain = (ContinuousAR.new_cache, ContinuousAR.append_tokens,
                                                   ContinuousAR.query, loop.head_chain)

    def role(model: Any, kind: str) -> str:
        return f"{'target' if model is pair.target else 'draft'}.{kind}"

    def slots(cache: Any) -> int:
        return cache.keys[0].shape[1]

    def call(key: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        counts[key] += 1
        sync(pair.device)
        start = stamp()
        out = fn(*args, **kwargs)
        sync(pair.device)
        for clock, t in since(start).items():
            in_calls[clock] += t
        return out

    def counted_new_cache(self: Any, labels: torch.Tensor, extra_slots: int = 0) -> Any:
        slots_needed = 1 + self.config.num_tokens + extra_slots
        return call(shape_key(role(self, "cache"), slots_needed, labels.shape[0]), new_cache, self, labels, extra_slots)

    def counted_append(self: Any, cache: Any, tokens: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        key = shape_key(role(self, "append"), tokens.shape[1], slots(cache), tokens.shape[0])
        return call(key, append_tokens, self, cache, tokens, *args, **kwargs)

    def counted_query(self: Any, cache: Any, positions: torch.Tensor, visible: torch.Tensor) -> Any:
        key = shape_key(role(self, "query"), positions.shape[1], slots(cache), positions.shape[0])
        return call(key, query, self, cache, positions, visible)

    def counted_head(side: Any, schedule: DiffusionSchedule, z: Any, w: Any, x_T: torch.Tensor, *args: Any) -> Any:
        key = shape_key(role(side.model, "head"), schedule.num_steps, x_T.shape[0])
        return call(key, head_chain, side, schedule, z, w, x_T, *args)

    ContinuousAR.new_cache, ContinuousAR.append_tokens = counted_new_cache, counted_append  # type: ignore[method-assign]
    ContinuousAR.query, loop.head_chain = counted_query, counted_head  # type: ignore[method-assign]
    try:
        total, stats = run_arm(loop.run_batch, method, params, pair, work, seed)
    finally:
        ContinuousAR.new_cache, ContinuousAR.append_tokens = new_cache, append_tokens  # type: ignore[method-assign]
        ContinuousAR.query, loop.head_chain = query, head_chain  # type: ignore[method-assign]
    loop_s = {clock: total[clock] - in_calls[clock] for clock in CLOCK_NAMES}
    return CallCounts(dict(sorted(counts.items())), batch=work[0][0].shape[0]), stats, loop_s, total


# The calls a replay makes again: the transformer's entry points and the loop's head chain (a module function).
MODEL_CALLS: dict[Any, tuple[str, ...]] = {ContinuousAR: ("new_cache", "append_tokens", "query"), loop: ("head_chain",)}


def cache_length(obj: Any) -> torch.Tensor | None:
    """What a call's cost depends on besides its arguments: a content cache's lengths (the loop truncates them)."""
    return obj.length if isinstance(obj, ContentCache) else None


def record_calls(method: str, params: dict[str, Any], pair: ModelPair, work: list, seed: int) -> list[CallRecording]:
    """An untimed pass recording each batch's calls in order (:class:`~bench.pricing.CallRecording`), apart from
    the counting pass so that the recording's own work (copying the calls' inputs) stays out of its loop times."""
    recordings = []
    for unit in work:
        with CallRecording(MODEL_CALLS, cache_length, results=(ContentCache,)) as recording:
            run_arm(loop.run_batch, method, params, pair, [unit], seed)
        recordings.append(recording)
    return recordings


def _call_of_shape(key: str, pair: ModelPair, use_cfg: bool, gen: torch.Generator) -> Any:
    """A zero-argument function making one call of shape ``key`` as the loops make it (random inputs of
    the call's shape: a call's cost does not depend on the values)."""
    role, *dims, rows = parse_shape(key)
    name, kind = role.split(".")
    model: ContinuousAR = pair.target if name == "target" else pair.draft
    c = model.config
    device = pair.device
    randn = lambda *shape: torch.randn(*shape, generator=gen).to(device)  # noqa: E731
    labels = torch.arange(rows, device=device) % c.num_classes
    if kind == "head":
        steps = dims[0]
        schedule = DiffusionSchedule.cosine(c.diffusion_train_steps, steps)
        z = (randn(rows, 1, c.dim), randn(rows, 1, c.dim) if use_cfg else None)
        w = torch.full((rows,), 1.5, device=device)
        x_T, eps = randn(rows, c.token_dim), randn(rows, steps, c.token_dim)
        side = SimpleNamespace(model=model)
        return lambda: loop.head_chain(side, schedule, z, w, x_T, eps, 1.0, False, 1.0)
    extra = dims[-1] - 1 - c.num_tokens  # cache slots past the class entry and the image's tokens
    if kind == "cache":
        return lambda: model.new_cache(labels, extra_slots=extra)
    tokens = dims[0]
    cache = model.new_cache(labels, extra_slots=extra)
    mid = c.num_tokens // 2  # a mid-image prefix (attention spans every slot, so its length costs nothing)
    model.append_tokens(cache, randn(rows, mid, c.token_dim), torch.arange(mid, device=device).expand(rows, mid))
    positions = ((mid + torch.arange(tokens, device=device)) % c.num_tokens).expand(rows, tokens).contiguous()
    if kind == "query":
        visible = torch.full((rows, tokens), mid + 1, device=device)
        return lambda: model.query(cache, positions, visible)
    new_tokens, n_valid = randn(rows, tokens, c.token_dim), torch.full((rows,), tokens, device=device)
    length = cache.length

    def append() -> None:
        cache.length = length  # each call appends at the same place
        model.append_tokens(cache, new_tokens, positions, n_valid)
    return append


def cost_timer(pair: ModelPair, shapes: list[str], use_cfg: bool) -> InterleavedTimer:
    """A timer of every call shape (random inputs of the shape), stepped between the arms' runs."""
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        calls = {key: _call_of_shape(key, pair, use_cfg, gen) for key in shapes}
    return InterleavedTimer(calls, pair.device)


def resample_numbers(stats: list) -> tuple[float, int]:
    """Mean residual proposals per resampled token, and cap hits (CSpD's extras; zero for target_only)."""
    resampled = sum(s.extra.get("resampled_tokens", 0) for s in stats)
    tries = sum(s.extra.get("mean_resample_tries", 0.0) * s.extra.get("resampled_tokens", 0) for s in stats)
    return (tries / resampled if resampled else 0.0), sum(s.extra.get("resample_cap_hits", 0) for s in stats)


def bench_batch(pair: ModelPair, batch: int, samples: int, reps: int, gamma: int, seed: int,
                cost_timings: int, replay: bool = True) -> tuple[list[ArmResult], dict[str, dict[str, float]]]:
    work = batches_of(samples, batch)
    arms = [(name, method, params if method == "target_only" else {**params, "gamma": gamma})
            for name, method, params in ARMS]
    # The untimed counting pass is also the warm-up (allocator, kernels).
    counted = {name: count_calls(method, params, pair, work, seed) for name, method, params in arms}
    shapes = sorted({key for counts, *_ in counted.values() for key in counts.shapes})
    use_cfg = TargetOnly().cfg != 1.0  # the arms sample with the defaults

    timer = cost_timer(pair, shapes, use_cfg)
    by_name = {name: (method, params) for name, method, params in arms}
    # Each arm's calls replayed in sequence take turns with the runs, as one more "arm" each.
    recorded = {name: record_calls(method, params, pair, work, seed) for name, method, params in arms} if replay else {}
    replays = {replay_name(name): name for name in recorded}
    unit_index = {id(unit): i for i, unit in enumerate(work)}
    names = with_replays(list(by_name)) if replay else list(by_name)

    def run(name: str, unit: Any) -> dict[str, float]:
        if name in replays:
            return replay_time(recorded[replays[name]][unit_index[id(unit)]], pair.device, torch.no_grad)
        return run_arm(loop.run_batch, *by_name[name], pair, [unit], seed)[0]

    # Every shape is timed cost_timings times or more, a few shapes before each run.
    per_run = -(-len(shapes) * cost_timings // (reps * len(work) * len(names)))
    runs, _ = run_in_turns(names, work, reps, run, lambda: timer.step(per_run))  # per repetition and batch
    costs = timer.costs()

    base_name = arms[0][0]
    results = []
    for name, method, params in arms:
        counts, stats, loop_s, total_s = counted[name]
        drafted = sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_draft_tokens for s in stats)
        clocks = {}
        for clock in CLOCK_NAMES:
            # paired batch by batch: a batch's runs under every arm are close in time
            mine = [t[clock] for t in runs[name]]
            base = [t[clock] for t in runs[base_name]]
            rep_totals = [t[clock] for t in per_repetition(runs[name], len(work))]
            pred_time = predicted_time(counts.shapes, costs[clock], batch)
            predicted = predicted_time(counted[base_name][0].shapes, costs[clock], batch) / pred_time
            speedup = paired_speedup(base, mine)
            clocks[clock] = ClockResult(
                s_per_sample=statistics.median(rep_totals) / samples, speedup=speedup, predicted_speedup=predicted,
                efficiency=speedup / predicted,
                efficiency_interval=efficiency_interval(base, mine, predicted),
                overhead=statistics.median(rep_totals) / pred_time,
                sequence_predicted=sequence_speedup(runs, base_name, name, clock) if replay else None,
                sequence_efficiency=sequence_efficiency(runs, base_name, name, clock) if replay else None,
                reps_s=rep_totals, runs_s=mine,
            )
        tries, caps = resample_numbers(stats)
        results.append(ArmResult(
            name=name, method=method, params=params, batch=batch, samples=samples,
            draft_acceptance_rate=accepted / drafted if drafted else None,
            mean_acceptance_length=sum(s.num_tokens for s in stats) / sum(s.target_calls for s in stats),
            mean_resample_tries=tries, resample_cap_hits=caps, calls=counts, loop_s=loop_s, total_s=total_s,
            clocks=clocks,
        ))
    return results, costs


def step_costs(costs: dict[str, float], batch: int, gamma: int, steps: int, slots: int) -> str:
    """One token's step of each model (append 1 + query 1 + head on the batch) and a full window's verify."""

    def ms(*keys: str) -> str:
        return f"{sum(costs[k] for k in keys) * 1e3:.2f} ms" if all(k in costs for k in keys) else "-"

    def step(model: str) -> str:
        return ms(shape_key(f"{model}.append", 1, slots, batch), shape_key(f"{model}.query", 1, slots, batch),
                  shape_key(f"{model}.head", steps, batch))

    head = shape_key("target.head", steps, batch * gamma)
    return (f"target step {step('target')} (head {ms(shape_key('target.head', steps, batch))}), draft step "
            f"{step('draft')} (head {ms(shape_key('draft.head', steps, batch))}), verify of {gamma}: query "
            f"{ms(shape_key('target.query', gamma, slots, batch))} + head {ms(head)}")


def print_table(batch: int, samples: int, reps: int, costs: dict[str, dict[str, float]],
                results: list[ArmResult], clock: str, gamma: int, pair: ModelPair) -> None:
    other = next(c for c in CLOCK_NAMES if c != clock)
    slots = next(parse_shape(key)[2] for key in costs[clock] if key.startswith("target.query"))
    print(f"\n## batch {batch}: {samples} samples, {reps} reps, {clock} clock; per call at the full batch: "
          f"{step_costs(costs[clock], batch, gamma, pair.target.config.diffusion_sample_steps, slots)}")
    header = (f"{'method':<17} {'alpha':>6} {'len':>5} {'tgt':>5} {'draft':>6} {'tries':>5} {'caps':>4} "
              f"{'ms/sample':>10} {'speedup':>8} {'pred':>6} {'eff':>5} {'eff 90%':>9} {'ovh':>5} {'loop':>6} "
              f"{'loop%':>5} {'pred-seq':>8} {'eff-seq':>7} | {'speedup':>8} {'eff':>5} ({other})")
    print(header)
    print("-" * len(header))
    per_batch = samples / batch
    for r in results:
        alpha = "-" if r.draft_acceptance_rate is None else f"{r.draft_acceptance_rate:.3f}"
        rounds = r.calls.total("target.head")
        tgt, draft = rounds / per_batch, r.calls.total("draft.head") / per_batch
        m, o = r.clocks[clock], r.clocks[other]
        print(f"{r.name:<17} {alpha:>6} {r.mean_acceptance_length:>5.2f} {tgt:>5.1f} {draft:>6.1f} "
              f"{r.mean_resample_tries:>5.2f} {r.resample_cap_hits:>4} {m.s_per_sample * 1e3:>10.2f} "
              f"{m.speedup:>8.2f} {m.predicted_speedup:>6.2f} {m.efficiency:>5.2f} "
              f"{interval_text(m.efficiency_interval):>9} {m.overhead:>5.2f} "
              f"{r.loop_s[clock] / rounds * 1e3:>6.2f} {100 * r.loop_s[clock] / r.total_s[clock]:>5.1f} "
              f"{optional(m.sequence_predicted, '8.2f')} {optional(m.sequence_efficiency, '7.2f')} "
              f"| {o.speedup:>8.2f} {o.efficiency:>5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, gamma=4)
    ap.add_argument("--samples", type=int, default=None,
                    help="samples at batch sizes > 1 (default: --batches-large batches)")
    ap.add_argument("--batches-large", type=int, default=None,
                    help="number of batches at batch sizes > 1 (default 2, quick 1)")
    ap.add_argument("--samples-b1", type=int, default=None, help="samples at batch 1 (default 2, quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 6, quick 3)")
    ap.add_argument("--quick", action="store_true", help="fewer samples and repetitions (a few minutes)")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip the replays of each arm's calls in sequence (pred-seq, eff-seq; about half the time)")
    args = ap.parse_args(argv)

    samples_b1 = args.samples_b1 or (1 if args.quick else 2)
    batches_large = args.batches_large or (1 if args.quick else 2)
    cost_timings = 8 if args.quick else 24
    reps = args.reps or (3 if args.quick else 6)
    device, clock, report = start_report(args, target=TARGET, draft=DRAFT, batches=[])
    pair = load_pair(TARGET, DRAFT, device)
    print(f"# specray continuous bench: {TARGET} vs {DRAFT} on {device}, {report['machine']} "
          f"({torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}), gamma={args.gamma}, seed={args.seed}, heap {report['heap']}")
    for batch in [int(b) for b in args.batches.split(",")]:
        samples = samples_b1 if batch == 1 else (args.samples or batch * batches_large)
        results, costs = bench_batch(pair, batch, samples, reps, args.gamma, args.seed, cost_timings, args.replay)
        print_table(batch, samples, reps, costs, results, clock, args.gamma, pair)
        report["batches"].append({"batch": batch, "samples": samples, "reps": reps, "call_costs_s": costs,
                                  "arms": [asdict(r) for r in results]})
    took = finish_report(report, args.json)
    print(f"\n# alpha: draft acceptance rate; len: tokens per target call; tgt, draft: head chains (one per "
          f"model step or verify) per batch; tries, caps: residual proposals per resampled token, cap hits; "
          f"speedup: vs target_only, median of paired runs (same batch, same rep); pred: predicted from the "
          f"calls, each priced at its own shape; eff = speedup / pred; "
          f"eff 90%: a 90 % confidence interval for eff (the median paired speedup's, over pred); "
          f"ovh = time / predicted time; loop: the "
          f"loop's own time (outside the calls) per target call, in ms, and loop%: its share of the time; "
          f"pred-seq: predicted from each arm's calls replayed in sequence with nothing between them; eff-seq: the "
          f"replays' share of the runs' time over target_only's. "
          f"Bench took {took:.0f} s." + (f"\n# wrote {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
