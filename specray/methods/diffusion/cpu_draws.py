"""A speculative diffusion round's draws (:func:`~specray.methods.diffusion.loop.speculative_chain`'s streams draft,
accept and, with the residual sampler, residual and residual_noise): torch's operations, or on a CPU one call of
specray's kernels with their values.

A round mixes its index and every slot's step into each stream's hash, then draws the draft noise by Box-Muller (with
the residual sampler's noise where the round draws it) and one uniform per slot from the other streams. At batch 1 that
is some 30 torch operations, about 0.1 ms of dispatch a round (more in the loop, where each pays for the code before
it); ``csrc/round_draws.cpp`` makes them in one call of about 10 µs. Its hash and integer steps are exact, its products
and differences round once in the order of :func:`round_draws_torch`, and its log, sqrt and cos are torch's operations
on the same shapes, so the values are the same by construction; the kernel still serves only after matching torch's
operations bit for bit in the process (:func:`_kernel_matches`), and where the extension is off or not built
(:mod:`~specray.models.cpu_kernels`) torch's operations run. ``ENABLED`` switches the kernel for an A/B comparison.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from specray import rng
from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED
# Past this many normals torch's operations, which use every intra-op thread, take over from the kernel (one thread
# for its own loops; it serves small rounds, where dispatch is the cost).
KERNEL_MAX_ELEMENTS = 1 << 18

Draws = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def round_draws(hashes: torch.Tensor, rows: torch.Tensor, index: int, steps: torch.Tensor, shape: tuple[int, ...],
                residual_noise: bool) -> Draws:
    """A round's keys ``[streams, n, G]``, normals ``[1 or 2, n, G, *shape]`` (float64) and uniforms in (0, 1]
    ``[1 or 2, n, G]`` (float64), from the streams' hashes ``[streams, batch]`` (``rng.stream_hash`` of draft, accept
    and, with four streams, residual, residual_noise), the round's batch rows ``rows [n]``, its ``index`` and the
    slots' steps ``steps [n, G]``. The normals are the draft stream's, then with ``residual_noise`` the residual
    noise stream's; the uniforms (``1 - u``) the accept stream's, then with four streams the residual stream's."""
    kernel = _kernel(hashes) if (1 + residual_noise) * steps.numel() * math.prod(shape) <= KERNEL_MAX_ELEMENTS else None
    if kernel is not None:
        draws = kernel(hashes, rows, index, steps, list(shape), residual_noise)
        if draws[0] is not None:
            return draws
    return round_draws_torch(hashes, rows, index, steps, shape, residual_noise)


def round_draws_torch(hashes: torch.Tensor, rows: torch.Tensor, index: int, steps: torch.Tensor,
                      shape: tuple[int, ...], residual_noise: bool) -> Draws:
    """:func:`round_draws` by torch's operations: one hash, one normal and one uniform call for every stream."""
    draws = rng.extend_hash(hashes[:, rows, None], index, steps)  # [streams, n, G]
    normals = rng.normal_at(draws[0::3] if residual_noise else draws[:1], shape, dtype=torch.float64)
    uniforms = 1.0 - rng.uniform_at(draws[1:3])  # in (0, 1]
    return draws, normals, uniforms


def _kernel(hashes: torch.Tensor) -> Callable | None:
    if not ENABLED or not hashes.is_cpu or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("round_draws", 0, _kernel_matches)


def _kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`round_draws_torch`'s bits: two and four streams over 5 batch rows (the extremes
    of int64 among the hashes, seed 0), rounds of 1 and 3 rows (in another order, one twice), 1 and 7 slots, states of
    no, 1, 5 and 64 elements, round 0 and a large round index, the residual noise drawn and not."""
    generator = torch.Generator().manual_seed(0)
    for streams, residual_noise in ((2, False), (4, False), (4, True)):
        hashes = torch.randint(-(1 << 63), (1 << 63) - 1, (streams, 5), generator=generator)
        hashes[:, 0] = torch.tensor([0, -1, (1 << 63) - 1, -(1 << 63)])[:streams]
        for rows, G, shape, index in ((torch.tensor([2]), 7, (1, 8, 8), 0), (torch.tensor([4, 0, 4]), 1, (5,), 1 << 40),
                                      (torch.tensor([1, 3, 0]), 7, (), 3), (torch.tensor([0]), 1, (1,), 12)):
            steps = torch.randint(0, 1000, (rows.numel(), G), generator=generator)
            want = round_draws_torch(hashes, rows, index, steps, shape, residual_noise)
            got = kernel(hashes, rows, index, steps, list(shape), residual_noise)
            if any(g is None or g.shape != w.shape or g.dtype != w.dtype or not torch.equal(g, w)
                   for g, w in zip(got, want, strict=True)):
                return False
    return True
