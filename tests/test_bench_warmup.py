"""bench/warmup.py's cases and arguments: no timing is asserted, only which rows it measures and what it refuses."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import warmup  # noqa: E402


def test_every_kind_of_other_work_gets_a_row_per_time_away(capsys):
    warmup.main(["--batch", "1", "--model", "draft", "--calls", "2", "--reps", "1", "--warm", "2",
                 "--away-ms", "0.05,0.2"])
    out = capsys.readouterr().out
    assert "digits-gpt-draft at batch 1" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| after")]
    kinds = ("another cache", "the other model", "Python alone", "one small op", "asleep")
    assert [row.split(" | ")[:2] for row in rows] == [[f"| {kind}", away] for away in ("0.05 ms", "0.2 ms")
                                                        for kind in kinds]
    assert all(len(row.split(" | ")) == 2 + 2 + 1 for row in rows)  # kind, away, two calls, mean


def test_the_diffusion_family_times_a_denoiser_after_the_other_models_calls_on_their_own_rows(capsys, monkeypatch):
    made = []
    real = warmup.denoiser_call

    def recording(model, rows, *args):
        made.append((model, rows))
        return real(model, rows, *args)

    monkeypatch.setattr(warmup, "denoiser_call", recording)
    warmup.main(["--family", "diffusion", "--model", "draft", "--batch", "2", "--other-rows", "3", "--calls", "2",
                 "--reps", "1", "--warm", "2", "--away-ms", "0.05"])
    out = capsys.readouterr().out
    assert "digits-ddpm-draft at batch 2, random steps, the other model on 3 rows" in out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| after")]
    kinds = ("other inputs", "the other model", "Python alone", "one small op", "asleep")
    assert [row.split(" | ")[:2] for row in rows] == [[f"| {kind}", "0.05 ms"] for kind in kinds]
    # The timed call and its other inputs are the draft's on the batch's rows, the other model's the target's on 3.
    draft, target = made[0][0], made[2][0]
    assert made == [(draft, 2), (draft, 2), (target, 3)] and draft is not target
    assert sum(p.numel() for p in draft.parameters()) < sum(p.numel() for p in target.parameters())  # the draft


def test_other_rows_below_one_are_refused_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        warmup.main(["--other-rows", "0"])
    assert exit_info.value.code != 0
    assert "--other-rows must be at least 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("away", ["0.5,x", "0", "-1"])
def test_a_bad_time_away_is_refused_naming_the_flag(away, capsys):
    with pytest.raises(SystemExit) as exit_info:
        warmup.main(["--away-ms", away])
    assert exit_info.value.code != 0
    assert "--away-ms" in capsys.readouterr().err


def test_the_work_between_calls_runs_for_the_time_asked():
    for work in (warmup.python_alone, warmup.one_small_op):
        start = time.perf_counter()
        work(0.01)
        assert 0.01 <= time.perf_counter() - start < 0.5


def test_small_calls_get_a_row_each_with_a_cell_per_time_away(capsys):
    warmup.main(["--small-calls", "--reps", "1", "--warm", "2", "--away-ms", "0.05,0.2"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and not line.startswith("| call")]
    assert [row.split(" | ")[0] for row in rows] == ["| torch add, 8 floats", "| NumPy add, 64 floats",
                                                     "| sum(range(50))"]
    assert all(len(row.split(" | ")) == 2 + 2 for row in rows)  # call, warm, two times away
    assert "| call | warm | after 0.05 ms | after 0.2 ms |" in out


def test_each_small_call_does_its_work():
    calls = warmup.small_calls()
    assert calls["sum(range(50))"]() == 1225
    for name in ("torch add, 8 floats", "NumPy add, 64 floats"):
        calls[name]()
        out = calls[name]()
        assert float(out.sum()) == 2.0 * len(out)  # in place: the same buffer, one added each call


def test_the_first_call_after_time_away_is_timed_after_that_time():
    start = time.perf_counter()
    warm, first = warmup.first_call_after(lambda: None, 0.01, warm=3)
    assert time.perf_counter() - start >= 0.01
    assert 0 <= warm < 0.01 and 0 <= first < 0.01
