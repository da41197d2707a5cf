"""Decoding loops of the continuous_ar family: ``target_only`` and ``cspd``.

One token per AR step (MAR with num_iter = L), in MAR's random order or raster
order. Randomness is keyed by (seed, sample_id, stream, position, step) via
``specray.rng`` and indexed by **spatial position**, never by call:

* ``order``: the generation order (stream "order");
* ``x_T`` / ``eps``: the head chain's start and per-step noise of each
  position, ``eps`` step 0 being the final-step noise of exact mode. With
  alignment (default) draft and target read the same arrays; ``no_align``
  gives the draft its own streams ("x_T/draft", "eps/draft");
* ``accept``, ``residual``: CSpD decisions and residual proposals.

CSpD (spec ``shared/spec/cspd.md``): its parameters, the ``mode`` table (paper/code/exact
settings of the spec's conflicts) and the window semantics are documented on
:class:`specray.methods.continuous.params.CSpD`. ``window: mar`` (default, official code) decides
every window token independently against the target's prefix-only prediction and finalises the
whole window (target law = the target emitting the window in one parallel step, §1.4c);
``window: sequential`` (LLM-style, §6.5) stops at the first rejection and emits a bonus token when
all are accepted, which in exact mode reproduces target-only decoding's law.

CFG: scale ``cfg`` with ``cfg_schedule`` constant or linear (w_k = 1 + (w−1)(k+1)/L
for the token emitted at generation step k); each position is drafted and
verified with its own step's w (the code's "last draft step's w for the whole
window" is a bug the spec lists, §9.6).

Bookkeeping: a round moves one thing from the device to the host, the window's accept
decisions (the residual sampler then adds one check per pass of tries, when a token was
rejected); what sets the next calls' shapes (cached tokens per row, the per-row cursor) is
kept on the host, the round tally too, and CSpD's per-row numbers stay on the device (one
slot per row and generation step) until the batch ends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from specray import rng
from specray.families import Method, resolve
from specray.methods.common import GenerationResult, RoundTally, SampleStats, bind_conditions
from specray.methods.continuous.head import ChainOutput, guided_eps_fn, run_chain
from specray.methods.continuous.params import Common, CSpD
from specray.methods.continuous.rules import (
    FIRST_BLOCK,
    KeyedDraws,
    LogRatio,
    ResidualResult,
    accept,
    log_acceptance_ratio,
    residual_sample,
)
from specray.models.continuous_ar import ContentCache, ContinuousAR, tokens_to_uint8
from specray.models.continuous_schedule import DiffusionSchedule
from specray.models.pair import ModelPair

FAMILY = "continuous_ar"


# -- shared randomness -------------------------------------------------------------------------------
@dataclass
class ChainNoise:
    """x_T ``[B, L, d]`` and per-step noise ``[B, L, T, d]``, indexed by spatial position (or, once
    :meth:`in_order`, by generation step)."""

    x_T: torch.Tensor
    eps: torch.Tensor

    @classmethod
    def draw(cls, seed: int, sample_ids: torch.Tensor, num_tokens: int, num_steps: int, dim: int, suffix: str = "") -> "ChainNoise":
        device = sample_ids.device
        pos = torch.arange(num_tokens, device=device)
        x_T = rng.normal(seed, sample_ids[:, None], "x_T" + suffix, pos[None, :], 0, shape=(dim,))
        steps = torch.arange(num_steps, device=device)
        eps = rng.normal(seed, sample_ids[:, None, None], "eps" + suffix, pos[None, :, None], steps[None, None, :], shape=(dim,))
        return cls(x_T=x_T, eps=eps)

    def in_order(self, order: torch.Tensor) -> "ChainNoise":
        """The same noise indexed by generation step: row b's step k holds position ``order[b, k]``'s."""
        rows = torch.arange(order.shape[0], device=order.device)[:, None]
        return ChainNoise(self.x_T[rows, order], self.eps[rows, order])

    def steps(self, first: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise of generation steps ``first .. stop-1`` of every row, flattened to ``[B·m, d]`` and
        ``[B·m, T, d]`` (fresh contiguous copies: the head's matmuls see what a gather would give them)."""
        x_T = self.x_T[:, first:stop].clone(memory_format=torch.contiguous_format)
        eps = self.eps[:, first:stop].clone(memory_format=torch.contiguous_format)
        return x_T.reshape(-1, x_T.shape[-1]), eps.reshape(-1, *eps.shape[2:])

    def at(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise of generation steps ``steps [B, m]`` (one per row and slot), flattened like :meth:`steps`."""
        b, m = steps.shape
        rows = torch.arange(b, device=steps.device)[:, None]
        return self.x_T[rows, steps].reshape(b * m, -1), self.eps[rows, steps].reshape(b * m, *self.eps.shape[2:])


def generation_order(kind: str, seed: int, sample_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    if kind == "raster":
        return torch.arange(num_tokens, device=sample_ids.device).expand(sample_ids.shape[0], num_tokens).clone()
    keys = rng.uniform(seed, sample_ids[:, None], "order", torch.arange(num_tokens, device=sample_ids.device)[None, :])
    return torch.argsort(keys, dim=1)


def cfg_scales(cfg: float, schedule: str, num_tokens: int, device: torch.device) -> torch.Tensor:
    """w per generation step k (one token per step; M_k = L − k − 1 still masked after step k).

    MAR's linear schedule clamps the masked count to at least 1 (``mask_len``), so the last step's
    scale is ``1 + (cfg − 1)(L − 1)/L``, never ``cfg`` itself (spec checkpoints.md).
    """
    k = torch.arange(num_tokens, dtype=torch.float32, device=device)
    if schedule == "linear":
        still_masked = (num_tokens - k - 1).clamp(min=1)
        return 1.0 + (cfg - 1.0) * (num_tokens - still_masked) / num_tokens
    return torch.full((num_tokens,), cfg, dtype=torch.float32, device=device)


# -- one model's side of the loop ------------------------------------------------------------------
class ModelSide:
    """A model with its content cache over the shared token sequence (conditional + null rows under CFG).

    How many tokens each row has cached is mirrored on the host (``cached``, CPU): the loops know
    how many tokens a forward appends without asking the device.
    """

    def __init__(self, model: ContinuousAR, labels: torch.Tensor, use_cfg: bool, extra_slots: int) -> None:
        self.model = model
        self.use_cfg = use_cfg
        self.batch = labels.shape[0]
        self.device = labels.device
        rows = torch.cat([labels, torch.full_like(labels, model.null_class)]) if use_cfg else labels
        # A masked (MAR-style) model has no cache: every forward sees the visible tokens afresh.
        self.masked = getattr(model, "masked_context", False)
        self.row_labels = rows
        self.cache: ContentCache | None = None if self.masked else model.new_cache(rows, extra_slots=extra_slots)
        self.cached = torch.zeros(self.batch, dtype=torch.int64)  # tokens cached per row (slot 0 is the class entry)

    def _dup(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t]) if self.use_cfg else t

    def truncate(self, num_tokens: torch.Tensor) -> None:
        """Keep at most ``num_tokens [B]`` (host) tokens cached per row; later ones are stale."""
        if self.cache is not None:
            self.cached = torch.minimum(self.cached, num_tokens)
            self.cache.truncate(self._dup(self.cached.to(self.device) + 1))

    def _masked_context(self, seq: torch.Tensor, order: torch.Tensor, positions: torch.Tensor,
                        visible: torch.Tensor) -> torch.Tensor:
        """z from a masked model: one forward per distinct visible count across the query slots."""
        uniform = bool((visible == visible[:, :1]).all())  # host
        seq, order, positions, visible = (self._dup(t) for t in (seq, order, positions, visible.to(self.device)))
        if uniform:
            return self.model.context(seq, order, self.row_labels, positions, visible[:, 0])
        return torch.cat([self.model.context(seq, order, self.row_labels, positions[:, j : j + 1], visible[:, j])
                          for j in range(positions.shape[1])], dim=1)

    def context(
        self, seq: torch.Tensor, order: torch.Tensor, upto: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward: append seq[:, cached:upto] as content, then z for spatial ``positions [B, m]``.

        ``upto [B]`` and ``visible [B, m]`` (how many generated tokens each query sees) are host tensors.
        """
        if self.masked:
            z = self._masked_context(seq, order, positions, visible)
            return (z, None) if not self.use_cfg else (z[: self.batch], z[self.batch :])
        need = (upto - self.cached).clamp(min=0)
        n_app = int(need.max())
        if n_app > 0:
            idx = (self.cached[:, None] + torch.arange(n_app)).clamp(max=seq.shape[1] - 1).to(self.device)
            tokens = torch.gather(seq, 1, idx[..., None].expand(-1, -1, seq.shape[-1]))
            self.model.append_tokens(self.cache, self._dup(tokens), self._dup(torch.gather(order, 1, idx)),
                                     self._dup(need.to(self.device)))
            self.cached = self.cached + need
        z = self.model.query(self.cache, self._dup(positions), self._dup(visible.to(self.device) + 1))
        if not self.use_cfg:
            return z, None
        return z[: self.batch], z[self.batch :]


def head_chain(
    side: ModelSide,
    schedule: DiffusionSchedule,
    z: tuple[torch.Tensor, torch.Tensor | None],
    w: torch.Tensor,
    x_T: torch.Tensor,
    eps: torch.Tensor,
    tau: float,
    final_step_noise: bool,
    clip_x0: float | None = 1.0,
) -> ChainOutput:
    """Head chains of all slots ``z [B, m, C]`` batched (flattened to B·m)."""
    z_c, z_u = z
    flat_c = z_c.reshape(-1, z_c.shape[-1])
    flat_u = None if z_u is None else z_u.reshape(-1, z_u.shape[-1])
    fn = guided_eps_fn(side.model, schedule, flat_c, flat_u, w.reshape(-1, 1))
    return run_chain(fn, schedule, x_T, eps, tau, final_step_noise, clip_x0)


# -- the loops ------------------------------------------------------------------------------------
@dataclass
class _Setup:
    params: Common
    schedule: DiffusionSchedule
    order: torch.Tensor
    w: torch.Tensor  # [L] cfg per generation step
    noise_target: ChainNoise
    noise_draft: ChainNoise
    num_tokens: int
    dim: int

    def __post_init__(self) -> None:
        # The loops read noise by generation step: one gather here instead of one per step.
        self.target_steps = self.noise_target.in_order(self.order)
        aligned = self.noise_draft is self.noise_target
        self.draft_steps = self.target_steps if aligned else self.noise_draft.in_order(self.order)

    @property
    def clip(self) -> float | None:
        return 1.0 if self.params.clip_denoised else None

    def chain(self, side: ModelSide, z: tuple[torch.Tensor, torch.Tensor | None], w: torch.Tensor,
              noise: tuple[torch.Tensor, torch.Tensor]) -> ChainOutput:
        p = self.params
        return head_chain(side, self.schedule, z, w, *noise, p.temperature, p.final_step_noise, self.clip)


@functools.lru_cache(maxsize=8)
def _cosine_schedule(train_steps: int, sample_steps: int) -> DiffusionSchedule:
    """The head's sampling schedule, built once per step counts (in Python, milliseconds) and only read."""
    return DiffusionSchedule.cosine(train_steps, sample_steps)


def _setup(params: Common, pair: ModelPair, sample_ids: torch.Tensor, seed: int) -> _Setup:
    target: ContinuousAR = pair.target
    cfgm = target.config
    steps = params.sample_steps or cfgm.diffusion_sample_steps
    schedule = _cosine_schedule(cfgm.diffusion_train_steps, steps)
    L, d = cfgm.num_tokens, cfgm.token_dim
    order = generation_order(params.order, seed, sample_ids, L)
    noise_t = ChainNoise.draw(seed, sample_ids, L, schedule.num_steps, d)
    noise_d = noise_t
    if isinstance(params, CSpD) and params.no_align:
        noise_d = ChainNoise.draw(seed, sample_ids, L, schedule.num_steps, d, suffix="/draft")
    w = cfg_scales(params.cfg, params.cfg_schedule, L, sample_ids.device)
    return _Setup(params, schedule, order, w, noise_t, noise_d, L, d)


def _cache_slack(gamma: int, num_tokens: int) -> int:
    """Cache slots past L for padded windows; one value for γ ≤ L so that target-only and
    CSpD run the same attention shapes (bit-identical pre-fill / γ = 1 identity)."""
    return max(gamma, num_tokens) + 1


def _images(seq: torch.Tensor, order: torch.Tensor, decode=None) -> torch.Tensor:
    """uint8 images of tokens in generation order: the presets' patches, or a release's VAE ``decode``."""
    spatial = torch.empty_like(seq)
    spatial.scatter_(1, order[..., None].expand_as(seq), seq)
    return tokens_to_uint8(spatial) if decode is None else decode(spatial)


def _step_all_rows(s: _Setup, side: ModelSide, seq: torch.Tensor, k: int, noise: ChainNoise) -> ChainOutput:
    """One model step of every row at generation step ``k``, seeing the k tokens before it."""
    b = seq.shape[0]
    z = side.context(seq, s.order, torch.full((b,), k), s.order[:, k : k + 1], torch.full((b, 1), k))
    return s.chain(side, z, s.w[k : k + 1].expand(b, 1), noise.steps(k, k + 1))


def _run_target_only(s: _Setup, pair: ModelPair, labels: torch.Tensor) -> tuple[torch.Tensor, list[SampleStats]]:
    b, L = labels.shape[0], s.num_tokens
    tgt = ModelSide(pair.target, labels, s.params.cfg != 1.0, extra_slots=_cache_slack(1, L))
    seq = torch.zeros(b, L, s.dim, device=labels.device)
    for k in range(L):
        seq[:, k] = _step_all_rows(s, tgt, seq, k, s.target_steps).x0.reshape(b, s.dim)
    stats = [SampleStats(num_tokens=L, target_calls=L) for _ in range(b)]
    return seq, stats


class _VerifyLog:
    """CSpD's own per-row numbers beside the shared round tally, kept on the device per (row, generation
    step) and read once at the end: the log-ratio terms of every counted decision, and resampling."""

    TERMS = ("log_ratio", "log_factor", "final_term")

    def __init__(self, batch: int, num_tokens: int, device: torch.device) -> None:
        self.terms = torch.zeros(len(self.TERMS), batch, num_tokens, dtype=torch.float64, device=device)
        self.counted = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)
        self.resampled = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)
        self.tries = torch.zeros(batch, num_tokens, dtype=torch.int64, device=device)
        self.cap_hit = torch.zeros(batch, num_tokens, dtype=torch.bool, device=device)

    def window(self, first: int, ratio: LogRatio) -> None:
        """Every decision of a window of generation steps ``first ..`` (one per row and slot) counts."""
        b = self.counted.shape[0]
        m = ratio.log_ratio.shape[0] // b
        self.terms[:, :, first : first + m] = torch.stack([getattr(ratio, t) for t in self.TERMS]).reshape(-1, b, m)
        self.counted[:, first : first + m] = True

    def decisions(self, rows: torch.Tensor, slots: torch.Tensor, steps: torch.Tensor, ratio: LogRatio,
                  window: int) -> None:
        """The counted decisions: slot ``slots[i]`` of row ``rows[i]``, at generation step ``steps[i]``."""
        flat = rows * window + slots
        self.terms[:, rows, steps] = torch.stack([getattr(ratio, t)[flat] for t in self.TERMS])
        self.counted[rows, steps] = True

    def resample(self, rows: torch.Tensor, steps: torch.Tensor, res: ResidualResult) -> None:
        self.resampled[rows, steps] = True
        self.tries[rows, steps] = res.tries
        self.cap_hit[rows, steps] = res.cap_hit

    def rows(self) -> list[dict[str, Any]]:
        """Per-row means; each log-ratio sum adds the decisions in generation order (the order they were made)."""
        terms, counted = self.terms.cpu().tolist(), self.counted.cpu().tolist()
        resampled, tries, caps = (t.sum(1).tolist() for t in (self.resampled, self.tries, self.cap_hit))
        out = []
        for i, row_counted in enumerate(counted):
            sums = [0.0] * len(self.TERMS)
            for j, c in enumerate(row_counted):
                if c:
                    for t in range(len(self.TERMS)):
                        sums[t] += terms[t][i][j]
            nv, nr = max(sum(row_counted), 1), int(resampled[i])
            out.append({
                "mean_resample_tries": float(tries[i]) / nr if nr else 0.0,
                "resample_cap_hits": int(caps[i]),
                "resampled_tokens": nr,
                "mean_log_ratio": sums[0] / nv,
                "mean_log_sigma_factor": sums[1] / nv,
                "mean_final_step_term": sums[2] / nv,
            })
        return out


@dataclass
class _Verified:
    """A verify forward's outcome over its B·m slots (flattened row-major)."""

    chain: ChainOutput  # the target's chain per slot
    ratio: LogRatio
    q_mu1: torch.Tensor  # the draft's final-step Gaussian per slot, for the residual
    q_s1: torch.Tensor
    positions: torch.Tensor  # [B·m] spatial position per slot
    accepted: torch.Tensor  # bool [B, m] on the host: the round's one device-to-host transfer


class _Cspd:
    """One batch's CSpD state: the shared sequence, the draft's final-step Gaussians per generation
    step, both models' caches, and the tallies."""

    def __init__(self, s: _Setup, pair: ModelPair, labels: torch.Tensor, sample_ids: torch.Tensor, seed: int) -> None:
        p: CSpD = s.params  # type: ignore[assignment]
        self.s, self.p, self.seed, self.sample_ids = s, p, seed, sample_ids
        self.b, self.L, self.d, self.gamma = labels.shape[0], s.num_tokens, s.dim, p.gamma
        dev = labels.device
        use_cfg = p.cfg != 1.0
        self.tgt = ModelSide(pair.target, labels, use_cfg, extra_slots=_cache_slack(p.gamma, self.L))
        self.dft = ModelSide(pair.draft, labels, use_cfg, extra_slots=_cache_slack(p.gamma, self.L))
        self.seq = torch.zeros(self.b, self.L, self.d, device=dev)
        self.q_mu1 = torch.zeros(self.b, self.L, self.d, device=dev)
        self.q_s1 = torch.ones(self.b, self.L, self.d, device=dev)
        self.q_slog = torch.zeros(self.b, self.L, dtype=torch.float64, device=dev)
        # acceptance uniforms keyed by (sample, position), and the residual's first block of tries,
        # drawn once and read by generation step
        self.u_accept = rng.uniform(seed, sample_ids[:, None], "accept", s.order)
        self.first_tries = KeyedDraws.ahead(seed, sample_ids, s.order, self.d, FIRST_BLOCK)
        self.tally = RoundTally(self.b, self.gamma, self.L)  # on the host: its inputs are host masks
        self.log = _VerifyLog(self.b, self.L, dev)

    # -- model steps --------------------------------------------------------------------------------
    def target_step(self, k: int) -> None:
        self.seq[:, k] = _step_all_rows(self.s, self.tgt, self.seq, k, self.s.target_steps).x0.reshape(self.b, self.d)
        self.tally.add_calls(None, target=1)

    def draft_step(self, k: int) -> None:
        """Draft generation step ``k`` on every row."""
        out = _step_all_rows(self.s, self.dft, self.seq, k, self.s.draft_steps)
        self.seq[:, k], self.q_mu1[:, k] = out.x0.reshape(self.b, self.d), out.mu1.reshape(self.b, self.d)
        self.q_s1[:, k], self.q_slog[:, k] = out.s1.reshape(self.b, self.d), out.slog.reshape(self.b)
        self.tally.add_calls(None, draft=1)

    def draft_rows(self, steps: torch.Tensor, valid: torch.Tensor) -> None:
        """Draft generation step ``steps [B]`` (host, < L) of each row; only rows ``valid`` keep theirs."""
        s, b = self.s, self.b
        idx = steps[:, None].to(self.seq.device)
        z = self.dft.context(self.seq, s.order, steps, torch.gather(s.order, 1, idx), steps[:, None])
        out = s.chain(self.dft, z, s.w[idx], s.draft_steps.at(idx))
        rows = torch.nonzero(valid).squeeze(-1)
        at = (rows.to(self.seq.device), steps[rows].to(self.seq.device))
        self.seq[at] = out.x0.reshape(b, self.d)[at[0]]
        self.q_mu1[at] = out.mu1.reshape(b, self.d)[at[0]]
        self.q_s1[at] = out.s1.reshape(b, self.d)[at[0]]
        self.q_slog[at] = out.slog.reshape(b)[at[0]]
        self.tally.add_calls(None, draft=valid.to(torch.int64))

    # -- verification -------------------------------------------------------------------------------
    def _decide(self, z: tuple[torch.Tensor, torch.Tensor | None], w: torch.Tensor, noise: tuple, x0: torch.Tensor,
                q_mu1: torch.Tensor, q_s1: torch.Tensor, q_slog: torch.Tensor, u: torch.Tensor,
                positions: torch.Tensor) -> _Verified:
        """The target's chains on the ``[B, m]`` slots, the acceptance ratios and decisions (slots flattened)."""
        p, flat = self.p, lambda t: t.reshape(-1, self.d)  # noqa: E731
        pch = self.s.chain(self.tgt, z, w, noise)
        q_mu1, q_s1 = flat(q_mu1), flat(q_s1)
        ratio = log_acceptance_ratio(flat(x0), pch.mu1, pch.s1, pch.slog, q_mu1, q_s1, q_slog.reshape(-1),
                                     p.sigma_orientation, p.kappa)
        acc = accept(ratio.log_ratio, u.reshape(-1)).reshape(u.shape)
        return _Verified(pch, ratio, q_mu1, q_s1, positions.reshape(-1), acc.cpu())

    def verify_window(self, first: int, stop: int) -> _Verified:
        """Verify generation steps ``first .. stop-1`` of every row, the window masked for the target."""
        s, b, m = self.s, self.b, stop - first
        visible = torch.full((b, m), first)
        z = self.tgt.context(self.seq, s.order, torch.full((b,), first), s.order[:, first:stop], visible)
        window = slice(first, stop)
        return self._decide(z, s.w[window].expand(b, m), s.target_steps.steps(first, stop), self.seq[:, window],
                            self.q_mu1[:, window], self.q_s1[:, window], self.q_slog[:, window],
                            self.u_accept[:, window], s.order[:, window])

    def verify_slots(self, steps: torch.Tensor, upto: torch.Tensor, visible: torch.Tensor) -> _Verified:
        """Verify generation steps ``steps [B, m]`` (host; clamped to L - 1 past the end), appending up to ``upto``."""
        s = self.s
        idx = steps.clamp(max=self.L - 1).to(self.seq.device)
        positions = torch.gather(s.order, 1, idx)
        z = self.tgt.context(self.seq, s.order, upto, positions, visible)
        def gather(t: torch.Tensor) -> torch.Tensor:
            return torch.gather(t, 1, idx[..., None].expand(-1, -1, t.shape[-1]) if t.dim() == 3 else idx)

        return self._decide(z, s.w[idx], s.target_steps.at(idx), gather(self.seq), gather(self.q_mu1),
                            gather(self.q_s1), gather(self.q_slog), gather(self.u_accept), positions)

    def resample(self, v: _Verified, slots: torch.Tensor, rows: torch.Tensor, steps: torch.Tensor) -> None:
        """Replace the tokens at flat verify slots ``slots`` (rows ``rows``, generation steps ``steps``) by
        residual samples."""
        slots = slots.to(self.seq.device)
        rows, steps = rows.to(self.seq.device), steps.to(self.seq.device)
        first_tries = (self.first_tries[0][rows, steps], self.first_tries[1][rows, steps])
        draw = KeyedDraws(self.seed, self.sample_ids[rows], v.positions[slots], self.d, first_tries=first_tries)
        res = residual_sample(v.chain.mu1[slots].double(), v.chain.s1[slots].double(), v.q_mu1[slots].double(),
                              v.q_s1[slots].double(), v.ratio.log_factor[slots], draw, self.p.max_tries)
        self.seq[rows, steps] = res.x.to(self.seq.dtype)
        self.log.resample(rows, steps, res)

    # -- the two window schemes ---------------------------------------------------------------------
    def mar_windows(self, first: int) -> None:
        """Draft every step, verify at every γ-th step (and the last): all decisions independent."""
        verified = first
        for k in range(first, self.L):
            self.draft_step(k)
            if not (k % self.gamma == 0 or k == self.L - 1):
                continue
            v = self.verify_window(verified, k + 1)
            self.log.window(verified, v.ratio)
            rejected = ~v.accepted
            rej = torch.nonzero(rejected.reshape(-1)).squeeze(-1)
            if rej.numel():
                m = k + 1 - verified
                self.resample(v, rej, rej // m, verified + rej % m)
                first_rejected = torch.where(v.accepted.all(1), k + 1, verified + rejected.to(torch.int8).argmax(1))
                self.dft.truncate(first_rejected)
            steps = torch.arange(verified, k + 1).expand(self.b, -1)  # the window is generation steps verified .. k
            self.tally.observe(None, steps, torch.ones_like(v.accepted), v.accepted)
            self.tally.add_calls(None, target=1)
            verified = k + 1

    def sequential_windows(self, first: int) -> None:
        """LLM-style: per-row cursor n; accept a prefix, resample the first rejection, bonus when all pass."""
        L, gamma = self.L, self.gamma
        n = torch.full((self.b,), first, dtype=torch.int64)  # host
        slot = torch.arange(gamma + 1)[None, :]
        while bool((n < L).any()):
            active = n < L
            m_valid = torch.clamp(L - n, max=gamma) * active
            for j in range(gamma):
                valid = active & (n + j < L)
                if not bool(valid.any()):
                    break
                self.draft_rows((n + j).clamp(max=L - 1), valid)
            steps = n[:, None] + slot  # window slots + bonus slot
            self.tgt.truncate(n)
            v = self.verify_slots(steps, (n + gamma).clamp(max=L), steps.clamp(max=L))
            in_window = slot < m_valid[:, None]
            rejected = in_window & ~v.accepted
            any_rejected = rejected.any(1)
            a = torch.where(any_rejected, rejected.to(torch.int8).argmax(1), m_valid)  # accepted prefix length
            counted = torch.nonzero((slot <= a[:, None]) & in_window)
            c_rows, c_slots = counted[:, 0], counted[:, 1]
            dev = self.seq.device
            self.log.decisions(c_rows.to(dev), c_slots.to(dev), (n[c_rows] + c_slots).to(dev), v.ratio, gamma + 1)
            rows_rej = torch.nonzero(any_rejected & active).squeeze(-1)
            if rows_rej.numel():
                self.resample(v, rows_rej * (gamma + 1) + a[rows_rej], rows_rej, n[rows_rej] + a[rows_rej])
            # bonus: all γ drafts accepted and room left -> the target's own sample at slot γ
            bonus = active & ~any_rejected & (m_valid == gamma) & (n + gamma < L)
            rows_b = torch.nonzero(bonus).squeeze(-1)
            if rows_b.numel():
                at = rows_b.to(dev)
                bonus_x0 = v.chain.x0.reshape(self.b, gamma + 1, self.d)[at, gamma]
                self.seq[at, (n[rows_b] + gamma).to(dev)] = bonus_x0.to(self.seq.dtype)
            emitted = torch.where(any_rejected | bonus, a + 1, a) * active
            # window slot j is generation step n + j; slots at or past m_valid were not drafted
            rows = torch.nonzero(active).squeeze(-1)
            window = slot[:, :gamma]
            self.tally.observe(rows, n[rows, None] + window, window < m_valid[rows, None], window < a[rows, None])
            self.tally.add_calls(rows, target=1)
            # caches: accepted drafts stay valid as content; everything after them is stale
            self.tgt.truncate(n + a)
            self.dft.truncate(n + a)
            n = n + emitted

    def run(self) -> tuple[torch.Tensor, list[SampleStats]]:
        prefill_steps = [k for k in range(self.L) if k <= self.p.prefill_ratio * self.L]
        for k in prefill_steps:
            self.target_step(k)
        if self.p.window == "mar":
            self.mar_windows(len(prefill_steps))
        else:
            self.sequential_windows(len(prefill_steps))
        return self.seq, self.tally.to_stats(self.L, extra=self.log.rows())


@torch.no_grad()
def run_batch(method: str | Method, params: Any, pair: ModelPair, labels: torch.Tensor, sample_ids: torch.Tensor,
              seed: int) -> GenerationResult:
    """Generate one batch; images uint8 on CPU (``[B, 8, 8]`` for the presets, ``[B, H, W, 3]`` for a
    release). ``method``/``params`` as names and a mapping, or as the family table's entry and typed parameters."""
    method, params = resolve(FAMILY, method, params)
    if isinstance(params, CSpD) and pair.draft is None:
        raise ValueError(f"method {method.name!r} needs a draft model; the arm's 'draft' is empty")
    dev = pair.device
    labels = bind_conditions(labels, pair).to(dev, torch.int64)
    sample_ids = sample_ids.to(dev, torch.int64)
    s = _setup(params, pair, sample_ids, seed)
    if isinstance(params, CSpD):
        seq, stats = _Cspd(s, pair, labels, sample_ids, seed).run()
    else:
        seq, stats = _run_target_only(s, pair, labels)
    return GenerationResult(images=_images(seq, s.order, pair.info.get("image_decoder")), stats=stats)


__all__ = ["run_batch", "ChainNoise", "ModelSide"]
