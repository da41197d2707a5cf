"""Counter-based randomness: keyed, batch-independent, and statistically sound."""

import math
import subprocess
import sys

import pytest
import torch
from scipy import stats

from specray import rng
from specray.models import cpu_kernels


def test_draws_do_not_depend_on_batch_companions():
    ids = torch.tensor([3, 17, 42, 1000])
    alone = rng.uniform(7, torch.tensor([17]), "draft", position=5, shape=(6,))
    together = rng.uniform(7, ids, "draft", position=5, shape=(6,))
    assert torch.equal(alone[0], together[1])
    shuffled = rng.uniform(7, ids.flip(0), "draft", position=5, shape=(6,))
    assert torch.equal(shuffled.flip(0), together)


def test_every_key_field_changes_the_draw():
    base = rng.uniform(1, [5], "accept", position=2, step=3, shape=(8,))
    for kwargs in (
        dict(seed=2, sample_ids=[5], stream="accept", position=2, step=3),
        dict(seed=1, sample_ids=[6], stream="accept", position=2, step=3),
        dict(seed=1, sample_ids=[5], stream="residual", position=2, step=3),
        dict(seed=1, sample_ids=[5], stream="accept", position=3, step=3),
        dict(seed=1, sample_ids=[5], stream="accept", position=2, step=4),
    ):
        other = rng.uniform(shape=(8,), **kwargs)
        assert not torch.any(other == base)


def test_per_row_positions_broadcast():
    ids = torch.tensor([1, 2, 3])
    pos = torch.tensor([0, 10, 20])
    batched = rng.uniform(0, ids, "x", position=pos)
    for i in range(3):
        assert batched[i] == rng.uniform(0, ids[i : i + 1], "x", position=int(pos[i]))[0]


def _splitmix_reference(seed: int, sample_id: int, stream: str, position: int, step: int, index: int) -> int:
    """The documented key hash on Python ints, one key at a time: SplitMix64's finaliser over
    seed, sample id, stream, position, step and the element index (times the golden gamma)."""
    m64 = (1 << 64) - 1

    def mix(z: int) -> int:
        z = (z + 0x9E3779B97F4A7C15) & m64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m64
        return z ^ (z >> 31)

    h = mix(mix(seed) ^ sample_id)
    for field in (rng.stream_id(stream), position, step, (index * 0x9E3779B97F4A7C15) & m64):
        h = mix(h ^ field)
    return h - (1 << 64) if h >> 63 else h  # as int64


def test_broadcast_keys_draw_the_reference_bits():
    """Sample ids, positions and steps on three different axes (as a loop's chunk of rounds asks
    for them), with a trailing shape: every element is the scalar reference hash of its own key."""
    ids, pos, steps = torch.tensor([3, 90]), torch.tensor([0, 7, 63]), torch.tensor([1, 5])
    bits = rng.random_bits(11, ids[:, None, None], "accept", pos[None, :, None], steps[None, None, :], shape=(2,))
    assert bits.shape == (2, 3, 2, 2)
    for (b, p, s, j), value in zip(torch.cartesian_prod(*(torch.arange(n) for n in bits.shape)).tolist(),
                                   bits.flatten().tolist()):
        assert value == _splitmix_reference(11, int(ids[b]), "accept", int(pos[p]), int(steps[s]), j)


def test_uniforms_of_several_streams_in_one_pass_are_each_streams_own():
    """``uniform_streams`` (a loop's per-round uniforms) stacks the very draws of ``uniform`` per stream,
    checked against the scalar reference hash too; the stream order is the stack's."""
    ids, pos, steps = torch.tensor([3, 90]), torch.tensor([0, 7, 63]), torch.tensor([1, 5, 8, 13])
    streams = ("draft", "accept", "residual")
    u = rng.uniform_streams(11, ids[:, None, None], streams, pos[None, :, None], steps[None, None, :])
    assert u.shape == (2, 3, 4, 3) and u.dtype == torch.float64
    for k, stream in enumerate(streams):
        assert torch.equal(u[..., k], rng.uniform(11, ids[:, None, None], stream, pos[None, :, None], steps[None, None, :]))
    ref = _splitmix_reference(11, 90, "residual", 63, 8, 0)
    assert u[1, 2, 2, 2].item() == ((ref % (1 << 64)) >> 11) / (1 << 53)
    # int fields as they are, a stream given by its id, and the order of the streams kept
    flipped = rng.uniform_streams(11, 90, (rng.stream_id("residual"), "draft"), position=63, step=8)
    assert flipped.tolist() == [u[1, 2, 2, 2].item(), u[1, 2, 2, 0].item()]
    assert len(set(u[0, 0, 0].tolist())) == 3  # the streams are independent draws
    # with a trailing shape (a tree round's per-rank draws): after the streams' dimension, element 0 keyed as a
    # draw without a shape
    wide = rng.uniform_streams(11, ids[:, None, None], streams, pos[None, :, None], steps[None, None, :], shape=(4,))
    assert wide.shape == (2, 3, 4, 3, 4)
    for k, stream in enumerate(streams):
        assert torch.equal(wide[..., k, :], rng.uniform(11, ids[:, None, None], stream, pos[None, :, None],
                                                        steps[None, None, :], shape=(4,)))
    assert torch.equal(wide[..., 0], u)
    ref = _splitmix_reference(11, 3, "accept", 7, 13, 2)
    assert wide[0, 1, 3, 1, 2].item() == ((ref % (1 << 64)) >> 11) / (1 << 53)


def test_uniform_and_normal_distributions():
    # N = 200k draws, seed 0; KS at level 1e-3 (critical value 1.95/sqrt(N)).
    n = 200_000
    u = rng.uniform(0, torch.arange(n), "u").numpy()
    assert u.min() >= 0.0 and u.max() < 1.0
    assert stats.kstest(u, "uniform").statistic < 1.95 / math.sqrt(n)
    z = rng.normal(0, torch.arange(n), "z", dtype=torch.float64).numpy()
    assert stats.kstest(z, "norm").statistic < 1.95 / math.sqrt(n)
    # Elements within one key's trailing shape are independent too.
    pair = rng.normal(0, torch.arange(n), "pair", shape=(2,), dtype=torch.float64).numpy()
    assert abs(float((pair[:, 0] * pair[:, 1]).mean())) < 4 / math.sqrt(n)


def test_categorical_law_and_zero_mass():
    # N = 100k draws from a fixed law with zeroed entries; chi-square p > 1e-3.
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0], dtype=torch.float64)
    n = 100_000
    draws = rng.categorical(probs.expand(n, -1), 3, torch.arange(n), "cat")
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[probs == 0].sum() == 0
    nz = probs > 0
    assert stats.chisquare(counts[nz].numpy(), (probs[nz] * n).numpy()).pvalue > 1e-3


def test_sample_categorical_unnormalised_and_edges():
    probs = torch.tensor([[0.0, 2.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]])
    u = torch.tensor([0.999999999, 0.5], dtype=torch.float64)
    out = rng.sample_categorical(probs, u)
    assert out.tolist() == [1, 3]
    assert rng.sample_categorical(probs, torch.zeros(2, dtype=torch.float64)).tolist() == [1, 0]


def _finaliser_kernel():
    """specray's C++ finaliser where it built and matched torch's operations here (loading the kernels)."""
    if cpu_kernels.extension() is None:
        pytest.skip("the CPU kernels did not build here (see the log)")
    found = rng._mix_kernel(torch.zeros(1, dtype=torch.int64))
    assert found is not None, "the finaliser kernel built but did not give torch's bits (see the log)"
    return found


def test_the_finaliser_kernel_gives_the_torch_operations_bits():
    """Keys from seed 3 (not the check's), contiguous, strided, broadcast views and 0-dim: the kernel's bits are
    ``_mix_torch``'s, and ``_mix`` (which takes it once the kernels are loaded) draws the scalar reference's."""
    kernel = _finaliser_kernel()
    keys = torch.randint(-(1 << 63), (1 << 63) - 1, (6, 50, 7), generator=torch.Generator().manual_seed(3))
    for x in (keys, keys[:, ::3], keys.transpose(0, 2), keys[0, :1].expand(9, 7), keys[2, 4, 5]):
        assert torch.equal(kernel(x), rng._mix_torch(x))
        assert torch.equal(rng._mix(x), rng._mix_torch(x))
    assert rng.random_bits(11, [90], "accept", 7, 5, shape=(2,))[0, 1] == _splitmix_reference(11, 90, "accept", 7, 5, 1)


def test_a_finaliser_that_differs_is_refused():
    """Negative controls for the check: arithmetic instead of logical shifts, and a missing last xor-shift."""

    def arithmetic_shifts(z: torch.Tensor) -> torch.Tensor:
        z = z + rng._GOLDEN
        z = (z ^ (z >> 30)) * rng._MUL1
        z = (z ^ (z >> 27)) * rng._MUL2
        return z ^ (z >> 31)

    def no_last_shift(z: torch.Tensor) -> torch.Tensor:
        z = z + rng._GOLDEN
        z = (z ^ rng._shr(z, 30)) * rng._MUL1
        return (z ^ rng._shr(z, 27)) * rng._MUL2

    assert rng._kernel_matches(rng._mix_torch, 0)
    assert not rng._kernel_matches(arithmetic_shifts, 0) and not rng._kernel_matches(no_last_shift, 0)


def test_one_draw_per_key_by_the_kernel_is_the_torch_operations_uniform():
    """``uniform`` without a shape takes one ``keyed_uniforms`` call once the kernels are loaded: its values are the
    torch operations' (``_to_uniform(random_bits(...))``) for int and tensor key fields broadcast on several axes, the
    int64 extremes among the sample ids, a seed past 2**63 (masked as the hash masks it) and an int stream, and the
    scalar reference hash's for one key. Where the fields do not broadcast, or a field is not on the CPU, the kernel
    refuses and torch's operations answer."""
    _finaliser_kernel()
    module = cpu_kernels.loaded()
    ids = torch.tensor([0, 1, -1, (1 << 63) - 1, -(1 << 63), 12345, 90])
    steps = torch.tensor([0, 5, 1 << 40])
    cases = [(11, ids, "target", 0, 0), (11, ids, "accept", 7, 5), ((1 << 64) + 3, ids[:, None], 77, torch.arange(9), 2),
             (3, ids[None, :, None], "draft", torch.arange(4)[:, None, None], steps), (3, ids.to(torch.int32), "x", 2, 0)]
    for seed, sample_ids, stream, position, step in cases:
        by_torch = rng._to_uniform(rng.random_bits(seed, sample_ids, stream, position, step))
        by_kernel = rng._keyed_uniforms(seed, sample_ids, stream, position, step, None)
        assert by_kernel is not None and by_kernel.dtype == torch.float64 and torch.equal(by_kernel, by_torch)
        assert torch.equal(rng.uniform(seed, sample_ids, stream, position, step), by_torch)
    reference = _splitmix_reference(11, 90, "accept", 7, 5, 0)
    assert rng.uniform(11, ids, "accept", 7, 5)[-1].item() == ((reference >> 11) & ((1 << 53) - 1)) / (1 << 53)
    assert module.keyed_uniforms(ids, torch.arange(3), torch.zeros(1, dtype=torch.int64), 0, 0) is None
    assert module.keyed_uniforms(ids.float(), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                                 0, 0) is None
    assert rng._keyed_uniforms(1, ids, "x", 0, 0, "meta") is None


def test_draws_are_the_same_with_and_without_the_kernels(monkeypatch):
    _finaliser_kernel()
    ids = torch.arange(40)
    with_kernel = (rng.uniform(5, ids, "draft", position=3, step=ids[:, None], shape=(3,)),
                   rng.normal(5, ids, "eps", shape=(4, 4), dtype=torch.float64),
                   rng.uniform(5, ids, "draft", position=ids[:, None], step=2))
    monkeypatch.setattr(cpu_kernels, "ENABLED", False)
    assert rng._mix_kernel(ids) is None and rng._keyed_uniforms(5, ids, "draft", 0, 0, None) is None
    without = (rng.uniform(5, ids, "draft", position=3, step=ids[:, None], shape=(3,)),
               rng.normal(5, ids, "eps", shape=(4, 4), dtype=torch.float64),
               rng.uniform(5, ids, "draft", position=ids[:, None], step=2))
    assert all(torch.equal(a, b) for a, b in zip(with_kernel, without))


def test_drawing_never_builds_nor_loads_the_kernels():
    """A process that only draws (a reducer's bootstrap, a driver) keeps torch's operations: no build, no load."""
    code = ("import torch\nfrom specray import rng\nfrom specray.models import cpu_kernels\n"
            "rng.uniform(1, torch.arange(5), 'x', shape=(3,)); rng.normal(1, [2], 'y', shape=(2,))\n"
            "assert cpu_kernels.loaded() is None and 'module' not in cpu_kernels._built\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
