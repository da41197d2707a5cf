"""Pricing model calls by their measured shape: the pieces the family benches share.

A bench counts an arm's model calls by shape in an untimed pass, times every shape used in the
same run, and predicts the arm's time as the sum over its calls of each call's cost. A shape key
is ``role:dim:...:rows``: what is called, then the sizes its cost depends on, the rows fed last.

Every timing reads two clocks: ``wall`` (time.perf_counter) and ``cpu`` (process CPU time, which
leaves out the time the process waits for a core on a shared machine; a fair clock for
single-threaded torch on CPU only: it misses asynchronous GPU work).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

import torch

CLOCK_NAMES = ("wall", "cpu")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stamp() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def since(start: tuple[float, float]) -> dict[str, float]:
    end = stamp()
    return {name: end[i] - start[i] for i, name in enumerate(CLOCK_NAMES)}


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


def time_calls_round_robin(calls: dict[str, Callable[[], object]], device: torch.device, timings: int = 5,
                           seconds: float = 0.02) -> dict[str, dict[str, float]]:
    """Seconds per call ``{clock: {key: s}}`` of several calls: each timed ``timings`` times, one timing of
    every call per pass (so that drift on a shared machine hits every call alike), each timing of as
    many back-to-back calls as fill about ``seconds`` (at least one); the median per call."""
    repeat: dict[str, int] = {}
    for key, call in calls.items():
        once = time_call(call, device, calls=1, timings=1, warmup=1)["wall"]
        repeat[key] = max(1, round(seconds / max(once, 1e-6)))
    times: dict[str, dict[str, list[float]]] = {clock: {key: [] for key in calls} for clock in CLOCK_NAMES}
    for _ in range(timings):
        for key, call in calls.items():
            for clock, t in time_call(call, device, repeat[key], timings=1, warmup=0).items():
                times[clock][key].append(t)
    return {clock: {key: statistics.median(ts) for key, ts in by_key.items()} for clock, by_key in times.items()}


def median_costs(cost_reps: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Per-call costs ``{clock: {key: s}}``: each key's median over the repetitions' timings."""
    return {clock: {key: statistics.median(c[clock][key] for c in cost_reps) for key in cost_reps[0][clock]}
            for clock in CLOCK_NAMES}


def paired_speedup(base: Iterable[float], mine: Iterable[float]) -> float:
    """Median over repetitions of base time / this arm's time in the same repetition."""
    return statistics.median(b / m for b, m in zip(base, mine))
