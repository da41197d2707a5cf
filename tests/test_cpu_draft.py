"""The diffusion rounds' drafted states on a CPU (specray/methods/diffusion/cpu_draft.py): the kernel's values are
torch's operations' wherever it serves a call, torch's operations run everywhere else, a kernel that rounds or
orders otherwise is refused by the check, and the loops' samples are the same with and without it."""

from __future__ import annotations

import pytest
import torch

from specray.methods.diffusion import cpu_draft, loop
from specray.models import cpu_kernels
from tests.diffusion_kernel_runs import assert_same_with_and_without, checked_kernel, spy_on_kernel


@pytest.fixture(scope="module")
def kernel():
    return checked_kernel(cpu_draft._kernel, "draft kernel")


def _inputs(n: int, G: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    y0 = (torch.randn((n,) + shape, generator=generator, dtype=torch.float64) * 2).to(dtype)
    coef = torch.stack([torch.rand(n, G, generator=generator, dtype=torch.float64) * 1.5,
                        torch.randn(n, G, generator=generator, dtype=torch.float64),
                        torch.rand(n, G, generator=generator, dtype=torch.float64)]).reshape((3, n, G) + (1,) * len(shape))
    eps = torch.randn((n,) + shape, generator=generator, dtype=torch.float64)
    xi = torch.randn((n, G) + shape, generator=generator, dtype=torch.float64)
    return y0, coef, eps, xi


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, G, shape", [(1, 7, (1, 8, 8)), (2, 3, (4,)), (33, 1, (2, 3, 5)), (5, 12, (3, 16, 16))])
def test_kernel_gives_torchs_values(kernel, dtype: torch.dtype, n: int, G: int, shape: tuple[int, ...]) -> None:
    """Another grid than the check's (seed 7): rows, slots and state shapes, with states near the dtype's range
    (steps that overflow to inf), zero coefficients and NaN noise among them."""
    y0, coef, eps, xi = _inputs(n, G, shape, dtype, seed=7)
    y0.view(-1)[-1] = torch.finfo(dtype).max / 2
    coef[0, -1, 0] = 0.0
    xi.view(-1)[n * G // 2] = float("nan")
    Y = torch.full((n, G + 1) + shape, 7.0, dtype=dtype)
    assert kernel(Y, y0, coef, eps, xi)
    assert cpu_kernels.same_values(Y, cpu_draft.affine_states_torch(y0, coef, eps, xi))
    assert cpu_kernels.same_values(cpu_draft.affine_states(y0, coef, eps, xi), Y)


def test_calls_the_kernel_does_not_serve_go_to_torch(kernel) -> None:
    """Strided inputs, a half-precision state, float32 noise: the kernel writes nothing and ``affine_states`` gives
    torch's values; coefficients of another shape: nothing written."""
    y0, coef, eps, xi = _inputs(3, 4, (2, 5), torch.float32, seed=1)
    wide = torch.randn(3, 4, 2, 10, dtype=torch.float64)
    cases = {
        "strided noise": (y0, coef, eps, wide[..., ::2]),
        "strided state": (torch.randn(3, 2, 10)[..., ::2], coef, eps, xi),
        "half state": (y0.half(), coef, eps, xi),
        "float32 noise": (y0, coef, eps, xi.float()),
    }
    for name, (s0, c, e, x) in cases.items():
        Y = torch.full((3, 5, 2, 5), 7.0, dtype=s0.dtype)
        assert not kernel(Y, s0, c, e, x), name
        assert torch.all(Y == 7.0), name
        got, want = cpu_draft.affine_states(s0, c, e, x), cpu_draft.affine_states_torch(s0, c, e, x)
        assert got.dtype == s0.dtype and cpu_kernels.same_values(got, want), name
    Y = torch.full((3, 5, 2, 5), 7.0)
    assert not kernel(Y, y0, coef[:2], eps, xi) and not kernel(Y, y0, coef[:, :2], eps, xi)  # not [3, n, G]
    assert torch.all(Y == 7.0)


def test_kernels_that_round_or_order_otherwise_are_refused() -> None:
    """Negative controls for the check: the step's sum in another order, the noise added in float32, no rounding
    to the state's dtype between steps."""

    def write(Y: torch.Tensor, states: torch.Tensor) -> bool:
        Y.copy_(states)
        return True

    def other_order(Y, y0, coef, eps, xi):
        A, drift, noise = coef[0].unbind(1), (coef[1] * eps[:, None]).unbind(1), (coef[2] * xi).unbind(1)
        ys = [y0]
        for j in range(len(A)):
            ys.append((A[j] * ys[-1].double() + (drift[j] + noise[j])).to(y0.dtype))
        return write(Y, torch.stack(ys, dim=1))

    def float32_noise(Y, y0, coef, eps, xi):
        return write(Y, cpu_draft.affine_states_torch(y0, coef, eps, xi.float().double()))

    def no_rounding(Y, y0, coef, eps, xi):
        A, drift, noise = coef[0].unbind(1), (coef[1] * eps[:, None]).unbind(1), (coef[2] * xi).unbind(1)
        ys, y64 = [y0.double()], y0.double()
        for j in range(len(A)):
            y64 = A[j] * y64 + drift[j] + noise[j]
            ys.append(y64)
        return write(Y, torch.stack(ys, dim=1).to(y0.dtype))

    assert cpu_draft._kernel_matches(lambda Y, *args: write(Y, cpu_draft.affine_states_torch(*args)), 0)
    for wrong in (other_order, float32_noise, no_rounding):
        assert not cpu_draft._kernel_matches(wrong, 0), wrong.__name__


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_drafted_states_are_the_samplers_own_steps(kernel, dtype: torch.dtype) -> None:
    """Each drafted state is ``loop._step`` (the step every sampler takes, target_only's too) of the one before at
    its row's step: 5 rows at steps 0-4 of a 12-step chain with random coefficients, 7 slots, seed 4; the kernel's
    states and torch's, bit for bit."""
    generator = torch.Generator().manual_seed(4)
    K, n, G, shape = 12, 5, 7, (1, 8, 8)
    tables = [torch.rand(K, generator=generator, dtype=torch.float64) + 0.3 for _ in range(3)]
    chain = loop.GaussianChain(A=tables[0], B=tables[1] - 0.8, sigma=tables[2], target_eps=None)
    k = torch.arange(n)
    steps = (k[:, None] + torch.arange(G)).clamp(max=K - 1)
    coef = torch.stack([chain.A, chain.B, chain.sigma])[:, steps].reshape((3, n, G) + (1,) * len(shape))
    y0 = torch.randn((n,) + shape, generator=generator, dtype=torch.float64).to(dtype)
    eps = torch.randn((n,) + shape, generator=generator, dtype=torch.float64)
    xi = torch.randn((n, G) + shape, generator=generator, dtype=torch.float64)
    Y = torch.empty((n, G + 1) + shape, dtype=dtype)
    assert kernel(Y, y0, coef, eps, xi)
    for states in (Y, cpu_draft.affine_states_torch(y0, coef, eps, xi)):
        y = y0
        for j in range(G):
            y = loop._step(chain, y, eps, steps[:, j], xi[:, j])
            assert cpu_kernels.same_values(states[:, j + 1].contiguous(), y)


def test_large_rounds_go_to_torch(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``KERNEL_MAX_ELEMENTS`` drafted elements torch's operations (every intra-op thread) draft: the kernel
    is not called, and the values are the same."""
    y0, coef, eps, xi = _inputs(4, 7, (3, 8, 8), torch.float32, seed=2)
    calls = []
    monkeypatch.setattr(cpu_draft, "_kernel", lambda y: calls.append(1) or kernel)
    small = cpu_draft.affine_states(y0, coef, eps, xi)
    monkeypatch.setattr(cpu_draft, "KERNEL_MAX_ELEMENTS", xi.numel() - 1)
    large = cpu_draft.affine_states(y0, coef, eps, xi)
    assert len(calls) == 1 and cpu_kernels.same_values(small, large)


@pytest.mark.parametrize("drafter, verification", [("frozen", "block"), ("free", "block"), ("free", "token")])
def test_chains_are_the_same_with_and_without_the_kernel(kernel, monkeypatch: pytest.MonkeyPatch, drafter: str,
                                                         verification: str) -> None:
    """The linear-Gaussian chain and the digits DDPM (``assert_same_with_and_without``, ψ_α's residual): the same
    states and statistics with the kernel and with torch's operations, every round of the kernel's run drafted by
    it."""
    served = assert_same_with_and_without(cpu_draft, monkeypatch, drafter, verification, "residual")
    assert len(served) > 10 and all(served)


@pytest.fixture(scope="module")
def step_kernel():
    return checked_kernel(cpu_draft._step_kernel, "draft step kernel")


def _slot_major(n: int, G: int, shape: tuple[int, ...], dtype: torch.dtype, seed: int):
    """A round's slot-major states with slot 0 set (the rest NaN), its coefficients, noise and per-slot model eps."""
    y0, coef, _, xi = _inputs(n, G, shape, dtype, seed)
    S = torch.full((G + 1, n) + shape, float("nan"), dtype=dtype)
    S[0] = y0
    eps = torch.randn((G, n) + shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
    return S, coef, eps.to(dtype), xi


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n, G, shape", [(1, 7, (1, 8, 8)), (33, 3, (4,)), (5, 12, (3, 16, 16))])
def test_model_steps_are_torchs_and_the_samplers_own(step_kernel, dtype: torch.dtype, n: int, G: int,
                                                     shape: tuple[int, ...]) -> None:
    """A model drafter's round step by step (seed 8, another grid than the check's): the kernel's states are
    ``model_step_torch``'s bit for bit, and each is ``loop._step`` of the one before with that slot's eps."""
    S, coef, eps, xi = _slot_major(n, G, shape, dtype, seed=8)
    want = S.clone()
    for j in range(G):
        assert step_kernel(S, j, coef, eps[j], xi)
        cpu_draft.model_step_torch(want, j, coef, eps[j], xi)
    assert cpu_kernels.same_values(S, want)
    chain = loop.GaussianChain(A=coef[0].flatten(), B=coef[1].flatten(), sigma=coef[2].flatten(), target_eps=None)
    for j in range(G):
        k = torch.arange(n) * G + j  # row i's slot j is entry i G + j of the flattened coefficients
        assert cpu_kernels.same_values(S[j + 1], loop._step(chain, S[j], eps[j], k, xi[:, j]))


def test_model_steps_the_kernel_does_not_serve_go_to_torch(step_kernel) -> None:
    """float32 eps for float64 states, a strided eps, a slot past the round, coefficients of another row count:
    the kernel writes nothing and says so; ``model_step`` gives torch's values for the first two."""
    S, coef, eps, xi = _slot_major(3, 4, (2, 5), torch.float64, seed=2)
    wide = torch.cat([eps[0], eps[0]], dim=-1)
    cases = {"float32 eps": (0, coef, eps[0].float()), "strided eps": (0, coef, wide[..., ::2]),
             "slot past the round": (4, coef, eps[0]), "coef of two rows": (0, coef[:, :2], eps[0])}
    for name, (j, c, e) in cases.items():
        before = S.clone()
        assert not step_kernel(S, j, c, e, xi), name
        assert cpu_kernels.same_values(S, before), name
    for name in ("float32 eps", "strided eps"):
        j, c, e = cases[name]
        got, want = S.clone(), S.clone()
        cpu_draft.model_step(step_kernel, got, j, c, e, xi)
        cpu_draft.model_step_torch(want, j, c, e, xi)
        assert not got[1].isnan().any() and cpu_kernels.same_values(got, want), name


def test_model_step_kernels_that_round_or_order_otherwise_are_refused() -> None:
    """Negative controls for the step's check: the sum in another order, the noise in float32, the eps rounded to
    float32 first."""

    def wrong(how):
        def step(S, j, coef, eps, xi):
            A, B, sigma = (c[:, j] for c in coef)
            S[j + 1] = how(A, S[j].double(), B, eps.double(), sigma, xi[:, j]).to(S.dtype)
            return True
        return step

    wrongs = {"other order": wrong(lambda A, y, B, e, s, x: A * y + (B * e + s * x)),
              "float32 noise": wrong(lambda A, y, B, e, s, x: A * y + B * e + (s * x).float().double()),
              "float32 eps": wrong(lambda A, y, B, e, s, x: A * y + B * e.float().double() + s * x)}
    assert cpu_draft._step_kernel_matches(wrong(lambda A, y, B, e, s, x: A * y + B * e + s * x), 0)
    for name, kernel_off in wrongs.items():
        assert not cpu_draft._step_kernel_matches(kernel_off, 0), name


@pytest.mark.parametrize("verification, rejection", [("token", "reflection"), ("block", "residual")])
def test_model_chains_are_the_same_with_and_without_the_step_kernel(step_kernel, monkeypatch: pytest.MonkeyPatch,
                                                                    verification: str, rejection: str) -> None:
    """The linear-Gaussian chain and the digits DDPM with the model drafter (``assert_same_with_and_without``: the
    module's switch turns the step's kernel off too; ``_step_kernel`` spied on): the same states, statistics and
    images with the kernel stepping every round and with the loop's own torch steps."""
    served = spy_on_kernel(cpu_draft, monkeypatch, "_step_kernel")
    assert_same_with_and_without(cpu_draft, monkeypatch, "model", verification, rejection)
    assert len(served) > 50 and all(served)
