"""The one-step sampler for the generalised residual (alpha q - p)^+ of two isotropic Gaussians.

``q = N(m_q, sigma^2 I)``, ``p = N(m_p, sigma^2 I)``, ``alpha in (0, 1]`` (spec_diffusion.md section 4).
With ``Delta = (m_p - m_q) / sigma``, ``delta = |Delta|``, ``e = Delta / delta`` and
``z = (y - m_q) / sigma``, the residual factorises: ``s = <e, z>`` follows the 1-D law
``psi_alpha(s; delta) ∝ (alpha phi(s) - phi(s - delta))^+`` and ``z_perp ~ N(0, I - e e^T)``
independently. ``s`` is drawn by inverse CDF (fixed 60-step bisection in log space, float64),
so there is no network call and no random run time.

All scalar math (delta, c_alpha, log Z, the bisection) is float64, as the spec requires. On the CPU the
Newton draws are one C++ call where the process has loaded specray's kernels (``csrc/residual_draw.cpp``,
checked against the Python path before it serves), else a single row's draw (the loop's cut row at batch 1)
solves on Python floats (:func:`_sample_psi_one_row`): the same bits either way.
"""

from __future__ import annotations

import math
import struct
import threading
from collections.abc import Callable

import torch

from specray.models import cpu_kernels

# Below this normalised mean gap the two kernels are treated as identical (spec 4.5.1).
DELTA_MIN = 1e-10
BISECTION_STEPS = 60
NEWTON_STEPS = 16
_LOG_HALF = -math.log(2.0)
_TAIL = 30.0
_HALF_LOG_2PI = 0.5 * math.log(2 * math.pi)
_SQRT_HALF = math.sqrt(0.5)  # beyond -_TAIL the left-tail expansion of log Phi is used for differences


def _const(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float64)


# The scalar math's constants as 0-dim float64 tensors (every device takes them as scalars): an op with
# a tensor operand skips wrapping a Python number, which costs as much as the op on the 1-element
# tensors of the loop's one residual draw per round. The same float64 values, so the same results.
_HALF_T, _LOG_HALF_T, _NEG_TAIL_T = _const(0.5), _const(_LOG_HALF), _const(-_TAIL)
_NEG_SQRT_HALF_T, _HALF_LOG_2PI_T, _ZERO_T = _const(-_SQRT_HALF), _const(_HALF_LOG_2PI), _const(0.0)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, accurate on both sides of -ln 2."""
    which = host_test(x, lambda t: t > _LOG_HALF)  # one branch suffices where every element takes it
    if which is not None:
        return torch.expm1(x).neg_().log_() if which else torch.exp(x).neg_().log1p_()
    return torch.where(x > _LOG_HALF_T, torch.expm1(x).neg_().log_(), torch.exp(x).neg_().log1p_())


def any_of(mask: torch.Tensor) -> bool:
    """Whether a branch that only some elements need must be computed: ``mask.any()`` on the CPU, where
    reading it is free; True on an accelerator, where reading it would wait for the device (the branch
    is then computed for every element and ``torch.where`` keeps it where the mask says, the same values)."""
    if not mask.is_cpu:
        return True
    return bool(mask) if mask.numel() == 1 else bool(mask.any())


def all_or_none(mask: torch.Tensor) -> bool | None:
    """On the CPU, True where every element of ``mask`` is set and False where none is (so ``torch.where``
    on it would keep one branch whole, which is then all there is to compute); None otherwise, and
    always on an accelerator (see :func:`any_of`)."""
    if not mask.is_cpu:
        return None
    if mask.numel() == 1:
        return bool(mask)
    if bool(mask.all()):
        return True
    return None if bool(mask.any()) else False


def host_test(x: torch.Tensor, test: Callable[[float], bool]) -> bool | None:
    """:func:`all_or_none` of the mask ``test(x)`` made on the host from the elements of a CPU tensor as
    Python floats (whose comparisons are the IEEE ones torch makes): reading a few elements costs less
    than a comparison op on them. None on an accelerator."""
    if not x.is_cpu:
        return None
    if x.numel() == 1:
        return test(x.item())
    hits = [test(t) for t in x.reshape(-1).tolist()]
    return True if all(hits) else None if any(hits) else False


def log_ndtr(x: torch.Tensor) -> torch.Tensor:
    """``log Phi(x)`` in float64: ``log(erfc(-x/sqrt 2)/2)`` above -30 (relatively accurate there
    and several times faster than ``torch.special.log_ndtr`` on CPU; note ``torch.special.ndtr``
    is not relatively accurate for negative x), the left-tail expansion below."""
    far = x < _NEG_TAIL_T
    return _log_ndtr(x, far, any_of(far))


def _log_ndtr(x: torch.Tensor, far: torch.Tensor | None, any_far: bool) -> torch.Tensor:
    """:func:`log_ndtr` given ``far = x < -30`` and whether any element is."""
    # with no x below -30 the clamp would return x itself
    head = torch.special.erfc((torch.clamp(x, min=-_TAIL) if any_far else x) * _NEG_SQRT_HALF_T).mul_(_HALF_T).log_()
    if not any_far:
        return head
    t = torch.clamp(x, max=-_TAIL)
    tail = -0.5 * t * t - torch.log(-t) - _HALF_LOG_2PI + _log_mills_series(t)
    return torch.where(far, tail, head)


def threshold(delta: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """``c_alpha = delta/2 + ln(alpha)/delta``: the residual lives on ``s < c_alpha``."""
    return delta / 2 + log_alpha / delta


def _log_mills_series(x: torch.Tensor) -> torch.Tensor:
    """``log r(x)`` with ``Phi(x) = phi(x) r(x) / (-x)`` for ``x << 0`` (asymptotic series)."""
    x2 = 1.0 / (x * x)
    return torch.log1p(x2 * (-1 + x2 * (3 + x2 * (-15 + x2 * 105))))


def _log_G_offset(v: torch.Tensor, c: torch.Tensor, delta: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """``log G`` at ``s = c + v`` (``v <= 0``), parametrised by the offset from the threshold.

    ``log G(s) = ln alpha + log Phi(s) + log1mexp(log Phi(s - delta) - log Phi(s) - ln alpha)``.
    For ``s < -30`` the two ``log Phi`` are O(s^2) and their difference would lose every
    digit, so it is taken from the left-tail expansion, where it simplifies exactly to
    ``delta v - log1p(delta / -s) + log r(s - delta) - log r(s)`` (using ``c delta = delta^2/2 + ln alpha``).
    """
    return _log_G_at(c + v, v, delta, log_alpha)


def _log_G_at(s: torch.Tensor, v: torch.Tensor, delta: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """:func:`_log_G_offset` given ``s = c + v`` as well."""
    shifted = s - delta
    any_far_shifted = host_test(shifted, lambda t: t < -_TAIL) is not False
    far_shifted = shifted < _NEG_TAIL_T if any_far_shifted else None  # (a mask only where one is read)
    # delta >= 0, so s - delta <= s: where no s - delta is below -30, no s is either
    far = s < _NEG_TAIL_T if any_far_shifted else None
    any_far = any_far_shifted and any_of(far)
    log_phi_s = _log_ndtr(s, far, any_far)
    inner = _log_ndtr(shifted, far_shifted, any_far_shifted).sub_(log_phi_s).sub_(log_alpha)
    if any_far:
        t = torch.clamp(s, max=-_TAIL)
        tail = delta * v - torch.log1p(delta / (-t)) + _log_mills_series(t - delta) - _log_mills_series(t)
        inner = torch.where(far, tail, inner)
    return (log_alpha + log_phi_s).add_(log1mexp(inner.clamp_(max=0.0)))


def log_G(s: torch.Tensor, delta: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """``log(alpha Phi(s) - Phi(s - delta))`` for ``s <= c_alpha`` (where it is increasing; ``G(c_alpha) = Z_alpha``)."""
    c = threshold(delta, log_alpha)
    return _log_G_offset(s - c, c, delta, log_alpha)


def log_residual_mass(delta: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """``log Z_alpha = log ∫ (alpha phi(s) - phi(s - delta))^+ ds`` (= log TV for alpha = 1)."""
    delta, log_alpha = _as_f64(delta, log_alpha)
    c = threshold(delta, log_alpha)
    return _log_G_offset(torch.zeros_like(c), c, delta, log_alpha)


def residual_cdf(s: torch.Tensor, delta: torch.Tensor, log_alpha: torch.Tensor) -> torch.Tensor:
    """``F_alpha(s)`` of psi_alpha (1 for ``s >= c_alpha``)."""
    s, delta, log_alpha = _as_f64(s, delta, log_alpha)
    c = threshold(delta, log_alpha)
    inside = torch.exp(log_G(torch.minimum(s, c), delta, log_alpha) - log_G(c, delta, log_alpha))
    return torch.where(s >= c, torch.ones_like(inside), inside)


def residual_moments(delta: torch.Tensor, log_alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(E[s], E[s^2])`` under psi_alpha (spec 4.2)."""
    delta, log_alpha = _as_f64(delta, log_alpha)
    c = threshold(delta, log_alpha)
    Z = torch.exp(log_residual_mass(delta, log_alpha))
    phi_cd = torch.exp(-0.5 * (c - delta) ** 2) / math.sqrt(2 * math.pi)
    Phi_cd = torch.special.ndtr(c - delta)
    return -delta * Phi_cd / Z, 1 + delta * (phi_cd - delta * Phi_cd) / Z


def sample_psi(delta: torch.Tensor, log_alpha: torch.Tensor, u: torch.Tensor, method: str = "newton") -> torch.Tensor:
    """Inverse-CDF draw ``s ~ psi_alpha(.; delta)`` from uniforms ``u`` in (0, 1] (float64, broadcast).

    Solves ``log G(s) = log u + log Z`` on the bracket ``[Phi^-1(u Z / alpha), c_alpha]`` (the lower
    end via ``-sqrt(-2a)`` when ``a = log(u Z / alpha) < -600``: ``Phi(-sqrt(-2a)) < e^a``).
    ``method="bisection"``: 60 fixed bisection steps (spec 4.3). ``method="newton"`` (default):
    ``NEWTON_STEPS`` Newton steps on the concave ``log G`` from the bracket's lower end, falling back
    to bisection whenever a step leaves the bracket (e.g. near u -> 1 where G' -> 0); the same
    root in a quarter of the tensor operations, which matters because the loop calls this once
    per round. On the CPU (:data:`ONE_ROW_ON_HOST`) the Newton draws are one C++ call where the kernels are loaded,
    else one row's draw runs on Python floats; the same bits either way.
    Both work on the offset ``v = s - c`` (full precision when ``|c|`` is huge).
    """
    if method not in ("newton", "bisection"):
        raise ValueError(f"method must be 'newton' or 'bisection', got {method!r}")
    if method == "newton" and ONE_ROW_ON_HOST:
        s = _kernel_draws(delta, log_alpha, u)
        if s is not None:
            return s
    delta, log_alpha, u = _as_f64(delta, log_alpha, u)
    delta, log_alpha, u = torch.broadcast_tensors(delta, log_alpha, u)
    if method == "newton" and delta.numel() == 1 and delta.device.type == "cpu" and ONE_ROW_ON_HOST:
        row_delta = delta.item()
        if row_delta != 0.0:  # Python's division by zero raises where torch's gives inf or NaN
            s = _sample_psi_one_row(row_delta, log_alpha.item(), u.item())
            return torch.tensor(s, dtype=torch.float64).reshape(delta.shape)
    c = threshold(delta, log_alpha)
    target = torch.log(u) + _log_G_offset(torch.zeros_like(c), c, delta, log_alpha)
    a = target - log_alpha
    far = a < -600.0
    if any_of(far):
        lo = torch.where(far, -torch.sqrt(-2 * a), torch.special.ndtri(torch.exp(torch.where(far, torch.zeros_like(a), a))))
    else:  # what the where would keep
        lo = torch.special.ndtri(torch.exp(a))
    lo = torch.clamp(lo - c, max=0.0)
    hi = torch.zeros_like(c)
    if method == "bisection":
        for _ in range(BISECTION_STEPS):
            mid = 0.5 * (lo + hi)
            above = _log_G_offset(mid, c, delta, log_alpha) > target
            hi = torch.where(above, mid, hi)
            lo = torch.where(above, lo, mid)
        return c + 0.5 * (lo + hi)
    return c + _newton(lo, hi, c, delta, log_alpha, target)


def _newton(lo: torch.Tensor, hi: torch.Tensor, c: torch.Tensor, delta: torch.Tensor, log_alpha: torch.Tensor,
            target: torch.Tensor) -> torch.Tensor:
    """``NEWTON_STEPS`` safeguarded Newton steps on ``log G(c + v) = target`` from ``v = lo``; returns v.

    A step is a pure function of the state ``(v, lo, hi)``, so once a state recurs every later one is
    known, and on the CPU the loop stops there with the v the last step would have left (the same bits,
    in about half the steps; on an accelerator every step runs, as the check would wait for the device).
    A step that leaves v unchanged leaves the whole state unchanged from the next step on (lo and hi
    already hold v where the sign of f moves them); otherwise a state can recur two steps later (v
    oscillating by an ulp).
    """
    states = [(lo.clone(), lo, hi)]
    if lo.device.type != "cpu":
        for _ in range(NEWTON_STEPS):
            states = [_newton_step(*states[-1], c, delta, log_alpha, target, True)]
        return states[-1][0]
    # Every v (and so lo and hi) is a midpoint or a v_new that passed the bracket check within [lo, 0]:
    # from a finite lo above -1e307 (no midpoint overflows) all stay finite, and a v_new that is not
    # fails the check without isfinite.
    check_finite = not bool((lo >= -1e307).all())
    v_bits = [states[0][0].view(torch.int64)]
    for i in range(NEWTON_STEPS):
        states.append(_newton_step(*states[-1], c, delta, log_alpha, target, check_finite))
        v_bits.append(states[-1][0].view(torch.int64))
        if torch.equal(v_bits[-1], v_bits[-2]):
            return states[-1][0]
        if i >= 1 and torch.equal(v_bits[-1], v_bits[-3]) and _same_bits(states[-1][1:], states[-3][1:]):
            return states[-1 if (NEWTON_STEPS - 1 - i) % 2 == 0 else -2][0]  # period 2 from here on
    return states[-1][0]


# ---- one row on the host: the same steps on Python floats ----------------------------------------
#
# At batch 1 the diffusion loop draws for one row per round: on 1-element tensors the solve is some
# 300 ops (about 45 a Newton step), 0.7 ms a round against a 5 ms target call. Below, every +, -, *,
# / and comparison is made on Python floats (IEEE double, correctly rounded, as torch's float64 ops
# are), and every transcendental (erfc, log, exp, expm1, log1p, sqrt, ndtri) by torch on a
# 1-element tensor, as the tensor path computes it on one row (Python's math module differs from
# torch's kernels in the last bit): the same bits in about 0.3 ms. The functions mirror their tensor
# twins above op for op; tests/test_diffusion_residual.py compares the two paths bit for bit.

ONE_ROW_ON_HOST = True  # False: every draw takes the tensor path, neither C++ nor Python floats (the tests' reference)


class _OneElement(threading.local):
    def __init__(self) -> None:
        with torch.inference_mode(False):  # a thread's first draw may come inside inference mode, later ones not
            self.buffer = torch.zeros((), dtype=torch.float64)
        self.memory = self.buffer.numpy()  # the buffer's element, set and read without a torch call


_one_element = _OneElement()  # per thread: the loops of two threads may solve at once


def _on_one(op: Callable[[torch.Tensor], torch.Tensor], x: float) -> float:
    """``op`` (in place where torch has that: the same kernel as its out-of-place twin) on a 1-element
    float64 tensor holding ``x``: a reused tensor costs a third of a new one, and setting and reading its
    element through NumPy costs a quarter of ``fill_`` and ``item``."""
    one = _one_element
    one.memory[()] = x
    out = op(one.buffer)
    return float(one.memory) if out is one.buffer else out.item()


def _clamp_max(x: float, bound: float) -> float:
    """``torch.clamp(x, max=bound)`` on a float: NaN stays, and ``x`` is kept unless ``bound < x``."""
    return bound if bound < x else x


def _log1mexp_one(x: float) -> float:
    if x > _LOG_HALF:
        return _on_one(torch.Tensor.log_, -_on_one(torch.Tensor.expm1_, x))
    return _on_one(torch.Tensor.log1p_, -_on_one(torch.Tensor.exp_, x))


def _log_mills_series_one(x: float) -> float:
    x2 = 1.0 / (x * x)
    return _on_one(torch.Tensor.log1p_, x2 * (-1 + x2 * (3 + x2 * (-15 + x2 * 105))))


def _log_ndtr_one(x: float, far: bool) -> float:
    """:func:`_log_ndtr` of one element (``far``: ``x < -30``)."""
    head = _on_one(torch.Tensor.log_, _on_one(torch.Tensor.erfc_, (-_TAIL if far else x) * -_SQRT_HALF) * 0.5)
    if not far:
        return head
    t = _clamp_max(x, -_TAIL)
    return -0.5 * t * t - _on_one(torch.Tensor.log_, -t) - _HALF_LOG_2PI + _log_mills_series_one(t)


def _log_G_at_one(s: float, v: float, delta: float, log_alpha: float) -> float:
    """:func:`_log_G_at` of one element."""
    shifted = s - delta
    far_shifted = shifted < -_TAIL
    far = far_shifted and s < -_TAIL
    log_phi_s = _log_ndtr_one(s, far)
    inner = _log_ndtr_one(shifted, far_shifted) - log_phi_s - log_alpha
    if far:
        t = _clamp_max(s, -_TAIL)
        inner = (delta * v - _on_one(torch.Tensor.log1p_, delta / (-t)) + _log_mills_series_one(t - delta)
                 - _log_mills_series_one(t))
    return (log_alpha + log_phi_s) + _log1mexp_one(_clamp_max(inner, 0.0))


def _newton_step_one(v: float, lo: float, hi: float, c: float, delta: float, log_alpha: float, target: float,
                     check_finite: bool) -> tuple[float, float, float]:
    """:func:`_newton_step` of one element."""
    s = c + v
    log_g = _log_G_at_one(s, v, delta, log_alpha)
    f = log_g - target
    if f > 0.0:
        hi = v
    else:
        lo = v
    log_dg = (log_alpha - 0.5 * s * s) - _HALF_LOG_2PI + _log1mexp_one(_clamp_max(delta * v, -1e-300))
    v_new = v - f * _on_one(torch.Tensor.exp_, log_g - log_dg)
    if lo <= v_new <= hi and (not check_finite or math.isfinite(v_new)):
        return v_new, lo, hi
    return 0.5 * (lo + hi), lo, hi


def _sample_psi_one_row(delta: float, log_alpha: float, u: float) -> float:
    """:func:`sample_psi` (Newton) of one element."""
    c = delta / 2 + log_alpha / delta
    target = _on_one(torch.Tensor.log_, u) + _log_G_at_one(c + 0.0, 0.0, delta, log_alpha)
    a = target - log_alpha
    if a < -600.0:
        lo = -_on_one(torch.Tensor.sqrt_, -2 * a)
    else:
        lo = _on_one(torch.special.ndtri, _on_one(torch.Tensor.exp_, a))
    lo = _clamp_max(lo - c, 0.0)
    return c + _newton_one_row(lo, 0.0, c, delta, log_alpha, target)


# residual_draw.cpp's constants: Python's values (a compiler would fold log and sqrt by its own rounding).
KERNEL_CONSTANTS = torch.tensor([_LOG_HALF, _SQRT_HALF, _HALF_LOG_2PI, _TAIL], dtype=torch.float64)


def _kernel_draws(delta, log_alpha, u) -> torch.Tensor | None:
    """:func:`sample_psi`'s Newton draws by the C++ kernel, or None where it is not loaded or refuses the call (a
    delta of 0, which the Python path would divide by). The loop's inputs (float64 CPU tensors of one shape) go as
    they are; others after broadcasting."""
    kernel = _draws_kernel(delta) if isinstance(delta, torch.Tensor) else None
    if kernel is None:
        return None
    args = (delta, log_alpha, u)
    if not all(isinstance(t, torch.Tensor) and t.dtype == torch.float64 and t.shape == delta.shape for t in args):
        args = tuple(t.contiguous() for t in torch.broadcast_tensors(*_as_f64(*args)))
    s = kernel(*(t if t.dim() == 1 else t.reshape(-1) for t in args), KERNEL_CONSTANTS)  # it refuses strided ones
    return None if s is None else s.reshape(args[0].shape)


def _draws_kernel(delta: torch.Tensor) -> Callable | None:
    """The C++ Newton draws (``psi_draws``) for CPU tensors, where the process has loaded specray's kernels (never
    building them here) and the kernel gave :func:`_sample_psi_one_row`'s bits in this process."""
    if not delta.is_cpu or cpu_kernels.loaded() is None or not cpu_kernels.ENABLED or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("psi_draws", 0, _draws_kernel_matches)


def _draws_kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`_sample_psi_one_row`'s bits: 400 random draws (seed 3; delta and -log alpha
    log-normal over many decades, u = 1 and u = e^(-700 U) among them: the far tails, the lower bracket end below
    a = -600, the bisection fallback) and 196 edge combinations (subnormal, huge, infinite and NaN inputs)."""
    gen = torch.Generator().manual_seed(3)
    n = 400
    delta = torch.exp(3 * torch.randn(n, dtype=torch.float64, generator=gen))
    log_alpha = -torch.exp(3 * torch.randn(n, dtype=torch.float64, generator=gen))
    log_alpha[:40] = 0.0
    u = 1 - torch.rand(n, dtype=torch.float64, generator=gen)
    u[40:50] = 1.0
    u[50:80] = torch.exp(-700 * torch.rand(30, dtype=torch.float64, generator=gen))
    edges = [(d, a, v) for d in (1e-300, 1e-12, 0.5, 40.0, 1e300, math.inf, math.nan)
             for a in (0.0, -1e-300, -0.3, -50.0, -1e300, -math.inf, math.nan) for v in (1e-300, 0.3, 1.0, math.nan)]
    rows = list(zip(delta.tolist(), log_alpha.tolist(), u.tolist())) + edges
    got = kernel(*(torch.tensor(column, dtype=torch.float64) for column in zip(*rows)), KERNEL_CONSTANTS)
    want = [_sample_psi_one_row(*row) for row in rows]
    return got is not None and cpu_kernels.same_values(got, torch.tensor(want, dtype=torch.float64))


def _newton_one_row(lo: float, hi: float, c: float, delta: float, log_alpha: float, target: float) -> float:
    """:func:`_newton` of one element: the same steps, the same early stop on a recurring state."""
    states = [(lo, lo, hi)]
    check_finite = not lo >= -1e307
    keys = [_bits(states[0])]  # (v, lo, hi) as bit patterns: -0.0 and NaNs compared as torch.equal on views
    for i in range(NEWTON_STEPS):
        states.append(_newton_step_one(*states[-1], c, delta, log_alpha, target, check_finite))
        keys.append(_bits(states[-1]))
        if keys[-1][0] == keys[-2][0]:
            return states[-1][0]
        if i >= 1 and keys[-1] == keys[-3]:
            return states[-1 if (NEWTON_STEPS - 1 - i) % 2 == 0 else -2][0]  # period 2 from here on
    return states[-1][0]


def _bits(state: tuple[float, float, float]) -> tuple[int, ...]:
    return struct.unpack("<3q", struct.pack("<3d", *state))


def _same_bits(a: tuple[torch.Tensor, ...], b: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(x.view(torch.int64), y.view(torch.int64)) for x, y in zip(a, b))


def _newton_step(v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, c: torch.Tensor, delta: torch.Tensor,
                 log_alpha: torch.Tensor, target: torch.Tensor,
                 check_finite: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    # psi_alpha is log-concave, so log G is concave: Newton started left of the root (at the
    # bracket's lower end) climbs monotonically to it without overshooting.
    s = c + v
    log_g = _log_G_at(s, v, delta, log_alpha)
    f = log_g - target
    which = host_test(f, lambda t: t > 0.0)  # where every row moves the same end, it is v (the wheres' values)
    if which is None:
        above = f > _ZERO_T
        hi, lo = torch.where(above, v, hi), torch.where(above, lo, v)
    elif which:
        hi = v
    else:
        lo = v
    # d/ds log G = alpha phi(s) (1 - e^{delta v}) / G
    log_dg = (log_alpha - _HALF_T * s * s).sub_(_HALF_LOG_2PI_T).add_(log1mexp((delta * v).clamp_(max=-1e-300)))
    v_new = v - f.mul_(log_g.sub_(log_dg).exp_())
    if _host_inside(v_new, lo, hi, check_finite):  # the where would keep v_new whole
        return v_new, lo, hi
    inside = (v_new >= lo).logical_and_(v_new <= hi)
    if check_finite:
        inside.logical_and_(torch.isfinite(v_new))
    return torch.where(inside, v_new, _HALF_T * (lo + hi)), lo, hi


def _host_inside(v: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, check_finite: bool) -> bool:
    """On the CPU, whether every ``v`` lies in its bracket ``[lo, hi]`` (and is finite, with
    ``check_finite``), read on the host as :func:`host_test` does; False on an accelerator."""
    if not v.is_cpu:
        return False
    if v.numel() == 1:
        vs, los, his = [v.item()], [lo.item()], [hi.item()]
    else:
        vs, los, his = (t.reshape(-1).tolist() for t in (v, lo, hi))
    return all(a <= x <= b and (not check_finite or math.isfinite(x)) for x, a, b in zip(vs, los, his))


def sample_residual(
    m_q: torch.Tensor,
    Delta: torch.Tensor,
    sigma: torch.Tensor,
    log_alpha: torch.Tensor,
    u: torch.Tensor,
    zeta: torch.Tensor,
) -> torch.Tensor:
    """Draw ``y ~ (alpha q - p)^+`` per row (spec 4.6).

    ``m_q, Delta, zeta``: ``[n, ...]`` (any trailing shape, flattened internally);
    ``sigma, log_alpha, u``: ``[n]``. ``zeta`` is a standard normal (fresh, or the rejected
    draft's own normalised noise: reusing its orthogonal part is exact, spec 4.4).
    Rows with ``delta <= DELTA_MIN`` draw from ``q`` (spec 4.5.1). Returns ``m_q``'s dtype.
    """
    n = m_q.shape[0]
    D = Delta.reshape(n, -1).to(torch.float64)
    Z = zeta.reshape(n, -1).to(torch.float64)
    delta = torch.linalg.vector_norm(D, dim=1)
    # without a tiny delta the wheres on it would keep their other branch whole
    any_tiny = host_test(delta, lambda t: t <= DELTA_MIN) is not False
    tiny = delta <= DELTA_MIN if any_tiny else None
    safe_delta = torch.where(tiny, torch.ones_like(delta), delta) if any_tiny else delta
    e = D / safe_delta[:, None]
    s = sample_psi(safe_delta, log_alpha, u)
    z_perp = Z - (Z * e).sum(dim=1, keepdim=True) * e
    z = s[:, None] * e + z_perp
    if any_tiny:
        z = torch.where(tiny[:, None], Z, z)
    y = m_q.reshape(n, -1).to(torch.float64) + sigma.to(torch.float64)[:, None] * z
    return y.reshape(m_q.shape).to(m_q.dtype)


def reflect(m_q: torch.Tensor, Delta: torch.Tensor, sigma: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """Reflection maximal coupling (P25): map the rejected draft ``m_p + sigma xi`` to
    ``m_q + sigma (xi - 2 <e, xi> e)``. Exact only for token verification (alpha = 1)."""
    n = m_q.shape[0]
    D = Delta.reshape(n, -1).to(torch.float64)
    X = xi.reshape(n, -1).to(torch.float64)
    delta = torch.linalg.vector_norm(D, dim=1)
    e = D / torch.where(delta <= DELTA_MIN, torch.ones_like(delta), delta)[:, None]
    z = X - 2 * (X * e).sum(dim=1, keepdim=True) * e
    y = m_q.reshape(n, -1).to(torch.float64) + sigma.to(torch.float64)[:, None] * z
    return y.reshape(m_q.shape).to(m_q.dtype)


def _as_f64(*xs):
    out = tuple(x.to(torch.float64) if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=torch.float64) for x in xs)
    return out if len(out) > 1 else out[0]
