"""The EAGLE draft head: its layout, the LANTERN drafter loader, the target's tree-mask forward."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specray.methods.discrete.loop import GuidedModel
from specray.methods.discrete.params import SD
from specray.methods.discrete.tree_rules import tree_index
from specray.methods.discrete.trees import NAMED_TREES
from specray.methods.params import ParamError
from specray.models.checkpoints.reading import CheckpointError
from specray.models.discrete_ar import DiscreteGPT, GPTConfig
from specray.models.draft_formats import LanternDrafter
from specray.models.eagle_head import EagleHead, check_head_for_target, head_logits
from specray.models.lantern_drafter import (
    head_state_from_lantern,
    lantern_key_shapes,
    load_lantern_drafter,
    read_state,
)

torch.set_num_threads(1)

FIXTURE = Path(__file__).parent / "fixtures" / "lantern"


def tiny_target(seed: int = 0) -> DiscreteGPT:
    torch.manual_seed(seed)
    return DiscreteGPT(GPTConfig(dim=32, n_layer=2, n_head=4, grid_size=4)).eval()


# ---- LANTERN's released drafters -----------------------------------------------------------------


def test_lantern_drafter_matches_the_official_module():
    """Fixture: LANTERN's own cnets_llamagen.Model (tests/fixtures/lantern/make_fixture.py), random
    weights, 2 sequences of 130 positions (past the t2i head's 119 zero-rotation rows)."""
    head = load_lantern_drafter(LanternDrafter.parse({"path": str(FIXTURE)}))
    reference = load_file(str(FIXTURE / "reference.safetensors"))
    length = reference["input_ids"].shape[1]
    positions = torch.arange(1, length + 1).expand(2, length)  # the drafter's index i is sequence position i + 1
    with torch.no_grad():
        out = head(reference["hidden_states"], reference["input_ids"], positions)
    assert (out - reference["output"]).abs().max().item() < 1e-5
    assert head.config.cls_token_num == 120 and head.config.grid_size == 16 and head.config.fc_bias


def test_lantern_loader_is_strict_about_keys_and_shapes():
    head = load_lantern_drafter(LanternDrafter.parse({"path": str(FIXTURE)}))
    state = read_state(FIXTURE / "model.safetensors")
    assert set(state) == set(lantern_key_shapes(head.config))
    missing = {k: v for k, v in state.items() if k != "fc.bias"}
    with pytest.raises(ValueError, match=r"missing keys \['fc.bias'\]"):
        head_state_from_lantern(missing, head.config)
    with pytest.raises(ValueError, match=r"unexpected keys \['layers.0.input_layernorm.weight'\]"):
        head_state_from_lantern({**state, "layers.0.input_layernorm.weight": torch.ones(32)}, head.config)
    wrong = {**state, "layers.0.mlp.up_proj.weight": torch.zeros(63, 32)}
    with pytest.raises(ValueError, match=r"'layers.0.mlp.up_proj.weight' has shape \[63, 32\], expected \[64, 32\]"):
        head_state_from_lantern(wrong, head.config)


def test_lantern_bin_is_read_with_weights_only(tmp_path):
    torch.save(read_state(FIXTURE / "model.safetensors"), tmp_path / "pytorch_model.bin")
    shutil.copy(FIXTURE / "config.json", tmp_path / "config.json")
    from_bin = load_lantern_drafter(LanternDrafter.parse({"path": str(tmp_path)}))
    from_safetensors = load_lantern_drafter(LanternDrafter.parse({"path": str(FIXTURE)}))
    for key, value in from_safetensors.state_dict().items():
        assert torch.equal(value, from_bin.state_dict()[key]), key
    # A pickle that needs arbitrary code is refused, never unpickled.
    torch.save({"weights": read_state(FIXTURE / "model.safetensors"), "extra": object}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="never unpickles untrusted code"):
        load_lantern_drafter(LanternDrafter.parse({"path": str(tmp_path)}))
    # Like the release loaders: a torch.compile prefix is dropped before the strict key match.
    compiled = {f"_orig_mod.{k}": v for k, v in read_state(FIXTURE / "model.safetensors").items()}
    torch.save(compiled, tmp_path / "pytorch_model.bin")
    from_compiled = load_lantern_drafter(LanternDrafter.parse({"path": str(tmp_path)}))
    assert all(torch.equal(v, from_compiled.state_dict()[k]) for k, v in from_safetensors.state_dict().items())


def test_lantern_options_refuse_what_the_loader_cannot_map(tmp_path):
    config = json.loads((FIXTURE / "config.json").read_text())
    shutil.copy(FIXTURE / "model.safetensors", tmp_path / "model.safetensors")
    for key, value, message in (("num_hidden_layers", 2, "num_hidden_layers=2 is not supported; allowed: 1"),
                                ("input_type", "i2i", "input_type='i2i' is not supported; allowed: one of c2i"),
                                ("num_key_value_heads", 2, "num_key_value_heads=2")):
        (tmp_path / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ParamError, match=message):
            LanternDrafter.parse({"path": str(tmp_path)})
    with pytest.raises(ParamError, match="does not exist"):
        LanternDrafter.parse({"path": str(tmp_path / "nope")})
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ParamError, match="neither model.safetensors nor pytorch_model.bin"):
        LanternDrafter.parse({"path": str(tmp_path)})


# ---- the head's own forwards and its pairing with a target ---------------------------------------


def test_cached_forward_equals_the_training_forward():
    target = tiny_target()
    head = EagleHead.for_target(target).eval()
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(3, 9, 32, generator=gen)
    tokens = torch.randint(0, 17, (3, 9), generator=gen)
    positions = torch.arange(1, 10).expand(3, 9)
    with torch.no_grad():
        full = head(features, tokens, positions)
        cache = head.new_cache(3, 20)
        slots = torch.arange(20)
        step = [head.forward_cached(features[:, i : i + 1], tokens[:, i : i + 1], positions[:, i : i + 1],
                                    positions[:, i : i + 1], ((slots >= 1) & (slots <= i + 1)).expand(3, 1, 20), cache)
                for i in range(9)]
    assert (torch.cat(step, 1) - full).abs().max().item() < 1e-5


def test_head_refuses_a_target_it_was_not_built_for():
    target, other = tiny_target(0), tiny_target(1)
    head = EagleHead.for_target(target)
    check_head_for_target(head, target)
    with pytest.raises(ValueError, match="token embeddings differ from the target's"):
        check_head_for_target(head, other, "my-head")
    wide = DiscreteGPT(GPTConfig(dim=48, n_layer=1, n_head=4, grid_size=4))
    with pytest.raises(ValueError, match="'my-head': EAGLE head dim=32 does not match the target's 48"):
        check_head_for_target(head, wide, "my-head")


@torch.no_grad()
def test_tree_forward_gives_each_node_its_path_law():
    """Spec §9.14 for trees: P at every node of one tree-masked verify call equals the sampler's
    processed law after feeding that node's path incrementally (fp32, max abs diff < 1e-5)."""
    target = tiny_target()
    tree = NAMED_TREES["eagle25"]
    index = tree_index(tree, torch.device("cpu"))
    sampling = SD(cfg_scale=2.0, top_k=10)
    gen = torch.Generator().manual_seed(2)
    prefix = torch.randint(0, 17, (1, 5), generator=gen)  # committed image tokens 0..4
    nodes = torch.randint(0, 17, (1, tree.num_nodes + 1), generator=gen)
    label = torch.tensor([3])
    n = prefix.shape[1]  # the root is image token n - 1, fed at position n

    stream = GuidedModel(target, 1, sampling, 40)
    fed = torch.cat([label[:, None], prefix[:, :-1]], 1)
    stream.probs(torch.arange(1), fed, torch.arange(n)[None], prefix=True)
    from specray.methods.discrete.eagle_loop import TargetStream, _tree_visible

    tree_stream = TargetStream(target, 1, sampling, 40)
    tree_stream.probs(torch.arange(1), fed, torch.arange(n)[None], torch.arange(n)[None],
                      (torch.arange(40) <= torch.arange(n)[:, None])[None], prefix=True)
    ids = torch.arange(tree.num_nodes + 1)
    tokens = torch.cat([prefix[:, -1:], nodes[:, 1:]], 1)
    P, _ = tree_stream.probs(torch.arange(1), tokens, n + index.depths[None], n + ids[None],
                             _tree_visible(index, torch.tensor([n]), 40))
    for node in range(tree.num_nodes + 1):
        path = [0] + tree.ancestors(node)[::-1]
        path_tokens = tokens[:, path]
        chain = GuidedModel(target, 1, sampling, 40)
        chain.cache = stream.cache.__class__([k.clone() for k in stream.cache.keys],
                                             [v.clone() for v in stream.cache.values], stream.cache.lengths.clone())
        expected = chain.probs(torch.arange(1), path_tokens, n + torch.arange(len(path))[None], prefix=False)[:, -1]
        assert (P[:, node] - expected).abs().max().item() < 1e-5, node


def test_head_logits_use_the_target_output_layer():
    target = tiny_target()
    features = torch.randn(2, 32)
    assert torch.equal(head_logits(target, features), target.output(features).float())
