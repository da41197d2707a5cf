"""`specray train`: reproduce the built-in presets deterministically.

Each family's trainer lives beside its model; this module only dispatches.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path

from specray.models.presets import WEIGHTS_DIR, PRESETS, get_preset

# family -> "module:function" with signature (name, out_dir, seed) -> Path of the written weights
TRAINERS: dict[str, str] = {
    "discrete_ar": "specray.models.discrete_train:train_preset",
    "continuous_ar": "specray.models.continuous_train:train_preset",
    "diffusion": "specray.models.diffusion_train:train_preset",
    "feature": "specray.eval.digits_features:train_preset",
}


def trainer_for(name: str) -> Callable[..., Path]:
    preset = get_preset(name)
    key = preset.family if preset.role != "feature" else "feature"
    module_name, func = TRAINERS[key].split(":")
    return getattr(importlib.import_module(module_name), func)


def train(name: str, out_dir: Path = WEIGHTS_DIR, seed: int = 0) -> Path:
    return trainer_for(name)(name, Path(out_dir), seed)


def all_preset_names() -> list[str]:
    from specray.models.presets import _load_all

    _load_all()
    return sorted(PRESETS)
