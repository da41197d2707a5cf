"""Block verification of a CPU round on the host: :func:`~specray.methods.diffusion.rules.block_verify`'s
arithmetic on NumPy arrays, with the same bits.

On a CPU the loop verifies a few dozen scalars a round (``[n, G]``, G <= gamma), on which each of the tensor
path's ~85 operations costs its dispatch, several times more inside the loop than alone (the model calls
between rounds evict the operations' code). Here every +, -, *, /, comparison and selection is NumPy's
(IEEE float64, correctly rounded, as torch's), and every transcendental is torch's kernel run in place on the
array's own memory (NumPy's and Python's differ from torch's in the last bit): erfc, log, exp, expm1, log1p
give the same bits on any shape; ``sigmoid`` runs on the same ``[n, G]`` shape as the tensor path's, since
its vectorised and scalar kernels differ. Each function mirrors its tensor twin in ``residual.py`` or
``rules.py`` op for op; tests/test_diffusion_block_host.py compares the two paths bit for bit.
"""

from __future__ import annotations

import numpy as np
import torch

from specray.methods.diffusion.residual import _HALF_LOG_2PI, _LOG_HALF, _SQRT_HALF, _TAIL, DELTA_MIN

Array = np.ndarray


def _on(x: Array) -> torch.Tensor:
    """A tensor on ``x``'s memory (``x`` a float64 array this module made): torch's in-place ops on it leave
    their results in ``x``."""
    return torch.from_numpy(x)


def _clamp_max(x: Array, bound: float) -> Array:
    """``torch.clamp(x, max=bound)``: ``x`` kept unless ``bound < x`` (NaN kept)."""
    return np.where(x > bound, bound, x)


def _clamp_min(x: Array, bound: float) -> Array:
    return np.where(x < bound, bound, x)


def _log1mexp(x: Array) -> Array:
    """:func:`~specray.methods.diffusion.residual.log1mexp`."""
    big = x > _LOG_HALF
    if big.all():
        return _large(x)
    small = x.copy()
    _on(small).exp_().neg_().log1p_()
    return small if not big.any() else np.where(big, _large(x), small)


def _large(x: Array) -> Array:
    """``log(-expm1(x))``: log1mexp's branch above -ln 2."""
    out = x.copy()
    _on(out).expm1_().neg_().log_()
    return out


def _log_mills_series(x: Array) -> Array:
    x2 = 1.0 / (x * x)
    out = x2 * (-1 + x2 * (3 + x2 * (-15 + x2 * 105)))
    _on(out).log1p_()
    return out


def _log_ndtr(x: Array, far: Array | None, any_far: bool) -> Array:
    """:func:`~specray.methods.diffusion.residual._log_ndtr`."""
    head = (_clamp_min(x, -_TAIL) if any_far else x) * -_SQRT_HALF
    _on(head).erfc_().mul_(0.5).log_()
    if not any_far:
        return head
    t = _clamp_max(x, -_TAIL)
    log_minus_t = -t
    _on(log_minus_t).log_()
    tail = -0.5 * t * t - log_minus_t - _HALF_LOG_2PI + _log_mills_series(t)
    return np.where(far, tail, head)


def _log_G_at(s: Array, v: Array, delta: Array, log_alpha: Array) -> Array:
    """:func:`~specray.methods.diffusion.residual._log_G_at`."""
    shifted = s - delta
    far_shifted = shifted < -_TAIL
    any_far_shifted = bool(far_shifted.any())
    far = s < -_TAIL
    any_far = any_far_shifted and bool(far.any())
    log_phi_s = _log_ndtr(s, far, any_far)
    inner = _log_ndtr(shifted, far_shifted, any_far_shifted) - log_phi_s - log_alpha
    if any_far:
        t = _clamp_max(s, -_TAIL)
        log1p_ratio = delta / -t
        _on(log1p_ratio).log1p_()
        tail = delta * v - log1p_ratio + _log_mills_series(t - delta) - _log_mills_series(t)
        inner = np.where(far, tail, inner)
    return (log_alpha + log_phi_s) + _log1mexp(_clamp_max(inner, 0.0))


def _log_residual_mass(delta: Array, log_alpha: Array) -> Array:
    """:func:`~specray.methods.diffusion.residual.log_residual_mass`."""
    c = delta / 2 + log_alpha / delta
    v = np.zeros_like(c)
    return _log_G_at(c + v, v, delta, log_alpha)


def running_log_w(log_rho: list[float]) -> list[float]:
    """``[0, min(0, 0 + r_1), ...]``: the columns of log w for one row, as ``torch.clamp(w + r, max=0)``
    makes them (which keeps w, -0.0 and NaN included, unless ``w > 0``)."""
    out = [0.0]
    for r in log_rho:
        w = out[-1] + r
        out.append(0.0 if w > 0.0 else w)
    return out


def block_weights(log_rho: Array, delta: Array, g: Array) -> tuple[Array, Array, Array]:
    """:func:`~specray.methods.diffusion.rules.block_weights` (``log w``, ``h``; both ``[n, G+1]``) and the
    mask of drafted slots ``[n, G]``."""
    n, G = log_rho.shape
    with np.errstate(all="ignore"):  # torch's float arithmetic never warns
        valid = np.arange(G)[None, :] < g[:, None]
        tiny = delta <= DELTA_MIN
        any_tiny = bool(tiny.any())
        if any_tiny:
            log_rho = np.where(tiny, 0.0, log_rho)
        log_w = np.array([running_log_w(row) for row in np.where(valid, log_rho, 0.0).tolist()]).reshape(n, G + 1)
        lw = log_w[:, :G]
        if any_tiny:
            log_R = np.where(tiny, -np.inf, _log_residual_mass(np.where(tiny, 1.0, delta), lw))
        else:
            log_R = _log_residual_mass(delta, lw)
        odds = log_R - _log1mexp(_clamp_max(lw, -1e-300))
        _on(odds).sigmoid_()  # the tensor path's shape: sigmoid's vectorised and scalar kernels differ
        h = np.concatenate([np.where(valid, np.where(lw >= 0, 1.0, odds), 0.0), np.zeros((n, 1))], axis=1)
        rows = np.arange(n)
        h[rows, g] = _on(log_w[rows, g]).exp_().numpy()
    return log_w, h, valid


def block_verify(log_rho: torch.Tensor, delta: torch.Tensor, g: torch.Tensor,
                 eta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`~specray.methods.diffusion.rules.block_verify` of CPU tensors; returns its Verdict's fields
    ``(tau, log_alpha, expected_advance)`` as CPU tensors."""
    gg = g.numpy()
    log_w, h, valid = block_weights(log_rho.numpy(), delta.numpy(), gg)
    n, G = valid.shape
    coins = np.concatenate([np.zeros((n, 1)), eta.numpy()], axis=1)
    index = np.arange(G + 1)[None, :]
    passes = (coins <= h) & (index <= gg[:, None])
    passes[:, 0] = True
    tau = (passes * index).max(axis=1)
    w = log_w[:, :G].copy()
    _on(w).exp_()
    log_alpha = np.where(tau < gg, log_w[np.arange(n), tau], 0.0)
    return _on(tau), _on(log_alpha), _on(np.where(valid, w, 0.0)).sum(dim=1)
