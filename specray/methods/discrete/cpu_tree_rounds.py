"""A static tree's round decision and a tree level's children draws on a CPU: one call of specray's kernels
(``csrc/tree_rounds.cpp``) with the values of torch's operations, or those operations.

At batch 1 a tree round's work outside the model calls was mostly dispatch: :func:`~specray.methods.discrete.tree_rules.verify_tree`
scores every child of every internal node as if reached (about 60 torch operations, 0.43 ms a round on the
``small`` tree), and each level's draws without replacement (:func:`~specray.methods.discrete.eagle_loop.draw_children_torch`)
take about 8 operations per child slot. The kernels walk each row's one path and draw each child in place.

As in :mod:`~specray.methods.discrete.cpu_rounds`, each kernel serves a width only after it has matched torch's
operations value for value there (:func:`_tree_rounds_match`, :func:`_children_draws_match`), in this process at
this thread count; it leaves laws that are not finite and non-negative with mass to torch, and the choice never
changes a value. ``cpu_rounds.ENABLED`` switches these kernels too (the accepted path's K/V move,
``TargetStream.move``, is a copy and not checked; ``SPECRAY_DECODE_KERNEL=0`` turns every kernel off).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from specray import rng
from specray.methods.discrete import cpu_rounds

# Each rule's tree kernel (LANTERN with its G* residual only, as on chains).
TREE_ROUND_KERNELS = {"sd": "tree_round", "cool_sd": "tree_round", "uniform_rsd": "tree_round",
                      "lantern": "lantern_tree_round"}
# The cases each tree kernel is checked on: (rule, its RuleParams' fields), LANTERN's with a neighbour table.
_TREE_CASES = {
    "tree_round": (("sd", {}), ("cool_sd", {"delta": 0.5, "mu": -0.3}), ("cool_sd", {"delta": 2.0}),
                   ("uniform_rsd", {"delta": 1.1})),
    "lantern_tree_round": (("lantern", {"k": 0, "lam": 2.0}), ("lantern", {"k": 3, "lam": 2.0}),
                           ("lantern", {"k": 3, "lam": 2.0, "forbid_zero_target_mass": True}),
                           ("lantern", {"k": 3, "mode": "delta", "delta": 0.3})),
}


def _check_trees():
    """The trees the checks run on: the named ones and a chain, as :class:`~specray.methods.discrete.tree_rules.TreeIndex`."""
    from specray.methods.discrete import tree_rules, trees  # tree_rules imports this module

    shapes = (*trees.NAMED_TREES.values(), trees.StaticTree.chain(3))
    return [tree_rules.tree_index(tree, torch.device("cpu")) for tree in shapes]


def _tree_round_case(index, generator: torch.Generator, rows: int, width: int):
    """A round's tensors on ``index``'s tree: children drawn from their parents' Q (siblings may repeat), about one
    node in eight not drafted, every third row's Q equal to its P (empty residuals)."""
    nodes, internal = index.tree.num_nodes + 1, index.internal.shape[0]
    P = cpu_rounds._test_laws(generator, (rows, nodes, width))
    Q = cpu_rounds._test_laws(generator, (rows, internal, width))
    Q[::3] = P[::3][:, index.internal]
    tokens = torch.zeros(rows, nodes, dtype=torch.int64)
    parents = index.internal_of[index.parents[1:]]  # each drafted node's parent, by internal index
    tokens[:, 1:] = rng.sample_categorical(Q[:, parents], torch.rand(rows, nodes - 1, generator=generator,
                                                                     dtype=torch.float64))
    valid = torch.rand(rows, nodes, generator=generator) > 0.125
    valid[:, 0] = True
    u_accept = torch.rand(rows, nodes, generator=generator, dtype=torch.float64) ** 3
    u_residual = torch.rand(rows, generator=generator, dtype=torch.float64)
    return P, Q, tokens, valid, u_accept, u_residual


def _tree_rounds_match(name: str, decide: Callable, width: int) -> bool:
    """Whether the tree kernel ``decide`` (``name`` in :data:`TREE_ROUND_KERNELS`) gives
    :func:`~specray.methods.discrete.tree_rules.verify_tree`'s decisions for laws of ``width`` entries: each case of
    its rules on the trees ``small``, ``eagle25``, ``eagle57`` and a 3-node chain, 1, 2 and 33 rows
    (:func:`_tree_round_case`); acceptance uniforms at random, equal to torch's pass probabilities (every child
    fails) and one below them (rows pass as far as they can); the next token's uniform on its law's running sums,
    so that a pass probability or a law that differs in a bit changes tokens; seed 0, at the calling thread count."""
    from specray.methods.discrete import lantern, rules, tree_rules  # tree_rules imports this module

    generator = torch.Generator().manual_seed(0)
    table = lantern.neighbours_from_embeddings(torch.randn(width, 8, generator=generator), min(4, width - 1))
    for rule, fields in _TREE_CASES[name]:
        params = rules.RuleParams(**fields, neighbours=table if rule == "lantern" else None)
        for index in _check_trees():
            extra = tree_round_arguments(rule, params, index)
            children, exists = index.child_nodes[index.child_exists], index.child_exists
            for rows in (1, 2, 33):
                P, Q, tokens, valid, u_accept, u_residual = _tree_round_case(index, generator, rows, width)
                pass_probs = tree_rules.verify_tree_with_details(rule, index, P, Q, tokens, valid, u_accept,
                                                                 u_residual, params)[1].pass_probs
                at_pass = torch.zeros_like(u_accept)
                at_pass[:, children] = pass_probs[:, exists]
                for u_acc in (u_accept, at_pass, torch.nextafter(at_pass, torch.zeros_like(at_pass))):
                    law = tree_rules.verify_tree_with_details(rule, index, P, Q, tokens, valid, u_acc, u_residual,
                                                              params)[1].next_token_probs
                    u_res = cpu_rounds._boundary_uniforms(law, generator)
                    want = tree_rules.verify_tree_with_details(rule, index, P, Q, tokens, valid, u_acc, u_res,
                                                               params)[0]
                    got = decide(P, Q, tokens, valid, u_acc, u_res, *tree_tables(index), *extra)
                    if got[0] is None or any(not torch.equal(g, w) for g, w in
                                             zip(got, (want.n_accepted, want.path, want.next_token))):
                        return False
    return True


def _children_draws_match(draw: Callable, width: int) -> bool:
    """Whether ``draw`` gives :func:`~specray.methods.discrete.eagle_loop.draw_children_torch`'s tokens and flags
    for laws of ``width`` entries: every level of the trees of :func:`_check_trees`, 1, 2 and 33 rows, float32 laws
    contiguous and strided (a level's laws as the catch-up call gives them), a third of the rows with mass on two
    tokens only (their later children are not drawn), about one parent in six not drafted; the spare column (absent
    children's writes, which nothing reads) is not compared; seed 0, at the calling thread count."""
    from specray.methods.discrete import eagle_loop  # eagle_loop imports this module

    generator = torch.Generator().manual_seed(0)
    for index in _check_trees():
        plan_levels = eagle_loop.tree_levels(index.tree, torch.device("cpu"))
        columns = index.tree.num_nodes + 2
        for level, _, kids in plan_levels:
            nodes = level.ids
            for rows in (1, 2, 33):
                laws = cpu_rounds._test_laws(generator, (rows, 2 * nodes.shape[0], width))
                laws[::3, :, 2:] = 0.0
                u = torch.rand(rows, columns, generator=generator, dtype=torch.float64)
                valid = torch.rand(rows, columns, generator=generator) > 1 / 6
                tokens = torch.randint(width, (rows, columns), generator=generator)
                for q in (laws[:, : nodes.shape[0]].contiguous(), laws[:, 1::2]):
                    want_tokens, want_valid = tokens.clone(), valid.clone()
                    eagle_loop.draw_children_torch(q, u, want_tokens, want_valid, nodes, kids)
                    got_tokens, got_valid = tokens.clone(), valid.clone()
                    if not draw(q, u, got_tokens, got_valid, nodes, kids):
                        return False
                    if not (torch.equal(got_tokens[:, :-1], want_tokens[:, :-1]) and
                            torch.equal(got_valid[:, :-1], want_valid[:, :-1])):
                        return False
    return True


_CHECKS = {"draw_children": _children_draws_match,
           **{name: functools.partial(_tree_rounds_match, name) for name in _TREE_CASES}}


def kernel(name: str, width: int) -> Callable | None:
    """The kernel ``name`` (``draw_children`` or one of :data:`TREE_ROUND_KERNELS`) if it gives torch's values at
    ``width`` at this thread count, else None (:func:`~specray.methods.discrete.cpu_rounds.kernel`)."""
    return cpu_rounds.kernel(name, width, _CHECKS)


def tree_tables(index) -> tuple[torch.Tensor, ...]:
    """The tree's tables the tree kernels read (a :class:`~specray.methods.discrete.tree_rules.TreeIndex`'s)."""
    return index.child_nodes, index.child_exists, index.internal_of, index.depths, index.path_to


def tree_round_arguments(rule: str, params, index) -> tuple | None:
    """What the tree kernel of ``rule`` takes after the round's tensors and the tree's tables, under the rule's
    :class:`~specray.methods.discrete.rules.RuleParams`; None where it does not serve them. Built once per arm."""
    from specray.methods.discrete import tree_rules  # tree_rules imports this module

    if rule in ("cool_sd", "uniform_rsd"):  # each internal node's children's multiplier
        return (tree_rules.node_omegas(rule, index, params, torch.device("cpu")).squeeze(-1).contiguous(),)
    return cpu_rounds.round_arguments(rule, params, index.tree.depth) if rule in ("sd", "lantern") else None


def decide_tree(rule: str, extra: tuple | None, index, P: torch.Tensor, Q: torch.Tensor, tokens: torch.Tensor,
                valid: torch.Tensor, u_accept: torch.Tensor,
                u_residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``(n_accepted, path, next_token)`` of :func:`~specray.methods.discrete.tree_rules.verify_tree` by the rule's
    tree kernel (``extra`` from :func:`tree_round_arguments`), or None where it does not serve the round."""
    decide_round = tree_round_kernel(rule, extra, index, P.shape[-1], P.device)
    return None if decide_round is None else decide_round(P, Q, tokens, valid, u_accept, u_residual)


def tree_round_kernel(rule: str, extra: tuple | None, index, width: int, device: torch.device) -> Callable | None:
    """:func:`decide_tree` for rounds over laws of ``width`` entries on ``device`` (a CPU), the kernel and the tree's
    tables looked up once (a run keeps its thread count): ``(P, Q, tokens, valid, u_accept, u_residual) ->``
    decide_tree's value; None where no kernel serves such rounds."""
    name = TREE_ROUND_KERNELS.get(rule)
    fast = kernel(name, width) if name is not None and extra is not None and device.type == "cpu" else None
    if fast is None:
        return None
    arguments = (*tree_tables(index), *extra)

    def decide_round(P: torch.Tensor, Q: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor,
                     u_accept: torch.Tensor, u_residual: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        out = fast(P, Q, tokens, valid, u_accept, u_residual, *arguments)
        return None if out is None or out[0] is None else out

    return decide_round


def draw_children(q: torch.Tensor, u: torch.Tensor, node_tokens: torch.Tensor, node_valid: torch.Tensor,
                  nodes: torch.Tensor, kids: torch.Tensor) -> bool:
    """One level's children into ``node_tokens`` / ``node_valid`` by the kernel, as
    :func:`~specray.methods.discrete.eagle_loop.draw_children_torch` draws them; False (nothing written) where it
    does not serve the call."""
    fast = cpu_rounds._fast("draw_children", q, _CHECKS)
    return fast is not None and fast(q, u, node_tokens, node_valid, nodes, kids)
