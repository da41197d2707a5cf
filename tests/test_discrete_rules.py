"""Correctness of the discrete verification rules (spec discrete_sd.md §9, items 1–9 and 11–13).

Exact tests enumerate the law of one round of the kernel itself (tests/discrete_enumeration.py)
on random toy chains (V = 2–4, γ = 1–3, target/draft tables indexed by the full prefix, ~30% of
the distributions with zeroed entries to emulate top-k). Monte-Carlo tests run the batched
kernel on 2·10^5 rows and chi-square the padded outputs against the enumerated law.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specray import rng as srng
from specray.methods.discrete import lantern as lantern_mod
from specray.methods.discrete import rules as rules_mod
from specray.methods.discrete.lantern import neighbours_from_embeddings
from specray.methods.discrete.rules import (
    RULES,
    RuleParams,
    acceptance_probs,
    cool_sd_omegas,
    correction_dist,
    normalise,
    verify,
    verify_with_details,
)
from tests.discrete_enumeration import (
    ToyChain,
    draft_rows,
    enumerate_round,
    lookup,
    random_chain,
    target_law,
    total_variation,
    vanilla_residual,
    wrong_residual_target,
)

torch.set_num_threads(1)

EXACT_TOL = 1e-9
COOL_DELTAS = (0.0, 0.25, 0.5, 1.0, 1.1, 1.5, 2.0, 4.0)


def toy_chains(seed: int, count: int) -> list[ToyChain]:
    gen = np.random.default_rng(seed)
    return [random_chain(gen, int(gen.integers(2, 5)), int(gen.integers(1, 4))) for _ in range(count)]


def toy_neighbours(vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return neighbours_from_embeddings(torch.randn(vocab, 3, generator=gen), vocab - 1)


CHAINS = toy_chains(seed=2024, count=60)


# ------------------------------------------------------------------------ exact rules (§9.1–4)


def test_sd_and_block_round_law_is_the_target_law():
    worst = {"sd": 0.0, "block": 0.0}
    for chain in CHAINS:
        target = target_law(chain)
        for rule in worst:
            law = enumerate_round(chain, rule)
            assert abs(law.law.sum() - 1.0) < 1e-12
            assert not law.positive_weight_fallback, "a reachable rejection sampled an empty residual"
            worst[rule] = max(worst[rule], total_variation(law.law, target))
    print(f"max TV over {len(CHAINS)} instances: {worst}")
    assert worst["sd"] < EXACT_TOL and worst["block"] < EXACT_TOL


def test_negative_control_wrong_residual_fails_exactness():
    tvs = np.array([
        total_variation(enumerate_round(c, "sd", correction_fn=wrong_residual_target).law, target_law(c))
        for c in CHAINS
    ])
    print(f"wrong residual: max TV {tvs.max():.4f}, share > 1e-3: {(tvs > 1e-3).mean():.2f}")
    assert tvs.max() > 1e-3
    assert (tvs > 1e-3).mean() > 0.8


def test_negative_control_block_with_prefix_decision_or_plain_residual_fails(monkeypatch):
    chains = CHAINS[:20]
    plain = [
        total_variation(enumerate_round(c, "block", correction_fn=_sd_residual_for_block).law, target_law(c))
        for c in chains
    ]
    monkeypatch.setattr(rules_mod, "decide_accepted", lambda rule, passed: _prefix_decision(passed))
    prefix = [total_variation(enumerate_round(c, "block").law, target_law(c)) for c in chains]
    print(f"block negative controls: plain residual max TV {max(plain):.4f}, prefix decision {max(prefix):.4f}")
    assert max(plain) > 1e-3 and max(prefix) > 1e-3


def _prefix_decision(passed: torch.Tensor) -> torch.Tensor:
    return torch.cumprod(passed.to(torch.int64), dim=1).sum(dim=1)


def _sd_residual_for_block(rule, P, Q, drafts, n_accepted, params):  # noqa: ANN001
    return correction_dist("sd", P, Q, drafts, n_accepted, params)


def test_block_never_fewer_tokens_than_sd_and_equal_for_gamma_one():
    gains = []
    for chain in CHAINS:
        e_sd = enumerate_round(chain, "sd").expected_tokens
        e_block = enumerate_round(chain, "block").expected_tokens
        assert e_block >= e_sd - 1e-12
        if chain.gamma == 1:
            assert abs(e_block - e_sd) < 1e-12
        gains.append(e_block - e_sd)
    print(f"block - sd tokens/round: mean {np.mean(gains):.4f}, max {np.max(gains):.4f}")
    assert max(gains) > 0.01  # the toy has instances where block verification helps


def test_block_zero_target_mass_draft_forces_earlier_stop():
    gen = torch.Generator().manual_seed(7)
    checked = 0
    for chain in CHAINS:
        drafts, P, Q, q_weight = draft_rows(chain)
        p_draft = torch.gather(P[:, : chain.gamma], -1, drafts.unsqueeze(-1)).squeeze(-1)
        zero = p_draft == 0
        if not zero.any():
            continue
        first_zero = torch.where(zero.any(1), zero.to(torch.int64).argmax(1) + 1, chain.gamma + 1)  # 1-based
        for trial in range(16):
            u = torch.rand(drafts.shape, generator=gen, dtype=torch.float64) * (trial > 0)  # trial 0: u = 0
            out, details = verify_with_details("block", P, Q, drafts, u, torch.rand(len(drafts), dtype=torch.float64))
            assert (out.n_accepted < first_zero).all()
            positions = torch.arange(1, chain.gamma + 1)
            assert (details.pass_probs[positions >= first_zero.unsqueeze(1)] == 0).all()
        checked += 1
    assert checked > 5


# ------------------------------------------------------------------------ COOL-SD (§9.5–7)


def test_cool_sd_schedule_matches_spec_table():
    assert torch.allclose(cool_sd_omegas(4, 1.1), torch.tensor([2.36, 1.17, 0.58, 0.29], dtype=torch.float64), atol=6e-3)
    assert torch.allclose(cool_sd_omegas(5, 2.0), torch.tensor([5.19, 2.58, 1.28, 0.64, 0.32], dtype=torch.float64), atol=6e-3)
    assert abs(cool_sd_omegas(7, 2.0).mean().item() - 2.0) < 1e-12  # mean normalisation
    assert torch.allclose(cool_sd_omegas(3, 1.0, nu=0.5, mu=0.0), torch.exp(-0.5 * torch.arange(1.0, 4.0, dtype=torch.float64)))


def test_cool_sd_tv_within_bound_lossless_region_and_monotone():
    chains = CHAINS[:40]
    cases = violations = 0
    worst_ratio = 0.0
    for chain in chains:
        target = target_law(chain)
        previous_tv = previous_bound = 0.0
        for delta in COOL_DELTAS:
            law = enumerate_round(chain, "cool_sd", RuleParams(delta=delta))
            tv = total_variation(law.law, target)
            cases += 1
            violations += tv > law.bound + 1e-12
            if law.bound > 1e-9:
                worst_ratio = max(worst_ratio, tv / law.bound)
            if cool_sd_omegas(chain.gamma, delta).max() <= 1.0:
                assert tv < 1e-12, f"lossless region violated: delta={delta}, TV={tv}"
                assert law.bound < 1e-12
            assert law.bound >= previous_bound - 1e-15
            assert tv >= previous_tv - 1e-12
            assert not law.positive_weight_fallback
            previous_tv, previous_bound = tv, law.bound
    print(f"COOL-SD: {cases} cases, {violations} bound violations, max TV/B* {worst_ratio:.3f}")
    assert violations == 0


def test_cool_sd_gstar_never_worse_than_vanilla_residual():
    strictly_better = 0
    for chain in CHAINS[:40]:
        target = target_law(chain)
        for delta in (1.1, 2.0):
            params = RuleParams(delta=delta)
            tv_gstar = total_variation(enumerate_round(chain, "cool_sd", params).law, target)
            tv_vanilla = total_variation(enumerate_round(chain, "cool_sd", params, vanilla_residual).law, target)
            assert tv_gstar <= tv_vanilla + 1e-12
            strictly_better += tv_gstar < tv_vanilla - 1e-9
    print(f"G* strictly better than the vanilla residual in {strictly_better}/80 cases")
    assert strictly_better > 0


def test_uniform_rsd_bound_and_lossless_when_delta_at_most_one():
    for chain in CHAINS[:20]:
        target = target_law(chain)
        for delta in (0.5, 1.0, 1.5, 3.0):
            law = enumerate_round(chain, "uniform_rsd", RuleParams(delta=delta))
            tv = total_variation(law.law, target)
            assert tv <= law.bound + 1e-12
            if delta <= 1.0:
                assert tv < 1e-12


def _single_step_gstar_check(rule: str, params: RuleParams, P: torch.Tensor, Q: torch.Tensor, gen: np.random.Generator) -> float:
    """TV of one relaxed step with the module's G*, asserting no residual G does better (§9.9)."""
    vocab = P.shape[-1]
    drafts = torch.arange(vocab).unsqueeze(1)  # one row per possible draft token x
    P_rows = P.expand(vocab, 2, vocab).clone()
    Q_rows = Q.expand(vocab, 1, vocab).clone()
    f = acceptance_probs(rule, P_rows, Q_rows, drafts, params)[:, 0]
    g_star, _ = correction_dist(rule, P_rows[:1], Q_rows[:1], drafts[:1], torch.tensor([0]), params)
    g_star = g_star[0] / g_star[0].sum()
    p, q = P[0, 0], Q[0, 0]
    beta = 1.0 - (q * f).sum()
    optimum = (q * f - p).clamp(min=0).sum().item()
    tv_star = 0.5 * (q * f + beta * g_star - p).abs().sum().item()
    assert abs(tv_star - optimum) < 1e-12
    for _ in range(50):
        g = torch.from_numpy(gen.dirichlet(np.full(vocab, 0.5)))
        assert 0.5 * (q * f + beta * g - p).abs().sum().item() >= optimum - 1e-12
    return optimum


def test_single_step_gstar_is_optimal():
    gen = np.random.default_rng(3)
    positive = 0
    for trial in range(40):
        vocab = 5
        P = normalise(torch.from_numpy(gen.dirichlet(np.full(vocab, 0.7), size=(1, 2))))
        Q = normalise(torch.from_numpy(gen.dirichlet(np.full(vocab, 0.7), size=(1, 1))))
        cool = RuleParams(delta=float(gen.uniform(0.2, 4.0)))  # γ = 1: ω_1 = δ
        lantern = RuleParams(k=2, lam=3.0, neighbours=toy_neighbours(vocab, trial))
        positive += _single_step_gstar_check("cool_sd", cool, P, Q, gen) > 1e-6
        positive += _single_step_gstar_check("lantern", lantern, P, Q, gen) > 1e-6
    assert positive > 20  # the relaxation is active in most trials


def test_all_token_relaxed_mass_matches_per_token_and_chunks(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    P = torch.softmax(torch.randn(3, 50, generator=gen, dtype=torch.float64), -1)
    P[:, :10] = 0
    P = P / P.sum(-1, keepdim=True)
    neighbours = neighbours_from_embeddings(torch.randn(50, 4, generator=gen), 12)
    tokens = torch.arange(50).expand(3, 50)
    for kwargs in ({"mode": "lambda", "lam": 4.0}, {"mode": "delta", "delta": 0.05, "forbid_zero_target_mass": True}):
        per_token, _ = lantern_mod.relaxed_target_mass(P.unsqueeze(1).expand(3, 50, 50), tokens, neighbours, 12, **kwargs)
        monkeypatch.setattr(lantern_mod, "_GATHER_BUDGET", 100)  # forces 1-2 tokens per chunk
        chunked = lantern_mod.relaxed_target_mass_all_tokens(P, neighbours, 12, **kwargs)
        monkeypatch.undo()
        assert torch.equal(per_token, chunked)
        assert (per_token >= P).all()


# ------------------------------------------------------------------------ LANTERN (§9.8)


def _lantern(chain: ToyChain, seed: int, **kwargs) -> RuleParams:
    return RuleParams(neighbours=toy_neighbours(chain.vocab, seed), **kwargs)


def test_lantern_reduces_to_sd_when_k_is_zero_or_lambda_is_one():
    for index, chain in enumerate(CHAINS[:30]):
        sd = enumerate_round(chain, "sd").law
        k_max = chain.vocab - 1
        for params in (
            _lantern(chain, index, k=0, lam=5.0),
            _lantern(chain, index, k=k_max, lam=1.0),
            _lantern(chain, index, k=k_max, mode="delta", delta=0.0),
            _lantern(chain, index, k=0, lam=5.0, residual="official"),
            # Not the official residual with λ = 1: like the released code it triggers on m* >= 1
            # even when the counted neighbours carry zero mass (top-k zeros), see the module docstring.
        ):
            assert np.abs(enumerate_round(chain, "lantern", params).law - sd).max() < 1e-15


def test_lantern_lambda_mode_never_accepts_zero_target_mass():
    checked = 0
    for index, chain in enumerate(CHAINS):
        drafts, P, Q, _ = draft_rows(chain)
        params = _lantern(chain, index, k=chain.vocab - 1, lam=20.0)
        zeros = torch.zeros(drafts.shape, dtype=torch.float64)
        _, details = verify_with_details("lantern", P, Q, drafts, zeros, zeros[:, 0], params)
        p_draft = torch.gather(P[:, : chain.gamma], -1, drafts.unsqueeze(-1)).squeeze(-1)
        assert (details.pass_probs[p_draft == 0] == 0).all()
        checked += int((p_draft == 0).sum())
    assert checked > 10


def test_lantern_delta_mode_can_accept_zero_target_mass_unless_forbidden():
    # Token 0 is outside the target's support, but its nearest neighbour 1 carries mass 0.3 <= δ.
    P = torch.tensor([[[0.0, 0.3, 0.7], [0.2, 0.3, 0.5]]], dtype=torch.float64)
    Q = torch.tensor([[[1.0, 0.0, 0.0]]], dtype=torch.float64)
    drafts = torch.tensor([[0]])
    neighbours = torch.tensor([[1, 2], [0, 2], [1, 0]])
    u = torch.tensor([[0.29]], dtype=torch.float64)
    faithful = RuleParams(k=2, mode="delta", delta=0.4, neighbours=neighbours)
    out, details = verify_with_details("lantern", P, Q, drafts, u, torch.tensor([0.5], dtype=torch.float64), faithful)
    assert details.pass_probs.item() == pytest.approx(0.3)
    assert out.n_accepted.item() == 1
    forbidden = RuleParams(k=2, mode="delta", delta=0.4, neighbours=neighbours, forbid_zero_target_mass=True)
    out, details = verify_with_details("lantern", P, Q, drafts, u, torch.tensor([0.5], dtype=torch.float64), forbidden)
    assert details.pass_probs.item() == 0.0 and out.n_accepted.item() == 0
    lam = RuleParams(k=2, mode="lambda", lam=50.0, neighbours=neighbours)
    assert verify_with_details("lantern", P, Q, drafts, u, torch.tensor([0.5], dtype=torch.float64), lam)[1].pass_probs.item() == 0.0


def test_lantern_gstar_tv_within_bound():
    worst = 0.0
    for index, chain in enumerate(CHAINS[:40]):
        target = target_law(chain)
        for params in (
            _lantern(chain, index, k=chain.vocab - 1, lam=3.0),
            _lantern(chain, index, k=1, lam=10.0),
            _lantern(chain, index, k=chain.vocab - 1, mode="delta", delta=0.3),
        ):
            law = enumerate_round(chain, "lantern", params)
            tv = total_variation(law.law, target)
            assert tv <= law.bound + 1e-12
            assert not law.positive_weight_fallback
            worst = max(worst, tv)
            official = enumerate_round(chain, "lantern", RuleParams(**{**params.__dict__, "residual": "official"}))
            assert abs(official.law.sum() - 1.0) < 1e-12
    assert worst > 1e-3  # the relaxation does change the law


def test_lantern_official_residual_zeroes_draft_neighbours_in_q():
    P = normalise(torch.tensor([[[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]]))
    Q = normalise(torch.tensor([[[0.5, 0.2, 0.2, 0.1]]]))
    drafts = torch.tensor([[0]])
    neighbours = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 3, 0], [2, 1, 0]])
    params = RuleParams(k=1, lam=3.0, residual="official", neighbours=neighbours)  # budget 0.2 >= P(1)
    dist, fallback = correction_dist("lantern", P, Q, drafts, torch.tensor([0]), params)
    # Q' zeroes tokens 1 and 2 (k+1 = 2 nearest neighbours of token 0); token 0 keeps Q = 0.5.
    expected = torch.tensor([[0.0, 0.2, 0.3, 0.3]], dtype=torch.float64)
    assert torch.allclose(dist, expected) and not fallback.any()
    gstar = correction_dist("lantern", P, Q, drafts, torch.tensor([0]), RuleParams(k=1, lam=3.0, neighbours=neighbours))[0]
    assert not torch.allclose(gstar / gstar.sum(), expected / expected.sum())


# ------------------------------------------------------------------------ Monte Carlo (§9.11)

MC_ROWS = 200_000
MC_SEED = 11
MC_P_MIN = 1e-3


def _mc_chain() -> ToyChain:
    chain = random_chain(np.random.default_rng(5), vocab=3, gamma=3, zero_prob=0.3)
    return chain


def _sample_sequences(chain: ToyChain, P_tab: list[np.ndarray], stream: str, n: int) -> np.ndarray:
    ids = torch.arange(n)
    seqs = np.zeros((n, len(P_tab)), dtype=np.int64)
    u = srng.uniform(MC_SEED, ids, stream, shape=(len(P_tab),)).numpy()
    for i, table in enumerate(P_tab):
        dist = torch.from_numpy(lookup(table, seqs[:, :i]))
        seqs[:, i] = srng.sample_categorical(dist, torch.from_numpy(u[:, i])).numpy()
    return seqs


def _run_mc(chain: ToyChain, rule: str, params: RuleParams) -> tuple[np.ndarray, np.ndarray]:
    """Padded round outputs [N, γ+1] and tokens per round [N] of the batched kernel."""
    from tests.discrete_enumeration import rows_for_sequences

    n, gamma = MC_ROWS, chain.gamma
    drafts = _sample_sequences(chain, chain.Q_tab, "draft", n)
    P, Q = rows_for_sequences(chain, drafts)
    ids = torch.arange(n)
    out = verify(
        rule, P.float(), Q.float(), torch.from_numpy(drafts),
        srng.uniform(MC_SEED, ids, "accept", shape=(gamma,)), srng.uniform(MC_SEED, ids, "residual"), params,
    )
    n_acc = out.n_accepted.numpy()
    seq = np.zeros((n, gamma + 1), dtype=np.int64)
    seq[:, :gamma] = np.where(out.accepted_mask.numpy(), drafts, 0)
    seq[np.arange(n), n_acc] = out.next_token.numpy()
    u_pad = srng.uniform(MC_SEED, ids, "pad", shape=(gamma + 1,)).numpy()
    for m in range(gamma + 1):  # pad with target sampling after the emitted tokens
        dist = torch.from_numpy(lookup(chain.P_tab[m], seq[:, :m]))
        fresh = srng.sample_categorical(dist, torch.from_numpy(u_pad[:, m])).numpy()
        seq[:, m] = np.where(m > n_acc, fresh, seq[:, m])
    return seq, n_acc + 1


def _chi_square_p(seq: np.ndarray, law: np.ndarray) -> tuple[float, int]:
    flat = np.ravel_multi_index(tuple(seq.T), law.shape)
    counts = np.bincount(flat, minlength=law.size).astype(float)
    probs = law.reshape(-1)
    impossible = probs == 0
    impossible_hits = int(counts[impossible].sum())
    expected = probs * len(seq)
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    return float(stats.chi2.sf(chi2, len(obs) - 1)), impossible_hits


@pytest.mark.parametrize(
    "rule,params,against_target",
    [("sd", RuleParams(), True), ("block", RuleParams(), True), ("cool_sd", RuleParams(delta=2.0), False)],
)
def test_monte_carlo_batched_kernel_matches_enumerated_law(rule, params, against_target):
    # N = 2e5 rows, seed MC_SEED, accept if chi-square p > 1e-3 and mean tokens within 4 SE.
    chain = _mc_chain()
    exact = enumerate_round(chain, rule, params)
    law = target_law(chain) if against_target else exact.law
    seq, tokens = _run_mc(chain, rule, params)
    assert len(np.unique(tokens)) == chain.gamma + 1, "batch should hold every acceptance length"
    p_value, impossible_hits = _chi_square_p(seq, law)
    se = tokens.std(ddof=1) / np.sqrt(len(tokens))
    z = (tokens.mean() - exact.expected_tokens) / se
    print(f"{rule}: p={p_value:.3f}, tokens/round MC {tokens.mean():.4f} vs exact {exact.expected_tokens:.4f} (z={z:.2f}),"
          f" exact TV to target {total_variation(exact.law, target_law(chain)):.4f}")
    assert impossible_hits == 0
    assert p_value > MC_P_MIN
    assert abs(z) < 4
    if not against_target:  # negative control: the relaxed rule's samples must fail the target law
        p_target, _ = _chi_square_p(seq, target_law(chain))
        assert p_target < 1e-6


# ------------------------------------------------------------------------ batching (§9.12–13)


def _random_batch(batch: int, gamma: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    P = torch.softmax(2 * torch.randn(batch, gamma + 1, vocab, generator=gen), -1)
    P[:, :, : vocab // 4] *= (torch.rand(batch, gamma + 1, 1, generator=gen) < 0.5)  # top-k style zeros
    P = P / P.sum(-1, keepdim=True)
    Q = torch.softmax(2 * torch.randn(batch, gamma, vocab, generator=gen), -1)
    # Draft the token with the largest Q − P among P > 0, so every plain acceptance probability
    # is in (0, 1) and hand-set uniforms can force any acceptance length.
    gap = (Q - P[:, :gamma]).masked_fill(P[:, :gamma] == 0, float("-inf"))
    drafts = gap.argmax(-1)
    return P.float(), Q.float(), drafts


def _all_rule_params(vocab: int) -> list[tuple[str, RuleParams]]:
    neighbours = neighbours_from_embeddings(torch.randn(vocab, 4, generator=torch.Generator().manual_seed(3)), 8)
    return [
        ("sd", RuleParams()),
        ("block", RuleParams()),
        ("lantern", RuleParams(k=8, lam=3.0, neighbours=neighbours)),
        ("lantern", RuleParams(k=8, mode="delta", delta=0.2, neighbours=neighbours, residual="official")),
        ("cool_sd", RuleParams(delta=2.0)),
        ("uniform_rsd", RuleParams(delta=1.5)),
    ]


def test_permutation_invariance():
    batch, gamma, vocab = 64, 4, 40
    P, Q, drafts = _random_batch(batch, gamma, vocab, seed=1)
    ids = torch.arange(batch)
    u_acc, u_res = srng.uniform(3, ids, "accept", shape=(gamma,)), srng.uniform(3, ids, "residual")
    perm = torch.randperm(batch, generator=torch.Generator().manual_seed(0))
    for rule, params in _all_rule_params(vocab):
        base = verify(rule, P, Q, drafts, u_acc, u_res, params)
        shuffled = verify(rule, P[perm], Q[perm], drafts[perm], u_acc[perm], u_res[perm], params)
        for field in ("n_accepted", "next_token", "accepted_mask"):
            assert torch.equal(getattr(base, field)[perm], getattr(shuffled, field)), (rule, field)


def test_ragged_batch_rows_equal_single_row_runs():
    batch, gamma, vocab = 30, 4, 40
    P, Q, drafts = _random_batch(batch, gamma, vocab, seed=2)
    forced = torch.arange(batch) % (gamma + 1)  # row b should accept exactly forced[b] drafts under sd
    positions = torch.arange(gamma)
    u_acc = torch.where(positions < forced.unsqueeze(1), 0.0, 1.0 - 2.0**-53).to(torch.float64)
    u_res = srng.uniform(4, torch.arange(batch), "residual")
    assert torch.equal(verify("sd", P, Q, drafts, u_acc, u_res).n_accepted, forced)
    for rule, params in _all_rule_params(vocab):
        together = verify(rule, P, Q, drafts, u_acc, u_res, params)
        for b in range(batch):
            alone = verify(rule, P[b : b + 1], Q[b : b + 1], drafts[b : b + 1], u_acc[b : b + 1], u_res[b : b + 1], params)
            assert together.n_accepted[b] == alone.n_accepted[0], (rule, b)
            assert together.next_token[b] == alone.next_token[0], (rule, b)
            assert torch.equal(together.accepted_mask[b], alone.accepted_mask[0])
        if rule == "sd":
            assert torch.equal(together.accepted_mask.sum(1), together.n_accepted)


def test_float32_inputs_decide_like_float64():
    P, Q, drafts = _random_batch(32, 3, 30, seed=5)
    ids = torch.arange(32)
    u_acc, u_res = srng.uniform(9, ids, "accept", shape=(3,)), srng.uniform(9, ids, "residual")
    for rule, params in _all_rule_params(30):
        a = verify(rule, P, Q, drafts, u_acc, u_res, params)
        b = verify(rule, P.double(), Q.double(), drafts, u_acc, u_res, params)
        assert torch.equal(a.n_accepted, b.n_accepted) and torch.equal(a.next_token, b.next_token)


# ------------------------------------------------------------------------ neighbours and validation


@pytest.mark.parametrize("normalize", [True, False])
def test_neighbours_from_embeddings_matches_brute_force(normalize):
    E = torch.randn(25, 3, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.5, 3, 25).unsqueeze(1)
    nb = neighbours_from_embeddings(E, 6, normalize=normalize, chunk_rows=7)
    X = torch.nn.functional.normalize(E.double(), dim=1) if normalize else E.double()
    for v in range(25):
        d = ((X - X[v]) ** 2).sum(1)
        d[v] = float("inf")
        assert torch.equal(nb[v], torch.argsort(d, stable=True)[:6])
        assert v not in nb[v].tolist()
    assert neighbours_from_embeddings(E, 0).shape == (25, 0)
    with pytest.raises(ValueError, match="k must satisfy"):
        neighbours_from_embeddings(E, 25)


def test_errors_name_the_bad_field():
    P, Q, drafts = _random_batch(2, 2, 5, seed=0)
    u, ur = torch.zeros(2, 2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    with pytest.raises(ValueError, match="rule must be one of"):
        verify("nope", P, Q, drafts, u, ur)
    with pytest.raises(ValueError, match="params.lam"):
        verify("lantern", P, Q, drafts, u, ur, RuleParams(k=1, neighbours=torch.zeros(5, 1, dtype=torch.long)))
    with pytest.raises(ValueError, match="params.neighbours"):
        verify("lantern", P, Q, drafts, u, ur, RuleParams(k=2, lam=2.0))
    with pytest.raises(ValueError, match="params.delta"):
        verify("cool_sd", P, Q, drafts, u, ur, RuleParams())
    with pytest.raises(ValueError, match="params.residual"):
        verify("lantern", P, Q, drafts, u, ur, RuleParams(lam=2.0, residual="paper"))
    with pytest.raises(ValueError, match="u_accept"):
        verify("sd", P, Q, drafts, u[:, :1], ur)
    assert set(RULES) == {"sd", "block", "lantern", "cool_sd", "uniform_rsd"}


def _circle(angles: list[float]) -> torch.Tensor:
    a = torch.tensor(angles, dtype=torch.float64)
    return torch.stack([torch.cos(a), torch.sin(a)], 1)


def test_official_residual_zeroes_the_k_plus_one_nearest_neighbours():
    """Spec §3.3: the released LlamaGen code zeroes Q on the k+1 nearest neighbours of the rejected
    draft. The loop's table has k+1 columns; with k columns (the table before) the constructed case
    below resamples from [0, 1/2, 0, 1/2] instead of [0, 1/3, 1/3, 1/3]: TV 1/3."""
    from specray.methods.discrete.params import Lantern
    from specray.methods.discrete.rules import rule_params_for

    embeddings = _circle([0.0, 0.3, 0.6, 0.9])  # token 0's neighbours, nearest first: 1, 2, 3
    params = rule_params_for(Lantern(k=1, lam=5.0, residual="official"), 4, embeddings)
    assert params.neighbours.shape == (4, 2) and params.neighbours[0].tolist() == [1, 2]
    P = torch.tensor([[[0.1, 0.3, 0.3, 0.3], [0.25, 0.25, 0.25, 0.25]]], dtype=torch.float64)
    Q = torch.tensor([[[0.4, 0.1, 0.5, 0.0]]], dtype=torch.float64)  # budget 4 * 0.1 >= P(1): m* = 1
    drafts, rejected = torch.tensor([[0]]), torch.tensor([0])
    fixed = correction_dist("lantern", P, Q, drafts, rejected, params)[0][0]
    k_only = RuleParams(**{**params.__dict__, "neighbours": params.neighbours[:, :1]})
    before = correction_dist("lantern", P, Q, drafts, rejected, k_only)[0][0]
    fixed, before = fixed / fixed.sum(), before / before.sum()
    assert torch.allclose(fixed, torch.tensor([0.0, 1 / 3, 1 / 3, 1 / 3], dtype=torch.float64))
    assert torch.allclose(before, torch.tensor([0.0, 0.5, 0.0, 0.5], dtype=torch.float64))
    assert abs(0.5 * (fixed - before).abs().sum().item() - 1 / 3) < 1e-12


def test_neighbourhoods_use_the_tokenizer_codebook_when_the_pair_has_one():
    from types import SimpleNamespace

    from specray.methods.discrete.params import Lantern
    from specray.methods.discrete.rules import neighbourhood_space, rule_params_for_pair

    embeddings = _circle([0.0, 0.3, 0.6, 0.9])  # from token 0: 1, 2, 3
    codebook = _circle([0.0, 0.9, 0.6, 0.3])  # from token 0: 3, 2, 1
    pair = SimpleNamespace(device=torch.device("cpu"),
                           info={"vocab_size": 4, "token_embeddings": embeddings, "codebook": codebook})
    assert neighbourhood_space(pair.info) is codebook
    assert rule_params_for_pair(Lantern(k=2), pair).neighbours[0].tolist() == [3, 2, 1]
    del pair.info["codebook"]
    assert rule_params_for_pair(Lantern(k=2), pair).neighbours[0].tolist() == [1, 2, 3]
