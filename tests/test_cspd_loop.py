"""The continuous_ar loop module: parameters, call counts, identity invariants (spec T7a, T8), stats."""

from __future__ import annotations

import math

import pytest
import torch

from specray.families import family
from specray.methods.continuous import loop as cl
from specray.methods.params import ParamError
from specray.models.continuous_ar import levels_to_tokens, load_pair, tokens_to_uint8
from specray.models.digits import load_digits_split, to_uint8_pixels

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def draft_pair():
    # Mq := Mp (same weights) gives the identity invariants of spec T8
    return load_pair("digits-mar-draft", "digits-mar-draft", torch.device("cpu"))


@pytest.fixture(scope="module")
def real_pair():
    return load_pair("digits-mar-target", "digits-mar-draft", torch.device("cpu"))


def test_resolve_params_modes_and_errors() -> None:
    resolve = family("continuous_ar").parse_params
    p = resolve("cspd", {})
    assert (p.mode, p.sigma_orientation, p.kappa, p.final_step_noise, p.window) == ("exact", "none", 1.0, True, "mar")
    assert resolve("cspd", {"mode": "code"}).kappa == 42.0
    assert resolve("cspd", {"mode": "paper", "kappa": 42}).sigma_orientation == "paper"
    with pytest.raises(ParamError, match="^kappa: .*exact"):
        resolve("cspd", {"mode": "exact", "kappa": 42})
    with pytest.raises(ParamError, match="^window: .*sequential"):
        resolve("cspd", {"window": "llm"})
    with pytest.raises(ParamError, match="^mode: "):
        resolve("cspd", {"mode": "fast"})
    with pytest.raises(ParamError, match="unknown parameter"):
        resolve("target_only", {"gamma": 4})
    with pytest.raises(KeyError, match="unknown method 'medusa' for family 'continuous_ar'"):
        resolve("medusa", {})


def test_tokens_roundtrip_digits() -> None:
    images, _ = load_digits_split("heldout")
    assert torch.equal(tokens_to_uint8(levels_to_tokens(images)), to_uint8_pixels(images))


def test_identity_gamma1_is_bit_identical_to_target_only(draft_pair) -> None:
    labels, sids = torch.tensor([3, 7, 0]), torch.tensor([10, 11, 12])
    base = cl.run_batch("target_only", {}, draft_pair, labels, sids, seed=5)
    for mode in ("paper", "code"):
        out = cl.run_batch("cspd", {"mode": mode, "gamma": 1}, draft_pair, labels, sids, seed=5)
        assert torch.equal(out.images, base.images)
        assert all(s.draft_acceptance_rate == 1.0 and s.extra["mean_log_ratio"] == 0.0 for s in out.stats)
    with_cfg = cl.run_batch("target_only", {"cfg": 3.0}, draft_pair, labels, sids, seed=5)
    out = cl.run_batch("cspd", {"mode": "paper", "gamma": 1, "cfg": 3.0}, draft_pair, labels, sids, seed=5)
    assert torch.equal(out.images, with_cfg.images)


def test_call_counts_prefill_and_window_semantics(draft_pair) -> None:
    labels, sids = torch.tensor([1, 2]), torch.tensor([0, 1])
    for gamma, rho in [(4, 0.05), (8, 0.05), (4, 0.2)]:
        out = cl.run_batch("cspd", {"gamma": gamma, "prefill_ratio": rho, "mode": "paper"}, draft_pair, labels, sids, 0)
        n_pre = len([k for k in range(16) if k <= rho * 16])
        verify = len([k for k in range(n_pre, 16) if k % gamma == 0 or k == 15])
        for s in out.stats:
            assert s.target_calls == n_pre + verify  # spec §7.7
            assert s.draft_calls == 16 - n_pre
            assert s.num_draft_tokens == 16 - n_pre and s.num_tokens == 16
            assert len(s.accepted_per_position) == gamma
            assert {"mean_resample_tries", "resample_cap_hits"} <= set(s.extra)


def test_sequential_window_emits_all_tokens_and_counts(real_pair) -> None:
    labels, sids = torch.tensor([4, 9, 2]), torch.tensor([0, 1, 2])
    out = cl.run_batch("cspd", {"window": "sequential", "mode": "code", "gamma": 4}, real_pair, labels, sids, 0)
    assert out.images.shape == (3, 8, 8) and out.images.dtype == torch.uint8
    for s in out.stats:
        assert s.num_accepted_draft_tokens <= s.num_draft_tokens
        # each round emits accepted drafts + one residual/bonus token (the last round may emit no extra)
        assert s.num_tokens - 1 <= s.num_accepted_draft_tokens + s.num_spec_steps + 1 <= s.num_tokens + 1
        assert s.target_calls == 1 + s.num_spec_steps


def test_alignment_raises_acceptance_on_presets(real_pair) -> None:
    labels, sids = torch.arange(8) % 10, torch.arange(8)
    rates = {}
    for no_align in (False, True):
        out = cl.run_batch("cspd", {"mode": "code", "gamma": 4, "no_align": no_align}, real_pair, labels, sids, 0)
        rates[no_align] = sum(s.num_accepted_draft_tokens for s in out.stats) / sum(s.num_draft_tokens for s in out.stats)
    assert rates[False] > rates[True] + 0.1, rates


def test_noise_indexed_by_position_prefill_equals_target_only(real_pair) -> None:
    # T7a/T8: pre-fill tokens are the target-only tokens of the same steps (same order, x_T, ε)
    labels, sids = torch.tensor([5, 6]), torch.tensor([3, 4])
    base = cl.run_batch("target_only", {"order": "raster"}, real_pair, labels, sids, 1)
    out = cl.run_batch("cspd", {"order": "raster", "mode": "paper", "prefill_ratio": 0.2}, real_pair, labels, sids, 1)
    # steps k ≤ 3.2 -> tokens 0..3 in raster order = the top two patch rows' first... compare patch row 0 (4 tokens)
    assert torch.equal(out.images[:, :2, :], base.images[:, :2, :])


def test_head_frequencies_are_cached_per_size_with_the_formula_bits() -> None:
    """The head's timestep embedding reads its frequencies from a cache: at widths 160 and 64 (the
    presets' heads) and timesteps 0..999, exactly the embedding computed per call, and the cached
    tensor is a plain one even when the first call came in inference mode (training reads it too)."""
    from specray.models import continuous_ar

    continuous_ar._cached_time_frequencies.cache_clear()
    t = torch.arange(1000)
    for width in (160, 64, 160):  # a cache keyed without the size would serve 160's to 64
        with torch.inference_mode():
            cached = continuous_ar.timestep_embedding(t, width)
        freqs = torch.exp(-math.log(10000.0) * torch.arange(width // 2, dtype=torch.float32) / (width // 2))
        args = t.to(torch.float32).unsqueeze(-1) * freqs
        assert torch.equal(cached, torch.cat([torch.cos(args), torch.sin(args)], dim=-1)), width
    assert continuous_ar._cached_time_frequencies.cache_info().misses == 2
    assert not continuous_ar._cached_time_frequencies(80, 10000.0, t.device).is_inference()
