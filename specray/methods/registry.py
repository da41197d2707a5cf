"""Which methods each model family offers, and where its decoding loop lives.

A family's loop module exports:

- ``METHODS: dict[str, dict]`` -- method name -> default parameters;
- ``resolve_params(method, params) -> dict`` -- defaults merged in, every value
  validated (raise ``ValueError`` naming the parameter and the allowed values);
- ``run_batch(method, params, pair, labels, sample_ids, seed) -> GenerationResult``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILY_LOOPS: dict[str, str] = {
    "discrete_ar": "specray.methods.discrete_loop",
    "continuous_ar": "specray.methods.continuous_loop",
    "diffusion": "specray.methods.diffusion_loop",
}


def family_loop(family: str) -> ModuleType:
    if family not in FAMILY_LOOPS:
        allowed = ", ".join(sorted(FAMILY_LOOPS))
        raise ValueError(f"unknown family {family!r}; allowed: {allowed}")
    return importlib.import_module(FAMILY_LOOPS[family])


def methods_of(family: str) -> list[str]:
    return list(family_loop(family).METHODS)
