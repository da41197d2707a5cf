"""On a CPU a discrete-AR call attends over a prefix of its static cache (``attention_span``): the
same bits as attending over the whole cache, checked here at the kernel, at the model and through
the decoding loops (the full cache is what a quantum larger than any cache gives)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import specray.models.discrete_ar as discrete_ar
from specray.families import format_options
from specray.methods.discrete.loop import run_batch
from specray.models.captions import set_caption_features
from specray.models.checkpoints.llamagen_t2i import load
from specray.models.discrete_ar import DiscreteGPT, GPTConfig, attention_span, load_pair
from tests.checkpoint_fixtures import llamagen_t2i_target, reference

WHOLE_CACHE = 1 << 30  # a quantum past every cache: attention_span returns max_len


@pytest.fixture
def whole_cache(monkeypatch):
    """Call it to make every call attend over the whole cache, as before spans existed."""
    return lambda: monkeypatch.setattr(discrete_ar, "ATTENTION_SPAN_QUANTUM", WHOLE_CACHE)


@pytest.mark.parametrize("max_len", [70, 600])  # 600: past 256 keys the kernel blocks them
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 5)])  # a decode step, a verify
def test_sdpa_over_the_span_equals_the_whole_cache_bit_for_bit(rows, n, max_len):
    """Every filled length 1 .. max_len, random inputs (seed 0): masked SDPA over the first
    ``attention_span`` slots equals masked SDPA over all of them. Negative control: slicing to exactly
    the filled length changes some results in the last bits (the kernel's vector tail), which is why
    the span is rounded up."""
    generator = torch.Generator().manual_seed(0)
    exact_differs = 0
    for filled in range(1, max_len + 1):
        q = torch.randn(rows, 2, n, 16, generator=generator)
        k, v = (torch.randn(rows, 2, max_len, 16, generator=generator) for _ in range(2))
        positions = (filled - n + torch.arange(n)).clamp(min=0).expand(rows, n)
        mask = (torch.arange(max_len) <= positions[:, :, None])[:, None]
        whole = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        span = attention_span(positions, max_len)
        assert filled <= span <= max_len and (span == max_len or span < filled + 512)
        prefix = F.scaled_dot_product_attention(q, k[:, :, :span], v[:, :, :span], attn_mask=mask[..., :span])
        assert torch.equal(prefix, whole), f"filled {filled}"
        exact = F.scaled_dot_product_attention(q, k[:, :, :filled], v[:, :, :filled], attn_mask=mask[..., :filled])
        exact_differs += not torch.equal(exact, whole)
    assert exact_differs > 0


@pytest.fixture
def model():
    """A small random GPT (seed 0), the model of the calls below."""
    torch.manual_seed(0)
    return DiscreteGPT(GPTConfig(dim=32, n_layer=2, n_head=2)).eval()


@pytest.fixture
def spans(monkeypatch):
    """The key length of every SDPA call, in order."""
    recorded = []
    sdpa = F.scaled_dot_product_attention

    def recording(q, k, v, **kwargs):
        recorded.append(k.shape[-2])
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording)
    return recorded


def ragged_calls(model: DiscreteGPT) -> list[torch.Tensor]:
    """Logits of a loop-like sequence of calls on 4 rows: prefill, decode steps, a 5-token verify on
    some rows at their own positions, and a call over every row with two parked far ahead."""
    torch.manual_seed(1)
    cache = model.new_cache(4, model.max_seq_len + 5)
    labels = torch.tensor([[0], [3], [7], [9]])
    out = [model.forward_step(labels, torch.zeros(4, 1, dtype=torch.int64), cache)]
    for t in range(1, 30):
        out.append(model.forward_step(torch.randint(0, 17, (4, 1)), torch.full((4, 1), t), cache, prefix=False))
    rows = torch.tensor([1, 3])
    starts = torch.tensor([[12], [29]])
    out.append(model.forward_step(torch.randint(0, 17, (2, 5)), starts + torch.arange(5), cache, rows=rows,
                                  prefix=False))
    parked = torch.tensor([[30], [34], [30], [60]])
    out.append(model.forward_step(torch.randint(0, 17, (4, 1)), parked, cache, prefix=False))
    return out


def test_forward_step_logits_are_the_whole_cache_logits(whole_cache, model, spans):
    with torch.inference_mode():
        with_spans = ragged_calls(model)
        assert min(spans) == 16 and max(spans) < model.max_seq_len + 5  # the spans are in use
        whole_cache()
        spans.clear()
        whole = ragged_calls(model)
    assert set(spans) == {model.max_seq_len + 5}
    for i, (a, b) in enumerate(zip(with_spans, whole)):
        assert torch.equal(a, b), f"call {i}"


def test_span_stops_at_the_slots_real_tokens_occupy():
    positions = torch.tensor([[61, 62, 63, 64, 65], [40, 41, 42, 43, 44]])  # a padded verify's tail past 63
    assert attention_span(positions, 69) == 69
    assert attention_span(positions, 69, fed=64) == 64
    assert attention_span(positions[1:], 69, fed=64) == 48  # below the cap: rounded up as before
    with pytest.raises(ValueError, match="position"):
        attention_span(positions + 4, 69, "position", fed=64)  # still refuses slots past the cache


def test_padding_past_max_seq_len_leaves_the_real_logits_whole_cache_ones(whole_cache, model, spans):
    """A verify whose padded tail and a parked row pass ``max_seq_len`` (as in a speculative loop's
    last rounds): every call attends over ``max_seq_len`` slots, and the logits at real positions
    are the whole cache's bit for bit. The padding's logits differ (it sees fewer slots), so the
    comparison does see what the span cuts off."""

    def calls() -> list[torch.Tensor]:
        torch.manual_seed(1)
        cache = model.new_cache(3, model.max_seq_len + 5)
        model.forward_step(torch.tensor([[1], [5], [8]]), torch.zeros(3, 1, dtype=torch.int64), cache)
        for t in range(1, 62):
            model.forward_step(torch.randint(0, 17, (3, 1)), torch.full((3, 1), t), cache, prefix=False)
        spans.clear()
        verify = torch.tensor([[61], [59], [57]]) + torch.arange(5)  # row 0: positions 64, 65 are padding
        parked = torch.tensor([[66], [62], [60]])  # row 0 parked at the cache's end
        return [model.forward_step(torch.randint(0, 17, (3, 5)), verify, cache, prefix=False),
                model.forward_step(torch.randint(0, 17, (3, 1)), parked, cache, prefix=False)]

    with torch.inference_mode():
        capped = calls()
        assert set(spans) == {model.max_seq_len}
        whole_cache()
        whole = calls()
        assert set(spans) == {model.max_seq_len + 5}
    verify_real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(capped[0][verify_real], whole[0][verify_real])
    assert torch.equal(capped[1][1:], whole[1][1:])
    assert not torch.equal(capped[0][0, 3:], whole[0][0, 3:]) and not torch.equal(capped[1][0], whole[1][0])


def test_caption_model_logits_are_the_whole_cache_logits(whole_cache):
    """The 120-slot caption prefix (its padding masked as keys), then one token per call."""
    ref = reference("llamagen_t2i")
    model = load(format_options("discrete_ar", llamagen_t2i_target()), "cpu").gpt
    set_caption_features(torch.tensor(ref["caption_features"]), torch.tensor(ref["caption_mask"]).bool(), model)
    tokens = torch.tensor(ref["tokens"])

    def logits() -> torch.Tensor:
        cache = model.new_cache(2)
        steps = [model.forward_step(torch.arange(2)[:, None], torch.zeros(2, 1, dtype=torch.int64), cache)]
        for i in range(tokens.shape[1] - 1):
            steps.append(model.forward_step(tokens[:, i : i + 1], torch.full((2, 1), i + 1), cache))
        return torch.cat(steps, dim=1)

    with torch.inference_mode():
        with_spans = logits()
        whole_cache()
        assert torch.equal(with_spans, logits())


@pytest.mark.parametrize("method, params, draft", [
    ("target_only", {}, "digits-gpt-draft"),
    ("sd", {"gamma": 4}, "digits-gpt-draft"),
    ("cool_sd", {"gamma": 3, "delta": 2.0}, "digits-gpt-draft"),
    ("sd", {"gamma": 4}, "digits-gpt-eagle"),  # the EAGLE head's chain: tree-style masks over the span
    ("lantern", {"tree": "small"}, "digits-gpt-eagle"),
    ("sd", {"tree": "eagle25"}, "digits-gpt-eagle"),
])
def test_samples_and_statistics_are_the_whole_cache_ones(whole_cache, method, params, draft):
    """The digits presets, 5 samples (rows finish at different rounds, so calls park rows)."""
    pair = load_pair("digits-gpt-target", draft, "cpu")
    labels, ids = torch.tensor([0, 4, 7, 7, 9]), torch.arange(5) + 11
    with_spans = run_batch(method, params, pair, labels, ids, seed=3)
    whole_cache()
    whole = run_batch(method, params, pair, labels, ids, seed=3)
    assert torch.equal(with_spans.images, whole.images)
    assert repr([s.as_row() for s in with_spans.stats]) == repr([s.as_row() for s in whole.stats])  # nan-safe
