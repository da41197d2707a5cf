"""Loading a model pair of any family by preset name (or checkpoint path)."""

from __future__ import annotations

import importlib

import torch

from specray.models.pair import ModelPair

# Each family module exports ``load_pair(target, draft, device) -> ModelPair``.
FAMILY_MODELS: dict[str, str] = {
    "discrete_ar": "specray.models.discrete_ar",
    "continuous_ar": "specray.models.continuous_ar",
    "diffusion": "specray.models.diffusion",
}


def load_pair(family: str, target: str, draft: str | None, device: torch.device | str) -> ModelPair:
    if family not in FAMILY_MODELS:
        allowed = ", ".join(sorted(FAMILY_MODELS))
        raise ValueError(f"unknown family {family!r}; allowed: {allowed}")
    module = importlib.import_module(FAMILY_MODELS[family])
    return module.load_pair(target, draft, torch.device(device))
