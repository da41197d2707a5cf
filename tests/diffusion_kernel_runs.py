"""The diffusion loops run with one of a round's CPU kernels on and off (its module's ``ENABLED``), for the kernels'
tests: the same states, statistics and images either way, and what the kernel gave; and the kernels' fixtures."""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import pytest
import torch

from specray.methods.diffusion import cpu_commit, loop
from specray.models import cpu_kernels
from tests.test_diffusion_chain import make_chain, start_states


def checked_kernel(find: Callable[[torch.Tensor], Callable | None], what: str) -> Callable:
    """The kernel ``find`` gives for CPU states, which gave its Python path's values in this process (the module's
    check); the test is skipped where the extension did not build."""
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    found = find(torch.zeros(1))
    assert found is not None, f"the {what} built but did not give its Python path's values (see the log)"
    return found


def spy_on_kernel(module: ModuleType, monkeypatch: pytest.MonkeyPatch, name: str = "_kernel") -> list:
    """What each call of ``module``'s kernel (the one its function ``name`` finds) gave, in a list that grows as the
    kernel serves."""
    served, original = [], getattr(module, name)

    def spied(like: torch.Tensor):
        found = original(like)
        return None if found is None else lambda *args: served.append(found(*args)) or served[-1]

    monkeypatch.setattr(module, name, spied)
    return served


def assert_same_with_and_without(module: ModuleType, monkeypatch: pytest.MonkeyPatch, drafter: str,
                                 verification: str, rejection: str) -> list[tuple]:
    """The linear-Gaussian chain (float64 states, 300 rows, seed 2) and the digits DDPM with its draft model
    (float32, 3 samples, K 30) with ``module``'s kernel (``module._kernel``) and with torch's operations: the same
    states, statistics and images. Returns what the kernel gave in its run, one entry per call. The commit kernel
    (:mod:`cpu_commit`), which makes the ratios' call itself, is off unless it is ``module``."""
    from specray.models.diffusion import load_pair

    pair = load_pair("digits-ddpm", "digits-ddpm-draft", "cpu")
    x0, ids = start_states(300)
    params = {"num_steps": 30, "drafter": drafter, "gamma": 5, "rejection": rejection}
    runs, served = [], spy_on_kernel(module, monkeypatch)
    if module is not cpu_commit:
        monkeypatch.setattr(cpu_commit, "ENABLED", False)
    for enabled in (True, False):
        monkeypatch.setattr(module, "ENABLED", enabled)
        x, stats = loop.speculative_chain(make_chain(), x0, ids, seed=2, drafter=drafter, verification=verification,
                                          rejection=rejection, gamma=5)
        with torch.inference_mode():
            result = loop.run_batch(f"spec_{verification}", params, pair, torch.tensor([1, 4, 9]),
                                    torch.tensor([0, 5, 11]), 3)
        runs.append((x, stats.rounds, stats.accepted, result.images, [vars(s) for s in result.stats]))
    (x, rounds, accepted, images, sample_stats), (x_t, rounds_t, accepted_t, images_t, sample_stats_t) = runs
    assert torch.equal(x, x_t) and torch.equal(rounds, rounds_t) and torch.equal(accepted, accepted_t)
    assert torch.equal(images, images_t) and sample_stats == sample_stats_t
    return served
