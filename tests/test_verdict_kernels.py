"""Token and block verification of a diffusion round in C++ (``csrc/verdicts.cpp``, :func:`rules._kernel`): the
tensor paths' verdicts, and block verification's weights ``h`` (which decide tau only through comparisons with the
coins), bit for bit, NaN for NaN, on random, tail-edge and out-of-domain rounds; torch's operations where a kernel
refuses a call; a kernel that differs refused by the check; the diffusion loop's samples the same with and without
the kernels."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specray.methods.diffusion import cpu_commit, rules
from specray.methods.diffusion.residual import DELTA_MIN, KERNEL_CONSTANTS
from specray.models import cpu_kernels
from tests.test_residual_draw_kernel import sample_digest

RULES = ["token", "block"]


def found(rule: str):
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    kernel = rules._kernel(torch.zeros(1), f"{rule}_verdict")
    assert kernel is not None, f"the {rule} verdict kernel built but did not give torch's values (see the log)"
    return kernel


@pytest.fixture(scope="module")
def kernel():
    return found("block")


@pytest.fixture(scope="module", params=RULES)
def both(request):
    return request.param, found(request.param)


def same_as_tensors(rule_kernel, log_rho, delta, g, eta) -> bool:
    rule, kernel = rule_kernel
    if rule == "token":
        got = kernel(log_rho, delta, g, eta, DELTA_MIN)
        want = rules._token_verify_tensors(log_rho, delta, g, eta)
        expected = (want.tau, want.log_alpha, want.expected_advance)
    else:
        got = kernel(log_rho, delta, g, eta, KERNEL_CONSTANTS, DELTA_MIN)
        want = rules._block_verify_tensors(log_rho, delta, g, eta)
        expected = (want.tau, want.log_alpha, want.expected_advance, rules.block_weights(log_rho, delta, g)[1])
    return got[0] is not None and all(cpu_kernels.same_values(a, b) for a, b in zip(got, expected))


def test_random_rounds_give_the_tensor_paths_values(both) -> None:
    """1,470 random rounds (seed 7): batches 1-100, block lengths 1-7, ragged and full rows; delta log-normal over
    eight decades (the far-tail branches of log Phi on either side), identical kernels (delta 1e-12) and positive
    log rho in some rounds."""
    gen = torch.Generator().manual_seed(7)
    far = 0
    for n, G, rep in itertools.product((1, 2, 3, 5, 8, 32, 100), range(1, 8), range(30)):
        delta = torch.exp(3 * torch.randn(n, G, dtype=torch.float64, generator=gen)) * (0.1 if rep % 2 else 1.0)
        log_rho = -delta * torch.randn(n, G, dtype=torch.float64, generator=gen) - 0.5 * delta * delta
        if rep % 5 == 0:
            delta[0, 0] = 1e-12
        if rep % 7 == 0:
            log_rho[:, 0] = 0.3
        g = torch.full((n,), G) if rep % 3 == 0 else torch.randint(1, G + 1, (n,), generator=gen)
        eta = torch.rand(n, G, dtype=torch.float64, generator=gen)
        assert same_as_tensors(both, log_rho, delta, g, eta)
        far += int((delta > 60).sum())
    assert far > 1000  # s - delta = -delta / 2 + log w / delta < -30: the tail expansion's branch


def test_rounds_at_the_tail_branches_edge_give_the_tensor_paths_values(kernel) -> None:
    """Slot 1's s = c or s - delta within 3 of -30, where log Phi switches to its tail expansion (400 rounds of 8
    rows, seed 11): c = delta / 2 + log w_1 / delta, so log rho_0 = log w_1 = delta (c - delta / 2)."""
    gen = torch.Generator().manual_seed(11)
    near = 0
    for rep in range(400):
        shifted_band = rep % 2 == 1  # s - delta near -30 (delta about 60, log w = 0), else s itself
        delta = (55 + 10 * torch.rand(8, 2, dtype=torch.float64, generator=gen) if shifted_band
                 else 0.5 + 20 * torch.rand(8, 2, dtype=torch.float64, generator=gen))
        c = -33 + 6 * torch.rand(8, dtype=torch.float64, generator=gen)
        log_rho = torch.zeros(8, 2, dtype=torch.float64)
        if not shifted_band:
            log_rho[:, 0] = delta[:, 1] * (c - delta[:, 1] / 2)
        eta = torch.rand(8, 2, dtype=torch.float64, generator=gen)
        assert same_as_tensors(("block", kernel), log_rho, delta, torch.full((8,), 2), eta)
        s = delta[:, 1] / 2 + log_rho[:, 0].clamp(max=0) / delta[:, 1]
        point = s - delta[:, 1] if shifted_band else s
        near += int(((point > -31) & (point < -30)).sum())
    assert near > 300


def test_edge_values_give_the_tensor_paths_values(both) -> None:
    """Zero, subnormal, tiny, huge and infinite delta and log rho, -0.0 included (6,561 two-slot rounds at block
    lengths 1 and 2 and coins 0, 0.5 and 1)."""
    deltas = [0.0, 1e-300, 1e-12, 1e-10, 0.5, 40.0, 1e3, 1e300, math.inf]
    log_rhos = [0.0, -0.0, 1e-300, -1e-300, -0.3, 2.0, -50.0, -1e300, -math.inf]
    for d1, d2, r1, r2 in itertools.product(deltas, deltas, log_rhos, log_rhos):
        log_rho = torch.tensor([[r1, r2]], dtype=torch.float64)
        delta = torch.tensor([[d1, d2]], dtype=torch.float64)
        eta = torch.full((1, 2), (r1 + r2 > -1) * 0.5 + (d1 > 1) * 0.5, dtype=torch.float64)
        assert same_as_tensors(both, log_rho, delta, torch.tensor([1 + (d1 < d2)]), eta)


def test_calls_the_kernels_do_not_serve_go_to_torch(both) -> None:
    """float32 coins, strided inputs, block lengths past G and mismatched shapes are refused; the rule then gives
    its tensor path's verdict."""
    rule, kernel = both
    extra = (DELTA_MIN,) if rule == "token" else (KERNEL_CONSTANTS, DELTA_MIN)
    log_rho = torch.tensor([[-0.2, -0.4]], dtype=torch.float64)
    delta = torch.tensor([[0.6, 0.9]], dtype=torch.float64)
    eta = torch.tensor([[0.5, 0.5]], dtype=torch.float64)
    g = torch.tensor([2])
    assert kernel(log_rho, delta, g, eta, *extra)[0] is not None
    for args in [(log_rho, delta, g, eta.float()), (log_rho, delta, torch.tensor([3]), eta),
                 (log_rho, delta, g.int(), eta), (log_rho, delta[:, :1], g, eta),
                 (torch.tensor([[-0.2, 9, -0.4]], dtype=torch.float64)[:, ::2], delta, g, eta)]:
        assert kernel(*args, *extra)[0] is None
    verdict = getattr(rules, f"{rule}_verify")(log_rho, delta, g, eta.float())
    want = getattr(rules, f"_{rule}_verify_tensors")(log_rho, delta, g, eta.float())
    assert torch.equal(verdict.tau, want.tau) and torch.equal(verdict.log_alpha, want.log_alpha)


def test_kernels_that_differ_are_refused(kernel) -> None:
    """The checks compare every output bit for bit: an h off by one ulp (which would rarely change tau) fails the
    block kernel's, an expected advance off by one ulp the token kernel's."""
    def h_off_by_an_ulp(*args):
        tau, log_alpha, expected, h = kernel(*args)
        h[0, 0] = math.nextafter(h[0, 0].item(), -math.inf)
        return tau, log_alpha, expected, h

    token = found("token")

    def advance_off_by_an_ulp(*args):
        tau, log_alpha, expected = token(*args)
        expected[-1] = math.nextafter(expected[-1].item(), math.inf)
        return tau, log_alpha, expected

    assert rules._block_kernel_matches(kernel, 0) and rules._token_kernel_matches(token, 0)
    assert not rules._block_kernel_matches(h_off_by_an_ulp, 0)
    assert not rules._token_kernel_matches(advance_off_by_an_ulp, 0)


@pytest.mark.parametrize("method, drafter, batch", [("spec_block", "free", 1), ("spec_block", "frozen", 5),
                                                    ("spec_token", "free", 3)])
def test_diffusion_samples_are_the_same_with_and_without_the_kernels(kernel, monkeypatch, method: str, drafter: str,
                                                                     batch: int) -> None:
    """Verification through the loop (the built-in pair, K = 30, seed 5): images and statistics unchanged. The commit
    kernel, which makes the verdict's call itself, is off."""
    monkeypatch.setattr(cpu_commit, "ENABLED", False)
    digest = lambda: sample_digest(method, {"num_steps": 30, "drafter": drafter, "gamma": 5}, batch, 11)  # noqa: E731

    calls = []
    real = rules._kernel
    monkeypatch.setattr(rules, "_kernel", lambda log_rho, name: calls.append(name) or real(log_rho, name))
    with_kernels = digest()
    assert f"{method[5:]}_verdict" in calls
    monkeypatch.setattr(rules, "_kernel", lambda log_rho, name: None)
    assert digest() == with_kernels
