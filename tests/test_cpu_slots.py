"""A diffusion round's slots in one call on a CPU (specray/methods/diffusion/cpu_slots.py): the kernel gives the
loop's numpy values where every row drafts gamma steps and refuses every other round, a kernel that gives another
step or coefficient, or serves a ragged round, is refused by the check, and the loops' samples are the same with and
without it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specray.methods.diffusion import cpu_slots, loop
from tests.diffusion_kernel_runs import assert_same_with_and_without, checked_kernel


@pytest.fixture(scope="module")
def kernel():
    return checked_kernel(cpu_slots._kernel, "slots kernel")


@pytest.mark.parametrize("n, gamma, K", [(1, 7, 100), (5, 1, 9), (32, 4, 1000)])
def test_kernel_gives_the_loops_values(kernel, n: int, gamma: int, K: int) -> None:
    """Another grid than the check's (seed 3): rows at random steps, one at the last step it can draft gamma from,
    one at step 0; the tables' values include a NaN and an infinity, copied as they are."""
    generator = torch.Generator().manual_seed(3)
    tables = torch.randn(3, K, dtype=torch.float64, generator=generator)
    tables[0, 1], tables[2, -1] = float("nan"), float("inf")
    k = torch.randint(0, K - gamma + 1, (n,), generator=generator)
    k[0], k[-1] = 0, K - gamma
    steps, coef = cpu_slots.full_round_slots(k, gamma, tables)
    _, want_steps, _, want_coef = loop._slots_from_host(k.numpy(), np.full(n, gamma), gamma, tables)
    assert steps.dtype == want_steps.dtype and torch.equal(steps, want_steps)
    assert coef.dtype == want_coef.dtype and coef.is_contiguous()
    assert torch.equal(coef.isnan(), want_coef.isnan()) and torch.equal(coef.nan_to_num(), want_coef.nan_to_num())


def test_rounds_it_does_not_serve_are_refused(kernel) -> None:
    """A row with fewer than gamma steps left, a done row, a negative step, float32 tables, int32 steps, strided
    steps, tables of two rows, gamma 0: None (the loop's numpy path serves those rounds)."""
    tables = torch.rand(3, 12, dtype=torch.float64)
    k = torch.tensor([0, 3, 7])
    assert cpu_slots.full_round_slots(k, 5, tables) is not None
    cases = {
        "ragged row": (torch.tensor([0, 3, 8]), 5, tables),
        "done row": (torch.tensor([12, 3, 7]), 5, tables),
        "negative step": (torch.tensor([0, -1, 7]), 5, tables),
        "float32 tables": (k, 5, tables.float()),
        "int32 steps": (k.int(), 5, tables),
        "strided steps": (torch.tensor([0, 9, 3, 9, 7])[::2], 5, tables),
        "two tables": (k, 5, tables[:2]),
        "gamma 0": (k, 0, tables),
    }
    for name, args in cases.items():
        assert cpu_slots.full_round_slots(*args) is None, name


def test_kernels_that_differ_are_refused(kernel) -> None:
    """Negative controls for the check: a step one more, the coefficients of the next step, and a kernel that serves
    a row with fewer than gamma steps left (clamping its steps as the ragged path does): each refused."""

    def step_off(k, gamma, tables):
        steps, coef = kernel(k, gamma, tables)
        return (None, None) if steps is None else (steps + 1, coef)

    def next_coef(k, gamma, tables):
        steps, _ = kernel(k, gamma, tables)
        return (None, None) if steps is None else (steps, tables[:, (steps + 1).clamp(max=tables.shape[1] - 1)])

    def serves_ragged(k, gamma, tables):
        steps = (k[:, None] + torch.arange(gamma)).clamp(max=tables.shape[1] - 1)
        return steps, tables[:, steps].contiguous()

    assert cpu_slots._kernel_matches(kernel, 0)
    for wrong in (step_off, next_coef, serves_ragged):
        assert not cpu_slots._kernel_matches(wrong, 0), wrong.__name__


@pytest.mark.parametrize("drafter, verification", [("free", "block"), ("frozen", "token"), ("model", "block")])
def test_same_samples_with_and_without(monkeypatch: pytest.MonkeyPatch, drafter: str, verification: str) -> None:
    """The linear-Gaussian chain and the digits DDPM (``assert_same_with_and_without``, ψ_α's residual): the same
    states, statistics and images; the kernel served the full rounds and refused the ragged ones at the end."""
    served = assert_same_with_and_without(cpu_slots, monkeypatch, drafter, verification, "residual")
    assert any(steps is not None for steps, _ in served) and any(steps is None for steps, _ in served)
