"""Drafting with an EAGLE head: chains of γ head steps, or a static tree (spec discrete_sd §3.5, §6).

The head (:class:`~specray.models.eagle_head.EagleHead`) drafts from the target's own hidden states,
so the target calls here return the hidden states (after the final norm) along with the processed
distributions, and the batch keeps them per sequence position (``TargetStream.features``). Rows are
ragged as in the GPT-draft loop (``loop.py``): each row has its own committed length ``n_b``.

One round for the active rows:

1. CATCH UP: the head re-reads the last ``depth + 1`` committed positions with the target's *true*
   hidden states (it drafted them from its own predictions last round), up to position ``n_b``,
   whose output is the law of the first draft. Positions are clamped at 1, the first one the head
   has (``f_0`` and image token 0); repeated ones rewrite the same slot with the same values.
2. DRAFT: chain — γ − 1 more head steps, each fed its previous prediction and the token it drew.
   Tree — one head call per depth over that depth's internal nodes; every node's children are
   drawn without replacement from the head's processed law (a child past the law's support is not
   drafted). Tree node ``v`` lives in cache slot ``n_b + v`` (the root, the last committed token,
   in ``n_b``) at sequence position ``n_b + depth(v)``, and attends to the committed prefix and its
   own ancestors.
3. VERIFY: one target call on ``[last committed token, drafts]`` (the chain causally, the tree with
   its tree mask); both CFG streams, logits CFG-combined and processed as the sampler does.
4. DECIDE: the chain rules of the family table, or :func:`~specray.methods.discrete.tree_rules.verify_tree`.
5. COMMIT: the accepted tokens and the correction / bonus; for a tree, the target's K/V and hidden
   states of the accepted path move from the nodes' scratch slots to their sequence positions.

Randomness (``specray.rng``): the first image token as in every method; a chain uses the GPT-draft
loop's keys (:class:`~specray.methods.discrete.loop.RoundUniforms`); a tree node ``v`` at depth ``t``
draws its token and acceptance uniform from streams "draft" / "accept" at position ``n_b + t - 1``
(the image-token index it would take), step = round, index = the node's rank among the tree's
nodes of depth ``t``; the correction / bonus from "residual" at position ``n_b``. A one-path tree
therefore has exactly the chain's keys, and gives the chain's tokens.

On a CPU a tree round's decision, each depth's children draws, its slots, positions and masks, its uniforms and its
commit (the tokens, the accepted path's K/V and hidden states) are one C++ call each
(:mod:`~specray.methods.discrete.cpu_tree_rounds`, ``cpu_rounds.bookkeeping``), with torch's values; at batch 1
they were most of the round's work outside the model calls. A chain's masks are a one-path tree's.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specray import rng
from specray.families import Method
from specray.methods.common import RoundTally
from specray.methods.discrete import cpu_rounds, cpu_tree_rounds
from specray.methods.discrete.loop import RoundUniforms, _decide, _next_round, _verify_inputs
from specray.methods.discrete.params import Sampling, Speculative
from specray.methods.discrete.processing import model_softmax, process_with
from specray.methods.discrete.rules import RuleParams, _rows_column, rule_params_for_pair
from specray.methods.discrete.tree_rules import TREE_RULES, tree_index, tree_verifier
from specray.methods.discrete.trees import StaticTree, resolve_tree
from specray.models import cpu_kernels
from specray.models.discrete_ar import DiscreteGPT, KVCache, attention_span, kv_slots
from specray.models.eagle_head import EagleHead
from specray.models.pair import ModelPair


class _Streams:
    """Cache rows of a batch's samples: sample ``b`` in row ``b`` and, with CFG, its uncond stream in ``batch + b``."""

    def __init__(self, batch: int, sampling: Sampling) -> None:
        self.batch = batch
        self.sampling = sampling
        self.guided = sampling.uses_uncond
        self.rows = 2 * batch if self.guided else batch
        self.calls = 0
        self._rows_of: torch.Tensor | None = None  # cache_rows' last samples, and their rows
        self._rows = None
        self._column_of: torch.Tensor | None = None  # cache_rows_column's last samples, and their rows' column
        self._column = None
        self.softmax = model_softmax(sampling)  # the calls' probabilities made by them; None: process() makes them

    def cache_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """The cache rows of the samples ``idx`` (made once per ``idx`` object: a round asks several times)."""
        if not self.guided:
            return idx
        if idx is not self._rows_of:
            self._rows_of, self._rows = idx, torch.cat([idx, idx + self.batch])
        return self._rows

    def cache_rows_column(self, idx: torch.Tensor) -> torch.Tensor:
        """``cache_rows(idx)[:, None]``, an index's row column (made once per ``idx`` object, as cache_rows)."""
        if idx is not self._column_of:
            self._column_of, self._column = idx, self.cache_rows(idx)[:, None]
        return self._column

    def both(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` for the cond rows, repeated for the uncond rows."""
        return torch.cat([x, x]) if self.guided else x

    def process(self, out: torch.Tensor) -> torch.Tensor:
        """A call's laws from its output: the probabilities themselves where it made them (:attr:`softmax`)."""
        if self.softmax is not None:
            return out
        r = out.shape[0] // 2 if self.guided else out.shape[0]
        return process_with(self.sampling, out[:r], out[r:] if self.guided else None)


class TargetStream(_Streams):
    """The target's cache plus its hidden state at every sequence position (``features``)."""

    def __init__(self, model: DiscreteGPT, batch: int, sampling: Sampling, max_len: int) -> None:
        super().__init__(batch, sampling)
        self.model = model
        weight = model.output.weight
        # One tensor per K and V over all layers (the cache's per-layer tensors are views of it), so
        # moving the accepted path's slots is one copy, not two per layer.
        layers = len(model.layers)
        shape = {"max_len": max_len, "n_head": model.config.n_head, "head_dim": model.config.head_dim, "like": weight}
        self.keys = kv_slots(layers, self.rows, **shape)
        self.values = kv_slots(layers, self.rows, **shape)
        # The same slots as laid out in memory (head-major, kv_slots), as the C++ copies take them; views.
        self.stored = (self.keys.transpose(-3, -2), self.values.transpose(-3, -2))
        self.cache = KVCache([self.keys[i] for i in range(layers)], [self.values[i] for i in range(layers)],
                             torch.zeros(self.rows, dtype=torch.int64, device=weight.device))
        self.features = torch.zeros(self.rows, max_len, model.config.dim, dtype=weight.dtype, device=weight.device)

    def probs(self, idx: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
              visible: torch.Tensor, prefix: bool = False, paired: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Processed laws ``[r, n, V]`` and hidden states ``[rows, n, D]`` (cond rows, then uncond).
        ``paired``: ``positions``, ``slots`` and ``visible`` are given for every cache row already."""
        self.calls += 1
        fed = tokens
        if self.guided:
            uncond = torch.where(positions[: tokens.shape[0]] == 0, self.model.null_class, tokens) if prefix else tokens
            fed = torch.cat([tokens, uncond])
        if not paired:
            positions, slots, visible = self.both(positions), self.both(slots), self.both(visible)
        hidden, out = self.model.forward_tree_logits(fed, positions, slots, visible, self.cache,
                                                     rows=self.cache_rows(idx), prefix=prefix, softmax=self.softmax)
        return self.process(out), hidden

    def keep_features(self, idx: torch.Tensor, slots: torch.Tensor, hidden: torch.Tensor, paired: bool = False) -> None:
        """Store hidden states ``[rows, k, D]`` at ``slots [r, k]`` of the samples ``idx`` (``[rows, k]`` if ``paired``)."""
        same = hidden.dtype == self.features.dtype  # no op where nothing converts
        self.features[self.cache_rows_column(idx), slots if paired else self.both(slots)] = (
            hidden if same else hidden.to(self.features.dtype))

    def read_features(self, idx: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[rows, k, D]`` at ``slots [rows, k]`` (given for every cache row) of the samples ``idx``."""
        return self.features[self.cache_rows_column(idx), slots]

    def move(self, idx: torch.Tensor, source: torch.Tensor, dest: torch.Tensor, hidden: torch.Tensor) -> None:
        """Move K/V of slots ``source [r, k]`` to ``dest [r, k]`` and store ``hidden [rows, k, D]`` at ``dest``."""
        rows = self.cache_rows(idx)
        src, dst = self.both(source), self.both(dest)
        kernels = cpu_kernels.extension() if self.features.device.type == "cpu" else None
        for slots, stored in zip((self.keys, self.values), self.stored):
            # One C++ call per tensor on a CPU (a copy: the same values), else torch's indexed copy.
            if kernels is None or not kernels.move_slots(stored, rows, src, dst):
                slots[:, rows[:, None], dst] = slots[:, rows[:, None], src]  # the right side is a copy: overlaps are safe
        self.features[rows[:, None], dst] = hidden.to(self.features.dtype)


class HeadStream(_Streams):
    """The EAGLE head's cache; its logits come from the target's output layer."""

    def __init__(self, head: EagleHead, target: DiscreteGPT, batch: int, sampling: Sampling, max_len: int) -> None:
        super().__init__(batch, sampling)
        self.head = head
        self.target = target
        self.cache = head.new_cache(self.rows, max_len)

    def probs(self, idx: torch.Tensor, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor, visible: torch.Tensor, paired: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Processed laws ``[r, n, V]`` and predicted hidden states ``[rows, n, D]`` (cond, then uncond rows).
        ``paired``: ``positions``, ``slots`` and ``visible`` are given for every cache row already."""
        self.calls += 1
        if not paired:
            positions, slots, visible = self.both(positions), self.both(slots), self.both(visible)
        predicted, out = self.head.forward_cached_logits(features, self.both(tokens), positions, slots, visible,
                                                         self.cache, self.target, rows=self.cache_rows(idx),
                                                         softmax=self.softmax)
        return self.process(out), predicted


def _causal(positions: torch.Tensor, span: int, first: int = 0) -> torch.Tensor:
    """``visible [r, n, span]``: slot s is seen from position p iff ``first <= s <= p``."""
    slots, from_first = _slot_ranges(span, first, positions.device)
    return from_first & (slots <= positions[:, :, None])


@functools.lru_cache(maxsize=32)
def _window_offsets(window: int, device: torch.device) -> torch.Tensor:
    """``arange(window) - window + 1`` (``[1 - window .. 0]``), built once; read-only."""
    return torch.arange(window, device=device) - window + 1


@functools.lru_cache(maxsize=32)
def _slot_ranges(span: int, first: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``arange(span)`` and ``arange(span) >= first``, built once (two ops fewer per call); read-only."""
    slots = torch.arange(span, device=device)
    return slots, slots >= first


def _round_masks(index, n_rows: torch.Tensor, span: int, window: int) -> tuple[torch.Tensor, ...]:
    """For cache rows at committed lengths ``n_rows`` on a tree (its
    :class:`~specray.methods.discrete.tree_rules.TreeIndex`; a chain is a one-path tree), over ``span`` slots: the
    nodes' slots ``n + v`` and positions ``n + depth(v)``, the verify's mask (:func:`_tree_visible`) and the head's
    (the same without slot 0: the head has none), and the catch-up's positions and mask over ``window`` positions
    (:func:`_catch_up_window`). One kernel call on a CPU (the same values)."""
    kernels = cpu_rounds.bookkeeping(n_rows.device)
    fast = None if kernels is None else kernels.tree_masks(n_rows, index.depths, index.visible, span, window)
    if fast is not None and fast[0] is not None:
        return fast
    visible = _tree_visible(index, n_rows, span)
    head_visible = visible & _slot_ranges(span, 1, n_rows.device)[1]
    return (n_rows[:, None] + index.node_ids, n_rows[:, None] + index.depths, visible, head_visible,
            *_catch_up_window(n_rows, window, span))


def _tree_visible(index, n: torch.Tensor, span: int) -> torch.Tensor:
    """``visible [r, N+1, span]``: node v sees the committed slots ``0 .. n - 1`` and its own root path, slots
    ``n + a`` (``span`` must cover every tree slot, ``n + N``). Built once a round: the verify call reads it whole,
    each head call the rows of its level (without slot 0: the head has no position 0)."""
    r, nodes = n.shape[0], index.node_ids.shape[0]
    slots, _ = _slot_ranges(span, 0, n.device)
    n_col = n[:, None]
    committed = (slots < n_col)[:, None, :].expand(r, nodes, span)
    tree_slots = (n_col + index.node_ids)[:, None, :].expand(-1, nodes, -1)  # node v in slot n + v
    return committed.clone().scatter_(2, tree_slots, index.visible[None].expand(r, -1, -1))


def _catch_up_window(n_rows: torch.Tensor, window: int, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The catch-up's positions ``[rows, window]`` up to ``n`` of every cache row (``n_rows``, ``head.both(n)``),
    clamped at 1, and their mask ``[rows, window, span]`` (``span``: the round's attention span, past ``n``)."""
    # n - window + 1 + arange(window): integer sums, so one add of a cached offset row gives the same positions
    positions = (n_rows[:, None] + _window_offsets(window, n_rows.device)).clamp(min=1)
    return positions, _causal(positions, span, first=1)


def _catch_up(head: HeadStream, target: TargetStream, idx: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
              visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1. CATCH UP at ``positions`` with mask ``visible`` (:func:`_catch_up_window`): the first draft's law ``[r, 1, V]``
    and the head's prediction at the last position ``[rows, 1, D]`` (as a head step gives them), and the image
    tokens it fed ``[r, window]``, the last one token ``n - 1``, the tree's root."""
    before = positions - 1  # image token s - 1 is fed at position s
    features = target.read_features(idx, before)
    fed = tokens.gather(1, before[: tokens.shape[0]])
    q, predicted = head.probs(idx, features, fed, positions, positions, visible, paired=True)
    return q[:, -1:], predicted[:, -1:], fed


# ---- chain ------------------------------------------------------------------------------------------


def _chain(method: Method, params: Speculative, pair: ModelPair, labels: torch.Tensor, sample_ids: torch.Tensor,
           seed: int) -> tuple[torch.Tensor, RoundTally]:
    target_model: DiscreteGPT = pair.target
    gamma = params.gamma
    num_tokens = target_model.config.num_image_tokens
    batch, device = labels.shape[0], labels.device
    max_len = target_model.max_seq_len + gamma + 1
    target = TargetStream(target_model, batch, params, max_len)
    head = HeadStream(pair.draft, target_model, batch, params, max_len)
    verifier = method.rule()(params, pair)
    tokens = torch.zeros(batch, num_tokens + gamma + 1, dtype=torch.int64, device=device)
    committed = _prefill(target, labels, sample_ids, seed, tokens)
    tally = RoundTally(batch, gamma, num_tokens, device)
    tally.add_calls(None, target=1)
    uniforms = RoundUniforms(seed, sample_ids, num_tokens + gamma + 1)
    all_rows = torch.arange(batch, device=device)
    steps = torch.arange(gamma + 1, device=device)
    path = tree_index(StaticTree.chain(gamma), device)  # node i at depth i: slot and position n + i
    on_cpu = device.type == "cpu"
    draw_column = cpu_rounds.bound_draw(target_model.config.vocab_size, device, keepdim=True)
    for it in range(num_tokens):
        planned = _next_round(committed, num_tokens, gamma, labels, tokens, all_rows, steps, uniforms, it,
                              draft_inputs=False)
        if planned is None:
            break
        rnd, (u_draft, u_accept, u_residual) = planned
        # Every call of the round sees no slot past the verify's last position: one span for all of them.
        # The cache's slots (max_len rounded up) on a CPU, where the largest position is known on the host.
        span = attention_span(rnd.positions, target.cache.max_len, checked=rnd.top + gamma if on_cpu else None)
        # The round's positions and masks for every cache row (cond rows, then uncond), built once, as a one-path
        # tree's: the verify reads them whole, each head step its column (the head has no position 0).
        _, positions, visible, head_visible, *catch_up = _round_masks(path, head.both(rnd.n), span, gamma + 1)
        q, predicted, _ = _catch_up(head, target, rnd.idx, rnd.tokens, *catch_up)
        # Per-step columns split off once, the laws and drafts stacked once (fewer ops than indexing).
        step_positions = positions[:, 1:gamma, None].unbind(1)  # [rows, 1] columns, one op (split costs more)
        step_visible = head_visible[:, 1:gamma, None].unbind(1)  # [rows, 1, span]
        laws, ds = [], []  # the laws [r, V] (views of the head's [r, 1, V]) and the drafts [r, 1], by step
        for i, u_step in enumerate(u_draft[:, :, None].unbind(1)):
            if i:
                at = step_positions[i - 1]
                q, predicted = head.probs(rnd.idx, predicted, ds[-1], at, at, step_visible[i - 1], paired=True)
            laws.append(q[:, 0])
            ds.append(draw_column(laws[-1], u_step))  # [r, 1]: the next step's fed column
        # the drafts and laws stacked, the drafts written into the token buffer, the verify call's tokens (loop's)
        drafts, Q, fed = _verify_inputs(rnd, ds, laws, gamma)
        P, hidden = target.probs(rnd.idx, fed, positions, positions, visible, paired=True)
        target.keep_features(rnd.idx, positions, hidden, paired=True)
        n_acc, next_token = _decide(verifier, rnd, P, Q, drafts, u_accept, u_residual)
        _commit_tokens(rnd.idx, rnd.full, rnd.n, n_acc, next_token, rnd.tokens, tokens, committed)
        tally.observe_prefix(None if rnd.full else rnd.idx, rnd.positions, rnd.n_drafts, n_acc)
    tally.flush()
    tally.add_calls(None, target=tally.rounds, draft=gamma * tally.rounds)  # a round: one verify, gamma head calls
    return tokens[:, :num_tokens], tally


def _prefill(target: TargetStream, labels: torch.Tensor, sample_ids: torch.Tensor, seed: int,
             tokens: torch.Tensor) -> torch.Tensor:
    """0. PREFILL: image token 0 from the target (keyed like target_only's) and its hidden state ``f_0``."""
    batch = labels.shape[0]
    idx = torch.arange(batch, device=labels.device)
    zero = torch.zeros(batch, 1, dtype=torch.int64, device=labels.device)
    visible = _causal(zero, attention_span(zero, target.cache.max_len))
    probs0, hidden = target.probs(idx, labels[:, None], zero, zero, visible, prefix=True)
    target.keep_features(idx, zero, hidden)
    # rng.categorical's keys and tokens, drawn by the kernel where it serves
    tokens[:, 0] = cpu_rounds.sample_categorical(probs0[:, 0], rng.uniform(seed, sample_ids, "target", position=0,
                                                                          device=labels.device))
    return torch.ones(batch, dtype=torch.int64, device=labels.device)


def _commit_tokens(idx: torch.Tensor, full: bool, n: torch.Tensor, n_acc: torch.Tensor, next_token: torch.Tensor,
                   row_tokens: torch.Tensor, tokens: torch.Tensor, committed: torch.Tensor) -> None:
    """The accepted drafts are in ``row_tokens`` already; the correction / bonus follows them."""
    last = n + n_acc
    if full:  # idx is arange(batch): one index_put, no reshaping
        row_tokens[idx, last] = next_token
        committed.copy_(last + 1)
    else:
        row_tokens.scatter_(1, last[:, None], next_token[:, None])
        tokens[idx] = row_tokens
        committed[idx] = last + 1


# ---- tree -------------------------------------------------------------------------------------------


class _TreePlan:
    """Everything about a tree a round reuses, built once per batch: per depth, the internal nodes the
    head runs on, their parents and their children; the round's attention mask (:meth:`visible`); and
    the round's uniforms.

    Uniforms: node ``v`` at depth ``t`` draws from streams "draft" / "accept" at position
    ``n_b + t - 1``, index = its rank among the nodes of depth ``t``; the residual at position ``n_b``.
    As :class:`~specray.methods.discrete.loop.RoundUniforms` makes them, on a CPU a round hashes its nodes'
    keys alone (``tree_uniforms``, from each sample's stream hashes made once), and elsewhere torch's
    operations make them for every position and a chunk of rounds at once (the same values as one
    ``rng.uniform`` call per key either way).
    """

    def __init__(self, tree: StaticTree, device: torch.device, seed: int, sample_ids: torch.Tensor,
                 num_positions: int) -> None:
        self.tree = tree
        self.index = tree_index(tree, device)
        self.levels = tree_levels(tree, device)
        ranks, seen = [0], {}
        for depth in tree.depths[1:]:
            ranks.append(seen.get(depth, 0))
            seen[depth] = ranks[-1] + 1
        # Per node, and once more for the spare column (node 0's keys): its position offset and rank.
        self.offset = torch.tensor([max(d - 1, 0) for d in tree.depths] + [0], device=device)
        self.rank = torch.tensor(ranks + [0], device=device)
        self.width = max(seen.values())
        self.seed, self.sample_ids = seed, sample_ids
        self.hashes = RoundUniforms.stream_hashes(seed, sample_ids)  # the kernel's keys start from them
        self.positions = torch.arange(num_positions, device=device)
        self.chunk = max(4, min(32, 256 // max(1, sample_ids.shape[0])))
        self.chunks: list[torch.Tensor] = []  # [B, positions, chunk, width, 3] float64
        self._blank = self._new_nodes(sample_ids.shape[0])  # blank_nodes' template for the whole batch

    STREAMS = RoundUniforms.STREAMS

    def uniforms(self, step: int, idx: torch.Tensor, n: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Uniforms of rows ``idx``: streams draft ``[r, N+2]`` (the last column the spare one's, a copy of
        node 0's) and accept ``[r, N+1]`` per node, and the residual ``[r]`` (the root's keys, index 0: a draw
        without an index is keyed as index 0)."""
        kernels = cpu_rounds.bookkeeping(idx.device)
        fast = None if kernels is None else kernels.tree_uniforms(self.hashes, step, idx, n, self.offset, self.rank)
        if fast is not None and fast[0] is not None:  # one call: the same values, contiguous
            return fast
        while len(self.chunks) <= step // self.chunk:
            first = len(self.chunks) * self.chunk
            steps = torch.arange(first, first + self.chunk, device=self.positions.device)[None, None, :]
            u = rng.uniform_streams(self.seed, self.sample_ids[:, None, None], self.STREAMS,
                                    position=self.positions[None, :, None], step=steps, shape=(self.width,))
            self.chunks.append(u.transpose(-2, -1))  # streams last: one index below takes all three
        slab = self.chunks[step // self.chunk].select(2, step % self.chunk)  # [B, positions, width, 3]
        if idx.shape[0] != slab.shape[0]:
            slab = slab[idx]
        per_node = slab[_rows_column(idx.shape[0], idx.device), n[:, None] + self.offset[None], self.rank]
        return per_node[:, :, 0], per_node[:, :-1, 1], per_node[:, 0, 2]

    def blank_nodes(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A round's node tokens (0) and drafted flags (the root's only) ``[rows, N+2]``, the spare column last (see
        :meth:`draw_children`); for the whole batch, copies of a pair made once (one op each)."""
        if rows != self._blank[0].shape[0]:
            return self._new_nodes(rows)
        return self._blank[0].clone(), self._blank[1].clone()

    def _new_nodes(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.zeros(rows, self.tree.num_nodes + 2, dtype=torch.int64, device=self.rank.device)
        valid = torch.zeros(rows, self.tree.num_nodes + 2, dtype=torch.bool, device=self.rank.device)
        valid[:, 0] = True
        return tokens, valid

    def masks(self, n_rows: torch.Tensor, top: int, max_len: int, window: int) -> tuple[torch.Tensor, ...]:
        """:func:`_round_masks` of cache rows at committed lengths ``n_rows`` (the largest ``top``) over the round's
        attention span in a cache of ``max_len`` slots: every call of the round sees the whole tree's slots."""
        on_cpu = n_rows.device.type == "cpu"  # the largest slot, n + N, known on the host (elsewhere no span)
        span = attention_span(n_rows, max_len, checked=top + self.tree.num_nodes if on_cpu else None)
        return _round_masks(self.index, n_rows, span, window)

    def draw_children(self, depth: int, q: torch.Tensor, u: torch.Tensor, node_tokens: torch.Tensor,
                      node_valid: torch.Tensor) -> None:
        """Children of depth ``depth``'s internal nodes, without replacement from their laws ``q [r, L, V]``
        (:func:`draw_children_torch`; one kernel call on a CPU, :mod:`~specray.methods.discrete.cpu_tree_rounds`).

        ``node_tokens`` / ``node_valid`` ``[r, N+2]``: a spare last column takes the absent children's writes;
        ``u [r, N+2]``: the round's draft uniforms per node, and the spare column's for absent children
        (:meth:`uniforms`).
        """
        nodes, _, kids = self.levels[depth]
        if not cpu_tree_rounds.draw_children(q, u, node_tokens, node_valid, nodes.ids, kids):
            draw_children_torch(q, u, node_tokens, node_valid, nodes.ids, kids)


class Columns:
    """Column ids of a round's per-node tensors, taken by one ``narrow`` (a view) where they are consecutive, as
    the named trees' levels are, else by ``index_select`` (the same values)."""

    def __init__(self, ids: list[int], device: torch.device) -> None:
        self.ids = torch.tensor(ids, device=device)
        self.first = ids[0] if ids == list(range(ids[0], ids[0] + len(ids))) else None
        self.count = len(ids)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """``x[:, ids]``."""
        return x.narrow(1, self.first, self.count) if self.first is not None else x.index_select(1, self.ids)


class TreeLevel(NamedTuple):
    """The internal nodes of one depth of a tree, as a round drafts them."""

    nodes: Columns  # their node ids
    parents_at: Columns  # each one's parent's place among the previous depth's internal nodes
    kids: torch.Tensor  # [slots, L] their children by drafting slot, the spare column N + 1 where a node has fewer


def tree_levels(tree: StaticTree, device: torch.device) -> list[TreeLevel]:
    """:class:`TreeLevel` per depth (child slots that no node of the depth uses left out). The internal nodes of
    the depths in turn are the tree's internal nodes in order (node ids sort by depth), so a round's drafter laws
    per depth, concatenated, are ``Q`` in the order ``verify_tree`` reads it."""
    spare = tree.num_nodes + 1
    levels, previous = [], [-1]  # the root's parent: none (its level reads the catch-up's one prediction)
    for depth in range(tree.depth):
        nodes = list(tree.levels[depth])
        slots = [[tree.children[v][j] if j < len(tree.children[v]) else spare for v in nodes]
                 for j in range(tree.max_children)]
        kids = torch.tensor([slot for slot in slots if any(k != spare for k in slot)], device=device)
        parents_at = [previous.index(tree.parents[v]) for v in nodes]
        levels.append(TreeLevel(Columns(nodes, device), Columns(parents_at, device), kids))
        previous = nodes
    assert [v for level in levels for v in level.nodes.ids.tolist()] == list(tree.internal)
    return levels


def draw_children_torch(q: torch.Tensor, u: torch.Tensor, node_tokens: torch.Tensor, node_valid: torch.Tensor,
                        nodes: torch.Tensor, kids: torch.Tensor) -> None:
    """The children of ``nodes`` (one tree level), written at the columns ``kids [slots, L]`` of ``node_tokens`` /
    ``node_valid``, drawn without replacement from the nodes' laws ``q [r, L, V]`` with the uniforms of those
    columns of ``u``: child ``j`` from the law without the earlier children's tokens, drafted where its parent was
    and that law has mass left (token 0 and not valid otherwise)."""
    left = q.to(torch.float64)
    parent_valid = node_valid.index_select(1, nodes)
    # index_select / index_copy_ rather than [:, kids]: the same values, a few µs less per op. An
    # absent child's writes land in the spare column, which nothing reads, so they need no mask.
    for slot in kids:
        cdf = torch.cumsum(left, dim=-1)  # float64 running sums, as sample_categorical makes them
        drawn = (cdf.select(-1, -1) > 0) & parent_valid
        # A parent whose law has no mass left draws V - 1 from its zero cdf; not drawn, so masked below.
        token = rng.sample_from_cdf(cdf, u.index_select(1, slot).unsqueeze(-1))
        node_tokens.index_copy_(1, slot, torch.where(drawn, token.squeeze(-1), 0))
        node_valid.index_copy_(1, slot, drawn)
        # The drawn token leaves the parent's law. Zeroing it where nothing was drawn changes no
        # output: no later child of that parent is drawn either (absent children stay absent, an
        # invalid parent stays invalid, an empty law stays empty), so one scatter, no mask.
        left = left.scatter(-1, token, 0.0)


def _tree(params: Speculative, pair: ModelPair, labels: torch.Tensor, sample_ids: torch.Tensor,
          seed: int) -> tuple[torch.Tensor, RoundTally]:
    target_model: DiscreteGPT = pair.target
    tree = resolve_tree(params.tree)
    depth, nodes = tree.depth, tree.num_nodes + 1
    num_tokens = target_model.config.num_image_tokens
    batch, device = labels.shape[0], labels.device
    plan = _TreePlan(tree, device, seed, sample_ids, num_tokens + depth + 1)
    index = plan.index
    max_len = target_model.max_seq_len + nodes
    target = TargetStream(target_model, batch, params, max_len)
    head = HeadStream(pair.draft, target_model, batch, params, max_len)
    verify = tree_verifier(params.rule, index, tree_rule_params(params, pair))
    tokens = torch.zeros(batch, num_tokens + depth + 1, dtype=torch.int64, device=device)
    committed = _prefill(target, labels, sample_ids, seed, tokens)
    tally = RoundTally(batch, depth, num_tokens, device)
    tally.add_calls(None, target=1)
    depth_steps = torch.arange(depth, device=device)
    node_depth = index.depths[:, None] == depth_steps[None] + 1  # [N+1, depth]: node v sits at depth t + 1 (root: none)
    all_rows = torch.arange(batch, device=device)
    for it in range(num_tokens):
        counts = committed.tolist()  # the round's one host sync
        active = [b for b, c in enumerate(counts) if c < num_tokens]
        if not active:
            break
        full = len(active) == batch  # every row takes part: the batch's own tensors, updated in place
        if full:  # committed is replaced, never written, by a round (the tally keeps n): no copy
            idx, n, row_tokens = all_rows, committed, tokens
        else:
            idx = torch.tensor(active, device=device)
            n, row_tokens = committed[idx], tokens[idx]
        r = idx.shape[0]
        u_draft, u_accept, u_residual = plan.uniforms(it, idx, n)

        # 1-2. CATCH UP, then one head call per depth over that depth's internal nodes. Slots, positions and the
        # mask of the round's calls are built once, for every cache row (cond rows, then uncond).
        node_tokens, node_valid = plan.blank_nodes(r)
        top = max(counts[b] for b in active)
        slots, node_positions, visible, head_visible, *catch_up = plan.masks(head.both(n), top, target.cache.max_len,
                                                                             depth + 1)
        q, predicted, caught_up = _catch_up(head, target, idx, row_tokens, *catch_up)
        qs = [q]  # per depth: the laws [r, L, V]; predicted: the last depth's predictions [rows, L, D]
        plan.draw_children(0, qs[0], u_draft, node_tokens, node_valid)
        for t in range(1, depth):
            level, parents_at, _ = plan.levels[t]
            q, predicted = head.probs(idx, parents_at.take(predicted), level.take(node_tokens),
                                      level.take(node_positions), level.take(slots), level.take(head_visible),
                                      paired=True)
            qs.append(q)
            plan.draw_children(t, q, u_draft, node_tokens, node_valid)
        node_tokens, node_valid = node_tokens[:, :nodes], node_valid[:, :nodes]
        Q = torch.cat(qs, dim=1)  # [r, I, V]: the internal nodes depth by depth, in order (tree_levels)

        # 3-4. VERIFY the whole tree in one target call, DECIDE depth by depth.
        fed = torch.cat([caught_up[:, -1:], node_tokens[:, 1:]], dim=1)  # the root: token n - 1
        P, hidden = target.probs(idx, fed, node_positions, slots, visible, paired=True)
        if top + depth < num_tokens:  # every node has room in the image
            verifiable = node_valid
        else:  # a node past the image's last token is not verified
            verifiable = node_valid & (index.depths[None] <= (num_tokens - 1 - n)[:, None])
        out = verify(P, Q, node_tokens, verifiable, u_accept, u_residual)

        # 5. COMMIT: accepted node at depth t + 1 -> image token n + t, sequence position n + t + 1.
        new_n = _commit_tree(target, idx, n, out, node_tokens, hidden, row_tokens)
        if full:
            committed = new_n
        else:
            tokens[idx] = row_tokens
            committed = committed.index_put((idx,), new_n)  # a new tensor: an earlier round's n stays as the tally kept it
        tally.observe_tree(None if full else idx, n, verifiable, out.n_accepted, node_depth)
    tally.flush()
    tally.add_calls(None, target=tally.rounds, draft=depth * tally.rounds)  # a round: one verify, depth head calls
    return tokens[:, :num_tokens], tally


def _commit_tree(target: TargetStream, idx: torch.Tensor, n: torch.Tensor, out, node_tokens: torch.Tensor,
                 hidden: torch.Tensor, row_tokens: torch.Tensor) -> torch.Tensor:
    """The accepted path's tokens and the correction / bonus into ``row_tokens``, its K/V and hidden states to their
    sequence positions (:func:`_commit_tree_torch`; one kernel call on a CPU); the rows' new committed lengths."""
    kernels = cpu_rounds.bookkeeping(hidden.device)
    if kernels is not None:
        new_n = kernels.tree_commit(*target.stored, target.features,
                                    row_tokens, target.cache_rows(idx), n, out.n_accepted, out.path, out.next_token,
                                    node_tokens, hidden)
        if new_n is not None:
            return new_n
    return _commit_tree_torch(target, idx, n, out, node_tokens, hidden, row_tokens)


def _commit_tree_torch(target: TargetStream, idx: torch.Tensor, n: torch.Tensor, out, node_tokens: torch.Tensor,
                       hidden: torch.Tensor, row_tokens: torch.Tensor) -> torch.Tensor:
    """:func:`_commit_tree` by torch's operations: accepted node at depth t + 1 -> image token n + t, sequence
    position n + t + 1 (a rejected depth's token goes to the scratch token n + depth, its hidden state to n + t + 1)."""
    depth = out.path.shape[1]
    accepted = torch.arange(depth, device=n.device) < out.n_accepted[:, None]
    dest = n[:, None] + 1 + torch.arange(depth, device=n.device)
    row_tokens.scatter_(1, torch.where(accepted, dest - 1, n[:, None] + depth), node_tokens.gather(1, out.path))
    target.keep_features(idx, target.both(n)[:, None], hidden[:, :1], paired=True)
    kept = torch.where(accepted, n[:, None] + out.path, dest)  # node v in slot n + v; rejected depths stay put
    path_rows = torch.arange(hidden.shape[0], device=n.device)[:, None]
    target.move(idx, kept, dest, hidden[path_rows, target.both(out.path)])
    last = n + out.n_accepted
    row_tokens.scatter_(1, last[:, None], out.next_token[:, None])
    return last + 1


def tree_rule_params(params: Speculative, pair: ModelPair) -> RuleParams:
    """The rule's parameters for a tree round: COOL-SD's μ normalised over the tree's depth (spec §4.6)."""
    if params.rule not in TREE_RULES:
        raise ValueError(f"rule {params.rule!r} cannot verify a tree; allowed: {', '.join(TREE_RULES)}")
    return rule_params_for_pair(params, pair)


def head_speculative(method: Method, params: Speculative, pair: ModelPair, labels: torch.Tensor,
                     sample_ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, RoundTally]:
    """Image tokens ``[B, N]`` and the round tally of an arm drafting with an EAGLE head."""
    if not isinstance(pair.draft, EagleHead):
        raise ValueError(f"static-tree drafting needs an EAGLE head as the draft; {pair.draft_name!r} is a "
                         f"{type(pair.draft).__name__}")
    if params.tree is None:
        return _chain(method, params, pair, labels, sample_ids, seed)
    return _tree(params, pair, labels, sample_ids, seed)
