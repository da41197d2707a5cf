"""Verification rules for speculative decoding of discrete tokens (spec discrete_sd.md §1–§5).

One round, batched over rows: every row b has γ drafted tokens ``drafts[b]``, the draft
distributions they were sampled from ``Q[b, i]`` (i = 0..γ−1) and the target distributions
``P[b, i]`` (i = 0..γ, the last one is the bonus position). Rows decide independently, so
``n_accepted`` is ragged. All inputs are the *processed* sampler distributions (CFG,
temperature, top-k, top-p; spec §0.1).

Rules (``RULES``):

* ``"sd"`` — standard speculative sampling (Leviathan et al.; Chen et al.), exact (§1).
* ``"block"`` — block verification (Sun et al. 2025), exact, never fewer tokens than ``sd`` in
  expectation (§2). All positions are examined; τ is the *last* position that passes.
* ``"lantern"`` — LANTERN (δ-mode) / LANTERN++ (λ-mode) relaxed acceptance over latent
  neighbourhoods (§3), chain version.
* ``"cool_sd"`` — COOL-SD annealed relaxation ``ω_i = δ·exp(−ν i − μ)`` with the G* residual (§4).
* ``"uniform_rsd"`` — the same with ``ω_i = δ`` (§4.5 ablation).

Arithmetic: inputs may be float32; every decision is made in float64, after renormalising each
P and Q row in float64 (the categorical sampler normalises by the row total as well, so the
renormalised Q is exactly the law the draft was drawn from). Comparisons are strict
``u < acceptance probability`` (§5.2), so a zero acceptance never passes even when the
generator returns exactly 0. The correction / bonus token is drawn with
:func:`specray.rng.sample_categorical` from ``u_residual``.

Defaults chosen for the spec's open points (documented here, configurable in :class:`RuleParams`):

* COOL-SD μ (spec §4.1, [?]): ``mu=None`` means mean normalisation,
  ``μ = log((1/γ) Σ_{i=1..γ} e^{−ν i})`` so that the mean of ω over the round equals δ (and
  UNIFORM-RSD at the same δ has the same mean multiplier). Pass a float to fix μ instead.
  ν defaults to 0.7. Residual: always the general G* = Norm([P − Q·f]_+), never hard-coded
  to the vanilla residual (positions with ω < 1 need it).
* LANTERN residual (spec §3.3): ``residual="gstar"`` (default) is G* = Norm([P_j − min(Q_j, P̃_j)]_+)
  with every vocabulary entry's own neighbourhood. ``residual="official"`` is the released
  LlamaGen file's chain analogue: if the rejected draft used neighbour mass (m* ≥ 1), Q_j is
  zeroed on the k+1 nearest neighbours of d_j (d_j keeps its Q mass, no renormalisation) and
  the residual is Norm([P_j − Q'_j]_+) with a uniform fallback when it has no mass; otherwise the
  vanilla residual. (The Lumina-mGPT file's variant, zeroing P instead, is not implemented.)
  When the neighbour table has fewer than k+1 columns, all available neighbours are zeroed.
  As in the released code, "m* >= 1" also counts neighbours of zero mass (their cumulative mass
  is <= any budget), so with top-k zeros the official residual differs from ``sd`` even at λ = 1;
  the G* residual reduces to ``sd`` exactly whenever k = 0, λ = 1 or δ = 0.
* LANTERN mode: explicit ``mode`` ("lambda": budget (λ−1)·P(x), λ ≥ 1; "delta": budget δ,
  0 ≤ δ ≤ 1) rather than the code's switch on δ > 1. ``forbid_zero_target_mass`` (default
  False, the faithful behaviour) sets P̃(x) = 0 wherever P(x) = 0. The bonus is unrelaxed.
* Zero-mass residual guards: P_j for the exact rules, COOL-SD and LANTERN G* (the residual can
  only be empty where rejection has probability 0, spec §1/§2/§4.2).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray.methods.discrete import cpu_rounds
from specray.methods.discrete import params as method_params
from specray.methods.discrete.lantern import (
    LANTERN_MODES,
    neighbours_from_embeddings,
    relaxed_target_mass,
    relaxed_target_mass_all_tokens,
)
from specray.rng import sample_categorical

RULES = ("sd", "block", "lantern", "cool_sd", "uniform_rsd")
LANTERN_RESIDUALS = ("gstar", "official")
_CHAIN_RULES = ("sd", "lantern", "cool_sd", "uniform_rsd")
_F64 = torch.float64


@dataclass
class RuleParams:
    """Parameters of the relaxed rules; ``sd`` and ``block`` use none of them."""

    # LANTERN / LANTERN++
    k: int = 0
    lam: float | None = None
    delta: float | None = None  # LANTERN δ-mode budget; COOL-SD / UNIFORM-RSD δ
    mode: str = "lambda"
    residual: str = "gstar"
    forbid_zero_target_mass: bool = False
    neighbours: torch.Tensor | None = None  # int64 [V, kmax], nearest first, self excluded
    # COOL-SD
    nu: float = 0.7
    mu: float | None = None  # None: mean normalisation (module docstring)


@dataclass
class VerifyOutput:
    n_accepted: torch.Tensor  # int64 [B], accepted drafts, 0..gamma
    next_token: torch.Tensor  # int64 [B], correction (n_accepted < gamma) or bonus token
    accepted_mask: torch.Tensor  # bool [B, gamma], positions < n_accepted


@dataclass
class VerifyDetails:
    """What a round's decision was computed from; used by the exact-enumeration tests."""

    pass_probs: torch.Tensor  # float64 [B, gamma]; row b passes position i iff u_accept[b, i] < this
    next_token_probs: torch.Tensor  # float64 [B, V], normalised law the next token was drawn from
    residual_fallback: torch.Tensor  # bool [B], the residual had zero mass and a guard was used


# --------------------------------------------------------------------------------------------
# validation


def validate_params(rule: str, params: RuleParams) -> None:
    """Raise ValueError naming the bad field and its allowed values."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "lantern":
        if not isinstance(params.k, int) or params.k < 0:
            raise ValueError(f"params.k must be an int >= 0 for rule 'lantern', got {params.k!r}")
        if params.mode not in LANTERN_MODES:
            raise ValueError(f"params.mode must be one of {LANTERN_MODES}, got {params.mode!r}")
        if params.mode == "lambda" and (params.lam is None or params.lam < 1.0):
            raise ValueError(f"params.lam must be a float >= 1 in lantern mode 'lambda', got {params.lam!r}")
        if params.mode == "delta" and (params.delta is None or not 0.0 <= params.delta <= 1.0):
            raise ValueError(f"params.delta must be in [0, 1] in lantern mode 'delta', got {params.delta!r}")
        if params.residual not in LANTERN_RESIDUALS:
            raise ValueError(f"params.residual must be one of {LANTERN_RESIDUALS}, got {params.residual!r}")
    if rule in ("cool_sd", "uniform_rsd"):
        if params.delta is None or params.delta < 0.0:
            raise ValueError(f"params.delta must be a float >= 0 for rule {rule!r}, got {params.delta!r}")
        if rule == "cool_sd" and params.nu is None:
            raise ValueError("params.nu must be a float for rule 'cool_sd', got None")


def _validate_shapes(P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
                     u_accept: torch.Tensor, u_residual: torch.Tensor) -> None:
    if P.dim() != 3:
        raise ValueError(f"P must have shape [B, gamma+1, V], got {tuple(P.shape)}")
    batch, positions, vocab = P.shape
    gamma = positions - 1
    if gamma < 1:
        raise ValueError(f"P must cover gamma+1 >= 2 positions, got {positions}")
    if tuple(Q.shape) != (batch, gamma, vocab):
        raise ValueError(f"Q must have shape [B={batch}, gamma={gamma}, V={vocab}], got {tuple(Q.shape)}")
    if tuple(drafts.shape) != (batch, gamma):
        raise ValueError(f"drafts must have shape [B={batch}, gamma={gamma}], got {tuple(drafts.shape)}")
    if tuple(u_accept.shape) != (batch, gamma):
        raise ValueError(f"u_accept must have shape [B={batch}, gamma={gamma}], got {tuple(u_accept.shape)}")
    if tuple(u_residual.shape) != (batch,):
        raise ValueError(f"u_residual must have shape [B={batch}], got {tuple(u_residual.shape)}")


# --------------------------------------------------------------------------------------------
# building blocks (public so tests and loops can inspect what a round decides from)


def normalise(dist: torch.Tensor) -> torch.Tensor:
    """Rows as float64 distributions summing to 1."""
    d = dist.to(_F64)
    return d / d.sum(dim=-1, keepdim=True)


def cool_sd_omegas(gamma: int, delta: float, nu: float = 0.7, mu: float | None = None) -> torch.Tensor:
    """COOL-SD schedule ``ω_i = δ·exp(−ν i − μ)``, i = 1..γ, float64 ``[γ]``.

    ``mu=None`` is mean normalisation (``mean(ω) = δ``), the spec's default for its open μ.
    """
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    positions = torch.arange(1, gamma + 1, dtype=_F64)
    if mu is None:
        mu = math.log(torch.exp(-nu * positions).mean().item())
    return float(delta) * torch.exp(-nu * positions - float(mu))


def rule_omegas(rule: str, gamma: int, params: RuleParams) -> torch.Tensor:
    """Per-position multipliers ω of the COOL-SD family (ones for the other rules)."""
    if rule == "cool_sd":
        return cool_sd_omegas(gamma, params.delta, params.nu, params.mu)
    if rule == "uniform_rsd":
        return torch.full((gamma,), float(params.delta), dtype=_F64)
    return torch.ones(gamma, dtype=_F64)


@functools.lru_cache(maxsize=256)
def _cached_omegas(rule: str, gamma: int, delta: float | None, nu: float | None, mu: float | None,
                   device: torch.device) -> torch.Tensor:
    """:func:`rule_omegas` on ``device``, built once per schedule (the loops call verify every round).

    Read-only: callers must not modify the returned tensor.
    """
    return rule_omegas(rule, gamma, RuleParams(delta=delta, nu=nu, mu=mu)).to(device)


def _omegas_on(rule: str, gamma: int, params: RuleParams, device: torch.device) -> torch.Tensor:
    return _cached_omegas(rule, gamma, params.delta, params.nu, params.mu, device)


def _ratio_prob(numerator: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """min(1, numerator / q), with q = 0 meaning 'accept iff numerator > 0'."""
    # numerator / 0 is inf or nan there, but torch.where discards it: same values as dividing
    # by a substituted 1, two kernels fewer (this runs once per round and per block weight). The
    # bool branch is promoted to 1.0 / 0.0 by where itself.
    return torch.where(q > 0, numerator / q, numerator > 0).clamp_(max=1.0)


def _at_draft(dist: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """``dist[b, i, drafts[b, i]]`` for ``dist [B, >= γ, V]`` and ``drafts [B, γ]``."""
    # One indexing op with cached row and column indices (a gather needs four: slice, unsqueeze, squeeze).
    batch, gamma = drafts.shape
    return dist[_rows_column(batch, dist.device), _columns_row(gamma, dist.device), drafts]


def relaxed_draft_mass(rule: str, P: torch.Tensor, drafts: torch.Tensor, params: RuleParams) -> torch.Tensor:
    """Target-side mass the chain rules compare against Q(d_i): ``[B, γ]`` float64.

    P is the normalised float64 ``[B, γ+1, V]``. sd: P_i(d_i); cool_sd/uniform_rsd: ω_i P_i(d_i);
    lantern: P̃_i(d_i).
    """
    gamma = drafts.shape[1]
    if rule == "lantern":
        relaxed, _ = relaxed_target_mass(
            P[:, :gamma], drafts, params.neighbours, params.k, params.mode, params.lam,
            params.delta, params.forbid_zero_target_mass,
        )
        return relaxed
    p_draft = _at_draft(P, drafts)
    if rule == "sd":  # ω = 1: the product would return p_draft bit for bit
        return p_draft
    return _omegas_on(rule, gamma, params, P.device) * p_draft


def block_weights(P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """Capped cumulative likelihood ratios ``w_0 = 1, w_i = min(1, w_{i−1} P_i(d_i)/Q_i(d_i))``: ``[B, γ+1]``."""
    p_draft = _at_draft(P, drafts)
    q_draft = _at_draft(Q, drafts)
    weights = [torch.ones_like(p_draft[:, 0])]
    # Columns as views, one call each, instead of an index op per position.
    for p_i, q_i, q_positive in zip(p_draft.unbind(1), q_draft.unbind(1), (q_draft > 0).unbind(1)):
        # min(1, w·P/Q), Q = 0 capping at 1 when w·P > 0 (see _ratio_prob); (w·P)/Q, not w·(P/Q),
        # is the rounding of the scalar recursion. A zero weight stays zero: 0·P = 0 for the finite,
        # normalised P this takes, so no separate mask is needed.
        numerator = weights[-1] * p_i
        weights.append(torch.where(q_positive, numerator / q_i, numerator > 0).clamp_(max=1.0))
    return torch.stack(weights, dim=1)


def block_stop_probs(P: torch.Tensor, Q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``h_1 … h_γ`` of block verification (spec §2): ``[B, γ]`` float64."""
    gamma = Q.shape[1]
    w = weights[:, :gamma].unsqueeze(-1)  # w_0 .. w_{γ−1}
    # Z_i pairs w_i with the distributions of 1-based position i+1, i.e. 0-based index i.
    residual_mass = (w * P[:, :gamma] - Q).clamp(min=0).sum(-1)  # Z_0 .. Z_{γ−1}
    z = residual_mass[:, 1:]
    denominator = z + 1.0 - weights[:, 1:gamma]
    # z / denominator is only kept where denominator > 0 (see _ratio_prob).
    inner = torch.where(denominator > 0, z / denominator, 1.0).clamp_(0.0, 1.0)
    return torch.cat([inner, weights[:, gamma:]], dim=1)


def acceptance_probs(rule: str, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
                     params: RuleParams) -> torch.Tensor:
    """Pass probabilities ``[B, γ]`` float64; row b passes position i iff ``u_accept[b, i] <`` this.

    Chain rules: the conditional acceptance probability ``min(1, P̃_i(d_i)/Q_i(d_i))`` (stop at the
    first failure). Block: the stop probabilities h_i (τ = last passing position).
    P and Q must be normalised float64 (see :func:`normalise`).
    """
    return _acceptance_probs(rule, P, Q, drafts, params)[0]


def _acceptance_probs(rule: str, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
                      params: RuleParams) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`acceptance_probs` plus block's weights (None for the chain rules), reused by the residual."""
    if rule == "block":
        weights = block_weights(P, Q, drafts)
        return block_stop_probs(P, Q, weights), weights
    return _ratio_prob(relaxed_draft_mass(rule, P, drafts, params), _at_draft(Q, drafts)), None


def decide_accepted(rule: str, passed: torch.Tensor) -> torch.Tensor:
    """Number of accepted drafts ``[B]`` from per-position pass events ``[B, γ]``."""
    if rule == "block":
        positions = _arange(passed.shape[1] + 1, passed.device)[1:]
        return (passed.to(torch.int64) * positions).max(dim=1).values  # last passing index, NOT a prefix
    return torch.cumprod(passed, dim=1, dtype=torch.int64).sum(dim=1)


def _row_at(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[b, index[b]]`` for ``x[B, L, ...]`` (one indexing op, the row indices cached)."""
    return x[_arange(x.shape[0], x.device), index]


def correction_dist(rule: str, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
                    n_accepted: torch.Tensor, params: RuleParams,
                    block_w: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Unnormalised law of the token emitted after ``n_accepted`` drafts, and a fallback flag.

    Returns ``(dist [B, V] float64, fallback [B] bool)``: the bonus ``P_{γ+1}`` where all γ
    drafts were accepted, otherwise the rule's residual at position j = n_accepted (0-based);
    ``fallback`` marks rows whose residual had zero mass and was replaced by the guard.
    ``block_w``: block's weights when already computed (:func:`block_weights`), else recomputed.
    """
    gamma = drafts.shape[1]
    is_bonus = n_accepted == gamma
    j = n_accepted.clamp(max=gamma - 1)
    p_j = _row_at(P, n_accepted)  # the bonus position for bonus rows
    q_j = _row_at(Q, j)
    if rule == "block":
        weights = block_weights(P, Q, drafts) if block_w is None else block_w
        w_tau = _row_at(weights, n_accepted).unsqueeze(-1)
        residual, guard = (w_tau * p_j - q_j).clamp_(min=0), p_j
    else:
        omega = None
        if rule in ("cool_sd", "uniform_rsd"):
            omega = _omegas_on(rule, gamma, params, P.device)[j].unsqueeze(-1)
        # Only LANTERN's official residual reads the rejected draft.
        draft_j = _row_at(drafts, j) if rule == "lantern" and params.residual == "official" else None
        residual, guard = rejection_residual(rule, p_j, q_j, draft_j, params, omega)
    empty = residual.sum(-1) <= 0
    fallback = empty & ~is_bonus
    if guard is p_j:  # bonus and fallback rows both take p_j: one where
        return torch.where((empty | is_bonus).unsqueeze(-1), p_j, residual), fallback
    residual = torch.where(fallback.unsqueeze(-1), guard, residual)
    return torch.where(is_bonus.unsqueeze(-1), p_j, residual), fallback


def rejection_residual(rule: str, p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor | None, params: RuleParams,
                       omega: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """What a chain rule (not block) resamples from after rejecting ``draft``: ``[p − q·f]_+``, unnormalised.

    ``p``, ``q`` ``[..., V]`` the target and draft laws at the rejected position (normalised float64),
    ``draft [...]`` the rejected token (read by LANTERN's official residual only), ``omega [..., 1]`` the COOL-SD multiplier there. Returns
    ``(residual, guard)``: the guard is what to sample from where the residual has no mass.
    Shared by the chain rules and the tree's per-child recursion (``tree_rules``).
    """
    if rule == "sd":
        return (p - q).clamp_(min=0), p
    if rule in ("cool_sd", "uniform_rsd"):
        return (p - torch.minimum(q, omega * p)).clamp_(min=0), p
    if rule != "lantern":
        raise ValueError(f"rule {rule!r} has no per-position residual; allowed: sd, lantern, cool_sd, uniform_rsd")
    if params.residual == "gstar":
        relaxed = relaxed_target_mass_all_tokens(
            p.reshape(-1, p.shape[-1]), params.neighbours, params.k, params.mode, params.lam, params.delta,
            params.forbid_zero_target_mass,
        ).reshape(p.shape)
        return (p - torch.minimum(q, relaxed)).clamp(min=0), p
    return _lantern_official_residual(p, q, draft, params)


def _lantern_official_residual(p_j: torch.Tensor, q_j: torch.Tensor, draft_j: torch.Tensor,
                               params: RuleParams) -> tuple[torch.Tensor, torch.Tensor]:
    """LlamaGen-file residual: zero Q on the k+1 nearest neighbours of d_j when m* >= 1."""
    _, m_star = relaxed_target_mass(
        p_j, draft_j, params.neighbours, params.k, params.mode, params.lam, params.delta,
        params.forbid_zero_target_mass,
    )
    used_neighbours = (m_star >= 1).unsqueeze(-1)
    vanilla = (p_j - q_j).clamp(min=0)
    if params.k == 0:
        return vanilla, p_j
    zeroed_ids = params.neighbours[:, : params.k + 1].to(p_j.device)[draft_j]  # [B, <=k+1]
    q_masked = q_j.scatter(-1, zeroed_ids, 0.0)
    official = (p_j - q_masked).clamp(min=0)
    uniform = torch.full_like(p_j, 1.0 / p_j.shape[-1])
    return (torch.where(used_neighbours, official, vanilla),
            torch.where(used_neighbours, uniform, p_j))


# --------------------------------------------------------------------------------------------
# the round


def _as(x: torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``x.to(device, dtype)``, skipping the call (a dispatch per round) when it would be a no-op."""
    return x if x.dtype == dtype and x.device == device else x.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=64)
def _arange(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` built once per (n, device); read-only."""
    return torch.arange(n, device=device)


@functools.lru_cache(maxsize=64)
def _rows_column(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)[:, None]``, built once; read-only."""
    return _arange(n, device)[:, None]


@functools.lru_cache(maxsize=64)
def _columns_row(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)[None, :]``, built once; read-only."""
    return _arange(n, device)[None, :]

CorrectionFn = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _verify_impl(rule: str, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
                 u_accept: torch.Tensor, u_residual: torch.Tensor, params: RuleParams,
                 correction_fn: CorrectionFn = correction_dist,
                 validate: bool = True) -> tuple[VerifyOutput, VerifyDetails]:
    """The round; ``correction_fn`` exists only so tests can inject a wrong residual (negative control).
    ``validate=False``: the caller vouches for the parameters (validated once) and the shapes."""
    if validate:
        validate_params(rule, params)
        _validate_shapes(P, Q, drafts, u_accept, u_residual)
    device = P.device
    P64, Q64 = normalise(P), normalise(_as(Q, Q.dtype, device))
    drafts = _as(drafts, torch.int64, device)
    pass_probs, weights = _acceptance_probs(rule, P64, Q64, drafts, params)
    passed = _as(u_accept, _F64, device) < pass_probs
    n_accepted = decide_accepted(rule, passed)
    if correction_fn is correction_dist:  # block reuses its weights instead of recomputing them
        dist, fallback = correction_dist(rule, P64, Q64, drafts, n_accepted, params, block_w=weights)
    else:
        dist, fallback = correction_fn(rule, P64, Q64, drafts, n_accepted, params)
    dist = dist / dist.sum(-1, keepdim=True)
    next_token = sample_categorical(dist, _as(u_residual, _F64, device))
    gamma = drafts.shape[1]
    accepted_mask = _columns_row(gamma, device) < n_accepted.unsqueeze(1)
    output = VerifyOutput(n_accepted=n_accepted, next_token=next_token, accepted_mask=accepted_mask)
    return output, VerifyDetails(pass_probs=pass_probs, next_token_probs=dist, residual_fallback=fallback)


def verify_with_details(rule: str, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
                        u_accept: torch.Tensor, u_residual: torch.Tensor,
                        params: RuleParams | None = None) -> tuple[VerifyOutput, VerifyDetails]:
    """:func:`verify` plus the pass probabilities and the next-token law it used."""
    return _verify_impl(rule, P, Q, drafts, u_accept, u_residual, params or RuleParams())


def verify(rule: str, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor,
           u_accept: torch.Tensor, u_residual: torch.Tensor,
           params: RuleParams | None = None) -> VerifyOutput:
    """Decide one speculative round for every row.

    Args:
        rule: one of :data:`RULES`.
        P: target distributions ``[B, γ+1, V]`` (processed; float32 or float64).
        Q: draft distributions ``[B, γ, V]``, the exact vectors the drafts were sampled from.
        drafts: int64 ``[B, γ]``.
        u_accept: float64 uniforms ``[B, γ]``, one per draft position (block uses all of them).
        u_residual: float64 uniforms ``[B]`` for the correction / bonus draw.
        params: rule parameters (see :class:`RuleParams`).
    """
    return verify_with_details(rule, P, Q, drafts, u_accept, u_residual, params)[0]


# --------------------------------------------------------------------------------------------
# what a method's parameters make of the rules (the family table's rule factory)

Verifier = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], VerifyOutput]


def rule_params_for(params: method_params.Speculative, vocab_size: int | None = None,
                    embeddings: torch.Tensor | None = None) -> RuleParams:
    """:class:`RuleParams` of a speculative method (LANTERN's neighbour table built from ``embeddings``)."""
    if isinstance(params, method_params.Lantern):
        if vocab_size is not None and not params.k <= vocab_size - 1:
            raise ValueError(f"parameter 'k' must be in [0, {vocab_size - 1}] (vocabulary {vocab_size}), got {params.k}")
        rule_params = RuleParams(k=params.k, lam=params.lam, delta=params.delta, mode=params.mode,
                                 residual=params.residual, forbid_zero_target_mass=params.forbid_zero_target_mass)
        if embeddings is not None and params.k > 0:
            # k + 1 columns: the official residual zeroes the k+1 nearest neighbours (spec §3.3);
            # the relaxed mass reads the first k.
            columns = min(params.k + 1, embeddings.shape[0] - 1)
            rule_params.neighbours = neighbours_from_embeddings(embeddings.float(), columns,
                                                                normalize=params.normalize_embeddings)
        return rule_params
    if isinstance(params, method_params.CoolSD):
        mu = params.mu
        if mu is None:  # the mean-normalised mu of the full round, fixed for shortened last rounds
            positions = torch.arange(1, params.draft_length + 1, dtype=torch.float64)
            mu = math.log(torch.exp(-params.nu * positions).mean().item())
        return RuleParams(delta=params.delta, nu=params.nu, mu=mu)
    if isinstance(params, method_params.UniformRSD):
        return RuleParams(delta=params.delta)
    return RuleParams()


def neighbourhood_space(info: dict) -> torch.Tensor | None:
    """The vectors LANTERN's neighbourhoods are measured in (spec §3.1): the tokenizer's codebook when
    the pair has one (``info["codebook"]``, e.g. LlamaGen's VQ-16), else the target's input embeddings
    (right for the digits presets, whose identity tokenizer has no codebook)."""
    codebook = info.get("codebook")
    return codebook if codebook is not None else info.get("token_embeddings")


def rule_params_for_pair(params: method_params.Speculative, pair) -> RuleParams:
    """:func:`rule_params_for` with the pair's vocabulary and neighbourhood space, on the pair's device."""
    rule_params = rule_params_for(params, pair.info.get("vocab_size"), neighbourhood_space(pair.info))
    if rule_params.neighbours is not None:
        rule_params.neighbours = rule_params.neighbours.to(pair.device)
    validate_params(params.rule, rule_params)
    return rule_params


def verifier_for(params: method_params.Speculative, pair) -> Verifier:
    """The built-in rules' factory: ``verify(P, Q, drafts, u_accept, u_residual)`` for one run on ``pair``."""
    rule_params = rule_params_for_pair(params, pair)
    # The round kernel per (width, gamma, device), looked up once (a short last round has its own gamma).
    kernel_for = functools.cache(functools.partial(cpu_rounds.round_kernel, params.rule, rule_params))

    def verify_round(P, Q, drafts, u_accept, u_residual) -> VerifyOutput:
        # One C++ call where it serves (on a CPU), with the same values as the operations below.
        decide_round = kernel_for(P.shape[-1], drafts.shape[1], P.device)
        fast = None if decide_round is None else decide_round(P, Q, drafts, u_accept, u_residual)
        if fast is not None:
            return VerifyOutput(*fast)
        # rule_params were validated above; the loops build the shapes verify expects.
        return _verify_impl(params.rule, P, Q, drafts, u_accept, u_residual, rule_params, validate=False)[0]

    return verify_round
