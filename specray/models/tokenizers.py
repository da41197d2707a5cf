"""What turns generated tokens into pixels."""

from __future__ import annotations

import torch

from specray.models.digits import to_uint8_pixels


def identity_digits_to_images(tokens: torch.Tensor, grid_size: int = 8) -> torch.Tensor:
    """Identity tokenizer of the digits presets: tokens ``[B, grid^2]`` (grey levels 0..16) -> uint8 ``[B, grid, grid]`` on CPU."""
    if tokens.shape[-1] != grid_size * grid_size:
        raise ValueError(f"tokens have {tokens.shape[-1]} positions, expected grid_size^2={grid_size * grid_size}")
    return to_uint8_pixels(tokens.detach().cpu().reshape(-1, grid_size, grid_size))


def to_images(tokens: torch.Tensor, grid_size: int = 8) -> torch.Tensor:
    """Default decoder of the discrete family (identity over grey levels)."""
    return identity_digits_to_images(tokens, grid_size)
