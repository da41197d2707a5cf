"""Model families behind small protocols, the built-in presets, checkpoint loading."""
