"""The CPU RMSNorm kernel (specray/models/cpu_norm.py): torch's values bit for bit where it serves a call,
torch's operations everywhere else, and a kernel that sums otherwise refused by the check."""

from __future__ import annotations

import pytest
import torch

from specray.models import cpu_kernels, cpu_norm
from specray.models.discrete_ar import RMSNorm

pytestmark = pytest.mark.usefixtures("single_thread")  # the actors' setting (conftest)


@pytest.fixture(scope="module")
def kernel(single_thread):
    fast = cpu_norm.kernel(64)
    if fast is None:
        pytest.skip("the RMSNorm kernel did not build or did not match torch's operations here (see the log)")
    return fast


@pytest.mark.parametrize("width", [8, 16, 24, 48, 64, 72, 200, 504, 511])
def test_kernel_gives_torchs_values(kernel, width):
    # 7 row counts (8-row blocks and rows left over) x 3 scales, seed 7 (not the self-check's seed 0).
    generator = torch.Generator().manual_seed(7)
    weight = torch.randn(width, generator=generator)
    for rows in (1, 2, 3, 8, 15, 256, 1280):
        for scale in (1e-4, 1.0, 50.0):
            x = torch.randn(rows, width, generator=generator) * scale
            got = kernel(x, weight, 1e-6)
            assert got is not None and torch.equal(got, cpu_norm.torch_rms_norm(x, weight, 1e-6)), (width, rows, scale)


@pytest.mark.parametrize("why", ["narrow", "wide", "float64", "strided"])
def test_calls_the_kernel_does_not_serve_go_to_torch(kernel, why):
    width = {"narrow": 7, "wide": 512}.get(why, 64)
    x = torch.randn(6, width, dtype=torch.float64 if why == "float64" else torch.float32)
    weight = torch.randn(width, dtype=x.dtype)
    if why == "strided":
        x = torch.randn(width, 6).t()
    assert kernel(x, weight, 1e-5) is None
    assert torch.equal(cpu_norm.rms_norm(x, weight, 1e-5), cpu_norm.torch_rms_norm(x, weight, 1e-5))


def test_the_check_refuses_a_kernel_that_sums_otherwise():
    """Negative control for the guard: the same norm with the sum of squares taken in float64 (correctly
    rounded, not torch's order) differs in the last bits of some rows, and is refused."""
    def float64_sum(x, weight, eps):
        squares = torch.sum(x.double() ** 2, dim=-1, keepdim=True).float()
        return (x * (squares / x.shape[-1] + eps).rsqrt()) * weight

    assert not cpu_norm._matches_torch(float64_sum, 64)
    assert cpu_norm._matches_torch(cpu_norm.torch_rms_norm, 64)


def test_the_model_norm_uses_the_kernel_in_cpu_inference_only(kernel, monkeypatch):
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    calls = []
    extension = cpu_kernels.extension()
    real = extension.rms_norm
    monkeypatch.setattr(extension, "rms_norm", lambda *args: calls.append(1) or real(*args))
    x = torch.randn(2, 5, 64)
    with torch.inference_mode():
        fast = norm(x)
    assert calls and torch.equal(fast, cpu_norm.torch_rms_norm(x, norm.weight.detach(), 1e-5))
    calls.clear()
    trained = norm(x)  # autograd on: torch's generic form, which the backward pass needs
    assert not calls and trained.requires_grad
    monkeypatch.setattr(cpu_norm, "ENABLED", False)
    with torch.inference_mode():
        assert torch.equal(norm(x), fast) and not calls
