"""Block verification on the host (``block_host``, a CPU round's path) gives the tensor path's bits: the
verdict, and the weights ``log w`` and ``h`` it is decided from."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from specray.methods.diffusion import block_host, rules
from specray.methods.diffusion.rules import block_verify


def both_paths(monkeypatch, log_rho, delta, g, eta) -> tuple[rules.Verdict, rules.Verdict]:
    on_host = block_verify(log_rho, delta, g, eta)
    monkeypatch.setattr(rules, "BLOCK_ON_HOST", False)
    on_tensors = block_verify(log_rho, delta, g, eta)
    monkeypatch.setattr(rules, "BLOCK_ON_HOST", True)
    return on_host, on_tensors


def assert_same_bits(a: rules.Verdict, b: rules.Verdict) -> None:
    assert a.tau.dtype == b.tau.dtype == torch.int64 and torch.equal(a.tau, b.tau)
    for x, y in ((a.log_alpha, b.log_alpha), (a.expected_advance, b.expected_advance)):
        assert x.dtype == y.dtype == torch.float64 and x.shape == y.shape
        assert torch.equal(x.view(torch.int64), y.view(torch.int64))


def same_weights(log_rho, delta, g) -> bool:
    """Whether the host's ``log w`` and ``h`` (which decide tau only through comparisons with the coins) have
    the tensor path's bits, a NaN's sign aside (an infinite delta's h is NaN either way)."""
    on_tensors = rules.block_weights(log_rho, delta, g)
    on_host = block_host.block_weights(log_rho.numpy(), delta.numpy(), g.numpy())[:2]
    return all(bool(((x.view(torch.int64) == y.view(torch.int64)) | (x.isnan() & y.isnan())).all())
               for x, y in zip(map(torch.from_numpy, on_host), on_tensors))


def test_random_rounds_give_the_tensor_paths_bits(monkeypatch) -> None:
    """1,470 random rounds (seed 7): batches 1-100, block lengths 1-7, ragged and full rows; delta log-normal
    over eight decades (the far-tail branches of log Phi taken on either side), identical kernels (delta 1e-12)
    and positive log rho in some rounds."""
    gen = torch.Generator().manual_seed(7)
    far = 0
    for n, G, rep in itertools.product((1, 2, 3, 5, 8, 32, 100), range(1, 8), range(30)):
        delta = torch.exp(3 * torch.randn(n, G, dtype=torch.float64, generator=gen)) * (0.1 if rep % 2 else 1.0)
        log_rho = -delta * torch.randn(n, G, dtype=torch.float64, generator=gen) - 0.5 * delta * delta
        if rep % 5 == 0:
            delta[0, 0] = 1e-12
        if rep % 7 == 0:
            log_rho[:, 0] = 0.3
        g = torch.randint(1, G + 1, (n,), generator=gen)
        if rep % 3 == 0:
            g[:] = G
        eta = torch.rand(n, G, dtype=torch.float64, generator=gen)
        assert_same_bits(*both_paths(monkeypatch, log_rho, delta, g, eta))
        assert same_weights(log_rho, delta, g)
        far += int((delta > 60).sum())
    assert far > 1000  # s - delta = -delta / 2 + log w / delta < -30: the tail expansion's branch


def test_rounds_at_the_tail_branches_edge_give_the_tensor_paths_bits(monkeypatch) -> None:
    """Slot 1's s = c and s - delta within 3 of -30, where log Phi switches to its tail expansion (400 rounds of
    8 rows, seed 11): c = delta / 2 + log w_1 / delta, so log rho_0 = log w_1 = delta (c - delta / 2)."""
    gen = torch.Generator().manual_seed(11)
    near = 0
    for rep in range(400):
        shifted_band = rep % 2 == 1  # s - delta near -30 (delta about 60, log w = 0), else s itself
        delta = (55 + 10 * torch.rand(8, 2, dtype=torch.float64, generator=gen) if shifted_band
                 else 0.5 + 20 * torch.rand(8, 2, dtype=torch.float64, generator=gen))
        c = -33 + 6 * torch.rand(8, dtype=torch.float64, generator=gen)
        log_rho = torch.zeros(8, 2, dtype=torch.float64)
        if not shifted_band:
            log_rho[:, 0] = delta[:, 1] * (c - delta[:, 1] / 2)
        eta = torch.rand(8, 2, dtype=torch.float64, generator=gen)
        assert_same_bits(*both_paths(monkeypatch, log_rho, delta, torch.full((8,), 2), eta))
        assert same_weights(log_rho, delta, torch.full((8,), 2))
        s = delta[:, 1] / 2 + log_rho[:, 0].clamp(max=0) / delta[:, 1]
        point = s - delta[:, 1] if shifted_band else s
        near += int(((point > -31) & (point < -30)).sum())
    assert near > 300


def test_edge_values_give_the_tensor_paths_bits(monkeypatch) -> None:
    """Zero, subnormal, tiny, huge and infinite delta and log rho, -0.0 included (6,561 two-slot rounds at
    block lengths 1 and 2 and coins 0, 0.5 and 1)."""
    deltas = [0.0, 1e-300, 1e-12, 1e-10, 0.5, 40.0, 1e3, 1e300, math.inf]
    log_rhos = [0.0, -0.0, 1e-300, -1e-300, -0.3, 2.0, -50.0, -1e300, -math.inf]
    for d1, d2, r1, r2 in itertools.product(deltas, deltas, log_rhos, log_rhos):
        log_rho = torch.tensor([[r1, r2]], dtype=torch.float64)
        delta = torch.tensor([[d1, d2]], dtype=torch.float64)
        g = torch.tensor([1 + (d1 < d2)])
        eta = torch.full((1, 2), (r1 + r2 > -1) * 0.5 + (d1 > 1) * 0.5, dtype=torch.float64)
        assert_same_bits(*both_paths(monkeypatch, log_rho, delta, g, eta))
        assert same_weights(log_rho, delta, g)


@pytest.mark.parametrize("on_host", [True, False])
def test_the_host_path_serves_cpu_rounds_unless_switched_off(monkeypatch, on_host: bool) -> None:
    calls = []
    real = block_host.block_verify
    monkeypatch.setattr(block_host, "block_verify", lambda *args: calls.append(args) or real(*args))
    monkeypatch.setattr(rules, "BLOCK_ON_HOST", on_host)
    verdict = block_verify(torch.tensor([[-0.2, -0.4]], dtype=torch.float64), torch.tensor([[0.6, 0.9]], dtype=torch.float64),
                           torch.tensor([2]), torch.tensor([[0.5, 0.5]], dtype=torch.float64))
    assert len(calls) == int(on_host) and verdict.tau.shape == (1,)
