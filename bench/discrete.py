"""Benchmark of the discrete family on the built-in presets (digits-gpt-target with the separate
draft GPT digits-gpt-draft, and with the EAGLE head digits-gpt-eagle).

For batch 1 and batch 32 and each arm (target_only; with the draft GPT: sd, block, lantern, cool_sd
at delta 1.1 and 2.0, uniform_rsd, gamma 4; with the EAGLE head: sd on a chain of gamma 4 and on the
static trees ``small`` and ``eagle25``, LANTERN++ and COOL-SD (delta 2.0) on the ``small`` tree; default
sampling with CFG 1.5) it reports:

- ``len``: mean acceptance length (image tokens per target call, bonus and prefill included);
  ``alpha``: draft acceptance rate;
- ``speedup``: measured speedup over ``target_only``. All arms run on the same samples and seeds,
  taking turns batch by batch (the order rotates), after a warm-up; the median over repetitions
  of the paired ratio target_only time / arm time;
- ``pred``: the speedup predicted from the measured call counts and the per-call costs measured
  in the same run, at the same batch size, each call priced by what it really is. The calls, each a
  :meth:`GuidedModel.forward` call (forward on both CFG halves + logits processing), are counted by
  wrapping that method in an untimed pass, by shape: model, tokens per row (target_only and the
  prefill: 1; a round's first draft call: 2, catching up the previous round's commit; later draft
  calls: 1; verify: gamma+1, padded in a row's short last round, so it costs the same) and rows fed
  (the whole batch, or, in the tail rounds once over half the rows are done, fewer rows read by index), and
  the cache slots its attention reads (on a CPU the span up to the call's furthest row, in steps of 16:
  attention's cost grows with it, and in a speculative batch the furthest row runs well ahead of the
  rest). The head arms' calls are counted the same way: ``target_f`` is a target call that also returns
  hidden states (prefill 1 token, chain verify gamma+1, tree verify: the tree's nodes + 1, with its tree
  mask), ``head`` an EAGLE-head call (the round's catch-up over depth + 1 positions, then one token per
  chain step, or one tree level's internal nodes). Every shape used is timed in the same run (its
  furthest row's tokens ending at the span's last slot; warmed by 0.05 s of its own calls, then timed
  back to back with itself, as a loop's calls follow each other on one cache; a speculative GPT shape
  with its rows a few positions apart, since rows at different positions write their K/V by index and
  level rows through cheaper slices), a few shapes before each arm's batch, so that the timings see the
  load the runs see (calls on fewer rows at a grid of row counts, linear in between), and predicted
  time = sum over calls of the cost of the call's shape;
- ``eff`` = speedup / pred (1.0: no more loop overhead than target_only's own loop);
- ``eff 90%``: a 90 % confidence interval for ``eff``: the order statistics of the paired speedups that bound
  their median at 90 % or more (:func:`~bench.pricing.median_interval`; of 5 to 7 pairs, the lowest and the
  highest; of fewer, the same, short of 90 %), over ``pred``. The repetitions' noise, which the median hides: an
  interval under 0.95 puts the efficiency under 0.95 at that confidence, whichever way one rerun's median falls;
- ``ovh`` = time / predicted time of the arm's own calls (its loop overhead factor);
- ``run-eff``: the efficiency with each call priced at what it took in the timed runs themselves
  (the time inside the model calls, measured in place): an arm's share of time in its calls over
  target_only's. It leaves out any difference between a call timed alone and in the loop, and a
  change of load between the cost timings and the runs; what is left is the loop's own work
  (CPU only: on a GPU a call returns before its work is done);
- ``loop``: the time outside the model calls per target call, in ms (CPU only);
- ``pred-seq``: the speedup predicted by the calls as the arm makes them: each batch's calls, recorded
  in the untimed pass with their inputs, made again in the same order with nothing between them
  (:class:`~bench.pricing.CallRecording`: fresh caches, the cache lengths set back where the loop's
  commit changed them), timed in turns with the runs; target_only's replay time over the arm's. A call
  alone, back to back with its own kind, finds its weights in the CPU's caches; in a speculative loop
  the draft's and the target's calls evict each other's every round, which ``pred`` leaves out and a
  replay keeps, with no loop work at all;
- ``eff-seq``: the efficiency by the replays, what the loop's own work costs and nothing else: the
  median share of an arm's time its replay takes (replay time / run time, repetition by repetition;
  an arm and its replay run next to each other in every turn) over target_only's. Like speedup /
  pred-seq, with each ratio taken between neighbours in time, so the machine's drift cancels.

Both clocks are measured: wall time, and process CPU time, which leaves out the time the process
waits for a core on a shared machine (valid for single-threaded CPU runs only). The main columns use
``--clock`` (auto: cpu on a CPU device, wall on CUDA); the last two columns give the other clock.

    python bench/discrete.py [--quick] [--no-replay] [--json out.json] [--device cpu] [--clock auto|wall|cpu]
"""

from __future__ import annotations

import argparse
import functools
import inspect
import statistics
import sys
from collections import Counter
from collections.abc import Callable
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
    optional,
    paired_speedup,
    parse_shape,
    partial_rows_grid,
    per_repetition,
    predicted_time,
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
from specray.methods.discrete.eagle_loop import HeadStream, TargetStream  # noqa: E402
from specray.methods.discrete.loop import GuidedModel, generation_context, run_batch  # noqa: E402
from specray.methods.discrete.params import SD  # noqa: E402
from specray.models.discrete_ar import attention_span, load_pair  # noqa: E402
from specray.models.pair import ModelPair  # noqa: E402

TARGET, DRAFT, HEAD = "digits-gpt-target", "digits-gpt-draft", "digits-gpt-eagle"

# (row name, method, params, draft); cool_sd at the spec's default delta and at a looser one. Chains
# get gamma from --gamma; a tree's depth is its draft length.
ARMS: list[tuple[str, str, dict[str, Any], str]] = [
    ("target_only", "target_only", {}, DRAFT),
    ("sd", "sd", {}, DRAFT),
    ("block", "block", {}, DRAFT),
    ("lantern", "lantern", {}, DRAFT),
    ("cool_sd d=1.1", "cool_sd", {"delta": 1.1}, DRAFT),
    ("cool_sd d=2.0", "cool_sd", {"delta": 2.0}, DRAFT),
    ("uniform_rsd", "uniform_rsd", {}, DRAFT),
    ("eagle sd", "sd", {}, HEAD),
    ("eagle sd small", "sd", {"tree": "small"}, HEAD),
    ("eagle sd e25", "sd", {"tree": "eagle25"}, HEAD),
    ("eagle lantern sm", "lantern", {"tree": "small"}, HEAD),
    ("eagle cool2 sm", "cool_sd", {"tree": "small", "delta": 2.0}, HEAD),
]


# The model calls of the loops, each counted and priced as one call; the time outside them is the loop's.
# GuidedModel.forward is the model call itself (probs may widen a call to every row of the batch).
MODEL_CALLS = {GuidedModel: "forward", TargetStream: "probs", HeadStream: "probs"}
# Their signatures, read before any pass wraps them: call_size finds an argument by its name.
_SIGNATURES = {cls: inspect.signature(getattr(cls, name)) for cls, name in MODEL_CALLS.items()}


@dataclass
class CallCounts:
    """Batch-level :meth:`GuidedModel.forward` calls of one arm over the bench's samples, by shape."""

    shapes: dict[str, int]  # shape_key(role, tokens per row, slots attended over, rows) -> calls
    batch: int

    def total(self, role: str, tokens: int | None = None, partial: bool | None = None) -> int:
        """Calls of ``role`` (with ``tokens`` per row; only those with fewer rows than the batch if ``partial``)."""
        out = 0
        for key, n in self.shapes.items():
            r, t, _, rows = parse_shape(key)
            if r == role and tokens in (None, t) and partial in (None, rows < self.batch):
                out += n
        return out


@dataclass
class ClockResult:
    """Timing of one arm under one clock."""

    s_per_sample: float  # median over repetitions
    speedup: float  # median over repetitions of (target_only time / this arm's time), same repetition
    predicted_speedup: float  # from the call counts and this clock's per-call costs
    efficiency: float  # speedup / predicted_speedup
    efficiency_interval: tuple[float, float]  # eff 90%: efficiency_interval of the paired speedups
    overhead: float  # median time / predicted time of the arm's own calls
    loop_s_per_target_call: float | None  # median time outside the model calls per target call (CPU only)
    run_efficiency: float | None  # efficiency from each run's own split into calls and loop (CPU only)
    sequence_predicted: float | None  # predicted speedup from the replays of the calls in sequence (None: --no-replay)
    sequence_efficiency: float | None  # the replays' share of the runs' time over target_only's
    reps_s: list[float] = field(default_factory=list)
    reps_loop_s: list[float] = field(default_factory=list)  # time outside the calls, per repetition (CPU only)


@dataclass
class ArmResult:
    name: str
    method: str
    params: dict[str, Any]
    batch: int
    samples: int
    mean_acceptance_length: float
    draft_acceptance_rate: float | None
    calls: CallCounts
    clocks: dict[str, ClockResult]




def count_calls(method: str, params: dict[str, Any], pair: ModelPair, work: list, seed: int,
                ) -> tuple[CallCounts, list, list[CallRecording]]:
    """Untimed pass with the model calls wrapped (:meth:`GuidedModel.forward`, the head streams'
    ``probs``): every call counted by its real shape, and each batch's calls recorded in order
    (:class:`~bench.pricing.CallRecording`, one per batch of ``work``).

    The shape is what the cost of a call depends on: the model, the tokens per row (the first
    draft call of a round feeds 2, verify feeds gamma + 1, padded in a row's short last round) and
    the rows fed (fewer than the batch in the tail rounds, once rows are done).
    """
    counts: Counter[str] = Counter()
    methods = MODEL_CALLS
    originals = {cls: getattr(cls, name) for cls, name in methods.items()}

    def counter(cls: type) -> Any:
        def counted(self: Any, idx: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            tokens, slots = call_size(self, idx, *args, **kwargs)
            counts[shape_key(model_role(self, pair), tokens, slots, idx.shape[0])] += 1
            return originals[cls](self, idx, *args, **kwargs)
        return counted

    for cls, name in methods.items():
        setattr(cls, name, counter(cls))
    stats, recordings = [], []
    try:
        for unit in work:
            with CallRecording(methods, cache_lengths) as recording:
                stats += run_arm(run_batch, method, params, pair, [unit], seed)[1]
            recordings.append(recording)
    finally:
        for cls, name in methods.items():
            setattr(cls, name, originals[cls])
    return CallCounts(dict(sorted(counts.items())), batch=work[0][0].shape[0]), stats, recordings


def model_role(stream: Any, pair: ModelPair) -> str:
    """The bench's name of the model a stream of ``pair``'s calls: ``target``/``draft`` (a GPT stream),
    ``target_f`` (the head loops' target stream) or ``head``."""
    if isinstance(stream, GuidedModel):
        return "target" if stream.model is pair.target else "draft"
    return "target_f" if isinstance(stream, TargetStream) else "head"


def call_size(stream: Any, idx: torch.Tensor, *args: Any, **kwargs: Any) -> tuple[int, int]:
    """Of one model call (:data:`MODEL_CALLS`, its arguments after ``idx``): the tokens fed per row and the
    cache slots its attention reads (on a CPU the span up to the call's furthest row,
    :func:`~specray.models.discrete_ar.attention_span`; a head stream's mask is that wide)."""
    bound = _SIGNATURES[type(stream)].bind(stream, idx, *args, **kwargs).arguments
    if isinstance(stream, GuidedModel):
        span = attention_span(bound["positions"], stream.cache.max_len, fed=stream.model.max_seq_len)
        return bound["positions"].shape[1], span
    return bound["positions"].shape[1], bound["visible"].shape[-1]


def cache_lengths(stream: Any) -> torch.Tensor:
    """What a model call's cost depends on besides its arguments: its stream's cache lengths."""
    return stream.cache.lengths


def replay_batch(recording: CallRecording, device: torch.device) -> dict[str, float]:
    """Time one batch's calls made again in sequence, with nothing between them (both clocks), in the
    context a run makes its calls in (:func:`~specray.methods.discrete.loop.generate_tokens`)."""
    return replay_time(recording, device, generation_context)


def shapes_to_time(counts: list[CallCounts], batch: int) -> list[str]:
    """The call shapes whose cost is measured: every (model, tokens per row, slots attended over) kind the
    arms use, at the full batch if they make it there, and on the partial-rows grid if they make partial calls."""
    kinds: dict[tuple[str, int, int], set[bool]] = {}
    for c in counts:
        for key in c.shapes:
            role, tokens, slots, rows = parse_shape(key)
            kinds.setdefault((role, tokens, slots), set()).add(rows < batch)
    out = []
    for (role, tokens, slots), partial in sorted(kinds.items()):
        if False in partial:
            out.append(shape_key(role, tokens, slots, batch))
        if True in partial:
            out += [shape_key(role, tokens, slots, rows) for rows in partial_rows_grid(batch)]
    return out


# Per shape and timing: untimed calls filling WARM_SECONDS, then timed calls filling PART_SECONDS. After other
# work a call's cost falls over some ten calls of its own (bench/warmup.py): 0.05 s is about ten of a batch-32
# target call.
WARM_SECONDS, PART_SECONDS = 0.05, 0.01


def _call_of_shape(role: str, n: int, slots: int, rows: int, batch: int, pairs: dict[str, ModelPair], gamma: int,
                   gen: torch.Generator) -> Callable[[], Any]:
    """A zero-argument function making one call of shape (role, n tokens per row, attending over ``slots`` cache
    slots, rows) as the loops make it: on a CPU a call attends over the cache's first slots up to its furthest
    row (:func:`~specray.models.discrete_ar.attention_span`), so its cost grows with them, and in a speculative
    batch the furthest row runs well ahead of the others (rows accept different numbers of drafts): a shape
    priced at the rows' mean position would read fewer slots than the loop's call does. So the furthest row's
    last token goes to slot ``slots - 1``, and the timer warms the call and times it back to back with itself
    (:class:`~bench.pricing.InterleavedTimer`), as a loop's calls follow each other on one cache.

    The cache length is the loop's: target_only's for 1-token target calls (all but one prefill call
    per speculative batch), the speculative loop's (room for a padded verify) otherwise; for the head
    arms' calls, the prefix plus the call's tokens (a tree verify's nodes). The rows of a speculative
    GPT shape stand at different positions (0-3 apart), as they do after a loop's first round.
    """
    sampling = SD()
    gpt = pairs[DRAFT]
    device = gpt.device
    idx = torch.arange(rows, device=device)
    tok = torch.randint(0, gpt.target.config.vocab_size, (rows, n), generator=gen).to(device)
    # Past their first round a speculative loop's rows stand at different positions, so its GPT calls write
    # K/V by index; target_only keeps every row level, and a level write goes through slices, which costs
    # less (cache_write_index). So the speculative GPT shapes are timed with rows a few positions apart.
    level = role not in ("target", "draft") or (role, n) == ("target", 1)
    stagger = torch.zeros(rows, 1, dtype=torch.int64) if level else (torch.arange(rows) % 4)[:, None]
    # The furthest row's tokens end at slot `slots - 1`, the others' a few slots before (past the prefix slot 0).
    pos = (slots - n + torch.arange(n) - stagger).clamp(min=1).to(device)
    if role in ("target", "draft"):
        model = gpt.target if role == "target" else gpt.draft
        max_len = gpt.target.max_seq_len + (0 if (role, n) == ("target", 1) else gamma + 1)
        # A stream of its own: on a CPU a GPT's cache grows with its calls (KVCache.reserve) and a call reads
        # every slot its cache holds, as the loop's do (a call of a shape on a cache grown past its span by
        # another shape's would read more); the verify calls' as the speculative loop keeps it (few_reads).
        few_reads = role == "target" and n > 1
        return functools.partial(GuidedModel(model, batch, sampling, max_len, few_reads=few_reads).forward, idx, tok,
                                 pos, all_rows=rows == batch, prefix=False)
    head_pair = pairs[HEAD]
    fed = head_pair.target.max_seq_len
    # The head loops' calls reach slots past the positions fed (a tree's nodes, a padded verify): their spans too.
    max_len = max(fed + n + 1, slots)
    role_stream = (TargetStream(head_pair.target, batch, sampling, max_len) if role == "target_f"
                   else HeadStream(head_pair.draft, head_pair.target, batch, sampling, max_len))
    # K/V at slots `pos`; a tree mask costs the same as a causal one over as many slots
    positions, visible = pos.clamp(max=fed - 1), torch.arange(slots, device=device) <= pos[:, :, None]
    if role == "target_f":
        return functools.partial(role_stream.probs, idx, tok, positions, pos, visible)
    features = torch.randn(role_stream.cache_rows(idx).shape[0], n, head_pair.target.config.dim, generator=gen).to(device)
    return functools.partial(role_stream.probs, idx, features, tok, positions, pos, visible)


def cost_timer(pairs: dict[str, ModelPair], batch: int, gamma: int, shapes: list[str]) -> InterleavedTimer:
    """Times every call shape (CFG on, default sampling) a few at a time between the arms' batches, so
    that the costs see the load the runs see; a shape's cost is the median of its timings. Each call
    is made the way the loops make it past the prefix (:func:`_call_of_shape`): a stream for ``batch``
    samples, fed ``tokens`` per row on ``rows`` of them (the full batch without a gather, fewer rows
    by index, as in the tail rounds)."""
    gen = torch.Generator().manual_seed(0)
    calls = {key: _call_of_shape(*parse_shape(key), batch, pairs, gamma, gen) for key in shapes}
    return InterleavedTimer(calls, pairs[DRAFT].device, seconds=PART_SECONDS, warm_seconds=WARM_SECONDS)


def arm_params(method: str, params: dict[str, Any], gamma: int | None) -> dict[str, Any]:
    """An arm's parameters (a row of :data:`ARMS`) with the chains' ``gamma`` (None: the method's default);
    target_only and the trees take none (a tree's depth is its draft length)."""
    chain = gamma is not None and method != "target_only" and "tree" not in params
    return {**params, "gamma": gamma} if chain else {**params}


def bench_batch(pairs: dict[str, ModelPair], batch: int, samples: int, reps: int, gamma: int, seed: int,
                cost_timings: int, replay: bool = True) -> tuple[list[ArmResult], dict[str, dict[str, float]]]:
    work = batches_of(samples, batch)
    arms = [(name, method, arm_params(method, params, gamma), pairs[draft]) for name, method, params, draft in ARMS]
    # Warm-up (allocator, kernels, neighbour tables), then the untimed counting pass.
    for _, method, params, pair in arms:
        run_arm(run_batch, method, params, pair, work[:1], seed)
    counted = {name: count_calls(method, params, pair, work, seed) for name, method, params, pair in arms}

    shapes = shapes_to_time([c for c, _, _ in counted.values()], batch)
    timer = cost_timer(pairs, batch, gamma, shapes)
    split = pairs[DRAFT].device.type == "cpu"
    by_name = {name: (method, params, pair) for name, method, params, pair in arms}
    # Each arm's calls replayed in sequence take turns with the runs, as one more "arm" each.
    replays = {replay_name(name): name for name in by_name} if replay else {}
    unit_index = {id(unit): i for i, unit in enumerate(work)}
    device = pairs[DRAFT].device

    def run(name: str, unit: Any) -> dict[str, float]:
        if name in replays:
            return replay_batch(counted[replays[name]][2][unit_index[id(unit)]], device)
        return run_arm(run_batch, *by_name[name], [unit], seed)[0]

    turns = reps * len(work) * (len(arms) + len(replays))
    names = with_replays(list(by_name)) if replay else list(by_name)
    runs, outside = run_in_turns(names, work, reps, run, timer.spread(cost_timings * len(shapes), turns),
                                 MODEL_CALLS if split else None)
    times = {name: per_repetition(r, len(work)) for name, r in runs.items()}
    loop_times = {name: per_repetition(r, len(work)) for name, r in outside.items()}
    costs = timer.costs()

    base_name = arms[0][0]
    results = []
    for name, method, params, _ in arms:
        counts, stats, _ = counted[name]
        drafted = sum(s.num_draft_tokens for s in stats)
        accepted = sum(s.num_accepted_draft_tokens for s in stats)
        clocks = {}
        for clock in CLOCK_NAMES:
            mine = [t[clock] for t in times[name]]
            base = [t[clock] for t in times[base_name]]
            speedup = paired_speedup(base, mine)
            pred_time = predicted_time(counts.shapes, costs[clock], batch)
            predicted = predicted_time(counted[base_name][0].shapes, costs[clock], batch) / pred_time
            loop = [t[clock] for t in loop_times[name]] if split else []
            target_calls = counts.total("target") + counts.total("target_f")
            sequence = sequence_speedup(times, base_name, name, clock) if replays else None
            clocks[clock] = ClockResult(
                s_per_sample=statistics.median(mine) / samples, speedup=speedup, predicted_speedup=predicted,
                efficiency=speedup / predicted,
                efficiency_interval=efficiency_interval(base, mine, predicted),
                overhead=statistics.median(mine) / pred_time,
                loop_s_per_target_call=statistics.median(loop) / target_calls if split else None,
                run_efficiency=split_efficiency(loop, mine, [t[clock] for t in loop_times[base_name]], base)
                if split else None,
                sequence_predicted=sequence,
                sequence_efficiency=sequence_efficiency(times, base_name, name, clock) if replays else None,
                reps_s=mine, reps_loop_s=loop,
            )
        results.append(ArmResult(
            name=name, method=method, params=params, batch=batch, samples=samples,
            mean_acceptance_length=sum(s.num_tokens for s in stats) / sum(s.target_calls for s in stats),
            draft_acceptance_rate=accepted / drafted if drafted else None, calls=counts, clocks=clocks,
        ))
    return results, costs


def print_table(batch: int, samples: int, reps: int, costs: dict[str, dict[str, float]],
                results: list[ArmResult], clock: str, gamma: int) -> None:
    other = next(c for c in CLOCK_NAMES if c != clock)
    c = costs[clock]

    def ms(role: str, tokens: int, rows: int = batch) -> str:
        """The shape's cost over the spans it was timed at, the shortest's to the longest's."""
        timed = sorted((slots, cost) for key, cost in c.items() for r, t, slots, n in [parse_shape(key)]
                       if (r, t, n) == (role, tokens, rows))
        if not timed:
            return "-"
        (lo, c_lo), (hi, c_hi) = timed[0], timed[-1]
        return f"{c_lo * 1e3:.3f} ms" if lo == hi else f"{c_lo * 1e3:.3f}-{c_hi * 1e3:.3f} ms over {lo}-{hi} slots"

    print(f"\n## batch {batch}: {samples} samples, {reps} reps, {clock} clock; per call at the full batch: "
          f"target 1 token {ms('target', 1)}, verify {gamma + 1} tokens {ms('target', gamma + 1)}, "
          f"draft 1 token {ms('draft', 1)}, draft 2 tokens {ms('draft', 2)}")
    head_shapes = sorted({parse_shape(k)[:2] for k in c if parse_shape(k)[0] in ("target_f", "head")
                          and parse_shape(k)[-1] == batch}, key=lambda x: (x[0] != "target_f", x[1]))
    if head_shapes:
        print("   head arms, per call at the full batch: " + ", ".join(
            f"{'target' if role == 'target_f' else 'head'} {n} token{'s' if n > 1 else ''} {ms(role, n)}"
            for role, n in head_shapes))
    if batch > 1:
        grid = partial_rows_grid(batch)
        print(f"   calls on fewer rows (tail rounds) timed at rows {grid}, linear in between; e.g. at 1 row: "
              f"verify {ms('target', gamma + 1, 1)}, draft {ms('draft', 1, 1)}, draft 2 tokens {ms('draft', 2, 1)}")
    header = (f"{'method':<17} {'len':>5} {'alpha':>6} {'tgt':>5} {'draft':>6} {'d2':>5} {'part':>5} {'ms/sample':>10} "
              f"{'speedup':>8} {'pred':>6} {'eff':>5} {'eff 90%':>9} {'ovh':>5} {'run-eff':>7} {'loop':>6} "
              f"{'pred-seq':>8} {'eff-seq':>7} | {'speedup':>8} {'eff':>5} ({other})")
    print(header)
    print("-" * len(header))
    per_batch = samples / batch
    for r in results:
        alpha = "-" if r.draft_acceptance_rate is None else f"{r.draft_acceptance_rate:.3f}"
        target_calls = r.calls.total("target") + r.calls.total("target_f")
        draft_calls = r.calls.total("draft") + r.calls.total("head")
        tgt, draft = target_calls / per_batch, draft_calls / per_batch
        two = r.calls.total("draft", tokens=2) / per_batch
        partial = sum(r.calls.total(role, partial=True) for role in ("target", "target_f", "draft", "head"))
        partial /= target_calls + draft_calls
        m, o = r.clocks[clock], r.clocks[other]
        print(f"{r.name:<17} {r.mean_acceptance_length:>5.2f} {alpha:>6} {tgt:>5.1f} {draft:>6.1f} {two:>5.1f} "
              f"{partial:>5.2f} {m.s_per_sample * 1e3:>10.2f} {m.speedup:>8.2f} {m.predicted_speedup:>6.2f} "
              f"{m.efficiency:>5.2f} {interval_text(m.efficiency_interval):>9} {m.overhead:>5.2f} "
              f"{optional(m.run_efficiency, '7.2f')} "
              f"{optional(m.loop_s_per_target_call and m.loop_s_per_target_call * 1e3, '6.2f')} "
              f"{optional(m.sequence_predicted, '8.2f')} {optional(m.sequence_efficiency, '7.2f')} | "
              f"{o.speedup:>8.2f} {o.efficiency:>5.2f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap, gamma=4)
    ap.add_argument("--samples-b1", type=int, default=None, help="samples at batch 1 (default 12, quick 4)")
    ap.add_argument("--batches-large", type=int, default=None,
                    help="number of batches at batch sizes > 1 (default 2, quick 1)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 7, quick 3)")
    ap.add_argument("--cost-timings", type=int, default=None, help="timings per call shape (default 12, quick 6)")
    ap.add_argument("--quick", action="store_true", help="fewer samples and repetitions")
    ap.add_argument("--no-replay", dest="replay", action="store_false",
                    help="skip the replays of each arm's calls in sequence (pred-seq, eff-seq; about half the time)")
    args = ap.parse_args(argv)

    samples_b1 = args.samples_b1 or (4 if args.quick else 12)
    batches_large = args.batches_large or (1 if args.quick else 2)
    reps = args.reps or (3 if args.quick else 7)
    cost_timings = args.cost_timings or (6 if args.quick else 12)
    device, clock, report = start_report(args, target=TARGET, draft=DRAFT, head=HEAD, batches=[])
    pairs = {DRAFT: load_pair(TARGET, DRAFT, device), HEAD: load_pair(TARGET, HEAD, device)}
    print(f"# specray discrete bench: {TARGET} vs {DRAFT} and {HEAD} on {device}, {report['machine']} "
          f"({torch.get_num_threads()} thread(s), torch {torch.__version__}), gamma={args.gamma}, seed={args.seed}, heap {report['heap']}")
    for batch in [int(b) for b in args.batches.split(",")]:
        samples = samples_b1 if batch == 1 else batch * batches_large
        results, costs = bench_batch(pairs, batch, samples, reps, args.gamma, args.seed, cost_timings, args.replay)
        print_table(batch, samples, reps, costs, results, clock, args.gamma)
        report["batches"].append({"batch": batch, "samples": samples, "reps": reps, "call_costs_s": costs,
                                  "arms": [asdict(r) for r in results]})
    took = finish_report(report, args.json)
    print(f"\n# len: mean acceptance length (tokens per target call); alpha: draft acceptance rate; tgt, draft: "
          f"batch-level calls per batch; d2: 2-token draft calls per batch; part: share of calls on fewer rows "
          f"than the batch; speedup: vs target_only, median of paired reps; pred: predicted "
          f"from the calls, each priced at its own shape; eff = speedup / pred; "
          f"eff 90%: a 90 % confidence interval for eff (the median paired speedup's, over pred); "
          f"ovh = time / predicted time; "
          f"run-eff: eff from each run's own split into calls and loop; loop: ms outside the calls per target call; "
          f"pred-seq: predicted from each arm's calls replayed in sequence with nothing between them; "
          f"eff-seq: the replays' share of the runs' time over target_only's. "
          f"Bench took {took:.0f} s." + (f"\n# wrote {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
