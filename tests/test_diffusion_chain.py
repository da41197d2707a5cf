"""Exactness of speculative sampling on a 2-D linear-Gaussian chain with a known law
(spec_diffusion.md tests T5, T6, T8, T9, T11, T13), run through the production loop
``speculative_chain``.

Chain (d = 2, K = 12, sigma = 0.5): ``x_{k+1} = 0.6 x + 0.6 eps(x, k) + 0.5 xi`` with target
``eps(x, k) = 0.5 x + 0.3 sin k``, i.e. ``x_{k+1} = 0.9 x + 0.18 sin k + 0.5 xi``; x_0 ~ N(0, I).
x_K is N(mu_K, v_K I) in closed form. The independent draft adds ``tanh(3x)`` to eps (a
mean error of 0.6 tanh(3x), the spec's T9 control chain); Frozen and Free drafters reuse a
stale target eps.

Statistics: N = 40 000 chains (x_0 seed 0, loop seed 1). Five p-values per run (KS of the two
whitened coordinates and two diagonal projections against N(0,1), chi^2_2 of the squared norm);
an exact rule must have every p > 1e-3, and mean/variance within 4.5 s.e. A negative control
must be rejected: min p < 1e-4 or a variance off by > 6 s.e.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from specray.methods.diffusion.loop import GaussianChain, ancestral_chain, speculative_chain
from specray.methods.diffusion.rules import block_verify, token_verify

K, D, SIGMA, N = 12, 2, 0.5, 40_000
P_MIN = 1e-3


def target_eps(x: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return 0.5 * x + 0.3 * torch.sin(k.to(x.dtype))[:, None]


def draft_eps(x: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    return target_eps(x, k, rows) + torch.tanh(3 * x)


def make_chain() -> GaussianChain:
    full = lambda v: torch.full((K,), v, dtype=torch.float64)  # noqa: E731
    return GaussianChain(A=full(0.6), B=full(0.6), sigma=full(SIGMA), target_eps=target_eps, draft_eps=draft_eps)


def known_law() -> tuple[float, float]:
    mu, var = 0.0, 1.0
    for k in range(K):
        mu, var = 0.9 * mu + 0.18 * math.sin(k), 0.81 * var + SIGMA**2
    return mu, var


def start_states(n: int = N) -> tuple[torch.Tensor, torch.Tensor]:
    x0 = torch.randn(n, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    return x0, torch.arange(n)


def law_check(x: torch.Tensor) -> tuple[float, float]:
    """(min KS p-value, max |z| of the per-coordinate mean and variance)."""
    mu, var = known_law()
    z = (x - mu) / math.sqrt(var)
    projections = [z[:, 0], z[:, 1], (z[:, 0] + z[:, 1]) / math.sqrt(2), (z[:, 0] - z[:, 1]) / math.sqrt(2)]
    ps = [stats.kstest(p.numpy(), "norm").pvalue for p in projections]
    ps.append(stats.kstest((z**2).sum(1).numpy(), stats.chi2(D).cdf).pvalue)
    n = x.shape[0]
    z_mean = (z.mean(0).abs() * math.sqrt(n)).max().item()
    z_var = ((z.var(0) - 1).abs() / math.sqrt(2 / n)).max().item()
    return min(ps), max(z_mean, z_var)


EXACT = [
    ("model", "token", "reflection", 4),
    ("model", "token", "residual", 4),
    ("model", "block", "residual", 4),
    ("model", "block", "residual", 7),
    ("free", "block", "residual", 7),
    ("free", "token", "reflection", 7),
    ("frozen", "block", "residual", 2),
    ("frozen", "token", "residual", 3),
    ("free", "token", "residual", 5),
]


@pytest.mark.parametrize("drafter,verification,rejection,gamma", EXACT)
def test_speculative_chain_reproduces_target_law(drafter: str, verification: str, rejection: str, gamma: int) -> None:
    x0, ids = start_states()
    x, st = speculative_chain(make_chain(), x0, ids, seed=1, drafter=drafter, verification=verification, rejection=rejection, gamma=gamma)
    p_min, z_max = law_check(x)
    assert p_min > P_MIN, f"min KS p = {p_min:.2e}"
    assert z_max < 4.5, f"moment z = {z_max:.1f}"
    assert torch.all(st.accepted <= st.drafted) and torch.all(st.rounds >= 1)


def test_plain_ancestral_chain_matches_law() -> None:
    """The harness itself: plain ancestral sampling passes."""
    x0, ids = start_states()
    p_min, z_max = law_check(ancestral_chain(make_chain(), x0, ids, seed=1))
    assert p_min > P_MIN and z_max < 4.5


@pytest.mark.parametrize("control", ["reflection_in_block", "alpha_one"])
def test_negative_controls_fail(control: str) -> None:
    """T9: reflection inside block verification, and alpha = 1 instead of w_tau, both bias x_K."""
    x0, ids = start_states()
    kwargs = dict(drafter="model", verification="block", gamma=4)
    if control == "reflection_in_block":
        x, _ = speculative_chain(make_chain(), x0, ids, seed=1, rejection="reflection", **kwargs)
    else:
        x, _ = speculative_chain(make_chain(), x0, ids, seed=1, rejection="residual", residual_alpha="one", **kwargs)
    p_min, z_max = law_check(x)
    assert p_min < 1e-4 or z_max > 6, f"control {control} not detected: p = {p_min:.2e}, z = {z_max:.1f}"


@pytest.mark.parametrize("drafter", ["model", "free", "frozen"])
@pytest.mark.parametrize("gamma", [2, 4, 7])
def test_block_efficiency_at_least_token(drafter: str, gamma: int) -> None:
    """T8: mean advance per round, block >= token (Rao-Blackwellised sum of w_i vs v_i, 1e4 chains).
    Equality is expected at gamma = 2 (no bonus step), a strict gain from gamma = 3 on."""
    x0, ids = start_states(10_000)
    res = {}
    for verification in ("token", "block"):
        _, st = speculative_chain(make_chain(), x0, ids, seed=3, drafter=drafter, verification=verification, rejection="residual", gamma=gamma)
        res[verification] = (st.expected_advance.sum() / st.rounds.sum()).item(), (K / st.rounds.double()).mean().item()
    token_rb, token_emp = res["token"]
    block_rb, block_emp = res["block"]
    assert block_rb >= token_rb - 0.01, res
    assert block_emp >= token_emp - 0.02, res
    if gamma >= 4 and drafter != "frozen":
        assert block_rb > token_rb, res


def iid_rounds(delta: float, gamma: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """i.i.d. reference model: the draft s-law is N(delta, 1) against a target N(0, 1) at every step."""
    gen = torch.Generator().manual_seed(seed)
    xi = torch.randn(n, gamma, dtype=torch.float64, generator=gen)
    log_rho = -delta * xi - delta**2 / 2
    eta = 1 - torch.rand(n, gamma, dtype=torch.float64, generator=gen)
    return log_rho, torch.full((n, gamma), delta, dtype=torch.float64), eta


@pytest.mark.parametrize("delta,gamma,block_ref", [(0.25, 7, 5.648), (0.5, 7, 4.525), (1.0, 7, 2.932), (2.0, 7, 1.552), (1.0, 2, 1.6169)])
def test_iid_reference_advance(delta: float, gamma: int, block_ref: float) -> None:
    """T8 table: token advance = sum_{i<gamma} a^i with a = 2 Phi(-delta/2); block vs the spec's
    Monte-Carlo values (2e5 rounds, seed 5, tolerance 4 s.e. + 0.003 for the reference's own error)."""
    n = 200_000
    log_rho, dl, eta = iid_rounds(delta, gamma, n, 5)
    g = torch.full((n,), gamma)
    a = 2 * stats.norm.cdf(-delta / 2)
    token_exact = sum(a**i for i in range(gamma))
    tv, bv = token_verify(log_rho, dl, g, eta), block_verify(log_rho, dl, g, eta)
    adv_token = torch.where(tv.tau < g, tv.tau + 1, g).double()
    adv_block = torch.where(bv.tau < g, bv.tau + 1, g).double()
    se = lambda v: v.std().item() / math.sqrt(n)  # noqa: E731
    assert abs(adv_token.mean().item() - token_exact) < 4 * se(adv_token)
    assert abs(tv.expected_advance.mean().item() - token_exact) < 4 * se(tv.expected_advance) + 1e-9
    assert abs(adv_block.mean().item() - block_ref) < 4 * se(adv_block) + 0.003
    # Rao-Blackwell identity: E[sum_i w_i] equals the empirical mean advance
    assert abs(bv.expected_advance.mean().item() - adv_block.mean().item()) < 4 * se(adv_block)


def test_block_cut_probabilities_match_weights() -> None:
    """T10: with y_{1:i} fixed and eta / later drafts re-randomised, P(tau >= i) = w_i and P(tau = i) = R_i
    (i.i.d. model, delta = 1, gamma = 5, i = 2; 2e5 repetitions, seed 7, 4.5 binomial s.e.)."""
    from specray.methods.diffusion.rules import block_weights

    delta, gamma, i, n = 1.0, 5, 2, 200_000
    log_rho, dl, eta = iid_rounds(delta, gamma, n, 7)
    log_rho[:, :i] = torch.tensor([0.3, -0.9], dtype=torch.float64)  # fixed first i drafts
    g = torch.full((n,), gamma)
    tau = block_verify(log_rho, dl, g, eta).tau
    log_w, _ = block_weights(log_rho[:1], dl[:1], g[:1])
    w_i = log_w[0, i].exp().item()
    from specray.methods.diffusion.residual import log_residual_mass

    R_i = log_residual_mass(torch.tensor(delta, dtype=torch.float64), log_w[0, i]).exp().item()
    for p_emp, p_true in [((tau >= i).double().mean().item(), w_i), ((tau == i).double().mean().item(), R_i)]:
        assert abs(p_emp - p_true) < 4.5 * math.sqrt(p_true * (1 - p_true) / n)


def test_frozen_first_step_always_accepted_and_identical_kernels() -> None:
    """T13: Frozen drafter's step 1 has delta = 0 and is always accepted; identical kernels give tau = g."""
    x0, ids = start_states(2_000)
    _, st = speculative_chain(make_chain(), x0, ids, seed=4, drafter="frozen", verification="block", rejection="residual", gamma=7)
    assert torch.all(st.per_position[:, 0] == st.rounds)
    same = GaussianChain(A=make_chain().A, B=make_chain().B, sigma=make_chain().sigma, target_eps=target_eps, draft_eps=target_eps)
    for verification in ("token", "block"):
        _, st = speculative_chain(same, x0, ids, seed=4, drafter="model", verification=verification, rejection="residual", gamma=5)
        assert torch.all(st.rounds == math.ceil(K / 5)) and torch.all(st.accepted == K)  # K not a multiple of gamma


def test_batched_equals_single_rows() -> None:
    """T11: a row's trajectory does not depend on batch composition (rows finish in different rounds)."""
    x0, ids = start_states(6)
    for drafter, verification in [("free", "block"), ("model", "token"), ("frozen", "block")]:
        xb, sb = speculative_chain(make_chain(), x0, ids, seed=9, drafter=drafter, verification=verification, rejection="residual", gamma=4)
        assert len(set(sb.rounds.tolist())) > 1 or drafter == "frozen"
        for r in range(6):
            xr, sr = speculative_chain(make_chain(), x0[r : r + 1], ids[r : r + 1], seed=9, drafter=drafter, verification=verification, rejection="residual", gamma=4)
            torch.testing.assert_close(xr[0], xb[r], rtol=0, atol=1e-12)
            assert sr.rounds[0] == sb.rounds[r] and sr.target_calls[0] == sb.target_calls[r]


def test_round_slots_from_the_host_are_the_devices() -> None:
    """A CPU round builds its block lengths, slot steps, drafted slots and coefficients from the host's copy of the
    steps, or by one kernel call where every batch row drafts gamma steps (its constant tensors made once); a GPU
    round from the device's steps. All give the same tensors, in full rounds (the last one's rows ending at K) and
    ragged ones, of every batch row and of some (K = 12, gamma 5, random tables, seed 6), the coefficients contiguous
    as the kernels take them. The kernel refuses a ragged round."""
    import numpy as np

    from specray.methods.diffusion import cpu_slots
    from specray.methods.diffusion.loop import ChainStats, _full_blocks, _full_round, _new_round, _slots_on_device

    tables = torch.rand(3, K, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    all_rows = torch.arange(6)
    kernel = cpu_slots._kernel(torch.zeros(1, dtype=torch.int64)) is not None
    for steps, full in (([0, 3, 5, 7], True), ([7, 7, 6, 1], True), ([2, 8, 11, 10], False), ([0, 8, 3, 3], False)):
        g_host = np.minimum(5, K - np.array(steps))
        G = int(g_host.max())
        device = _slots_on_device(torch.tensor(steps), G, 5, tables, ChainStats(4, 5, K))
        rounds = []
        for act in (None, torch.tensor([0, 2, 3, 5])):
            k = torch.tensor(steps) if act is None else torch.zeros(6, dtype=torch.int64).index_put_(
                (act,), torch.tensor(steps))
            rows = all_rows[:4] if act is None else all_rows
            rounds.append(_new_round(3, act, rows, k, np.array(steps), 5, False, tables, ChainStats(4, 5, K)))
        by_kernel = _full_round(3, all_rows[:4], torch.tensor(steps), 5, False, tables)
        assert (by_kernel is not None) == (full and kernel)
        if by_kernel is not None:
            assert by_kernel.valid is _full_blocks(4, 5)[2]  # made once
            rounds.append(by_kernel)
        for rnd, act in zip(rounds, (None, torch.tensor([0, 2, 3, 5]), None)):
            for a, b in zip((rnd.g, rnd.steps, rnd.valid, rnd.coef), device, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
            assert rnd.coef.is_contiguous() and (rnd.G, rnd.ragged) == (G, int(g_host.min()) < G)
            assert np.array_equal(rnd.g_host, g_host) and torch.equal(rnd.kk, torch.tensor(steps))
            assert torch.equal(rnd.row_index, torch.arange(4))
            assert torch.equal(rnd.label_rows, torch.arange(4) if act is None else act)
    assert not _full_blocks(4, 5)[0].flags.writeable


@pytest.mark.parametrize("drafter", ["frozen", "free", "model"])
def test_target_calls_a_row(drafter: str) -> None:
    """A row's target calls: a Frozen round makes two (its first state's call, then the verify call) where it drafts
    more than one step, else one; a Free row's first round is a Frozen round and the later ones make one, as do the
    model drafter's (K = 12, gamma 5, 4 and 1; 6 rows, seed 3, rows finishing in different rounds)."""
    x0, ids = start_states(6)
    for gamma in (5, 4, 1):
        _, st = speculative_chain(make_chain(), x0, ids, seed=3, drafter=drafter, verification="block",
                                  rejection="residual", gamma=gamma)
        if gamma == 1:  # a single step a round: no verify call after a Frozen one
            assert torch.equal(st.target_calls, st.rounds)
        elif drafter == "frozen":  # every round 2, but the last one where it has a single step left
            assert torch.all((st.target_calls >= 2 * st.rounds - 1) & (st.target_calls <= 2 * st.rounds))
            assert torch.any(st.target_calls == 2 * st.rounds)
        else:
            assert torch.equal(st.target_calls, st.rounds + (drafter == "free"))


@pytest.mark.parametrize("verification", ["token", "block"])
@pytest.mark.parametrize("noise_with_round", [True, False])
def test_residual_draws_keyed_by_round_and_resampled_step(monkeypatch: pytest.MonkeyPatch, verification: str,
                                                          noise_with_round: bool) -> None:
    """A cut row's psi_alpha draws are streams "residual" (u, in (0, 1]) and "residual_noise" (zeta) at position =
    the round and step = the step it resamples (module docstring), whichever slot that is and however the loop
    draws them (with the round's other streams for every slot, or zeta for the cut rows alone). 40 rows,
    gamma 5, seed 6."""
    from specray import rng
    from specray.methods.diffusion import loop

    monkeypatch.setattr(loop, "RESIDUAL_NOISE_WITH_ROUND", loop.RESIDUAL_NOISE_WITH_ROUND if noise_with_round else 0)
    # The draws are seen where sample_residual takes them: the C++ resampled states take the same ones, from the
    # same _ResidualDraws.at call (tests/test_residual_draw_kernel.py compares the samples), and the commit kernel
    # the same draws at the same slots (tests/test_cpu_commit.py).
    from specray.methods.diffusion import cpu_commit

    monkeypatch.setattr(loop, "_states_kernel", lambda chain, Y, name: None)
    monkeypatch.setattr(cpu_commit, "ENABLED", False)

    seen: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    original_resample, original_sample = loop._resample, loop.sample_residual
    where: dict[str, torch.Tensor] = {}

    def resample(chain, rnd, cut, Y, E, Delta, xi, verdict, *rest):
        where["ids"] = ids[rnd.label_rows[cut]]
        where["position"] = torch.full_like(cut, rnd.index)
        where["step"] = rnd.kk[cut] + verdict.tau[cut]
        return original_resample(chain, rnd, cut, Y, E, Delta, xi, verdict, *rest)

    def sample_residual(m_q, Delta, sigma, log_alpha, u, zeta):
        seen.append((where["ids"], where["position"], where["step"], u, zeta))
        return original_sample(m_q, Delta, sigma, log_alpha, u, zeta)

    monkeypatch.setattr(loop, "_resample", resample)
    monkeypatch.setattr(loop, "sample_residual", sample_residual)
    x0, ids = start_states(40)
    speculative_chain(make_chain(), x0, ids, seed=6, drafter="model", verification=verification, rejection="residual",
                      gamma=5)
    assert len(seen) > 5 and len({int(s.min()) for _, _, s, _, _ in seen}) > 3  # many rounds, many steps
    for sample_ids, position, step, u, zeta in seen:
        expected_u = 1.0 - rng.uniform(6, sample_ids, "residual", position=position, step=step)
        expected_zeta = rng.normal(6, sample_ids, "residual_noise", position=position, step=step, shape=(D,),
                                   dtype=torch.float64)
        assert torch.equal(u, expected_u) and torch.equal(zeta, expected_zeta)
