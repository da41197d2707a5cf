"""What the decoding loops of every family share: the per-sample statistics record, the batch
result, and the per-round tally of drafted and accepted tokens.

Field names follow the design's data section (vLLM's speculative-decoding metric names where one
exists). A "token" is whatever the family emits one of per target step: an image token, a
continuous token, a denoising step.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specray.models import cpu_kernels


@dataclass
class SampleStats:
    """What one sample cost and how much of its draft was accepted.

    ``mean_acceptance_length`` is tokens (or denoising steps) emitted per target
    call, the bonus/correction included; ``target_only`` has 1.0.
    ``accepted_per_position[i]`` counts rounds in which draft position ``i`` was
    accepted (length gamma; empty for non-speculative methods).
    ``extra`` holds family-specific numbers (resampling tries, cap hits, states
    evaluated...); it is stored as a JSON column.
    """

    num_tokens: int
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_acceptance_rate(self) -> float:
        if self.num_draft_tokens == 0:
            return float("nan")
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        if self.target_calls == 0:
            return float("nan")
        return self.num_tokens / self.target_calls

    def as_row(self) -> dict[str, Any]:
        # A shallow copy: dataclasses.asdict deep-copies the timelines in ``extra``, a tenth of an
        # actor's time on a 50k run. The caller owns the row; this record keeps its own lists.
        row = {name: getattr(self, name) for name in self.__dataclass_fields__}
        row["accepted_per_position"] = list(self.accepted_per_position)
        row["extra"] = dict(self.extra)
        row["draft_acceptance_rate"] = self.draft_acceptance_rate
        row["mean_acceptance_length"] = self.mean_acceptance_length
        return row


def bind_conditions(conditions: Any, pair: Any) -> torch.Tensor:
    """The per-row condition ids the loops feed a model: class labels as they are; for prompts
    (``specray.models.text.TextFeatures``) the batch's features go to the pair's text-conditioned
    models and row ``b``'s id is ``b``. A caption-prefix model (LlamaGen t2i,
    ``specray.models.captions``) gets the token-level features and mask; the built-in text models
    (``specray.models.conditioning``) get the pooled features."""
    from specray.models.captions import set_caption_features
    from specray.models.conditioning import set_prompt_features
    from specray.models.text import TextFeatures

    caption_model, text_model = text_conditioning(pair.target)
    if isinstance(conditions, TextFeatures):
        if not text_model:
            raise ValueError(f"model {pair.target_name!r} is class-conditioned; prompts need a text-conditioned model")
        if caption_model:
            set_caption_features(conditions.tokens, conditions.mask, pair.target, pair.draft)
        else:
            set_prompt_features(conditions.pooled, pair.target, pair.draft)
        return torch.arange(len(conditions), device=pair.device)
    if text_model:
        kind = "a text-to-image model (caption prefix)" if caption_model else "text-conditioned"
        raise ValueError(f"model {pair.target_name!r} is {kind}; give it prompts "
                         "(conditions: {kind: prompts, ...}), not class labels")
    return conditions


_TEXT_CONDITIONING: weakref.WeakKeyDictionary[torch.nn.Module, tuple[bool, bool]] = weakref.WeakKeyDictionary()


def text_conditioning(model: torch.nn.Module) -> tuple[bool, bool]:
    """Whether ``model`` takes a caption prefix, and whether it is text-conditioned at all (a caption prefix or
    pooled text features). Found once per model, whose condition modules are fixed once it is built: walking its
    modules cost every batch 0.16 ms on the digits target (12 layers; a real checkpoint has more), some 15 % of
    a batch's work outside its model calls and rounds at batch 1."""
    kinds = _TEXT_CONDITIONING.get(model)
    if kinds is None:
        from specray.models.captions import caption_embedders
        from specray.models.conditioning import text_embeddings

        caption_model = bool(caption_embedders(model))
        kinds = _TEXT_CONDITIONING[model] = (caption_model, caption_model or bool(text_embeddings(model)))
    return kinds


def _grouped(kept: list[tuple], key: Callable[[tuple], int]) -> list[list[tuple]]:
    """``kept`` in groups of equal ``key``."""
    return [list(group) for _, group in itertools.groupby(sorted(kept, key=key), key)]


@dataclass
class GenerationResult:
    """Images of one batch plus one statistics record per row.

    ``images`` is uint8, ``[B, H, W]`` (grey) or ``[B, H, W, 3]`` (RGB), on CPU. The loops do not
    time themselves: the caller (the actor, a benchmark) measures the batch around the call.
    """

    images: torch.Tensor
    stats: list[SampleStats]


class RoundTally:
    """Per-row counters of a batch's speculative rounds, on the run's device.

    The per-sample analogue of vLLM's ``SpecDecodingStats.observe_draft``: each round reports, for
    the rows that took part, which draft slots were drafted and which were accepted, and at which
    token index (``position``) each slot sits. Chain rules accept a prefix, block verification
    the prefix up to its last passing slot, CSpD's windows any subset: all are masks here.

    Counters are moved to the host once, in :meth:`to_stats`. Every round is kept aside by reference
    (no op in the round) and folded in by :meth:`flush`, counters and timeline alike, all rounds of a
    kind at once, their rows concatenated: prefix rounds by their counts, rounds given as masks, tree
    rounds by their drafted nodes and accepted depths.
    """

    def __init__(self, batch: int, gamma: int, num_positions: int, device: torch.device | str = "cpu") -> None:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.int64, device=device)  # noqa: E731
        self.batch, self.gamma, self.num_positions = batch, gamma, num_positions
        self.rounds, self.drafted, self.accepted = zeros(batch), zeros(batch), zeros(batch)
        self.per_position = zeros(batch, gamma)
        self.target_calls, self.draft_calls = zeros(batch), zeros(batch)
        # Padded by gamma + 1 columns so that a round's padding slots (masked out) need no clamp.
        self._width = num_positions + gamma + 1
        self.timeline_drafted, self.timeline_accepted = zeros(batch, self._width), zeros(batch, self._width)
        self._slots = torch.arange(max(gamma, 1) + 1, device=device)
        self._all_rows = torch.arange(batch, device=device)
        # Rounds kept aside until flush, by reference (callers pass fresh tensors each round), each with its rows
        # first (None: every row): prefix rounds as (rows, positions [r, G], drafted and accepted counts [r]); rounds
        # reported as masks as (rows, positions, drafted, accepted [r, G], drafted count [r] or None); tree rounds as
        # observe_tree's arguments.
        self._prefix_rounds: list[tuple] = []
        self._mask_rounds: list[tuple] = []
        self._tree_rounds: list[tuple] = []

    def slots(self, n: int) -> torch.Tensor:
        """``arange(n)`` on the tally's device (n <= gamma + 1), for building masks from counts."""
        return self._slots[:n] if n <= self._slots.numel() else torch.arange(n, device=self._slots.device)

    def observe(self, rows: torch.Tensor | None, positions: torch.Tensor, drafted: torch.Tensor,
                accepted: torch.Tensor, drafted_count: torch.Tensor | None = None) -> None:
        """One round of batch rows ``rows [r]`` (None: every row, in order).

        ``positions [r, G]``: the token index of each draft slot; ``drafted``/``accepted`` ``[r, G]``:
        bool masks (accepted implies drafted). Slots past the row's draft are not drafted.
        ``drafted_count [r]``: tokens drafted when a slot held several candidates (a draft tree: the
        slots are its depths, the count its nodes); default ``drafted.sum(1)``. The tensors are kept
        by reference until :meth:`flush`: the caller must not modify them.
        """
        self._mask_rounds.append((rows, positions, drafted, accepted, drafted_count))

    def observe_prefix(self, rows: torch.Tensor | None, positions: torch.Tensor, n_drafted: torch.Tensor,
                       n_accepted: torch.Tensor) -> None:
        """:meth:`observe` for rounds that draft and accept a prefix: counts ``[r]`` instead of masks (``positions``
        may have more slots than a row drafts, up to ``gamma + 1``: slots past ``n_drafted`` count as not drafted)."""
        self._prefix_rounds.append((rows, positions, n_drafted, n_accepted))

    def observe_tree(self, rows: torch.Tensor | None, n: torch.Tensor, drafted_nodes: torch.Tensor,
                     n_accepted: torch.Tensor, node_depth: torch.Tensor) -> None:
        """:meth:`observe` for a round that drafts a tree from committed lengths ``n [r]``: ``drafted_nodes [r, N]``
        which nodes were drafted, ``node_depth [N, G]`` each node's depth one-hot (node v at depth t + 1 in column t,
        the root's row all False), ``n_accepted [r]`` the accepted depths. Slot t is image token ``n + t``: drafted
        where a node of depth t + 1 was, accepted below ``n_accepted``; the drafted count is the drafted nodes."""
        self._tree_rounds.append((rows, n, drafted_nodes, n_accepted, node_depth))

    def _tree_masks(self, n: torch.Tensor, drafted_nodes: torch.Tensor, n_accepted: torch.Tensor,
                    node_depth: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """:meth:`observe_tree`'s rounds as positions, drafted and accepted masks ``[r, G]`` and drafted counts
        ``[r]``."""
        slot = self.slots(node_depth.shape[1])
        drafted_at = drafted_nodes[..., None] & node_depth  # [r, N, G]
        return (n[..., None] + slot, drafted_at.any(-2), slot < n_accepted[..., None], drafted_at.sum((-2, -1)))

    def add_calls(self, rows: torch.Tensor | None, target: torch.Tensor | int = 0,
                  draft: torch.Tensor | int = 0) -> None:
        """Target and draft network calls that rows ``rows`` (None: all) took part in."""
        if rows is None:
            self.target_calls += target
            self.draft_calls += draft
        else:
            self.target_calls[rows] += target
            self.draft_calls[rows] += draft

    def flush(self) -> None:
        """Fold the rounds kept aside into the counters (to_stats does it too): the rounds of a kind and width (a tree's
        table) at once, their rows concatenated (integer sums: the order does not matter)."""
        prefix_rounds = [] if self._prefix_rounds_in_one_call() else self._prefix_rounds
        for group in _grouped(prefix_rounds, lambda kept: kept[1].shape[1]):
            rows, (positions, n_drafted, n_accepted) = self._joined(group, 3)
            slot = self.slots(positions.shape[1])
            self._fold(rows, positions, slot < n_drafted[:, None], slot < n_accepted[:, None], n_drafted)
        for group in _grouped(self._mask_rounds, lambda kept: kept[1].shape[1]):
            rows, (positions, drafted, accepted) = self._joined(group, 3)
            self._fold(rows, positions, drafted, accepted,
                       torch.cat([d.sum(1) if c is None else c for _, _, d, _, c in group]))
        for group in _grouped(self._tree_rounds, lambda kept: id(kept[4])):  # one table per tree drafted
            rows, kept = self._joined(group, 3)
            self._fold(rows, *self._tree_masks(*kept, group[0][4]))
        self._prefix_rounds, self._mask_rounds, self._tree_rounds = [], [], []

    def _prefix_rounds_in_one_call(self) -> bool:
        """Fold the prefix rounds by the C++ extension's one call (``fold_prefix_rounds``: the same integer sums, each
        round at its own width) where the counters are on a CPU and this process has the extension loaded; False,
        with nothing folded, where it does not serve them (a batch-1 sample's 22 rounds: a flush 0.26 ms by torch's
        operations, 0.11 ms with this call, which itself takes 0.01 ms)."""
        kernels = cpu_kernels.loaded() if self._prefix_rounds and self.rounds.device.type == "cpu" else None
        return kernels is not None and kernels.fold_prefix_rounds(
            [self._all_rows if kept[0] is None else kept[0] for kept in self._prefix_rounds],
            *([kept[i] for kept in self._prefix_rounds] for i in (1, 2, 3)),
            self.rounds, self.drafted, self.accepted, self.per_position, self.timeline_drafted, self.timeline_accepted)

    def _joined(self, group: list[tuple], n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The rounds' rows (every row where a round's are None) and their first ``n`` tensors, concatenated."""
        rows = torch.cat([self._all_rows if kept[0] is None else kept[0] for kept in group])
        return rows, [torch.cat([kept[i] for kept in group]) for i in range(1, n + 1)]

    def _fold(self, rows: torch.Tensor, positions: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor,
              drafted_counts: torch.Tensor) -> None:
        """Add rounds by their rows: batch rows ``rows [n]`` (a row once a round it took part in), ``positions`` and
        masks ``[n, G]``, counts ``[n]``."""
        g = min(positions.shape[1], self.gamma)
        self.rounds.index_add_(0, rows, torch.ones_like(rows))
        self.drafted.index_add_(0, rows, drafted_counts.to(torch.int64))
        self.accepted.index_add_(0, rows, accepted.sum(1))
        self.per_position[:, :g].index_add_(0, rows, accepted[:, :g].to(torch.int64))
        flat = (rows[:, None] * self._width + positions).flatten()
        self.timeline_drafted.view(-1).index_add_(0, flat, drafted.flatten().to(torch.int64))
        self.timeline_accepted.view(-1).index_add_(0, flat, accepted.flatten().to(torch.int64))

    def to_stats(self, num_tokens: int, extra: list[dict[str, Any]] | None = None,
                 timeline: bool = True) -> list[SampleStats]:
        """One :class:`SampleStats` per row (one host transfer per counter).

        ``extra[b]`` is merged into row b's ``extra``; ``timeline`` adds
        ``extra["acceptance_timeline"]`` (drafted and accepted per token index, the first
        ``num_positions`` columns).
        """
        self.flush()
        # Python ints by one tolist a counter: indexing a tensor element by element cost a batch of 32 0.5 ms
        host = {name: getattr(self, name).tolist() for name in
                ("rounds", "drafted", "accepted", "per_position", "target_calls", "draft_calls")}
        if timeline:
            drafted = self.timeline_drafted[:, :self.num_positions].tolist()
            accepted = self.timeline_accepted[:, :self.num_positions].tolist()
        stats = []
        for b in range(self.batch):
            row_extra = dict(extra[b]) if extra is not None else {}
            if timeline:
                row_extra["acceptance_timeline"] = {"accepted": accepted[b], "drafted": drafted[b]}
            stats.append(SampleStats(
                num_tokens=num_tokens,
                num_spec_steps=host["rounds"][b],
                num_draft_tokens=host["drafted"][b],
                num_accepted_draft_tokens=host["accepted"][b],
                accepted_per_position=host["per_position"][b],
                target_calls=host["target_calls"][b],
                draft_calls=host["draft_calls"][b],
                extra=row_extra,
            ))
        return stats
