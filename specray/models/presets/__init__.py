"""The small built-in models, trained by the project on scikit-learn's digits.

Each family registers its presets in its own module here
(``discrete.py``, ``continuous.py``, ``diffusion.py``). Weights live in
``weights/<name>.safetensors`` with the training record in the safetensors
metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

WEIGHTS_DIR = Path(__file__).parent / "weights"
# The null condition of text-conditioned presets: their "labels" are row indices into a batch's
# prompt features, which stay below it (specray.models.conditioning).
TEXT_NULL_INDEX = 1 << 20


@dataclass(frozen=True)
class Preset:
    name: str
    family: str  # "discrete_ar" | "continuous_ar" | "diffusion"
    role: str  # "target" | "draft" | "feature"
    config: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)  # training hyperparameters

    @property
    def weights_path(self) -> Path:
        return WEIGHTS_DIR / f"{self.name}.safetensors"


PRESETS: dict[str, Preset] = {}


def register(preset: Preset) -> Preset:
    if preset.name in PRESETS:
        raise ValueError(f"preset {preset.name!r} registered twice")
    PRESETS[preset.name] = preset
    return preset


def get_preset(name: str) -> Preset:
    _load_all()
    try:
        return PRESETS[name]
    except KeyError:
        allowed = ", ".join(sorted(PRESETS))
        raise KeyError(f"unknown preset {name!r}; built-in presets are: {allowed}") from None


def presets_of_family(family: str) -> list[Preset]:
    _load_all()
    return [p for p in PRESETS.values() if p.family == family]


def _load_all() -> None:
    # Importing a family module registers its presets.
    from specray.models.presets import continuous, diffusion, discrete, features  # noqa: F401
