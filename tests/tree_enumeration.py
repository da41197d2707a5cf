"""Exact law of one static-tree round on toy categorical trees (spec discrete_sd.md §3.5, §9 item 10).

A toy tree instance is a static tree (depth D) plus target and draft tables indexed by the full
prefix (a :class:`~tests.discrete_enumeration.ToyChain` with ``gamma = D``). The law of a round is
the law of the emitted tokens padded with target sampling to length D + 1.

Like the chain enumerator, this computes the law of the *kernel itself*
(``tree_rules._verify_tree_impl``), walking down the tree depth by depth:

1. at the current node, every ordered draw of its children without replacement from the draft table
   becomes one row (weight: the probability of that draw; a child beyond the draft's support is
   not drafted). Nodes off the walk get a fixed filler draw (the kernel must not read them; a test
   checks that separately);
2. one kernel call returns every child's pass probability ``a_j`` (they do not depend on the
   uniforms); each row is split into the outcomes "child k is the first to pass" and "no child
   passes", with weight ``Π_{l<k}(1 − a_l) a_k`` resp. ``Π_l (1 − a_l)``, and uniforms set inside
   the matching intervals (``(1 + a_l)/2`` fails, ``a_k/2`` passes);
3. a pass that lands on an internal node continues the walk there; every other outcome is a
   finished row. One last kernel call on the finished rows gives its own accepted path and the exact
   vector it draws the next token from, which is continued with the target tables.

A wrong decision, a wrong walk or a wrong residual inside the kernel changes the enumerated law.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from specray.methods.discrete.rules import RuleParams, rule_omegas
from specray.methods.discrete.tree_rules import (
    ResidualFn,
    _verify_tree_impl,
    rejection_residual,
    tree_index,
)
from specray.methods.discrete.trees import StaticTree
from tests.discrete_enumeration import (
    ToyChain,
    lookup,
    random_chain,
    suffix_target_probs,
    total_variation,
)


@dataclass
class ToyTree:
    tree: StaticTree
    chain: ToyChain  # P_tab for prefixes of length 0..D, Q_tab for 0..D-1

    @property
    def vocab(self) -> int:
        return self.chain.vocab


@dataclass
class TreeRoundLaw:
    law: np.ndarray  # [V] * (D + 1)
    expected_tokens: float  # E[n_accepted + 1]
    positive_weight_fallback: bool
    rows: int


def random_tree(gen: np.random.Generator, depth: int, max_rows: int = 40_000) -> StaticTree:
    """2–3 children per expanded node; the root always expands, deeper nodes with probability 1/2."""
    while True:
        counts: dict[tuple[int, ...], int] = {(): int(gen.integers(2, 4))}
        frontier = [()]
        for _ in range(depth - 1):
            nxt = []
            for parent in frontier:
                for i in range(counts[parent]):
                    child = parent + (i,)
                    if i == 0 or gen.random() < 0.5:
                        counts[child] = int(gen.integers(2, 4))
                        nxt.append(child)
            frontier = nxt
        paths = [parent + (i,) for parent, n in counts.items() for i in range(n)]
        tree = StaticTree.from_paths(paths)
        if tree.depth == depth and _walk_rows_estimate(tree, 4) <= max_rows:
            return tree


def _walk_rows_estimate(tree: StaticTree, vocab: int) -> int:
    def rows(node: int) -> int:
        kids = tree.children[node]
        draws = int(np.prod([vocab - j for j in range(len(kids))]))
        return draws * (1 + sum(rows(c) for c in kids if tree.children[c]))
    return rows(0)


def random_toy_tree(gen: np.random.Generator, vocab: int, depth: int, zero_prob: float = 0.3) -> ToyTree:
    return ToyTree(random_tree(gen, depth), random_chain(gen, vocab, depth, zero_prob))


# ---- inputs of the kernel for rows of node tokens ------------------------------------------------


def node_prefixes(tree: StaticTree, tokens: np.ndarray, node: int) -> np.ndarray:
    """The tokens on the path from the root's child to ``node`` (included) for every row: ``[R, depth(node)]``,
    the prefix the tables are indexed by at ``node``."""
    return tokens[:, tree.ancestors(node)[::-1]]


def kernel_inputs(toy: ToyTree, tokens: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """P ``[R, N+1, V]`` at every node and Q ``[R, I, V]`` at the internal nodes, along rows of node tokens."""
    tree, chain = toy.tree, toy.chain
    P = np.stack([lookup(chain.P_tab[tree.depths[v]], node_prefixes(tree, tokens, v)) for v in range(tree.num_nodes + 1)], 1)
    Q = np.stack([lookup(chain.Q_tab[tree.depths[v]], node_prefixes(tree, tokens, v)) for v in tree.internal], 1)
    return torch.from_numpy(P), torch.from_numpy(Q)


def _fill_children(toy: ToyTree, tokens: np.ndarray, valid: np.ndarray, assigned: np.ndarray) -> None:
    """Filler draw for internal nodes whose children are not assigned: the draft's likeliest tokens in order."""
    tree = toy.tree
    for v in tree.internal:  # parents before children
        todo = ~assigned[:, v]
        if not todo.any():
            continue
        q = lookup(toy.chain.Q_tab[tree.depths[v]], node_prefixes(tree, tokens[todo], v))
        order = np.argsort(-q, axis=1, kind="stable")
        for j, child in enumerate(tree.children[v]):
            tokens[todo, child] = order[:, j] if j < q.shape[1] else 0
            in_support = np.take_along_axis(q, order[:, j : j + 1], 1)[:, 0] > 0 if j < q.shape[1] else False
            valid[todo, child] = valid[todo, v] & in_support


def ordered_draws(q: np.ndarray, m: int) -> list[tuple[tuple[int, ...], tuple[bool, ...], float]]:
    """Every ordered draw of m children without replacement from q: (tokens, drafted, probability)."""
    vocab = q.shape[0]
    out = []
    for drawn in itertools.permutations(range(vocab), min(m, vocab)):
        seq = drawn + (0,) * (m - len(drawn))  # more children than tokens: the rest are never drafted
        left, weight, tokens, drafted, dead = q.copy(), 1.0, [], [], False
        for position, token in enumerate(seq):
            mass = left.sum()
            if dead or mass <= 0 or position >= len(drawn):
                dead = True
                tokens.append(0)
                drafted.append(False)
                continue
            weight *= left[token] / mass
            tokens.append(token)
            drafted.append(True)
            left[token] = 0.0
        if weight > 0:
            out.append((tuple(tokens), tuple(drafted), weight))
    # Draws that ran out of support are listed once per order of the undrafted tail: keep one.
    unique: dict[tuple, tuple] = {}
    for tokens, drafted, weight in out:
        key = tuple(t if d else -1 for t, d in zip(tokens, drafted))
        unique.setdefault(key, (tokens, drafted, weight))
    return list(unique.values())


def enumerate_tree_round(toy: ToyTree, rule: str, params: RuleParams | None = None,
                         residual_fn: ResidualFn = rejection_residual) -> TreeRoundLaw:
    """Exact law of one round of ``rule`` on ``toy`` (see the module docstring)."""
    params = params or RuleParams()
    tree, vocab, depth = toy.tree, toy.vocab, toy.tree.depth
    index = tree_index(tree, torch.device("cpu"))
    nodes = tree.num_nodes + 1
    internal_of = {v: i for i, v in enumerate(tree.internal)}

    def run(tokens: np.ndarray, valid: np.ndarray, u: np.ndarray):
        P, Q = kernel_inputs(toy, tokens)
        return _verify_tree_impl(rule, index, P, Q, torch.from_numpy(tokens), torch.from_numpy(valid),
                                 torch.from_numpy(u), torch.zeros(len(tokens), dtype=torch.float64), params, residual_fn)

    # A state: node tokens, drafted flags, which nodes have their children assigned, uniforms, weight, node.
    tokens0 = np.zeros((1, nodes), dtype=np.int64)
    valid0 = np.ones((1, nodes), dtype=bool)
    states = [(tokens0[0], valid0[0], np.zeros(nodes, dtype=bool), np.full(nodes, 0.5), 1.0, 0)]
    finished: list[tuple[np.ndarray, np.ndarray, np.ndarray, float]] = []
    while states:
        rows = []  # expand each state's node into its children draws
        for tokens, valid, assigned, u, weight, node in states:
            q = lookup(toy.chain.Q_tab[tree.depths[node]], node_prefixes(tree, tokens[None], node))[0]
            for draw, drafted, w in ordered_draws(q, len(tree.children[node])):
                t, d, a = tokens.copy(), valid.copy(), assigned.copy()
                t[list(tree.children[node])] = draw
                d[list(tree.children[node])] = np.array(drafted) & valid[node]
                a[node] = True
                rows.append((t, d, a, u.copy(), weight * w, node))
        tokens = np.stack([r[0] for r in rows])
        valid = np.stack([r[1] for r in rows])
        assigned = np.stack([r[2] for r in rows])
        _fill_children(toy, tokens, valid, assigned)
        _, details = run(tokens, valid, np.stack([r[3] for r in rows]))
        a_all = details.pass_probs.numpy()
        states = []
        for r, (_, _, _, u, weight, node) in enumerate(rows):
            kids = tree.children[node]
            a = a_all[r, internal_of[node], : len(kids)]
            reach = 1.0
            for k, child in enumerate(kids + (None,)):
                if child is None:  # no child passes
                    u_out = u.copy()
                    u_out[list(kids)] = (1 + a) / 2
                    if weight * reach > 0:
                        finished.append((tokens[r], valid[r], u_out, weight * reach))
                    break
                p_k = reach * a[k]
                if weight * p_k > 0:
                    u_out = u.copy()
                    u_out[list(kids[:k])] = (1 + a[:k]) / 2
                    u_out[child] = a[k] / 2
                    if tree.children[child]:
                        states.append((tokens[r].copy(), valid[r].copy(), assigned[r].copy(), u_out, weight * p_k, child))
                    else:
                        finished.append((tokens[r], valid[r], u_out, weight * p_k))
                reach *= 1 - a[k]

    tokens = np.stack([f[0] for f in finished])
    valid = np.stack([f[1] for f in finished])
    weight = np.array([f[3] for f in finished])
    out, details = run(tokens, valid, np.stack([f[2] for f in finished]))
    n_acc = out.n_accepted.numpy()
    path = out.path.numpy()
    next_probs = details.next_token_probs.numpy()
    grouped: dict[tuple[int, ...], np.ndarray] = {}
    for r in range(len(finished)):
        prefix = tuple(int(tokens[r, path[r, t]]) for t in range(n_acc[r]))
        grouped[prefix] = grouped.get(prefix, 0.0) + weight[r] * next_probs[r]
    suffix = suffix_target_probs(toy.chain)
    law = np.zeros((vocab,) * (depth + 1))
    for prefix, y_law in grouped.items():
        n = len(prefix)
        law[prefix] += y_law.reshape((vocab,) + (1,) * (depth - n)) * suffix[n + 1][prefix]
    return TreeRoundLaw(law=law, expected_tokens=float((weight * (n_acc + 1)).sum()),
                        positive_weight_fallback=bool(details.residual_fallback.numpy()[weight > 0].any()),
                        rows=len(finished))


def tree_target_law(toy: ToyTree) -> np.ndarray:
    return suffix_target_probs(toy.chain)[0]


# ---- the coupling bound on a tree (independent of the kernel) ------------------------------------


def coupling_bound(toy: ToyTree, acceptance) -> float:  # noqa: ANN001
    """``Σ_nodes Pr(node reached) · Σ_steps Pr(step reached) · Σ_x [q_j f_j − p_j]_+`` with the G* update.

    ``acceptance(p, q, depth) -> f`` gives every token's acceptance probability at a child step of
    depth ``depth`` (1-based) from the current target ``p`` and the step's draft law ``q``. The bound
    is the one-step optimality of G* (spec Appendix A.1) applied to each child step, summed along
    the walk (A.2); expectations over the draws are exact.
    """
    tree, chain = toy.tree, toy.chain

    def node_bound(node: int, prefix: tuple[int, ...]) -> float:
        t = tree.depths[node]
        p0 = lookup(chain.P_tab[t], np.array([prefix], dtype=np.int64).reshape(1, t))[0]
        q0 = lookup(chain.Q_tab[t], np.array([prefix], dtype=np.int64).reshape(1, t))[0]
        kids = tree.children[node]

        def steps(j: int, p: np.ndarray, q_left: np.ndarray) -> float:
            if j == len(kids) or q_left.sum() <= 0:
                return 0.0
            q = q_left / q_left.sum()
            f = acceptance(p, q, t + 1)
            total = float(np.clip(q * f - p, 0, None).sum())
            residual = np.clip(p - q * f, 0, None)
            p_next = residual / residual.sum() if residual.sum() > 0 else p
            for c in np.nonzero(q > 0)[0]:
                child = kids[j]
                if tree.children[child] and f[c] > 0:
                    total += q[c] * f[c] * node_bound(child, prefix + (int(c),))
                if f[c] < 1:
                    left = q_left.copy()
                    left[c] = 0.0
                    total += q[c] * (1 - f[c]) * steps(j + 1, p_next, left)
            return total

        return steps(0, p0, q0.copy())

    return node_bound(0, ())


def cool_sd_acceptance(rule: str, depth: int, params: RuleParams):  # noqa: ANN201
    omegas = rule_omegas(rule, depth, params).numpy()

    def acceptance(p: np.ndarray, q: np.ndarray, t: int) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(q > 0, np.minimum(1.0, omegas[t - 1] * p / q), 0.0)

    return acceptance


__all__ = [
    "ToyTree", "TreeRoundLaw", "cool_sd_acceptance", "coupling_bound", "enumerate_tree_round", "kernel_inputs",
    "ordered_draws", "random_toy_tree", "random_tree", "total_variation", "tree_target_law",
]
