"""``SampleStats.extra["acceptance_timeline"]`` of the three families' loops.

Per sample, on the digits presets (CPU, seed 0, 4 samples per batch): the timeline has one bin
per image token / generation step / denoising step, ``accepted <= drafted`` bin by bin, and the
bins sum exactly to the sample's ``num_accepted_draft_tokens`` / ``num_draft_tokens``. Steps that
are never drafted (the discrete prefill token, CSpD's target-only prefill steps) have 0 drafts.
target_only stores no timeline. (That the timeline leaves images and the other stats unchanged was
checked bit for bit against the loops before the timeline was added; see the report of issue 6.)
"""

from __future__ import annotations

import pytest
import torch

from specray.families import load_pair
from specray.methods.common import SampleStats
from specray.methods.continuous import loop as continuous_loop
from specray.methods.diffusion import loop as diffusion_loop
from specray.methods.discrete import loop as discrete_loop

torch.set_num_threads(1)

SEED = 0
SAMPLE_IDS = torch.arange(4)
LABELS = torch.tensor([0, 3, 7, 9])


def check_timeline(stats: list[SampleStats], bins: int, never_drafted: int = 0) -> None:
    for s in stats:
        timeline = s.extra["acceptance_timeline"]
        accepted, drafted = timeline["accepted"], timeline["drafted"]
        assert len(accepted) == len(drafted) == bins
        assert all(isinstance(v, int) and 0 <= a <= d for a, d in zip(accepted, drafted) for v in (a, d))
        assert sum(accepted) == s.num_accepted_draft_tokens
        assert sum(drafted) == s.num_draft_tokens > 0
        assert drafted[:never_drafted] == [0] * never_drafted


@pytest.fixture(scope="module")
def discrete_pair():
    return load_pair("discrete_ar", "digits-gpt-target", "digits-gpt-draft", "cpu")


@pytest.mark.parametrize("method,params", [("sd", {}), ("block", {}), ("lantern", {}), ("sd", {"gamma": 7})])
def test_discrete_timeline_per_image_token(discrete_pair, method: str, params: dict) -> None:
    result = discrete_loop.run_batch(method, params, discrete_pair, LABELS, SAMPLE_IDS, SEED)
    # image token 0 comes from the target prefill, never from a draft
    check_timeline(result.stats, discrete_pair.target.config.num_image_tokens, never_drafted=1)
    # the last image token is never drafted either (g_b = min(gamma, N - 1 - n_b))
    assert all(s.extra["acceptance_timeline"]["drafted"][-1] == 0 for s in result.stats)
    target_only = discrete_loop.run_batch("target_only", {}, discrete_pair, LABELS, SAMPLE_IDS, SEED)
    assert all("acceptance_timeline" not in s.extra for s in target_only.stats)


@pytest.fixture(scope="module")
def continuous_pair():
    return load_pair("continuous_ar", "digits-mar-target", "digits-mar-draft", "cpu")


@pytest.mark.parametrize("params", [{"mode": "exact"}, {"mode": "paper"}, {"window": "sequential", "gamma": 3}])
def test_continuous_timeline_per_generation_step(continuous_pair, params: dict) -> None:
    result = continuous_loop.run_batch("cspd", {**params, "prefill_ratio": 0.1}, continuous_pair, LABELS, SAMPLE_IDS, SEED)
    num_tokens = continuous_pair.target.config.num_tokens
    prefill = sum(1 for k in range(num_tokens) if k <= 0.1 * num_tokens)  # target-only steps
    check_timeline(result.stats, num_tokens, never_drafted=prefill)
    target_only = continuous_loop.run_batch("target_only", {}, continuous_pair, LABELS, SAMPLE_IDS, SEED)
    assert all("acceptance_timeline" not in s.extra for s in target_only.stats)


@pytest.fixture(scope="module")
def diffusion_pair():
    return load_pair("diffusion", "digits-ddpm", "digits-ddpm-draft", "cpu")


@pytest.mark.parametrize("method,params", [("spec_block", {"drafter": "free"}), ("spec_block", {"drafter": "model"}),
                                           ("spec_token", {"drafter": "frozen", "gamma": 3})])
def test_diffusion_timeline_per_denoising_step(diffusion_pair, method: str, params: dict) -> None:
    num_steps = 20
    result = diffusion_loop.run_batch(method, {**params, "num_steps": num_steps}, diffusion_pair, LABELS, SAMPLE_IDS, SEED)
    speculated = result.stats[0].extra["speculated_steps"]  # chain steps; the deterministic last step is not drafted
    check_timeline(result.stats, speculated)
    # every chain step is drafted at least once: a round's block always starts at the row's step
    assert all(min(s.extra["acceptance_timeline"]["drafted"]) >= 1 for s in result.stats)
    target_only = diffusion_loop.run_batch("target_only", {"num_steps": num_steps}, diffusion_pair, LABELS, SAMPLE_IDS, SEED)
    assert all("acceptance_timeline" not in s.extra for s in target_only.stats)
