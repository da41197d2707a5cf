"""A speculative diffusion round's log density ratios on a CPU (specray/methods/diffusion/cpu_ratios.py): the kernel's
values are torch's operations' wherever it serves a call, torch's operations run everywhere else (ragged rounds
among them), a kernel that rounds or sums otherwise is refused by the check, and the loops' samples are the same with
and without it."""

from __future__ import annotations

import pytest
import torch

from specray.methods.diffusion import cpu_ratios
from specray.methods.diffusion.rules import log_ratio
from specray.models import cpu_kernels
from tests.diffusion_kernel_runs import assert_same_with_and_without


@pytest.fixture(scope="module")
def kernel():
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    found = cpu_ratios._kernel(torch.zeros(1))
    assert found is not None, "the ratios kernel built but did not give torch's values (see the log)"
    return found


def _inputs(n: int, G: int, shape: tuple[int, ...], dtype: torch.dtype, per_slot: bool, seed: int):
    return cpu_ratios.random_round(n, G, shape, dtype, per_slot, torch.Generator().manual_seed(seed))


def _same(got: tuple, want: tuple) -> bool:
    return all(g.shape == w.shape and cpu_kernels.same_values(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, G, shape, per_slot", [(1, 7, (1, 8, 8), False), (33, 3, (4,), True),
                                                   (5, 12, (3, 16, 16), False), (2, 1, (2, 3, 5), True)])
def test_kernel_gives_torchs_values(kernel, dtype: torch.dtype, n: int, G: int, shape: tuple[int, ...],
                                    per_slot: bool) -> None:
    """Another grid than the check's (seed 7), with a zero B (Delta zero) and a subnormal sigma among the slots: the
    kernel's Delta, log rho and delta are torch's bit for bit, and log rho and delta are ``rules.log_ratio`` of its
    Delta."""
    coef, eps_draft, eps_target, xi = _inputs(n, G, shape, dtype, per_slot, seed=7)
    coef[1, 0, 0] = 0.0
    coef[2, -1, -1] = 1e-310
    got = kernel(coef, eps_draft, eps_target, xi)
    assert _same(got, cpu_ratios.affine_ratios_torch(coef, eps_draft, eps_target, xi))
    assert _same(cpu_ratios.affine_ratios(coef, eps_draft, eps_target, xi), got)
    assert _same(got[1:], log_ratio(got[0], xi))
    assert torch.all(got[0][0, 0] == 0) and torch.all(got[2][0, 0] == 0)


def test_calls_the_kernel_does_not_serve_go_to_torch(kernel) -> None:
    """A half-precision target eps, float32 noise: the kernel gives nothing and ``affine_ratios`` gives torch's
    values; coefficients of another shape, draft eps of another element count: the kernel gives nothing; strided
    inputs (a Free drafter's first round drafts from a column of the target eps): served, torch's values."""
    coef, eps_draft, eps_target, xi = _inputs(3, 4, (2, 5), torch.float32, False, seed=1)
    to_torch = {
        "half target eps": (coef, eps_draft, eps_target.half(), xi),
        "float32 noise": (coef, eps_draft, eps_target, xi.float()),
    }
    for name, args in to_torch.items():
        assert all(t is None for t in kernel(*args)), name
        assert _same(cpu_ratios.affine_ratios(*args), cpu_ratios.affine_ratios_torch(*args)), name
    refused = {"coef of two rows": (coef[:, :2], eps_draft, eps_target, xi),
               "draft eps of another element count": (coef, eps_draft[..., :4], eps_target, xi)}
    for name, args in refused.items():
        assert all(t is None for t in kernel(*args)), name
    wide = torch.randn(3, 4, 2, 10, dtype=torch.float64)
    strided = (coef, wide[:, :1, :, ::2], eps_target.double().transpose(0, 1).contiguous().transpose(0, 1),
               wide[..., 1::2])
    assert not strided[1].is_contiguous() and not strided[2].is_contiguous()
    assert _same(kernel(*strided), cpu_ratios.affine_ratios_torch(*strided))


def test_ragged_rounds_go_to_torch(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """A ragged round (``valid`` given): the kernel is not called, Delta is zero on the slots not drafted and the
    drafted slots' values are the full round's."""
    coef, eps_draft, eps_target, xi = _inputs(3, 4, (1, 8, 8), torch.float32, False, seed=3)
    calls = []
    monkeypatch.setattr(cpu_ratios, "_kernel", lambda eps: calls.append(1) or kernel)
    valid = torch.arange(4)[None, :] < torch.tensor([4, 2, 1])[:, None]
    Delta, log_rho, delta = cpu_ratios.affine_ratios(coef, eps_draft, eps_target, xi, valid)
    full = cpu_ratios.affine_ratios(coef, eps_draft, eps_target, xi)
    assert len(calls) == 1  # the full round's call only
    assert torch.all(Delta[~valid] == 0) and torch.all(delta[~valid] == 0)
    assert torch.equal(Delta[valid], full[0][valid]) and torch.equal(log_rho[valid], full[1][valid])


def test_kernels_that_round_or_sum_otherwise_are_refused() -> None:
    """Negative controls for the check: B / sigma taken first, log rho as a difference of squared norms (spec 3.1's
    cancellation), the sums in float32."""

    def b_over_sigma(coef, eps_draft, eps_target, xi):
        Delta = (coef[1] / coef[2]) * (eps_draft - eps_target.to(torch.float64))
        return Delta, *log_ratio(Delta, xi)

    def squared_norms(coef, eps_draft, eps_target, xi):
        Delta, _, delta = cpu_ratios.affine_ratios_torch(coef, eps_draft, eps_target, xi)
        X = xi.flatten(2)
        return Delta, -0.5 * (((X + Delta.flatten(2)) ** 2).sum(2) - (X * X).sum(2)), delta

    def float32_sums(coef, eps_draft, eps_target, xi):
        Delta, _, _ = cpu_ratios.affine_ratios_torch(coef, eps_draft, eps_target, xi)
        log_rho, delta = log_ratio(Delta.float(), xi.float())
        return Delta, log_rho.double(), delta.double()

    assert cpu_ratios._kernel_matches(cpu_ratios.affine_ratios_torch, 0)
    for wrong in (b_over_sigma, squared_norms, float32_sums):
        assert not cpu_ratios._kernel_matches(wrong, 0), wrong.__name__


def test_large_rounds_go_to_torch(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``KERNEL_MAX_ELEMENTS`` elements torch's operations (every intra-op thread) compute the ratios: the kernel
    is not called, and the values are the same."""
    args = _inputs(4, 7, (3, 8, 8), torch.float32, False, seed=2)
    calls = []
    monkeypatch.setattr(cpu_ratios, "_kernel", lambda eps: calls.append(1) or kernel)
    small = cpu_ratios.affine_ratios(*args)
    monkeypatch.setattr(cpu_ratios, "KERNEL_MAX_ELEMENTS", args[3].numel() - 1)
    large = cpu_ratios.affine_ratios(*args)
    assert len(calls) == 1 and _same(small, large)


@pytest.mark.parametrize("drafter, verification, rejection", [("free", "block", "residual"),
                                                              ("model", "token", "reflection")])
def test_chains_are_the_same_with_and_without_the_kernel(kernel, monkeypatch: pytest.MonkeyPatch, drafter: str,
                                                         verification: str, rejection: str) -> None:
    """The linear-Gaussian chain and the digits DDPM (``assert_same_with_and_without``): the same states and
    statistics with the kernel and with torch's operations, the kernel serving every full round."""
    served = assert_same_with_and_without(cpu_ratios, monkeypatch, drafter, verification, rejection)
    assert len(served) > 5 and all(out[0] is not None for out in served)
