"""The lossless arms are exact on the release-format checkpoints as on the presets.

Discrete family (tiny LlamaGen target + draft, official FID sampler settings: cfg 1.75, top-k 0,
top-p 1, T 1): the law of the first image tokens of ``sd`` and ``block`` matches ``target_only``
in a chi-square two-sample test (N = 1000 per arm, class 3, seeds 100 and 200, positions 1-3, each
p > 1e-3); the negative control (``uniform_rsd`` with delta 1000, which samples the draft) fails it.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency

from specray.families import format_options, resolve
from specray.methods.discrete.loop import generate_tokens
from specray.models.discrete_ar import load_pair
from tests.checkpoint_fixtures import llamagen_draft, llamagen_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

N = 1000
LABEL = 3
POSITIONS = (1, 2, 3)
ALPHA = 1e-3


@pytest.fixture(scope="module")
def llamagen_pair():
    return load_pair(llamagen_target(), llamagen_draft(), "cpu")


def official(method: str, **extra):
    defaults = format_options("discrete_ar", llamagen_target()).sampling_defaults()
    return resolve("discrete_ar", method, {**defaults, **extra})


@pytest.fixture(scope="module")
def target_only_tokens(llamagen_pair):
    method, params = official("target_only")
    assert params.cfg_scale == 1.75
    return generate_tokens(method, params, llamagen_pair, torch.full((N,), LABEL), torch.arange(N), seed=100)[0]


def p_values(pair, base, method, **extra):
    m, params = official(method, **extra)
    other = generate_tokens(m, params, pair, torch.full((N,), LABEL), torch.arange(N), seed=200)[0]
    out = []
    for pos in POSITIONS:
        table = torch.stack([torch.bincount(base[:, pos], minlength=64), torch.bincount(other[:, pos], minlength=64)])
        out.append(chi2_contingency(table[:, table.sum(0) > 0].numpy())[1])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd", "block"])
def test_exact_rules_match_target_only_on_llamagen(llamagen_pair, target_only_tokens, method):
    assert min(p_values(llamagen_pair, target_only_tokens, method, gamma=3)) > ALPHA


@pytest.mark.slow
def test_negative_control_fails_on_llamagen(llamagen_pair, target_only_tokens):
    assert min(p_values(llamagen_pair, target_only_tokens, "uniform_rsd", gamma=3, delta=1000.0)) < ALPHA
