"""An EAGLE drafter in LANTERN's released layout on the LlamaGen c2i release loader (random-weight fixtures).

The released LANTERN drafters load through the checkpoint layer's safe reader and pair with a
``llamagen-c2i`` target; LANTERN's neighbourhoods are then taken in the VQ tokenizer's codebook
space, not in the GPT's input embeddings (spec discrete_sd.md §3.1).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from specray.methods.discrete.lantern import neighbours_from_embeddings
from specray.methods.discrete.loop import generate_tokens
from specray.methods.discrete.params import Lantern
from specray.methods.discrete.rules import neighbourhood_space, rule_params_for_pair
from specray.models.discrete_ar import load_pair
from specray.models.eagle_head import EagleHeadConfig
from specray.models.lantern_drafter import lantern_key_shapes
from tests.checkpoint_fixtures import llamagen_target

pytestmark = pytest.mark.usefixtures("single_thread")

# LANTERN's c2i drafters fix a 24 x 24 token grid (384 px over a 16x tokenizer); the tiny VQ
# fixture downsamples 2x, so a 48 px target has that grid.
TARGET = llamagen_target(image_size=48)


def _lantern_drafter(tmp_path, target_embeddings: torch.Tensor) -> dict:
    """A c2i drafter in LANTERN's key layout, random weights, the target's token embeddings."""
    vocab, dim = target_embeddings.shape
    config = {"hidden_size": dim, "num_attention_heads": 2, "num_key_value_heads": 2, "intermediate_size": 64,
              "vocab_size": vocab, "rms_norm_eps": 1e-5, "num_hidden_layers": 1, "hidden_act": "silu",
              "input_type": "c2i"}
    shapes = lantern_key_shapes(EagleHeadConfig(vocab_size=vocab, dim=dim, n_head=2, ffn_hidden=64, grid_size=24,
                                                cls_token_num=1, fc_bias=True, input_norm=False))
    gen = torch.Generator().manual_seed(0)
    state = {key: 0.05 * torch.randn(shape, generator=gen) for key, shape in shapes.items()}
    state["embed_tokens.weight"] = target_embeddings.clone()
    state["layers.0.post_attention_layernorm.weight"] = torch.ones(dim)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    return {"format": "lantern-llamagen", "path": str(tmp_path)}


def test_lantern_drafter_pairs_with_the_llamagen_release_and_neighbourhoods_use_its_codebook(tmp_path):
    target_only = load_pair(TARGET, None, "cpu")
    pair = load_pair(TARGET, _lantern_drafter(tmp_path, target_only.target.tok_embeddings.weight.detach()), "cpu")
    assert pair.info["draft_kind"] == "eagle_head" and pair.info["tokenizer"] == "vq"

    codebook = pair.info["codebook"]
    assert codebook.shape == (64, 8)  # the VQ codebook (64 codes of dim 8), not the GPT's [64, 32] embeddings
    assert neighbourhood_space(pair.info) is codebook
    params = Lantern.parse({"tree": [[0], [1], [0, 0]], "k": 5, "residual": "official"})
    table = rule_params_for_pair(params, pair).neighbours
    assert torch.equal(table, neighbours_from_embeddings(codebook.float(), 6, normalize=True))  # k + 1 columns
    assert not torch.equal(table, neighbours_from_embeddings(pair.info["token_embeddings"].float(), 6, normalize=True))

    # LANTERN++ on a static tree with the released-layout drafter: whole images, every token a code.
    tokens, tally = generate_tokens("lantern", params, pair, torch.tensor([3, 7]), torch.tensor([0, 1]), seed=0)
    assert tokens.shape == (2, 24 * 24) and int(tokens.min()) >= 0 and int(tokens.max()) < 64
