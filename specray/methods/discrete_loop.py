"""Decoding loops of the discrete family: target-only, and draft -> verify -> commit (spec discrete_sd §5).

Rows are ragged (spec §5.3): every sample keeps its own number of committed
image tokens ``n_b``; caches are written at per-row positions and rows that are
done drop out of the calls (compaction by index, the caches stay in place).

One round for the active rows:

1. DRAFT: ``g_b = min(gamma, N - 1 - n_b)`` drafts per row (never past the last
   image token), the draft running its own cond and uncond streams; the first
   draft step re-feeds sequence positions ``n_b - 1, n_b`` so it catches up
   whatever the previous round committed.
2. VERIFY: one target call on ``[last committed token, d_1 .. d_gamma]`` for both
   CFG halves (padded past ``g_b``; those outputs are ignored).
3. DECIDE: :func:`specray.methods.discrete_rules.verify` on the first ``g_b``
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
of the output): the uniforms of a run come from a few large ``rng.uniform`` calls
(:class:`RoundUniforms`, target_only's in one call) instead of one call per step and stream;
while every row is active (``full``) the caches are read without a gather copy and rows are
updated in place; the common round (every row drafts gamma tokens) skips the per-step live-row
indexing and verifies in one group; counters stay on the device and are moved once; the host
syncs are two per round (draft-length range, and the active rows only once some are done).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from specray import rng
from specray.methods.discrete_rules import RuleParams, verify
from specray.methods.processing import SamplingParams, process_with
from specray.methods.result import GenerationResult
from specray.methods.stats import SampleStats
from specray.models.discrete_ar import DiscreteGPT
from specray.models.pair import ModelPair
from specray.models.tokenizers import to_images

_SAMPLING_DEFAULTS: dict[str, Any] = {"cfg_scale": 1.5, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
_SPECULATIVE = {"gamma": 4}

METHODS: dict[str, dict[str, Any]] = {
    "target_only": {**_SAMPLING_DEFAULTS},
    "sd": {**_SAMPLING_DEFAULTS, **_SPECULATIVE},
    "block": {**_SAMPLING_DEFAULTS, **_SPECULATIVE},
    "lantern": {
        **_SAMPLING_DEFAULTS,
        **_SPECULATIVE,
        "k": 5,
        "lam": 2.0,
        "delta": None,
        "mode": "lambda",
        "residual": "gstar",
        "forbid_zero_target_mass": False,
        "normalize_embeddings": True,
    },
    "cool_sd": {**_SAMPLING_DEFAULTS, **_SPECULATIVE, "delta": 1.1, "nu": 0.7, "mu": None},
    "uniform_rsd": {**_SAMPLING_DEFAULTS, **_SPECULATIVE, "delta": 1.1},
}

# ---- parameters ------------------------------------------------------------------------------


def _number(method: str, name: str, value: Any, *, integer: bool = False, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and int(value) != value):
        raise ValueError(f"{method}: parameter {name!r} must be {kind}{' or null' if allow_none else ''}, got {value!r}")
    return int(value) if integer else float(value)


def resolve_params(method: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults of ``method`` merged with ``params``, validated."""
    if method not in METHODS:
        raise ValueError(f"unknown discrete_ar method {method!r}; allowed: {', '.join(METHODS)}")
    params = dict(params or {})
    defaults = METHODS[method]
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(f"{method}: unknown parameter(s) {unknown}; allowed: {sorted(defaults)}")
    out = {**copy.deepcopy(defaults), **params}
    out["cfg_scale"] = _number(method, "cfg_scale", out["cfg_scale"])
    out["temperature"] = _number(method, "temperature", out["temperature"])
    out["top_k"] = _number(method, "top_k", out["top_k"], integer=True)
    out["top_p"] = _number(method, "top_p", out["top_p"])
    try:
        SamplingParams(out["cfg_scale"], out["temperature"], out["top_k"], out["top_p"])
    except ValueError as err:
        raise ValueError(f"{method}: {err}") from None
    if method == "target_only":
        return out
    out["gamma"] = _number(method, "gamma", out["gamma"], integer=True)
    if not 1 <= out["gamma"] <= 32:
        raise ValueError(f"{method}: parameter 'gamma' must be an integer in [1, 32], got {out['gamma']}")
    if method == "lantern":
        out["k"] = _number(method, "k", out["k"], integer=True)
        out["lam"] = _number(method, "lam", out["lam"], allow_none=True)
        out["delta"] = _number(method, "delta", out["delta"], allow_none=True)
        if out["mode"] not in ("lambda", "delta"):
            raise ValueError(f"{method}: parameter 'mode' must be one of 'lambda', 'delta', got {out['mode']!r}")
        if out["residual"] not in ("gstar", "official"):
            raise ValueError(f"{method}: parameter 'residual' must be one of 'gstar', 'official', got {out['residual']!r}")
        for flag in ("forbid_zero_target_mass", "normalize_embeddings"):
            if not isinstance(out[flag], bool):
                raise ValueError(f"{method}: parameter {flag!r} must be true or false, got {out[flag]!r}")
    if method in ("cool_sd", "uniform_rsd"):
        out["delta"] = _number(method, "delta", out["delta"])
    if method == "cool_sd":
        out["nu"] = _number(method, "nu", out["nu"])
        out["mu"] = _number(method, "mu", out["mu"], allow_none=True)
    try:
        _rule_params(method, out, vocab_size=None)
    except ValueError as err:
        raise ValueError(f"{method}: {err}") from None
    return out


def _sampling(params: dict[str, Any]) -> SamplingParams:
    return SamplingParams(params["cfg_scale"], params["temperature"], params["top_k"], params["top_p"])


def _rule_params(method: str, params: dict[str, Any], vocab_size: int | None,
                 embeddings: torch.Tensor | None = None) -> RuleParams:
    """RuleParams for ``verify`` (neighbour table built when embeddings are given)."""
    from specray.methods.discrete_rules import validate_params

    rule_params = RuleParams()
    if method == "lantern":
        rule_params = RuleParams(
            k=params["k"], lam=params["lam"], delta=params["delta"], mode=params["mode"],
            residual=params["residual"], forbid_zero_target_mass=params["forbid_zero_target_mass"],
        )
        if vocab_size is not None and not 0 <= params["k"] <= vocab_size - 1:
            raise ValueError(f"parameter 'k' must be in [0, {vocab_size - 1}] (vocabulary {vocab_size}), got {params['k']}")
        if embeddings is not None and params["k"] > 0:
            from specray.methods.lantern import neighbours_from_embeddings

            rule_params.neighbours = neighbours_from_embeddings(
                embeddings.float(), params["k"], normalize=params["normalize_embeddings"]
            )
    elif method == "cool_sd":
        mu = params["mu"]
        if mu is None:  # fix the mean-normalised mu of the full round (module docstring)
            positions = torch.arange(1, params["gamma"] + 1, dtype=torch.float64)
            mu = math.log(torch.exp(-params["nu"] * positions).mean().item())
        rule_params = RuleParams(delta=params["delta"], nu=params["nu"], mu=mu)
    elif method == "uniform_rsd":
        rule_params = RuleParams(delta=params["delta"])
    if method in ("sd", "block", "lantern", "cool_sd", "uniform_rsd"):
        validate_params(method, rule_params)
    return rule_params


# ---- guided model streams ------------------------------------------------------------------------


class GuidedModel:
    """A GPT plus its KV cache for ``batch`` samples, returning processed distributions.

    With CFG the cache holds ``2 * batch`` rows: sample ``b``'s cond stream in row ``b``
    and its uncond stream (null class) in row ``batch + b``; both always move together.
    """

    def __init__(self, model: DiscreteGPT, batch: int, sampling: SamplingParams, max_len: int) -> None:
        self.model = model
        self.batch = batch
        self.sampling = sampling
        self.guided = sampling.uses_uncond
        self.cache = model.new_cache(2 * batch if self.guided else batch, max_len)
        self.calls = 0

    def probs(self, idx: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, *,
              all_rows: bool = False, prefix: bool | None = None) -> torch.Tensor:
        """Processed distributions ``[r, n, V]`` for samples ``idx`` fed ``tokens`` at sequence ``positions``.

        A token at sequence position 0 is the class label; the uncond stream gets the null class there.
        Hints that only skip work (results are identical): ``all_rows`` says ``idx`` is
        ``arange(batch)`` (the caches are then read without a gather copy); ``prefix=False`` says no
        position is 0 (the uncond tokens are then the cond tokens).
        """
        self.calls += 1
        if not self.guided:
            logits = self.model.forward_step(tokens, positions, self.cache, rows=None if all_rows else idx,
                                             prefix=prefix)
            return process_with(self.sampling, logits, None)
        if prefix is False:
            uncond_tokens = tokens
        else:
            null = torch.full_like(tokens, self.model.null_class)
            uncond_tokens = torch.where(positions == 0, null, tokens)
        logits = self.model.forward_step(
            torch.cat([tokens, uncond_tokens]), torch.cat([positions, positions]), self.cache,
            rows=None if all_rows else torch.cat([idx, idx + self.batch]), prefix=prefix,
        )
        r = idx.shape[0]
        return process_with(self.sampling, logits[:r], logits[r:])

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
    leaves only when done), so the keys of a round are (sample, position, iteration). They are
    computed for all samples and positions, a chunk of rounds at a time: the same values as one
    ``rng.uniform`` call per key (the hash is elementwise), without a call per round and stream.
    """

    STREAMS = ("draft", "accept", "residual")

    def __init__(self, seed: int, sample_ids: torch.Tensor, num_positions: int) -> None:
        self.seed = seed
        self.sample_ids = sample_ids
        self.positions = torch.arange(num_positions, device=sample_ids.device)
        # Per-call overhead dominates small batches, element cost large ones.
        self.chunk = max(8, min(64, 256 // max(1, sample_ids.shape[0])))
        self.chunks: list[torch.Tensor] = []  # [B, positions, chunk, 3] float64

    def round(self, step: int, idx: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Uniforms ``[r, k, 3]`` of rows ``idx`` at ``positions [r, k]`` (each < ``num_positions``) in round ``step``."""
        while len(self.chunks) <= step // self.chunk:
            start = len(self.chunks) * self.chunk
            steps = torch.arange(start, start + self.chunk, device=self.positions.device)
            self.chunks.append(torch.stack([
                rng.uniform(self.seed, self.sample_ids[:, None, None], stream,
                            position=self.positions[None, :, None], step=steps[None, None, :])
                for stream in self.STREAMS
            ], dim=-1))
        slab = self.chunks[step // self.chunk][:, :, step % self.chunk]  # [B, positions, 3]
        rows = slab if idx.shape[0] == slab.shape[0] else slab[idx]  # full batch: idx is arange
        return torch.gather(rows, 1, positions[:, :, None].expand(-1, -1, 3))


def sequence_tokens(labels: torch.Tensor, image_tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Token fed at each sequence position: the label at 0, image token ``p - 1`` at ``p >= 1``.

    ``labels [r]``, ``image_tokens [r, >= max(positions)]``, ``positions [r, n]``.
    """
    image = torch.gather(image_tokens, 1, (positions - 1).clamp(min=0))
    return torch.where(positions == 0, labels[:, None].expand_as(positions), image)


# ---- loops -------------------------------------------------------------------------------------


@dataclass
class _RowCounters:
    rounds: torch.Tensor
    target_calls: torch.Tensor
    draft_calls: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    accepted_per_position: torch.Tensor
    extra: dict[str, Any] = field(default_factory=dict)
    # Drafts made / accepted per image-token index [B, width >= N] (speculative methods only);
    # stored as extra["acceptance_timeline"], the first N columns.
    timeline_drafted: torch.Tensor | None = None
    timeline_accepted: torch.Tensor | None = None

    @classmethod
    def zeros(cls, batch: int, gamma: int, device: torch.device | None = None,
              timeline_width: int = 0) -> "_RowCounters":
        z = lambda: torch.zeros(batch, dtype=torch.int64, device=device)  # noqa: E731
        timeline = (lambda: torch.zeros(batch, timeline_width, dtype=torch.int64, device=device)) if timeline_width \
            else (lambda: None)
        return cls(z(), z(), z(), z(), z(), torch.zeros(batch, max(gamma, 0), dtype=torch.int64, device=device),
                   timeline_drafted=timeline(), timeline_accepted=timeline())

    def add_timeline(self, idx: torch.Tensor, positions: torch.Tensor, n_drafts: torch.Tensor,
                     n_acc: torch.Tensor) -> None:
        """Count one round of rows ``idx``: drafts at image-token ``positions [r, gamma]``, the
        first ``n_drafts`` made and the first ``n_acc`` accepted (two index_adds, no host sync)."""
        width = self.timeline_drafted.shape[1]
        slot = torch.arange(positions.shape[1], device=positions.device)[None, :]
        flat = (idx[:, None] * width + positions).flatten()
        self.timeline_drafted.view(-1).index_add_(0, flat, (slot < n_drafts[:, None]).flatten().long())
        self.timeline_accepted.view(-1).index_add_(0, flat, (slot < n_acc[:, None]).flatten().long())

    def to_stats(self, num_tokens: int) -> list[SampleStats]:
        host = {name: getattr(self, name).cpu() for name in
                ("rounds", "target_calls", "draft_calls", "drafted", "accepted", "accepted_per_position")}
        timelines = None
        if self.timeline_drafted is not None:  # one transfer each; plain lists for the JSON column
            timelines = (self.timeline_drafted[:, :num_tokens].tolist(), self.timeline_accepted[:, :num_tokens].tolist())
        self = _RowCounters(**host, extra=self.extra)  # one transfer per counter, not per sample
        return [
            SampleStats(
                num_tokens=num_tokens,
                num_spec_steps=int(self.rounds[b]),
                num_draft_tokens=int(self.drafted[b]),
                num_accepted_draft_tokens=int(self.accepted[b]),
                accepted_per_position=[int(x) for x in self.accepted_per_position[b]],
                target_calls=int(self.target_calls[b]),
                draft_calls=int(self.draft_calls[b]),
                extra={} if timelines is None else
                {"acceptance_timeline": {"accepted": timelines[1][b], "drafted": timelines[0][b]}},
            )
            for b in range(self.rounds.shape[0])
        ]


def _target_only(pair: ModelPair, sampling: SamplingParams, labels: torch.Tensor, sample_ids: torch.Tensor,
                 seed: int) -> tuple[torch.Tensor, _RowCounters]:
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
    for t in range(num_tokens):
        positions = torch.full((batch, 1), t, dtype=torch.int64, device=device)
        probs = stream.probs(idx, fed, positions, all_rows=True, prefix=t == 0)[:, 0]
        tokens[:, t] = rng.sample_categorical(probs, u[:, t])
        fed = tokens[:, t : t + 1]
    counters = _RowCounters.zeros(batch, 0)
    counters.target_calls += num_tokens
    return tokens, counters


def _speculative(method: str, params: dict[str, Any], pair: ModelPair, labels: torch.Tensor,
                 sample_ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, _RowCounters]:
    if pair.draft is None:
        raise ValueError(f"method {method!r} needs a draft model; the pair has none")
    target: DiscreteGPT = pair.target
    draft: DiscreteGPT = pair.draft
    sampling = _sampling(params)
    gamma = params["gamma"]
    num_tokens = target.config.num_image_tokens
    vocab = target.config.vocab_size
    rule_params = _rule_params(method, params, vocab, pair.info.get("token_embeddings"))
    if rule_params.neighbours is not None:
        rule_params.neighbours = rule_params.neighbours.to(labels.device)
    batch = labels.shape[0]
    device = labels.device
    max_len = target.max_seq_len + gamma + 1  # room for a row's padded last verify
    target_stream = GuidedModel(target, batch, sampling, max_len)
    draft_stream = GuidedModel(draft, batch, sampling, max_len)
    tokens = torch.zeros(batch, num_tokens + gamma + 1, dtype=torch.int64, device=device)
    committed = torch.ones(batch, dtype=torch.int64, device=device)  # n_b after the prefill
    # Timeline columns up to num_tokens + gamma: a round's padded tail positions need no clamp.
    counters = _RowCounters.zeros(batch, gamma, device, timeline_width=num_tokens + gamma + 1)
    # Positions up to num_tokens + gamma: a round's padded tail positions (never read) need no clamp.
    uniforms = RoundUniforms(seed, sample_ids, num_tokens + gamma + 1)

    # First image token from the target prefill, keyed exactly like target_only's.
    all_rows = torch.arange(batch, device=device)
    zero = torch.zeros(batch, 1, dtype=torch.int64, device=device)
    probs0 = target_stream.probs(all_rows, labels[:, None], zero, all_rows=True, prefix=True)[:, 0]
    tokens[:, 0] = rng.categorical(probs0, seed, sample_ids, "target", position=0)
    counters.target_calls += 1
    steps = torch.arange(gamma + 1, device=device)
    full_rounds: list[torch.Tensor] = []  # [(n_drafts, n_acc)] of the rounds with every row active

    # Every active row is in round `it` (see RoundUniforms). Host syncs, which decide the Python
    # control flow: the range of draft lengths per round, plus the active rows once some are done.
    for it in range(num_tokens):
        n_drafts = (num_tokens - 1 - committed).clamp(max=gamma)  # g_b; negative once a row is done
        lengths = n_drafts.tolist()  # one transfer for both bounds
        g_min, g_max = min(lengths), max(lengths)
        if g_max < 0:
            break
        full = g_min >= 0  # every row active: idx == arange(batch), no gathers, in-place updates
        if full:
            idx, r, n = all_rows, batch, committed
        else:
            idx = torch.nonzero(n_drafts >= 0).squeeze(1)
            r, n, n_drafts = idx.shape[0], committed[idx], n_drafts[idx]
            g_min = int(n_drafts.min())
        row_labels = labels if full else labels[idx]
        row_tokens = tokens if full else tokens[idx]
        round_positions = n[:, None] + steps  # image-token index of each draft / sequence position fed in verify
        fed_positions = round_positions - 1  # image-token index of the token fed at each of those positions
        u = uniforms.round(it, idx, round_positions[:, :gamma])  # [r, gamma, (draft, accept, residual)]

        # 1. DRAFT (rows with g_b <= i sit out step i; while none do, no indexing)
        if g_min == gamma:  # the common round: every row drafts gamma tokens
            drafted, draft_dists = [], []
            step_positions = round_positions.split(1, dim=1)  # views, one call for the round
            step_uniforms = u[:, :, 0].unbind(1)
            for i in range(gamma):
                if i == 0:
                    positions = fed_positions[:, :2]  # [n - 1, n]
                    # From round 1 on, n >= 2: both are image tokens (no class label to place).
                    fed = (sequence_tokens(row_labels, row_tokens, positions) if it == 0
                           else row_tokens.gather(1, positions - 1))
                else:
                    positions, fed = step_positions[i], drafted[-1].unsqueeze(1)
                q = draft_stream.probs(idx, fed, positions, all_rows=full, prefix=it == 0 and i == 0)[:, -1]
                draft_dists.append(q)
                drafted.append(rng.sample_categorical(q, step_uniforms[i]))
            drafts, Q = torch.stack(drafted, dim=1), torch.stack(draft_dists, dim=1)
        else:
            drafts = torch.zeros(r, gamma, dtype=torch.int64, device=device)
            Q = torch.zeros(r, gamma, vocab, dtype=torch.float32, device=device)
        for i in range(g_max if g_min < gamma else 0):
            every = i < g_min
            live = None if every else torch.nonzero(n_drafts > i).squeeze(1)
            n_live = n if every else n[live]
            if i == 0:
                positions = torch.stack([n_live - 1, n_live], dim=1)
                fed = sequence_tokens(row_labels if every else row_labels[live],
                                      row_tokens if every else row_tokens[live], positions)
            else:
                positions = round_positions[:, i : i + 1] if every else (n_live + i)[:, None]
                fed = drafts[:, i - 1 : i] if every else drafts[live, i - 1 : i]
            q = draft_stream.probs(idx if every else idx[live], fed, positions,
                                   all_rows=full and every, prefix=it == 0 and i == 0)[:, -1]
            if every:
                Q[:, i] = q
                drafts[:, i] = rng.sample_categorical(q, u[:, i, 0])
            else:
                Q[live, i] = q
                drafts[live, i] = rng.sample_categorical(q, u[live, i, 0])

        # 2. VERIFY: [last committed token, d_1 .. d_gamma] at sequence positions n .. n + gamma.
        # The drafts are written into the token buffer now: positions past the committed length are
        # scratch (never read before a later round commits them), so the accepted ones need no copy.
        row_tokens.scatter_(1, round_positions[:, :gamma], drafts)
        P = target_stream.probs(idx, row_tokens.gather(1, fed_positions), round_positions, all_rows=full, prefix=False)

        # 3. DECIDE (rows grouped by g_b; one group, without indexing, until rows near the end)
        u_accept = u[:, :, 1]
        u_residual = u[:, 0, 2]
        if g_min == g_max == gamma:  # the common round: no slicing
            out = verify(method, P, Q, drafts, u_accept, u_residual, rule_params)
            n_acc, next_token = out.n_accepted, out.next_token
        elif g_min == g_max and g_min > 0:
            out = verify(method, P[:, : g_min + 1], Q[:, :g_min], drafts[:, :g_min], u_accept[:, :g_min],
                         u_residual, rule_params)
            n_acc, next_token = out.n_accepted, out.next_token
        else:
            n_acc = torch.zeros(r, dtype=torch.int64, device=device)
            next_token = torch.zeros(r, dtype=torch.int64, device=device)
            for g in torch.unique(n_drafts).tolist():
                rows = torch.nonzero(n_drafts == g).squeeze(1)
                if g == 0:  # only the last image token is left: plain target sampling
                    next_token[rows] = rng.sample_categorical(P[rows, 0], u_residual[rows])
                    continue
                out = verify(method, P[rows, : g + 1], Q[rows, :g], drafts[rows, :g], u_accept[rows, :g],
                             u_residual[rows], rule_params)
                n_acc[rows] = out.n_accepted
                next_token[rows] = out.next_token

        # 4. COMMIT: the accepted drafts are in place; the correction / bonus token follows them.
        last = n + n_acc
        row_tokens.scatter_(1, last[:, None], next_token[:, None])
        if not full:
            tokens[idx] = row_tokens
        new_n = last + 1
        target_stream.crop(idx, new_n, all_rows=full)  # seq positions 0 .. n + n_acc hold committed K/V
        if g_min == gamma:  # every row drafted gamma: its draft cache holds up to n + gamma
            draft_stream.crop(idx, torch.minimum(new_n, round_positions[:, gamma]), all_rows=full)
        else:
            draft_stream.crop(idx, torch.minimum(new_n, n + n_drafts).clamp(min=n), all_rows=full)
        if full:
            committed.copy_(new_n)
        else:
            committed[idx] = new_n

        counters.add_timeline(idx, round_positions[:, :gamma], n_drafts, n_acc)
        if full:  # summed once after the loop (integer sums: the same counts)
            full_rounds.append(torch.stack([n_drafts, n_acc]))
        else:
            accepted_at = steps[None, :gamma] < n_acc[:, None]
            counters.rounds[idx] += 1
            counters.drafted[idx] += n_drafts
            counters.accepted[idx] += n_acc
            counters.accepted_per_position[idx] += accepted_at.long()
    if full_rounds:
        per_round = torch.stack(full_rounds)  # [rounds, (drafted, accepted), batch]
        counters.rounds += len(full_rounds)
        counters.drafted += per_round[:, 0].sum(0)
        counters.accepted += per_round[:, 1].sum(0)
        counters.accepted_per_position += (steps[None, :gamma, None] < per_round[:, 1, None, :]).sum(0).T
    counters.target_calls += counters.rounds  # one verify call per round (plus the prefill)
    counters.draft_calls += counters.drafted  # one draft call per drafted position
    return tokens[:, :num_tokens], counters


def generate_tokens(method: str, params: dict[str, Any], pair: ModelPair, labels: torch.Tensor,
                    sample_ids: torch.Tensor, seed: int) -> tuple[torch.Tensor, list[SampleStats]]:
    """Image tokens ``[B, N]`` and per-sample statistics (``params`` already resolved)."""
    device = pair.device
    labels = labels.to(device=device, dtype=torch.int64)
    sample_ids = sample_ids.to(device=device, dtype=torch.int64)
    num_classes = pair.target.config.num_classes
    if labels.dim() != 1 or sample_ids.shape != labels.shape:
        raise ValueError(f"labels and sample_ids must be 1-D of equal length, got {tuple(labels.shape)} and {tuple(sample_ids.shape)}")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(f"class labels must be in [0, {num_classes - 1}], got range [{int(labels.min())}, {int(labels.max())}]")
    with torch.inference_mode():
        if method == "target_only":
            tokens, counters = _target_only(pair, _sampling(params), labels, sample_ids, seed)
        else:
            tokens, counters = _speculative(method, params, pair, labels, sample_ids, seed)
    return tokens, counters.to_stats(pair.target.config.num_image_tokens)


def run_batch(method: str, params: dict[str, Any] | None, pair: ModelPair, labels: torch.Tensor,
              sample_ids: torch.Tensor, seed: int) -> GenerationResult:
    """Generate one batch with ``method``; images uint8 ``[B, 8, 8]`` on CPU."""
    resolved = resolve_params(method, params)
    start = time.perf_counter()
    tokens, stats = generate_tokens(method, resolved, pair, labels, sample_ids, seed)
    if pair.device.type == "cuda":
        torch.cuda.synchronize(pair.device)
    images = to_images(tokens, pair.target.config.grid_size)
    return GenerationResult(images=images, stats=stats, batch_wall_time_s=time.perf_counter() - start)
