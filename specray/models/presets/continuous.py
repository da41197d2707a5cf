"""Built-in continuous presets (registered on import)."""

from specray.models.presets import Preset, register  # noqa: F401
