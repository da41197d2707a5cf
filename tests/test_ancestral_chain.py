"""Plain ancestral sampling (target_only's loop) draws its noise for blocks of steps and steps an affine chain with the
draft kernel: the same bits as its definition, one ``rng.normal`` and one ``_step`` per denoising step, at every
block size, with the kernel and without, on the affine and the x0-clipped chains, and on the digits DDPM's images."""

from __future__ import annotations

import pytest
import torch

from specray import rng
from specray.methods.diffusion import cpu_draft, loop
from tests.diffusion_kernel_runs import spy_on_kernel
from tests.test_diffusion_chain import K, make_chain, start_states
from tests.test_diffusion_clipped_chain import clipped_chain


def per_step(chain: loop.GaussianChain, x: torch.Tensor, ids: torch.Tensor, seed: int, keys=lambda k: (0, k)):
    """The definition: step k's noise from stream ``eps`` at (position 0, step k), then ``A x + B eps + sigma xi``.
    ``keys`` maps k to the (position, step) drawn, for the negative control."""
    rows = torch.arange(x.shape[0])
    for k in range(chain.num_steps):
        kk = torch.full_like(rows, k)
        xi = rng.normal(seed, ids, "eps", *keys(k), shape=x.shape[1:], dtype=torch.float64)
        x = loop._step(chain, x, chain.target_eps(x, kk, rows), kk, xi)
    return x


def image_chain() -> loop.GaussianChain:
    """float32 states [4, 1, 8, 8], coefficients that change with the step (seed 0) and a nonlinear eps."""
    generator = torch.Generator().manual_seed(0)
    A, B, sigma = (torch.rand(K, dtype=torch.float64, generator=generator) + 0.2 for _ in range(3))

    def eps(x: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * (k[:, None, None, None] + 1)

    return loop.GaussianChain(A=A, B=-B, sigma=sigma, target_eps=eps)


@pytest.mark.parametrize("block_steps", [None, 5, 1])  # None: the default budget, all K = 12 steps in one block
@pytest.mark.parametrize("enabled", [True, False])
@pytest.mark.parametrize("case", ["affine", "image", "clipped"])
def test_blocks_give_the_per_step_bits(case: str, block_steps: int | None, enabled: bool,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    chain = {"affine": make_chain, "image": image_chain, "clipped": clipped_chain}[case]()
    if case == "image":
        x0, ids = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(1)), torch.tensor([3, 0, 9, 2])
    else:
        x0, ids = start_states(300)
    if block_steps is not None:  # blocks of 5, 5 and 2 steps; of 1 step each
        monkeypatch.setattr(loop, "ANCESTRAL_BLOCK_ELEMENTS", block_steps * x0.numel())
    monkeypatch.setattr(cpu_draft, "ENABLED", enabled)
    served = spy_on_kernel(cpu_draft, monkeypatch)
    got = loop.ancestral_chain(chain, x0, ids, seed=4)
    assert got.dtype == x0.dtype and torch.equal(got, per_step(chain, x0, ids, seed=4))
    # the affine chains take the kernel's step wherever it is on; the clipped chain is not affine in eps
    assert served == ([True] * K if enabled and case != "clipped" else [])


def test_the_comparison_sees_the_keys() -> None:
    """Negative control: the definition with another seed, or with position and step swapped, gives other states."""
    chain, (x0, ids) = make_chain(), start_states(300)
    got = loop.ancestral_chain(chain, x0, ids, seed=4)
    assert not torch.equal(got, per_step(chain, x0, ids, seed=5))
    assert not torch.equal(got, per_step(chain, x0, ids, seed=4, keys=lambda k: (k, 0)))


def test_target_only_images_are_the_per_step_images(monkeypatch: pytest.MonkeyPatch) -> None:
    """The digits DDPM (float32, 3 samples, K 30, seed 3, an affine chain): target_only's images with the block loop,
    whose 29 stochastic steps the kernel makes (the 30th is the final step), and with the definition."""
    from specray.models.diffusion import load_pair

    pair = load_pair("digits-ddpm", None, "cpu")
    labels, ids, params = torch.tensor([1, 4, 9]), torch.tensor([0, 5, 11]), {"num_steps": 30}
    served = spy_on_kernel(cpu_draft, monkeypatch)
    with torch.inference_mode():
        blocks = loop.run_batch("target_only", params, pair, labels, ids, 3)
        monkeypatch.setattr(loop, "ancestral_chain", per_step)
        steps = loop.run_batch("target_only", params, pair, labels, ids, 3)
    assert served == [True] * 29 and torch.equal(blocks.images, steps.images)
    assert [vars(s) for s in blocks.stats] == [vars(s) for s in steps.stats]
