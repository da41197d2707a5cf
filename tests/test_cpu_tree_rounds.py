"""The CPU kernels of the static-tree rounds (specray/methods/discrete/cpu_tree_rounds.py, and the K/V move of
eagle_loop.TargetStream): a tree round's decision (sd, cool_sd, uniform_rsd, LANTERN++ with G*), a tree level's
children draws and the accepted path's cache moves with the torch operations' values where they serve a call,
torch's operations everywhere else, kernels that normalise, weigh or draw otherwise refused by the checks, and the
tree arms' samples the same with and without them and the round's bookkeeping kernels (test_round_bookkeeping.py)."""

from __future__ import annotations

import pytest
import torch

from specray.methods.discrete import cpu_rounds, cpu_tree_rounds, eagle_loop, lantern, rules, tree_rules
from specray.methods.discrete.loop import generate_tokens
from specray.methods.discrete.trees import NAMED_TREES, StaticTree
from specray.models import cpu_kernels
from specray.models.discrete_ar import load_pair
from specray.models.presets import get_preset

pytestmark = pytest.mark.usefixtures("single_thread")  # the actors' setting (conftest)

CPU = torch.device("cpu")
# Trees on another grid than the checks': the named ones and a lopsided custom one.
TREES = {**NAMED_TREES, "custom": StaticTree.from_paths([[0], [1], [2], [0, 0], [0, 1], [2, 0], [0, 0, 0]])}
NEIGHBOURS = {width: lantern.neighbours_from_embeddings(torch.randn(width, 6, generator=torch.Generator().manual_seed(5)),
                                                        min(6, width - 1)) for width in (4, 17, 40, 255)}
CASES = {"sd": ("sd", {}), "cool_sd": ("cool_sd", {"delta": 1.7, "nu": 0.9, "mu": -0.2}),
         "uniform_rsd": ("uniform_rsd", {"delta": 0.8}),
         "lantern_lambda": ("lantern", {"k": 2, "lam": 3.0}), "lantern_k5": ("lantern", {"k": 5, "lam": 1.5}),
         "lantern_delta": ("lantern", {"k": 4, "mode": "delta", "delta": 0.2, "forbid_zero_target_mass": True})}


@pytest.fixture(scope="module")
def extension(single_thread):
    names = ("draw_children", *set(cpu_tree_rounds.TREE_ROUND_KERNELS.values()))
    if any(cpu_tree_rounds.kernel(name, 17) is None for name in names):
        pytest.skip("the tree kernels did not build or did not match torch's operations here (see the log)")
    return cpu_kernels.extension()


def _params(case: str, width: int) -> rules.RuleParams:
    rule, fields = CASES[case]
    if "k" in fields:  # at most the table's neighbours
        fields = {**fields, "k": min(fields["k"], NEIGHBOURS[width].shape[1])}
    return rules.RuleParams(**fields, neighbours=NEIGHBOURS[width] if rule == "lantern" else None)


def _decide(extension, rule, params, index, round_):
    name = cpu_tree_rounds.TREE_ROUND_KERNELS[rule]
    extra = cpu_tree_rounds.tree_round_arguments(rule, params, index)
    return getattr(extension, name)(*round_, *cpu_tree_rounds.tree_tables(index), *extra)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("width", [4, 17, 40, 255])
def test_tree_rounds_give_torchs_decisions(extension, case, width):
    # every tree of TREES x 1, 3 and 100 rows, seed 7 (not the checks' seed 0); each round also at the boundaries
    # (acceptance uniforms equal to torch's pass probabilities and one below, the next token's on its law's sums).
    generator = torch.Generator().manual_seed(7)
    rule = CASES[case][0]
    params = _params(case, width)
    for tree in TREES.values():
        index = tree_rules.tree_index(tree, CPU)
        children, exists = index.child_nodes[index.child_exists], index.child_exists
        for rows in (1, 3, 100):
            P, Q, tokens, valid, u_accept, u_residual = cpu_tree_rounds._tree_round_case(index, generator, rows, width)
            details = tree_rules.verify_tree_with_details(rule, index, P, Q, tokens, valid, u_accept, u_residual,
                                                          params)[1]
            at_pass = torch.zeros_like(u_accept)
            at_pass[:, children] = details.pass_probs[:, exists]
            for u in (u_accept, at_pass, torch.nextafter(at_pass, torch.zeros_like(at_pass))):
                law = tree_rules.verify_tree_with_details(rule, index, P, Q, tokens, valid, u, u_residual,
                                                          params)[1].next_token_probs
                u_res = cpu_rounds._boundary_uniforms(law, generator)
                want = tree_rules.verify_tree(rule, index, P, Q, tokens, valid, u, u_res, params)
                got = _decide(extension, rule, params, index, (P, Q, tokens, valid, u, u_res))
                assert torch.equal(got[0], want.n_accepted), (tree.name, rows)
                assert torch.equal(got[1], want.path), (tree.name, rows)
                assert torch.equal(got[2], want.next_token), (tree.name, rows)


@pytest.mark.parametrize("width", [1, 2, 17, 255])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_children_draws_give_torchs_tokens(extension, width, dtype):
    # every level of TREES, 1 and 50 rows, laws contiguous and strided, half the rows with mass on one token (their
    # later children are not drawn), a quarter of the parents not drafted; seed 7.
    generator = torch.Generator().manual_seed(7)
    for tree in TREES.values():
        columns = tree.num_nodes + 2
        for level, _, kids in eagle_loop.tree_levels(tree, CPU):
            nodes = level.ids
            for rows in (1, 50):
                laws = cpu_rounds._test_laws(generator, (rows, 2 * nodes.shape[0], width), dtype)
                laws[::2, :, 1:] = 0.0
                u = torch.rand(rows, columns, generator=generator, dtype=torch.float64)
                valid = torch.rand(rows, columns, generator=generator) > 0.25
                for q in (laws[:, : nodes.shape[0]].contiguous(), laws[:, 1::2]):
                    want_tokens, want_valid = torch.zeros(rows, columns, dtype=torch.int64), valid.clone()
                    eagle_loop.draw_children_torch(q, u, want_tokens, want_valid, nodes, kids)
                    got_tokens, got_valid = torch.zeros(rows, columns, dtype=torch.int64), valid.clone()
                    assert extension.draw_children(q, u, got_tokens, got_valid, nodes, kids)
                    # the spare last column takes absent children's writes and is read by nothing
                    assert torch.equal(got_tokens[:, :-1], want_tokens[:, :-1]), (tree.name, rows)
                    assert torch.equal(got_valid[:, :-1], want_valid[:, :-1]), (tree.name, rows)


NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("why", ["narrow", "wide", "float64", "strided", "token_out_of_range", "nan_p", "zero_q_row",
                                 "negative_uniform", "infinite_multiplier", "official_residual"])
def test_tree_rounds_the_kernels_do_not_serve_go_to_torch(extension, why):
    width = {"narrow": 3, "wide": 256}.get(why, 17)
    index = tree_rules.tree_index(NAMED_TREES["small"], CPU)
    generator = torch.Generator().manual_seed(1)
    P, Q, tokens, valid, u_accept, u_residual = cpu_tree_rounds._tree_round_case(index, generator, 4, width)
    rule, params = "sd", rules.RuleParams()
    if why == "float64":
        P = P.double()
    elif why == "strided":
        P = torch.cat([P, P], dim=2)[:, :, :width]
    elif why == "token_out_of_range":
        tokens[1, 2] = width
    elif why == "nan_p":
        P[2, 0, 3] = NAN
    elif why == "zero_q_row":
        Q[0, 1] = 0.0
    elif why == "negative_uniform":  # torch passes an undrafted child (pass probability 0) at u < 0; the walk skips it
        valid[:, 1] = False
        u_accept[:, :2] = -0.5
    elif why == "infinite_multiplier":  # the config refuses such a mu; a direct call must not serve it
        rule, params = "cool_sd", rules.RuleParams(delta=2.0, mu=-800.0)
    elif why == "official_residual":
        rule, params = "lantern", rules.RuleParams(k=2, lam=2.0, residual="official", neighbours=NEIGHBOURS[17])
    extra = cpu_tree_rounds.tree_round_arguments(rule, params, index)
    round_ = (P, Q, tokens, valid, u_accept, u_residual)
    assert cpu_tree_rounds.decide_tree(rule, extra, index, *round_) is None
    if extra is not None:
        assert _decide(extension, rule, params, index, round_)[0] is None
    if why == "token_out_of_range":  # torch's indexing error, as without the kernels
        with pytest.raises(IndexError):
            tree_rules.tree_verifier(rule, index, params)(*round_)
        return
    # the verifier the loop uses falls back to torch's operations, with the same decisions
    out = tree_rules.tree_verifier(rule, index, params)(*round_)
    want = tree_rules.verify_tree(rule, index, *round_, params)
    for got, expected in zip((out.n_accepted, out.path, out.next_token), (want.n_accepted, want.path, want.next_token)):
        assert torch.equal(got, expected)


@pytest.mark.parametrize("why", ["nan", "inf", "negative", "float32_uniforms", "narrow_uniforms"])
def test_children_draws_the_kernel_does_not_serve_write_nothing(extension, why):
    tree = NAMED_TREES["small"]
    level, _, kids = eagle_loop.tree_levels(tree, CPU)[0]
    nodes = level.ids
    generator = torch.Generator().manual_seed(4)
    q = cpu_rounds._test_laws(generator, (3, 1, 17))
    u = torch.rand(3, tree.num_nodes + 2, generator=generator, dtype=torch.float64)
    if why in ("nan", "inf", "negative"):
        q[1, 0, 3] = {"nan": NAN, "inf": INF, "negative": -1.0}[why]
    elif why == "float32_uniforms":
        u = u.float()
    else:
        u = u[:, :-1]  # no spare column: the spare children's uniform is out of range
    tokens = torch.randint(17, (3, tree.num_nodes + 2), generator=generator)
    valid = torch.rand(3, tree.num_nodes + 2, generator=generator) > 0.5
    before = tokens.clone(), valid.clone()
    assert not extension.draw_children(q, u, tokens, valid, nodes, kids)
    assert not cpu_tree_rounds.draw_children(q, u, tokens, valid, nodes, kids)
    assert torch.equal(tokens, before[0]) and torch.equal(valid, before[1])  # nothing written


def test_the_checks_refuse_kernels_that_normalise_weigh_or_draw_otherwise(extension):
    """Negative controls for the guards: (1) the tree decision with every law normalised by a running sum (not
    torch's cascade order); (2) cool_sd and uniform_rsd decided as sd (their multipliers dropped); (3) LANTERN's
    with every neighbour's mass taken (no budget); (4) children drawn with replacement (each from the parent's whole
    law). Each is refused; torch's own operations and the kernels are accepted."""
    real_tree, real_lantern = extension.tree_round, extension.lantern_tree_round

    def with_running_sums(P, Q, tokens, valid, u_accept, u_residual, child_nodes, *rest):
        index = next(i for i in cpu_tree_rounds._check_trees() if i.child_nodes is child_nodes)
        original = tree_rules.normalise
        tree_rules.normalise = lambda d: d.to(torch.float64) / d.to(torch.float64).cumsum(-1)[..., -1:]
        try:
            out = tree_rules.verify_tree("sd", index, P, Q, tokens, valid, u_accept, u_residual)
        finally:
            tree_rules.normalise = original
        return out.n_accepted, out.path, out.next_token

    def torch_sd(P, Q, tokens, valid, u_accept, u_residual, child_nodes, *rest):
        index = next(i for i in cpu_tree_rounds._check_trees() if i.child_nodes is child_nodes)
        out = tree_rules.verify_tree("sd", index, P, Q, tokens, valid, u_accept, u_residual)
        return out.n_accepted, out.path, out.next_token

    def sd_only(*args):
        if args[11] is not None:  # cool_sd's and uniform_rsd's cases
            return real_tree(*args[:11], None)
        return real_tree(*args)

    def lantern_no_budget(*args):
        neighbours, k, lambda_mode, lam, delta, forbid = args[11:]
        return real_lantern(*args[:11], neighbours, k, False, lam, 1e9, forbid)

    def with_replacement(q, u, node_tokens, node_valid, nodes, kids):
        for slot in kids:  # every child from the whole law: draw_children_torch one slot at a time
            eagle_loop.draw_children_torch(q, u, node_tokens, node_valid, nodes, slot[None])
        return True

    def torch_tree_round(*args):
        sd_rounds = args[11] is None
        return torch_sd(*args) if sd_rounds else real_tree(*args)

    assert not cpu_tree_rounds._tree_rounds_match("tree_round", with_running_sums, 17)
    assert not cpu_tree_rounds._tree_rounds_match("tree_round", sd_only, 17)
    assert not cpu_tree_rounds._tree_rounds_match("lantern_tree_round", lantern_no_budget, 17)
    assert not cpu_tree_rounds._children_draws_match(with_replacement, 17)
    assert cpu_tree_rounds._tree_rounds_match("tree_round", torch_tree_round, 17)
    assert cpu_tree_rounds._children_draws_match(
        lambda *args: eagle_loop.draw_children_torch(*args) or True, 17)
    for name in set(cpu_tree_rounds.TREE_ROUND_KERNELS.values()):
        assert cpu_tree_rounds._tree_rounds_match(name, getattr(extension, name), 17), name
    assert cpu_tree_rounds._children_draws_match(extension.draw_children, 17)


def test_moving_slots_gives_torchs_cache_and_refuses_what_it_does_not_serve(extension):
    """A tree round's accepted path moved in a head-major cache: every layer's slots as torch's indexed copy moves
    them, with destinations that are other moves' sources (each source read before any write); seed 6."""
    generator = torch.Generator().manual_seed(6)
    storage = torch.randn(3, 5, 2, 12, 4, generator=generator)  # [layers, rows, heads, slots, head_dim]
    rows = torch.tensor([4, 1, 2])
    source = torch.tensor([[5, 6, 9], [2, 3, 4], [7, 8, 8]])
    dest = torch.tensor([[4, 5, 6], [2, 3, 4], [5, 6, 7]])
    want = storage.clone()
    view = want.transpose(-3, -2)  # the cache's index order, as the loop's K/V tensors are
    view[:, rows[:, None], dest] = view[:, rows[:, None], source]
    got = storage.clone()
    assert extension.move_slots(got, rows, source, dest)
    assert torch.equal(got, want)
    for bad in (got.double(), got.transpose(-3, -2)):  # float64; not head-major contiguous
        assert not extension.move_slots(bad, rows, source, dest)
    before, past = got.clone(), dest.clone()
    past[1, 2] = 12
    assert not extension.move_slots(got, rows, source, past)  # a slot past the cache
    assert not extension.move_slots(got, torch.tensor([4, 1, 5]), source, dest)  # a row past the cache
    assert torch.equal(got, before)  # nothing moved


@pytest.mark.skipif(not get_preset("digits-gpt-eagle").weights_path.exists(), reason="EAGLE head not trained")
@pytest.mark.parametrize("method,params", [
    ("sd", {"tree": "small"}), ("sd", {"tree": "eagle25"}), ("lantern", {"tree": "small"}),
    ("cool_sd", {"tree": "small", "delta": 2.0}), ("uniform_rsd", {"tree": "small", "delta": 1.5}),
])
def test_the_tree_arms_give_the_same_samples_with_and_without_the_kernels(extension, monkeypatch, method, params):
    """The trained head's tree arms with the tree kernels (decisions, draws, and the round's masks, uniforms and
    commit) against torch's operations: 12 samples at batch 12 (rows finish in different rounds, so the tail rounds
    run on fewer rows), CFG 1.5, seed 3; the kernels must serve every round. The other kernels stay on in both runs
    (they are compared on their own); without the round kernels the path's K/V moves by torch's copy."""
    pair = load_pair("digits-gpt-target", "digits-gpt-eagle", "cpu")
    ids = torch.arange(12) + 40
    names = (cpu_tree_rounds.TREE_ROUND_KERNELS[method], "draw_children", "tree_masks", "tree_uniforms", "tree_commit",
             "move_slots")
    served = {name: [] for name in names}

    def watched(name, real):
        return lambda *args: served[name].append(real(*args)) or served[name][-1]

    for name in names:
        monkeypatch.setattr(extension, name, watched(name, getattr(extension, name)))
    with_kernels = generate_tokens(method, {"cfg_scale": 1.5, **params}, pair, ids % 10, ids, 3)
    rounds = len(served["tree_commit"])
    assert rounds > 0 and not served["move_slots"]  # the commit moves the path's K/V itself
    for name in names[:5]:
        assert served[name] and all(out is not None and out is not False and
                                    (not isinstance(out, tuple) or out[0] is not None) for out in served[name]), name
    assert len(served["tree_masks"]) == len(served["tree_uniforms"]) == rounds
    monkeypatch.setattr(cpu_rounds, "ENABLED", False)
    monkeypatch.setattr(extension, "move_slots", lambda *args: served["move_slots"].append(False))  # torch's copy
    for calls in served.values():
        calls.clear()
    without = generate_tokens(method, {"cfg_scale": 1.5, **params}, pair, ids % 10, ids, 3)
    assert not any(served[name] for name in names[:5]) and served["move_slots"] and not any(served["move_slots"])
    assert torch.equal(with_kernels[0], without[0])
    assert [vars(s) for s in with_kernels[1]] == [vars(s) for s in without[1]]
