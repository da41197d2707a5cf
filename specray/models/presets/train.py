"""`specray train`: reproduce the built-in presets deterministically.

A generator preset is trained by its family's trainer (the family table names it); the digits
feature extractor by the reducer's own trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specray.models.presets import PRESETS, WEIGHTS_DIR, get_preset


def trainer_for(name: str) -> Callable[..., Path]:
    """``train(name, out_dir, seed) -> Path`` of preset ``name`` (KeyError naming the presets)."""
    preset = get_preset(name)
    if preset.role == "feature":
        from specray.eval.digits_features import train_preset

        return train_preset
    from specray.families import family

    return family(preset.family).trainer()


def train(name: str, out_dir: Path = WEIGHTS_DIR, seed: int = 0) -> Path:
    return trainer_for(name)(name, Path(out_dir), seed)


def all_preset_names() -> list[str]:
    """Every preset, those trained from another model (an EAGLE head from its target) after the rest."""
    from specray.models.presets import _load_all

    _load_all()
    return sorted(PRESETS, key=lambda name: ("target" in PRESETS[name].train, name))
