"""bench/compiled.py's figures from its timings: no timing is asserted here, only how they are put together."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compiled import summary  # noqa: E402


def test_the_ratio_and_its_interval_pair_each_repetitions_eager_and_compiled_times():
    times = {"eager": [1.0, 2.0, 3.0, 4.0, 5.0], "compiled": [2.0, 1.0, 3.0, 2.0, 4.0]}
    row = summary(times)
    # Paired ratios 0.5, 2.0, 1.0, 2.0, 1.25: their median, not the medians' ratio (3.0 / 2.0 = 1.5).
    assert row["ratio"] == pytest.approx(1.25)
    assert row["ratio_interval"] == pytest.approx((0.5, 2.0))  # five repetitions: their whole range
    assert (row["eager_s_per_sample"], row["compiled_s_per_sample"]) == (3.0, 2.0)
    assert row["eager_reps_s_per_sample"] == times["eager"]
    assert row["compiled_reps_s_per_sample"] == times["compiled"]
