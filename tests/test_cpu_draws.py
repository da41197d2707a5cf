"""A speculative diffusion round's draws on a CPU (specray/methods/diffusion/cpu_draws.py): the kernel's bits are
torch's operations' wherever it serves a call, and each draw is specray.rng's at its key; torch's operations run
everywhere else; a kernel that draws otherwise is refused by the check; and the loops' samples are the same with
and without it."""

from __future__ import annotations

import pytest
import torch

from specray import rng
from specray.methods.diffusion import cpu_draws
from specray.models import cpu_kernels
from tests.diffusion_kernel_runs import assert_same_with_and_without

STREAMS = ("draft", "accept", "residual", "residual_noise")


@pytest.fixture(scope="module")
def kernel():
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    found = cpu_draws._kernel(torch.zeros(1, dtype=torch.int64))
    assert found is not None, "the draws kernel built but did not give torch's values (see the log)"
    return found


def _hashes(seed: int, sample_ids: torch.Tensor, streams: int) -> torch.Tensor:
    return torch.stack([rng.stream_hash(seed, sample_ids, s) for s in STREAMS[:streams]])


def _same(got: tuple, want: tuple) -> bool:
    return all(g.shape == w.shape and g.dtype == w.dtype and torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("streams, residual_noise", [(2, False), (4, False), (4, True)])
@pytest.mark.parametrize("n, G, shape", [(1, 7, (1, 8, 8)), (33, 3, (4,)), (5, 12, (3, 16, 16))])
def test_kernel_gives_torchs_bits_and_rngs_draws(kernel, streams: int, residual_noise: bool, n: int, G: int,
                                                 shape: tuple[int, ...]) -> None:
    """Another grid than the check's (seed 7, 40 sample ids, the round's rows a random subset): the kernel's keys,
    normals and uniforms are torch's bit for bit, and each is specray.rng's draw at (seed, sample id, stream,
    position = the round, step = the slot's step)."""
    generator = torch.Generator().manual_seed(7)
    sample_ids = torch.randperm(1000, generator=generator)[:40]
    hashes = _hashes(7, sample_ids, streams)
    rows = torch.randperm(40, generator=generator)[:n]
    steps = torch.randint(0, 1000, (n, G), generator=generator)
    got = kernel(hashes, rows, 21, steps, list(shape), residual_noise)
    assert _same(got, cpu_draws.round_draws_torch(hashes, rows, 21, steps, shape, residual_noise))
    assert _same(cpu_draws.round_draws(hashes, rows, 21, steps, shape, residual_noise), got)
    _, normals, uniforms = got
    ids = sample_ids[rows][:, None]
    normal_streams = ("draft", "residual_noise") if residual_noise else ("draft",)
    for q, stream in enumerate(normal_streams):
        want = rng.normal(7, ids, stream, position=21, step=steps, shape=shape, dtype=torch.float64)
        assert torch.equal(normals[q], want), stream
    for q, stream in enumerate(("accept", "residual")[: 1 + (streams == 4)]):
        assert torch.equal(uniforms[q], 1.0 - rng.uniform(7, ids, stream, position=21, step=steps)), stream


def test_calls_the_kernel_does_not_serve_go_to_torch(kernel) -> None:
    """Three streams, the residual noise asked of two streams, steps of one row for two: the kernel gives nothing
    and ``round_draws`` gives torch's bits; float hashes, a row out of range: the kernel gives nothing."""
    hashes = _hashes(1, torch.arange(4), 4)
    rows, steps = torch.tensor([0, 3]), torch.arange(10).reshape(2, 5)
    to_torch = {
        "three streams": (hashes[:3], rows, steps, False),
        "residual noise of two streams": (hashes[:2], rows, steps, True),
        "steps of one row": (hashes, rows, steps[:1], False),
    }
    for name, (h, r, s, noise) in to_torch.items():
        assert all(t is None for t in kernel(h, r, 2, s, [1, 8, 8], noise)), name
        assert _same(cpu_draws.round_draws(h, r, 2, s, (1, 8, 8), noise),
                     cpu_draws.round_draws_torch(h, r, 2, s, (1, 8, 8), noise)), name
    refused = {"float hashes": (hashes.double(), rows), "row out of range": (hashes, torch.tensor([0, 4]))}
    for name, (h, r) in refused.items():
        assert all(t is None for t in kernel(h, r, 2, steps, [1, 8, 8], False)), name


def test_kernels_that_draw_otherwise_are_refused() -> None:
    """Negative controls for the check: the uniforms not subtracted from 1, Box-Muller's sine in place of its
    cosine, the normals rounded through float32, the round index left out of the keys."""

    def torch_then(change):
        def kernel(hashes, rows, index, steps, shape, residual_noise):
            return change(*cpu_draws.round_draws_torch(hashes, rows, index, steps, tuple(shape), residual_noise))
        return kernel

    def sine(hashes, rows, index, steps, shape, residual_noise):
        draws, _, uniforms = cpu_draws.round_draws_torch(hashes, rows, index, steps, tuple(shape), residual_noise)
        u = rng.uniform_at(draws[0::3] if residual_noise else draws[:1], tuple(shape) + (2,))
        return draws, torch.sqrt(-2.0 * torch.log(1.0 - u[..., 0])) * torch.sin(2.0 * torch.pi * u[..., 1]), uniforms

    def no_round(hashes, rows, index, steps, shape, residual_noise):
        return cpu_draws.round_draws_torch(hashes, rows, 0, steps, tuple(shape), residual_noise)

    wrong = {
        "uniforms not from 1": torch_then(lambda d, n, u: (d, n, 1.0 - u)),
        "sine": sine,
        "float32 normals": torch_then(lambda d, n, u: (d, n.float().double(), u)),
        "no round index": no_round,
    }
    assert cpu_draws._kernel_matches(torch_then(lambda *draws: draws), 0)
    for name, kernel in wrong.items():
        assert not cpu_draws._kernel_matches(kernel, 0), name


def test_large_rounds_go_to_torch(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``KERNEL_MAX_ELEMENTS`` normals torch's operations (every intra-op thread) draw: the kernel is not
    called, and the bits are the same."""
    hashes, rows, steps = _hashes(2, torch.arange(6), 4), torch.arange(6), torch.arange(42).reshape(6, 7)
    calls = []
    monkeypatch.setattr(cpu_draws, "_kernel", lambda h: calls.append(1) or kernel)
    small = cpu_draws.round_draws(hashes, rows, 3, steps, (1, 8, 8), True)
    monkeypatch.setattr(cpu_draws, "KERNEL_MAX_ELEMENTS", 2 * steps.numel() * 64 - 1)
    large = cpu_draws.round_draws(hashes, rows, 3, steps, (1, 8, 8), True)
    assert len(calls) == 1 and _same(small, large)


@pytest.mark.parametrize("drafter, verification, rejection", [("free", "block", "residual"),
                                                              ("model", "token", "reflection")])
def test_chains_are_the_same_with_and_without_the_kernel(kernel, monkeypatch: pytest.MonkeyPatch, drafter: str,
                                                         verification: str, rejection: str) -> None:
    """The linear-Gaussian chain and the digits DDPM (``assert_same_with_and_without``): the same states and
    statistics with the kernel and with torch's operations, the kernel drawing every round."""
    served = assert_same_with_and_without(cpu_draws, monkeypatch, drafter, verification, rejection)
    assert len(served) > 10 and all(out[0] is not None for out in served)
