"""A CPU worker keeps the memory it frees (glibc's ``mallopt``): freed blocks stay in the heap for the next call
instead of going back to the kernel.

glibc hands freed memory back to the kernel at the top of its heap (trimming) and gives blocks above its mmap
threshold their own mappings, which ``free`` unmaps. A speculative round's model calls change shape from call to
call (a draft on the rows still drafting, a verify of gamma + 1 states a row, the resampled rows), so a freed
activation rarely fits the next call and is unmapped or trimmed, to be faulted in again, page by page, a call later:
the diffusion family's speculative arms at batch 32 faulted in 27,000-293,000 pages a batch, 1-12 % of their time,
while target_only, whose calls repeat one shape, faulted in none. With both thresholds at :data:`KEEP_BYTES` they
fault in 900-5,000 and the peak memory is the same (the process's high-water mark); the memory is not returned to the
system while the worker lives, so only CPU workers do this (a GPU worker's host memory holds little after loading).

``SPECRAY_KEEP_FREED_MEMORY=0`` turns it off; glibc settings of the user's own (``MALLOC_TRIM_THRESHOLD_``,
``MALLOC_MMAP_THRESHOLD_``, ``GLIBC_TUNABLES`` with ``glibc.malloc``) are left as they are. Other C libraries: nothing.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (glibc's malloc.h)
KEEP_BYTES = 1 << 30  # blocks above 1 GiB still get their own mapping, returned when freed
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")

_kept: bool | None = None  # this process's outcome, once asked


def keep_freed_memory() -> bool:
    """Raise glibc's trim and mmap thresholds to :data:`KEEP_BYTES` in this process (once); whether they are raised."""
    global _kept
    if _kept is None:
        _kept = _set_thresholds()
        if _kept:
            log.info("heap: freed memory kept for reuse (glibc trim and mmap thresholds %d MiB)", KEEP_BYTES >> 20)
    return _kept


def _set_thresholds() -> bool:
    if os.environ.get("SPECRAY_KEEP_FREED_MEMORY", "1") == "0":
        return False
    if any(name in os.environ for name in USER_SETTINGS) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False  # the user's own choice
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # mallopt returns 1 on success; the mmap threshold first: setting either one stops glibc's own adjustment of both.
    return libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES) == 1 and libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES) == 1
