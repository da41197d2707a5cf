"""LlamaGen c2i GPT + VQ-16 loaded from the release format reproduce the official code.

Reference: tests/fixtures/checkpoints/llamagen (tools/make_reference_fixtures.py ran the official
FoundationVision/LlamaGen code on a tiny configuration with random weights). Tolerance rule of spec
checkpoints.md: |x - ref| <= atol + 1e-5 |ref|; atol 2e-5 for logits (values up to ~8, CFG 4 scales
differences by 7), 1e-6 for probabilities; integer outputs (codes, greedy tokens) match exactly.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specray.families import format_options
from specray.methods.discrete.loop import GuidedModel
from specray.methods.discrete.params import Sampling
from specray.models.checkpoints.autoencoders import VQModel
from specray.models.checkpoints.llamagen import load
from specray.models.discrete_ar import GPTConfig, load_pair, precompute_rope_2d
from tests.checkpoint_fixtures import assert_close as close  # noqa: F401
from tests.checkpoint_fixtures import llamagen_draft, llamagen_target, reference

pytestmark = pytest.mark.usefixtures("single_thread")

REF = reference("llamagen")
N = REF["tokens"].shape[1]




@pytest.fixture(scope="module")
def loaded():
    return load(format_options("discrete_ar", llamagen_target()), "cpu")


def test_full_sequence_logits(loaded):
    logits = loaded.gpt(torch.tensor(REF["labels"]), torch.tensor(REF["tokens"]))
    close(logits, REF["full_logits"], 2e-5)


def test_kv_cache_logits_step_by_step_equal_official_and_full_sequence(loaded):
    gpt = loaded.gpt
    labels, tokens = torch.tensor(REF["labels"]), torch.tensor(REF["tokens"])
    cache = gpt.new_cache(4)
    rows = torch.cat([labels, torch.full_like(labels, gpt.null_class)])
    steps = [gpt.forward_step(rows[:, None], torch.zeros(4, 1, dtype=torch.int64), cache)[:, -1]]
    for i in range(N - 1):
        x = tokens[:, i : i + 1]
        steps.append(gpt.forward_step(torch.cat([x, x]), torch.full((4, 1), i + 1), cache)[:, -1])
    cached = torch.stack(steps, dim=1)
    close(cached[:2], REF["cached_cond_logits"], 2e-5)
    close(cached[2:], REF["cached_uncond_logits"], 2e-5)
    close(cached[:2], REF["full_logits"], 2e-5)  # the cache changes nothing


SETTINGS = {"cfg4": dict(cfg_scale=4.0, temperature=1.0, top_k=0, top_p=1.0, cfg_interval=-1),
            "mixed": dict(cfg_scale=1.75, temperature=0.9, top_k=20, top_p=0.9, cfg_interval=2)}


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_sampler_distributions_and_greedy_tokens(loaded, name):
    """The processed law (CFG on raw logits, cfg_interval, temperature, top-k, top-p) at every step along
    the official token path, through the loop's own GuidedModel; its argmax path is official greedy decoding."""
    sampling = Sampling.parse(SETTINGS[name])
    labels, tokens = torch.tensor(REF["labels"]), torch.tensor(REF["tokens"])
    idx = torch.arange(2)
    for feed, expected in ((tokens, REF[f"probs_{name}"]), (None, None)):
        stream = GuidedModel(loaded.gpt, 2, sampling, loaded.gpt.max_seq_len)
        fed, chosen, laws = labels[:, None], [], []
        for t in range(N):
            probs = stream.probs(idx, fed, torch.full((2, 1), t), prefix=t == 0)[:, 0]
            laws.append(probs)
            chosen.append(probs.argmax(-1))
            fed = (feed[:, t] if feed is not None else chosen[-1])[:, None]
        if feed is not None:
            close(torch.stack(laws, 1), expected, 1e-6)
        else:
            assert np.array_equal(torch.stack(chosen, 1).numpy(), REF[f"greedy_{name}"])


def test_rope_of_a_head_dim_100_model_matches_official():
    """GPT-3B has head_dim 100: 25 frequencies per axis; the class token's entry is all zeros."""
    table = precompute_rope_2d(GPTConfig(dim=100, n_head=1, n_layer=1, grid_size=24))
    close(table, REF["rope_head100_grid24"], 1e-6)
    assert not table[0].any()


def test_vq_encode_and_decode(loaded):
    vq: VQModel = loaded.decoder.vq
    codes = vq.encode(torch.tensor(REF["vq_images"])).reshape(2, -1)
    assert np.array_equal(codes.numpy(), REF["vq_codes"])
    decoded = vq.decode_code(torch.tensor(REF["tokens"]), (4, 4))
    close(decoded, REF["vq_decoded"], 1e-5)
    pixels = loaded.decoder(torch.tensor(REF["tokens"]))  # bicubic to 16 px, LlamaGen's uint8 rule
    assert pixels.shape == (2, 16, 16, 3) and pixels.dtype == torch.uint8
    diff = np.abs(pixels.numpy().astype(int) - REF["vq_uint8_16"].astype(int))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01  # truncation at a float boundary may flip one level


def test_pair_exposes_decoder_and_codebook():
    pair = load_pair(llamagen_target(), llamagen_draft(), "cpu")
    assert pair.info["codebook"].shape == (64, 8)
    assert torch.allclose(pair.info["codebook"].norm(dim=-1), torch.ones(64))
    assert pair.draft.config.n_layer == 1 and pair.target.config.n_layer == 2
    assert pair.info["image_decoder"] is not None


def test_half_precision_weights_option():
    """dtype bfloat16: weights and KV cache in bf16, the sampler's laws still float32 and close to float32's."""
    half = load(format_options("discrete_ar", llamagen_target(dtype="bfloat16", tokenizer=None)), "cpu").gpt
    assert half.output.weight.dtype == torch.bfloat16
    sampling = Sampling.parse(SETTINGS["cfg4"])
    stream = GuidedModel(half, 2, sampling, half.max_seq_len)
    probs = stream.probs(torch.arange(2), torch.tensor(REF["labels"])[:, None], torch.zeros(2, 1, dtype=torch.int64),
                         prefix=True)[:, 0]
    assert probs.dtype == torch.float32 and torch.allclose(probs.sum(-1), torch.ones(2))
    assert np.abs(probs.detach().numpy() - REF["probs_cfg4"][:, 0]).max() < 0.05  # bf16 rounding, not a different law
