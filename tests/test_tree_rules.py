"""Verification over static draft trees (spec discrete_sd.md §3.5, §4.6, §9 item 10).

Exact tests enumerate the law of one round of the tree kernel itself (tests/tree_enumeration.py) on
random toy trees: vocabulary 2–4, depth 1–3, 2–3 children per expanded node (the root always
expands, deeper nodes with probability 1/2), target and draft tables indexed by the full prefix
with ~30% of the distributions zeroed on a random subset (top-k emulation). The Monte-Carlo test
runs the batched kernel on 2·10^5 rows and chi-squares the padded outputs.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from specray import rng as srng
from specray.methods.discrete.lantern import (
    neighbours_from_embeddings,
    relaxed_target_mass_all_tokens,
)
from specray.methods.discrete.rules import RuleParams, cool_sd_omegas, normalise, verify
from specray.methods.discrete.tree_rules import (
    node_tables,
    tree_index,
    verify_tree,
    verify_tree_with_details,
)
from specray.methods.discrete.trees import (
    NAMED_TREES,
    StaticTree,
    TreeError,
    resolve_tree,
)
from tests.discrete_enumeration import lookup, random_chain, total_variation
from tests.tree_enumeration import (
    ToyTree,
    cool_sd_acceptance,
    coupling_bound,
    enumerate_tree_round,
    kernel_inputs,
    random_toy_tree,
    tree_target_law,
)

torch.set_num_threads(1)

EXACT_TOL = 1e-9


def toy_trees(seed: int, count: int) -> list[ToyTree]:
    gen = np.random.default_rng(seed)
    return [random_toy_tree(gen, int(gen.integers(2, 5)), int(gen.integers(1, 4))) for _ in range(count)]


TREES = toy_trees(seed=12, count=20)


def keep_p(rule, p, q, token, params, omega):  # noqa: ANN001
    """Negative control: after a rejection keep the target law instead of the residual."""
    return p.clone(), p


# ------------------------------------------------------------------------ the tree structure


def test_named_trees_shapes():
    assert (NAMED_TREES["eagle57"].num_nodes, NAMED_TREES["eagle57"].depth) == (57, 5)
    assert (NAMED_TREES["eagle25"].num_nodes, NAMED_TREES["eagle25"].depth) == (25, 5)
    small = NAMED_TREES["small"]
    assert small.depth <= 5 and small.num_nodes < 16
    for tree in NAMED_TREES.values():  # parents come first and children are drafted in order
        assert all(tree.parents[v] < v for v in range(1, tree.num_nodes + 1))
        for kids in tree.children:
            assert [tree.paths[k - 1][-1] for k in kids] == list(range(len(kids)))


def test_bad_trees_say_what_is_wrong():
    with pytest.raises(TreeError, match="parent \\[1\\] is not in the tree"):
        StaticTree.from_paths([[0], [1, 0]])
    with pytest.raises(TreeError, match="needs its elder sibling \\[0\\]"):
        StaticTree.from_paths([[1]])
    with pytest.raises(TreeError, match="listed twice"):
        StaticTree.from_paths([[0], [0]])
    with pytest.raises(TreeError, match="unknown tree 'eagle99'; allowed: eagle57"):
        resolve_tree("eagle99")
    with pytest.raises(TreeError, match="at least one node"):
        StaticTree.from_paths([])


# ------------------------------------------------------------------------ exactness (sd)


def test_sd_tree_round_law_is_the_target_law():
    worst = 0.0
    for toy in TREES:
        law = enumerate_tree_round(toy, "sd")
        assert abs(law.law.sum() - 1.0) < 1e-12
        assert not law.positive_weight_fallback, "a reachable rejection sampled an empty residual"
        worst = max(worst, total_variation(law.law, tree_target_law(toy)))
    print(f"sd on {len(TREES)} random trees: max TV {worst:.2e}")
    assert worst < EXACT_TOL


def test_negative_control_wrong_residual_fails_exactness():
    tvs = np.array([total_variation(enumerate_tree_round(t, "sd", residual_fn=keep_p).law, tree_target_law(t))
                    for t in TREES[:16]])
    print(f"residual = p after a rejection: max TV {tvs.max():.4f}, share > 1e-3: {(tvs > 1e-3).mean():.2f}")
    assert tvs.max() > 1e-2
    assert (tvs > 1e-3).mean() > 0.7


def test_tree_beats_its_first_path_in_tokens_per_round():
    # More children per node can only add accepted tokens: compare with the tree's leftmost path.
    gains = []
    for toy in TREES[:10]:
        chain = StaticTree.chain(toy.tree.depth)
        gains.append(enumerate_tree_round(toy, "sd").expected_tokens
                     - enumerate_tree_round(ToyTree(chain, toy.chain), "sd").expected_tokens)
    assert min(gains) > -1e-12 and max(gains) > 0.05


# ------------------------------------------------------------------------ relaxed rules on trees


@pytest.mark.parametrize("rule", ["cool_sd", "uniform_rsd"])
def test_cool_sd_on_trees_stays_within_its_bound(rule):
    cases = violations = 0
    for toy in TREES[:10] if rule == "cool_sd" else TREES[10:16]:
        target = tree_target_law(toy)
        for delta in (0.25, 1.1, 2.0, 4.0):
            params = RuleParams(delta=delta)
            law = enumerate_tree_round(toy, rule, params)
            tv = total_variation(law.law, target)
            bound = coupling_bound(toy, cool_sd_acceptance(rule, toy.tree.depth, params))
            cases += 1
            violations += tv > bound + 1e-12
            omegas = cool_sd_omegas(toy.tree.depth, delta) if rule == "cool_sd" else torch.tensor([delta])
            if omegas.max() <= 1.0:
                assert tv < 1e-12 and bound < 1e-12
            assert not law.positive_weight_fallback
    print(f"{rule} on trees: {cases} cases, {violations} bound violations")
    assert violations == 0


def _lantern(toy: ToyTree, seed: int, **kwargs) -> RuleParams:
    gen = torch.Generator().manual_seed(seed)
    return RuleParams(neighbours=neighbours_from_embeddings(torch.randn(toy.vocab, 3, generator=gen), toy.vocab - 1),
                      **kwargs)


def _lantern_acceptance(params: RuleParams):  # noqa: ANN202
    def acceptance(p: np.ndarray, q: np.ndarray, depth: int) -> np.ndarray:
        relaxed = relaxed_target_mass_all_tokens(torch.from_numpy(p)[None], params.neighbours, params.k, params.mode,
                                                 params.lam, params.delta, params.forbid_zero_target_mass)[0].numpy()
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(q > 0, np.minimum(1.0, relaxed / q), 0.0)
    return acceptance


def test_lantern_on_trees_reduces_to_sd_and_gstar_stays_within_bound():
    worst = 0.0
    for index, toy in enumerate(TREES[:8]):
        sd = enumerate_tree_round(toy, "sd").law
        for params in (_lantern(toy, index, k=0, lam=4.0), _lantern(toy, index, k=toy.vocab - 1, lam=1.0)):
            assert np.abs(enumerate_tree_round(toy, "lantern", params).law - sd).max() < 1e-12
        params = _lantern(toy, index, k=toy.vocab - 1, lam=3.0)
        law = enumerate_tree_round(toy, "lantern", params)
        tv = total_variation(law.law, tree_target_law(toy))
        assert tv <= coupling_bound(toy, _lantern_acceptance(params)) + 1e-12
        official = enumerate_tree_round(toy, "lantern", RuleParams(**{**params.__dict__, "residual": "official"}))
        assert abs(official.law.sum() - 1.0) < 1e-12
        worst = max(worst, tv)
    assert worst > 1e-3  # the relaxation does change the law


# ------------------------------------------------------------------------ the kernel's wiring


@pytest.mark.parametrize("rule,params", [("sd", RuleParams()), ("cool_sd", RuleParams(delta=2.0)),
                                         ("uniform_rsd", RuleParams(delta=1.5)), ("lantern", "lantern")])
def test_one_path_tree_decides_like_the_chain_kernel(rule, params):
    gen = np.random.default_rng(4)
    for trial in range(6):
        chain = random_chain(gen, vocab=5, gamma=3)
        if params == "lantern":
            params = RuleParams(k=2, lam=3.0, neighbours=neighbours_from_embeddings(torch.randn(5, 3), 3))
        seqs = np.stack([np.array([gen.integers(5) for _ in range(3)]) for _ in range(256)])
        toy = ToyTree(StaticTree.chain(3), chain)
        tokens = np.concatenate([np.zeros((256, 1), dtype=np.int64), seqs], axis=1)
        P_tree, Q_tree = kernel_inputs(toy, tokens)
        ids = torch.arange(256)
        u_acc = srng.uniform(trial, ids, "accept", shape=(3,))
        u_res = srng.uniform(trial, ids, "residual")
        chain_out = verify(rule, P_tree, Q_tree, torch.from_numpy(seqs), u_acc, u_res, params)
        tree_out = verify_tree(rule, tree_index(toy.tree, torch.device("cpu")), P_tree, Q_tree,
                               torch.from_numpy(tokens), torch.ones(256, 4, dtype=torch.bool),
                               torch.cat([torch.zeros(256, 1, dtype=torch.float64), u_acc], 1), u_res, params)
        assert torch.equal(chain_out.n_accepted, tree_out.n_accepted)
        assert torch.equal(chain_out.next_token, tree_out.next_token)


def test_kernel_reads_only_the_nodes_on_its_walk():
    gen = np.random.default_rng(8)
    toy = random_toy_tree(gen, vocab=4, depth=3)
    tree, nodes = toy.tree, toy.tree.num_nodes + 1
    index = tree_index(tree, torch.device("cpu"))
    tokens = gen.integers(0, 4, size=(512, nodes))
    P, Q = kernel_inputs(toy, tokens)
    u = torch.from_numpy(gen.random((512, nodes)))
    u_res = torch.from_numpy(gen.random(512))
    valid = torch.ones(512, nodes, dtype=torch.bool)
    out, details = verify_tree_with_details("cool_sd", index, P, Q, torch.from_numpy(tokens), valid, u, u_res,
                                            RuleParams(delta=2.0))
    # Nodes whose parent is not on the accepted path (nor the root) were never tried: scramble them.
    on_path = torch.zeros(512, nodes, dtype=torch.bool)
    on_path[:, 0] = True
    on_path.scatter_(1, out.path, True)
    tried = on_path[:, index.parents.clamp(min=0)] & (index.parents >= 0)
    off = ~(tried | on_path)
    scrambled = torch.where(off, torch.from_numpy(gen.integers(0, 4, size=(512, nodes))), torch.from_numpy(tokens))
    P2, Q2 = kernel_inputs(toy, scrambled.numpy())
    u2 = torch.where(off, torch.from_numpy(gen.random((512, nodes))), u)
    again = verify_tree("cool_sd", index, P2, Q2, scrambled, valid, u2, u_res, RuleParams(delta=2.0))
    assert off.any()
    assert torch.equal(out.path, again.path) and torch.equal(out.next_token, again.next_token)


def _walk_by_hand(tree: StaticTree, pass_probs: np.ndarray, u: np.ndarray, internal_of: dict) -> tuple[list, int]:
    """The walk of one row, step by step: at each node try the children in order, descend to the first that
    passes (u < its pass probability); stop where none passes. Returns the accepted nodes and where it
    stopped (-1 at a leaf)."""
    node, path = 0, []
    while tree.children[node]:
        i = internal_of[node]
        passing = [c for j, c in enumerate(tree.children[node]) if u[c] < pass_probs[i, j]]
        if not passing:
            return path, i
        node = passing[0]
        path.append(node)
    return path, -1


@pytest.mark.parametrize("tree_name", ["small", "eagle25", "toys"])
def test_walk_matches_a_walk_by_hand(tree_name):
    # 512 rows per tree, seed 21, uniforms drawn near the pass probabilities so that many nodes have several
    # passing children (first versus any other matters) and many rows stop early; every row must agree exactly.
    gen = np.random.default_rng(21)
    toys = TREES[:8] if tree_name == "toys" else [ToyTree(NAMED_TREES[tree_name], random_chain(
        gen, vocab=5, gamma=NAMED_TREES[tree_name].depth, zero_prob=0.3))]
    several = stops = 0
    for toy in toys:
        tree, nodes = toy.tree, toy.tree.num_nodes + 1
        index = tree_index(tree, torch.device("cpu"))
        internal_of = {v: i for i, v in enumerate(tree.internal)}
        tokens = gen.integers(0, toy.vocab, size=(512, nodes))
        valid = torch.from_numpy(gen.random((512, nodes)) < 0.9)
        P, Q = kernel_inputs(toy, tokens)
        u = torch.from_numpy(gen.random((512, nodes)) ** 2)
        params = RuleParams(delta=2.0)
        out, details = verify_tree_with_details("cool_sd", index, P, Q, torch.from_numpy(tokens), valid, u,
                                                torch.from_numpy(gen.random(512)), params)
        child_tokens, child_valid = torch.from_numpy(tokens)[:, index.child_nodes], valid[:, index.child_nodes]
        probs, fallback, _ = node_tables("cool_sd", index, normalise(P)[:, index.internal], normalise(Q), child_tokens,
                                         child_valid, params)
        assert torch.equal(probs, details.pass_probs)
        for b in range(512):
            path, stopped = _walk_by_hand(tree, probs[b].numpy(), u[b].numpy(), internal_of)
            assert out.path[b].tolist() == path + [0] * (tree.depth - len(path)), b
            assert int(out.n_accepted[b]) == len(path)
            law = fallback[b, stopped] if stopped >= 0 else normalise(P)[b, path[-1]]
            assert torch.equal(details.next_token_probs[b], law)
            several += sum(bool(u[b, c] < probs[b, 0, j]) for j, c in enumerate(tree.children[0])) > 1
            stops += stopped >= 0
    assert several > 20 and stops > 20  # the walks tested include first-of-several passes and rejections


def test_errors_name_the_bad_input():
    index = tree_index(NAMED_TREES["small"], torch.device("cpu"))
    n, i = NAMED_TREES["small"].num_nodes + 1, index.internal.shape[0]
    P = torch.full((2, n, 5), 0.2)
    Q = torch.full((2, i, 5), 0.2)
    tokens = torch.zeros(2, n, dtype=torch.int64)
    valid = torch.ones(2, n, dtype=torch.bool)
    u = torch.zeros(2, n, dtype=torch.float64)
    with pytest.raises(ValueError, match="cannot verify a tree; allowed: sd, lantern"):
        verify_tree("block", index, P, Q, tokens, valid, u, u[:, 0])
    with pytest.raises(ValueError, match=rf"Q must have shape \[2, {i}, 5\]"):
        verify_tree("sd", index, P, Q[:, :2], tokens, valid, u, u[:, 0])
    with pytest.raises(ValueError, match="u_residual"):
        verify_tree("sd", index, P, Q, tokens, valid, u, u)


# ------------------------------------------------------------------------ Monte Carlo


MC_ROWS = 200_000
MC_SEED = 21


def _draw_tree(toy: ToyTree, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of node tokens drawn as the loop drafts them (children without replacement, in order)."""
    tree, nodes = toy.tree, toy.tree.num_nodes + 1
    tokens = np.zeros((n, nodes), dtype=np.int64)
    valid = np.ones((n, nodes), dtype=bool)
    u = srng.uniform(MC_SEED, torch.arange(n), "draft", shape=(nodes,)).numpy()
    for v in tree.internal:
        left = lookup(toy.chain.Q_tab[tree.depths[v]], tokens[:, tree.ancestors(v)[::-1]])
        for child in tree.children[v]:
            mass = left.sum(1)
            drafted = (mass > 0) & valid[:, v]
            safe = np.where(mass[:, None] > 0, left, 1.0)
            pick = srng.sample_categorical(torch.from_numpy(safe), torch.from_numpy(u[:, child])).numpy()
            tokens[:, child] = np.where(drafted, pick, 0)
            valid[:, child] = drafted
            left[np.arange(n), pick] = np.where(drafted, 0.0, left[np.arange(n), pick])
    return tokens, valid


def _chi_square_p(seq: np.ndarray, law: np.ndarray) -> tuple[float, int]:
    flat = np.ravel_multi_index(tuple(seq.T), law.shape)
    counts = np.bincount(flat, minlength=law.size).astype(float)
    probs = law.reshape(-1)
    expected = probs * len(seq)
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(stats.chi2.sf(((obs - exp) ** 2 / exp).sum(), len(obs) - 1)), int(counts[probs == 0].sum())


@pytest.mark.parametrize("rule,params,against_target", [("sd", RuleParams(), True),
                                                        ("cool_sd", RuleParams(delta=2.0), False)])
def test_monte_carlo_batched_tree_kernel(rule, params, against_target):
    # N = 2e5 rows, seed MC_SEED; chi-square p > 1e-3 against the exact law, mean tokens within 4 SE.
    gen = np.random.default_rng(30)
    toy = ToyTree(StaticTree.from_paths([[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]),
                  random_chain(gen, vocab=3, gamma=3, zero_prob=0.3))
    exact = enumerate_tree_round(toy, rule, params)
    tokens, valid = _draw_tree(toy, MC_ROWS)
    P, Q = kernel_inputs(toy, tokens)
    ids = torch.arange(MC_ROWS)
    nodes, depth = toy.tree.num_nodes + 1, toy.tree.depth
    out = verify_tree(rule, tree_index(toy.tree, torch.device("cpu")), P.float(), Q.float(), torch.from_numpy(tokens),
                      torch.from_numpy(valid), srng.uniform(MC_SEED, ids, "accept", shape=(nodes,)),
                      srng.uniform(MC_SEED, ids, "residual"), params)
    n_acc = out.n_accepted.numpy()
    seq = np.zeros((MC_ROWS, depth + 1), dtype=np.int64)
    seq[:, :depth] = np.take_along_axis(tokens, out.path.numpy(), 1)
    seq[np.arange(MC_ROWS), n_acc] = out.next_token.numpy()
    u_pad = srng.uniform(MC_SEED, ids, "pad", shape=(depth + 1,)).numpy()
    for m in range(depth + 1):
        fresh = srng.sample_categorical(torch.from_numpy(lookup(toy.chain.P_tab[m], seq[:, :m])),
                                        torch.from_numpy(u_pad[:, m])).numpy()
        seq[:, m] = np.where(m > n_acc, fresh, seq[:, m])
    target = tree_target_law(toy)
    p_value, impossible = _chi_square_p(seq, target if against_target else exact.law)
    tokens_per_round = n_acc + 1
    z = (tokens_per_round.mean() - exact.expected_tokens) / (tokens_per_round.std(ddof=1) / np.sqrt(MC_ROWS))
    print(f"{rule} tree: p={p_value:.3f}, tokens/round {tokens_per_round.mean():.4f} vs {exact.expected_tokens:.4f} "
          f"(z={z:.2f}), exact TV to target {total_variation(exact.law, target):.4f}")
    assert impossible == 0 and p_value > 1e-3 and abs(z) < 4
    assert len(np.unique(n_acc)) == depth + 1
    if not against_target:  # negative control: the relaxed rule's samples fail the target law
        assert _chi_square_p(seq, target)[0] < 1e-6
