"""RoundTally: every round is kept aside and folded in by flush, its rows concatenated with other rounds'; the
counters and the acceptance timeline must be those of the same rounds added up row by row in plain Python."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from specray.methods.common import RoundTally
from specray.models import cpu_kernels


def _stats(tally: RoundTally, num_tokens: int) -> list[dict]:
    return [dataclasses.asdict(s) for s in tally.to_stats(num_tokens)]


# A tree of depth 3 as observe_tree takes it: nodes 0 (the root) .. 5 at depths 0, 1, 1, 2, 2, 3, one-hot by depth.
NODE_DEPTHS = [0, 1, 1, 2, 2, 3]
TREE_DEPTHS = torch.tensor(NODE_DEPTHS)[:, None] == torch.arange(1, 4)[None, :]


def _added_row_by_row(batch: int, gamma: int, num_tokens: int, rounds: list[tuple]) -> list[dict]:
    """The statistics of ``rounds`` (rows, positions, drafted and accepted masks as lists, drafted counts) summed in
    Python, one row of one round at a time."""
    rows_stats = [{"rounds": 0, "drafted": 0, "accepted": 0, "per_position": [0] * gamma,
                   "timeline_drafted": [0] * num_tokens, "timeline_accepted": [0] * num_tokens} for _ in range(batch)]
    for rows, positions, drafted, accepted, counts in rounds:
        for i, b in enumerate(rows):
            row = rows_stats[b]
            row["rounds"] += 1
            row["drafted"] += counts[i]
            row["accepted"] += sum(accepted[i])
            for slot, position in enumerate(positions[i]):
                if slot < gamma:
                    row["per_position"][slot] += accepted[i][slot]
                if position < num_tokens:
                    row["timeline_drafted"][position] += drafted[i][slot]
                    row["timeline_accepted"][position] += accepted[i][slot]
    return rows_stats


@pytest.mark.parametrize("fold", ["kernel", "torch"])
def test_rounds_folded_by_flush_equal_rounds_added_row_by_row(fold, monkeypatch):
    # 60 rounds on 6 rows (seed 3): full and partial rounds mixed (a partial round's rows in a random order), masks of
    # two widths, tree-like drafted counts on some, prefix rounds and tree rounds on others, and a flush half way (a
    # tally flushed twice folds each round once). The prefix rounds folded by the extension's one call, and by torch's
    # operations.
    if fold == "kernel" and cpu_kernels.extension() is None:
        pytest.skip("specray's C++ extension is not built here")
    if fold == "torch":
        monkeypatch.setattr(cpu_kernels, "loaded", lambda: None)
    in_one_call = []  # what each flush's call answered
    one_call = RoundTally._prefix_rounds_in_one_call

    def noted(tally: RoundTally) -> bool:
        in_one_call.append(one_call(tally))
        return in_one_call[-1]

    monkeypatch.setattr(RoundTally, "_prefix_rounds_in_one_call", noted)
    gen = torch.Generator().manual_seed(3)
    batch, gamma, num_tokens = 6, 4, 40
    tally = RoundTally(batch, gamma, num_tokens)
    every_row = torch.arange(batch)
    rounds, full_rounds = [], 0
    for step in range(60):
        full = bool(torch.rand((), generator=gen) < 0.6)
        rows = every_row if full else torch.nonzero(torch.rand(batch, generator=gen) < 0.5).squeeze(1)
        rows = rows if full else rows[torch.randperm(rows.shape[0], generator=gen)]
        r = rows.shape[0]
        width = gamma if step % 3 else gamma - 1
        positions = torch.randint(0, num_tokens - width, (r, 1), generator=gen) + torch.arange(width)
        if step % 5 == 4:  # a tree round: TREE_DEPTHS' nodes, the root always there
            drafted_nodes = torch.rand(r, TREE_DEPTHS.shape[0], generator=gen) < 0.8
            drafted_nodes[:, 0] = True
            n = torch.randint(0, num_tokens - 3, (r,), generator=gen)
            n_accepted = torch.randint(0, 4, (r,), generator=gen)
            tally.observe_tree(None if full else rows, n, drafted_nodes, n_accepted, TREE_DEPTHS)
            nodes = drafted_nodes.tolist()
            drafted = [[any(d and NODE_DEPTHS[v] == t + 1 for v, d in enumerate(row)) for t in range(3)]
                       for row in nodes]
            accepted = [[t < a for t in range(3)] for a in n_accepted.tolist()]
            counts = [sum(d and NODE_DEPTHS[v] > 0 for v, d in enumerate(row)) for row in nodes]
            positions = n[:, None] + torch.arange(3)
        elif step % 2:
            drafted = torch.rand(r, width, generator=gen) < 0.8
            accepted = drafted & (torch.rand(r, width, generator=gen) < 0.5)
            count = drafted.sum(1) + torch.randint(0, 3, (r,), generator=gen) if step % 4 == 1 else None
            tally.observe(None if full else rows, positions, drafted, accepted, drafted_count=count)
            counts = (drafted.sum(1) if count is None else count).tolist()
            drafted, accepted = drafted.tolist(), accepted.tolist()
        else:
            n_drafted = torch.randint(0, width + 1, (r,), generator=gen)
            n_accepted = torch.minimum(n_drafted, torch.randint(0, width + 1, (r,), generator=gen))
            tally.observe_prefix(None if full else rows, positions, n_drafted, n_accepted)
            drafted = [[t < d for t in range(width)] for d in n_drafted.tolist()]
            accepted = [[t < a for t in range(width)] for a in n_accepted.tolist()]
            counts = n_drafted.tolist()
        rounds.append((rows.tolist(), positions.tolist(), drafted, accepted, counts))
        full_rounds += full
        if step == 30:
            tally.flush()
    assert 10 < full_rounds < 50
    stats = _stats(tally, num_tokens)
    expected = _added_row_by_row(batch, gamma, num_tokens, rounds)
    for row, want in zip(stats, expected):
        timeline = row["extra"]["acceptance_timeline"]
        assert (row["num_spec_steps"], row["num_draft_tokens"], row["num_accepted_draft_tokens"]) == (
            want["rounds"], want["drafted"], want["accepted"])
        assert row["accepted_per_position"] == want["per_position"]
        assert timeline["drafted"] == want["timeline_drafted"] and timeline["accepted"] == want["timeline_accepted"]
    assert all(s["num_spec_steps"] > 0 and s["num_accepted_draft_tokens"] > 0 for s in stats)
    assert in_one_call == ([True, True] if fold == "kernel" else [False, False])  # the flush half way and the last


def test_the_kernel_refuses_prefix_rounds_it_does_not_serve_and_writes_nothing():
    kernels = cpu_kernels.extension()
    if kernels is None:
        pytest.skip("specray's C++ extension is not built here")
    tally = RoundTally(2, 3, 10)
    counters = (tally.rounds, tally.drafted, tally.accepted, tally.per_position, tally.timeline_drafted,
                tally.timeline_accepted)
    rows, positions = torch.arange(2), torch.tensor([[2, 3, 4, 5], [0, 1, 2, 3]])
    n_drafted, n_accepted = torch.tensor([3, 4]), torch.tensor([1, 4])
    assert kernels.fold_prefix_rounds([rows], [positions], [n_drafted], [n_accepted], *counters)
    assert tally.rounds.tolist() == [1, 1] and tally.accepted.tolist() == [1, 4]
    assert tally.per_position.tolist() == [[1, 0, 0], [1, 1, 1]]  # the first gamma = 3 slots of 4
    before = [c.clone() for c in counters]
    refused = [([rows], [positions + 11], [n_drafted], [n_accepted]),  # past the timelines' 14 columns
               ([rows + 1], [positions], [n_drafted], [n_accepted]),  # a row past the batch
               ([rows], [positions.int()], [n_drafted], [n_accepted]),  # not int64
               ([rows], [positions], [n_drafted[:1]], [n_accepted])]  # counts of one row for two
    served = (rows, positions, n_drafted, n_accepted)
    for bad in refused:  # after a served round: nothing is written unless every round is served
        assert not kernels.fold_prefix_rounds(*([good, *worse] for good, worse in zip(served, bad)), *counters)
    assert all(torch.equal(c, b) for c, b in zip(counters, before))


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
