"""Zeroed CPU buffers handed from one decoding run to the next, instead of allocated afresh.

A discrete-AR run allocates its K/V caches anew: at fid50k's batch of 128 (256 rows with classifier-free
guidance) the target's are 24 tensors of 5.2 MB. Freed when the run ends, that memory goes back to
the operating system, and the next run's zero-fill faults every page in again: 3-5 % of a batch of
128 on a 2-core CPU. Inside :func:`reusing`, :func:`zeros` returns a buffer of the same shape from the
previous run instead, zeroed again: the same values, layout and strides as a fresh one. :func:`empty` hands it
out as the earlier run left it, for a caller that writes every element (a growing K/V cache).

A buffer is handed out again only while nothing but the pool holds its memory (a view kept past its
run keeps its buffer out of the pool). The pool drops a buffer that :data:`KEEP_IDLE_RUNS` runs in a
row did not take, so between runs it holds at most the buffers of the last ``KEEP_IDLE_RUNS + 1``
runs: enough for a job's arms taking turns batch by batch (fid50k: target_only's caches wait
through sd's and cool_sd's batches), never more. One pool per thread. A run takes the buffers of a shape
in the order the previous run took them, so a run that asks for them in the same order gets the same
addresses in the same places.

Off the CPU only *static* buffers are pooled: those whose addresses a CUDA graph records (a compiled
decode step's KV caches, ``torch._dynamo.mark_static_address``). The caching allocator reuses other GPU
memory by itself, but not at the same addresses, and a recorded graph whose static inputs moved is recorded
again: once per batch, and past torch's limit on such recordings (128 a graph) never again, the step then
running without its graph.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_Key = tuple[tuple[int, ...], torch.dtype, torch.device]
# Runs in a row that may leave a buffer untaken before it is dropped.
KEEP_IDLE_RUNS = 4


class _Pool(threading.local):
    def __init__(self) -> None:
        self.active = False
        self.free: dict[_Key, list[tuple[torch.Tensor, int]]] = {}  # (buffer, runs in a row it was not taken)
        self.taken: list[torch.Tensor] = []  # this run's


_pool = _Pool()


@contextmanager
def reusing() -> Iterator[None]:
    """One decoding run: :func:`zeros` reuses the earlier runs' buffers; this run's are kept for the next ones.

    Nested blocks belong to the outermost one.
    """
    if _pool.active:
        yield
        return
    _pool.active, _pool.taken = True, []
    try:
        yield
    finally:
        taken, _pool.taken, _pool.active = _pool.taken, [], False
        free: dict[_Key, list[tuple[torch.Tensor, int]]] = {}
        for buffer in taken:  # first, in the order this run took them (zeros hands them out from the front)
            free.setdefault(_key(buffer), []).append((buffer, 0))
        for key, buffers in _pool.free.items():  # not taken by this run
            free.setdefault(key, []).extend((buffer, idle + 1) for buffer, idle in buffers if idle < KEEP_IDLE_RUNS)
        _pool.free = {key: buffers for key, buffers in free.items() if buffers}


def zeros(*shape: int, dtype: torch.dtype, device: torch.device, static: bool = False) -> torch.Tensor:
    """``torch.zeros(*shape)``, contiguous; inside :func:`reusing` on a CPU, or on any device where ``static`` (a
    CUDA graph records its address), a free buffer of an earlier run if any: the first of its shape not yet taken."""
    return _buffer(shape, dtype, device, static, zeroed=True)


def empty(*shape: int, dtype: torch.dtype, device: torch.device, static: bool = False) -> torch.Tensor:
    """:func:`zeros` without the zeroing: ``torch.empty(*shape)``, or a free buffer holding an earlier run's values,
    for a caller that writes every element itself (a grown cache copies its held slots and zeroes only the new ones:
    at fid50k's batch of 128 zeroing the whole buffer first zeroed 2-3x the bytes the new slots need)."""
    return _buffer(shape, dtype, device, static, zeroed=False)


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, static: bool,
            zeroed: bool) -> torch.Tensor:
    device = torch.device(device)
    fresh = torch.zeros if zeroed else torch.empty
    if not _pool.active or (device.type != "cpu" and not static):
        return fresh(*shape, dtype=dtype, device=device)
    candidates = _pool.free.get((tuple(shape), dtype, device), [])
    while candidates:
        buffer, _ = candidates.pop(0)
        if _unshared(buffer):
            if zeroed:
                buffer.zero_()
            break
    else:
        buffer = fresh(*shape, dtype=dtype, device=device)
    _pool.taken.append(buffer)
    return buffer


def _key(buffer: torch.Tensor) -> _Key:
    return tuple(buffer.shape), buffer.dtype, buffer.device


# The buffer's own tensor and the temporary storage object of the query hold its memory; a view
# adds one. Without torch's counter (a private function, present in the pinned torch), never reuse.
_SOLE_OWNER_COUNT = 2


def _unshared(buffer: torch.Tensor) -> bool:
    """Whether nothing but ``buffer`` itself holds its memory (no view of it survived its run)."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return False
    return use_count(buffer.untyped_storage()._cdata) == _SOLE_OWNER_COUNT
