"""What a decoding loop hands back to the runtime."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specray.methods.stats import SampleStats


@dataclass
class GenerationResult:
    """Images of one batch plus one statistics record per row.

    ``images`` is uint8, ``[B, H, W]`` (grey) or ``[B, H, W, 3]`` (RGB), on CPU.
    ``batch_wall_time_s`` is measured by the caller around the whole batch.
    """

    images: torch.Tensor
    stats: list[SampleStats]
    batch_wall_time_s: float = 0.0
