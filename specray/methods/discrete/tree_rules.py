"""Verification of a static draft tree (spec discrete_sd §3.5 and §4.6), batched over rows.

At every node the drafter sampled the node's children ``c_1, c_2, ...`` without replacement from
its processed law ``q``; child ``j`` was drawn from ``q_j = Norm(q without c_1 .. c_{j-1})``. One
target call gave the processed law ``P`` at the root and at every node. Verification walks down
from the root, one depth at a time (recursive rejection without replacement): at the current node,
with ``p`` = P there, the children are tried in order,

* child ``c_j`` passes with probability ``f_j(c_j) = min(1, p̃(c_j) / q_j(c_j))``, where ``p̃`` is the
  rule's relaxed target mass computed on the *current* ``p``: ``p`` itself (``sd``), ``ω_t p``
  (``cool_sd`` / ``uniform_rsd``, ω by the child's depth ``t``), the λ- or δ-aggregation over latent
  neighbours (``lantern``);
* a pass descends to that child; a failure updates ``p ← Norm([p − q_j · f_j]_+)`` (``f_j`` of every
  token: the G* residual, which for ``sd`` is ``[p − q_j]_+``) — or, for ``lantern`` with
  ``residual: official``, the released LlamaGen code's ``Norm([p − q_j']_+)`` with ``q_j`` zeroed on the
  k+1 nearest neighbours of ``c_j`` when neighbour mass was used — and moves to the next child;
* when every child failed, the next token is drawn from the current ``p``; at a leaf (every drafted
  depth accepted) it is the bonus, drawn from P at the leaf.

Without relaxation this is exact: a rejected ``c_j`` has ``q_j(c_j) > p(c_j)``, so the updated ``p``
has no mass on it and the remaining children solve the same problem on the rest of the vocabulary.
Block verification has no tree form here (it is defined for one draft block); the parameter class
refuses it.

The per-child acceptance probabilities do not depend on the uniforms (every child of every node is
scored as if reached, vectorised over the tree's internal nodes), so :class:`TreeVerifyDetails`
exposes them and the exact-enumeration tests can weight each walk.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray.methods.discrete import cpu_tree_rounds
from specray.methods.discrete.lantern import relaxed_target_mass
from specray.methods.discrete.rules import (
    RuleParams,
    _at_draft,
    _ratio_prob,
    normalise,
    rejection_residual,
    rule_omegas,
    validate_params,
)
from specray.methods.discrete.trees import StaticTree
from specray.rng import sample_categorical

TREE_RULES = ("sd", "lantern", "cool_sd", "uniform_rsd")
_F64 = torch.float64


@dataclass(frozen=True)
class TreeIndex:
    """A :class:`StaticTree` as index tensors on one device."""

    tree: StaticTree
    internal: torch.Tensor  # [I] node ids with children, root first
    internal_ids: torch.Tensor  # [I] arange
    node_ids: torch.Tensor  # [N + 1] arange
    internal_of: torch.Tensor  # [N + 1] internal index of a node, -1 for leaves
    child_nodes: torch.Tensor  # [I, C] child node ids in drafting order (0 where absent)
    child_exists: torch.Tensor  # [I, C] bool
    internal_depth: torch.Tensor  # [I] depth of each internal node (its children are one deeper)
    depths: torch.Tensor  # [N + 1]
    parents: torch.Tensor  # [N + 1], -1 for the root
    visible: torch.Tensor  # [N + 1, N + 1] bool: node a may attend to node b (b is a or an ancestor of a)
    path_to: torch.Tensor  # [N + 1, depth]: node v's ancestor at depth t + 1 (v itself at its own depth), 0 below v


@functools.lru_cache(maxsize=32)
def tree_index(tree: StaticTree, device: torch.device) -> TreeIndex:
    """Index tensors of ``tree`` on ``device`` (built once per tree and device; read-only)."""
    internal = list(tree.internal)
    width = tree.max_children
    child_nodes = torch.zeros(len(internal), width, dtype=torch.int64)
    child_exists = torch.zeros(len(internal), width, dtype=torch.bool)
    for i, node in enumerate(internal):
        kids = tree.children[node]
        child_nodes[i, : len(kids)] = torch.tensor(kids)
        child_exists[i, : len(kids)] = True
    internal_of = torch.full((tree.num_nodes + 1,), -1, dtype=torch.int64)
    internal_of[torch.tensor(internal)] = torch.arange(len(internal))
    visible = torch.zeros(tree.num_nodes + 1, tree.num_nodes + 1, dtype=torch.bool)
    path_to = torch.zeros(tree.num_nodes + 1, tree.depth, dtype=torch.int64)
    for node in range(tree.num_nodes + 1):
        visible[node, 0] = True
        visible[node, tree.ancestors(node)] = True
        for ancestor in tree.ancestors(node):  # node itself included
            path_to[node, tree.depths[ancestor] - 1] = ancestor
    return TreeIndex(
        tree=tree,
        internal=torch.tensor(internal, device=device),
        internal_ids=torch.arange(len(internal), device=device),
        node_ids=torch.arange(tree.num_nodes + 1, device=device),
        internal_of=internal_of.to(device),
        child_nodes=child_nodes.to(device),
        child_exists=child_exists.to(device),
        internal_depth=torch.tensor([tree.depths[v] for v in internal], device=device),
        depths=torch.tensor(tree.depths, device=device),
        parents=torch.tensor(tree.parents, device=device),
        visible=visible.to(device),
        path_to=path_to.to(device),
    )


@dataclass
class TreeVerifyOutput:
    n_accepted: torch.Tensor  # int64 [B], accepted depths, 0 .. tree depth
    path: torch.Tensor  # int64 [B, depth]: accepted node ids, 0 past n_accepted
    next_token: torch.Tensor  # int64 [B]: correction or bonus


@dataclass
class TreeVerifyDetails:
    """What the round was decided from (used by the exact-enumeration tests)."""

    pass_probs: torch.Tensor  # float64 [B, I, C]: child j of internal node i passes iff u < this (if reached)
    next_token_probs: torch.Tensor  # float64 [B, V], normalised law the next token was drawn from
    residual_fallback: torch.Tensor  # bool [B]: a rejection on the way had an empty residual (guard used)


# A residual update after rejecting a child, injectable so tests can run a wrong one (negative control):
# (rule, p, q_j, child token, params, omega) -> (unnormalised residual, guard), shapes [B, I, V].
ResidualFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def node_omegas(rule: str, index: TreeIndex, params: RuleParams, device: torch.device) -> torch.Tensor | None:
    """``ω`` of each internal node's children, ``[I, 1]`` (COOL-SD schedule over the tree's depth), or None."""
    if rule not in ("cool_sd", "uniform_rsd"):
        return None
    omegas = rule_omegas(rule, index.tree.depth, params).to(device)
    return omegas[index.internal_depth].unsqueeze(-1)


def node_tables(rule: str, index: TreeIndex, P_int: torch.Tensor, Q_int: torch.Tensor, child_tokens: torch.Tensor,
                child_valid: torch.Tensor, params: RuleParams,
                residual_fn: ResidualFn = rejection_residual) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every internal node's child steps, scored as if reached.

    ``P_int``, ``Q_int`` ``[B, I, V]`` normalised float64 target and drafter laws at the internal nodes;
    ``child_tokens``, ``child_valid`` ``[B, I, C]``. Returns ``pass_probs [B, I, C]`` (0 for absent or
    invalid children), the law to draw from when every child fails ``[B, I, V]`` (normalised), and
    ``guarded [B, I]`` (some rejection on the way had an empty residual).
    """
    omega = node_omegas(rule, index, params, P_int.device)
    p = P_int
    q_left = Q_int.clone()  # q with the earlier children removed, unnormalised
    passes = []  # per child slot j: [B, I]
    guarded = torch.zeros(P_int.shape[:2], dtype=torch.bool, device=P_int.device)
    drafted = child_valid & index.child_exists
    children = child_tokens.shape[-1]
    for j in range(children):
        token = child_tokens.select(-1, j)
        q_mass = q_left.sum(-1)
        q_positive = q_mass > 0
        present = drafted.select(-1, j) & q_positive
        q_j = q_left / torch.where(q_positive, q_mass, 1.0).unsqueeze(-1)
        q_token = _at_draft(q_j, token)  # one indexing op
        passes.append(torch.where(present, _ratio_prob(_relaxed_mass(rule, p, token, params, omega), q_token), 0.0))
        residual, guard = residual_fn(rule, p, q_j, token, params, omega)
        mass = residual.sum(-1, keepdim=True)
        empty = mass.squeeze(-1) <= 0
        updated = torch.where(empty.unsqueeze(-1), guard, residual / torch.where(mass > 0, mass, 1.0))
        p = torch.where(present.unsqueeze(-1), updated, p)
        guarded |= present & empty
        if j == children - 1:  # no later child reads q_left
            break
        drawn = torch.zeros_like(q_left, dtype=torch.bool).scatter_(-1, token.unsqueeze(-1), present.unsqueeze(-1))
        q_left = q_left.masked_fill(drawn, 0.0)
    return torch.stack(passes, dim=-1), p, guarded


def _relaxed_mass(rule: str, p: torch.Tensor, token: torch.Tensor, params: RuleParams,
                  omega: torch.Tensor | None) -> torch.Tensor:
    """``p̃(token)`` on the current ``p``: what the child's draft probability is compared against."""
    if rule == "lantern":
        return relaxed_target_mass(p, token, params.neighbours, params.k, params.mode, params.lam, params.delta,
                                   params.forbid_zero_target_mass)[0]
    p_token = _at_draft(p, token)  # p[b, i, token[b, i]] in one indexing op
    return p_token if omega is None else omega.squeeze(-1) * p_token


def _validate(rule: str, index: TreeIndex, P: torch.Tensor, Q: torch.Tensor, tokens: torch.Tensor,
              valid: torch.Tensor, u_accept: torch.Tensor, u_residual: torch.Tensor) -> None:
    if rule not in TREE_RULES:
        raise ValueError(f"rule {rule!r} cannot verify a tree; allowed: {', '.join(TREE_RULES)} "
                         "(block verification is defined for chains)")
    nodes = index.tree.num_nodes + 1
    if P.dim() != 3 or P.shape[1] != nodes:
        raise ValueError(f"P must have shape [B, nodes={nodes}, V], got {tuple(P.shape)}")
    batch, _, vocab = P.shape
    expected = {"Q": (Q, (batch, index.internal.shape[0], vocab)), "tokens": (tokens, (batch, nodes)),
                "valid": (valid, (batch, nodes)), "u_accept": (u_accept, (batch, nodes)),
                "u_residual": (u_residual, (batch,))}
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} must have shape {list(shape)}, got {list(tensor.shape)}")


def _verify_tree_impl(rule: str, index: TreeIndex, P: torch.Tensor, Q: torch.Tensor, tokens: torch.Tensor,
                      valid: torch.Tensor, u_accept: torch.Tensor, u_residual: torch.Tensor, params: RuleParams,
                      residual_fn: ResidualFn = rejection_residual,
                      validate: bool = True) -> tuple[TreeVerifyOutput, TreeVerifyDetails]:
    if validate:
        validate_params(rule, params)
        _validate(rule, index, P, Q, tokens, valid, u_accept, u_residual)
    batch = P.shape[0]
    device = P.device
    P64 = normalise(P)
    child_tokens = tokens[:, index.child_nodes]  # [B, I, C]
    child_valid = valid[:, index.child_nodes]
    pass_probs, fallback_law, guarded = node_tables(
        rule, index, P64[:, index.internal], normalise(Q), child_tokens, child_valid, params, residual_fn)

    # Where the walk goes from each node: its first passing child, or itself (every child failed, or a
    # leaf), so that depth steps of one lookup each walk every row down its accepted path and then stay.
    passed = u_accept.to(_F64)[:, index.child_nodes] < pass_probs  # [B, I, C]
    first = index.child_nodes[index.internal_ids, passed.to(torch.int64).argmax(-1)]  # [B, I]
    step = index.node_ids.repeat(batch, 1)  # [B, N + 1]
    step[:, index.internal] = torch.where(passed.any(-1), first, index.internal)
    rows = torch.arange(batch, device=device)
    node = torch.zeros(batch, dtype=torch.int64, device=device)
    for _ in range(index.tree.depth):
        node = step[rows, node]
    path = index.path_to[node]  # [B, depth]: the accepted nodes, 0 past the last
    n_accepted = index.depths[node]
    rejected_at = index.internal_of[node]  # the walk ended at an internal node: every child there failed
    rejected = rejected_at >= 0
    law = torch.where(rejected.unsqueeze(-1), fallback_law[rows, rejected_at.clamp(min=0)], P64[rows, node])
    next_token = sample_categorical(law, u_residual.to(device=device, dtype=_F64))
    fallback = rejected & guarded[rows, rejected_at.clamp(min=0)]
    return (TreeVerifyOutput(n_accepted=n_accepted, path=path, next_token=next_token),
            TreeVerifyDetails(pass_probs=pass_probs, next_token_probs=law, residual_fallback=fallback))


def verify_tree_with_details(rule: str, index: TreeIndex, P: torch.Tensor, Q: torch.Tensor, tokens: torch.Tensor,
                             valid: torch.Tensor, u_accept: torch.Tensor, u_residual: torch.Tensor,
                             params: RuleParams | None = None) -> tuple[TreeVerifyOutput, TreeVerifyDetails]:
    """:func:`verify_tree` plus the per-child pass probabilities and the next-token law it used."""
    return _verify_tree_impl(rule, index, P, Q, tokens, valid, u_accept, u_residual, params or RuleParams())


def verify_tree(rule: str, index: TreeIndex, P: torch.Tensor, Q: torch.Tensor, tokens: torch.Tensor,
                valid: torch.Tensor, u_accept: torch.Tensor, u_residual: torch.Tensor,
                params: RuleParams | None = None) -> TreeVerifyOutput:
    """Decide one tree round for every row.

    Args:
        rule: one of :data:`TREE_RULES`.
        index: the tree (:func:`tree_index`), nodes ``0 .. N`` with 0 the root.
        P: target laws ``[B, N+1, V]`` at every node (processed; the law of the node's children, or
            the bonus after it).
        Q: drafter laws ``[B, I, V]`` at the internal nodes (``index.internal``), the vectors the
            children were sampled from (before removing earlier siblings).
        tokens: int64 ``[B, N+1]`` each node's token (the root's is not read).
        valid: bool ``[B, N+1]``: the node was drafted (False where the drafter's support ran out).
        u_accept: float64 ``[B, N+1]``: the uniform of each node's acceptance test.
        u_residual: float64 ``[B]`` for the correction / bonus draw.
        params: rule parameters (:class:`~specray.methods.discrete.rules.RuleParams`; COOL-SD's μ
            normalised over the tree's depth).
    """
    return verify_tree_with_details(rule, index, P, Q, tokens, valid, u_accept, u_residual, params)[0]


def tree_verifier(rule: str, index: TreeIndex, params: RuleParams) -> Callable[..., TreeVerifyOutput]:
    """:func:`verify_tree` for the rounds of one arm, ``(P, Q, tokens, valid, u_accept, u_residual) -> output``:
    the rule and its parameters validated once; on a CPU each round is one call of the tree kernel where it serves
    (:mod:`~specray.methods.discrete.cpu_tree_rounds`), with the same values as torch's operations, which decide
    every other round."""
    if rule not in TREE_RULES:
        raise ValueError(f"rule {rule!r} cannot verify a tree; allowed: {', '.join(TREE_RULES)} "
                         "(block verification is defined for chains)")
    validate_params(rule, params)
    extra = (cpu_tree_rounds.tree_round_arguments(rule, params, index) if index.node_ids.device.type == "cpu"
             else None)
    kernel_for = functools.cache(functools.partial(cpu_tree_rounds.tree_round_kernel, rule, extra, index))  # per width

    def verify_round(P, Q, tokens, valid, u_accept, u_residual) -> TreeVerifyOutput:
        decide_round = kernel_for(P.shape[-1], P.device)
        fast = None if decide_round is None else decide_round(P, Q, tokens, valid, u_accept, u_residual)
        if fast is not None:
            return TreeVerifyOutput(*fast)
        # The loop builds the shapes _validate checks.
        return _verify_tree_impl(rule, index, P, Q, tokens, valid, u_accept, u_residual, params, validate=False)[0]

    return verify_round
