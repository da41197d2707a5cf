"""Writing the built-in presets' weights: fp16 safetensors with the training record as metadata."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def save_fp16(module: torch.nn.Module, path: Path, metadata: dict[str, str]) -> Path:
    """Write ``module``'s state dict as fp16 (the presets stay a few MB); loaders cast back to fp32."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(torch.float16).contiguous() for k, v in module.state_dict().items()}
    save_file(state, str(path), metadata=metadata)
    return path
