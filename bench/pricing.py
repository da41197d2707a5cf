"""Pricing model calls by their measured shape: the pieces the family benches share.

A bench counts an arm's model calls by shape in an untimed pass, times every shape used in the
same run, and predicts the arm's time as the sum over its calls of each call's cost. A shape key
is ``role:dim:...:rows``: what is called, then the sizes its cost depends on, the rows fed last.

Every timing reads two clocks: ``wall`` (time.perf_counter) and ``cpu`` (process CPU time, which
leaves out the time the process waits for a core on a shared machine; a fair clock for
single-threaded torch on CPU only: it misses asynchronous GPU work).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import scipy.stats
import torch

from specray.runtime.hardware import device_name
from specray.runtime.heap import keep_freed_memory

CLOCK_NAMES = ("wall", "cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stamp() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> dict[str, float]:
    end = stamp()
    return {name: end[i] - start[i] for i, name in enumerate(CLOCK_NAMES)}


def batches_of(samples: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Sample ids 0..samples-1 in batches of ``(labels, sample ids)``; label = sample id mod 10
    (every class appears)."""
    out = []
    for start in range(0, samples, batch):
        sids = torch.arange(start, min(start + batch, samples), dtype=torch.int64)
        out.append((sids % 10, sids))
    return out


def shape_key(role: str, *dims: int) -> str:
    """Key of one kind of call: ``role`` then its sizes, the rows fed last."""
    return ":".join([role, *(str(d) for d in dims)])


def parse_shape(key: str) -> tuple:
    role, *dims = key.split(":")
    return (role, *(int(d) for d in dims))


def partial_rows_grid(batch: int) -> list[int]:
    """Row counts at which calls with fewer rows than the batch are timed (others interpolated)."""
    grid = {1 << k for k in range(batch.bit_length()) if 1 << k < batch}
    return sorted(grid | ({batch - 1} if batch > 1 else set()))


def shape_cost(key: str, costs: dict[str, float], batch: int) -> float:
    """Cost of one call of shape ``key``: measured, or (partial rows off the grid) linear in rows
    between the two nearest timed row counts of the same kind."""
    if key in costs:
        return costs[key]
    role, *dims, rows = parse_shape(key)
    grid = partial_rows_grid(batch)
    hi = next(g for g in grid if g > rows)
    lo = max(g for g in grid if g < rows)
    c_lo, c_hi = costs[shape_key(role, *dims, lo)], costs[shape_key(role, *dims, hi)]
    return c_lo + (c_hi - c_lo) * (rows - lo) / (hi - lo)


def predicted_time(shapes: dict[str, int], costs: dict[str, float], batch: int) -> float:
    """Sum over an arm's calls ``{shape key: count}`` of each call's cost at its own shape."""
    return sum(n * shape_cost(key, costs, batch) for key, n in shapes.items())


def time_call(call: Callable[[], object], device: torch.device, calls: int, timings: int = 5,
              warmup: int = 3) -> dict[str, float]:
    """Seconds per call ``{clock: s}``: the median of ``timings`` timings of ``calls`` back-to-back calls."""
    for _ in range(warmup):
        call()
    times: dict[str, list[float]] = {clock: [] for clock in CLOCK_NAMES}
    for _ in range(timings):
        sync(device)
        start = stamp()
        for _ in range(calls):
            call()
        sync(device)
        for clock, t in since(start).items():
            times[clock].append(t / calls)
    return {clock: statistics.median(ts) for clock, ts in times.items()}


class InterleavedTimer:
    """Per-call costs of several calls, timed a few at a time between other work (:meth:`step`),
    cycling through the calls: on a shared machine each call's timings then sample the same
    stretches of drift as the work around them. Each timing is of as many back-to-back calls as
    fill about ``seconds`` (at least one, calibrated on the first calls after a warm-up), after
    untimed calls of the same kind filling about ``warm_seconds`` (at least one): a cost is that of a
    call back to back with its own kind, as the definition of the prices says. (Without it a call
    taking ``seconds`` or more was timed alone, first after the other work: at batch 32 a target call
    then took 1.2x what it takes after one of its kind.)

    A key may name several *parts* (a sequence of calls, each with state of its own, such as a cache per
    position): each part is warmed and timed back to back with itself, one part after the other, and the
    key's cost is the sum of its parts' per-call costs. Timed in turn inside one block instead, every call
    would follow another part's and find its memory cold (on the AVX-512 development machine a GPT call at
    batch 32 costs 1.2-1.3x as much right after another cache's calls, and its cost falls back over some
    ten calls of its own: ``bench/warmup.py``)."""

    def __init__(self, calls: dict[str, Callable[[], object] | Sequence[Callable[[], object]]],
                 device: torch.device, seconds: float = 0.02, warm_seconds: float = 0.0,
                 grad_mode: Callable[[], contextlib.AbstractContextManager] = torch.inference_mode) -> None:
        self.calls, self.device, self.grad_mode = calls, device, grad_mode  # grad_mode: as the loop runs its calls
        self.parts = {key: list(call) if isinstance(call, Sequence) else [call] for key, call in calls.items()}
        self.repeat: dict[str, list[int]] = {}  # per key, per part: calls per timing
        self.warmup: dict[str, list[int]] = {}  # per key, per part: untimed calls before a timing
        with grad_mode():
            for key, parts in self.parts.items():
                once = [time_call(part, device, calls=1, timings=1, warmup=1)["wall"] for part in parts]
                self.repeat[key] = [max(1, round(seconds / max(t, 1e-6))) for t in once]
                self.warmup[key] = [max(1, round(warm_seconds / max(t, 1e-6))) for t in once]
        self.times: dict[str, dict[str, list[float]]] = {clock: {key: [] for key in calls} for clock in CLOCK_NAMES}
        self._keys = list(calls)
        self._next = 0

    def step(self, count: int = 1) -> None:
        """Time the next ``count`` calls of the cycle once each (every part of a call)."""
        for _ in range(count):
            key = self._keys[self._next % len(self._keys)]
            self._next += 1
            total = dict.fromkeys(CLOCK_NAMES, 0.0)
            with self.grad_mode():
                for part, repeat, warmup in zip(self.parts[key], self.repeat[key], self.warmup[key]):
                    for clock, t in time_call(part, self.device, repeat, timings=1, warmup=warmup).items():
                        total[clock] += t
            for clock, t in total.items():
                self.times[clock][key].append(t)

    def spread(self, timings: int, turns: int) -> Callable[[], None]:
        """A ``between`` for :func:`run_in_turns`: ``timings`` calls of the cycle in all, spread evenly over its
        ``turns`` turns (a turn times none where there are more turns than timings)."""
        turn = 0

        def between() -> None:
            nonlocal turn
            self.step(timings * (turn + 1) // turns - timings * turn // turns)
            turn += 1
        return between

    def costs(self) -> dict[str, dict[str, float]]:
        """Seconds per call ``{clock: {key: s}}``: the median of each call's timings."""
        return {clock: {key: statistics.median(ts) for key, ts in by_key.items()}
                for clock, by_key in self.times.items()}


class TimeInCalls:
    """Within the block, the time spent inside the model calls ``{class: method name}`` (both clocks),
    so that a run's time splits into its calls and its loop. A call made inside another counted call
    is not counted again. CPU devices only: on a GPU a call returns before its work is done."""

    def __init__(self, methods: dict[type, str]) -> None:
        self.methods = methods

    def __enter__(self) -> dict[str, float]:
        self.inside = dict.fromkeys(CLOCK_NAMES, 0.0)
        self.depth = 0
        self.originals = {cls: getattr(cls, name) for cls, name in self.methods.items()}
        for cls, name in self.methods.items():
            setattr(cls, name, self._timed(self.originals[cls]))
        return self.inside

    def _timed(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.depth += 1
            start = stamp()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth -= 1
                if self.depth == 0:
                    for clock, t in since(start).items():
                        self.inside[clock] += t
        return timed

    def __exit__(self, *exc: object) -> None:
        for cls, name in self.methods.items():
            setattr(cls, name, self.originals[cls])


class CallRecording:
    """The model calls ``{class or module: method or function name}`` one run makes, in order, to make again with
    nothing between them (:meth:`replay`): the time of a loop whose own work costs nothing, with every call made in
    the sequence, on the inputs and at the cache lengths the run made it.

    A call's cost depends on what ran before it (on a CPU the weights and caches another model's call
    evicted, which a speculative loop's draft and verify calls do to each other every round), not only on
    its shape; a replay keeps that and leaves out the loop's work. The objects of those classes made in the
    block are recorded by their constructor's arguments and made anew by each replay (their caches
    included); objects made before it (a stateless model, a module) are called as they are. A call's value
    that is an instance of ``results`` (a cache a model call makes) is the replay's own value of that call
    wherever a later call takes it. ``state(obj)`` is the tensor a call's cost depends on besides its
    arguments (a cache's lengths; None: nothing), of the object called and of the recorded objects it takes;
    set back before a call where the run's loop changed it since the object's previous call (a commit's crop;
    one copy, where the run made one or more ops).
    """

    def __init__(self, methods: dict[type | ModuleType, str | tuple[str, ...]],
                 state: Callable[[Any], torch.Tensor | None] | None = None, results: tuple[type, ...] = ()) -> None:
        # one name or several per owner
        self.methods = {owner: (names,) if isinstance(names, str) else names for owner, names in methods.items()}
        self.state, self.results = state or (lambda obj: None), results
        # per object, in order of appearance: _Made (its constructor's call), _Returned (a call's value) or itself
        self.objects: list[Any] = []
        # (object, name, args, kwargs, states to set back first: ((object, tensor), ...)), the objects as places
        self.calls: list[tuple[int, str, tuple, dict, tuple[tuple[int, torch.Tensor], ...]]] = []

    def __enter__(self) -> CallRecording:
        index: dict[int, int] = {}  # id(object) -> its place in self.objects
        last: dict[int, torch.Tensor | None] = {}  # id(object) -> its state after its last call
        self._alive: list[Any] = []  # the objects seen, by place, kept alive through the block: their ids stay theirs

        def seen(obj: Any, made: Any) -> None:
            index[id(obj)] = len(self.objects)
            self.objects.append(made)
            self._alive.append(obj)
            last[id(obj)] = _snapshot(self.state(obj))

        def record(obj: Any, name: str, call: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
            if id(obj) not in index:  # made before the block: replayed on the object itself
                seen(obj, obj)
            taken: list[int] = []  # the places of the recorded objects among the arguments
            recorded_args, recorded_kwargs = _recorded(args, index, taken), _recorded(kwargs, index, taken)
            involved = [obj, *(self._alive[place] for place in taken if self._alive[place] is not obj)]
            restores = []
            for o in involved:
                now = self.state(o)
                if now is not None and not torch.equal(now, last[id(o)]):
                    restores.append((index[id(o)], now.clone()))
            self.calls.append((index[id(obj)], name, recorded_args, recorded_kwargs, tuple(restores)))
            out = call(*args, **kwargs)
            if isinstance(out, self.results) and id(out) not in index:
                seen(out, _Returned(len(self.calls) - 1))
            for o in involved:
                last[id(o)] = _snapshot(self.state(o))
            return out

        def constructor(cls: type, init: Callable[..., None]) -> Callable[..., None]:
            def recorded(obj: Any, *args: Any, **kwargs: Any) -> None:
                init(obj, *args, **kwargs)
                if type(obj) is cls:
                    seen(obj, _Made(cls, args, kwargs))
            return recorded

        def method(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
            def recorded(obj: Any, *args: Any, **kwargs: Any) -> Any:
                return record(obj, name, functools.partial(call, obj), args, kwargs)
            return recorded

        def function(module: ModuleType, name: str, call: Callable[..., Any]) -> Callable[..., Any]:
            def recorded(*args: Any, **kwargs: Any) -> Any:
                return record(module, name, call, args, kwargs)
            return recorded

        # the owners' own attributes (None: inherited), put back as they were on exit
        self.originals = {(owner, attr): vars(owner).get(attr) for owner, names in self.methods.items()
                          for attr in (*names, *(() if isinstance(owner, ModuleType) else ("__init__",)))}
        for owner, names in self.methods.items():
            for name in names:
                if isinstance(owner, ModuleType):
                    setattr(owner, name, function(owner, name, getattr(owner, name)))
                else:
                    setattr(owner, name, method(name, getattr(owner, name)))
            if not isinstance(owner, ModuleType):
                owner.__init__ = constructor(owner, owner.__init__)
        return self

    def __exit__(self, *exc: object) -> None:
        for (owner, attr), original in self.originals.items():
            if original is None:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)
        self._alive = []

    def replay(self, make: Callable[[Any, Callable[[], Any]], Any] | None = None) -> None:
        """Make the objects anew and the calls again, in order (through the owners' methods as they are now).
        ``make(obj, call)``, if given, makes each call of ``obj`` (``call()``) and returns its value: a bench may
        time it, or make it again."""
        objects = [made.cls(*made.args, **made.kwargs) if isinstance(made, _Made) else made for made in self.objects]
        returned = {made.call: place for place, made in enumerate(self.objects) if isinstance(made, _Returned)}
        for number, (i, name, args, kwargs, restores) in enumerate(self.calls):
            for place, state in restores:
                self.state(objects[place]).copy_(state)
            method = getattr(objects[i], name)
            call_args, call_kwargs = _resolved(args, objects), _resolved(kwargs, objects)
            out = (method(*call_args, **call_kwargs) if make is None  # the timed replays: nothing between the calls
                   else make(objects[i], functools.partial(method, *call_args, **call_kwargs)))
            if number in returned:
                objects[returned[number]] = out


class _Made(NamedTuple):
    """An object a recording saw made by its class's constructor, remade by each replay."""

    cls: type
    args: tuple
    kwargs: dict


class _Returned(NamedTuple):
    """An object a recorded call returned: each replay's own value of that call stands for it."""

    call: int


class _Ref(NamedTuple):
    """A recorded object in a call's arguments, by its place in :attr:`CallRecording.objects`."""

    place: int


def _snapshot(state: torch.Tensor | None) -> torch.Tensor | None:
    return None if state is None else state.clone()


def replay_name(arm: str) -> str:
    """The name an arm's replays take turns under (:func:`run_in_turns`)."""
    return f"{arm} replay"


def replay_time(recording: CallRecording, device: torch.device,
                context: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext) -> dict[str, float]:
    """Time one batch's recorded calls made again (both clocks), inside ``context()``: the context the
    family's loop makes its calls in."""
    sync(device)
    start = stamp()
    with context():
        recording.replay()
    sync(device)
    return since(start)


def with_replays(arms: list[str]) -> list[str]:
    """The names taking turns: each arm followed by its replay, so that the two run one after the other
    in every turn (:func:`run_in_turns` rotates the order, keeping neighbours together but at the wrap)."""
    return [name for arm in arms for name in (arm, replay_name(arm))]


def sequence_speedup(times: dict[str, list[dict[str, float]]], base: str, arm: str, clock: str) -> float:
    """``pred-seq``: the median over repetitions of ``base``'s replay time over ``arm``'s (per-repetition times)."""
    return paired_speedup([t[clock] for t in times[replay_name(base)]], [t[clock] for t in times[replay_name(arm)]])


def sequence_efficiency(times: dict[str, list[dict[str, float]]], base: str, arm: str, clock: str) -> float:
    """``eff-seq``: the median share of an arm's time its calls take made in sequence (its replay's time over its
    run's, repetition by repetition: the two ran next to each other) over ``base``'s. As speedup / pred-seq, but
    each ratio taken between neighbours in time, so the machine's drift between turns cancels."""
    def share(name: str) -> float:
        return statistics.median(r[clock] / t[clock] for r, t in zip(times[replay_name(name)], times[name]))
    return share(arm) / share(base)


def _recorded(values: Any, index: dict[int, int], taken: list[int]) -> Any:
    """A call's arguments as a replay takes them: tensors cloned (the loop may write to them after the call), the
    recorded objects by their place (:class:`_Ref`, each place also added to ``taken``), inside tuples, lists and
    dicts too; the rest as is."""
    if isinstance(values, torch.Tensor):
        return values.clone()
    if id(values) in index:
        taken.append(index[id(values)])
        return _Ref(index[id(values)])
    if type(values) is dict:
        return {k: _recorded(v, index, taken) for k, v in values.items()}
    if type(values) in (tuple, list):  # not a named tuple: its fields are no place for a recorded object
        return type(values)(_recorded(v, index, taken) for v in values)
    return values


def _resolved(values: Any, objects: list[Any]) -> Any:
    """:func:`_recorded`'s arguments with each :class:`_Ref` the replay's own object."""
    if isinstance(values, _Ref):
        return objects[values.place]
    if type(values) is dict:
        return {k: _resolved(v, objects) for k, v in values.items()}
    if type(values) in (tuple, list):
        return type(values)(_resolved(v, objects) for v in values)
    return values


def optional(x: float | None, fmt: str) -> str:
    """``x`` in ``fmt`` (e.g. ``"7.2f"``), or "-" right-aligned to its width where there is none."""
    return format(x, fmt) if x is not None else format("-", ">" + fmt.split(".")[0])


def split_efficiency(loop: list[float], total: list[float], base_loop: list[float], base_total: list[float]) -> float:
    """Efficiency from each run's own split into calls and loop: the median share of an arm's time
    spent in its calls over target_only's. With the calls priced at what they took in the runs
    themselves, a change of load between cost timings and runs cancels out."""
    def share(loop_s: list[float], total_s: list[float]) -> float:
        return statistics.median(1 - lo / t for lo, t in zip(loop_s, total_s))
    return share(loop, total) / share(base_loop, base_total)


def paired_ratios(base: Iterable[float], mine: Iterable[float]) -> list[float]:
    """Base time / this arm's time, repetition by repetition (the same repetition's two runs)."""
    return [b / m for b, m in zip(base, mine)]


def paired_speedup(base: Iterable[float], mine: Iterable[float]) -> float:
    """Median over repetitions of base time / this arm's time in the same repetition."""
    return statistics.median(paired_ratios(base, mine))


# The confidence of the efficiency interval the family benches print (``eff 90%``).
INTERVAL_LEVEL = 0.9


def median_interval(values: Sequence[float], level: float = INTERVAL_LEVEL) -> tuple[float, float]:
    """A distribution-free confidence interval for the median of independent ``values``, scipy's
    (``quantile_test``): the order statistics ``x_(k)`` and ``x_(n+1-k)`` with the largest ``k`` whose coverage,
    ``1 - 2 P(Binomial(n, 1/2) < k)``, is at least ``level``. Seven values give their whole range (98 %), fifteen
    their 4th to 12th (96 %); too few values for the level (four or fewer at 0.9) give their whole range, short of
    it."""
    xs = list(values)
    if not xs:
        raise ValueError("median_interval needs at least one value")
    # The interval does not depend on the quantile tested, q.
    interval = scipy.stats.quantile_test(xs, q=xs[0], p=0.5).confidence_interval(confidence_level=level)
    if math.isnan(interval.low) or math.isnan(interval.high):
        return min(xs), max(xs)
    return float(interval.low), float(interval.high)


def interval_text(interval: tuple[float, float], digits: int = 2) -> str:
    """An interval as the tables print it: ``0.81-0.93``."""
    return f"{interval[0]:.{digits}f}-{interval[1]:.{digits}f}"


def ratio_interval(base: Iterable[float], mine: Iterable[float], level: float = INTERVAL_LEVEL) -> tuple[float, float]:
    """:func:`median_interval` of the paired ratios base time / this arm's time (:func:`paired_ratios`), the
    interval of :func:`paired_speedup`: the machine's noise from repetition to repetition, which the median alone
    hides."""
    return median_interval(paired_ratios(base, mine), level)


def efficiency_interval(base: Iterable[float], mine: Iterable[float], predicted: float,
                        level: float = INTERVAL_LEVEL) -> tuple[float, float]:
    """``eff 90%``: :func:`ratio_interval` of the paired speedups over the predicted speedup."""
    lo, hi = ratio_interval(base, mine, level)
    return lo / predicted, hi / predicted


def run_arm(run_batch: Callable[..., Any], method: str, params: dict[str, Any], pair: Any, work: list,
            seed: int) -> tuple[dict[str, float], list]:
    """Time one arm of a family's ``run_batch`` on every batch of ``work`` (both clocks); returns the
    time and every sample's stats."""
    sync(pair.device)
    start = stamp()
    stats = []
    for labels, sids in work:
        stats += run_batch(method, params, pair, labels, sids, seed).stats
    sync(pair.device)
    return since(start), stats


def run_in_turns(names: list[str], work: list, reps: int, run: Callable[[str, Any], dict[str, float]],
                 between: Callable[[], None], model_calls: dict[type, str] | None = None,
                 ) -> tuple[dict[str, list[dict[str, float]]], dict[str, list[dict[str, float]]]]:
    """Time ``run(name, batch)`` for every arm on every batch of ``work``, ``reps`` times. The arms take
    turns batch by batch (every arm runs a batch before any runs the next; the order rotates each
    time), so drift on a shared machine hits them alike; ``between`` (the cost timings) runs before
    each arm's batch. Returns per arm, run by run (repetition-major): the elapsed ``{clock: s}``, and
    the time outside ``model_calls`` (:class:`TimeInCalls`; the elapsed time when not given)."""
    elapsed: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    outside: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    turn = 0
    for _ in range(reps):
        for unit in work:
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                between()
                with TimeInCalls(model_calls) if model_calls else contextlib.nullcontext(
                        dict.fromkeys(CLOCK_NAMES, 0.0)) as inside:
                    t = run(name, unit)
                elapsed[name].append(t)
                outside[name].append({clock: t[clock] - inside[clock] for clock in CLOCK_NAMES})
            turn += 1
    return elapsed, outside


def per_repetition(runs: list[dict[str, float]], batches: int) -> list[dict[str, float]]:
    """``{clock: s}`` summed over each repetition's ``batches`` consecutive runs."""
    return [{clock: sum(r[clock] for r in runs[i : i + batches]) for clock in CLOCK_NAMES}
            for i in range(0, len(runs), batches)]


# ---- command line and report ----------------------------------------------------------------------


def add_common_args(ap: argparse.ArgumentParser, gamma: int) -> None:
    """The options every family bench takes."""
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--gamma", type=int, default=gamma)
    ap.add_argument("--batches", default="1,32", help="comma-separated batch sizes")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 for stable timing)")
    ap.add_argument("--json", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--clock", choices=("auto", *CLOCK_NAMES), default="auto",
                    help="clock of the main columns (both are measured and stored); auto: cpu on a CPU "
                         "device (robust on a shared machine), wall on CUDA")


def start_report(args: argparse.Namespace, **fields: Any) -> tuple[torch.device, str, dict[str, Any]]:
    """Set torch's threads and, on a CPU, keep freed memory as the workers do (:mod:`specray.runtime.heap`); return
    the device, the main clock and the report's header (with the machine in words,
    :func:`~specray.runtime.hardware.device_name`, and ``heap``: whether freed memory is kept)."""
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kept = device.type == "cpu" and keep_freed_memory()
    clock = args.clock if args.clock != "auto" else ("cpu" if device.type == "cpu" else "wall")
    report = {**fields, "device": str(device), "machine": device_name(device), "gamma": args.gamma, "seed": args.seed,
              "threads": torch.get_num_threads(), "torch": torch.__version__, "python": platform.python_version(),
              "quick": args.quick, "clock": clock, "heap": "kept" if kept else "glibc's default",
              "started": time.perf_counter()}
    return device, clock, report


def finish_report(report: dict[str, Any], path: Path | None) -> float:
    """Record the bench's wall time, write the report to ``path`` if given; return the wall time."""
    report["bench_wall_s"] = time.perf_counter() - report.pop("started")
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2))
    return report["bench_wall_s"]
