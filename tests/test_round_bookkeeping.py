"""The CPU kernels of the discrete rounds' bookkeeping: a static tree round's slots, positions and masks (the EAGLE
head's chain's too), uniforms per node and commit (csrc/tree_bookkeeping.cpp, called by
specray/methods/discrete/eagle_loop.py), and a draft GPT's round's positions, uniforms and commit
(csrc/chain_bookkeeping.cpp, called by loop.py), give the values and writes of torch's operations and refuse,
writing nothing, what they do not serve; the GPT-draft and head-chain arms give the same samples with and without
them."""

from __future__ import annotations

import pytest
import torch

from specray import rng
from specray.methods.discrete import cpu_rounds, eagle_loop, loop, tree_rules
from specray.methods.discrete.loop import generate_tokens
from specray.methods.discrete.params import SD
from specray.methods.discrete.trees import NAMED_TREES, StaticTree
from specray.models import cpu_kernels
from specray.models.discrete_ar import load_pair
from specray.models.presets import get_preset

CPU = torch.device("cpu")
TREES = {**NAMED_TREES, "custom": StaticTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0]]),
         "chain": StaticTree.chain(4)}


@pytest.fixture(scope="module")
def extension():
    module = cpu_kernels.extension()
    if module is None:
        pytest.skip("specray's CPU kernels did not build here (see the log)")
    return module


def _torch_only(monkeypatch):
    monkeypatch.setattr(cpu_rounds, "ENABLED", False)


def _plan(tree: StaticTree, batch: int, num_positions: int = 80) -> eagle_loop._TreePlan:
    return eagle_loop._TreePlan(tree, CPU, seed=4, sample_ids=torch.arange(batch) + 9, num_positions=num_positions)


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("rows", [1, 2, 14])
def test_the_round_masks_are_torchs(extension, monkeypatch, name, rows):
    """Slots, positions, the verify's and the head's masks and the catch-up's positions and mask for cache rows at
    random committed lengths 1-60 (the catch-up's clamp at 1 included), against torch's operations: equal values,
    dtypes and shapes; seed 1."""
    plan = _plan(TREES[name], 4)
    generator = torch.Generator().manual_seed(1)
    for _ in range(5):
        n_rows = torch.randint(1, 61, (rows,), generator=generator)
        n_rows[0] = 1
        top, max_len = int(n_rows.max()), 64 + plan.tree.num_nodes + 1
        got = plan.masks(n_rows, top, max_len, plan.tree.depth + 1)
        with monkeypatch.context() as patch:
            _torch_only(patch)
            want = plan.masks(n_rows, top, max_len, plan.tree.depth + 1)
        assert len(got) == len(want) == 6
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and torch.equal(g, w)


def test_the_round_masks_refuse_what_they_do_not_serve(extension):
    """A node's slot past the span, or a mask of another dtype: undefined tensors (torch's operations run)."""
    index = tree_rules.tree_index(NAMED_TREES["small"], CPU)
    n_rows = torch.tensor([3, 9])
    span = 9 + index.depths.shape[0]  # the last node of the second row fits exactly
    assert extension.tree_masks(n_rows, index.depths, index.visible, span, 4)[0] is not None
    assert extension.tree_masks(n_rows, index.depths, index.visible, span - 1, 4)[0] is None
    assert extension.tree_masks(n_rows, index.depths, index.visible.long(), span, 4)[0] is None


@pytest.mark.parametrize("name", list(TREES))
def test_the_round_uniforms_are_torchs(extension, monkeypatch, name):
    """Each node's draft and accept uniforms and the residual's, for the whole batch and for some of its rows, at
    several rounds (two chunks of them) and committed lengths: the values of torch's indexing, where the kernel's plan
    made no chunk of uniforms; seed 2."""
    batch = 5
    plan = _plan(TREES[name], batch, num_positions=64 + TREES[name].depth + 1)
    torch_plan = _plan(TREES[name], batch, num_positions=64 + TREES[name].depth + 1)
    generator = torch.Generator().manual_seed(2)
    for step in (0, 3, plan.chunk + 1):
        for idx in (torch.arange(batch), torch.tensor([1, 4]), torch.tensor([3])):
            n = torch.randint(1, 64, idx.shape, generator=generator)
            got = plan.uniforms(step, idx, n)
            with monkeypatch.context() as patch:
                _torch_only(patch)
                want = torch_plan.uniforms(step, idx, n)
            for g, w in zip(got, want):
                assert g.dtype == w.dtype and torch.equal(g, w)
    assert not plan.chunks and torch_plan.chunks
    refused = ((plan.hashes, 0, torch.tensor([batch]), torch.tensor([3])),  # a row past the batch
               (plan.hashes, 0, torch.tensor([0]), torch.tensor([-1])),  # a negative committed length
               (plan.hashes[:, :2], 0, torch.tensor([0]), torch.tensor([3])))  # two streams' hashes
    for args in refused:
        assert extension.tree_uniforms(*args, plan.offset, plan.rank)[0] is None


def test_the_tree_uniforms_are_rngs(extension):
    """The kernel's uniforms of a tree's nodes are ``rng.uniform``'s at each node's keys (sample, stream, position
    n + depth - 1, round, index the node's rank; the residual at n, index 0), key by key: rounds 0 and 70 and rows 4
    and 1 of 5 samples at committed lengths 9 and 30 (seed 4)."""
    tree, ids = TREES["custom"], torch.arange(5) + 9
    plan = _plan(tree, 5)
    for step, idx, n in ((0, torch.tensor([4, 1]), torch.tensor([9, 30])), (70, torch.tensor([1]), torch.tensor([9]))):
        draft, accept, residual = extension.tree_uniforms(plan.hashes, step, idx, n, plan.offset, plan.rank)
        for b, (row, length) in enumerate(zip(idx.tolist(), n.tolist())):
            for v in range(tree.num_nodes + 2):
                position, rank = length + int(plan.offset[v]), int(plan.rank[v])
                for stream, got in (("draft", draft), ("accept", accept)):
                    if v < got.shape[1]:
                        want = rng.uniform(4, ids[row], stream, position=position, step=step, shape=(plan.width,))
                        assert got[b, v] == want[rank]
            assert residual[b] == rng.uniform(4, ids[row], "residual", position=length, step=step)


def _commit_case(tree: StaticTree, guided: bool, generator: torch.Generator):
    """A target stream of the digits GPT for 6 samples with random K/V and hidden states, and a round's verdict on
    rows 0, 2, 3 and 5: committed lengths 1-50, every accepted count 0 .. depth among them, paths of random nodes."""
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    sampling = SD(cfg_scale=1.5 if guided else 1.0)
    nodes = tree.num_nodes + 1
    target = eagle_loop.TargetStream(pair.target, 6, sampling, pair.target.max_seq_len + nodes)
    for tensor in (target.keys, target.values, target.features):
        tensor.copy_(torch.randn(tensor.shape, generator=generator))
    idx = torch.tensor([0, 2, 3, 5])
    r, depth = idx.shape[0], tree.depth
    n = torch.randint(1, 51, (r,), generator=generator)
    n_accepted = torch.arange(r) % (depth + 1)
    path = torch.randint(0, nodes, (r, depth), generator=generator)
    out = tree_rules.TreeVerifyOutput(n_accepted, path, torch.randint(0, 17, (r,), generator=generator))
    node_tokens = torch.randint(0, 17, (r, nodes + 1), generator=generator)[:, :nodes]  # a view, as the loop's
    hidden = torch.randn(target.cache_rows(idx).shape[0], nodes, target.features.shape[-1], generator=generator)
    row_tokens = torch.randint(0, 17, (r, 64 + depth + 1), generator=generator)
    return target, idx, n, out, node_tokens, hidden, row_tokens


def _state(target, row_tokens):
    return [t.clone() for t in (target.keys, target.values, target.features, row_tokens)]


@pytest.mark.parametrize("name", list(TREES))
@pytest.mark.parametrize("guided", [True, False])
def test_the_round_commit_writes_what_torch_writes(extension, monkeypatch, name, guided):
    """The commit of 4 of 6 rows (CFG on: the uncond cache rows too): the row tokens, every layer's K and V, the hidden
    states and the new committed lengths equal torch's operations' after the same call; seed 3."""
    tree = TREES[name]
    target, idx, n, out, node_tokens, hidden, row_tokens = _commit_case(tree, guided, torch.Generator().manual_seed(3))
    before = _state(target, row_tokens)
    new_n = eagle_loop._commit_tree(target, idx, n, out, node_tokens, hidden, row_tokens)
    got = _state(target, row_tokens)
    for tensor, saved in zip((target.keys, target.values, target.features, row_tokens), before):
        tensor.copy_(saved)
    with monkeypatch.context() as patch:
        _torch_only(patch)
        want_n = eagle_loop._commit_tree(target, idx, n, out, node_tokens, hidden, row_tokens)
    assert torch.equal(new_n, want_n) and torch.equal(new_n, n + out.n_accepted + 1)
    assert all(torch.equal(g, w) for g, w in zip(got, _state(target, row_tokens)))
    assert not torch.equal(got[0], before[0])  # it moved something


def test_the_round_commit_refuses_what_it_does_not_serve(extension):
    """A path node past the tree, or a committed length whose path would leave the cache: nothing written; seed 4."""
    tree = NAMED_TREES["small"]
    target, idx, n, out, node_tokens, hidden, row_tokens = _commit_case(tree, True, torch.Generator().manual_seed(4))
    before = _state(target, row_tokens)
    rows = target.cache_rows(idx)
    storage = (target.keys.transpose(-3, -2), target.values.transpose(-3, -2))
    bad_path = out.path.clone()
    bad_path[1, 0] = tree.num_nodes + 1
    past = n.clone()
    past[2] = target.cache.max_len
    for path, lengths in ((bad_path, n), (out.path, past)):
        assert extension.tree_commit(*storage, target.features, row_tokens, rows, lengths, out.n_accepted, path,
                                     out.next_token, node_tokens, hidden) is None
    assert all(torch.equal(g, w) for g, w in zip(_state(target, row_tokens), before))


# ---- a draft GPT's round -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 3, 32])
@pytest.mark.parametrize("gamma", [1, 4, 6])
def test_the_chain_round_plan_is_torchs(extension, monkeypatch, batch, gamma):
    """Positions, fed positions and the draft, accept and residual uniforms of a round every row takes part in, at
    committed lengths 1 .. 64 - gamma - 1 and rounds across two chunks of uniforms: torch's values; and the draft
    calls' inputs, the operations of loop._draft_every_row (the first call's tokens only where every row has committed
    two or more, else None), and none where they are not asked for (the EAGLE head's chain); seed 5."""
    num_tokens = 64
    uniforms = loop.RoundUniforms(7, torch.arange(batch) + 3, num_tokens + gamma + 1)
    steps, all_rows = torch.arange(gamma + 1), torch.arange(batch)
    generator = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 17, (batch, num_tokens + gamma + 1), generator=generator)
    labels = torch.arange(batch) % 10
    for step in (0, 2, uniforms.chunk + 3):
        committed = torch.randint(2, num_tokens - gamma, (batch,), generator=generator)
        if step == 0:
            committed[-1] = 1  # a row with its first image token alone: the first call feeds the class label
        got = loop._next_round(committed, num_tokens, gamma, labels, tokens, all_rows, steps, uniforms, step)
        with monkeypatch.context() as patch:
            _torch_only(patch)
            want = loop._next_round(committed, num_tokens, gamma, labels, tokens, all_rows, steps, uniforms, step)
        assert torch.equal(got[0].positions, want[0].positions)
        assert torch.equal(got[0].fed_positions, want[0].fed_positions)
        for g, w in zip(got[1], want[1]):
            assert g.dtype == w.dtype and torch.equal(g, w)
        assert want[0].draft_inputs is None
        first_positions, first_fed, later_positions, u_columns = got[0].draft_inputs
        rnd, u_draft = want[0], want[1][0]
        assert torch.equal(first_positions, rnd.fed_positions[:, :2])
        if step == 0:
            assert first_fed is None
        else:
            assert torch.equal(first_fed, rnd.tokens.gather(1, rnd.fed_positions[:, :2] - 1))
        for g, w in zip(later_positions + u_columns, rnd.positions[:, 1:gamma, None].unbind(1)
                        + u_draft[:, :, None].unbind(1), strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)
        head_chain = loop._next_round(committed, num_tokens, gamma, labels, tokens, all_rows, steps, uniforms, step,
                                      draft_inputs=False)  # as the EAGLE head's chain plans: no draft inputs
        assert head_chain[0].draft_inputs is None and torch.equal(head_chain[0].positions, want[0].positions)
    hashes = uniforms.hashes
    assert extension.chain_plan(committed - num_tokens, gamma, hashes, 0, tokens)[0] is None  # negative lengths
    assert extension.chain_plan(committed, gamma, hashes[:, :2], 0, tokens)[0] is None  # two streams' hashes
    assert extension.chain_plan(committed, gamma, hashes, 0, tokens[:, 0])[0] is None  # a buffer of another shape


@pytest.mark.parametrize("batch", [1, 5])
def test_the_round_uniforms_are_torchs_and_rngs(extension, monkeypatch, batch):
    """A round's uniforms at its rows' positions, by the kernel (``round_uniforms``): the values of torch's path
    (the slab's, gathered) for every row and for some, at rounds 0, 9 and 70 (two chunks of rounds), with no slab
    made, and ``rng.uniform``'s at the last row's last position; rows past the batch and negative positions refused;
    seed 6."""
    ids, generator = torch.arange(batch) + 3, torch.Generator().manual_seed(6)
    uniforms, torch_side = loop.RoundUniforms(7, ids, 70), loop.RoundUniforms(7, ids, 70)
    for step in (0, 9, 70):
        for idx in (torch.arange(batch), torch.tensor([batch - 1])):
            positions = torch.randint(0, 66, (idx.shape[0], 4), generator=generator)
            got = uniforms.round(step, idx, positions)
            with monkeypatch.context() as patch:
                _torch_only(patch)
                want = torch_side.round(step, idx, positions)
            assert got.dtype == want.dtype == torch.float64 and torch.equal(got, want)
            row, i = idx.shape[0] - 1, 3
            for s, stream in enumerate(loop.RoundUniforms.STREAMS):
                key = rng.uniform(7, ids[idx[row]], stream, position=positions[row, i], step=step)
                assert got[row, i, s] == key
    assert not uniforms.chunks and torch_side.chunks  # the kernel hashed its keys alone
    assert extension.round_uniforms(uniforms.hashes, torch.tensor([batch]), torch.zeros(1, 2, dtype=torch.int64),
                                    0) is None
    assert extension.round_uniforms(uniforms.hashes, torch.tensor([0]), torch.tensor([[3, -1]]), 0) is None


@pytest.mark.parametrize("batch", [1, 3, 32])
@pytest.mark.parametrize("gamma", [1, 4, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_chain_verify_inputs_are_torchs(extension, batch, gamma, dtype):
    """The verify call's inputs of a round every row takes part in, from the drafts and laws as columns: the stacked
    drafts and laws, the token buffer after the drafts' write and the tokens fed, equal to torch.cat, torch.stack,
    scatter_ and gather's (loop._verify_inputs without the kernel), at committed lengths 1 .. 64 - gamma - 1, the first
    laws a strided view; seed 8."""
    generator = torch.Generator().manual_seed(8)
    committed = torch.randint(1, 64 - gamma, (batch,), generator=generator)
    positions = committed[:, None] + torch.arange(gamma + 1)
    ds = [torch.randint(0, 17, (batch, 1), generator=generator) for _ in range(gamma)]
    qs = [torch.rand(batch, 17, generator=generator, dtype=dtype) for _ in range(gamma)]
    qs[0] = torch.rand(batch, 2, 17, generator=generator, dtype=dtype)[:, -1]  # strided, as a 2-token call's last laws
    buffer = torch.randint(0, 17, (batch, 64 + gamma + 1), generator=generator)
    got_buffer, want_buffer = buffer.clone(), buffer.clone()
    got = extension.chain_verify_inputs(ds, qs, got_buffer, positions, positions - 1)
    rnd = loop._Round(torch.arange(batch), False, committed, None, [gamma] * batch, None, want_buffer, positions,
                      positions - 1, int(committed.max()))  # not full: torch's operations
    want = loop._verify_inputs(rnd, ds, qs, gamma)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w)
    assert torch.equal(got_buffer, want_buffer) and not torch.equal(got_buffer, buffer)


def test_the_chain_verify_inputs_refuse_what_they_do_not_serve(extension):
    """A position past the token buffer, laws of two dtypes, or a draft column of another shape: None, nothing
    written."""
    positions = torch.tensor([[5, 6, 7]])
    ds, qs = [torch.tensor([[1]]), torch.tensor([[2]])], [torch.rand(1, 17), torch.rand(1, 17)]
    tokens = torch.zeros(1, 8, dtype=torch.int64)
    assert extension.chain_verify_inputs(ds, qs, tokens, positions + 2, positions + 1)[0] is None  # slot 8 is past it
    assert extension.chain_verify_inputs(ds, [qs[0], qs[1].double()], tokens, positions, positions - 1)[0] is None
    assert extension.chain_verify_inputs([ds[0], torch.tensor([1, 2])], qs, tokens, positions, positions - 1)[0] is None
    assert not tokens.any()


def test_the_chain_round_feeds_the_plans_draft_inputs(extension, monkeypatch):
    """Negative control for the draft calls' inputs the plan makes: with the first draft call's tokens one token off
    in every round that has them, an sd arm's samples differ from those of the plan as it is (12 samples at batch 12,
    gamma 4, CFG 1.5, seed 3), so the loop feeds them."""
    if not get_preset("digits-gpt-draft").weights_path.exists():
        pytest.skip("digits-gpt-draft not trained")
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    ids, vocab = torch.arange(12) + 40, pair.target.config.vocab_size
    right = generate_tokens("sd", {"gamma": 4, "cfg_scale": 1.5}, pair, ids % 10, ids, 3)[0]
    real, shifted = extension.chain_plan, []

    def first_tokens_off(*args):
        planned = list(real(*args))
        if planned[6] is not None:
            planned[6] = (planned[6] + 1) % vocab
            shifted.append(True)
        return tuple(planned)

    monkeypatch.setattr(extension, "chain_plan", first_tokens_off)
    wrong = generate_tokens("sd", {"gamma": 4, "cfg_scale": 1.5}, pair, ids % 10, ids, 3)[0]
    assert shifted and not torch.equal(wrong, right)


@pytest.mark.parametrize("kernel", ["chain_plan", "round_uniforms"])
def test_the_chain_round_draws_the_kernels_uniforms(extension, monkeypatch, kernel):
    """Negative control for the uniforms the kernels hash: with every round's uniforms keyed by the next round's
    index (``chain_plan``'s in the rounds every row takes part in, ``round_uniforms``' in the tail rounds), an sd arm's
    samples differ from those of the kernels as they are (12 samples at batch 12, gamma 4, CFG 1.5, seed 3), so the
    loop draws with what they hash."""
    if not get_preset("digits-gpt-draft").weights_path.exists():
        pytest.skip("digits-gpt-draft not trained")
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    ids = torch.arange(12) + 40
    right = generate_tokens("sd", {"gamma": 4, "cfg_scale": 1.5}, pair, ids % 10, ids, 3)[0]
    real, called = getattr(extension, kernel), []

    def next_round(*args):  # the round's index is argument 3 of both: (committed, gamma, hashes, step, tokens) and
        called.append(True)  # (hashes, idx, positions, step)
        return real(*args[:3], args[3] + 1, *args[4:])

    monkeypatch.setattr(extension, kernel, next_round)
    wrong = generate_tokens("sd", {"gamma": 4, "cfg_scale": 1.5}, pair, ids % 10, ids, 3)[0]
    assert called and not torch.equal(wrong, right)


def _chain_streams(guided: bool, batch: int):
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    sampling = SD(cfg_scale=1.5 if guided else 1.0)
    return [loop.GuidedModel(model, batch, sampling, 80) for model in (pair.target, pair.draft)]


@pytest.mark.parametrize("guided", [True, False])
@pytest.mark.parametrize("gamma", [1, 4])
def test_the_chain_round_commit_writes_what_torch_writes(extension, monkeypatch, guided, gamma):
    """The commit of a round of 6 rows, every accepted count 0 .. gamma and rows drafting fewer than gamma among them
    (CFG on: both cache halves): the token buffer, the committed lengths and both caches' lengths equal torch's
    operations' after the same call; seed 6."""
    batch, generator = 6, torch.Generator().manual_seed(6)
    committed = torch.randint(1, 50, (batch,), generator=generator)
    n_drafts = torch.full((batch,), gamma)
    n_drafts[-1] = gamma - 1
    n_acc = torch.minimum(torch.arange(batch) % (gamma + 1), n_drafts)
    next_token = torch.randint(0, 17, (batch,), generator=generator)
    tokens = torch.randint(0, 17, (batch, 64 + gamma + 1), generator=generator)
    results = []
    for kernels_on in (True, False):
        target_stream, draft_stream = _chain_streams(guided, batch)
        for stream in (target_stream, draft_stream):
            stream.cache.lengths.copy_(torch.randint(1, 60, stream.cache.lengths.shape, generator=generator))
        n, buffer = committed.clone(), tokens.clone()
        rnd = loop._Round(torch.arange(batch), True, n, n_drafts, [gamma] * batch, None, buffer, None, None,
                          int(n.max()))
        with monkeypatch.context() as patch:
            if not kernels_on:
                _torch_only(patch)
            loop._commit(rnd, n_acc, next_token, buffer, n, target_stream, draft_stream)
        results.append((buffer, n, target_stream.cache.lengths, draft_stream.cache.lengths))
    assert all(torch.equal(g, w) for g, w in zip(*results))
    assert torch.equal(results[0][1], committed + n_acc + 1)


def test_the_chain_round_commit_refuses_what_it_does_not_serve(extension):
    """A correction past the token buffer, or cache lengths of another size: False, nothing written."""
    target_stream, draft_stream = _chain_streams(True, 2)
    tokens, committed = torch.zeros(2, 8, dtype=torch.int64), torch.tensor([3, 7])
    args = (target_stream.cache.lengths, draft_stream.cache.lengths, torch.tensor([0, 1]), torch.tensor([5, 6]),
            torch.tensor([4, 4]))
    assert not extension.chain_commit(tokens, committed, *args)  # 7 + 1 is past the buffer's 8 tokens
    assert not extension.chain_commit(tokens, torch.tensor([3, 4]), args[0][:3], *args[1:])
    assert not tokens.any() and torch.equal(committed, torch.tensor([3, 7]))


@pytest.mark.parametrize("method,params,draft", [
    ("sd", {"gamma": 4}, "digits-gpt-draft"), ("block", {"gamma": 5}, "digits-gpt-draft"),
    ("lantern", {"gamma": 4}, "digits-gpt-draft"), ("cool_sd", {"gamma": 4, "delta": 2.0}, "digits-gpt-draft"),
    ("sd", {"gamma": 4, "cfg_scale": 1.0}, "digits-gpt-draft"), ("sd", {"gamma": 4}, "digits-gpt-eagle"),
    ("block", {"gamma": 3}, "digits-gpt-eagle"),
])
def test_the_chain_arms_give_the_same_samples_with_and_without_the_kernels(extension, monkeypatch, method, params,
                                                                         draft):
    """GPT-draft and head-chain arms with the bookkeeping kernels (each serving) against torch's operations: 12 samples
    at batch 12 (rows finish in different rounds: the tail rounds run on fewer rows, by torch's operations but for
    their uniforms, ``round_uniforms``'), CFG 1.5 unless set, seed 3; equal tokens and statistics."""
    if not get_preset(draft).weights_path.exists():
        pytest.skip(f"{draft} not trained")
    pair = load_pair("digits-gpt-target", draft, "cpu")
    ids = torch.arange(12) + 40
    names = (("chain_plan", "chain_verify_inputs", "chain_commit", "round_uniforms") if draft == "digits-gpt-draft"
             else ("chain_plan", "chain_verify_inputs", "tree_masks", "round_uniforms"))
    served = {name: [] for name in names}
    for name in names:
        real = getattr(extension, name)
        monkeypatch.setattr(extension, name, lambda *args, name=name, real=real: served[name].append(real(*args)) or
                            served[name][-1])
    with_kernels = generate_tokens(method, {"cfg_scale": 1.5, **params}, pair, ids % 10, ids, 3)
    for name in names:
        assert served[name] and all(out is not None and out is not False
                                    and (not isinstance(out, tuple) or out[0] is not None)
                                    for out in served[name]), name
    _torch_only(monkeypatch)
    for calls in served.values():
        calls.clear()
    without = generate_tokens(method, {"cfg_scale": 1.5, **params}, pair, ids % 10, ids, 3)
    assert not any(served.values())
    assert torch.equal(with_kernels[0], without[0])
    assert [vars(s) for s in with_kernels[1]] == [vars(s) for s in without[1]]
