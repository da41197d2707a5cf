"""bench/loop_only.py: a batch run with its model calls handing back their recorded values makes the run's images and
statistics, it refuses values that are not the run's, and it puts the wrapped calls back; no timing is asserted."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import discrete, loop_only  # noqa: E402
from specray.methods.discrete.eagle_loop import HeadStream, TargetStream  # noqa: E402
from specray.methods.discrete.loop import GuidedModel  # noqa: E402


@pytest.fixture(scope="module")
def pairs():
    return {draft: discrete.load_pair(discrete.TARGET, draft, torch.device("cpu"))
            for draft in (discrete.DRAFT, discrete.HEAD)}


def _calls():
    return GuidedModel.forward, TargetStream.probs, HeadStream.probs


@pytest.mark.parametrize("method,params,draft", [
    ("target_only", {}, discrete.DRAFT), ("sd", {"gamma": 3}, discrete.DRAFT),
    ("cool_sd", {"gamma": 2}, discrete.DRAFT), ("sd", {"gamma": 3}, discrete.HEAD),
    ("sd", {"tree": "small"}, discrete.HEAD)])
def test_handing_back_the_recorded_values_makes_the_runs_images_and_statistics(pairs, method, params, draft):
    calls = _calls()
    unit = (torch.tensor([3, 7]), torch.tensor([11, 12]))
    values, targets, result = loop_only.record_values(method, params, pairs[draft], unit, seed=5)
    assert targets >= 1 and len(values) >= targets
    assert loop_only.same_result(result, loop_only.run_alone(method, params, pairs[draft], *unit, 5, values))
    assert _calls() == calls


def test_values_of_another_batch_are_refused_or_make_other_images(pairs):
    # negative control: the check that guards the timings must fail when the values are not the run's
    pair = pairs[discrete.DRAFT]
    values, _, result = loop_only.record_values("sd", {"gamma": 3}, pair, (torch.tensor([3]), torch.tensor([1])), 0)
    other, _, _ = loop_only.record_values("sd", {"gamma": 3}, pair, (torch.tensor([8]), torch.tensor([2])), 0)
    try:
        alone = loop_only.run_alone("sd", {"gamma": 3}, pair, torch.tensor([3]), torch.tensor([1]), 0, other)
    except RuntimeError as exc:
        assert "model calls than the" in str(exc)
    else:
        assert not loop_only.same_result(result, alone)
    with pytest.raises(RuntimeError, match="more model calls than the 2 recorded"):
        loop_only.run_alone("sd", {"gamma": 3}, pair, torch.tensor([3]), torch.tensor([1]), 0, values[:2])
    assert loop_only.same_result(result, loop_only.run_alone("sd", {"gamma": 3}, pair, torch.tensor([3]),
                                                              torch.tensor([1]), 0, values))


def test_a_short_run_prints_every_chosen_arm(capsys):
    calls = _calls()
    loop_only.main(["--arms", "target_only,sd", "--samples", "1", "--reps", "1", "--gamma", "2"])
    lines = capsys.readouterr().out.splitlines()
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in lines
            if line.split() and line.split()[0] in ("target_only", "sd")}
    assert set(rows) == {"target_only", "sd"}
    for run, calls_ms, between, alone, _ in rows.values():
        assert run > 0 and alone > 0 and abs(run - calls_ms - between) <= 2e-3  # printed to 3 decimals
    assert _calls() == calls


def test_an_unknown_arm_is_refused_with_the_choices(capsys):
    with pytest.raises(SystemExit) as exc:
        loop_only.main(["--arms", "sd,nope"])
    assert exc.value.code == 2
    assert "--arms: unknown ['nope']; the rows of bench/discrete.py are ['target_only', 'sd'" in capsys.readouterr().err


def test_the_benches_give_the_chains_gamma_and_target_only_and_the_trees_none():
    # bench/discrete.py, bench/in_place.py and this script build their arms' parameters by one rule
    made = {name: discrete.arm_params(method, params, 3) for name, method, params, _ in discrete.ARMS}
    assert made["target_only"] == {} and made["sd"] == {"gamma": 3}
    assert made["cool_sd d=2.0"] == {"delta": 2.0, "gamma": 3}
    assert made["eagle sd"] == {"gamma": 3} and made["eagle sd small"] == {"tree": "small"}
    assert discrete.arm_params("sd", {}, None) == {}
    row = dict(discrete.ARMS[1][2])
    discrete.arm_params("sd", discrete.ARMS[1][2], 3)["gamma"] = 9  # a copy: the table's row is left alone
    assert discrete.ARMS[1][2] == row
