"""RoundTally: rounds in which every row takes part are kept aside and folded in by flush; the counters
and the acceptance timeline must be those of the same rounds observed row by row."""

from __future__ import annotations

import dataclasses

import torch

from specray.methods.common import RoundTally


def _stats(tally: RoundTally, num_tokens: int) -> list[dict]:
    return [dataclasses.asdict(s) for s in tally.to_stats(num_tokens)]


# A tree of depth 3 as observe_tree takes it: nodes 0 (the root) .. 5 at depths 0, 1, 1, 2, 2, 3, one-hot by depth.
TREE_DEPTHS = torch.tensor([0, 1, 1, 2, 2, 3])[:, None] == torch.arange(1, 4)[None, :]


def test_full_rounds_folded_by_flush_equal_rounds_observed_row_by_row():
    # 60 rounds on 6 rows (seed 3): full and partial rounds mixed, masks of two widths, tree-like drafted
    # counts on some, prefix rounds and tree rounds on others, and a flush half way (a tally flushed twice folds each
    # round once).
    gen = torch.Generator().manual_seed(3)
    batch, gamma, num_tokens = 6, 4, 40
    kept, by_row = RoundTally(batch, gamma, num_tokens), RoundTally(batch, gamma, num_tokens)
    every_row = torch.arange(batch)
    full_rounds = 0
    for step in range(60):
        full = torch.rand((), generator=gen) < 0.6
        rows = every_row if full else torch.nonzero(torch.rand(batch, generator=gen) < 0.5).squeeze(1)
        r = rows.shape[0]
        width = gamma if step % 3 else gamma - 1
        positions = torch.randint(0, num_tokens - width, (r, 1), generator=gen) + torch.arange(width)
        if step % 5 == 4:  # a tree round: TREE_DEPTHS' nodes, the root always there
            drafted_nodes = torch.rand(r, TREE_DEPTHS.shape[0], generator=gen) < 0.8
            drafted_nodes[:, 0] = True
            n = torch.randint(0, num_tokens - 3, (r,), generator=gen)
            n_accepted = torch.randint(0, 4, (r,), generator=gen)
            kept.observe_tree(None if full else rows, n, drafted_nodes, n_accepted, TREE_DEPTHS)
            by_row.observe_tree(rows, n.clone(), drafted_nodes, n_accepted, TREE_DEPTHS)
        elif step % 2:
            drafted = torch.rand(r, width, generator=gen) < 0.8
            accepted = drafted & (torch.rand(r, width, generator=gen) < 0.5)
            count = drafted.sum(1) + torch.randint(0, 3, (r,), generator=gen) if step % 4 == 1 else None
            kept.observe(None if full else rows, positions, drafted, accepted, drafted_count=count)
            by_row.observe(rows, positions.clone(), drafted, accepted, drafted_count=count)
        else:
            n_drafted = torch.randint(0, width + 1, (r,), generator=gen)
            n_accepted = torch.minimum(n_drafted, torch.randint(0, width + 1, (r,), generator=gen))
            kept.observe_prefix(None if full else rows, positions, n_drafted, n_accepted)
            by_row.observe_prefix(rows, positions.clone(), n_drafted, n_accepted)
        full_rounds += bool(full)
        if step == 30:
            kept.flush()
    assert 10 < full_rounds < 50
    stats = _stats(kept, num_tokens)
    assert stats == _stats(by_row, num_tokens)
    assert all(s["num_spec_steps"] > 0 and s["num_accepted_draft_tokens"] > 0 for s in stats)


def test_a_tree_round_counts_its_depths_and_nodes():
    # Two rows of the depth-3 tree at committed lengths 5 and 9. Row 0 drafted nodes 1, 2, 3 (depths 1, 1, 2: slots 0
    # and 1) and accepted 1 depth; row 1 drafted every node and accepted all 3 depths.
    drafted_nodes = torch.tensor([[True, True, True, True, False, False], [True] * 6])
    for rows in (None, torch.arange(2)):
        tally = RoundTally(2, 3, 20)
        tally.observe_tree(rows, torch.tensor([5, 9]), drafted_nodes, torch.tensor([1, 3]), TREE_DEPTHS)
        first, second = _stats(tally, 20)
        assert (first["num_draft_tokens"], first["num_accepted_draft_tokens"]) == (3, 1)
        assert (second["num_draft_tokens"], second["num_accepted_draft_tokens"]) == (5, 3)
        assert first["accepted_per_position"] == [1, 0, 0] and second["accepted_per_position"] == [1, 1, 1]
        timeline = first["extra"]["acceptance_timeline"]
        assert timeline["drafted"][4:8] == [0, 1, 1, 0] and timeline["accepted"][4:8] == [0, 1, 0, 0]
        timeline = second["extra"]["acceptance_timeline"]
        assert timeline["drafted"][8:13] == [0, 1, 1, 1, 0] and timeline["accepted"][8:13] == [0, 1, 1, 1, 0]
