"""On a CPU a discrete-AR call attends over a prefix of its static cache (``attention_span``): the
same bits as attending over the whole cache, checked here at the kernel, at the model and through
the decoding loops (``ATTENTION_SPANS`` off: every call attends over the whole cache)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import specray.models.discrete_ar as discrete_ar
from specray.families import format_options
from specray.methods.discrete.loop import run_batch
from specray.models import decode_attention
from specray.models.captions import set_caption_features
from specray.models.checkpoints.llamagen_t2i import load
from specray.models.discrete_ar import (
    DiscreteGPT,
    GPTConfig,
    KVCache,
    attention_span,
    cpu_attention_slots,
    kv_slots,
    load_pair,
)
from tests.checkpoint_fixtures import llamagen_t2i_target, reference


@pytest.fixture
def whole_cache(monkeypatch):
    """Call it to make every call attend over the whole cache, as before spans existed."""
    return lambda: monkeypatch.setattr(discrete_ar, "ATTENTION_SPANS", False)


def test_cpu_lengths_are_whole_vectors_then_whole_blocks():
    """Whole 16-slot vectors up to 192, else the block's end; the same within every later 512-block.
    A CPU cache has such a length (the whole cache sums as its spans), a cache elsewhere its own."""
    assert [cpu_attention_slots(x) for x in (1, 16, 17, 69, 90, 192, 193, 256, 375, 512)] == \
        [16, 16, 32, 80, 96, 192, 512, 512, 512, 512]
    assert [cpu_attention_slots(x) for x in (513, 581, 704, 705, 1024, 1025)] == [528, 592, 704, 1024, 1024, 1040]
    assert all(cpu_attention_slots(cpu_attention_slots(x)) == cpu_attention_slots(x) for x in range(1, 2000))
    shape = {"max_len": 69, "n_head": 2, "head_dim": 4}
    assert kv_slots(3, **shape, like=torch.zeros(())).shape == (3, 80, 2, 4)
    assert kv_slots(3, **shape, like=torch.zeros((), device="meta")).shape == (3, 69, 2, 4)
    assert attention_span(torch.tensor([[40]]), 80) == 48 and attention_span(torch.tensor([[70]]), 80) == 80


@pytest.mark.parametrize("max_len", [cpu_attention_slots(70), cpu_attention_slots(600)])  # 80, 608: a second block
@pytest.mark.parametrize("rows, n", [(1, 1), (3, 5), (2, 26)])  # a decode step, a verify, a tree
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
        assert filled <= span <= max_len and span < filled + 512
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
    """The key length of every SDPA call, in order (the decode-attention kernel off, so every call is one; the
    Python layers, whose calls go through F: the fused layers make the same calls from C++,
    tests/test_fused_layers.py)."""
    monkeypatch.setattr(decode_attention, "ENABLED", False)
    monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", False)
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
        assert min(spans) == 16 and max(spans) < cpu_attention_slots(model.max_seq_len + 5)  # the spans are in use
        whole_cache()
        spans.clear()
        whole = ragged_calls(model)
    assert set(spans) == {cpu_attention_slots(model.max_seq_len + 5)}
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
        parked = torch.tensor([[66], [62], [60]])  # row 0 parked past max_seq_len
        return [model.forward_step(torch.randint(0, 17, (3, 5)), verify, cache, prefix=False),
                model.forward_step(torch.randint(0, 17, (3, 1)), parked, cache, prefix=False)]

    with torch.inference_mode():
        capped = calls()
        assert set(spans) == {model.max_seq_len}
        whole_cache()
        whole = calls()
        assert set(spans) == {cpu_attention_slots(model.max_seq_len + 5)}
    verify_real = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(capped[0][verify_real], whole[0][verify_real])
    assert torch.equal(capped[1][1:], whole[1][1:])
    assert not torch.equal(capped[0][0, 3:], whole[0][0, 3:]) and not torch.equal(capped[1][0], whole[1][0])


def tree_hidden(model: DiscreteGPT, cache: KVCache, span: int, nodes: int) -> torch.Tensor:
    """Hidden states of a tree call of ``nodes`` nodes (slots n + v, positions n + 1 + v // 5, each node
    seeing the committed slots and the nodes before it) on 3 rows filled to 40 positions, over ``span``
    slots; one node is an EAGLE head chain's draft step."""
    torch.manual_seed(2)
    model.forward_step(torch.tensor([[1], [5], [8]]), torch.zeros(3, 1, dtype=torch.int64), cache)
    model.forward_step(torch.randint(0, 17, (3, 40)), torch.arange(1, 41).expand(3, -1), cache, prefix=False)
    n, node = torch.tensor([[10], [15], [20]]), torch.arange(nodes)
    slots, positions = n + node, n + 1 + node // 5
    key_slots = torch.arange(span)
    visible = (key_slots < n[:, :, None]) | ((key_slots >= n[:, :, None]) & (key_slots <= slots[:, :, None]))
    return model.forward_tree(torch.randint(0, 17, (3, nodes)), positions, slots, visible, cache)


@pytest.mark.parametrize("nodes, extra, rounded", [(26, 26, 96), (1, 5, 80)])
def test_tree_call_over_the_span_is_the_whole_cache_call(model, nodes, extra, rounded):
    """Tree calls (the EAGLE loops') on a cache of max_seq_len + extra slots, rounded up on a CPU: over
    their span (32 or 48 slots) the hidden states of the call over every slot. Negative control, on AVX2
    (where it was found): in a cache of exactly max_seq_len + 5 slots, a one-node call over all 69
    differs in the last bits, which is why a CPU cache is rounded up."""
    with torch.inference_mode():
        cache = model.new_cache(3, model.max_seq_len + extra)
        assert cache.max_len == rounded
        span = attention_span(torch.tensor([[20 + nodes - 1]]), cache.max_len)
        assert span <= 48
        over_span = tree_hidden(model, cache, span, nodes)
        assert torch.equal(over_span, tree_hidden(model, model.new_cache(3, model.max_seq_len + extra), rounded, nodes))
        if nodes == 1 and torch.backends.cpu.get_cpu_capability() == "AVX2":
            exact = model.max_seq_len + extra
            storage = [torch.zeros(3, 2, exact, 16).transpose(1, 2) for _ in range(4)]  # head-major, as kv_slots
            unrounded = KVCache(storage[:2], storage[2:], torch.zeros(3, dtype=torch.int64))
            assert not torch.equal(over_span, tree_hidden(model, unrounded, exact, nodes))


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
