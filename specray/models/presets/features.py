"""The digits feature extractor used for FID on the built-in presets (registered on import)."""

from specray.models.presets import Preset, register  # noqa: F401
