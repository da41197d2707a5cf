"""The discrete decoding loops on the built-in digits presets."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chi2_contingency

from specray.families import family
from specray.methods.discrete import loop as discrete_loop
from specray.methods.discrete.loop import generate_tokens, run_batch
from specray.methods.params import ParamError
from specray.models.discrete_ar import load_pair
from specray.models.presets import get_preset

torch.set_num_threads(1)

METHODS = list(family("discrete_ar").methods)


def resolve_params(method, params):
    """``method``'s typed parameters, through the family table (what the spec and the actor use)."""
    return family("discrete_ar").parse_params(method, params)


pytestmark = pytest.mark.skipif(
    not get_preset("digits-gpt-target").weights_path.exists() or not get_preset("digits-gpt-draft").weights_path.exists(),
    reason="discrete preset weights not trained",
)


@pytest.fixture(scope="module")
def pair():
    return load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")


# ---- parameters ----------------------------------------------------------------------------------


def test_resolve_params_defaults_and_errors():
    assert resolve_params("sd", None).gamma == 4
    assert resolve_params("cool_sd", {"delta": 2.0}).delta == 2.0
    assert set(METHODS) == {"target_only", "sd", "block", "lantern", "cool_sd", "uniform_rsd"}
    with pytest.raises(KeyError, match="unknown method 'eagle' for family 'discrete_ar'"):
        resolve_params("eagle", {})
    with pytest.raises(ParamError, match=r"^gamma: must be an integer in \[1, 64\], got 0"):
        resolve_params("sd", {"gamma": 0})
    with pytest.raises(ParamError, match="^gamma: unknown parameter; allowed: "):
        resolve_params("target_only", {"gamma": 3})
    with pytest.raises(ParamError, match="^top_p: "):
        resolve_params("block", {"top_p": 1.5})
    with pytest.raises(ParamError, match="^mode: must be one of 'lambda', 'delta'"):
        resolve_params("lantern", {"mode": "kappa"})
    with pytest.raises(ParamError, match="^lam: "):
        resolve_params("lantern", {"lam": 0.5})
    # COOL-SD's multipliers must be float64 numbers (an infinite ω times a zero mass is a NaN law)
    with pytest.raises(ParamError, match=r"^mu: the multipliers .* overflow float64 .* allowed: "):
        resolve_params("cool_sd", {"gamma": 1, "mu": -720.0})
    with pytest.raises(ParamError, match=r"^nu: the multipliers .* overflow"):
        resolve_params("cool_sd", {"nu": 1000.0})  # mu null: the mean of exp(-nu i) underflows to 0
    assert resolve_params("cool_sd", {"gamma": 1, "mu": -700.0}).mu == -700.0  # large but finite


def test_bad_labels_fail_clearly(pair):
    with pytest.raises(ValueError, match="class labels"):
        run_batch("sd", {}, pair, torch.tensor([10]), torch.tensor([0]), seed=0)


# ---- determinism and bookkeeping ---------------------------------------------------------------------


@pytest.mark.parametrize("method", list(METHODS))
def test_sample_is_independent_of_its_batch_companions(pair, method):
    """Same (seed, sample_id) -> same tokens alone and inside a batch of 8 with other companions."""
    params = resolve_params(method, {})
    labels = torch.tensor([3, 0, 7, 1, 9, 4, 2, 5])
    sample_ids = torch.tensor([42, 7, 1001, 3, 58, 11, 999, 123])
    batch_tokens, batch_stats = generate_tokens(method, params, pair, labels, sample_ids, seed=5)
    other_tokens, _ = generate_tokens(method, params, pair, torch.tensor([6, 3, 8]), torch.tensor([5, 42, 77]), seed=5)
    alone_tokens, alone_stats = generate_tokens(method, params, pair, labels[:1], sample_ids[:1], seed=5)
    assert torch.equal(alone_tokens[0], batch_tokens[0])
    assert torch.equal(other_tokens[1], batch_tokens[0])
    assert alone_stats[0] == batch_stats[0]
    again, _ = generate_tokens(method, params, pair, labels, sample_ids, seed=5)
    assert torch.equal(again, batch_tokens)
    different_seed, _ = generate_tokens(method, params, pair, labels, sample_ids, seed=6)
    assert not torch.equal(different_seed, batch_tokens)


@pytest.mark.parametrize("method", list(METHODS))
def test_growing_caches_give_the_static_caches_samples(pair, monkeypatch, method):
    """Every method, 20 samples (rows finish at different rounds, so calls park rows), seed 4: the same
    tokens and statistics with caches that grow with their calls (discrete_ar.GROWING_CACHES, every cache
    however small, the speculative loop's target's too) as with caches holding every slot from the start; the caches
    did grow."""
    from specray.models import discrete_ar

    monkeypatch.setattr(discrete_ar, "GROWING_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(discrete_ar, "FEW_READS_WHOLE_IN_LAST_LEVEL_CACHE", False)
    params = resolve_params(method, {})
    labels, sample_ids = torch.arange(20) % 10, torch.arange(20) + 300
    grown = []
    real = discrete_ar._grown
    monkeypatch.setattr(discrete_ar, "_grown", lambda old, slots: grown.append(slots) or real(old, slots))
    growing = generate_tokens(method, params, pair, labels, sample_ids, seed=4)
    assert {32, 48, 64} <= set(grown)
    monkeypatch.setattr(discrete_ar, "GROWING_CACHES", False)
    grown.clear()
    static = generate_tokens(method, params, pair, labels, sample_ids, seed=4)
    assert not grown
    assert torch.equal(growing[0], static[0])
    assert growing[1] == static[1]


def test_the_speculative_loops_target_cache_grows_only_past_the_last_level_cache(pair, monkeypatch):
    """sd and target_only, 3 samples, every cache that can grow set to (GROWING_CACHE_MIN_BYTES 0): the speculative
    loop's target cache (few_reads) holds every slot from the start where it fits in the CPU's last-level cache and
    grows where it does not (or where that cache is unknown); the draft's and target_only's grow either way."""
    from specray.models import discrete_ar

    monkeypatch.setattr(discrete_ar, "GROWING_CACHE_MIN_BYTES", 0)
    caches = []
    real = discrete_ar.DiscreteGPT.new_cache

    def recorded(model, *args, **kwargs):
        cache = real(model, *args, **kwargs)
        caches.append((model is pair.target, cache.slots is not None))
        return cache

    monkeypatch.setattr(discrete_ar.DiscreteGPT, "new_cache", recorded)
    labels, sample_ids = torch.arange(3), torch.arange(3)
    # sd's target cache whole: 3 samples' two CFG streams, 80 slots (64 + gamma 4 + 1, rounded), 12 layers' K and V
    c = pair.target.config
    slots = discrete_ar.cpu_attention_slots(pair.target.max_seq_len + 5)
    whole_bytes = 6 * slots * 2 * c.n_layer * c.n_head * c.head_dim * 4
    for last_level, target_grows in ((whole_bytes, False), (whole_bytes - 1, True), (None, True)):
        monkeypatch.setattr(discrete_ar, "last_level_cache_bytes", lambda: last_level)
        caches.clear()
        generate_tokens("sd", resolve_params("sd", {}), pair, labels, sample_ids, seed=1)
        assert caches == [(True, target_grows), (False, True)], last_level  # (target's, grows)
        caches.clear()
        generate_tokens("target_only", {}, pair, labels, sample_ids, seed=1)
        assert caches == [(True, True)], last_level


@pytest.mark.parametrize("method", list(METHODS))
def test_statistics_are_consistent(pair, method):
    result = run_batch(method, {}, pair, torch.arange(6), torch.arange(6), seed=1)
    assert result.images.shape == (6, 8, 8) and result.images.dtype == torch.uint8
    for s in result.stats:
        assert s.num_tokens == 64
        if method == "target_only":
            assert (s.target_calls, s.draft_calls, s.num_spec_steps, s.num_draft_tokens) == (64, 0, 0, 0)
            assert s.mean_acceptance_length == 1.0
            continue
        assert s.target_calls == 1 + s.num_spec_steps
        assert 1 + s.num_spec_steps + s.num_accepted_draft_tokens == 64  # prefill token + (n_acc + 1) per round
        assert s.draft_calls == s.num_draft_tokens <= 4 * s.num_spec_steps
        assert len(s.accepted_per_position) == 4 and sum(s.accepted_per_position) == s.num_accepted_draft_tokens
        assert s.accepted_per_position == sorted(s.accepted_per_position, reverse=True)


def test_first_token_is_shared_with_target_only(pair):
    """The prefill's token is keyed like target_only's first one, whatever draws it (torch's operations or the
    kernel). At temperature 8 the first token's law is wide enough that another seed changes some (at 1 nearly
    every digit starts with the same background token)."""
    labels, ids = torch.arange(10), torch.arange(10)
    hot = {"temperature": 8.0}
    base, _ = generate_tokens("target_only", resolve_params("target_only", hot), pair, labels, ids, seed=3)
    spec, _ = generate_tokens("sd", resolve_params("sd", hot), pair, labels, ids, seed=3)
    assert torch.equal(base[:, 0], spec[:, 0])
    other, _ = generate_tokens("sd", resolve_params("sd", hot), pair, labels, ids, seed=4)
    assert not torch.equal(other[:, 0], spec[:, 0])


# ---- losslessness (Monte Carlo) ----------------------------------------------------------------------

# Per-position marginals of target_only vs the exact rules, N samples each, one class, independent seeds.
MC_SAMPLES = 600
MC_LABEL = 3
MC_POSITIONS = (19, 27, 36, 44)  # pixels inside the digit, where the distribution is spread out
MC_ALPHA = 1e-3


@pytest.fixture(scope="module")
def target_only_tokens(pair):
    labels = torch.full((MC_SAMPLES,), MC_LABEL)
    return generate_tokens("target_only", resolve_params("target_only", {}), pair, labels, torch.arange(MC_SAMPLES),
                           seed=1000)[0]


def marginal_p_values(pair, base, method, params, seed):
    labels = torch.full((MC_SAMPLES,), MC_LABEL)
    ids = torch.arange(MC_SAMPLES)
    other, _ = generate_tokens(method, resolve_params(method, params), pair, labels, ids, seed=seed)
    p_values = []
    for pos in MC_POSITIONS:
        table = torch.stack([torch.bincount(base[:, pos], minlength=17), torch.bincount(other[:, pos], minlength=17)])
        table = table[:, table.sum(0) > 0]
        p_values.append(chi2_contingency(table.numpy())[1])
    return p_values


@pytest.mark.slow
@pytest.mark.parametrize("method", ["sd", "block"])
def test_exact_rules_match_target_marginals(pair, target_only_tokens, method):
    """N=600 per arm, seeds 1000 (target_only) and 2000; chi-square two-sample p > 1e-3 at every position."""
    p_values = marginal_p_values(pair, target_only_tokens, method, {}, seed=2000)
    assert min(p_values) > MC_ALPHA, p_values


@pytest.mark.slow
def test_marginal_check_detects_a_lossy_rule(pair, target_only_tokens):
    """Negative control: uniform_rsd with delta=1000 accepts (almost) every draft, i.e. samples the draft model."""
    p_values = marginal_p_values(pair, target_only_tokens, "uniform_rsd", {"delta": 1000.0}, seed=2000)
    assert min(p_values) < MC_ALPHA, p_values


@pytest.mark.slow
def test_relaxed_rules_accept_more_than_sd(pair):
    """Spec §9.16 on the presets: same seed (9), 256 samples of mixed classes.

    256, not 32: the margins are small (uniform_rsd at delta 1.1 and block gain ~0.05-0.1 tokens
    per target call over sd) and the arms' samples diverge after the first rejection, so 32
    samples flip the order for some seeds (seed 1: block 2.91 < sd 2.99). At 256 samples every
    order below holds for seeds 1, 2 and 9 (seed 9: sd 2.95, block 3.04, uniform_rsd 3.01,
    lantern 3.13, cool_sd delta=2.0 3.28).

    Not asserted: COOL-SD at its default delta=1.1 vs sd. With the mean-normalised mu and
    gamma=4 the schedule is (2.36, 1.17, 0.58, 0.29), stricter than sd at positions 3-4, and
    on these presets it accepts fewer tokens than sd (2.81 vs 2.95 tokens per target call on
    256 samples); at delta=2.0 it accepts more.
    """
    labels, ids = torch.arange(256) % 10, torch.arange(256)

    def mean_length(method, params=None):
        _, stats = generate_tokens(method, resolve_params(method, params or {}), pair, labels, ids, seed=9)
        return sum(s.num_tokens for s in stats) / sum(s.target_calls for s in stats)

    sd = mean_length("sd")
    assert mean_length("cool_sd", {"delta": 2.0}) > sd
    assert mean_length("uniform_rsd") > sd
    assert mean_length("lantern") > sd
    assert mean_length("cool_sd", {"delta": 2.0}) > mean_length("cool_sd", {"delta": 1.1})
    assert mean_length("block") >= sd


def test_module_is_the_registered_family_loop():
    from specray.families import family

    assert family("discrete_ar").loop() is discrete_loop.run_batch
