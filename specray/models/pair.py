"""A target and a draft model of one family, placed on one device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ModelPair:
    """The models one arm group decodes with.

    ``draft`` is None for families/arms that need no separate draft network
    (e.g. diffusion's Frozen and Free drafters reuse the target).
    ``info`` carries what the loop needs beyond the networks (image shape,
    schedules, token embeddings for LANTERN neighbourhoods...).
    """

    family: str
    target_name: str
    draft_name: str | None
    target: torch.nn.Module
    draft: torch.nn.Module | None
    device: torch.device
    info: dict[str, Any]
