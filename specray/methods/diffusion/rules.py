"""Token and block verification of drafted Gaussian denoising steps (spec_diffusion.md sections 3 and 5).

All inputs are per-row, per-draft-position scalars on ``[n, G]`` float64 tensors;
positions ``j >= g[row]`` are padding and never used. Column ``j`` is the transition out
of draft state ``y_j`` (step ``k + j``): ``Delta_j = B (eps_draft_j - eps_target_j) / sigma``,
``log rho_j = log q_j(y_{j+1}) - log p_j(y_{j+1}) = -<Delta_j, xi_j> - |Delta_j|^2 / 2``.

Both rules return ``tau``: the number of accepted draft steps (``tau == g`` means the whole
block was accepted; otherwise the state ``y_{tau+1}`` is replaced by a residual draw whose
weight is ``exp(log_alpha)``: 1 for token verification, ``w_tau`` for block verification).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray.methods.diffusion.residual import (
    DELTA_MIN,
    KERNEL_CONSTANTS,
    all_or_none,
    any_of,
    log1mexp,
    log_residual_mass,
)
from specray.models import cpu_kernels


@dataclass
class Verdict:
    tau: torch.Tensor  # int64 [n], accepted draft steps
    log_alpha: torch.Tensor  # float64 [n], log weight of the residual at the cut (0 when tau == g)
    expected_advance: torch.Tensor  # float64 [n], Rao-Blackwellised advance sum_{i<g} w_i (block) or v_i (token)


def log_ratio(Delta: torch.Tensor, xi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log rho, delta)`` on ``[n, G]`` from ``Delta, xi`` of shape ``[n, G, ...]`` (float64 sums).

    Written as ``-<Delta, xi> - delta^2/2`` rather than a difference of squared norms, which
    would cancel catastrophically in high dimension (spec 3.1).
    """
    D = Delta.flatten(2).to(torch.float64)
    X = xi.flatten(2).to(torch.float64)
    sq = (D * D).sum(dim=2)
    return -(D * X).sum(dim=2) - 0.5 * sq, torch.sqrt(sq)


def _valid(g: torch.Tensor, G: int) -> torch.Tensor:
    return torch.arange(G, device=g.device)[None, :] < g[:, None]


def token_verify(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, eta: torch.Tensor) -> Verdict:
    """Sequential acceptance: step j is accepted iff ``eta_j <= min(1, rho_j)``; stop at the first rejection.
    On a CPU one C++ call where the process has loaded specray's kernels (``csrc/verdicts.cpp``, the same values)."""
    kernel = _kernel(log_rho, "token_verdict")
    if kernel is not None:
        tau, log_alpha, expected = kernel(log_rho, delta, g, eta, DELTA_MIN)
        if tau is not None:  # None: a call it does not serve (e.g. float32 coins, a strided input)
            return Verdict(tau=tau, log_alpha=log_alpha, expected_advance=expected)
    return _token_verify_tensors(log_rho, delta, g, eta)


def _token_verify_tensors(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, eta: torch.Tensor) -> Verdict:
    """:func:`token_verify` by torch's operations."""
    n, G = log_rho.shape
    log_rho = torch.where(delta <= DELTA_MIN, torch.zeros_like(log_rho), log_rho)  # identical kernels
    valid = _valid(g, G)
    accepted = (torch.log(eta) <= log_rho) & valid  # the drafted slots form a prefix: tau is its accepted run
    tau = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
    log_v = torch.cumsum(torch.where(valid, log_rho.clamp(max=0.0), torch.zeros_like(log_rho)), dim=1)
    v_prev = torch.cat([torch.ones(n, 1, dtype=torch.float64, device=log_rho.device), log_v[:, :-1].exp()], dim=1)
    expected = torch.where(valid, v_prev, torch.zeros_like(v_prev)).sum(dim=1)
    return Verdict(tau=tau, log_alpha=torch.zeros(n, dtype=torch.float64, device=log_rho.device), expected_advance=expected)


def block_weights(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log w`` on ``[n, G+1]`` (``w_0 = 1``, ``w_j = min(1, w_{j-1} rho_j)``) and ``h`` on ``[n, G+1]``.

    ``h_i = R_i / (R_i + 1 - w_i)`` for ``i < g`` with ``R_i = Z_{w_i}(delta_{i+1})`` the mass of
    ``(w_i q - p)^+`` (``h_i = 1`` when ``w_i = 1``), and ``h_g = w_g``; entries past ``g`` are 0.
    """
    valid = _valid(g, log_rho.shape[1])
    return _block_weights(log_rho, delta, g, valid, all_or_none(valid))


def _keep(mask: torch.Tensor, uniform: bool | None, x: torch.Tensor) -> torch.Tensor:
    """``where(mask, x, 0)``; ``uniform``: :func:`all_or_none` of the mask (True: x itself, the same values)."""
    return x if uniform else torch.where(mask, x, torch.zeros_like(x))


def _block_weights(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, valid: torch.Tensor,
                   all_valid: bool | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`block_weights` given ``valid = _valid(g, G)`` and :func:`all_or_none` of it."""
    n, G = log_rho.shape
    tiny = delta <= DELTA_MIN
    any_tiny = any_of(tiny)  # without identical kernels the wheres on tiny would keep their other branch
    if any_tiny:
        log_rho = torch.where(tiny, torch.zeros_like(log_rho), log_rho)
    # Past g, log rho = 0 keeps w: log w is +0 or negative, so min(0, log w + 0) is log w, bit for bit.
    if log_rho.is_cpu:  # the same IEEE additions and clamps on Python floats, not 2 G ops on n-element columns
        log_w = torch.tensor([_running_log_w(row) for row in _keep(valid, all_valid, log_rho).tolist()],
                             dtype=torch.float64).reshape(n, G + 1)
    else:
        log_rho_cols = _keep(valid, all_valid, log_rho).unbind(1)
        cols = [torch.zeros(n, dtype=torch.float64, device=log_rho.device)]
        for j in range(G):
            cols.append(torch.clamp(cols[j] + log_rho_cols[j], max=0.0))
        log_w = torch.stack(cols, dim=1)
    lw = log_w[:, :G]
    if any_tiny:
        safe_delta = torch.where(tiny, torch.ones_like(delta), delta)
        log_R = torch.where(tiny, torch.full_like(delta, -torch.inf), log_residual_mass(safe_delta, lw))
    else:
        log_R = log_residual_mass(delta, lw)
    log_one_minus_w = log1mexp(torch.clamp(lw, max=-1e-300))
    h_inner = torch.where(lw >= 0, torch.ones_like(lw), torch.sigmoid(log_R - log_one_minus_w))
    h = torch.cat([_keep(valid, all_valid, h_inner), torch.zeros_like(log_w[:, :1])], dim=1)
    rows = torch.arange(n, device=g.device)
    h[rows, g] = log_w[rows, g].exp()
    return log_w, h


def _running_log_w(log_rho: list[float]) -> list[float]:
    """``[0, min(0, 0 + r_1), ...]``: the columns of log w for one row, as ``torch.clamp(w + r, max=0)``
    makes them (which keeps w, -0.0 and NaN included, unless ``w > 0``)."""
    out = [0.0]
    for r in log_rho:
        w = out[-1] + r
        out.append(0.0 if w > 0.0 else w)
    return out


def block_verify(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, eta: torch.Tensor) -> Verdict:
    """Block verification (S25 Algorithm 2 with the Gaussian closed form of R_i, spec 5.1).

    ``eta[:, j]`` is the coin of index ``i = j + 1`` (``eta_0 = 0``, so ``tau = 0`` always qualifies);
    ``tau = max{i in 0..g : eta_i <= h_i}``; the residual at the cut has weight ``alpha = w_tau``.
    On a CPU one C++ call where the process has loaded specray's kernels (``csrc/verdicts.cpp``, the same values).
    """
    kernel = _kernel(log_rho, "block_verdict")
    if kernel is not None:
        tau, log_alpha, expected, _ = kernel(log_rho, delta, g, eta, KERNEL_CONSTANTS, DELTA_MIN)
        if tau is not None:  # None: a call it does not serve (e.g. float32 coins, a strided input)
            return Verdict(tau=tau, log_alpha=log_alpha, expected_advance=expected)
    return _block_verify_tensors(log_rho, delta, g, eta)


def _block_verify_tensors(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor, eta: torch.Tensor) -> Verdict:
    """:func:`block_verify` by torch's operations."""
    n, G = log_rho.shape
    valid = _valid(g, G)
    all_valid = all_or_none(valid)
    log_w, h = _block_weights(log_rho, delta, g, valid, all_valid)
    coins = torch.cat([torch.zeros(n, 1, dtype=torch.float64, device=eta.device), eta.to(torch.float64)], dim=1)
    index = torch.arange(G + 1, device=g.device)[None, :]
    passes = (coins <= h) & (index <= g[:, None])
    passes[:, 0] = True
    tau = (passes * index).max(dim=1).values  # index where it passes, else 0
    rows = torch.arange(n, device=g.device)
    expected = _keep(valid, all_valid, log_w[:, :G].exp()).sum(dim=1)
    log_alpha = torch.where(tau < g, log_w[rows, tau], torch.zeros_like(log_w[:, 0]))
    return Verdict(tau=tau, log_alpha=log_alpha, expected_advance=expected)


def _kernel(log_rho: torch.Tensor, name: str) -> Callable | None:
    """The C++ verdict ``name`` for CPU tensors, where the process has loaded specray's kernels (never building them
    here) and it gave its tensor path's values in this process."""
    if not log_rho.is_cpu or cpu_kernels.loaded() is None or not cpu_kernels.ENABLED or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked(name, 0, _token_kernel_matches if name == "token_verdict" else _block_kernel_matches)


def _token_kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`_token_verify_tensors`' tau, log alpha and expected advance on
    :func:`_check_rounds`, bit for bit but NaN for NaN."""
    for log_rho, delta, g, eta in _check_rounds():
        got, want = kernel(log_rho, delta, g, eta, DELTA_MIN), _token_verify_tensors(log_rho, delta, g, eta)
        if got[0] is None or not _same_verdict(got, want):
            return False
    return True


def _block_kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`_block_verify_tensors`' tau, log alpha and expected advance, and h (which
    decides tau only through comparisons with the coins), on :func:`_check_rounds`, bit for bit but NaN for NaN."""
    for log_rho, delta, g, eta in _check_rounds():
        got = kernel(log_rho, delta, g, eta, KERNEL_CONSTANTS, DELTA_MIN)
        if got[0] is None or not _same_verdict(got, _block_verify_tensors(log_rho, delta, g, eta)):
            return False
        if not cpu_kernels.same_values(got[3], block_weights(log_rho, delta, g)[1]):
            return False
    return True


def _same_verdict(got: tuple[torch.Tensor, ...], want: Verdict) -> bool:
    return all(cpu_kernels.same_values(a, b) for a, b in zip(got, (want.tau, want.log_alpha, want.expected_advance)))


def _check_rounds() -> list[tuple[torch.Tensor, ...]]:
    """``(log_rho, delta, g, eta)`` of 48 random rounds (seed 5; 1 to 32 rows, block lengths 1 to 7, ragged and
    full; delta log-normal over eight decades, so log Phi's tail branches on either side; identical kernels,
    positive log rho) and 81 edge rounds (zero, subnormal, huge and infinite delta and log rho, -0.0 among them)."""
    gen = torch.Generator().manual_seed(5)
    rounds = []
    for i, (n, G) in enumerate([(n, G) for n in (1, 3, 32) for G in (1, 2, 5, 7)] * 4):
        delta = torch.exp(3 * torch.randn(n, G, dtype=torch.float64, generator=gen))
        log_rho = -delta * torch.randn(n, G, dtype=torch.float64, generator=gen) - 0.5 * delta * delta
        delta[0, 0] = 1e-12 if i % 5 == 0 else delta[0, 0]
        log_rho[:, 0] = 0.3 if i % 7 == 0 else log_rho[:, 0]
        g = torch.full((n,), G) if i % 3 == 0 else torch.randint(1, G + 1, (n,), generator=gen)
        rounds.append((log_rho, delta, g, torch.rand(n, G, dtype=torch.float64, generator=gen)))
    edges = [0.0, -0.0, 1e-300, -0.3, 2.0, -1e300, -math.inf, 40.0, math.inf]
    for d, r in itertools.product(edges, edges):
        log_rho, delta = (torch.tensor([[a, b]], dtype=torch.float64) for a, b in ((r, -0.5), (abs(d), 0.7)))
        rounds.append((log_rho, delta, torch.tensor([2]), torch.full((1, 2), 0.5, dtype=torch.float64)))
    return rounds
