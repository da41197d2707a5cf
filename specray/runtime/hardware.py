"""What a timing ran on, in words: job manifests and benchmark reports record it beside their times.

A time means little without its machine: the CPU's vector extensions decide which kernels MKL and
torch run, and the same code has run two to three times slower on one 2-core machine than on another
(README, "Benchmarks").
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import torch

CPUINFO = Path("/proc/cpuinfo")


def device_name(device: torch.device | str) -> str:
    """The GPU's name for a CUDA device; for the CPU, its model, family and model numbers (which tell
    CPU generations apart where a virtual machine shortens the name), the vector extensions torch's
    kernels use, and the logical CPUs, e.g. ``"AMD EPYC (family 25, model 1); AVX2; 2 CPUs"``."""
    device = torch.device(device)
    if device.type == "cuda":
        # is_available does not initialise CUDA, so a worker given a GPU that is not there (Ray's
        # fake GPUs in the tests) still fails only where it first uses the device; a name is a
        # record, so a device that fails to answer fails there too, not here
        if not torch.cuda.is_available():
            return "cuda (unavailable)"
        try:
            return torch.cuda.get_device_name(device)
        except (RuntimeError, AssertionError) as exc:
            return f"cuda (no name: {exc})"
    if device.type != "cpu":
        return device.type
    return f"{cpu_model()}; {torch.backends.cpu.get_cpu_capability()}; {os.cpu_count()} CPUs"


@functools.lru_cache(maxsize=1)
def cpu_model() -> str:
    """The first processor's ``model name`` from ``/proc/cpuinfo``, with its family and model numbers
    where given; ``"unknown CPU"`` in place of a name the file lacks, or for the whole when there is no
    such file (not Linux)."""
    try:
        text = CPUINFO.read_text()
    except OSError:
        return "unknown CPU"
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            break  # the first processor's block ends at its blank line
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or "unknown CPU"
    if "cpu family" in fields and "model" in fields:
        return f"{name} (family {fields['cpu family']}, model {fields['model']})"
    return name
