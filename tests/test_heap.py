"""A CPU worker keeps the memory it frees (specray/runtime/heap.py): with glibc's thresholds raised, blocks that are
freed and allocated again are not faulted in again; the switch and the user's own glibc settings are obeyed."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

# Blocks of 40 and 48 MiB, above the largest mmap threshold glibc sets itself (32 MiB), freed and allocated in turn,
# as a speculative loop's activations of changing shapes are: each one a fresh mapping unless freed memory is kept.
SCRIPT = """
import resource, torch
from specray.runtime import heap
kept = heap.keep_freed_memory()
sizes = [40 << 20, 48 << 20]
for size in sizes * 6:
    torch.ones(size // 4)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for size in sizes * 4:
    torch.ones(size // 4)
print(int(kept), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _run(**env: str) -> tuple[bool, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "SPECRAY_KEEP"))}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env={**environment, **env}, capture_output=True, text=True,
                         check=True, timeout=120)
    kept, faults = out.stdout.split()
    return kept == "1", int(faults)


def test_kept_memory_is_not_faulted_in_again():
    """8 blocks of 40-48 MiB after a warm-up of 12: about 90,000 pages faulted in with glibc's default, a few with the
    thresholds raised (tolerance: under 2,000 against over 40,000)."""
    kept, faults = _run()
    assert kept and faults < 2_000
    default, default_faults = _run(SPECRAY_KEEP_FREED_MEMORY="0")
    assert not default and default_faults > 40_000


@pytest.mark.parametrize("env", [{"SPECRAY_KEEP_FREED_MEMORY": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"},
                                 {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=131072"}])
def test_the_switch_and_the_users_own_settings_are_obeyed(env):
    assert not _run(**env)[0]
