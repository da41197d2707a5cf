"""Counter-based per-sample randomness.

Every random number specray draws is a pure function of a key
``(seed, sample_id, stream, position, step, index)``; there is no generator
state. A sample's draws therefore do not depend on which rows share its batch,
which shard it landed in, or how often it was retried, and draft and target can
share exactly the noise a method needs by asking for the same key.

The hash is SplitMix64's finaliser applied to the key fields one at a time. It
runs as int64 tensor arithmetic (multiplication wraps modulo 2**64 on every
torch backend), so draws are made on the device that uses them; on a CPU, once
the process has loaded specray's kernels (:mod:`specray.models.cpu_kernels`, which
a loop's first kernel call loads), the finaliser is one call of theirs with the
same bits.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence

import torch

from specray.models import cpu_kernels

# SplitMix64 constants, written as signed int64.
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
_MUL1 = 0xBF58476D1CE4E5B9 - (1 << 64)
_MUL2 = 0x94D049BB133111EB - (1 << 64)

TensorLike = torch.Tensor | int | Sequence[int]


def stream_id(name: str | int) -> int:
    """Stable integer id of a named stream ("draft", "accept", ...)."""
    if isinstance(name, int):
        return name
    return zlib.crc32(name.encode("utf-8"))


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns."""
    return (x >> k) & ((1 << (64 - k)) - 1)


# _mix's constants as 0-dim CPU tensors, which every device takes as scalars: an op with a tensor
# operand skips wrapping a Python number, which costs as much as the op on a small tensor.
_MIX_SHIFTS = {k: (torch.tensor(k), torch.tensor((1 << (64 - k)) - 1)) for k in (30, 27, 31)}
_GOLDEN_T, _MUL1_T, _MUL2_T = torch.tensor(_GOLDEN), torch.tensor(_MUL1), torch.tensor(_MUL2)


def _xor_shr(z: torch.Tensor, k: int) -> None:
    """``z ^= _shr(z, k)`` in place."""
    shift, mask = _MIX_SHIFTS[k]
    high = z >> shift
    high &= mask
    z ^= high


def _mix(z: torch.Tensor) -> torch.Tensor:
    kernel = _mix_kernel(z)
    mixed = kernel(z) if kernel is not None else None
    return mixed if mixed is not None else _mix_torch(z)


def _mix_torch(z: torch.Tensor) -> torch.Tensor:
    z = z + _GOLDEN_T
    _xor_shr(z, 30)
    z *= _MUL1_T
    _xor_shr(z, 27)
    z *= _MUL2_T
    _xor_shr(z, 31)
    return z


def _mix_kernel(z: torch.Tensor) -> Callable | None:
    """specray's C++ finaliser for a CPU tensor where this process has loaded the kernels already (the hash never
    builds nor loads them: a reducer or a driver that only draws keeps torch's operations), else None."""
    if not z.is_cpu or cpu_kernels.loaded() is None or not cpu_kernels.ENABLED or torch.compiler.is_compiling():
        return None
    return cpu_kernels.checked("splitmix", 0, _kernel_matches)


def _kernel_matches(kernel: Callable, _size: int) -> bool:
    """Whether ``kernel`` gives :func:`_mix_torch`'s bits on 4,096 keys (the extremes of int64, the constants and
    4,088 from seed 0), contiguous, transposed, one and none."""
    generator = torch.Generator().manual_seed(0)
    extremes = torch.tensor([0, 1, -1, (1 << 63) - 1, -(1 << 63), _GOLDEN, _MUL1, _MUL2])
    keys = torch.cat([extremes, torch.randint(-(1 << 63), (1 << 63) - 1, (4088,), generator=generator)])
    cases = (keys, keys.reshape(64, 64).t(), keys[3], keys[:0])
    return all(_same(kernel(x), _mix_torch(x)) for x in cases)


def _same(got: torch.Tensor | None, want: torch.Tensor) -> bool:
    return got is not None and got.shape == want.shape and torch.equal(got, want)


_U64 = (1 << 64) - 1


def _mix_int(z: int) -> int:
    """:func:`_mix` on a Python int (same int64 bit pattern), for the key fields every draw shares."""
    z = (z + _GOLDEN) & _U64
    z = ((z ^ (z >> 30)) * _MUL1) & _U64
    z = ((z ^ (z >> 27)) * _MUL2) & _U64
    z ^= z >> 31
    return z - (1 << 64) if z >> 63 else z


def _as_long(x: TensorLike, device: torch.device | str | None) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=torch.int64)
    return torch.as_tensor(x, dtype=torch.int64, device=device)


def stream_hash(seed: int, sample_ids: TensorLike, stream: str | int | torch.Tensor,
                device: torch.device | str | None = None) -> torch.Tensor:
    """The hash of a key's first fields (seed, sample_id, stream), shaped like ``sample_ids`` (broadcast
    against ``stream`` where that is a tensor of stream ids, :func:`stream_id`'s).

    A loop that draws from one stream many times hashes these once; :func:`extend_hash` adds
    ``position`` and ``step``, :func:`bits_at` (and :func:`uniform_at`, :func:`normal_at`) expands
    the key into draws, exactly as :func:`random_bits` does.
    """
    if device is None and isinstance(sample_ids, torch.Tensor):
        device = sample_ids.device
    h = _mix(_mix_int(int(seed) & 0x7FFFFFFFFFFFFFFF) ^ _as_long(sample_ids, device))
    return _mix(h ^ (stream if isinstance(stream, torch.Tensor) else stream_id(stream)))


def extend_hash(h: torch.Tensor, position: TensorLike = 0, step: TensorLike = 0) -> torch.Tensor:
    """A :func:`stream_hash` with ``position`` then ``step`` mixed in (all broadcast together)."""
    h = _mix(h ^ _key_field(position, h.device))
    return _mix(h ^ _key_field(step, h.device))


def _key_field(x: TensorLike, device: torch.device) -> torch.Tensor | int:
    return x if isinstance(x, int) else _as_long(x, device)  # an int needs no tensor


_INDEX_KEYS: dict[tuple[tuple[int, ...], str], torch.Tensor] = {}


def _index_keys(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """``arange(prod(shape)).reshape(shape) * golden``: what element j of a draw's trailing shape mixes in."""
    key = (shape, str(device))
    if key not in _INDEX_KEYS:
        _INDEX_KEYS[key] = torch.arange(math.prod(shape), dtype=torch.int64, device=device).reshape(shape) * _GOLDEN
    return _INDEX_KEYS[key]


def bits_at(h: torch.Tensor, shape: Sequence[int] = ()) -> torch.Tensor:
    """64 random bits per element of ``h.shape + shape`` from the key hashes ``h`` (:func:`extend_hash`)."""
    trailing = tuple(int(s) for s in shape)
    if not trailing:
        return _mix(h)  # element 0's key mixes in 0
    return _mix(h[(...,) + (None,) * len(trailing)] ^ _index_keys(trailing, h.device))


def random_bits(
    seed: int,
    sample_ids: TensorLike,
    stream: str | int,
    position: TensorLike = 0,
    step: TensorLike = 0,
    shape: Sequence[int] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """64 random bits per element, as int64.

    ``sample_ids``, ``position`` and ``step`` broadcast to a batch shape ``S``;
    the result has shape ``S + shape``. Element ``j`` of the trailing ``shape``
    (row-major) is keyed by index ``j``.
    """
    if device is None and isinstance(sample_ids, torch.Tensor):
        device = sample_ids.device
    # The hash is elementwise, so each field is mixed in at its own shape and the key broadcasts as
    # the fields come in: the bits of hashing the broadcast key, with the early mixes on fewer
    # elements (a loop's [samples, positions, steps] uniforms hash each sample id once, not per element).
    return bits_at(extend_hash(stream_hash(seed, sample_ids, stream, device), position, step), shape)


def _to_uniform(bits: torch.Tensor) -> torch.Tensor:
    return _shr(bits, 11).to(torch.float64) * (1.0 / (1 << 53))


def _box_muller(u: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Standard normals from uniforms ``u[..., 2]``."""
    u1 = 1.0 - u[..., 0]  # in (0, 1]: log is finite
    radius = torch.sqrt(-2.0 * torch.log(u1))
    return (radius * torch.cos(2.0 * math.pi * u[..., 1])).to(dtype)


def uniform_at(h: torch.Tensor, shape: Sequence[int] = ()) -> torch.Tensor:
    """:func:`uniform` from key hashes ``h`` (:func:`extend_hash`)."""
    return _to_uniform(bits_at(h, shape))


def normal_at(h: torch.Tensor, shape: Sequence[int] = (), dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:func:`normal` from key hashes ``h`` (:func:`extend_hash`)."""
    return _box_muller(uniform_at(h, tuple(int(s) for s in shape) + (2,)), dtype)


def uniform(
    seed: int,
    sample_ids: TensorLike,
    stream: str | int,
    position: TensorLike = 0,
    step: TensorLike = 0,
    shape: Sequence[int] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Uniforms in [0, 1) as float64 (53 random bits each)."""
    keyed = None if shape else _keyed_uniforms(seed, sample_ids, stream, position, step, device)
    return _to_uniform(random_bits(seed, sample_ids, stream, position, step, shape, device)) if keyed is None else keyed


def _keyed_uniforms(seed: int, sample_ids: TensorLike, stream: str | int, position: TensorLike, step: TensorLike,
                    device: torch.device | str | None) -> torch.Tensor | None:
    """:func:`uniform`'s one draw per key by one call of specray's kernels (``keyed_uniforms``: the same integer
    arithmetic, so the same values) where this process has loaded them (the hash never builds nor loads them) and
    the key fields are CPU tensors or ints; else None."""
    module = cpu_kernels.loaded()
    fields = (sample_ids, position, step)
    if (module is None or not cpu_kernels.ENABLED or torch.compiler.is_compiling()
            or not isinstance(sample_ids, torch.Tensor) or (device is not None and torch.device(device).type != "cpu")
            or any(isinstance(x, torch.Tensor) and not x.is_cpu for x in fields)):
        return None
    return module.keyed_uniforms(*(_as_long(x, "cpu") for x in fields), _mix_int(int(seed) & 0x7FFFFFFFFFFFFFFF),
                                 stream_id(stream))


def uniform_streams(
    seed: int,
    sample_ids: TensorLike,
    streams: Sequence[str | int],
    position: TensorLike = 0,
    step: TensorLike = 0,
    shape: Sequence[int] = (),
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """:func:`uniform` of each of ``streams`` at the same keys, stacked on a dimension after the keys' batch
    shape ``S``: shape ``S + (len(streams),) + shape``.

    The same values as ``torch.stack([uniform(seed, sample_ids, s, position, step, shape) for s in streams],
    len(S))`` (the hash is elementwise, so the stream enters as one more broadcast field), in one pass of the
    hash's operations instead of one per stream: a loop's uniforms cost those operations' dispatch. Element 0
    of a ``shape`` is keyed as a draw without one (index 0).
    """
    if device is None and isinstance(sample_ids, torch.Tensor):
        device = sample_ids.device
    h = stream_hashes(seed, sample_ids, streams, device)
    return _to_uniform(bits_at(extend_hash(h, _trailing(position, device), _trailing(step, device)), shape))


def stream_hashes(seed: int, sample_ids: TensorLike, streams: Sequence[str | int],
                  device: torch.device | str | None = None) -> torch.Tensor:
    """:func:`stream_hash` of each of ``streams``, stacked last: shape ``sample_ids.shape + (len(streams),)``
    (what :func:`uniform_streams` extends, and a loop that hashes a round's own keys starts from)."""
    if device is None and isinstance(sample_ids, torch.Tensor):
        device = sample_ids.device
    ids = torch.tensor([stream_id(s) for s in streams], dtype=torch.int64, device=device)
    return stream_hash(seed, _as_long(sample_ids, device)[..., None], ids, device)


def _trailing(x: TensorLike, device: torch.device | str | None) -> torch.Tensor | int:
    """A key field given one more trailing dimension (the streams'), an int as it is."""
    return x if isinstance(x, int) else _as_long(x, device)[..., None]


def normal(
    seed: int,
    sample_ids: TensorLike,
    stream: str | int,
    position: TensorLike = 0,
    step: TensorLike = 0,
    shape: Sequence[int] = (),
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Standard normals by Box-Muller on two independent uniforms per element."""
    shape = tuple(int(s) for s in shape)
    return _box_muller(uniform(seed, sample_ids, stream, position, step, shape + (2,), device), dtype)


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw from (unnormalised) ``probs[..., V]`` with uniforms ``u[...]``.

    Zero-probability entries are never returned. Rows must have positive mass.
    """
    return sample_categorical_keepdim(probs, u.unsqueeze(-1)).squeeze(-1)


def sample_categorical_keepdim(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample_categorical` with uniforms ``u[..., 1]`` and draws ``[..., 1]`` (the same values;
    a loop that feeds each draw back as a column saves the reshaping ops)."""
    # cumsum(dtype=float64) converts first, as probs.to(float64).cumsum would; one op fewer.
    return sample_from_cdf(torch.cumsum(probs, dim=-1, dtype=torch.float64), u)


def sample_from_cdf(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`sample_categorical_keepdim` given the float64 running sums ``cdf[..., V]`` of ``probs``
    (a caller that also needs the total mass ``cdf[..., -1]`` computes them once). An all-zero row
    gives ``V - 1``."""
    if u.dtype != torch.float64:
        u = u.to(torch.float64)
    # The cdf and target are fresh, hence contiguous, as searchsorted needs.
    idx = torch.searchsorted(cdf, u * cdf[..., -1:], right=True)
    return idx.clamp_(max=cdf.shape[-1] - 1)


def categorical(
    probs: torch.Tensor,
    seed: int,
    sample_ids: TensorLike,
    stream: str | int,
    position: TensorLike = 0,
    step: TensorLike = 0,
) -> torch.Tensor:
    """Draw one category per row of ``probs[..., V]``, keyed like :func:`uniform`.

    The key fields broadcast to ``probs.shape[:-1]``.
    """
    u = uniform(seed, sample_ids, stream, position, step, device=probs.device)
    u = torch.broadcast_to(u, probs.shape[:-1])
    return sample_categorical(probs, u)
