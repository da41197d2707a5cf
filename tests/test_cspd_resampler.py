"""CSpD ratio arithmetic and residual sampler (spec cspd.md §8, T1-T5).

Conventions (spec §8): float64; one-sample KS at level 1e-3 passes when
D ≤ 1.95/√N; means/rates within 4 standard errors. Reference CDFs are computed
by quadrature on a fine grid (2·10^5 points in 1-D, 1200² in 2-D), accurate to
~1e-7, far below the KS tolerances. Statistical draws use a seeded
torch.Generator (the keyed specray.rng path is tested separately at smaller N
because hashing 10^6 keys is slow on CPU).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from specray.methods.continuous.rules import (
    FIRST_BLOCK,
    KeyedDraws,
    accept,
    keyed_draws,
    log_acceptance_ratio,
    residual_keep_probability,
    residual_sample,
    verify_tokens,
)

KS_C = 1.95  # KS critical constant at level 1e-3


# -- helpers -----------------------------------------------------------------------------------
def generator_draws(seed: int, n: int, d: int):
    gen = torch.Generator().manual_seed(seed)

    def draw(attempt: int, active: torch.Tensor):
        k = active.shape[0]
        return torch.randn(k, d, generator=gen, dtype=torch.float64), torch.rand(k, generator=gen, dtype=torch.float64)

    return draw


def gauss(mu, s, n: int):
    mu = torch.as_tensor(mu, dtype=torch.float64).reshape(1, -1).expand(n, -1)
    s = torch.as_tensor(s, dtype=torch.float64).reshape(1, -1).expand(n, -1)
    return mu, s


def npdf(x, mu, s):
    return stats.norm.pdf(x, mu, s)


GRID = np.linspace(-14.0, 14.0, 200_001)


def cdf_from_density(density: np.ndarray) -> np.ndarray:
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (density[1:] + density[:-1]) * np.diff(GRID))])
    return cum / cum[-1]


def ks_against(samples: np.ndarray, ref_cdf: np.ndarray) -> float:
    x = np.sort(samples)
    f = np.interp(x, GRID, ref_cdf)
    n = len(x)
    return float(max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n)))


def residual_density_1d(p, q, log_c: float = 0.0) -> np.ndarray:
    return np.maximum(0.0, math.exp(log_c) * npdf(GRID, *p) - npdf(GRID, *q))


def run_residual_1d(p, q, n: int, seed: int, log_c: float = 0.0, max_tries=None):
    pm, ps = gauss([p[0]], [p[1]], n)
    qm, qs = gauss([q[0]], [q[1]], n)
    return residual_sample(pm, ps, qm, qs, torch.full((n,), log_c, dtype=torch.float64), generator_draws(seed, n, 1), max_tries)


# -- T1: log-ratio arithmetic ------------------------------------------------------------------
@pytest.mark.parametrize("d", [1, 2, 16])
@pytest.mark.parametrize("orientation", ["paper", "code", "none"])
@pytest.mark.parametrize("kappa", [1.0, 42.0])
def test_t1_log_ratio_matches_brute_force_product(d: int, orientation: str, kappa: float) -> None:
    g = np.random.default_rng(d * 7 + int(kappa))
    n_steps = 100
    p_sig = np.exp(g.normal(0, 0.003, (n_steps, d)))  # products stay representable in float64
    q_sig = np.exp(g.normal(0, 0.003, (n_steps, d)))
    pm, qm = g.normal(0, 0.3, d), g.normal(0, 0.3, d)
    ps, qs = np.exp(g.normal(-0.5, 0.2, d)), np.exp(g.normal(-0.5, 0.2, d))
    x0 = qm + qs * g.normal(0, 1, d)
    factor = {"paper": np.prod(q_sig / p_sig), "code": np.prod(p_sig / q_sig), "none": 1.0}[orientation]
    # explicit densities with κ in the exponent only (normalisers untouched)
    p_dens = np.prod(np.exp(-0.5 * ((x0 - pm) / (kappa * ps)) ** 2) / (ps * math.sqrt(2 * math.pi)))
    q_dens = np.prod(np.exp(-0.5 * ((x0 - qm) / (kappa * qs)) ** 2) / (qs * math.sqrt(2 * math.pi)))
    brute = math.log(factor * p_dens / q_dens)
    t = lambda a: torch.tensor(a, dtype=torch.float64).unsqueeze(0)  # noqa: E731
    got = log_acceptance_ratio(
        t(x0), t(pm), t(ps), torch.tensor([np.log(p_sig).sum()]), t(qm), t(qs), torch.tensor([np.log(q_sig).sum()]),
        orientation, kappa,
    )
    assert abs(float(got.log_ratio[0]) - brute) <= 1e-9 * max(1.0, abs(brute))
    assert abs(float(got.log_factor[0] + got.final_term[0]) - brute) <= 1e-9 * max(1.0, abs(brute))


def test_t1_sign_rule_paper_mode_larger_draft_sigmas_raise_log_r() -> None:
    x0 = torch.zeros(1, 16, dtype=torch.float64)
    base = dict(x0=x0, p_mu1=x0, p_s1=torch.ones_like(x0), q_mu1=x0, q_s1=torch.ones_like(x0))
    low = log_acceptance_ratio(**base, p_slog=torch.tensor([-10.0]), q_slog=torch.tensor([-10.0]), sigma_orientation="paper")
    high = log_acceptance_ratio(**base, p_slog=torch.tensor([-10.0]), q_slog=torch.tensor([-8.0]), sigma_orientation="paper")
    code = log_acceptance_ratio(**base, p_slog=torch.tensor([-10.0]), q_slog=torch.tensor([-8.0]), sigma_orientation="code")
    assert float(high.log_ratio) > float(low.log_ratio)
    assert float(code.log_ratio) < float(low.log_ratio)


def test_t1_tiny_sigmas_and_big_gaps_stay_finite() -> None:
    g = torch.Generator().manual_seed(0)
    x0 = torch.randn(1000, 16, generator=g) * 3  # mean gaps up to ~3 (spec T10)
    s = torch.full_like(x0, 6e-3)
    r = log_acceptance_ratio(x0.float(), torch.zeros_like(x0).float(), s.float(), torch.full((1000,), -800.0),
                             x0.float(), s.float(), torch.full((1000,), -790.0), "paper", 1.0)
    assert torch.isfinite(r.log_ratio).all() and r.log_ratio.dtype == torch.float64
    keep = residual_keep_probability(x0, torch.zeros_like(x0), s, x0, s, r.log_factor)
    assert torch.isfinite(keep).all()


def test_unknown_orientation_is_rejected_with_allowed_values() -> None:
    z = torch.zeros(1, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match="paper"):
        log_acceptance_ratio(z, z, z + 1, torch.zeros(1), z, z + 1, torch.zeros(1), "sideways", 1.0)


# -- T2: residual sampler, 1-D ------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("q", [(0.7, 0.8), (2.5, 0.5)])
def test_t2_residual_1d_matches_normalised_positive_part(seed: int, q) -> None:
    n = 1_000_000  # N_s; KS tolerance 1.95/sqrt(N_s) = 0.00195
    p = (0.0, 1.0)
    res = run_residual_1d(p, q, n, seed)
    x = res.x[:, 0].numpy()
    dens = residual_density_1d(p, q)
    ref = cdf_from_density(dens)
    assert ks_against(x, ref) <= KS_C / math.sqrt(n)
    z = np.trapezoid(dens, GRID)
    mean = np.trapezoid(GRID * dens, GRID) / z
    var = np.trapezoid((GRID - mean) ** 2 * dens, GRID) / z
    assert abs(x.mean() - mean) <= 4 * math.sqrt(var / n)
    assert abs(x.var() - var) <= 4 * math.sqrt(2 * var**2 / n) * 1.5  # 1.5: non-Gaussian kurtosis margin
    tries = res.tries.double()
    assert abs(float(tries.mean()) - 1 / z) <= 4 * math.sqrt((1 - z) / z**2 / n)
    assert int(res.cap_hit.sum()) == 0  # max_tries = None: no fallbacks


def test_t2_tiny_z_cap_binds_and_is_reported() -> None:
    p, q = (0.0, 1.0), (0.05, 1.0)
    z = float(np.trapezoid(residual_density_1d(p, q), GRID))  # ≈ 0.02
    n = 20_000
    capped = run_residual_1d(p, q, n, seed=3, max_tries=100)
    hits = int(capped.cap_hit.sum())
    expected = (1 - z) ** 100
    assert abs(hits / n - expected) <= 4 * math.sqrt(expected * (1 - expected) / n)
    assert hits > 0
    # fallbacks are the target mean, never a zero vector in disguise: here μ^p = 0, so check tries instead
    assert torch.all(capped.tries[capped.cap_hit] == 100)
    free = run_residual_1d(p, q, n, seed=4, max_tries=None)
    assert int(free.cap_hit.sum()) == 0
    assert ks_against(free.x[:, 0].numpy(), cdf_from_density(residual_density_1d(p, q))) <= KS_C / math.sqrt(n)


def test_t2_cap_fallback_is_target_mean_not_zero() -> None:
    n = 50
    pm, ps = gauss([1.5], [1.0], n)
    res = residual_sample(pm, ps, pm.clone(), ps.clone(), torch.zeros(n, dtype=torch.float64),
                          generator_draws(0, n, 1), max_tries=5)  # identical P, Q: residual mass 0
    assert bool(res.cap_hit.all())
    assert torch.equal(res.x, pm)


def test_keyed_draws_are_batch_independent() -> None:
    n = 2000
    pm, ps = gauss([0.0], [1.0], n)
    qm, qs = gauss([0.7], [0.8], n)
    sids, pos = torch.arange(n), torch.arange(n) % 16
    full = residual_sample(pm, ps, qm, qs, torch.zeros(n, dtype=torch.float64), keyed_draws(5, sids, pos, 1))
    half = residual_sample(pm[1::2], ps[1::2], qm[1::2], qs[1::2], torch.zeros(n // 2, dtype=torch.float64),
                           keyed_draws(5, sids[1::2], pos[1::2], 1))
    assert torch.equal(full.x[1::2], half.x)
    assert torch.equal(full.tries[1::2], half.tries)
    dens = residual_density_1d((0.0, 1.0), (0.7, 0.8))
    assert ks_against(full.x[:, 0].numpy(), cdf_from_density(dens)) <= KS_C / math.sqrt(n)


@pytest.mark.parametrize("max_tries", [1, 3, 100, None])
def test_keyed_draws_in_blocks_equal_one_try_at_a_time(max_tries) -> None:
    """Keyed draws are sampled a block of tries per pass; a plain DrawFn over the same keys takes one try
    per pass: the same tokens, tries and cap hits, bit for bit (close P and Q: many tries, some caps)."""
    n, d = 300, 4
    gen = torch.Generator().manual_seed(3)
    pm, ps = torch.randn(n, d, generator=gen, dtype=torch.float64), 0.1 + torch.rand(n, d, generator=gen, dtype=torch.float64)
    qm, qs = pm + 0.02 * torch.randn(n, d, generator=gen, dtype=torch.float64), ps * 1.01
    log_c = 0.01 * torch.randn(n, generator=gen, dtype=torch.float64)
    sids, pos = torch.arange(n) // 16, torch.arange(n) % 16
    keyed = keyed_draws(9, sids, pos, d)
    blocks = residual_sample(pm, ps, qm, qs, log_c, keyed, max_tries)
    one_by_one = residual_sample(pm, ps, qm, qs, log_c, lambda attempt, active: keyed(attempt, active), max_tries)
    normals, uniforms = KeyedDraws.ahead(9, sids, pos[:, None], d, FIRST_BLOCK)  # the loop's first tries, drawn ahead
    ahead = residual_sample(pm, ps, qm, qs, log_c, KeyedDraws(9, sids, pos, d, first_tries=(normals[:, 0], uniforms[:, 0])),
                            max_tries)
    assert bool(blocks.cap_hit.any()) if max_tries in (1, 3) else int(blocks.tries.max()) > 8  # caps; several blocks
    for field in ("x", "tries", "cap_hit"):
        assert torch.equal(getattr(blocks, field), getattr(one_by_one, field)), field
        assert torch.equal(getattr(ahead, field), getattr(one_by_one, field)), field


# -- T3: residual sampler, 2-D -------------------------------------------------------------------
P2 = ((0.0, 0.0), (1.0, 0.5))
Q2 = ((0.5, -0.3), (0.7, 0.6))


def residual_marginal_cdfs_2d(log_c: float = 0.0):
    xs = np.linspace(-9, 9, 1201)
    ys = np.linspace(-9, 9, 1201)
    X, Y = np.meshgrid(xs, ys, indexing="ij")
    p = npdf(X, P2[0][0], P2[1][0]) * npdf(Y, P2[0][1], P2[1][1])
    q = npdf(X, Q2[0][0], Q2[1][0]) * npdf(Y, Q2[0][1], Q2[1][1])
    r = np.maximum(0.0, math.exp(log_c) * p - q)
    mx, my = np.trapezoid(r, ys, axis=1), np.trapezoid(r, xs, axis=0)

    def cdf(grid, dens):
        c = np.concatenate([[0.0], np.cumsum(0.5 * (dens[1:] + dens[:-1]) * np.diff(grid))])
        return grid, c / c[-1]

    return cdf(xs, mx), cdf(ys, my)


def ks_grid(samples, grid_cdf) -> float:
    grid, cdf = grid_cdf
    x = np.sort(samples)
    f = np.interp(x, grid, cdf)
    n = len(x)
    return float(max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n)))


def energy_test_pvalue(a: np.ndarray, b: np.ndarray, permutations: int, seed: int) -> float:
    from scipy.spatial.distance import cdist

    z = np.concatenate([a, b])
    d = cdist(z, z)
    n = len(a)

    def stat(idx):
        i, j = idx[:n], idx[n:]
        return 2 * d[np.ix_(i, j)].mean() - d[np.ix_(i, i)].mean() - d[np.ix_(j, j)].mean()

    g = np.random.default_rng(seed)
    observed = stat(np.arange(2 * n))
    count = sum(stat(g.permutation(2 * n)) >= observed for _ in range(permutations))
    return (count + 1) / (permutations + 1)


def importance_reference_2d(n: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = g.normal(P2[0], P2[1], size=(1_000_000, 2))
    p = npdf(x[:, 0], P2[0][0], P2[1][0]) * npdf(x[:, 1], P2[0][1], P2[1][1])
    q = npdf(x[:, 0], Q2[0][0], Q2[1][0]) * npdf(x[:, 1], Q2[0][1], Q2[1][1])
    w = np.maximum(0.0, 1 - q / p)
    return x[g.choice(len(x), size=n, p=w / w.sum())]


def test_t3_residual_2d_diagonal() -> None:
    n = 400_000  # N_s; marginal KS tolerance 1.95/sqrt(N_s)
    pm, ps = gauss(P2[0], P2[1], n)
    qm, qs = gauss(Q2[0], Q2[1], n)
    res = residual_sample(pm, ps, qm, qs, torch.zeros(n, dtype=torch.float64), generator_draws(11, n, 2), None)
    x = res.x.numpy()
    cx, cy = residual_marginal_cdfs_2d()
    assert ks_grid(x[:, 0], cx) <= KS_C / math.sqrt(n)
    assert ks_grid(x[:, 1], cy) <= KS_C / math.sqrt(n)
    # joint law: energy-distance permutation test against an importance-resampled reference
    m = 500  # energy test sample per side (O(m²) per permutation)
    pval = energy_test_pvalue(x[:m], importance_reference_2d(m, 12), permutations=200, seed=13)
    assert pval > 1e-3


# -- T4/T5: one speculative step ------------------------------------------------------------------
def one_step_1d(p, q, n: int, seed: int, orientation: str, log_c: float, kappa: float, flip: bool = False):
    """Draft x ~ Q, accept with the CSpD ratio, resample rejected tokens; returns (tokens, accepted)."""
    g = torch.Generator().manual_seed(seed)
    pm, ps = gauss([p[0]], [p[1]], n)
    qm, qs = gauss([q[0]], [q[1]], n)
    x0 = qm + qs * torch.randn(n, 1, generator=g, dtype=torch.float64)
    # log C enters through the per-step σ sums: paper uses q−p, code p−q
    p_slog = torch.zeros(n, dtype=torch.float64)
    q_slog = torch.full((n,), log_c if orientation == "paper" else -log_c, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    if flip:  # deliberately wrong rule: ratio q/p instead of p/q
        pm, ps, qm, qs = qm, qs, pm, ps
    out = verify_tokens(x0, pm, ps, p_slog, qm, qs, q_slog, u, generator_draws(seed + 1, n, 1), orientation, kappa, None)
    return out


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow),
                                  pytest.param(3, marks=pytest.mark.slow)])
@pytest.mark.parametrize("q", [(0.7, 0.8), (2.5, 0.5)])
def test_t4_exact_step_reproduces_target_1d(seed: int, q) -> None:
    n = 1_000_000
    p = (0.0, 1.0)
    out = one_step_1d(p, q, n, seed, "none", 0.0, 1.0)
    x = np.sort(out.tokens[:, 0].numpy())
    assert stats.kstest(x, "norm").statistic <= KS_C / math.sqrt(n)
    tv = float(np.trapezoid(residual_density_1d(p, q), GRID))
    rate = float(out.accepted.double().mean())
    assert abs(rate - (1 - tv)) <= 4 * math.sqrt(tv * (1 - tv) / n)
    assert int(out.residual.cap_hit.sum()) == 0


def test_t4_exact_step_reproduces_target_2d() -> None:
    n = 400_000
    g = torch.Generator().manual_seed(21)
    pm, ps = gauss(P2[0], P2[1], n)
    qm, qs = gauss(Q2[0], Q2[1], n)
    x0 = qm + qs * torch.randn(n, 2, generator=g, dtype=torch.float64)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    zero = torch.zeros(n, dtype=torch.float64)
    out = verify_tokens(x0, pm, ps, zero, qm, qs, zero, u, generator_draws(22, n, 2), "none", 1.0, 100)
    y = out.tokens.numpy()
    assert stats.kstest(y[:, 0], "norm", args=(0.0, 1.0)).statistic <= KS_C / math.sqrt(n)
    assert stats.kstest(y[:, 1], "norm", args=(0.0, 0.5)).statistic <= KS_C / math.sqrt(n)
    assert abs(np.corrcoef(y[:, 0], y[:, 1])[0, 1]) <= 4 / math.sqrt(n)
    # accept rate vs E_P[min(1, Q/P)] by independent Monte Carlo (2·10^6 draws)
    h = np.random.default_rng(23).normal(P2[0], P2[1], size=(2_000_000, 2))
    ratio = (npdf(h[:, 0], 0.5, 0.7) * npdf(h[:, 1], -0.3, 0.6)) / (npdf(h[:, 0], 0, 1) * npdf(h[:, 1], 0, 0.5))
    overlap = np.minimum(1, ratio)
    a = float(out.accepted.double().mean())
    se = math.sqrt(a * (1 - a) / n + overlap.var() / len(overlap))
    assert abs(a - overlap.mean()) <= 4 * se
    assert int(out.residual.cap_hit.sum()) == 0


def test_t4_negative_control_wrong_ratio_fails() -> None:
    n = 1_000_000
    out = one_step_1d((0.0, 1.0), (0.7, 0.8), n, 5, "none", 0.0, 1.0, flip=True)
    d = stats.kstest(out.tokens[:, 0].numpy(), "norm").statistic
    assert d > 5 * KS_C / math.sqrt(n)


@pytest.mark.parametrize("log_sigma", [0.5, -0.5])
def test_t5_paper_mode_is_biased_and_matches_its_formula(log_sigma: float) -> None:
    n = 1_000_000
    p, q = (0.0, 1.0), (0.7, 0.8)
    out = one_step_1d(p, q, n, 31, "paper", log_sigma, 1.0)
    sp, qd = math.exp(log_sigma) * npdf(GRID, *p), npdf(GRID, *q)
    m = np.trapezoid(np.minimum(sp, qd), GRID)
    ref_density = np.minimum(sp, qd) + (1 - m) / (math.exp(log_sigma) - m) * np.maximum(0.0, sp - qd)
    x = out.tokens[:, 0].numpy()
    assert ks_against(x, cdf_from_density(ref_density)) <= KS_C / math.sqrt(n)
    assert stats.kstest(x, "norm").statistic > 5 * KS_C / math.sqrt(n)


def test_t5_code_mode_is_biased_and_matches_its_formula() -> None:
    n = 1_000_000
    p, q, kappa, log_f = (0.0, 1.0), (0.7, 0.8), 42.0, 0.3
    out = one_step_1d(p, q, n, 41, "code", log_f, kappa)
    pd, qd = npdf(GRID, *p), npdf(GRID, *q)
    # r_code = F · p̃/q̃ with κ in the exponents; residual ∝ max(0, P − Q/F) without κ
    log_rc = (log_f - math.log(p[1]) - 0.5 * ((GRID - p[0]) / (kappa * p[1])) ** 2
              + math.log(q[1]) + 0.5 * ((GRID - q[0]) / (kappa * q[1])) ** 2)
    acc_density = qd * np.minimum(1.0, np.exp(log_rc))
    a = np.trapezoid(acc_density, GRID)
    resid = np.maximum(0.0, pd - qd / math.exp(log_f))
    ref_density = acc_density + (1 - a) * resid / np.trapezoid(resid, GRID)
    x = out.tokens[:, 0].numpy()
    assert ks_against(x, cdf_from_density(ref_density)) <= KS_C / math.sqrt(n)
    assert stats.kstest(x, "norm").statistic > 5 * KS_C / math.sqrt(n)
    assert abs(float(out.accepted.double().mean()) - a) <= 4 * math.sqrt(a * (1 - a) / n)


def test_accept_rule_is_log_u_below_log_r() -> None:
    lr = torch.tensor([0.0, -1.0, -1.0, 5.0], dtype=torch.float64)
    u = torch.tensor([0.999, math.exp(-1.0) - 1e-9, math.exp(-1.0) + 1e-9, 0.5], dtype=torch.float64)
    assert accept(lr, u).tolist() == [True, True, False, True]
