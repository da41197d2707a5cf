"""The one-step residual sampler psi_alpha (spec_diffusion.md section 4; tests T1-T4).

Seeds are fixed per test (torch.Generator). KS p-values fail below 1e-3 (about 20 p-values
in this file: Bonferroni-style, as the spec says); moments must agree within 4 standard errors.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from specray.methods.diffusion import residual
from specray.methods.diffusion.residual import (
    log_residual_mass,
    residual_cdf,
    residual_moments,
    sample_psi,
    sample_residual,
)

CASES = [(1.0, 0.05), (1.0, 0.5), (1.0, 3.0), (0.3, 0.5), (0.05, 1.0), (0.9, 2.0), (1e-3, 2.5)]
Z_REFERENCE = {(1.0, 0.05): 0.019945, (1.0, 0.5): 0.1974, (1.0, 3.0): 0.8664, (0.3, 0.5): 7.089e-4, (0.05, 1.0): 7.786e-5, (0.9, 2.0): 0.5992}
P_MIN = 1e-3


def f64(x) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.float64)


def psi_density(s: np.ndarray, alpha: float, delta: float) -> np.ndarray:
    return np.maximum(alpha * stats.norm.pdf(s) - stats.norm.pdf(s - delta), 0.0)


def uniforms(n: int, seed: int) -> torch.Tensor:
    return 1.0 - torch.rand(n, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))  # in (0, 1]


def brute_force_1d(alpha: float, delta: float, n: int, seed: int) -> np.ndarray:
    """Rejection from (alpha phi(s) - phi(s - delta))^+: propose N(0,1), accept w.p. (1 - e^{delta s - delta^2/2}/alpha)^+."""
    rng = np.random.default_rng(seed)
    out: list[np.ndarray] = []
    have = 0
    while have < n:
        s = rng.standard_normal(4_000_000)
        keep = rng.random(s.size) < np.maximum(1 - np.exp(delta * s - delta**2 / 2) / alpha, 0.0)
        out.append(s[keep])
        have += int(keep.sum())
    return np.concatenate(out)[:n]


@pytest.mark.parametrize("alpha,delta", CASES)
def test_mass_cdf_and_density(alpha: float, delta: float) -> None:
    """T1: Z matches quadrature and the spec's reference values; F is increasing and reaches 1 at c."""
    la = f64(math.log(alpha))
    c = delta / 2 + math.log(alpha) / delta
    Z = float(log_residual_mass(f64(delta), la).exp())
    quad, _ = integrate.quad(psi_density, -np.inf, c, args=(alpha, delta), epsabs=1e-14, epsrel=1e-10, limit=200)
    assert Z == pytest.approx(quad, rel=1e-6)
    if (alpha, delta) in Z_REFERENCE:
        assert Z == pytest.approx(Z_REFERENCE[(alpha, delta)], rel=2e-3)
    grid = f64(np.linspace(c - 12, c + 1, 2001))
    F = residual_cdf(grid, f64(delta), la)
    assert torch.all(torch.diff(F) >= -1e-12)
    assert float(residual_cdf(f64(c), f64(delta), la)) == pytest.approx(1.0, abs=1e-9)
    mass, _ = integrate.quad(lambda s: psi_density(np.array(s), alpha, delta) / Z, -np.inf, c, limit=200)
    assert mass == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("alpha,delta", CASES)
def test_1d_sampler_ks_and_moments(alpha: float, delta: float) -> None:
    """T2: 2e5 draws (seed 11) vs F_alpha (KS) and vs brute-force rejection (2-sample KS, 5e4 draws
    (1.5e4 for alpha <= 0.5), seed 12); sample mean and second moment within 4 s.e. of the closed forms."""
    n = 200_000
    la = f64(math.log(alpha))
    s = sample_psi(f64(delta), la, uniforms(n, 11)).numpy()
    assert np.all(s <= delta / 2 + math.log(alpha) / delta + 1e-12)
    p_cdf = stats.kstest(s, lambda v: residual_cdf(f64(v), f64(delta), la).numpy()).pvalue
    assert p_cdf > P_MIN, f"KS vs F_alpha p={p_cdf:.2e}"
    if alpha >= 0.05:  # brute force is hopeless for tiny Z (acceptance ~ Z)
        ref = brute_force_1d(alpha, delta, 50_000 if alpha > 0.5 else 15_000, 12)
        p_two = stats.ks_2samp(s, ref).pvalue
        assert p_two > P_MIN, f"2-sample KS vs rejection sampling p={p_two:.2e}"
    m1, m2 = (float(v) for v in residual_moments(f64(delta), la))
    se1 = math.sqrt((m2 - m1**2) / n)
    se2 = float(np.std(s**2)) / math.sqrt(n)
    assert abs(s.mean() - m1) < 4 * se1
    assert abs((s**2).mean() - m2) < 4 * se2


def test_small_delta_limit_oracle() -> None:
    """T3a: alpha = 1, delta -> 0: s = -sqrt(-2 ln u) (Rayleigh); moments -> -sqrt(pi/2), 2."""
    s = sample_psi(f64(1e-9), f64(0.0), f64(0.3))
    assert float(s) == pytest.approx(-math.sqrt(-2 * math.log(0.3)), abs=1e-3)
    u = uniforms(100_000, 13)
    s = sample_psi(f64(1e-6), f64(0.0), u)
    oracle = -torch.sqrt(-2 * torch.log(u))
    assert torch.max(torch.abs(s - oracle)) < 1e-3
    m1, m2 = (float(v) for v in residual_moments(f64(1e-6), f64(0.0)))
    assert m1 == pytest.approx(-math.sqrt(math.pi / 2), abs=1e-4)
    assert m2 == pytest.approx(2.0, abs=1e-4)
    # the sampled law converges to the oracle: KS of delta = 1e-4 samples against Rayleigh
    s = sample_psi(f64(1e-4), f64(0.0), uniforms(100_000, 14)).numpy()
    assert stats.kstest(-s, stats.rayleigh.cdf).pvalue > P_MIN


@pytest.mark.parametrize("alpha", [1e-30, 1e-8, 1.0])
@pytest.mark.parametrize("delta", [1e-9, 1e-4, 1e-3, 40.0])
def test_extremes_are_finite(alpha: float, delta: float) -> None:
    """T3b/c: finite output, and s <= c_alpha, for extreme (alpha, delta) and u in {1e-300, 0.5, 1}."""
    la = f64(math.log(alpha))
    s = sample_psi(f64(delta), la, f64([1e-300, 1e-12, 0.5, 1.0]))
    assert torch.all(torch.isfinite(s))
    c = delta / 2 + math.log(alpha) / delta
    assert torch.all(s <= c + 1e-9 * max(1.0, abs(c)))
    assert torch.isfinite(log_residual_mass(f64(delta), la))


def brute_force_nd(m_q, m_p, sigma, alpha, n, seed) -> torch.Tensor:
    """Rejection in R^d: propose from q, accept w.p. (1 - p/(alpha q))^+."""
    gen = torch.Generator().manual_seed(seed)
    d = m_q.numel()
    out, have = [], 0
    while have < n:
        y = m_q + sigma * torch.randn(400_000, d, dtype=torch.float64, generator=gen)
        log_p_over_q = (-((y - m_p) ** 2).sum(1) + ((y - m_q) ** 2).sum(1)) / (2 * sigma**2)
        keep = torch.rand(y.shape[0], dtype=torch.float64, generator=gen) < torch.clamp(1 - torch.exp(log_p_over_q) / alpha, min=0)
        out.append(y[keep])
        have += int(keep.sum())
    return torch.cat(out)[:n]


@pytest.mark.parametrize("alpha", [1.0, 0.4])
@pytest.mark.parametrize("target_delta", [0.7, 1.0])
def test_16d_residual_against_rejection(alpha: float, target_delta: float) -> None:
    """T4: d = 16, 1e5 draws (seed 21) vs 4e4 brute-force rejection draws (seed 22):
    KS of s against each other and against F_alpha; z_perp mean 0 and covariance I - e e^T
    (max abs error < 0.02); |z_perp| ~ chi_15 (KS); corr(s, |z_perp|) ~ 0 (|r| < 4/sqrt(n))."""
    d, n, sigma = 16, 100_000, 0.8
    gen = torch.Generator().manual_seed(20)
    m_q = torch.randn(d, dtype=torch.float64, generator=gen)
    direction = torch.randn(d, dtype=torch.float64, generator=gen)
    Delta = target_delta * direction / direction.norm()
    m_p = m_q + sigma * Delta
    zeta = torch.randn(n, d, dtype=torch.float64, generator=torch.Generator().manual_seed(21))
    y = sample_residual(m_q.expand(n, d), Delta.expand(n, d), torch.full((n,), sigma, dtype=torch.float64),
                        torch.full((n,), math.log(alpha), dtype=torch.float64), uniforms(n, 23), zeta)
    ref = brute_force_nd(m_q, m_p, sigma, alpha, 40_000, 22)
    e = Delta / Delta.norm()
    z, z_ref = (y - m_q) / sigma, (ref - m_q) / sigma
    s, s_ref = z @ e, z_ref @ e
    la = f64(math.log(alpha))
    assert stats.ks_2samp(s.numpy(), s_ref.numpy()).pvalue > P_MIN
    assert stats.kstest(s.numpy(), lambda v: residual_cdf(f64(v), f64(target_delta), la).numpy()).pvalue > P_MIN
    z_perp = z - s[:, None] * e
    assert torch.max(torch.abs(z_perp.mean(0))) < 0.02
    cov = torch.cov(z_perp.T)
    assert torch.max(torch.abs(cov - (torch.eye(d, dtype=torch.float64) - torch.outer(e, e)))) < 0.02
    norms = z_perp.norm(dim=1).numpy()
    assert stats.kstest(norms, stats.chi(d - 1).cdf).pvalue > P_MIN
    r = np.corrcoef(s.numpy(), norms)[0, 1]
    assert abs(r) < 4 / math.sqrt(n)
    # the same checks against the brute-force draws' orthogonal part (sanity of the reference)
    assert stats.ks_2samp(norms, (z_ref - s_ref[:, None] * e).norm(dim=1).numpy()).pvalue > P_MIN


def test_newton_matches_bisection() -> None:
    """The default safeguarded Newton solver finds the same root as 60-step bisection
    (2e4 random (alpha, delta, u), seed 31, log-normal spreads over many decades; u < 1 - 1e-9)."""
    gen = torch.Generator().manual_seed(31)
    n = 20_000
    delta = torch.exp(2 * torch.randn(n, dtype=torch.float64, generator=gen))
    log_alpha = -torch.exp(2 * torch.randn(n, dtype=torch.float64, generator=gen))
    log_alpha[: n // 10] = 0.0
    u = (1 - torch.rand(n, dtype=torch.float64, generator=gen)).clamp(max=1 - 1e-9)
    newton, bisection = sample_psi(delta, log_alpha, u), sample_psi(delta, log_alpha, u, method="bisection")
    assert torch.all(torch.isfinite(newton))
    assert torch.max(torch.abs(newton - bisection) / (1 + bisection.abs())) < 1e-8


def random_draws(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(delta, log_alpha, u)``: delta and -log alpha log-normal over many decades, alpha = 1 for a tenth, u = 1
    for 25 and u = e^(-700 U) for 50 (the far tails, a < -600, the bisection fallback)."""
    gen = torch.Generator().manual_seed(seed)
    delta = torch.exp(3 * torch.randn(n, dtype=torch.float64, generator=gen))
    log_alpha = -torch.exp(3 * torch.randn(n, dtype=torch.float64, generator=gen))
    log_alpha[: n // 10] = 0.0
    u = 1 - torch.rand(n, dtype=torch.float64, generator=gen)
    u[n // 10 : n // 10 + 25] = 1.0
    u[n // 10 + 25 : n // 10 + 75] = torch.exp(-700 * torch.rand(50, dtype=torch.float64, generator=gen))
    return delta, log_alpha, u


@pytest.fixture
def python_path(monkeypatch):
    """The one-row path on Python floats, not the C++ draws a process that loaded specray's kernels takes
    (tests/test_residual_draw_kernel.py)."""
    monkeypatch.setattr(residual, "_draws_kernel", lambda delta: None)


def test_one_row_on_the_host_gives_the_tensor_paths_bits(monkeypatch, python_path) -> None:
    """A one-row draw (``ONE_ROW_ON_HOST``: the Newton solve on Python floats, the transcendentals by torch
    on one element) against the same draw on 1-element tensors, bit for bit: 1,500 random (alpha, delta, u)
    (seed 41; delta and -log alpha log-normal over many decades, alpha = 1 for a tenth, u = 1 for 25 and
    u = e^(-700 U) for 50). The draw reaches the far-tail branches (c < -30), the lower bracket end below
    a = -600, the bisection fallback and the loop's three exits (a fixed point, a period of 2, all 16 steps)."""
    n = 1500
    delta, log_alpha, u = random_draws(n, 41)
    rows = [(delta[i : i + 1], log_alpha[i : i + 1], u[i : i + 1]) for i in range(n)]
    on_host = torch.cat([sample_psi(*row) for row in rows])
    monkeypatch.setattr(residual, "ONE_ROW_ON_HOST", False)
    on_tensors = torch.cat([sample_psi(*row) for row in rows])
    assert torch.isfinite(on_tensors).all()
    assert torch.equal(on_host.view(torch.int64), on_tensors.view(torch.int64))
    c = delta / 2 + log_alpha / delta
    a = [math.log(u[i].item()) + residual._log_G_at_one(c[i].item(), 0.0, delta[i].item(), log_alpha[i].item())
         - log_alpha[i].item() for i in range(n)]
    assert int((c < -30).sum()) > 100 and sum(x < -600 for x in a) > 20


def test_one_row_on_the_host_is_taken_only_for_one_cpu_row(monkeypatch, python_path) -> None:
    calls = []
    real = residual._sample_psi_one_row
    monkeypatch.setattr(residual, "_sample_psi_one_row", lambda *args: calls.append(args) or real(*args))
    one = sample_psi(f64([0.7]), f64([-0.2]), f64([0.4]))
    assert one.shape == (1,) and one.dtype == torch.float64 and len(calls) == 1
    assert sample_psi(f64(0.7), f64(-0.2), f64(0.4)).shape == () and len(calls) == 2
    sample_psi(f64([0.7, 0.8]), f64(-0.2), f64(0.4))
    sample_psi(f64([0.7]), f64([-0.2]), f64([0.4]), method="bisection")
    assert len(calls) == 2


def test_one_row_on_the_host_in_a_new_thread_inside_and_outside_inference_mode(python_path) -> None:
    """The host path's scratch tensor is per thread and made outside inference mode, so a thread whose
    first draw runs inside ``torch.inference_mode`` can draw outside it later."""
    import threading

    results = []

    def draws() -> None:
        with torch.inference_mode():
            results.append(sample_psi(f64([0.7]), f64([-0.2]), f64([0.4])))
        results.append(sample_psi(f64([0.7]), f64([-0.2]), f64([0.4])))

    thread = threading.Thread(target=draws)
    thread.start()
    thread.join()
    assert len(results) == 2 and torch.equal(results[0], results[1])


def test_one_row_on_the_host_at_the_edges(monkeypatch, python_path) -> None:
    """Zero, subnormal, huge, infinite and NaN inputs (336 combinations of delta, log alpha and u, in and
    out of the sampler's domain): the host path gives the tensor path's bits, and never raises where it
    does not (delta = 0 takes the tensor path: Python's division by zero would raise)."""
    deltas = [0.0, 1e-300, 1e-12, 0.5, 40.0, 1e300, math.inf, math.nan]
    log_alphas = [0.0, -1e-300, -0.3, -50.0, -1e300, -math.inf, math.nan]
    us = [0.0, 1e-320, 1e-300, 0.3, 1.0, math.nan]
    cases = [(f64([d]), f64([a]), f64([u])) for d in deltas for a in log_alphas for u in us]
    on_host = torch.cat([sample_psi(*case) for case in cases])
    monkeypatch.setattr(residual, "ONE_ROW_ON_HOST", False)
    on_tensors = torch.cat([sample_psi(*case) for case in cases])
    assert torch.equal(on_host.view(torch.int64), on_tensors.view(torch.int64))
