"""A speculative diffusion round's log density ratios on an affine chain: each slot's scaled gap between the draft and
target means, ``Delta = B (eps_draft - eps_target) / sigma``, and :func:`~specray.methods.diffusion.rules.log_ratio` of
it with the draft noise. Torch's operations, or on a CPU for a round where every row drafts every slot one call of
specray's kernels with their values.

At batch 1 these are some 15 torch operations, about 30 µs of dispatch a round; ``csrc/round_ratios.cpp`` makes them in
one call of about 9 µs. Its products, differences and quotients round once in the order of :func:`affine_ratios_torch`,
and its two row sums and square root are torch's operations on the same shapes, so the values are the same by
construction; the kernel still serves only after matching torch's operations bit for bit in the process
(:func:`_kernel_matches`), and where the extension is off or not built (:mod:`~specray.models.cpu_kernels`) torch's
operations run. ``ENABLED`` switches the kernel for an A/B comparison.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specray.methods.diffusion.rules import log_ratio
from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED
# Past this many elements torch's operations, which use every intra-op thread, take over from the kernel (one thread
# for its own loops; it serves small rounds, where dispatch is the cost).
KERNEL_MAX_ELEMENTS = 1 << 18

Ratios = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def affine_ratios(coef: torch.Tensor, eps_draft: torch.Tensor, eps_target: torch.Tensor, xi: torch.Tensor,
                  valid: torch.Tensor | None = None) -> Ratios:
    """``(Delta [n, G, ...], log rho [n, G], delta [n, G])`` (float64) from the slots' coefficients ``coef [3, n, G,
    1...]`` (A, B, sigma; float64), the draft eps ``eps_draft [n, 1 or G, ...]`` (float64), the target eps
    ``eps_target [n, G, ...]`` and the draft noise ``xi [n, G, ...]`` (float64). ``valid [n, G]``: the drafted slots
    of a ragged round, Delta zero elsewhere (None: every slot)."""
    kernel = _kernel(eps_target) if valid is None and xi.numel() <= KERNEL_MAX_ELEMENTS else None
    if kernel is not None:
        ratios = kernel(coef, eps_draft, eps_target, xi)
        if ratios[0] is not None:  # None: a call it does not serve (e.g. float32 noise)
            return ratios
    return affine_ratios_torch(coef, eps_draft, eps_target, xi, valid)


def affine_ratios_torch(coef: torch.Tensor, eps_draft: torch.Tensor, eps_target: torch.Tensor, xi: torch.Tensor,
                        valid: torch.Tensor | None = None) -> Ratios:
    """:func:`affine_ratios` by torch's operations."""
    Delta = coef[1] * (eps_draft - eps_target.to(torch.float64)) / coef[2]
    if valid is not None:
        mask = valid.reshape(valid.shape + (1,) * (Delta.dim() - valid.dim()))
        Delta = torch.where(mask, Delta, torch.zeros_like(Delta))
    return Delta, *log_ratio(Delta, xi)


def _kernel(eps_target: torch.Tensor) -> Callable | None:
    if not ENABLED or not eps_target.is_cpu or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("round_ratios", 0, _kernel_matches)


def _kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`affine_ratios_torch`'s values, bit for bit but NaN for NaN: float32 and float64
    target eps of 1 and 4 rows, 1 and 7 slots, 2, 15 and 64 elements, one draft eps per row and one per slot, from
    seed 0, with identical eps (Delta zero), gaps past float64's range when squared and a NaN among them."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for n, G, shape, per_slot in ((1, 7, (1, 8, 8), False), (4, 1, (3, 5), False), (4, 7, (2,), True),
                                      (1, 7, (1, 8, 8), True)):
            coef, eps_draft, eps_target, xi = random_round(n, G, shape, dtype, per_slot, generator)
            eps_draft[0, 0] = eps_target[0, 0].double()  # identical kernels at a slot
            eps_draft.view(-1)[-1] = 1e200  # a gap whose square overflows
            xi.view(-1)[-2] = float("nan")
            got, want = kernel(coef, eps_draft, eps_target, xi), affine_ratios_torch(coef, eps_draft, eps_target, xi)
            if any(g is None or g.shape != w.shape or not cpu_kernels.same_values(g, w)
                   for g, w in zip(got, want, strict=True)):
                return False
    return True


def random_round(n: int, G: int, shape: tuple[int, ...], dtype: torch.dtype, per_slot: bool,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`affine_ratios`' inputs ``(coef, eps_draft, eps_target, xi)`` for a random full round of ``n`` rows and
    ``G`` slots (A in [0.5, 1.5), B normal, sigma in [0.01, 1.01); one draft eps per slot or per row), the check's
    and the tests'."""
    coef = torch.stack([torch.rand(n, G, generator=generator, dtype=torch.float64) + 0.5,
                        torch.randn(n, G, generator=generator, dtype=torch.float64),
                        torch.rand(n, G, generator=generator, dtype=torch.float64) + 0.01])
    coef = coef.reshape((3, n, G) + (1,) * len(shape))
    eps_target = torch.randn((n, G) + shape, generator=generator, dtype=torch.float64).to(dtype)
    eps_draft = torch.randn((n, G if per_slot else 1) + shape, generator=generator, dtype=torch.float64)
    xi = torch.randn((n, G) + shape, generator=generator, dtype=torch.float64)
    return coef, eps_draft, eps_target, xi
