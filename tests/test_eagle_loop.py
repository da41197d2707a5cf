"""Drafting with an EAGLE head on the digits target: chains and static trees through the family's loop."""

from __future__ import annotations

import pytest
import torch

from specray.families import family
from specray.methods.discrete.loop import generate_tokens
from specray.models.discrete_ar import load_pair
from specray.models.eagle_head import EagleHead
from specray.models.presets import get_preset
from specray.spec import SpecError, load_job

torch.set_num_threads(1)

pytestmark = pytest.mark.skipif(
    not get_preset("digits-gpt-target").weights_path.exists() or not get_preset("digits-gpt-draft").weights_path.exists(),
    reason="discrete preset weights not trained",
)
HAS_HEAD = get_preset("digits-gpt-eagle").weights_path.exists()
LABELS = torch.tensor([3, 0, 7, 1, 9, 4])
IDS = torch.tensor([42, 7, 1001, 3, 58, 11])


def params(method, raw):  # noqa: ANN001, ANN201
    return family("discrete_ar").parse_params(method, raw)


@pytest.fixture(scope="module")
def head_pair():
    """The digits target with a head of fixed random weights: the loop's mechanics need no training."""
    pair = load_pair("digits-gpt-target", None, "cpu")
    torch.manual_seed(0)
    pair.draft = EagleHead.for_target(pair.target).eval()
    pair.info["draft_kind"] = "eagle_head"
    return pair


@pytest.fixture(scope="module")
def gpt_pair():
    return load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")


@pytest.mark.parametrize("method,raw", [("sd", {}), ("cool_sd", {"delta": 2.0}), ("lantern", {"k": 3, "lam": 3.0})])
def test_a_one_path_tree_gives_the_chain_tokens(head_pair, method, raw):
    """A tree of one path drafts and verifies like the chain (same keys, same laws): same tokens."""
    chain, chain_stats = generate_tokens(method, params(method, {**raw, "gamma": 3}), head_pair, LABELS, IDS, seed=4)
    tree, tree_stats = generate_tokens(method, params(method, {**raw, "tree": [[0], [0, 0], [0, 0, 0]]}), head_pair,
                                       LABELS, IDS, seed=4)
    assert torch.equal(chain, tree)
    for a, b in zip(chain_stats, tree_stats):
        assert (a.target_calls, a.num_accepted_draft_tokens, a.num_draft_tokens) == \
               (b.target_calls, b.num_accepted_draft_tokens, b.num_draft_tokens)
        assert a.accepted_per_position == b.accepted_per_position


@pytest.mark.parametrize("raw", [{"gamma": 4}, {"tree": "small"}, {"tree": "eagle25", "cfg_scale": 1.0}])
def test_head_sample_is_independent_of_its_batch_companions(head_pair, raw):
    batch, batch_stats = generate_tokens("sd", params("sd", raw), head_pair, LABELS, IDS, seed=5)
    other, _ = generate_tokens("sd", params("sd", raw), head_pair, torch.tensor([6, 3]), torch.tensor([5, 42]), seed=5)
    alone, alone_stats = generate_tokens("sd", params("sd", raw), head_pair, LABELS[:1], IDS[:1], seed=5)
    assert torch.equal(alone[0], batch[0]) and torch.equal(other[1], batch[0])
    assert alone_stats[0] == batch_stats[0]
    assert not torch.equal(generate_tokens("sd", params("sd", raw), head_pair, LABELS, IDS, seed=6)[0], batch)


@pytest.mark.parametrize("raw", [{"gamma": 4}, {"tree": "small"}])
def test_head_first_token_is_shared_with_target_only(head_pair, raw):
    """The prefill's token is keyed like target_only's first one, whatever draws it (torch's operations or the
    kernel): the same token per sample. At temperature 8 the first token's law is wide enough that another seed
    changes some (at 1 nearly every digit starts with the same background token)."""
    hot = {"temperature": 8.0}
    base, _ = generate_tokens("target_only", params("target_only", hot), head_pair, LABELS, IDS, seed=3)
    spec, _ = generate_tokens("sd", params("sd", {**raw, **hot}), head_pair, LABELS, IDS, seed=3)
    assert torch.equal(base[:, 0], spec[:, 0])
    other, _ = generate_tokens("sd", params("sd", {**raw, **hot}), head_pair, LABELS, IDS, seed=4)
    assert not torch.equal(other[:, 0], spec[:, 0])


@pytest.mark.parametrize("tree", ["small", "eagle57"])
def test_tree_statistics_are_consistent(head_pair, tree):
    from specray.methods.discrete.trees import NAMED_TREES

    depth = NAMED_TREES[tree].depth
    _, stats = generate_tokens("cool_sd", params("cool_sd", {"tree": tree, "delta": 2.0}), head_pair, LABELS, IDS, seed=1)
    for s in stats:
        assert s.num_tokens == 64 and s.target_calls == 1 + s.num_spec_steps
        assert 1 + s.num_spec_steps + s.num_accepted_draft_tokens == 64  # prefill + (accepted + 1) per round
        assert s.draft_calls == depth * s.num_spec_steps  # one head call per depth
        assert len(s.accepted_per_position) == depth and sum(s.accepted_per_position) == s.num_accepted_draft_tokens
        assert s.accepted_per_position == sorted(s.accepted_per_position, reverse=True)
        assert s.num_draft_tokens > s.num_spec_steps  # several candidates per round


def test_a_tree_needs_a_head(gpt_pair):
    with pytest.raises(ValueError, match="needs an EAGLE head as the draft"):
        generate_tokens("sd", params("sd", {"tree": "small"}), gpt_pair, LABELS[:1], IDS[:1], seed=0)


# ---- the job spec ---------------------------------------------------------------------------------


def job(tmp_path, **arm):  # noqa: ANN001, ANN201
    base = {"name": "a", "family": "discrete_ar", "method": "sd", "target": "digits-gpt-target", "draft": "digits-gpt-eagle"}
    return {"job_id": "t", "output": str(tmp_path / "out"), "conditions": {"kind": "class_labels", "per_class": 1},
            "arms": [{**base, **arm}], "eval": {"fid": False}}


@pytest.mark.parametrize("arm,field,words", [
    ({"draft": "digits-gpt-draft", "params": {"tree": "small"}}, "arms[0].params.tree", "needs an EAGLE head"),
    ({"target": "digits-gpt-eagle"}, "arms[0].target", "a head can only be a draft"),
    ({"method": "block", "params": {"tree": "small"}}, "arms[0].params.tree", "defined for one draft block"),
    ({"params": {"tree": "small", "gamma": 3}}, "arms[0].params.gamma", "give gamma or tree, not both"),
    ({"params": {"tree": "eagle99"}}, "arms[0].params.tree", "unknown tree 'eagle99'; allowed: eagle57"),
    ({"params": {"tree": [[1]]}}, "arms[0].params.tree", "needs its elder sibling"),
    ({"draft": {"format": "eagle-head", "path": "/nonexistent.safetensors"}}, "arms[0].draft.path", "does not exist"),
    ({"draft": {"format": "lantern-llamagen", "path": "/nonexistent"}}, "arms[0].draft.path", "does not exist"),
])
def test_spec_refuses_bad_head_and_tree_arms(tmp_path, arm, field, words):
    with pytest.raises(SpecError) as info:
        load_job(job(tmp_path, **arm))
    assert info.value.field_path == field and words in str(info.value)


def test_spec_accepts_head_arms(tmp_path):
    spec = load_job(job(tmp_path, params={"tree": "eagle57"}))
    assert spec.arms[0].params["tree"] == "eagle57"
    spec = load_job(job(tmp_path, method="cool_sd", params={"tree": [[0], [1], [0, 0]], "delta": 2.0}))
    assert spec.arms[0].params["tree"] == [[0], [1], [0, 0]]
    # What the spec stores is what the actors parse again: a tree arm's params carry no gamma.
    stored = spec.arms[0].params
    assert "gamma" not in stored and params("cool_sd", stored).to_dict() == stored
    assert params("cool_sd", stored).draft_length == 2


def test_a_gpt_file_is_not_an_eagle_head_file(tmp_path):
    path = get_preset("digits-gpt-draft").weights_path
    with pytest.raises(SpecError, match="holds no EAGLE head"):
        load_job(job(tmp_path, draft={"format": "eagle-head", "path": str(path)}))


# ---- the trained head ------------------------------------------------------------------------------


@pytest.mark.skipif(not HAS_HEAD, reason="digits-gpt-eagle not trained")
def test_trained_head_loads_with_its_record_and_pairs_only_with_its_target():
    from safetensors import safe_open

    path = get_preset("digits-gpt-eagle").weights_path
    assert path.stat().st_size < 1_000_000
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    assert meta["target"] == "digits-gpt-target" and meta["seed"] == "0"
    assert float(meta["heldout_first_draft_alpha"]) > 0.6
    pair = load_pair("digits-gpt-target", "digits-gpt-eagle", "cpu")
    assert isinstance(pair.draft, EagleHead) and pair.info["draft_kind"] == "eagle_head"
    with pytest.raises(ValueError, match="EAGLE head dim=64 does not match the target's 48"):
        load_pair("digits-gpt-draft", "digits-gpt-eagle", "cpu")


def mean_length(pair, method, raw, n=30, seed=9):  # noqa: ANN001, ANN201
    _, stats = generate_tokens(method, params(method, raw), pair, torch.arange(n) % 10, torch.arange(n), seed=seed)
    return sum(s.num_tokens for s in stats) / sum(s.target_calls for s in stats)


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HEAD, reason="digits-gpt-eagle not trained")
def test_trained_head_drafts_longer_than_the_draft_gpt_and_a_tree_longer_than_a_chain(gpt_pair):
    """30 samples of mixed classes, seed 9, sd at equal depth 4 (deterministic). README's figures
    (bench/acceptance.py, 100 samples, seed 0): 2.89 / 3.55 / 3.64 tokens per target call."""
    head = load_pair("digits-gpt-target", "digits-gpt-eagle", "cpu")
    gpt_chain = mean_length(gpt_pair, "sd", {"gamma": 4})
    head_chain = mean_length(head, "sd", {"gamma": 4})
    head_tree = mean_length(head, "sd", {"tree": "small"})
    print(f"gpt chain {gpt_chain:.3f}, head chain {head_chain:.3f}, head tree {head_tree:.3f}")
    assert head_chain > gpt_chain + 0.3
    assert head_tree > head_chain + 0.1


@pytest.mark.slow
@pytest.mark.skipif(not HAS_HEAD, reason="digits-gpt-eagle not trained")
def test_head_lossless_arms_match_target_marginals(gpt_pair):
    """N = 600 samples of class 3 per arm, seeds 1000 (target_only) and 2000; chi-square two-sample
    p > 1e-3 at four spread-out positions for sd on the head's tree (the chain with the head is the
    one-path tree, test above); negative control: uniform_rsd with delta 1000 on the tree (samples
    the head) fails at some position."""
    from tests.test_discrete_loop import MC_ALPHA, MC_LABEL, MC_SAMPLES, marginal_p_values

    head = load_pair("digits-gpt-target", "digits-gpt-eagle", "cpu")
    base = generate_tokens("target_only", params("target_only", {}), gpt_pair, torch.full((MC_SAMPLES,), MC_LABEL),
                           torch.arange(MC_SAMPLES), seed=1000)[0]
    p_values = marginal_p_values(head, base, "sd", {"tree": "small"}, seed=2000)
    assert min(p_values) > MC_ALPHA, p_values
    lossy = marginal_p_values(head, base, "uniform_rsd", {"tree": "small", "delta": 1000.0}, seed=2000)
    assert min(lossy) < MC_ALPHA, lossy
