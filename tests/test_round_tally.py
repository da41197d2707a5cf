"""RoundTally: rounds in which every row takes part are kept aside and folded in by flush; the counters
and the acceptance timeline must be those of the same rounds observed row by row."""

from __future__ import annotations

import dataclasses

import torch

from specray.methods.common import RoundTally


def _stats(tally: RoundTally, num_tokens: int) -> list[dict]:
    return [dataclasses.asdict(s) for s in tally.to_stats(num_tokens)]


def test_full_rounds_folded_by_flush_equal_rounds_observed_row_by_row():
    # 60 rounds on 6 rows (seed 3): full and partial rounds mixed, masks of two widths, tree-like drafted
    # counts on some, prefix rounds on others, and a flush half way (a tally flushed twice folds each round once).
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
        if step % 2:
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
