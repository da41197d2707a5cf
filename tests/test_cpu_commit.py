"""A speculative diffusion round's work after its verify call in one CPU call (specray/methods/diffusion/cpu_commit.py):
the kernel gives the tensor path's new states, eps, steps, tau and expected advance wherever it serves a round, the
tensor path runs everywhere else (ragged, large and clipped rounds among them), a kernel that differs anywhere is
refused by the check, and the loops' samples are the same with and without it."""

from __future__ import annotations

import math

import pytest
import torch

from specray.methods.diffusion import cpu_commit, loop
from specray.methods.diffusion.residual import DELTA_MIN, KERNEL_CONSTANTS
from specray.models import cpu_kernels
from tests.diffusion_kernel_runs import assert_same_with_and_without, checked_kernel


@pytest.fixture(scope="module")
def kernel():
    return checked_kernel(cpu_commit._kernel, "commit kernel")


def _call(kernel, rnd, args, how, **change):
    coef, eps_draft, E, xi, eta, Y, draws = args
    inputs = dict(coef=coef, eps_draft=eps_draft, E=E, xi=xi, eta=eta, Y=Y, kk=rnd.kk, g=rnd.g, block=how["block"],
                  u=None if draws is None else draws.u, zeta=None if draws is None else draws.zeta,
                  alpha_one=how["alpha_one"], with_stale=how["with_stale"]) | change
    return kernel(*inputs.values(), KERNEL_CONSTANTS, DELTA_MIN)


def _want(rnd, args, how, chain) -> tuple:
    coef, eps_draft, E, xi, eta, Y, draws = args
    done = loop._commit_tensors(chain, rnd, coef, Y, E, eps_draft, xi, eta, draws, how["with_stale"],
                                "block" if how["block"] else "token", "one" if how["alpha_one"] else "w_tau")
    return done.x, done.stale, done.k, done.tau, done.expected_advance


def _same(got, want) -> bool:
    return len(got) == len(want) and all((a is None and b is None) or (
        a is not None and b is not None and a.shape == b.shape and a.dtype == b.dtype and cpu_kernels.same_values(a, b))
        for a, b in zip(got, want))


def test_kernel_gives_the_tensor_paths_values(kernel) -> None:
    """Other rounds than the check's (seed 11; the grid of ``random_commits``, 80 rounds): every output is the tensor
    path's bit for bit, and the rounds hold cut rows and kept rows in every rule, with one slot and with seven."""
    seen = set()
    for chain, rnd, args, how in cpu_commit.random_commits(torch.Generator().manual_seed(11)):
        got = _call(kernel, rnd, args, how)
        assert _same(got, _want(rnd, args, how, chain)), how
        tau = got[3]
        seen |= {(how["block"], args[6] is not None, how["alpha_one"], rnd.G, bool(c)) for c in (tau < rnd.G)}
    rules = {(block, residual, one) for block, residual, one in cpu_commit.MODES}
    assert seen == {rule + (G, cut) for rule in rules for G in (1, 7) for cut in (True, False)}


def test_new_states_are_each_rows_rule(kernel) -> None:
    """What the kernel writes, row by row, in the rounds of 16 rows (seed 3; 40 rounds, the Free drafter's eps asked
    for in each): a kept row's state is its last drafted state, a cut row's differs from its drafted state at slot
    tau + 1 (a new draw); the Free drafter's eps is the target eps at slot tau (cut) or g - 1 (kept); the next step
    is kk + tau + 1 (cut) or kk + g (kept). Both kinds of row occur."""
    kinds = set()
    for _, rnd, args, how in cpu_commit.random_commits(torch.Generator().manual_seed(3)):
        if rnd.kk.numel() != 16:
            continue
        x, stale, k, tau, _ = _call(kernel, rnd, args, how, with_stale=True)
        E, Y, G = args[2], args[5], rnd.G
        for i in range(16):
            t = int(tau[i])
            kinds.add(t < G)
            if t < G:
                assert not torch.equal(x[i], Y[i, t + 1]) and torch.equal(stale[i], E[i, t])
                assert k[i] == rnd.kk[i] + t + 1
            else:
                assert torch.equal(x[i], Y[i, G]) and torch.equal(stale[i], E[i, G - 1]) and k[i] == rnd.kk[i] + G
    assert kinds == {True, False}


def test_calls_the_kernel_does_not_serve_are_refused(kernel) -> None:
    """A ragged round (a row's g below G), half-precision states, draws' uniforms without their normals, a strided
    noise and states of another row count: the kernel gives an empty list and writes nothing."""
    chain, rnd, args, how = next(r for r in cpu_commit.random_commits(torch.Generator().manual_seed(5))
                                 if r[1].kk.numel() == 3 and r[1].G == 7 and r[2][6] is not None)
    coef, eps_draft, E, xi, eta, Y, draws = args
    refused = {
        "ragged": dict(g=torch.tensor([7, 3, 7])),
        "half states": dict(E=E.half(), Y=Y.half()),
        "uniforms without normals": dict(zeta=None),
        "strided noise": dict(xi=torch.cat([xi, xi], dim=-1)[..., ::2]),
        "states of another row count": dict(Y=Y[:2]),
    }
    for name, change in refused.items():
        assert _call(kernel, rnd, args, how, **change) == [], name


def test_rounds_it_does_not_serve_go_to_the_tensor_path(kernel, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the loop (the linear-Gaussian chain, 40 rows of 2, seed 2, K 20, gamma 5): the kernel serves every full
    round and no ragged one; past ``KERNEL_MAX_ELEMENTS`` of the ratios, and on an x0-clipped chain, it serves none;
    the states are the same every way."""
    from tests.test_diffusion_chain import make_chain, start_states

    x0, ids = start_states(40)
    served = []
    real = cpu_commit._kernel
    monkeypatch.setattr(cpu_commit, "_kernel", lambda E: served.append(1) or real(E))

    def run(chain=None):
        served.clear()
        x, stats = loop.speculative_chain(chain or make_chain(), x0, ids, 2, drafter="frozen", verification="block",
                                          rejection="residual", gamma=5)
        return x, int(stats.rounds.max())

    x, rounds = run()
    full = len(served)
    assert 0 < full < rounds  # the last rounds are ragged
    monkeypatch.setattr(cpu_commit, "ENABLED", False)
    x_off, _ = run()
    assert torch.equal(x, x_off)
    monkeypatch.setattr(cpu_commit, "ENABLED", True)
    monkeypatch.setattr(cpu_commit.cpu_ratios, "KERNEL_MAX_ELEMENTS", 1)
    x_large, _ = run()
    assert served == [] and torch.equal(x, x_large)
    monkeypatch.undo()
    monkeypatch.setattr(cpu_commit, "_kernel", lambda E: served.append(1) or real(E))
    clipped = make_chain()
    ones = torch.ones_like(clipped.A)
    clipped.clipped_mean = (clipped.B, clipped.A, ones, ones)
    run(clipped)
    assert served == []


def test_kernels_that_differ_are_refused(kernel) -> None:
    """Negative controls for the check: a new state one ulp off, tau one less in a row, the Free drafter's eps from
    the slot after, the next step one more, the expected advance one ulp off: each refused."""

    def changed(index: int, how):
        def wrong(*args):
            out = list(kernel(*args))
            if out[index] is not None:
                out[index] = how(out[index].clone())
            return out
        return wrong

    def ulp(t):
        flat = t.view(-1)
        flat[0] = math.nextafter(flat[0].item(), math.inf)
        return t

    def one_less(t):
        t[t > 0] -= 1
        return t

    wrong = {"state": changed(0, ulp), "tau": changed(3, one_less), "stale": changed(1, lambda t: t.roll(1, 0) + 1),
             "step": changed(2, lambda t: t + 1), "advance": changed(4, ulp)}
    assert cpu_commit._kernel_matches(kernel, 0)
    for name, kernel_off in wrong.items():
        assert not cpu_commit._kernel_matches(kernel_off, 0), name


@pytest.mark.parametrize("drafter, verification, rejection", [("frozen", "block", "residual"),
                                                              ("free", "token", "reflection"),
                                                              ("model", "block", "residual")])
def test_chains_are_the_same_with_and_without_the_kernel(kernel, monkeypatch: pytest.MonkeyPatch, drafter: str,
                                                         verification: str, rejection: str) -> None:
    """The linear-Gaussian chain and the digits DDPM (``assert_same_with_and_without``): the same states, statistics
    and images with the kernel and with the tensor path, the kernel serving the full rounds."""
    served = assert_same_with_and_without(cpu_commit, monkeypatch, drafter, verification, rejection)
    assert len(served) > 5 and all(served)
