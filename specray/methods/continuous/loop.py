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
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specray import rng
from specray.families import Method, resolve
from specray.methods.common import GenerationResult, RoundTally, SampleStats, bind_conditions
from specray.methods.continuous.head import ChainOutput, guided_eps_fn, run_chain
from specray.methods.continuous.params import Common, CSpD
from specray.methods.continuous.rules import accept, keyed_draws, log_acceptance_ratio, residual_sample
from specray.models.continuous_ar import ContentCache, ContinuousAR, tokens_to_uint8
from specray.models.continuous_schedule import DiffusionSchedule
from specray.models.pair import ModelPair

FAMILY = "continuous_ar"


# -- shared randomness -------------------------------------------------------------------------------
@dataclass
class ChainNoise:
    """x_T ``[B, L, d]`` and per-step noise ``[B, L, T, d]``, indexed by spatial position."""

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

    def take(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Noise of ``positions [B, m]`` flattened to ``[B·m, d]`` and ``[B·m, T, d]``."""
        b, m = positions.shape
        rows = torch.arange(b, device=positions.device)[:, None].expand(b, m)
        return self.x_T[rows, positions].reshape(b * m, -1), self.eps[rows, positions].reshape(b * m, *self.eps.shape[2:])


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
    """A model with its content cache over the shared token sequence (conditional + null rows under CFG)."""

    def __init__(self, model: ContinuousAR, labels: torch.Tensor, use_cfg: bool, extra_slots: int) -> None:
        self.model = model
        self.use_cfg = use_cfg
        self.batch = labels.shape[0]
        rows = torch.cat([labels, torch.full_like(labels, model.null_class)]) if use_cfg else labels
        # A masked (MAR-style) model has no cache: every forward sees the visible tokens afresh.
        self.masked = getattr(model, "masked_context", False)
        self.row_labels = rows
        self.cache: ContentCache | None = None if self.masked else model.new_cache(rows, extra_slots=extra_slots)

    def _dup(self, t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t]) if self.use_cfg else t

    def cached_tokens(self) -> torch.Tensor:
        if self.cache is None:
            return torch.zeros(self.batch, dtype=torch.int64, device=self.row_labels.device)
        return self.cache.length[: self.batch] - 1  # slot 0 is the class entry

    def truncate(self, num_tokens: torch.Tensor) -> None:
        if self.cache is not None:
            self.cache.truncate(self._dup(num_tokens + 1))

    def _masked_context(self, seq: torch.Tensor, order: torch.Tensor, query_index: torch.Tensor,
                        visible: torch.Tensor) -> torch.Tensor:
        """z from a masked model: one forward per distinct visible count across the query slots."""
        positions = torch.gather(order, 1, query_index.clamp(max=order.shape[1] - 1))
        seq, order, positions, visible = (self._dup(t) for t in (seq, order, positions, visible))
        if bool((visible == visible[:, :1]).all()):
            return self.model.context(seq, order, self.row_labels, positions, visible[:, 0])
        return torch.cat([self.model.context(seq, order, self.row_labels, positions[:, j : j + 1], visible[:, j])
                          for j in range(positions.shape[1])], dim=1)

    def context(
        self, seq: torch.Tensor, order: torch.Tensor, upto: torch.Tensor, query_index: torch.Tensor, visible: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One forward: append seq[:, cached:upto] as content, then z for generation indices ``query_index [B, m]``.

        ``visible [B, m]``: how many generated tokens each query sees.
        """
        if self.masked:
            z = self._masked_context(seq, order, query_index, visible)
            return (z, None) if not self.use_cfg else (z[: self.batch], z[self.batch :])
        have = self.cached_tokens()
        need = (upto - have).clamp(min=0)
        n_app = int(need.max())
        if n_app > 0:
            idx = (have[:, None] + torch.arange(n_app, device=seq.device)).clamp(max=seq.shape[1] - 1)
            tokens = torch.gather(seq, 1, idx[..., None].expand(-1, -1, seq.shape[-1]))
            positions = torch.gather(order, 1, idx)
            self.model.append_tokens(self.cache, self._dup(tokens), self._dup(positions), self._dup(need))
        positions = torch.gather(order, 1, query_index.clamp(max=order.shape[1] - 1))
        z = self.model.query(self.cache, self._dup(positions), self._dup(visible + 1))
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

    @property
    def clip(self) -> float | None:
        return 1.0 if self.params.clip_denoised else None


def _setup(params: Common, pair: ModelPair, sample_ids: torch.Tensor, seed: int) -> _Setup:
    target: ContinuousAR = pair.target
    cfgm = target.config
    steps = params.sample_steps or cfgm.diffusion_sample_steps
    schedule = DiffusionSchedule.cosine(cfgm.diffusion_train_steps, steps)
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


def _step_slots(s: _Setup, gen_index: torch.Tensor, noise: ChainNoise) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Noise and cfg scale for generation indices ``[B, m]``."""
    positions = torch.gather(s.order, 1, gen_index.clamp(max=s.num_tokens - 1))
    x_T, eps = noise.take(positions)
    return x_T, eps, s.w[gen_index.clamp(max=s.num_tokens - 1)]


def _run_target_only(s: _Setup, pair: ModelPair, labels: torch.Tensor) -> tuple[torch.Tensor, list[SampleStats]]:
    b, L = labels.shape[0], s.num_tokens
    tgt = ModelSide(pair.target, labels, s.params.cfg != 1.0, extra_slots=_cache_slack(1, L))
    seq = torch.zeros(b, L, s.dim, device=labels.device)
    for k in range(L):
        idx = torch.full((b, 1), k, dtype=torch.int64, device=labels.device)
        z = tgt.context(seq, s.order, idx[:, 0], idx, idx)
        x_T, eps, w = _step_slots(s, idx, s.noise_target)
        out = head_chain(tgt, s.schedule, z, w, x_T, eps, s.params.temperature, s.params.final_step_noise, s.clip)
        seq[:, k] = out.x0.reshape(b, s.dim)
    stats = [SampleStats(num_tokens=L, target_calls=L) for _ in range(b)]
    return seq, stats


@dataclass
class _CspdExtras:
    """CSpD's own per-row numbers beside the shared round tally: resampling and the log-ratio terms."""

    batch: int

    def __post_init__(self) -> None:
        z = lambda dtype=torch.int64: torch.zeros(self.batch, dtype=dtype)  # noqa: E731
        self.resampled, self.tries, self.cap_hits, self.verified = z(), z(), z(), z()
        self.sum_log_ratio, self.sum_log_factor, self.sum_final = z(torch.float64), z(torch.float64), z(torch.float64)

    def rows(self) -> list[dict[str, Any]]:
        out = []
        for i in range(self.batch):
            nv = max(int(self.verified[i]), 1)
            nr = int(self.resampled[i])
            out.append({
                "mean_resample_tries": float(self.tries[i]) / nr if nr else 0.0,
                "resample_cap_hits": int(self.cap_hits[i]),
                "resampled_tokens": nr,
                "mean_log_ratio": float(self.sum_log_ratio[i]) / nv,
                "mean_log_sigma_factor": float(self.sum_log_factor[i]) / nv,
                "mean_final_step_term": float(self.sum_final[i]) / nv,
            })
        return out


def _verify_slots(
    s: _Setup, tgt: ModelSide, seq: torch.Tensor, labels: torch.Tensor, sample_ids: torch.Tensor, seed: int,
    n_verified: torch.Tensor, gen_index: torch.Tensor, visible: torch.Tensor, q: dict[str, torch.Tensor],
) -> tuple[ChainOutput, Any, torch.Tensor, torch.Tensor]:
    """One target forward over slots ``gen_index [B, m]``; returns target chain, ratio, decisions, positions."""
    p = s.params
    b, m = gen_index.shape
    z = tgt.context(seq, s.order, n_verified, gen_index, visible)
    x_T, eps, w = _step_slots(s, gen_index, s.noise_target)
    pch = head_chain(tgt, s.schedule, z, w, x_T, eps, p.temperature, p.final_step_noise, s.clip)
    qi = gen_index.clamp(max=s.num_tokens - 1)
    gather = lambda t: torch.gather(t, 1, qi[..., None].expand(-1, -1, t.shape[-1])).reshape(b * m, -1) if t.dim() == 3 \
        else torch.gather(t, 1, qi).reshape(b * m)  # noqa: E731
    ratio = log_acceptance_ratio(
        gather(seq), pch.mu1, pch.s1, pch.slog, gather(q["mu1"]), gather(q["s1"]), gather(q["slog"]),
        p.sigma_orientation, p.kappa,
    )
    positions = torch.gather(s.order, 1, qi)
    sids = sample_ids[:, None].expand(b, m).reshape(-1)
    u = rng.uniform(seed, sids, "accept", positions.reshape(-1))
    acc = accept(ratio.log_ratio, u).reshape(b, m)
    return pch, ratio, acc, positions


def _resample(
    s: _Setup, pch: ChainOutput, q: dict[str, torch.Tensor], flat_slots: torch.Tensor,
    log_factor: torch.Tensor, sample_ids_flat: torch.Tensor, positions_flat: torch.Tensor, seed: int,
):
    """Residual samples for flat slot indices (into the B·m verification slots)."""
    b_rows = flat_slots  # indices into flattened [B·m]
    qmu = q["mu1_flat"][b_rows]
    qs = q["s1_flat"][b_rows]
    draw = keyed_draws(seed, sample_ids_flat[b_rows], positions_flat[b_rows], s.dim)
    return residual_sample(
        pch.mu1[b_rows].double(), pch.s1[b_rows].double(), qmu.double(), qs.double(), log_factor[b_rows], draw,
        s.params.max_tries,
    )


def _run_cspd(s: _Setup, pair: ModelPair, labels: torch.Tensor, sample_ids: torch.Tensor, seed: int):
    p = s.params
    b, L, d, gamma = labels.shape[0], s.num_tokens, s.dim, p.gamma
    dev = labels.device
    use_cfg = p.cfg != 1.0
    tgt = ModelSide(pair.target, labels, use_cfg, extra_slots=_cache_slack(gamma, L))
    dft = ModelSide(pair.draft, labels, use_cfg, extra_slots=_cache_slack(gamma, L))
    seq = torch.zeros(b, L, d, device=dev)
    q = {"mu1": torch.zeros(b, L, d, device=dev), "s1": torch.ones(b, L, d, device=dev),
         "slog": torch.zeros(b, L, dtype=torch.float64, device=dev)}
    tally = RoundTally(b, gamma, L, dev)
    extras = _CspdExtras(b)
    tau = p.temperature

    def target_step(k: int) -> None:
        idx = torch.full((b, 1), k, dtype=torch.int64, device=dev)
        z = tgt.context(seq, s.order, idx[:, 0], idx, idx)
        x_T, eps, w = _step_slots(s, idx, s.noise_target)
        seq[:, k] = head_chain(tgt, s.schedule, z, w, x_T, eps, tau, p.final_step_noise, s.clip).x0.reshape(b, d)
        tally.add_calls(None, target=1)

    def draft_step(gen_index: torch.Tensor, valid: torch.Tensor) -> None:
        """Draft the token at generation index ``gen_index [B]`` for rows where ``valid``."""
        idx = gen_index[:, None]
        z = dft.context(seq, s.order, gen_index.clamp(max=L), idx, idx)
        x_T, eps, w = _step_slots(s, idx, s.noise_draft)
        out = head_chain(dft, s.schedule, z, w, x_T, eps, tau, p.final_step_noise, s.clip)
        rows = torch.nonzero(valid).squeeze(-1)
        gi = gen_index[rows]
        seq[rows, gi] = out.x0.reshape(b, d)[rows]
        q["mu1"][rows, gi] = out.mu1.reshape(b, d)[rows]
        q["s1"][rows, gi] = out.s1.reshape(b, d)[rows]
        q["slog"][rows, gi] = out.slog.reshape(b)[rows]
        tally.add_calls(None, draft=valid.to(torch.int64))

    def flat_q(gen_index: torch.Tensor) -> None:
        qi = gen_index.clamp(max=L - 1)
        q["mu1_flat"] = torch.gather(q["mu1"], 1, qi[..., None].expand(-1, -1, d)).reshape(-1, d)
        q["s1_flat"] = torch.gather(q["s1"], 1, qi[..., None].expand(-1, -1, d)).reshape(-1, d)

    def record(ratio, acc_flat: torch.Tensor, counted: torch.Tensor) -> None:
        m = counted.shape[1]
        cnt = counted.reshape(-1).cpu()
        rows = torch.arange(b)[:, None].expand(b, m).reshape(-1)[cnt]
        extras.sum_log_ratio.index_add_(0, rows, ratio.log_ratio.cpu()[cnt])
        extras.sum_log_factor.index_add_(0, rows, ratio.log_factor.cpu()[cnt])
        extras.sum_final.index_add_(0, rows, ratio.final_term.cpu()[cnt])
        extras.verified += counted.sum(1).cpu()

    def add_resample(res, rows: torch.Tensor) -> None:
        ones = torch.ones_like(rows)
        extras.resampled.index_add_(0, rows.cpu(), ones.cpu())
        extras.tries.index_add_(0, rows.cpu(), res.tries.cpu())
        extras.cap_hits.index_add_(0, rows.cpu(), res.cap_hit.to(torch.int64).cpu())

    prefill_steps = [k for k in range(L) if k <= p.prefill_ratio * L]
    for k in prefill_steps:
        target_step(k)
    n_pre = len(prefill_steps)

    if p.window == "mar":
        verified = n_pre
        for k in range(n_pre, L):
            draft_step(torch.full((b,), k, dtype=torch.int64, device=dev), torch.ones(b, dtype=torch.bool, device=dev))
            if not (k % gamma == 0 or k == L - 1):
                continue
            gen_index = torch.arange(verified, k + 1, device=dev).expand(b, -1)
            m = gen_index.shape[1]
            visible = torch.full_like(gen_index, verified)  # the window stays masked for the target
            pch, ratio, acc, positions = _verify_slots(
                s, tgt, seq, labels, sample_ids, seed, torch.full((b,), verified, device=dev), gen_index, visible, q
            )
            flat_q(gen_index)
            record(ratio, acc, torch.ones_like(acc))
            rej = torch.nonzero(~acc.reshape(-1)).squeeze(-1)
            if rej.numel():
                sids = sample_ids[:, None].expand(b, m).reshape(-1)
                res = _resample(s, pch, q, rej, ratio.log_factor, sids, positions.reshape(-1), seed)
                seq.view(b * L, d)[(torch.arange(b, device=dev)[:, None] * L + gen_index).reshape(-1)[rej]] = res.x.to(seq.dtype)
                add_resample(res, rej // m)
                first_rej = torch.where(acc.all(1), torch.full((b,), k + 1, device=dev), verified + (~acc).int().argmax(1))
                dft.truncate(torch.minimum(dft.cached_tokens(), first_rej))
            tally.observe(None, gen_index, torch.ones_like(acc), acc)  # the window is generation steps verified .. k
            tally.add_calls(None, target=1)
            verified = k + 1
        return seq, tally.to_stats(L, extra=extras.rows())

    # sequential (LLM-style) windows: per-row cursor n
    n = torch.full((b,), n_pre, dtype=torch.int64, device=dev)
    while bool((n < L).any()):
        active = n < L
        m_valid = torch.clamp(L - n, max=gamma) * active
        for j in range(gamma):
            gi = n + j
            valid = active & (gi < L)
            if not bool(valid.any()):
                break
            draft_step(gi.clamp(max=L - 1), valid)
        gen_index = n[:, None] + torch.arange(gamma + 1, device=dev)  # window slots + bonus slot
        visible = gen_index.clamp(max=L)
        tgt.truncate(torch.minimum(tgt.cached_tokens(), n))
        upto = (n + gamma).clamp(max=L)
        pch, ratio, acc, positions = _verify_slots(s, tgt, seq, labels, sample_ids, seed, upto, gen_index, visible, q)
        flat_q(gen_index)
        slot = torch.arange(gamma + 1, device=dev)[None, :]
        in_window = slot < m_valid[:, None]
        acc_w = acc & in_window
        # accepted prefix length a: first slot that is in the window and rejected
        rejected = in_window & ~acc
        a = torch.where(rejected.any(1), rejected.int().argmax(1), m_valid)
        counted = slot <= a[:, None]
        counted &= in_window
        record(ratio, acc_w, counted)
        rows_rej = torch.nonzero(rejected.any(1) & active).squeeze(-1)
        if rows_rej.numel():
            flat_slot = rows_rej * (gamma + 1) + a[rows_rej]
            sids = sample_ids[:, None].expand(b, gamma + 1).reshape(-1)
            res = _resample(s, pch, q, flat_slot, ratio.log_factor, sids, positions.reshape(-1), seed)
            seq[rows_rej, n[rows_rej] + a[rows_rej]] = res.x.to(seq.dtype)
            add_resample(res, rows_rej)
        # bonus: all γ drafts accepted and room left -> the target's own sample at slot γ
        bonus = active & ~rejected.any(1) & (m_valid == gamma) & (n + gamma < L)
        rows_b = torch.nonzero(bonus).squeeze(-1)
        if rows_b.numel():
            seq[rows_b, n[rows_b] + gamma] = pch.x0.reshape(b, gamma + 1, d)[rows_b, gamma].to(seq.dtype)
        emitted = torch.where(rejected.any(1) | bonus, a + 1, a) * active
        # window slot j is generation step n + j; slots at or past m_valid were not drafted
        rows = torch.nonzero(active).squeeze(-1)
        window_steps = n[rows, None] + slot[:, :gamma]
        tally.observe(rows, window_steps, (slot[:, :gamma] < m_valid[rows, None]), (slot[:, :gamma] < a[rows, None]))
        tally.add_calls(rows, target=1)
        # caches: accepted drafts stay valid as content; everything after them is stale
        tgt.truncate(torch.minimum(tgt.cached_tokens(), n + a))
        dft.truncate(torch.minimum(dft.cached_tokens(), n + a))
        n = n + emitted
    return seq, tally.to_stats(L, extra=extras.rows())


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
        seq, stats = _run_cspd(s, pair, labels, sample_ids, seed)
    else:
        seq, stats = _run_target_only(s, pair, labels)
    return GenerationResult(images=_images(seq, s.order, pair.info.get("image_decoder")), stats=stats)


__all__ = ["run_batch", "ChainNoise", "ModelSide"]
