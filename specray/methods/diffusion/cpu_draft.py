"""The states a speculative diffusion round drafts with a fixed eps (the Frozen and Free drafters on an affine
chain), and plain ancestral sampling's steps as drafts of one slot: torch's operations, or on a CPU one call of
specray's kernels with their values. With a draft model (:func:`model_step`) each slot's step is one call, between
the model's calls: some 8 torch operations otherwise.

A drafted step is ``y_{j+1} = A_j y_j + B_j eps + sigma_j xi_j`` in float64, rounded to the state's dtype. At
batch 1 the γ = 7 steps are ~40 torch operations, about 60 µs of dispatch (a twentieth of a round's own work);
``csrc/gaussian_draft.cpp`` makes them in one call of about 3 µs. Every product and sum rounds once, in the order of
:func:`affine_states_torch` (the kernel is built without fused multiply-adds), so the values are the same by
construction; the kernel still serves only after matching torch's operations value for value in the process
(:func:`_kernel_matches`), and where the extension is off or not built (:mod:`~specray.models.cpu_kernels`)
torch's operations run. ``ENABLED`` switches the kernel for an A/B comparison.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED
# Past this many drafted elements torch's operations, which use every intra-op thread, take over from the kernel
# (one thread; it serves small rounds, where dispatch is the cost).
KERNEL_MAX_ELEMENTS = 1 << 18


def affine_states(y0: torch.Tensor, coef: torch.Tensor, eps: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """The drafted states ``Y [n, G+1, ...]`` (``Y[:, 0] = y0``, the state's dtype) from ``y0 [n, ...]``, the
    steps' coefficients ``coef [3, n, G, 1...]`` (A, B, sigma; float64), the fixed ``eps [n, ...]`` and the
    draft noise ``xi [n, G, ...]`` (float64)."""
    kernel = _kernel(y0) if xi.numel() <= KERNEL_MAX_ELEMENTS else None
    if kernel is not None:
        Y = torch.empty((y0.shape[0], coef.shape[2] + 1) + tuple(y0.shape[1:]), dtype=y0.dtype)
        if kernel(Y, y0.contiguous(), coef, eps.contiguous(), xi):  # a Frozen round's eps is a column of E
            return Y
    return affine_states_torch(y0, coef, eps, xi)


def affine_states_torch(y0: torch.Tensor, coef: torch.Tensor, eps: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """:func:`affine_states` by torch's operations: what does not depend on the previous state (``sigma xi`` and
    ``B eps``) for all slots at once, then ``(A y + B eps) + sigma xi`` slot by slot."""
    A, drift, noise = coef[0].unbind(1), (coef[1] * eps[:, None]).unbind(1), (coef[2] * xi).unbind(1)
    ys, y64 = [y0], y0.to(torch.float64)
    for j in range(len(A)):
        ys.append((A[j] * y64 + drift[j] + noise[j]).to(y0.dtype))
        y64 = ys[-1].to(torch.float64)
    return torch.stack(ys, dim=1)


def step_kernel(y0: torch.Tensor, xi: torch.Tensor) -> Callable | None:
    """The kernel that steps a model drafter's round from ``y0 [n, ...]`` with draft noise ``xi [n, G, ...]``, one
    call a slot (:func:`model_step`), looked up once a round; None where it does not serve (torch's operations would
    cost more in slot-major states than the loop's own steps)."""
    return _step_kernel(y0) if xi.numel() <= KERNEL_MAX_ELEMENTS else None


def model_step(kernel: Callable, S: torch.Tensor, j: int, coef: torch.Tensor, eps: torch.Tensor,
               xi: torch.Tensor) -> None:
    """Slot ``j + 1`` of the slot-major drafted states ``S [G + 1, n, ...]`` from slot ``j`` by ``kernel`` (from
    :func:`step_kernel`), where a draft model gave slot j's eps ``eps [n, ...]`` (the state's dtype); ``coef`` and
    ``xi`` as :func:`affine_states` takes them. Torch's operations where the kernel refuses the call."""
    if not kernel(S, j, coef, eps.contiguous(), xi):
        model_step_torch(S, j, coef, eps, xi)


def model_step_torch(S: torch.Tensor, j: int, coef: torch.Tensor, eps: torch.Tensor, xi: torch.Tensor) -> None:
    """:func:`model_step` by torch's operations, ``(A y + B eps) + sigma xi``."""
    A, B, sigma = (c[:, j] for c in coef)
    S[j + 1] = (A * S[j].to(torch.float64) + B * eps.to(torch.float64) + sigma * xi[:, j]).to(S.dtype)


def _kernel(y0: torch.Tensor) -> Callable | None:
    if not ENABLED or not y0.is_cpu or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("draft_affine", 0, _kernel_matches)


def _step_kernel(S: torch.Tensor) -> Callable | None:
    if not ENABLED or not S.is_cpu or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("draft_step", 0, _step_kernel_matches)


def _kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`affine_states_torch`'s values (NaN where it gives NaN): float32 and float64
    states of 1 and 4 rows, 1 and 7 slots, 15 and 64 elements, from seed 0, with states past the dtype's range,
    subnormal drifts and NaN noise among them."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for n, G, shape in ((1, 7, (1, 8, 8)), (4, 1, (3, 5)), (4, 7, (3, 5))):
            y0 = (torch.randn((n,) + shape, generator=generator, dtype=torch.float64) * 3).to(dtype)
            y0.view(-1)[0] = 3e38 if dtype == torch.float32 else 1e308  # steps past the dtype's range
            coef = torch.stack([torch.rand(n, G, generator=generator, dtype=torch.float64) + 0.5,
                                torch.randn(n, G, generator=generator, dtype=torch.float64),
                                torch.rand(n, G, generator=generator, dtype=torch.float64)])
            coef[1, 0, 0] = 1e-310  # subnormal drifts B eps
            coef = coef.reshape((3, n, G) + (1,) * len(shape))
            eps = torch.randn((n,) + shape, generator=generator, dtype=torch.float64)
            xi = torch.randn((n, G) + shape, generator=generator, dtype=torch.float64)
            xi.view(-1)[-1] = float("nan")
            Y = torch.empty((n, G + 1) + shape, dtype=dtype)
            want = affine_states_torch(y0, coef, eps, xi)
            if not kernel(Y, y0, coef, eps, xi) or not cpu_kernels.same_values(Y, want):
                return False
    return True


def _step_kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`model_step_torch`'s values (NaN where it gives NaN) at every slot: float32 states
    with float32 and float64 eps, float64 states, 1 and 4 rows, 1 and 7 slots, 15 and 64 elements, from seed 1, with
    states past the dtype's range, subnormal drifts and NaN noise among them."""
    generator = torch.Generator().manual_seed(1)
    for dtype, eps_dtype in ((torch.float32, torch.float32), (torch.float32, torch.float64),
                             (torch.float64, torch.float64)):
        for n, G, shape in ((1, 7, (1, 8, 8)), (4, 1, (3, 5)), (4, 7, (3, 5))):
            normal = lambda *size: torch.randn(size, generator=generator, dtype=torch.float64)  # noqa: E731
            S = (normal(G + 1, n, *shape) * 3).to(dtype)
            S[0].view(-1)[0] = 3e38 if dtype == torch.float32 else 1e308  # steps past the dtype's range
            coef = torch.stack([torch.rand(n, G, generator=generator, dtype=torch.float64) + 0.5,
                                torch.randn(n, G, generator=generator, dtype=torch.float64),
                                torch.rand(n, G, generator=generator, dtype=torch.float64)])
            coef[1, 0, 0] = 1e-310  # subnormal drifts B eps
            coef = coef.reshape((3, n, G) + (1,) * len(shape))
            xi = normal(n, G, *shape)
            xi.view(-1)[-1] = float("nan")
            got, want = S.clone(), S.clone()
            for j in range(G):
                eps = normal(n, *shape).to(eps_dtype)
                model_step_torch(want, j, coef, eps, xi)
                if not kernel(got, j, coef, eps, xi):
                    return False
            if not cpu_kernels.same_values(got, want):
                return False
    return True
