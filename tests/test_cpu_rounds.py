"""The CPU kernels of the discrete rounds (specray/methods/discrete/cpu_rounds.py): a round's decision (sd,
cool_sd, uniform_rsd, block, LANTERN++) and the inverse-CDF draw with the torch operations' values where they serve
a call, torch's operations everywhere else (irregular laws among them), and kernels that normalise, sum or weigh
otherwise refused by the checks."""

from __future__ import annotations

import pytest
import torch

from specray import rng
from specray.methods.discrete import cpu_rounds, lantern, rules
from specray.models import cpu_kernels

pytestmark = pytest.mark.usefixtures("single_thread")  # the actors' setting (conftest)

NEIGHBOURS = {width: lantern.neighbours_from_embeddings(torch.randn(width, 6, generator=torch.Generator().manual_seed(5)),
                                                        min(6, width - 1)) for width in (4, 17, 40, 255)}
# (rule, RuleParams fields) on another grid than the checks'
CASES = {"sd": ("sd", {}), "cool_sd": ("cool_sd", {"delta": 1.7, "nu": 0.9, "mu": -0.2}),
         "uniform_rsd": ("uniform_rsd", {"delta": 0.8}), "block": ("block", {}),
         "lantern_lambda": ("lantern", {"k": 2, "lam": 3.0}), "lantern_k5": ("lantern", {"k": 5, "lam": 1.5}),
         "lantern_delta": ("lantern", {"k": 4, "mode": "delta", "delta": 0.2, "forbid_zero_target_mass": True})}


@pytest.fixture(scope="module")
def extension(single_thread):
    if any(cpu_rounds.kernel(name, 17) is None for name in ("sample_categorical", *set(cpu_rounds.ROUND_KERNELS.values()))):
        pytest.skip("the round kernels did not build or did not match torch's operations here (see the log)")
    return cpu_kernels.extension()


def _round(rule: str, generator: torch.Generator, rows: int, gamma: int, width: int):
    P = cpu_rounds._test_laws(generator, (rows, gamma + 1, width))
    Q = cpu_rounds._test_laws(generator, (rows, gamma, width))
    Q[::4] = P[::4, :gamma]  # every fourth row: an empty residual
    drafts = rng.sample_categorical(Q, torch.rand(rows, gamma, generator=generator, dtype=torch.float64))
    u_accept = torch.rand(rows, gamma, generator=generator, dtype=torch.float64) ** 2
    u_residual = torch.rand(rows, generator=generator, dtype=torch.float64)
    return P, Q, drafts, u_accept, u_residual


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("width", [4, 17, 40, 255])
def test_rounds_give_torchs_decisions(extension, case, width):
    # gamma 1..6 x 1, 3 and 200 rows, seed 7 (not the checks' seed 0); each round also at the boundaries (acceptance
    # uniforms equal to torch's pass probabilities, the next token's on its law's running sums).
    generator = torch.Generator().manual_seed(7)
    rule, fields = CASES[case]
    if "k" in fields:  # at most the table's neighbours
        fields = {**fields, "k": min(fields["k"], NEIGHBOURS[width].shape[1])}
    params = rules.RuleParams(**fields, neighbours=NEIGHBOURS[width] if rule == "lantern" else None)
    decide = getattr(extension, cpu_rounds.ROUND_KERNELS[rule])
    for gamma in range(1, 7):
        extra = cpu_rounds.round_arguments(rule, params, gamma)
        for rows in (1, 3, 200):
            P, Q, drafts, u_accept, u_residual = _round(rule, generator, rows, gamma, width)
            details = rules._verify_impl(rule, P, Q, drafts, u_accept, u_residual, params)[1]
            for u in (u_accept, details.pass_probs):
                want = rules._verify_impl(rule, P, Q, drafts, u, u_residual, params)
                u_res = cpu_rounds._boundary_uniforms(want[1].next_token_probs, generator)
                want = rules._verify_impl(rule, P, Q, drafts, u, u_res, params)[0]
                got = decide(P, Q, drafts, u, u_res, *extra)
                assert torch.equal(got[0], want.n_accepted), (gamma, rows)
                assert torch.equal(got[1], want.next_token), (gamma, rows)
                assert torch.equal(got[2], want.accepted_mask), (gamma, rows)


@pytest.mark.parametrize("width", [1, 2, 17, 256])
def test_draws_give_torchs_tokens(extension, width):
    # float32 and float64 laws, 1 and 300 rows, strided rows, uniforms at random and on the running sums; seed 7.
    generator = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float64):
        for rows in (1, 300):
            laws = cpu_rounds._test_laws(generator, (rows, 3, width), dtype)[:, 1]
            for u in (torch.rand(rows, generator=generator, dtype=torch.float64),
                      cpu_rounds._boundary_uniforms(laws, generator)):
                assert torch.equal(extension.sample_categorical(laws, u), rng.sample_categorical(laws, u))
                column = u[:, None]
                assert torch.equal(extension.sample_categorical(laws, column),
                                   rng.sample_categorical_keepdim(laws, column))


@pytest.mark.parametrize("why", ["narrow", "wide", "float64", "strided", "official_residual"])
def test_rounds_the_kernels_do_not_serve_go_to_torch(extension, why):
    width = {"narrow": 3, "wide": 256}.get(why, 17)
    generator = torch.Generator().manual_seed(1)
    P, Q, drafts, u_accept, u_residual = _round("sd", generator, 5, 4, width)
    if why == "float64":
        P = P.double()
    if why == "strided":
        P = torch.cat([P, P], dim=2)[:, :, :width]
    official = why == "official_residual"
    method = (rules.method_params.Lantern(gamma=4, k=2, residual="official") if official else
              rules.method_params.SD(gamma=4))
    rule_params = rules.rule_params_for(method, width, torch.randn(width, 6, generator=generator))
    assert cpu_rounds.decide(method.rule, rule_params, P, Q, drafts, u_accept, u_residual) is None
    if not official:
        assert extension.chain_round(P, Q, drafts, u_accept, u_residual, None)[0] is None
        assert extension.block_round(P, Q, drafts, u_accept, u_residual)[0] is None
    # the verifier the loops use falls back to torch's operations, with the same decisions
    pair = type("Pair", (), {"info": {"vocab_size": width, "token_embeddings": torch.randn(width, 6, generator=generator)},
                             "device": torch.device("cpu")})()
    out = rules.verifier_for(method, pair)(P, Q, drafts, u_accept, u_residual)
    want = rules._verify_impl(method.rule, P, Q, drafts, u_accept, u_residual, rules.rule_params_for_pair(method, pair))[0]
    assert torch.equal(out.n_accepted, want.n_accepted) and torch.equal(out.next_token, want.next_token)


def test_draws_the_kernel_does_not_serve_go_to_torch(extension):
    laws = cpu_rounds._test_laws(torch.Generator().manual_seed(2), (4, 300))  # wider than the kernel's 256
    u = torch.rand(4, dtype=torch.float64)
    assert extension.sample_categorical(laws, u) is None
    assert extension.sample_categorical(laws[:, :17], u.float()) is None  # float32 uniforms: torch converts them
    assert extension.sample_categorical(laws[:, :17], u[None, :]) is None  # one row of uniforms, not one per row
    assert extension.sample_categorical(laws[0, :17], u[:1]) is None  # a single law: not 2-D
    assert torch.equal(cpu_rounds.sample_categorical(laws, u), rng.sample_categorical(laws, u))



NAN, INF = float("nan"), float("inf")
# Laws that are not finite and non-negative with mass in every row. torch's operations still give tokens for them
# (NaN passes through its sums, minima and comparisons, a binary search over unsorted running sums lands where a
# linear one does not); the kernels leave them to torch. Before that guard they served every case here with other
# tokens than torch's (0 or 1 against 3 on a width-4 law, found by a review).
IRREGULAR_ROUNDS = ["zero_p_row", "zero_q_row", "nan_p", "inf_p", "negative_bonus_p"]


def _irregular_round(why: str, rule: str, generator: torch.Generator):
    P, Q, drafts, u_accept, u_residual = _round(rule, generator, 6, 3, 17)
    row = 1
    if why == "zero_p_row":  # 0 / 0: a NaN law where the round rejects
        P[row, 0] = 0.0
    elif why == "zero_q_row":
        Q[row, 0] = 0.0
    elif why == "nan_p":
        P[row, 0, 5] = NAN
    elif why == "inf_p":
        P[row, 0, 5] = INF
    elif why == "negative_bonus_p":  # every draft passes (q = p, u = 0): the bonus draw meets the negative entry
        Q[row] = P[row, :3]
        u_accept[row] = 0.0
        P[row, 3, 2] = -P[row, 3].sum()
    return P, Q, drafts, u_accept, u_residual


@pytest.mark.parametrize("case, why", [(case, why) for case in ("sd", "cool_sd", "block", "lantern_lambda")
                                       for why in (*IRREGULAR_ROUNDS, "nan_u_residual")]
                         + [("cool_sd", "cool_sd_infinite_multiplier")])
def test_irregular_rounds_go_to_torch_and_nan_uniforms_give_torchs_tokens(extension, case, why):
    rule, fields = CASES[case]
    generator = torch.Generator().manual_seed(3)
    if why == "cool_sd_infinite_multiplier":  # the config refuses such a mu; a direct call must not serve it
        fields = {**fields, "mu": -800.0}
    params = rules.RuleParams(**fields, neighbours=NEIGHBOURS[17] if rule == "lantern" else None)
    if why in IRREGULAR_ROUNDS:
        round_ = _irregular_round(why, rule, generator)
    else:
        round_ = list(_round(rule, generator, 6, 3, 17))
        if why == "nan_u_residual":
            round_[4][1] = NAN
    extra = cpu_rounds.round_arguments(rule, params, 3)
    got = getattr(extension, cpu_rounds.ROUND_KERNELS[rule])(*round_, *extra)
    want = rules._verify_impl(rule, *round_, params)[0]
    if why == "nan_u_residual":  # served: searchsorted's test puts a NaN target past the last running sum
        assert got[0] is not None
        assert torch.equal(got[1], want.next_token) and int(want.next_token[1]) == 16
        assert torch.equal(got[0], want.n_accepted) and torch.equal(got[2], want.accepted_mask)
    else:
        assert got[0] is None
        assert cpu_rounds.decide(rule, params, *round_) is None


@pytest.mark.parametrize("why", ["nan", "inf", "negative"])
def test_irregular_laws_go_to_torch_for_draws(extension, why):
    generator = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, torch.float64):
        laws = cpu_rounds._test_laws(generator, (4, 17), dtype)
        laws[2, 3] = {"nan": NAN, "inf": INF, "negative": -laws[2].sum()}[why]
        for u in (torch.rand(4, generator=generator, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)):
            assert extension.sample_categorical(laws, u) is None
            assert torch.equal(cpu_rounds.sample_categorical(laws, u), rng.sample_categorical(laws, u))


def test_draws_at_nan_uniforms_and_massless_rows_give_torchs_tokens(extension):
    laws = cpu_rounds._test_laws(torch.Generator().manual_seed(4), (3, 17))
    laws[2] = 0.0
    u = torch.tensor([NAN, 0.5, 0.5], dtype=torch.float64)
    got = extension.sample_categorical(laws, u)
    assert got is not None and torch.equal(got, rng.sample_categorical(laws, u))
    assert got[0] == 16 and got[2] == 16  # past the last running sum, as torch's searchsorted puts them


def test_the_draw_wrappers_keep_torchs_shapes(extension):
    laws = cpu_rounds._test_laws(torch.Generator().manual_seed(4), (3, 17), torch.float64)
    flat = torch.rand(3, dtype=torch.float64)
    # torch broadcasts a flat u against the keepdim draw's [rows, 1] running sums: [3, 3]; the kernel is not asked
    assert cpu_rounds.sample_categorical_keepdim(laws, flat).shape == rng.sample_categorical_keepdim(laws, flat).shape
    with pytest.raises(RuntimeError):  # torch refuses a column for the flat draw, and so does the wrapper
        rng.sample_categorical(laws, flat[:, None])
    with pytest.raises(RuntimeError):
        cpu_rounds.sample_categorical(laws, flat[:, None])



def test_lantern_without_its_table_goes_to_torchs_error(extension):
    P, Q, drafts, u_accept, u_residual = _round("lantern", torch.Generator().manual_seed(3), 2, 4, 17)
    params = rules.RuleParams(k=2, lam=2.0)  # no neighbours: the kernel is not asked (it would raise a TypeError)
    assert cpu_rounds.decide("lantern", params, P, Q, drafts, u_accept, u_residual) is None
    with pytest.raises(ValueError, match="params.neighbours is required"):
        rules.verify("lantern", P, Q, drafts, u_accept, u_residual, params)


def test_the_checks_refuse_kernels_that_normalise_sum_or_weigh_otherwise(extension):
    """Negative controls for the guards: (1) sd's round with every law normalised by a running sum (not torch's
    cascade order): pass probabilities and laws differ in a last bit on some rows; (2) cool_sd and uniform_rsd
    decided as sd (their multipliers dropped); (3) block's round with its stop probabilities' residual masses summed
    by a running sum; (4) LANTERN's with every neighbour's mass taken (no budget); (5) draws from float32 running
    sums. Each is refused; torch's own draw is accepted, and so are the kernels."""
    real = extension.chain_round

    def with_running_sums(rule):
        def decide(P, Q, drafts, u_accept, u_residual, *extra):
            if rule == "sd" and extra[0] is not None:
                return real(P, Q, drafts, u_accept, u_residual, *extra)
            original = rules.normalise
            rules.normalise = lambda d: d.to(torch.float64) / d.to(torch.float64).cumsum(-1)[..., -1:]
            try:
                out = rules._verify_impl(rule, P, Q, drafts, u_accept, u_residual, rules.RuleParams())[0]
            finally:
                rules.normalise = original
            return out.n_accepted, out.next_token, out.accepted_mask
        return decide

    def block_running_sums(P, Q, drafts, u_accept, u_residual):
        original = rules.block_stop_probs

        def stop_probs(P, Q, weights):
            gamma = Q.shape[1]
            z = (weights[:, :gamma].unsqueeze(-1) * P[:, :gamma] - Q).clamp(min=0).cumsum(-1)[..., -1][:, 1:]
            inner = torch.where(z + 1.0 - weights[:, 1:gamma] > 0, z / (z + 1.0 - weights[:, 1:gamma]), 1.0)
            return torch.cat([inner.clamp(0.0, 1.0), weights[:, gamma:]], dim=1)
        rules.block_stop_probs = stop_probs
        try:
            out = rules._verify_impl("block", P, Q, drafts, u_accept, u_residual, rules.RuleParams())[0]
        finally:
            rules.block_stop_probs = original
        return out.n_accepted, out.next_token, out.accepted_mask

    def lantern_no_budget(P, Q, drafts, u_accept, u_residual, neighbours, k, lambda_mode, lam, delta, forbid):
        return extension.lantern_round(P, Q, drafts, u_accept, u_residual, neighbours, k, False, lam, 1e9, forbid)

    def float32_draw(probs, u):
        cdf = torch.cumsum(probs.float(), dim=-1).double()
        column = u if u.dim() == 2 else u[:, None]
        out = torch.searchsorted(cdf, column * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)
        return out if u.dim() == 2 else out[:, 0]

    def torch_draw(probs, u):
        return rng.sample_categorical(probs, u) if u.dim() == 1 else rng.sample_categorical_keepdim(probs, u)

    assert not cpu_rounds._rounds_match("chain_round", with_running_sums("sd"), 17)
    assert not cpu_rounds._rounds_match("chain_round", lambda *args: real(*args[:5], None), 17)
    assert not cpu_rounds._rounds_match("block_round", block_running_sums, 17)
    assert not cpu_rounds._rounds_match("lantern_round", lantern_no_budget, 17)
    assert not cpu_rounds._draws_match(float32_draw, 17)
    assert cpu_rounds._draws_match(torch_draw, 17)
    for name in set(cpu_rounds.ROUND_KERNELS.values()):
        assert cpu_rounds._rounds_match(name, getattr(extension, name), 17), name
    assert cpu_rounds._draws_match(extension.sample_categorical, 17)


def test_the_switch_turns_the_kernels_off(extension, monkeypatch):
    calls = []
    monkeypatch.setattr(extension, "chain_round", lambda *args: calls.append(1) or (None, None, None))
    monkeypatch.setattr(extension, "sample_categorical", lambda *args: calls.append(1))
    P, Q, drafts, u_accept, u_residual = _round("sd", torch.Generator().manual_seed(3), 2, 4, 17)
    monkeypatch.setattr(cpu_rounds, "ENABLED", False)
    assert cpu_rounds.decide("sd", rules.RuleParams(), P, Q, drafts, u_accept, u_residual) is None
    assert torch.equal(cpu_rounds.sample_categorical(P[:, 0], u_residual), rng.sample_categorical(P[:, 0], u_residual))
    assert not calls


def test_bound_draws_give_the_wrappers_tokens_through_the_kernel(extension, monkeypatch):
    """bound_draw (the loops' draws, the kernel looked up once): the wrappers' tokens for width-17 laws, flat and as
    a column, by the kernel; laws of another width by the unbound path; with the kernels off, the wrapper itself."""
    calls = []
    real = extension.sample_categorical
    monkeypatch.setattr(extension, "sample_categorical", lambda *args: calls.append(1) or real(*args))
    generator = torch.Generator().manual_seed(6)
    laws = cpu_rounds._test_laws(generator, (5, 17))
    u = torch.rand(5, dtype=torch.float64, generator=generator)
    flat, column = cpu_rounds.bound_draw(17, torch.device("cpu")), cpu_rounds.bound_draw(17, torch.device("cpu"), True)
    assert torch.equal(flat(laws, u), rng.sample_categorical(laws, u)) and len(calls) == 1
    assert torch.equal(column(laws, u[:, None]), rng.sample_categorical_keepdim(laws, u[:, None])) and len(calls) == 2
    wide = cpu_rounds._test_laws(generator, (5, 40))
    assert torch.equal(flat(wide, u), rng.sample_categorical(wide, u))  # checked for 17 entries only: unbound
    monkeypatch.setattr(cpu_rounds, "ENABLED", False)
    assert cpu_rounds.bound_draw(17, torch.device("cpu")) is cpu_rounds.sample_categorical


@pytest.mark.parametrize("method", ["sd", "cool_sd", "block"])
def test_the_draft_loop_decides_and_draws_in_the_kernels(extension, monkeypatch, method):
    """The draft GPT's loop (5 samples, gamma 4, CFG 1.5, seed 3): every round decided and every draw made by the
    kernels, bound once per run; the same tokens with the kernels off."""
    from specray.methods.discrete.loop import generate_tokens
    from specray.models.discrete_ar import load_pair

    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    name = cpu_rounds.ROUND_KERNELS[method]
    decided, drawn = [], []
    real_round, real_draw = getattr(extension, name), extension.sample_categorical
    monkeypatch.setattr(extension, name, lambda *args: decided.append(real_round(*args)[0]) or real_round(*args))
    monkeypatch.setattr(extension, "sample_categorical", lambda *args: drawn.append(1) or real_draw(*args))
    ids = torch.arange(5) + 11
    params = {"gamma": 4, "cfg_scale": 1.5, **({"delta": 2.0} if method == "cool_sd" else {})}
    tokens, stats = generate_tokens(method, params, pair, ids % 10, ids, 3)
    rounds = max(s.num_spec_steps for s in stats)
    assert len(decided) >= rounds and all(d is not None for d in decided)  # a round: one call per group of rows
    assert len(drawn) >= sum(s.num_draft_tokens for s in stats) / 5  # every draft step's draw for the batch
    monkeypatch.setattr(cpu_rounds, "ENABLED", False)
    decided.clear(), drawn.clear()
    assert torch.equal(generate_tokens(method, params, pair, ids % 10, ids, 3)[0], tokens) and not decided and not drawn
