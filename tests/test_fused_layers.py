"""A discrete model's layers in one C++ call (``discrete_ar.FusedLayers``, ``csrc/cached_layers.cpp``), and whole
calls in one (``FusedLayers.step``, ``tree_step``, ``head_step``), against the Python layers: the same logits, hidden
states, K/V and cache lengths, call by call, for every way a call writes and reads its cache."""

from __future__ import annotations

import types

import pytest
import torch

from specray.models import cpu_kernels, discrete_ar
from specray.models.discrete_ar import CfgSoftmax, DiscreteGPT, FusedLayers, GPTConfig, fused_layers
from specray.models.eagle_head import EagleHead, EagleHeadConfig

torch.set_num_threads(1)
ROWS = 64  # with 4-token verifies, the BLOCK_WRITE_MIN_TOKENS a BlockWrite needs


@pytest.fixture(autouse=True)
def _extension():
    if cpu_kernels.extension() is None:
        pytest.skip("specray's CPU kernels did not build here (see the log)")


def random_weights(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Weights larger than the init's, so that a difference would show in every output."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return module.eval()


def gpt_calls(model: DiscreteGPT) -> tuple[list[torch.Tensor], discrete_ar.KVCache]:
    """A loop's calls on one cache, each output kept: the prefix (every row at slot 0), level steps (slice writes),
    a ragged 4-token verify of every row (a BlockWrite), a ragged step (indexed writes), three rows of the batch
    (indexed writes, gathered reads), a tree call over explicit slots and a mask, and one with its logits."""
    g = torch.Generator().manual_seed(3)
    labels = torch.randint(0, 10, (ROWS,), generator=g)
    tokens = torch.randint(0, 17, (ROWS, 64), generator=g)
    cache = model.new_cache(ROWS)
    out = [model.prefill(labels, cache)]
    for t in range(1, 10):
        level = torch.full((ROWS, 1), t)
        out.append(model.forward_step(tokens[:, t - 1 : t], level, cache, prefix=False))
    lengths = torch.randint(3, 10, (ROWS,), generator=g)
    cache.crop(lengths)
    verify = lengths[:, None] + torch.arange(4)
    out.append(model.forward_step(tokens.gather(1, verify - 1), verify, cache, prefix=False))
    step = (lengths + 4)[:, None]
    out.append(model.forward_step(tokens.gather(1, step - 1), step, cache, prefix=False))
    rows = torch.tensor([5, 17, 3])
    some = (lengths[rows] + 5)[:, None] + torch.arange(2)
    out.append(model.forward_step(tokens[rows].gather(1, some - 1), some, cache, rows=rows))
    slots = (lengths[rows] + 7)[:, None] + torch.arange(3)
    visible = torch.arange(32)[None, None, :] <= slots[:, :, None]
    out.append(model.forward_tree(tokens[rows, :3], slots - 1, slots, visible, cache, rows=rows))
    out.extend(model.forward_tree_logits(tokens[rows, 3:6], slots + 2, slots + 3, visible, cache, rows=rows))
    # The calls' probabilities made by them: guided (the rows' halves as CFG streams) and not.
    after = (lengths + 5)[:, None]
    out.append(model.forward_step(tokens.gather(1, after - 1), after, cache, prefix=False, softmax=CfgSoftmax(1.5)))
    out.extend(model.forward_tree_logits(tokens[rows, 6:9], slots + 5, slots + 6, visible, cache, rows=rows,
                                         softmax=CfgSoftmax()))
    return out, cache


def run_both(calls, monkeypatch) -> tuple[tuple, tuple, list[str]]:
    """``calls()`` with the fused layers and with the Python layers, and the fused calls made: ``layers`` (the layers
    alone) or the name of the :class:`FusedLayers` method that ran a whole call each."""
    made = []

    def counting(name, original):
        def counted(self, *args, **kwargs):
            made.append(name)
            return original(self, *args, **kwargs)
        return counted

    monkeypatch.setattr(FusedLayers, "__call__", counting("layers", FusedLayers.__call__))
    for name in ("step", "tree_step", "head_step"):
        monkeypatch.setattr(FusedLayers, name, counting(name, getattr(FusedLayers, name)))
    with torch.inference_mode():
        fused = calls()
        monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", False)
        python = calls()
    return fused, python, made


def assert_same(fused: tuple, python: tuple) -> None:
    (fused_out, fused_cache), (python_out, python_cache) = fused, python
    assert len(fused_out) == len(python_out)
    for a, b in zip(fused_out, python_out):
        assert torch.equal(a, b)
    for a, b in zip(fused_cache.keys + fused_cache.values, python_cache.keys + python_cache.values):
        assert torch.equal(a, b)
    assert torch.equal(fused_cache.lengths, python_cache.lengths)


@pytest.mark.parametrize("step", [True, False], ids=["step", "layers"])
@pytest.mark.parametrize("block_copies", [True, False], ids=["cpp-copies", "indexed"])
@pytest.mark.parametrize("shape", [{"dim": 64, "n_layer": 3, "n_head": 4}, {"dim": 48, "n_layer": 1, "n_head": 2}],
                         ids=["heads-of-16", "heads-of-24"])
def test_fused_gpt_layers_give_the_python_layers_values(shape, block_copies, step, monkeypatch):
    """The digits target's and draft's head sizes (the first where the decode-attention kernel may serve), 3 and 1
    layers, random weights, the BlockWrite's C++ row copies on and off, the whole call in one (``step``: the 13
    cached forwards, the tree call with its logits) or the layers alone: every call's logits (tree calls: hidden
    states too; and a step and a tree call making their probabilities, CfgSoftmax, in the call), every K/V slot and
    the cache lengths equal bit for bit, the fused calls having made all 17 calls, with the probabilities made in
    C++ and in Python after the call (FUSED_SOFTMAX). Negative control: fused layers with w1 and w3 swapped differ."""
    monkeypatch.setattr(discrete_ar, "BLOCK_WRITE_KERNEL", block_copies)
    monkeypatch.setattr(discrete_ar, "FUSED_STEP", step)
    model = random_weights(DiscreteGPT(GPTConfig(**shape)), seed=1)
    fused, python, made = run_both(lambda: gpt_calls(model), monkeypatch)
    assert made == (["step"] * 13 + ["layers", "tree_step", "step", "tree_step"] if step else ["layers"] * 17)
    assert_same(fused, python)
    monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", True)
    monkeypatch.setattr(discrete_ar, "FUSED_SOFTMAX", False)
    with torch.inference_mode():
        assert_same(gpt_calls(model), python)

    swapped = FusedLayers(list(model.layers))
    swapped.weights[4], swapped.weights[5] = swapped.weights[5], swapped.weights[4]
    monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", True)
    monkeypatch.setitem(discrete_ar._FUSED, model, swapped)
    with torch.inference_mode():
        wrong, _ = gpt_calls(model)
    assert not torch.equal(wrong[1], python[0][1])


def test_a_fused_step_reading_the_wrong_rotary_rows_differs(monkeypatch):
    """Negative control for the step's own lookups: a step reading each position's rotary factors one row off (its
    table rolled by a row) gives other logits than the Python layers at the first decode step."""
    model = random_weights(DiscreteGPT(GPTConfig(dim=48, n_layer=1, n_head=2)), seed=1)
    original = FusedLayers.step

    def rolled(self, model, *args, **kwargs):
        shifted = types.SimpleNamespace(tok_embeddings=model.tok_embeddings, rope_table=model.rope_table.roll(1, 0),
                                        norm=model.norm, output=model.output)
        return original(self, shifted, *args, **kwargs)

    monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", False)
    with torch.inference_mode():
        python, _ = gpt_calls(model)
        monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", True)
        monkeypatch.setattr(FusedLayers, "step", rolled)
        wrong, _ = gpt_calls(model)
    assert not torch.equal(wrong[1], python[1])


def head_calls(head: EagleHead, target: DiscreteGPT | None = None,
               softmax: CfgSoftmax | None = None) -> tuple[list[torch.Tensor], discrete_ar.KVCache]:
    """An EAGLE head's cached calls: every row, 3 tokens at ragged slots with a causal mask; then two of the rows.
    With a ``target``: the same calls with their logits by its output layer (their ``softmax``, if given)."""
    g = torch.Generator().manual_seed(4)
    cache = head.new_cache(ROWS, 40)
    starts = torch.randint(1, 20, (ROWS, 1), generator=g)
    out = []
    for rows, n in ((None, 3), (torch.tensor([9, 2]), 2)):
        r = ROWS if rows is None else rows.shape[0]
        slots = (starts if rows is None else starts[rows] + 3) + torch.arange(n)
        visible = (torch.arange(cache.keys[0].shape[1])[None, None, :] <= slots[:, :, None]) & (
            torch.arange(cache.keys[0].shape[1]) >= 1)
        features = torch.randn(r, n, head.config.dim, generator=g)
        tokens = torch.randint(0, 17, (r, n), generator=g)
        if target is None:
            out.append(head.forward_cached(features, tokens, slots, slots, visible, cache, rows=rows))
        else:
            out.extend(head.forward_cached_logits(features, tokens, slots, slots, visible, cache, target, rows=rows,
                                                  softmax=softmax))
    return out, cache


@pytest.mark.parametrize("logits", ["layer", "with-logits", "with-probs"])
@pytest.mark.parametrize("input_norm", [False, True], ids=["eagle1", "input-norm"])
def test_fused_head_layer_gives_the_python_layers_values(input_norm, logits, monkeypatch):
    """An EAGLE head's layer (with and without its input norm, a bool mask, indexed writes), alone and with its
    input layer and the target's output layer in the same call (and the guided probabilities of its logits,
    CfgSoftmax): the same predictions, logits or probabilities and K/V, both calls fused."""
    head = random_weights(EagleHead(EagleHeadConfig(vocab_size=17, dim=64, n_head=4, ffn_hidden=192, grid_size=8,
                                                    input_norm=input_norm)), seed=2)
    target = None if logits == "layer" else random_weights(DiscreteGPT(GPTConfig(dim=64, n_layer=1, n_head=4)), seed=5)
    softmax = CfgSoftmax(1.5) if logits == "with-probs" else None
    fused, python, made = run_both(lambda: head_calls(head, target, softmax), monkeypatch)
    assert made == ["layers" if target is None else "head_step"] * 2
    assert_same(fused, python)


def test_the_python_layers_run_with_autograd_in_training_and_off_the_switch(monkeypatch):
    """Only eager float32 CPU inference with the complex rotary factor is fused."""
    model = DiscreteGPT(GPTConfig(dim=32, n_layer=1, n_head=2)).eval()
    h, keys = torch.zeros(1, 1, 32), [torch.zeros(1, 16, 2, 16)]
    rope = discrete_ar.rotary_complex(model.rope_table[torch.zeros(1, 1, dtype=torch.int64)])
    with torch.inference_mode():
        assert isinstance(fused_layers(model, h, rope, keys), FusedLayers)
        assert fused_layers(model, h, (rope, rope), keys) is None  # the (cos, sin) factors: the compiled step's form
        assert fused_layers(model, h.double(), rope, keys) is None
        model.train()
        assert fused_layers(model, h, rope, keys) is None
        model.eval()
        monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", False)
        assert fused_layers(model, h, rope, keys) is None
    assert fused_layers(model, h, rope, keys) is None  # autograd on
