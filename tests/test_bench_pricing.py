"""The arithmetic the family benches share (bench/pricing.py): no timing is asserted here, only how
costs, turns and splits are put together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import pricing  # noqa: E402
from bench.pricing import (  # noqa: E402
    TimeInCalls,
    per_repetition,
    run_in_turns,
    shape_cost,
    shape_key,
    split_efficiency,
)


def test_partial_rows_are_priced_linearly_between_the_timed_row_counts():
    # batch 32: rows timed at 1, 2, 4, 8, 16, 31; a call on 12 rows lies between 8 and 16
    costs = {shape_key("verify", 5, 8): 8.0, shape_key("verify", 5, 16): 16.0, shape_key("verify", 5, 32): 40.0}
    assert shape_cost(shape_key("verify", 5, 12), costs, batch=32) == pytest.approx(12.0)
    assert shape_cost(shape_key("verify", 5, 32), costs, batch=32) == 40.0  # timed: taken as is


def test_arms_take_turns_batch_by_batch_in_a_rotating_order():
    order: list[tuple[str, int]] = []

    def run(name: str, unit: int) -> dict[str, float]:
        order.append((name, unit))
        return {"wall": 1.0, "cpu": 2.0}

    elapsed, outside = run_in_turns(["a", "b", "c"], work=[0, 1], reps=2, run=run, between=lambda: None)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 0), ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 1)]
    assert len(elapsed["a"]) == 4 and outside["a"] == elapsed["a"]  # no model calls given: nothing split off
    assert per_repetition(elapsed["a"], batches=2) == [{"wall": 2.0, "cpu": 4.0}] * 2


class _Head:
    def call(self) -> int:
        return 1


class _Model:
    def call(self) -> int:
        return _Head().call() + 1  # a counted call inside a counted call


def test_time_in_calls_counts_a_nested_call_once_and_restores_the_methods(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setattr(pricing, "stamp", lambda: (t := next(ticks), t))  # each reading one tick later
    originals = _Model.call, _Head.call
    with TimeInCalls({_Model: "call", _Head: "call"}) as inside:
        assert _Model().call() == 2
    # the outer call reads the clock at ticks 0 and 2 (the inner one only at 1): 2 ticks, not 2 + 1
    assert inside == {"wall": 2, "cpu": 2}
    assert (_Model.call, _Head.call) == originals


def test_split_efficiency_is_the_share_of_time_in_calls_relative_to_the_base():
    # base: 10 s of which 1 s loop (90 % in calls); arm: 5 s of which 1 s loop (80 % in calls)
    assert split_efficiency([1.0, 1.0], [5.0, 5.0], [1.0, 1.0], [10.0, 10.0]) == pytest.approx(0.8 / 0.9)
    assert split_efficiency([0.5], [5.0], [1.0], [10.0]) == pytest.approx(1.0)  # the same loop share: 1
