"""Decoding loops of the discrete family: target-only, and draft -> verify -> commit (spec discrete_sd §5).

Rows are ragged (spec §5.3): every sample keeps its own number of committed
image tokens ``n_b``; caches are written at per-row positions and rows that are
done drop out of the calls (compaction by index, the caches stay in place) once fewer than half
the rows take part; until then a call runs on every row, the others parked (bit for bit the same).

One round for the active rows:

1. DRAFT: ``g_b = min(gamma, N - 1 - n_b)`` drafts per row (never past the last
   image token), the draft running its own cond and uncond streams; the first
   draft step re-feeds sequence positions ``n_b - 1, n_b`` so it catches up
   whatever the previous round committed.
2. VERIFY: one target call on ``[last committed token, d_1 .. d_gamma]`` for both
   CFG halves (padded past ``g_b``; those outputs are ignored).
3. DECIDE: the method's rule (:func:`specray.methods.discrete.rules.verify`) on the first ``g_b``
   positions (rows grouped by ``g_b``; a row with ``g_b = 0`` samples its last
   token straight from the target distribution).
4. COMMIT: ``n_b += n_acc + 1``; caches cropped to the committed length.

Randomness (``specray.rng``, keyed per sample, never by batch composition):

- target_only, and the first image token of every method: stream ``"target"``,
  position = image-token index (so all arms share image token 0 sample by sample);
- drafts: stream ``"draft"``, position = image-token index drafted, step = round;
- acceptance uniforms: stream ``"accept"``, position = image-token index, step = round;
- correction / bonus: stream ``"residual"``, position = first index of the round, step = round.

Keying by round as well as position matters for block verification: its decision
depends on drafts after the accepted prefix, so reusing their uniforms when the
same positions are drafted again in the next round would correlate the rounds.

COOL-SD in a row's shortened last round (``g_b < gamma``) uses the first ``g_b``
multipliers of the full-gamma schedule (mu is fixed from gamma when left None).

Performance (the models are tiny, so per-op dispatch dominates; none of this changes a bit
of the output): on a CPU a round hashes only the keys of the uniforms it uses, in one call, and elsewhere the
uniforms come from a few large calls (:class:`RoundUniforms`; target_only's in one ``rng.uniform`` call), instead
of one call per step and stream;
while every row is active (``full``) the caches are read without a gather copy and rows are
updated in place; the common round (every row drafts gamma tokens) skips the per-step live-row
indexing and verifies in one group; counters stay on the device (:class:`~specray.methods.common.RoundTally`) and are moved
once; the host syncs are two per round (draft lengths, and the active rows only once some are done). On a CPU a round's
decision and each draw are one C++ call (:mod:`~specray.methods.discrete.cpu_rounds`, the same values), and so are a
round's positions, uniforms and draft calls' inputs, its verify call's inputs, and its commit while every row takes
part (``cpu_rounds.bookkeeping``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specray import rng
from specray.families import Method, resolve
from specray.methods.common import GenerationResult, RoundTally, SampleStats, bind_conditions
from specray.methods.discrete import cpu_rounds
from specray.methods.discrete.params import Sampling, Speculative
from specray.methods.discrete.processing import model_softmax, process_with
from specray.methods.discrete.rules import Verifier
from specray.models import buffer_reuse
from specray.models.discrete_ar import DiscreteGPT
from specray.models.pair import ModelPair
from specray.models.tokenizers import to_images

FAMILY = "discrete_ar"
# A call for at least this share of the batch's samples runs on every row (see GuidedModel._park_other_rows).
FULL_CALL_FRACTION = 0.5


# ---- guided model streams ------------------------------------------------------------------------


class GuidedModel:
    """A GPT plus its KV cache for ``batch`` samples, returning processed distributions.

    With CFG the cache holds ``2 * batch`` rows: sample ``b``'s cond stream in row ``b``
    and its uncond stream (null class) in row ``batch + b``; both always move together.
    ``few_reads``: few of the stream's calls read its cache (:meth:`DiscreteGPT.new_cache`).
    """

    def __init__(self, model: DiscreteGPT, batch: int, sampling: Sampling, max_len: int,
                 few_reads: bool = False) -> None:
        self.model = model
        self.batch = batch
        self.sampling = sampling
        self.guided = sampling.uses_uncond
        self.cache = model.new_cache(2 * batch if self.guided else batch, max_len, few_reads=few_reads)
        self.all_rows = torch.arange(batch, device=self.cache.lengths.device)
        self.calls = 0
        self.softmax = model_softmax(sampling)  # None: the logits are processed here (process_with)

    def probs(self, idx: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *,
              all_rows: bool = False, prefix: bool | None = None) -> torch.Tensor:
        """Processed distributions ``[r, n, V]`` for samples ``idx`` fed ``tokens`` at sequence ``positions``.

        A token at sequence position 0 is the condition (a class label, or a prompt's row); the uncond
        stream gets the model's null condition there (:meth:`DiscreteGPT.null_prefix`).
        Hints that only skip work (results are identical): ``all_rows`` says ``idx`` is
        ``arange(batch)`` (the caches are then read without a gather copy); ``prefix=False`` says no
        position is 0 (the uncond tokens are then the cond tokens).
        """
        self.calls += 1
        if not all_rows and idx.shape[0] >= FULL_CALL_FRACTION * self.batch:
            all_tokens, all_positions = self._park_other_rows(idx, tokens, positions)
            return self.forward(self.all_rows, all_tokens, all_positions, all_rows=True, prefix=prefix)[idx]
        return self.forward(idx, tokens, positions, all_rows=all_rows, prefix=prefix)

    def forward(self, idx: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *,
                all_rows: bool, prefix: bool | None) -> torch.Tensor:
        """One model call on the rows of the samples ``idx`` (all rows, read in place, if ``all_rows``)."""
        if not self.guided:
            out = self.model.forward_step(tokens, positions, self.cache, rows=None if all_rows else idx,
                                          prefix=prefix, softmax=self.softmax)
        else:
            if prefix is False:
                uncond_tokens = tokens
            else:
                uncond_tokens = torch.where(positions == 0, self.model.null_prefix(tokens), tokens)
            out = self.model.forward_step(
                torch.cat([tokens, uncond_tokens]), torch.cat([positions, positions]), self.cache,
                rows=None if all_rows else torch.cat([idx, idx + self.batch]), prefix=prefix, softmax=self.softmax,
            )
        if self.softmax is not None:  # the probabilities, made by the call
            return out
        if not self.guided:
            return process_with(self.sampling, out, None)
        r = idx.shape[0]
        return process_with(self.sampling, out[:r], out[r:], positions)  # position p predicts token p

    def _park_other_rows(self, idx: torch.Tensor, tokens: torch.Tensor,
                         positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs for every row of the batch: ``tokens``/``positions`` at the samples ``idx``, the others parked.

        Reading a subset of rows copies their caches (every layer's K and V), which costs more than
        the idle rows' compute once most rows take part; the outputs of ``idx`` are the same bit for
        bit (every op is row-wise). A parked row is fed token 0 at the ``n`` slots from its cache length
        on, or at the cache's last ``n`` slots where those would pass its end: slots at or past a row's
        length are rewritten before any query reads them, and only a finished row comes that close to
        the end (a row with tokens left has room for its next call), whose cache is never read again.
        Consecutive slots on every row let the call write its K/V as blocks
        (:func:`~specray.models.discrete_ar.cache_write_index`).
        """
        n = tokens.shape[1]
        starts = self.cache.lengths[: self.batch, None].clamp(max=self.cache.max_len - n)
        all_positions = starts + torch.arange(n, device=idx.device)
        all_positions[idx] = positions
        all_tokens = torch.zeros(self.batch, n, dtype=tokens.dtype, device=tokens.device)
        all_tokens[idx] = tokens
        return all_tokens, all_positions

    def crop(self, idx: torch.Tensor, lengths: torch.Tensor, *, all_rows: bool = False) -> None:
        if all_rows:  # idx is arange(batch): one copy instead of indexed writes
            if self.guided:  # both CFG halves at once: a broadcast copy into the [2, batch] view
                self.cache.lengths.view(2, self.batch).copy_(lengths)
            else:
                self.cache.crop(lengths)
            return
        self.cache.crop(lengths, idx)
        if self.guided:
            self.cache.crop(lengths, idx + self.batch)


class RoundUniforms:
    """The speculative loop's uniforms, ``rng.uniform`` of streams "draft", "accept", "residual".

    Every active row's round index equals the loop iteration (all rows start together and a row
    leaves only when done), so the keys of a round are (sample, position, iteration): the same values
    as one ``rng.uniform`` call per key (the hash is elementwise), made one of two ways.

    - On a CPU with specray's kernels, a round hashes only the keys it uses, in the plan's call
      (``chain_plan``) or one ``round_uniforms`` call, from each sample's three stream hashes made once
      (``hashes [B, 3]``): 9 a row in a round of gamma 4 (12 in a tail round's call).
    - Elsewhere (a GPU, the kernels off), by torch's operations for every sample and position, a chunk
      of rounds at a time (:meth:`slab`): one pass of the hash's operations for many rounds, the
      elements a round does not read costing less than a pass each round would.
    """

    STREAMS = ("draft", "accept", "residual")

    def __init__(self, seed: int, sample_ids: torch.Tensor, num_positions: int) -> None:
        self.seed = seed
        self.sample_ids = sample_ids
        self.hashes = self.stream_hashes(seed, sample_ids)
        self.positions = torch.arange(num_positions, device=sample_ids.device)
        # Per-call overhead dominates small batches, element cost large ones.
        self.chunk = max(8, min(64, 256 // max(1, sample_ids.shape[0])))
        self.chunks: list[torch.Tensor] = []  # [B, positions, chunk, 3] float64

    @classmethod
    def stream_hashes(cls, seed: int, sample_ids: torch.Tensor) -> torch.Tensor:
        """``rng.stream_hash`` of each sample and stream ``[B, 3]``: what a round's keys start from."""
        return rng.stream_hashes(seed, sample_ids, cls.STREAMS)

    def slab(self, step: int) -> torch.Tensor:
        """Every sample's uniforms ``[B, positions, 3]`` in round ``step`` (a view), by torch's operations."""
        while len(self.chunks) <= step // self.chunk:
            start = len(self.chunks) * self.chunk
            steps = torch.arange(start, start + self.chunk, device=self.positions.device)
            self.chunks.append(rng.uniform_streams(self.seed, self.sample_ids[:, None, None], self.STREAMS,
                                                   position=self.positions[None, :, None], step=steps[None, None, :]))
        return self.chunks[step // self.chunk][:, :, step % self.chunk]

    def round(self, step: int, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Uniforms ``[r, k, 3]`` of rows ``idx`` at ``positions [r, k]`` (each < ``num_positions``) in round ``step``."""
        kernels = cpu_rounds.bookkeeping(positions.device)
        if kernels is not None:
            u = kernels.round_uniforms(self.hashes, idx, positions, step)
            if u is not None:
                return u
        slab = self.slab(step)
        rows = slab if idx.shape[0] == slab.shape[0] else slab[idx]  # full batch: idx is arange
        return torch.gather(rows, 1, positions[:, :, None].expand(-1, -1, 3))


def sequence_tokens(labels: torch.Tensor, image_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token fed at each sequence position: the label at 0, image token ``p - 1`` at ``p >= 1``.

    ``labels [r]``, ``image_tokens [r, >= max(positions)]``, ``positions [r, n]``.
    """
    image = torch.gather(image_tokens, 1, (positions - 1).clamp(min=0))
    return torch.where(positions == 0, labels[:, None].expand_as(positions), image)


# ---- loops -------------------------------------------------------------------------------------


def _target_only(pair: ModelPair, sampling: Sampling, labels: torch.Tensor, sample_ids: torch.Tensor,
                 seed: int) -> tuple[torch.Tensor, RoundTally]:
    target: DiscreteGPT = pair.target
    num_tokens = target.config.num_image_tokens
    batch = labels.shape[0]
    device = labels.device
    stream = GuidedModel(target, batch, sampling, target.max_seq_len)
    idx = torch.arange(batch, device=device)
    tokens = torch.zeros(batch, num_tokens, dtype=torch.int64, device=device)
    # All of the run's uniforms in one call: the same keys as rng.categorical(.., position=t) per step.
    u = rng.uniform(seed, sample_ids[:, None], "target", position=torch.arange(num_tokens, device=device)[None, :])
    fed = labels[:, None]
    draw = cpu_rounds.bound_draw(target.config.vocab_size, device)
    for t in range(num_tokens):
        positions = torch.full((batch, 1), t, dtype=torch.int64, device=device)
        probs = stream.probs(idx, fed, positions, all_rows=True, prefix=t == 0)[:, 0]
        tokens[:, t] = draw(probs, u[:, t])
        fed = tokens[:, t : t + 1]
    tally = RoundTally(batch, 0, num_tokens)
    tally.add_calls(None, target=num_tokens)
    return tokens, tally


@dataclass
class _Round:
    """The rows that take part in one round, and where each of them stands.

    ``full``: every row of the batch takes part (``idx`` is ``arange(batch)``; tensors are the
    batch's own, updated in place). ``lengths``: the rows' draft lengths g_b on the host, the
    one sync a round needs to choose its control flow.
    """

    idx: torch.Tensor
    full: bool
    n: torch.Tensor  # committed image tokens per row
    n_drafts: torch.Tensor  # g_b = min(gamma, N - 1 - n_b)
    lengths: list[int]
    labels: torch.Tensor
    tokens: torch.Tensor  # the rows' token buffer (a copy unless full)
    positions: torch.Tensor  # [r, gamma + 1]: image-token index of each draft = sequence position fed in verify
    fed_positions: torch.Tensor  # positions - 1: image-token index of the token fed at each of them
    top: int  # the rows' largest committed length (the largest of positions is top + gamma), on the host
    # The draft calls' inputs where the plan's kernel made them (cpu_rounds.bookkeeping's chain_plan): the first call's
    # positions and tokens (None in round 0), the later calls' positions and the draft uniforms, by column.
    draft_inputs: tuple | None = None


# A round's drafts and their laws: [r, gamma] and [r, gamma, V], or the common round's columns [r, 1] and [r, V].
Drafted = tuple[torch.Tensor, torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]


@functools.lru_cache(maxsize=16)
def _filled(value: int, n: int, device: torch.device) -> torch.Tensor:
    """``full((n,), value)`` int64, built once; read-only."""
    return torch.full((n,), value, dtype=torch.int64, device=device)


def _next_round(committed: torch.Tensor, num_tokens: int, gamma: int, labels: torch.Tensor, tokens: torch.Tensor,
                all_rows: torch.Tensor, steps: torch.Tensor, uniforms: RoundUniforms, step: int,
                draft_inputs: bool = True) -> tuple[_Round, tuple[torch.Tensor, ...]] | None:
    """Round ``step``'s rows and where they stand, and their uniforms: draft and accept ``[r, gamma]``, residual
    ``[r]`` (:class:`RoundUniforms`); None once every row is done. ``draft_inputs``: the round's draft GPT calls'
    inputs too, where the plan's kernel makes them (the EAGLE head's chain builds its own)."""
    room = [num_tokens - 1 - c for c in committed.tolist()]  # the round's one host sync
    active_room = [g for g in room if g >= 0]
    if not active_room:
        return None
    lengths = [min(g, gamma) for g in active_room]
    top = num_tokens - 1 - min(active_room)
    # g_b = min(gamma, N - 1 - n_b), negative once a row is done; while every row drafts gamma, a
    # cached constant (read-only) instead of two ops.
    n_drafts = (_filled(gamma, len(room), committed.device) if min(room) >= gamma else
                (num_tokens - 1 - committed).clamp(max=gamma))
    if len(lengths) == committed.shape[0]:
        kernels = cpu_rounds.bookkeeping(committed.device)
        planned = None if kernels is None else kernels.chain_plan(committed, gamma, uniforms.hashes, step,
                                                                  tokens if draft_inputs else None)
        if planned is not None and planned[0] is not None:  # one call, the same values
            positions, fed_positions, u_draft, u_accept, u_residual, *made = planned
            rnd = _Round(all_rows, True, committed, n_drafts, lengths, labels, tokens, positions, fed_positions, top,
                         tuple(made) if draft_inputs else None)
            return rnd, (u_draft, u_accept, u_residual)
        rnd = _Round(all_rows, True, committed, n_drafts, lengths, labels, tokens, committed[:, None] + steps, None, top)
    else:
        idx = torch.nonzero(n_drafts >= 0).squeeze(1)
        n = committed[idx]
        rnd = _Round(idx, False, n, n_drafts[idx], lengths, labels[idx], tokens[idx], n[:, None] + steps, None, top)
    rnd.fed_positions = rnd.positions - 1
    u = uniforms.round(step, rnd.idx, rnd.positions[:, :gamma])  # [r, gamma, (draft, accept, residual)]
    return rnd, (u[:, :, 0], u[:, :, 1], u[:, 0, 2])


def _draft(stream: GuidedModel, rnd: _Round, u_draft: torch.Tensor, first_round: bool, gamma: int,
           vocab: int, draws: tuple[Callable, Callable]) -> Drafted:
    """1. DRAFT: ``g_b`` tokens per row (rows with ``g_b <= i`` sit out step i); drafts and their laws Q (the
    common round's as columns, :func:`_draft_every_row`). ``draws``:
    :func:`~specray.methods.discrete.cpu_rounds.bound_draw`'s flat and column draws for the draft's laws."""
    g_min = min(rnd.lengths)
    draw, draw_column = draws
    if g_min == gamma:
        return _draft_every_row(stream, rnd, u_draft, first_round, gamma, draw_column)
    r = rnd.idx.shape[0]
    device = rnd.idx.device
    drafts = torch.zeros(r, gamma, dtype=torch.int64, device=device)
    Q = torch.zeros(r, gamma, vocab, dtype=torch.float32, device=device)
    for i in range(max(rnd.lengths)):
        every = i < g_min  # while every row drafts, no live-row indexing
        live = None if every else torch.nonzero(rnd.n_drafts > i).squeeze(1)
        if i == 0:
            # Catch up what the previous round committed: feed sequence positions [n - 1, n]. From
            # round 1 on both hold image tokens (n >= 2), so there is no class label to place.
            positions = rnd.fed_positions[:, :2] if every else rnd.fed_positions[live, :2]
            row_tokens = rnd.tokens if every else rnd.tokens[live]
            fed = (sequence_tokens(rnd.labels if every else rnd.labels[live], row_tokens, positions)
                   if first_round else row_tokens.gather(1, positions - 1))
        else:
            positions = rnd.positions[:, i : i + 1] if every else rnd.positions[live, i : i + 1]
            fed = drafts[:, i - 1 : i] if every else drafts[live, i - 1 : i]
        q = stream.probs(rnd.idx if every else rnd.idx[live], fed, positions,
                         all_rows=rnd.full and every, prefix=first_round and i == 0)[:, -1]
        if every:
            Q[:, i] = q
            drafts[:, i] = draw(q, u_draft[:, i])
        else:
            Q[live, i] = q
            drafts[live, i] = draw(q, u_draft[live, i])
    return drafts, Q


def _draft_every_row(stream: GuidedModel, rnd: _Round, u_draft: torch.Tensor, first_round: bool,
                     gamma: int, draw_column: Callable) -> Drafted:
    """:func:`_draft` for the common round, every row drafting ``gamma`` tokens: the same calls and
    draws, with the per-step columns split off once (by the plan's kernel where it made them); the drafts
    ``[r, 1]`` and laws ``[r, V]`` as lists of columns, stacked with the verify call's inputs
    (:func:`_verify_inputs`)."""
    made = rnd.draft_inputs
    if made is not None and made[1] is not None and not first_round:  # one call made them all (chain_plan)
        positions, fed, later_positions, u_columns = made
    else:
        positions = rnd.fed_positions[:, :2]  # step 0 catches up sequence positions [n - 1, n] (see _draft)
        if first_round:
            fed = sequence_tokens(rnd.labels, rnd.tokens, positions)
        else:
            fed = rnd.tokens.gather(1, positions - 1)
        later_positions = rnd.positions[:, 1:gamma, None].unbind(1)  # [r, 1] columns, one op (split costs more)
        u_columns = u_draft[:, :, None].unbind(1)
    qs, ds = [], []
    for i, u in enumerate(u_columns):
        if i > 0:
            positions, fed = later_positions[i - 1], ds[-1]
        q = stream.probs(rnd.idx, fed, positions, all_rows=rnd.full, prefix=first_round and i == 0)[:, -1]
        qs.append(q)
        ds.append(draw_column(q, u))  # [r, 1]: the next step's fed column
    return ds, qs


def _verify_inputs(rnd: _Round, drafts: torch.Tensor | list[torch.Tensor], Q: torch.Tensor | list[torch.Tensor],
                   gamma: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """2. VERIFY's inputs: the drafts ``[r, gamma]``, their laws ``[r, gamma, V]`` (from :func:`_draft`'s columns where
    it gave them) and the tokens of the target call on ``[last committed token, d_1 .. d_gamma]`` at positions
    ``n .. n + gamma``; a full round's in one call on a CPU (``chain_verify_inputs``, the same operations).

    The drafts are written into the token buffer first: positions past the committed length are
    scratch (never read before a later round commits them), so accepted drafts need no copy.
    """
    if isinstance(drafts, list):
        kernels = cpu_rounds.bookkeeping(rnd.tokens.device) if rnd.full else None
        made = None if kernels is None else kernels.chain_verify_inputs(drafts, Q, rnd.tokens, rnd.positions,
                                                                        rnd.fed_positions)
        if made is not None and made[0] is not None:
            return made
        drafts, Q = torch.cat(drafts, dim=1), torch.stack(Q, dim=1)
    rnd.tokens.scatter_(1, rnd.positions[:, :gamma], drafts)
    return drafts, Q, rnd.tokens.gather(1, rnd.fed_positions)


def _decide(verifier: Verifier, rnd: _Round, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
            u_accept: torch.Tensor, u_residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """3. DECIDE: accepted drafts and the next token per row; rows grouped by ``g_b``."""
    groups = sorted(set(rnd.lengths))
    gamma = drafts.shape[1]
    if len(groups) == 1 and groups[0] > 0:  # one group: no row indexing (no slicing at all when g = gamma)
        g = groups[0]
        out = (verifier(P, Q, drafts, u_accept, u_residual) if g == gamma else
               verifier(P[:, : g + 1], Q[:, :g], drafts[:, :g], u_accept[:, :g], u_residual))
        return out.n_accepted, out.next_token
    n_acc = torch.zeros_like(rnd.n)
    next_token = torch.zeros_like(rnd.n)
    for g in groups:
        rows = torch.nonzero(rnd.n_drafts == g).squeeze(1)
        if g == 0:  # only the last image token is left: plain target sampling
            next_token[rows] = cpu_rounds.sample_categorical(P[rows, 0], u_residual[rows])
            continue
        out = verifier(P[rows, : g + 1], Q[rows, :g], drafts[rows, :g], u_accept[rows, :g], u_residual[rows])
        n_acc[rows] = out.n_accepted
        next_token[rows] = out.next_token
    return n_acc, next_token


def _commit(rnd: _Round, n_acc: torch.Tensor, next_token: torch.Tensor, tokens: torch.Tensor,
            committed: torch.Tensor, target_stream: GuidedModel, draft_stream: GuidedModel) -> None:
    """4. COMMIT: the accepted drafts are in place; the correction / bonus token follows them."""
    kernels = cpu_rounds.bookkeeping(committed.device) if rnd.full else None
    if kernels is not None and kernels.chain_commit(rnd.tokens, committed, target_stream.cache.lengths,
                                                    draft_stream.cache.lengths, n_acc, next_token, rnd.n_drafts):
        return  # one call, the same writes
    last = rnd.n + n_acc
    if rnd.full:  # rnd.idx is arange(batch): one index_put, no reshaping
        rnd.tokens[rnd.idx, last] = next_token
    else:
        rnd.tokens.scatter_(1, last[:, None], next_token[:, None])
    if not rnd.full:
        tokens[rnd.idx] = rnd.tokens
    new_n = last + 1
    target_stream.crop(rnd.idx, new_n, all_rows=rnd.full)  # sequence positions 0 .. n + n_acc hold committed K/V
    draft_stream.crop(rnd.idx, torch.minimum(new_n, rnd.n + rnd.n_drafts), all_rows=rnd.full)
    if rnd.full:
        committed.copy_(new_n)
    else:
        committed[rnd.idx] = new_n


def _speculative(verifier: Verifier, params: Speculative, pair: ModelPair, labels: torch.Tensor,
                 sample_ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, RoundTally]:
    target: DiscreteGPT = pair.target
    gamma = params.gamma
    num_tokens = target.config.num_image_tokens
    batch = labels.shape[0]
    device = labels.device
    max_len = target.max_seq_len + gamma + 1  # room for a row's padded last verify
    # One verify call a round reads the target's cache (DiscreteGPT.new_cache's few_reads).
    target_stream = GuidedModel(target, batch, params, max_len, few_reads=True)
    draft_stream = GuidedModel(pair.draft, batch, params, max_len)
    tokens = torch.zeros(batch, num_tokens + gamma + 1, dtype=torch.int64, device=device)
    committed = torch.ones(batch, dtype=torch.int64, device=device)  # n_b after the prefill
    tally = RoundTally(batch, gamma, num_tokens, device)
    # Positions up to num_tokens + gamma: a round's padded tail positions (never read) need no clamp.
    uniforms = RoundUniforms(seed, sample_ids, num_tokens + gamma + 1)
    all_rows = torch.arange(batch, device=device)
    steps = torch.arange(gamma + 1, device=device)
    vocab = target.config.vocab_size
    draws = cpu_rounds.bound_draw(vocab, device), cpu_rounds.bound_draw(vocab, device, keepdim=True)

    # 0. PREFILL: the first image token from the target, keyed exactly like target_only's.
    zero = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    probs0 = target_stream.probs(all_rows, labels[:, None], zero, all_rows=True, prefix=True)[:, 0]
    # rng.categorical's keys and tokens, drawn by the bound kernel where it serves
    tokens[:, 0] = draws[0](probs0, rng.uniform(seed, sample_ids, "target", position=0, device=device))
    tally.add_calls(None, target=1)

    # Every active row is in round `it` (see RoundUniforms).
    for it in range(num_tokens):
        planned = _next_round(committed, num_tokens, gamma, labels, tokens, all_rows, steps, uniforms, it)
        if planned is None:
            break
        rnd, (u_draft, u_accept, u_residual) = planned
        drafts, Q = _draft(draft_stream, rnd, u_draft, it == 0, gamma, vocab, draws)
        drafts, Q, fed = _verify_inputs(rnd, drafts, Q, gamma)
        P = target_stream.probs(rnd.idx, fed, rnd.positions, all_rows=rnd.full, prefix=False)
        n_acc, next_token = _decide(verifier, rnd, P, Q, drafts, u_accept, u_residual)
        _commit(rnd, n_acc, next_token, tokens, committed, target_stream, draft_stream)
        tally.observe_prefix(None if rnd.full else rnd.idx, rnd.positions, rnd.n_drafts, n_acc)  # slot gamma: never drafted
    tally.flush()
    tally.add_calls(None, target=tally.rounds, draft=tally.drafted)  # one verify call per round, one draft call per draft
    return tokens[:, :num_tokens], tally


@contextlib.contextmanager
def generation_context() -> Iterator[None]:
    """What the loops run in: no autograd, and the caches reusing the last run's memory (a benchmark that makes a
    loop's model calls again makes them in it too)."""
    with torch.inference_mode(), buffer_reuse.reusing():
        yield


def generate_tokens(method: str | Method, params: Any, pair: ModelPair, labels: torch.Tensor,
                    sample_ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[SampleStats]]:
    """Image tokens ``[B, N]`` and per-sample statistics (``method``/``params`` as in :func:`run_batch`)."""
    method, params = resolve(FAMILY, method, params)
    device = pair.device
    labels = bind_conditions(labels, pair).to(device=device, dtype=torch.int64)
    sample_ids = sample_ids.to(device=device, dtype=torch.int64)
    num_classes = pair.target.config.num_classes
    if labels.dim() != 1 or sample_ids.shape != labels.shape:
        raise ValueError(f"labels and sample_ids must be 1-D of equal length, got {tuple(labels.shape)} and {tuple(sample_ids.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"class labels must be in [0, {num_classes - 1}], got range [{int(labels.min())}, {int(labels.max())}]")
    with generation_context():
        if isinstance(params, Speculative):
            if pair.draft is None:
                raise ValueError(f"method {method.name!r} needs a draft model; the pair has none")
            if method.rule is None:
                raise ValueError(f"method {method.name!r} names no verification rule in the family table")
            if params.tree is not None or pair.info.get("draft_kind") == "eagle_head":
                from specray.methods.discrete.eagle_loop import head_speculative

                tokens, tally = head_speculative(method, params, pair, labels, sample_ids, seed)
            else:
                verifier = method.rule()(params, pair)
                tokens, tally = _speculative(verifier, params, pair, labels, sample_ids, seed)
        else:
            tokens, tally = _target_only(pair, params, labels, sample_ids, seed)
    num_tokens = pair.target.config.num_image_tokens
    return tokens, tally.to_stats(num_tokens, timeline=isinstance(params, Speculative))


def run_batch(method: str | Method, params: Any, pair: ModelPair, labels: torch.Tensor,
              sample_ids: torch.Tensor, seed: int) -> GenerationResult:
    """Generate one batch; images uint8 on CPU (``[B, 8, 8]`` for the presets, ``[B, S, S, 3]`` for a
    release). ``method``/``params`` as names and a mapping, or as the family table's entry and typed parameters."""
    tokens, stats = generate_tokens(method, params, pair, labels, sample_ids, seed)
    decode = pair.info.get("image_decoder")  # a release's VQ decoder; the presets' tokens are pixels
    images = decode(tokens) if decode is not None else to_images(tokens, pair.target.config.grid_size)
    return GenerationResult(images=images, stats=stats)
