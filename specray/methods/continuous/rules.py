"""Continuous Speculative Decoding (CSpD): acceptance ratio and residual sampler.

Pure functions over the Gaussian parameters a head chain leaves behind
(``specray.methods.diffusion_head.ChainOutput``), float64 throughout. The
spec is ``shared/spec/cspd.md``; section numbers below refer to it.

Acceptance ratio (§2.3, §2.5, §6.4), in log space::

    log r = log C + log p̃_1(x0) − log q̃_1(x0)
    log p̃_1(x) = −Σ_k log s^p_k − ½ Σ_k ((x_k − μ^p_k)/(κ s^p_k))²     (s = τ·σ_1)

with the trajectory factor ``log C`` chosen by ``sigma_orientation``:

* ``paper``: log Σ = Σ_{t≥2} Σ_k (log σ^q − log σ^p)  = p(Y_p)/q(Y_q) (§2.3);
* ``code``:  log F = −log Σ, the official code's inverted factor (§2.5);
* ``none``:  0 (exact mode, §5.6).

κ ("inner temperature", 42 in the official code) divides the standard
deviations in the exponent only. With κ = 1 and ``none`` this is the true
density ratio p_1(x0)/q_1(x0) of the final-step Gaussians.

Residual (§5.2-5.3): proposals x ~ N(μ^p_1, s^p²) kept with probability
max(0, 1 − q_1(x)/(C·p_1(x))) using the true (κ-free) densities; exact for the
residual ∝ max(0, C·p_1 − q_1) when tries are unlimited. Tries are capped;
a token that hits the cap falls back to μ^p_1 and is counted, never left at zero.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray import rng

SIGMA_ORIENTATIONS = ("paper", "code", "none")

# draw(try_index, active_rows) -> (standard normals [len(active), d], uniforms [len(active)])
DrawFn = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def log_normal_diag(x: torch.Tensor, mu: torch.Tensor, s: torch.Tensor, kappa: float = 1.0) -> torch.Tensor:
    """log N(x; μ, diag s²) over the last dim, float64; κ ≠ 1 scales s in the exponent only."""
    x, mu, s = (t.to(torch.float64) for t in (x, mu, s))
    d = x.shape[-1]
    z = (x - mu) / (kappa * s)
    return -0.5 * d * math.log(2 * math.pi) - torch.log(s).sum(-1) - 0.5 * (z * z).sum(-1)


def log_trajectory_factor(p_slog: torch.Tensor, q_slog: torch.Tensor, orientation: str) -> torch.Tensor:
    """log C from the per-token sums Σ_{t≥2} Σ_k log σ_{t,k} of target (p) and draft (q)."""
    p_slog, q_slog = p_slog.to(torch.float64), q_slog.to(torch.float64)
    if orientation == "paper":
        return q_slog - p_slog
    if orientation == "code":
        return p_slog - q_slog
    if orientation == "none":
        return torch.zeros_like(p_slog)
    raise ValueError(f"sigma_orientation must be one of {SIGMA_ORIENTATIONS}, got {orientation!r}")


@dataclass
class LogRatio:
    """log r and its two components (logged for calibration, §9.2)."""

    log_ratio: torch.Tensor  # float64 [n]
    log_factor: torch.Tensor  # log C
    final_term: torch.Tensor  # log p̃_1(x0) − log q̃_1(x0)


def log_acceptance_ratio(
    x0: torch.Tensor,
    p_mu1: torch.Tensor,
    p_s1: torch.Tensor,
    p_slog: torch.Tensor,
    q_mu1: torch.Tensor,
    q_s1: torch.Tensor,
    q_slog: torch.Tensor,
    sigma_orientation: str = "paper",
    kappa: float = 1.0,
) -> LogRatio:
    """The CSpD acceptance log-ratio of drafted tokens ``x0 [n, d]`` (§6.4 ``log_ratio``)."""
    if not kappa > 0:
        raise ValueError(f"kappa must be > 0, got {kappa}")
    log_factor = log_trajectory_factor(p_slog, q_slog, sigma_orientation)
    final = log_normal_diag(x0, p_mu1, p_s1, kappa) - log_normal_diag(x0, q_mu1, q_s1, kappa)
    return LogRatio(log_ratio=log_factor + final, log_factor=log_factor, final_term=final)


def accept(log_ratio: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept iff log u < log r (≡ u < min(1, r)); u in [0, 1)."""
    return torch.log(u.to(torch.float64)) < log_ratio


@dataclass
class ResidualResult:
    x: torch.Tensor  # [n, d]
    tries: torch.Tensor  # int64 [n]: proposals drawn (= cap for cap hits)
    cap_hit: torch.Tensor  # bool [n]: never kept within max_tries; x fell back to μ^p_1


def residual_keep_probability(
    x: torch.Tensor, p_mu1: torch.Tensor, p_s1: torch.Tensor, q_mu1: torch.Tensor, q_s1: torch.Tensor,
    log_factor: torch.Tensor,
) -> torch.Tensor:
    """max(0, 1 − q_1(x) / (C·p_1(x))) with true densities (no κ), float64."""
    log_q_over_cp = log_normal_diag(x, q_mu1, q_s1) - log_normal_diag(x, p_mu1, p_s1) - log_factor.to(torch.float64)
    return (-torch.expm1(log_q_over_cp.clamp(max=0.0))).clamp(min=0.0)  # 1 − e^a for a ≤ 0, else 0


def residual_sample(
    p_mu1: torch.Tensor,
    p_s1: torch.Tensor,
    q_mu1: torch.Tensor,
    q_s1: torch.Tensor,
    log_factor: torch.Tensor,
    draw: DrawFn,
    max_tries: int | None = 100,
) -> ResidualResult:
    """Acceptance-rejection sampling of ∝ max(0, C·p_1 − q_1) with proposal p_1 (bound M = 1/Z).

    A ``draw`` that can draw several tries at once (:class:`KeyedDraws`) is asked for growing blocks
    of tries, each row keeping its first kept proposal: the same result as one try at a time (its
    draws are keyed by try), with a handful of passes instead of one per try.
    """
    if isinstance(draw, KeyedDraws):
        return _residual_sample_blocks(p_mu1, p_s1, q_mu1, q_s1, log_factor, draw, max_tries)
    n, d = p_mu1.shape
    device = p_mu1.device
    out = p_mu1.clone()
    tries = torch.zeros(n, dtype=torch.int64, device=device)
    done = torch.zeros(n, dtype=torch.bool, device=device)
    attempt = 0
    while not bool(done.all()) and (max_tries is None or attempt < max_tries):
        active = torch.nonzero(~done).squeeze(-1)
        normals, uniforms = draw(attempt, active)
        x = p_mu1[active] + p_s1[active] * normals.to(p_mu1.dtype)
        keep_prob = residual_keep_probability(
            x, p_mu1[active], p_s1[active], q_mu1[active], q_s1[active], log_factor[active]
        )
        take = uniforms.to(torch.float64) < keep_prob
        tries[active] += 1
        out[active[take]] = x[take]
        done[active[take]] = True
        attempt += 1
    return ResidualResult(x=out, tries=tries, cap_hit=~done)


class KeyedDraws:
    """Residual proposals keyed by (seed, sample_id, stream, position, try): batch-independent.

    A :data:`DrawFn` (one try for rows ``active``), and :meth:`block` draws tries
    ``first .. first + count - 1`` at once (the same numbers: each is a function of its key).
    ``first_tries``: the first tries of every row, drawn ahead (:meth:`ahead`), which
    :meth:`block` serves instead of drawing them again.
    """

    def __init__(self, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, dim: int,
                 stream: str = "residual", first_tries: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
        self.seed, self.sample_ids, self.positions, self.dim, self.stream = seed, sample_ids, positions, dim, stream
        self.first_tries = first_tries

    @classmethod
    def ahead(cls, seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, dim: int, tries: int,
              stream: str = "residual") -> tuple[torch.Tensor, torch.Tensor]:
        """Tries ``0 .. tries-1`` at ``positions [B, L]`` of samples ``sample_ids [B]``: normals
        ``[B, L, tries, d]`` and uniforms ``[B, L, tries]``, drawn in one pass."""
        attempts = torch.arange(tries, device=sample_ids.device)[None, None, :]
        draws = cls(seed, sample_ids, positions, dim, stream)
        return draws._draw(sample_ids[:, None, None], positions[..., None], attempts)

    def __call__(self, attempt: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._draw(self.sample_ids[active], self.positions[active], attempt)

    def block(self, first: int, count: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normals ``[len(active), count, d]`` and uniforms ``[len(active), count]`` of tries first.. ."""
        if self.first_tries is not None and first + count <= self.first_tries[1].shape[1]:
            normals, uniforms = self.first_tries
            return normals[active, first : first + count], uniforms[active, first : first + count]
        attempts = torch.arange(first, first + count, device=self.sample_ids.device)[None, :]
        return self._draw(self.sample_ids[active, None], self.positions[active, None], attempts)

    def _draw(self, sids: torch.Tensor, pos: torch.Tensor, attempt: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        normals = rng.normal(self.seed, sids, self.stream, pos, attempt, shape=(self.dim,), dtype=torch.float64)
        uniforms = rng.uniform(self.seed, sids, self.stream + "/keep", pos, attempt)
        return normals, uniforms


def keyed_draws(seed: int, sample_ids: torch.Tensor, positions: torch.Tensor, dim: int, stream: str = "residual") -> KeyedDraws:
    """Residual proposals keyed by (seed, sample_id, stream, position, try): batch-independent."""
    return KeyedDraws(seed, sample_ids, positions, dim, stream)


FIRST_BLOCK, MAX_BLOCK = 4, 256  # tries per pass of the block sampler: 4, 8, 16, ... (most rows keep an early try)


def _residual_sample_blocks(
    p_mu1: torch.Tensor, p_s1: torch.Tensor, q_mu1: torch.Tensor, q_s1: torch.Tensor, log_factor: torch.Tensor,
    draw: KeyedDraws, max_tries: int | None,
) -> ResidualResult:
    """:func:`residual_sample` with keyed draws, a growing block of tries per pass for the rows still open."""
    n = p_mu1.shape[0]
    device = p_mu1.device
    out = p_mu1.clone()
    tries = torch.zeros(n, dtype=torch.int64, device=device)
    kept_any = torch.zeros(n, dtype=torch.bool, device=device)
    active = torch.arange(n, device=device)
    first, size = 0, FIRST_BLOCK
    while active.numel() and (max_tries is None or first < max_tries):
        count = size if max_tries is None else min(size, max_tries - first)
        normals, uniforms = draw.block(first, count, active)
        mu, s = p_mu1[active, None], p_s1[active, None]
        x = mu + s * normals.to(p_mu1.dtype)  # [a, count, d]
        keep_prob = residual_keep_probability(x, mu, s, q_mu1[active, None], q_s1[active, None], log_factor[active, None])
        take = uniforms.to(torch.float64) < keep_prob
        kept = take.any(1)
        first_kept = take.to(torch.int8).argmax(1)  # the first kept try of each row (0 where none)
        tries[active] = first + torch.where(kept, first_kept + 1, count)
        out[active[kept]] = x[kept, first_kept[kept]]
        kept_any[active[kept]] = True
        active = active[~kept]
        first, size = first + count, min(2 * size, MAX_BLOCK)
    return ResidualResult(x=out, tries=tries, cap_hit=~kept_any)


@dataclass
class VerifyResult:
    tokens: torch.Tensor  # [n, d] accepted draft or residual sample
    accepted: torch.Tensor  # bool [n]
    ratio: LogRatio
    residual: ResidualResult  # over all n (entries of accepted tokens are unused)


def verify_tokens(
    x0: torch.Tensor,
    p_mu1: torch.Tensor,
    p_s1: torch.Tensor,
    p_slog: torch.Tensor,
    q_mu1: torch.Tensor,
    q_s1: torch.Tensor,
    q_slog: torch.Tensor,
    accept_uniforms: torch.Tensor,
    draw: DrawFn,
    sigma_orientation: str,
    kappa: float,
    max_tries: int | None = 100,
) -> VerifyResult:
    """One independent decision per token; rejected tokens replaced by a residual sample."""
    ratio = log_acceptance_ratio(x0, p_mu1, p_s1, p_slog, q_mu1, q_s1, q_slog, sigma_orientation, kappa)
    acc = accept(ratio.log_ratio, accept_uniforms)
    rej = torch.nonzero(~acc).squeeze(-1)

    def draw_rejected(attempt: int, active: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return draw(attempt, rej[active])

    res = residual_sample(p_mu1[rej], p_s1[rej], q_mu1[rej], q_s1[rej], ratio.log_factor[rej], draw_rejected, max_tries)
    tokens = x0.clone()
    tokens[rej] = res.x.to(tokens.dtype)
    n = x0.shape[0]
    full = ResidualResult(
        x=tokens,
        tries=torch.zeros(n, dtype=torch.int64, device=x0.device).index_put((rej,), res.tries),
        cap_hit=torch.zeros(n, dtype=torch.bool, device=x0.device).index_put((rej,), res.cap_hit),
    )
    return VerifyResult(tokens=tokens, accepted=acc, ratio=ratio, residual=full)
