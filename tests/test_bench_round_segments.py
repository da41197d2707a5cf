"""bench/round_segments.py: how it names and counts the gaps between a round's notes, in the diffusion family and the
discrete family's draft-GPT chains, and what it refuses; no timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import round_segments  # noqa: E402
from specray.methods.diffusion import loop  # noqa: E402
from specray.methods.discrete import loop as discrete_loop  # noqa: E402


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


def test_the_discrete_choices_are_the_draft_gpt_chains_of_its_bench():
    assert set(round_segments.CHAINS) == {"sd", "block", "lantern", "cool_sd d=1.1", "cool_sd d=2.0", "uniform_rsd"}


def test_a_short_discrete_run_prints_each_gap_of_a_chain_round_and_puts_the_wrapped_functions_back(capsys):
    wrapped = (discrete_loop.GuidedModel.forward, discrete_loop._next_round, discrete_loop._decide,
               discrete_loop._commit)
    round_segments.main(["--family", "discrete", "--arms", "sd", "--gamma", "2", "--reps", "1", "--warm", "0"])
    gaps = {line.split()[1] + " " + line.split()[2] for line in capsys.readouterr().out.splitlines()
            if line.startswith("sd ") and "rounds" not in line}
    # a round: the plan, its draft calls, the verify call, the decision, the commit
    assert {"N< N>", "N> D<", "D> D<", "D> T<", "T> V<", "V< V>", "V> C<", "C< C>", "C> N<"} <= gaps
    assert (discrete_loop.GuidedModel.forward, discrete_loop._next_round, discrete_loop._decide,
            discrete_loop._commit) == wrapped


@pytest.mark.parametrize("argv,message", [
    (["--family", "discrete", "--arms", "eagle sd"], "--arms: unknown ['eagle sd']; the speculative rows of "
                                                     "bench/discrete.py (its draft-GPT chains) are ['sd', 'block', "
                                                     "'lantern', 'cool_sd d=1.1', 'cool_sd d=2.0', 'uniform_rsd']"),
    (["--family", "continuous"], "argument --family: invalid choice: 'continuous' (choose from"),
    (["--gamma", "0"], "--gamma must be at least 1, got 0"),
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
