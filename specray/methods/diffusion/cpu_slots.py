"""A speculative diffusion round's slots where every row of the batch drafts gamma steps, in one call on a CPU.

Between two rounds :func:`~specray.methods.diffusion.loop.speculative_chain` finds the rows still active from the
host's copy of their steps, and :func:`~specray.methods.diffusion.loop._new_round` their block lengths, every slot's
step and its coefficients: a dozen numpy calls, about 35 µs back to back but 0.11–0.23 ms a round in the loop at batch
1, where each pays for the model call before it. In the common round (every row active with gamma steps or more
left) ``csrc/round_slots.cpp`` gives the steps and coefficients in one call: integer additions and copies of the
tables' values, so they are numpy's by construction; the kernel still serves only after matching that path in the
process (:func:`_kernel_matches`). Where the extension is off or not built (:mod:`~specray.models.cpu_kernels`), or
a row has fewer steps left, the loop's numpy path runs. ``ENABLED`` switches the kernel for an A/B comparison.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED


def full_round_slots(k: torch.Tensor, gamma: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every slot's step ``k + j`` ``[n, gamma]`` and coefficients ``tables[:, k + j]`` ``[3, n, gamma]`` of a round
    in which each row, at step ``k [n]``, drafts ``gamma`` steps, from the chain's ``tables [3, K]`` (A, B, sigma;
    float64); None where a row has fewer than gamma steps left or the kernel does not serve the call."""
    kernel = _kernel(k)
    if kernel is None:
        return None
    steps, coef = kernel(k, gamma, tables)
    return None if steps is None else (steps, coef)


def _kernel(k: torch.Tensor) -> Callable | None:
    if not ENABLED or not k.is_cpu or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("full_round_slots", 0, _kernel_matches)


def _kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`~specray.methods.diffusion.loop._slots_from_host`'s steps and coefficients
    (their dtypes and values) for 1, 3 and 16 rows at random steps with gamma 1 and 7 of 20 (random tables, seed 0),
    the last step a row can draft gamma from among them; and refuses a row with fewer steps left, and a done one."""
    from specray.methods.diffusion import loop  # the loop imports this module

    generator = torch.Generator().manual_seed(0)
    K = 20
    tables = torch.rand(3, K, dtype=torch.float64, generator=generator)
    for n in (1, 3, 16):
        for gamma in (1, 7):
            k = torch.randint(0, K - gamma + 1, (n,), generator=generator)
            k[-1] = K - gamma
            steps, coef = kernel(k, gamma, tables)
            _, want_steps, _, want_coef = loop._slots_from_host(k.numpy(), np.full(n, gamma), gamma, tables)
            if steps is None or any(got.dtype != want.dtype or not torch.equal(got, want)
                                    for got, want in ((steps, want_steps), (coef, want_coef))):
                return False
            for past in (K - gamma + 1, K):
                k[0] = past
                if kernel(k, gamma, tables)[0] is not None:
                    return False
    return True
