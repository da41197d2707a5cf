"""The residual sampler in C++ (``csrc/residual_draw.cpp``): the Newton draws (:func:`residual._draws_kernel`) give
the tensor path's bits on one row and on many, the Python path serves where the kernel refuses a call, a kernel
that differs is refused by the check; a round's new states (:func:`loop._states_kernel`) are ``_mean`` and
``sample_residual``'s or ``reflect``'s values; the diffusion loop's samples are the same with and without them."""

from __future__ import annotations

import hashlib
import math

import pytest
import torch

from specray.methods.diffusion import cpu_commit, loop, residual
from specray.methods.diffusion.residual import sample_psi
from specray.models import cpu_kernels
from tests.test_diffusion_residual import random_draws


@pytest.fixture(scope="module")
def kernel():
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    found = residual._draws_kernel(torch.zeros(1))
    assert found is not None, "the draws kernel built but did not give the Python path's bits (see the log)"
    return found


def on_tensors(monkeypatch, *args) -> torch.Tensor:
    monkeypatch.setattr(residual, "ONE_ROW_ON_HOST", False)  # the tensor path, kernel and host path off
    try:
        return sample_psi(*args)
    finally:
        monkeypatch.setattr(residual, "ONE_ROW_ON_HOST", True)


def sample_digest(method: str, params: dict, batch: int, first_id: int) -> str:
    """SHA-256 of a diffusion batch's images and statistics (the built-in pair, sample ids from ``first_id``, seed 5)."""
    from specray.models.diffusion import load_pair

    ids = torch.arange(batch) + first_id
    with torch.inference_mode():
        result = loop.run_batch(method, params, load_pair("digits-ddpm", "digits-ddpm-draft", "cpu"), ids % 10, ids, 5)
    stats = repr([vars(s) for s in result.stats]).encode()
    return hashlib.sha256(result.images.numpy().tobytes() + stats).hexdigest()


def test_one_row_draws_give_the_tensor_paths_bits(kernel, monkeypatch) -> None:
    """1,500 one-row draws (seed 41), each a call of its own as the loop's cut row at batch 1 makes it."""
    rows = [tuple(t[i : i + 1] for t in random_draws(1500, 41)) for i in range(1500)]
    with_kernel = torch.cat([sample_psi(*row) for row in rows])
    assert cpu_kernels.same_values(with_kernel, torch.cat([on_tensors(monkeypatch, *row) for row in rows]))


@pytest.mark.parametrize("n", [2, 7, 300])
def test_many_rows_give_the_tensor_paths_bits(kernel, monkeypatch, n: int) -> None:
    """A batch's cut rows in one call (seed 43): the tensor path stops its Newton loop when every row's state has
    recurred, the kernel row by row; both give each row's 16-step value."""
    delta, log_alpha, u = random_draws(n, 43) if n > 100 else (t[:n] for t in random_draws(200, 43 + n))
    got = sample_psi(delta, log_alpha, u)
    assert got.shape == (n,) and cpu_kernels.same_values(got, on_tensors(monkeypatch, delta, log_alpha, u))


def test_edge_inputs_give_the_tensor_paths_bits(kernel, monkeypatch) -> None:
    """Zero, subnormal, huge, infinite and NaN inputs (336 combinations): the kernel serves every call without a
    zero delta, bit for bit (NaN for NaN), and a call with one goes to the Python and tensor paths."""
    deltas = [0.0, 1e-300, 1e-12, 0.5, 40.0, 1e300, math.inf, math.nan]
    log_alphas = [0.0, -1e-300, -0.3, -50.0, -1e300, -math.inf, math.nan]
    us = [0.0, 1e-320, 1e-300, 0.3, 1.0, math.nan]
    cases = [(torch.tensor([d], dtype=torch.float64), torch.tensor([a], dtype=torch.float64),
              torch.tensor([v], dtype=torch.float64)) for d in deltas for a in log_alphas for v in us]
    got = torch.cat([sample_psi(*case) for case in cases])
    assert cpu_kernels.same_values(got, torch.cat([on_tensors(monkeypatch, *case) for case in cases]))
    columns = [torch.cat(column) for column in zip(*cases)]
    assert kernel(*columns, residual.KERNEL_CONSTANTS) is None  # a zero delta among them: refused whole


def test_calls_the_kernel_does_not_serve_are_refused(kernel) -> None:
    one = torch.tensor([0.5], dtype=torch.float64)
    constants = residual.KERNEL_CONSTANTS
    assert kernel(one, one, one, constants) is not None
    assert kernel(one.float(), one, one, constants) is None  # float32
    assert kernel(torch.tensor([0.5, 0.6], dtype=torch.float64), one, one, constants) is None  # lengths differ
    two = torch.full((2,), 0.5, dtype=torch.float64)
    assert kernel(torch.zeros(4, dtype=torch.float64)[::2] + 0.5, two, two, constants) is not None
    assert kernel(torch.full((4,), 0.5, dtype=torch.float64)[::2], one.repeat(2), one.repeat(2), constants) is None
    assert kernel(one, one, one, constants[:3]) is None


def test_a_kernel_that_differs_is_refused() -> None:
    """The check compares bit for bit: a draw off by one ulp fails it."""
    def off_by_an_ulp(delta, log_alpha, u, constants):
        right = torch.tensor([residual._sample_psi_one_row(*row) for row in zip(delta.tolist(), log_alpha.tolist(),
                                                                                     u.tolist())], dtype=torch.float64)
        right[7] = math.nextafter(right[7].item(), math.inf)
        return right

    exact = lambda d, a, u, c: torch.tensor(  # noqa: E731
        [residual._sample_psi_one_row(*row) for row in zip(d.tolist(), a.tolist(), u.tolist())], dtype=torch.float64)
    assert residual._draws_kernel_matches(exact, 0)
    assert not residual._draws_kernel_matches(off_by_an_ulp, 0)


@pytest.mark.parametrize("verification, batch", [("block", 1), ("block", 5), ("token", 3)])
def test_diffusion_samples_are_the_same_with_and_without_the_kernel(kernel, monkeypatch, verification: str,
                                                                    batch: int) -> None:
    """ψ_α's draws through the loop (the built-in pair, K = 30, seed 5): images and statistics unchanged. The commit
    kernel, which makes these calls itself, is off."""
    monkeypatch.setattr(cpu_commit, "ENABLED", False)
    params = {"num_steps": 30, "drafter": "free", "gamma": 5, "rejection": "residual"}
    digest = lambda: sample_digest(f"spec_{verification}", params, batch, 11)  # noqa: E731

    monkeypatch.setattr(loop, "_states_kernel", lambda chain, Y, name: None)  # the draws through sample_residual
    calls = []
    monkeypatch.setattr(residual, "_draws_kernel", lambda delta: calls.append(1) or kernel)
    with_kernel = digest()
    assert calls
    monkeypatch.setattr(residual, "_draws_kernel", lambda delta: None)
    assert digest() == with_kernel


@pytest.fixture(scope="module")
def states_kernel():
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    return states("residual_states")


def states(name: str):
    found = loop._states_kernel(loop.GaussianChain(torch.ones(1), torch.ones(1), torch.ones(1), None), torch.zeros(1),
                                name)
    assert found is not None, f"the {name} kernel built but did not give torch's values (see the log)"
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("rows, shape", [(1, (1, 8, 8)), (4, (3,)), (40, (2, 16, 16))])
def test_resampled_states_are_the_python_paths(states_kernel, dtype: torch.dtype, rows: int, shape) -> None:
    """Another grid than the check's (seed 13): the affine chain's mean (``loop._mean``) and ``sample_residual``, with
    a row of identical kernels (Delta of norm 1e-12, the fresh noise kept) and alpha = 1 among them."""
    gen = torch.Generator().manual_seed(13)
    x, eps = (torch.randn((rows,) + shape, dtype=torch.float64, generator=gen).to(dtype) for _ in range(2))
    coef = torch.rand(3, rows, dtype=torch.float64, generator=gen) + 0.1
    Delta = torch.randn((rows,) + shape, dtype=torch.float64, generator=gen)
    Delta[-1] *= 1e-14
    log_alpha = -torch.rand(rows, dtype=torch.float64, generator=gen)
    log_alpha[0] = 0.0
    u = 1 - torch.rand(rows, dtype=torch.float64, generator=gen)
    zeta = torch.randn((rows,) + shape, dtype=torch.float64, generator=gen)
    got = states_kernel(x, eps, coef, Delta, log_alpha, u, zeta, residual.KERNEL_CONSTANTS, residual.DELTA_MIN)
    chain, k = loop.GaussianChain(coef[0], coef[1], coef[2], None), torch.arange(rows)
    want = residual.sample_residual(loop._mean(chain, x, eps, k), Delta, chain.sigma[k], log_alpha, u, zeta)
    assert got.dtype == torch.float64 and cpu_kernels.same_values(got, want)
    assert torch.equal(got[-1], loop._mean(chain, x, eps, k)[-1] + coef[2, -1] * zeta[-1])


def test_resampled_states_calls_the_kernel_does_not_serve_are_refused(states_kernel) -> None:
    one, row = torch.ones(1, 4, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    coef, constants, delta_min = torch.ones(3, 1, dtype=torch.float64), residual.KERNEL_CONSTANTS, residual.DELTA_MIN
    assert states_kernel(one, one, coef, one, row, row, one, constants, delta_min) is not None
    assert states_kernel(one, one.float(), coef, one, row, row, one, constants, delta_min) is None  # dtypes differ
    assert states_kernel(one.half(), one.half(), coef, one, row, row, one, constants, delta_min) is None
    assert states_kernel(one, one, coef[:2], one, row, row, one, constants, delta_min) is None
    assert states_kernel(one, one, coef, one.float(), row, row, one, constants, delta_min) is None
    strided = torch.ones(1, 8, dtype=torch.float64)[:, ::2]
    assert states_kernel(one, one, coef, strided, row, row, one, constants, delta_min) is None


def test_a_resampled_states_kernel_that_differs_is_refused(states_kernel) -> None:
    def off_by_an_ulp(*args):
        y = states_kernel(*args)
        y.view(-1)[0] = math.nextafter(y.view(-1)[0].item(), math.inf)
        return y

    assert loop._states_kernel_matches(states_kernel, 0, reflected=False)
    assert not loop._states_kernel_matches(off_by_an_ulp, 0, reflected=False)


@pytest.mark.parametrize("method, batch", [("spec_block", 1), ("spec_block", 6), ("spec_token", 2)])
def test_diffusion_samples_are_the_same_with_and_without_the_states_kernel(states_kernel, monkeypatch, method: str,
                                                                           batch: int) -> None:
    """ψ_α's resampled states through the loop (the built-in pair, K = 30, Free drafter, seed 5): images and
    statistics unchanged. The commit kernel, which makes these calls itself, is off."""
    monkeypatch.setattr(cpu_commit, "ENABLED", False)
    params = {"num_steps": 30, "drafter": "free", "gamma": 5, "rejection": "residual"}
    digest = lambda: sample_digest(method, params, batch, 21)  # noqa: E731

    calls = []
    real = loop._states_kernel
    monkeypatch.setattr(loop, "_states_kernel", lambda chain, Y, name: calls.append(name) or real(chain, Y, name))
    with_kernel = digest()
    assert calls == ["residual_states"] * len(calls) and calls
    monkeypatch.setattr(loop, "_states_kernel", lambda chain, Y, name: None)
    assert digest() == with_kernel


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reflected_states_are_the_python_paths(states_kernel, dtype: torch.dtype) -> None:
    """The affine chain's mean and ``reflect`` (40 rows of 2 x 16 x 16 and 1 row of 1 x 8 x 8, seed 17; a row of
    identical kernels among them, which ``reflect`` reflects about Delta / 1 all the same)."""
    kernel = states("reflected_states")
    gen = torch.Generator().manual_seed(17)
    for rows, shape in ((40, (2, 16, 16)), (1, (1, 8, 8))):
        x, eps = (torch.randn((rows,) + shape, dtype=torch.float64, generator=gen).to(dtype) for _ in range(2))
        coef = torch.rand(3, rows, dtype=torch.float64, generator=gen) + 0.1
        Delta = torch.randn((rows,) + shape, dtype=torch.float64, generator=gen)
        Delta[-1] *= 1e-14
        xi = torch.randn((rows,) + shape, dtype=torch.float64, generator=gen)
        got = kernel(x, eps, coef, Delta, xi, residual.DELTA_MIN)
        chain, k = loop.GaussianChain(coef[0], coef[1], coef[2], None), torch.arange(rows)
        want = residual.reflect(loop._mean(chain, x, eps, k), Delta, chain.sigma[k], xi)
        assert got.dtype == torch.float64 and cpu_kernels.same_values(got, want)
    assert kernel(x, eps, coef[:, :0], Delta, xi, residual.DELTA_MIN) is None  # coef of another row count


@pytest.mark.parametrize("drafter, batch", [("free", 1), ("frozen", 4)])
def test_diffusion_samples_are_the_same_with_and_without_the_reflection_kernel(states_kernel, monkeypatch,
                                                                               drafter: str, batch: int) -> None:
    """Token verification's reflected states through the loop (the built-in pair, K = 30, seed 5): images and
    statistics unchanged, and the reflection off by one ulp refused by the check. The commit kernel, which makes
    these calls itself, is off."""
    monkeypatch.setattr(cpu_commit, "ENABLED", False)
    kernel = states("reflected_states")
    digest = lambda: sample_digest("spec_token", {"num_steps": 30, "drafter": drafter, "gamma": 5}, batch, 31)  # noqa: E731

    calls = []
    real = loop._states_kernel
    monkeypatch.setattr(loop, "_states_kernel", lambda chain, Y, name: calls.append(name) or real(chain, Y, name))
    with_kernel = digest()
    assert calls and set(calls) == {"reflected_states"}
    monkeypatch.setattr(loop, "_states_kernel", lambda chain, Y, name: None)
    assert digest() == with_kernel

    def off_by_an_ulp(*args):
        y = kernel(*args)
        y.view(-1)[-1] = math.nextafter(y.view(-1)[-1].item(), -math.inf)
        return y

    assert not loop._states_kernel_matches(off_by_an_ulp, 0, reflected=True)
