"""A speculative diffusion round's work after its verify call, on an affine chain's full round, in one call on a CPU.

:func:`~specray.methods.diffusion.loop._commit_tensors` computes the log ratios, the verdict, the cut rows' new states
(ψ_α's draw or the reflected draft), the kept rows' last drafted states, the Free drafter's eps and the next steps:
some 40 torch operations and calls, about 0.2 ms a round at batch 1, where the target call costs 3 ms.
``csrc/round_commit.cpp`` makes the same kernels' calls on the same inputs (``round_ratios``, ``token_verdict`` or
``block_verdict``, ``residual_states`` or ``reflected_states``) and copies for the rest, so the values are the same by
construction; the kernel still serves only after giving that path's values bit for bit in the process
(:func:`_kernel_matches`). Where the extension is off or not built (:mod:`~specray.models.cpu_kernels`), the ratios'
kernel is switched off, or the round is ragged or large, the tensor path runs. ``ENABLED`` switches the kernel for an
A/B comparison.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch

from specray.methods.diffusion import cpu_ratios
from specray.methods.diffusion.residual import DELTA_MIN, KERNEL_CONSTANTS
from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED

Done = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor, torch.Tensor]


def round_commit(coef: torch.Tensor, eps_draft: torch.Tensor, E: torch.Tensor, xi: torch.Tensor, eta: torch.Tensor,
                 Y: torch.Tensor, kk: torch.Tensor, g: torch.Tensor, *, block: bool, u: torch.Tensor | None,
                 zeta: torch.Tensor | None, alpha_one: bool, with_stale: bool) -> Done | None:
    """``(new states [n, ...], the Free drafter's eps or None, next steps [n], tau [n], expected advance [n])`` of a
    full round, as :func:`~specray.methods.diffusion.loop._commit_tensors` gives them, from
    :func:`~specray.methods.diffusion.cpu_ratios.affine_ratios`' inputs ``coef, eps_draft, E, xi``, the coins ``eta``,
    the drafted states ``Y [n, G + 1, ...]``, the rows' steps ``kk`` and block lengths ``g`` (every one G); ``block``:
    block verification, else token; ``u, zeta``: ψ_α's draws at every slot (None: reflection); ``alpha_one``: the
    negative control's weight 1. None where the kernel does not serve the call."""
    kernel = _kernel(E) if xi.numel() <= cpu_ratios.KERNEL_MAX_ELEMENTS else None
    if kernel is None:
        return None
    done = kernel(coef, eps_draft, E, xi, eta, Y, kk, g, block, u, zeta, alpha_one, with_stale, KERNEL_CONSTANTS,
                  DELTA_MIN)
    return tuple(done) if done else None


def _kernel(E: torch.Tensor) -> Callable | None:
    # the ratios' switch too: with it off, the A/B comparison of that kernel runs torch's ratios in every round
    if not (ENABLED and cpu_ratios.ENABLED and cpu_kernels.ENABLED) or not E.is_cpu or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("round_commit", 0, _kernel_matches)


def _kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`~specray.methods.diffusion.loop._commit_tensors`' new states, eps, steps, tau
    and expected advance, bit for bit but NaN for NaN, on :func:`random_commits`."""
    from specray.methods.diffusion import loop  # the loop imports this module

    for chain, rnd, args, how in random_commits(torch.Generator().manual_seed(4)):
        coef, eps_draft, E, xi, eta, Y, draws = args
        want = loop._commit_tensors(chain, rnd, coef, Y, E, eps_draft, xi, eta, draws, how["with_stale"],
                                    "block" if how["block"] else "token", "one" if how["alpha_one"] else "w_tau")
        u, zeta = (None, None) if draws is None else (draws.u, draws.zeta)
        got = kernel(coef, eps_draft, E, xi, eta, Y, rnd.kk, rnd.g, how["block"], u, zeta, how["alpha_one"],
                     how["with_stale"], KERNEL_CONSTANTS, DELTA_MIN)
        wanted = (want.x, want.stale, want.k, want.tau, want.expected_advance)
        if not got or any((a is None) != (b is None) or (a is not None and (a.shape != b.shape or a.dtype != b.dtype
                                                                            or not cpu_kernels.same_values(a, b)))
                          for a, b in zip(got, wanted, strict=True)):
            return False
    return True


# (block verification, ψ_α's residual, its weight 1): every rule the loop allows, and reflection with block verification
MODES = ((False, False, False), (False, True, False), (True, True, False), (True, True, True), (True, False, False))


def random_commits(generator: torch.Generator) -> list[tuple]:
    """Full rounds of an affine chain (K = 20 random steps) to compare the kernel with the tensor path on: 1 row of 1 x
    8 x 8 elements, 3 of 5, 16 of 1 and 16 of 1 x 8 x 8; float32 and float64 states; 1 and 7 slots; every :data:`MODES`;
    one draft eps per row and one per slot, and with and without the Free drafter's eps, in turn. Each row's draft eps
    is its target eps plus noise of its own scale, log-uniform from 1e-9 to 3, so rows accept every slot, some or none;
    in every fourth round the first row's is its target eps (identical kernels). Each entry is ``(chain, round, (coef,
    eps_draft, E, xi, eta, Y, residual draws), how)``."""
    from specray.methods.diffusion import loop

    K, commits = 20, []
    tables = torch.stack([torch.rand(K, dtype=torch.float64, generator=generator) + 0.5,
                          torch.randn(K, dtype=torch.float64, generator=generator),
                          torch.rand(K, dtype=torch.float64, generator=generator) * 0.5 + 0.01])
    chain = loop.GaussianChain(A=tables[0], B=tables[1], sigma=tables[2], target_eps=None)
    sizes = ((1, (1, 8, 8)), (3, (5,)), (16, (1,)), (16, (1, 8, 8)))
    for i, ((n, shape), dtype, G, (block, residual, alpha_one)) in enumerate(
            itertools.product(sizes, (torch.float32, torch.float64), (1, 7), MODES)):
        how = {"block": block, "alpha_one": alpha_one, "with_stale": i % 2 == 0}
        per_slot = i % 3 == 0
        kk = torch.randint(0, K - G + 1, (n,), generator=generator)
        rnd = loop._new_round(i, None, torch.arange(n), kk, kk.numpy(), G, False, tables, loop.ChainStats(n, G, K))
        coef = rnd.coef.reshape((3, n, G) + (1,) * len(shape))
        normal = lambda *size: torch.randn(size, dtype=torch.float64, generator=generator)  # noqa: E731
        E, Y = normal(n, G, *shape).to(dtype), normal(n, G + 1, *shape).to(dtype)
        scale = 10 ** (0.5 - 9.5 * torch.rand((n, 1) + (1,) * len(shape), dtype=torch.float64, generator=generator))
        if i % 4 == 1:  # the first row's draft eps is its target eps: identical kernels, Delta 0
            scale[0] = 0.0
        eps_draft = E[:, :G if per_slot else 1].double() + normal(n, G if per_slot else 1, *shape) * scale
        xi, zeta = normal(n, G, *shape), normal(n, G, *shape)
        eta, u = (1 - torch.rand(n, G, dtype=torch.float64, generator=generator) for _ in range(2))
        draws = loop._ResidualDraws(u, torch.zeros(n, G, dtype=torch.int64), zeta) if residual else None
        commits.append((chain, rnd, (coef, eps_draft, E, xi, eta, Y, draws), how))
    return commits
