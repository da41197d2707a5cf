"""RMSNorm in CPU inference: torch's five operations, or one call of specray's kernel with their bits.

:class:`~specray.models.discrete_ar.RMSNorm` computes ``(x * rsqrt(sum(x * x, -1) / D + eps)) * weight`` in
float32. On a CPU in inference each of those operations costs a few microseconds of dispatch, so a norm of
two rows (batch 1 with guidance) took ~13 us, 25 norms per call of the digits target; ``csrc/rms_norm.cpp``
does it in one pass (~3 us there, 68 -> 22 us at 1280 rows) with torch's summation order written out.

That order is torch's (its CPU sum kernel) and may change with a torch build, so the kernel serves a row
width only after it has matched torch's operations value for value on it (:func:`_matches_torch`), in this
process at this thread count; else, and where the extension is off or not built
(:mod:`~specray.models.cpu_kernels`), torch's operations run. The choice never changes a value.
"""

from __future__ import annotations

import functools

import torch

from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED


@functools.lru_cache(maxsize=8)
def _float32_scalars(*values: float) -> tuple[torch.Tensor, ...]:
    """``values`` as 0-dim float32 CPU tensors, built once; read-only."""
    with torch.inference_mode(False):  # plain tensors, whichever mode the first call came in
        return tuple(torch.tensor(float(v), dtype=torch.float32) for v in values)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The float32 RMSNorm's values by torch's operations, cheaper than the module's generic form at these
    sizes: ``mean`` is ``sum`` then a division by the count (what the CPU kernel does), and the count and
    ``eps`` enter as 0-dim float32 tensors (the values Python numbers become) instead of being wrapped into
    tensors on every call."""
    count, eps_t = _float32_scalars(x.shape[-1], eps)
    scale = torch.sum(x * x, dim=-1, keepdim=True).div_(count).add_(eps_t).rsqrt_()
    return (x * scale).mul_(weight)


def _matches_torch(kernel, width: int) -> bool:
    """Whether ``kernel`` gives torch's values for rows of ``width`` floats: 1, 2, 7, 8, 300 and 1280 rows (the
    8-row blocks and the rows left over), values from 1e-3 to 30 wide, seed 0, at the calling thread count."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(width, generator=generator)
    for rows in (1, 2, 7, 8, 300, 1280):
        for scale in (1e-3, 1.0, 30.0):
            x = torch.randn(rows, width, generator=generator) * scale
            got = kernel(x, weight, 1e-5)  # None: a call the kernel does not serve
            if got is None or not torch.equal(got, torch_rms_norm(x, weight, 1e-5)):
                return False
    return True


def kernel(width: int):
    """The kernel if it gives torch's values for rows of ``width`` at this thread count, else None (checked
    once per thread count and width, :func:`~specray.models.cpu_kernels.checked`)."""
    return cpu_kernels.checked("rms_norm", width, _matches_torch) if ENABLED else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """:func:`torch_rms_norm`'s values: by the kernel where it serves (float32 CPU rows, contiguous, width
    checked), else by torch's operations."""
    fast = kernel(x.shape[-1]) if ENABLED and x.is_contiguous() else None
    out = None if fast is None else fast(x, weight, eps)
    return torch_rms_norm(x, weight, eps) if out is None else out
