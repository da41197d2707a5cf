"""bench/round_segments.py: how it names and counts the gaps between a round's notes, and what it refuses; no timing
is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import round_segments  # noqa: E402
from specray.methods.diffusion import loop  # noqa: E402


def test_gaps_leave_out_the_calls_and_name_each_gap_by_its_two_notes():
    # two Frozen rounds (a target call, the verify call), a batch's final step between them; times in ns
    notes = [("R<", 0), ("T<", 1_000), ("T>", 9_000), ("T<", 12_000), ("T>", 30_000), ("R>", 34_000),
             ("T<", 40_000), ("T>", 50_000), ("R<", 51_000), ("T<", 53_000), ("T>", 60_000), ("T<", 61_000),
             ("T>", 70_000), ("R>", 76_000)]
    gaps, rounds = round_segments.gaps_by_kind(notes)
    assert rounds == 2
    assert gaps == {"R< T<": [1.0, 2.0], "T> T<": [3.0, 1.0], "T> R>": [4.0, 6.0], "R> T<": [6.0],
                    "T> R<": [1.0]}


def test_every_speculative_arm_of_the_diffusion_bench_is_a_choice_and_target_only_is_not():
    assert set(round_segments.SPECULATIVE) == {"token frozen", "token free", "token model", "block frozen",
                                               "block free", "block model"}


def test_a_short_run_prints_each_arms_gaps_and_puts_the_wrapped_functions_back(capsys):
    round_function = loop._round
    round_segments.main(["--arms", "token frozen,token model", "--steps", "12", "--reps", "1", "--warm", "0"])
    out = capsys.readouterr().out
    assert any(line.startswith("token frozen   T> R>") for line in out.splitlines())
    assert any(line.startswith("token model    D> D<") for line in out.splitlines())
    assert loop._round is round_function


@pytest.mark.parametrize("argv,message", [
    (["--arms", "target_only"], "--arms: unknown ['target_only']; the speculative rows of bench/diffusion.py are "
                                "['token frozen', 'token free', 'token model', 'block frozen', 'block free', "
                                "'block model']"),
    (["--arms", "token frozen,tokens free"], "--arms: unknown ['tokens free']"),
    (["--reps", "0"], "--reps must be at least 1, got 0"),
    (["--warm", "-1"], "--warm must be at least 0, got -1"),
])
def test_bad_arguments_are_refused_with_what_is_allowed(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        round_segments.main(argv)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err
