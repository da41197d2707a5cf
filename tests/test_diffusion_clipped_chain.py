"""Speculative sampling stays exact when the step mean clips x0 (diffusers' clip_sample, as in
google/ddpm-cifar10-32): the kernels are Gaussians of equal sigma whose means are not affine in eps,
and the loop verifies the difference of the two means (spec_diffusion 1.2).

The chain of tests/test_diffusion_chain.py (d = 2, K = 12, sigma 0.5, its target eps; the draft adds
3 tanh(3x), a rough draft that makes the negative control visible)
with the mean ``0.5 clip(x - 0.6 eps, -1, 1) + 0.5 x`` (the clip binds on about a tenth of the coordinates at every step).
No closed form: the speculative chains' x_K is compared with plain ancestral sampling by two-sample
KS tests on both coordinates and two diagonal projections (N = 40 000 each, x_0 seeds 0 and 7, loop
seeds 1 and 2): every p > 1e-3 for the exact rules; reflection inside block verification must give p < 1e-4.
"""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from specray.methods.diffusion.loop import GaussianChain, ancestral_chain, speculative_chain
from tests.test_diffusion_chain import SIGMA, D, K, N, target_eps

pytestmark = pytest.mark.slow  # five runs of 40 000 chains


def rough_draft_eps(x: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return target_eps(x, k, rows) + 3 * torch.tanh(3 * x)


def clipped_chain() -> GaussianChain:
    full = lambda v: torch.full((K,), v, dtype=torch.float64)  # noqa: E731
    return GaussianChain(A=full(0.8), B=full(-0.3), sigma=full(SIGMA), target_eps=target_eps, draft_eps=rough_draft_eps,
                         clipped_mean=(full(0.5), full(0.5), full(1.0), full(0.6)))


def start(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(N, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)), torch.arange(N)


@pytest.fixture(scope="module")
def ancestral() -> torch.Tensor:
    x0, ids = start(7)
    return ancestral_chain(clipped_chain(), x0, ids, seed=2)


def min_p(a: torch.Tensor, b: torch.Tensor) -> float:
    projections = lambda z: [z[:, 0], z[:, 1], z[:, 0] + z[:, 1], z[:, 0] - z[:, 1]]  # noqa: E731
    return min(stats.ks_2samp(p.numpy(), q.numpy()).pvalue for p, q in zip(projections(a), projections(b)))


def test_clip_binds(ancestral):
    x = ancestral
    assert ((x - 0.6 * target_eps(x, torch.zeros(N), None)).abs() > 1).float().mean() > 0.05


@pytest.mark.parametrize("drafter,verification,rejection", [("model", "block", "residual"),
                                                            ("model", "token", "reflection"),
                                                            ("free", "block", "residual")])
def test_speculative_matches_ancestral_with_clipping(ancestral, drafter, verification, rejection):
    x0, ids = start(0)
    x, _ = speculative_chain(clipped_chain(), x0, ids, seed=1, drafter=drafter, verification=verification,
                             rejection=rejection, gamma=4)
    assert min_p(x, ancestral) > 1e-3


def test_reflection_inside_block_verification_is_detected_with_clipping(ancestral):
    """Negative control (spec T9): reflection is not exact under block verification."""
    x0, ids = start(0)
    x, _ = speculative_chain(clipped_chain(), x0, ids, seed=1, drafter="model", verification="block",
                             rejection="reflection", gamma=4)
    assert min_p(x, ancestral) < 1e-4
