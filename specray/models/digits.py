"""scikit-learn's digits as the training data of the built-in presets.

1797 images of 8x8 pixels with 17 grey levels (0..16) and 10 classes. The
train/held-out split is fixed: a seeded permutation, the first 90% train.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

import numpy as np
import torch

IMAGE_SIZE = 8
NUM_LEVELS = 17  # grey levels 0..16
NUM_CLASSES = 10
TRAIN_FRACTION = 0.9

Split = Literal["train", "heldout"]


def load_digits_split(split: Split, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images ``uint8 [N, 8, 8]`` with values 0..16 and labels ``int64 [N]``.

    The split depends only on ``seed`` (a NumPy permutation of all 1797 images).
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    images, labels = _all_digits()
    order = np.random.RandomState(seed).permutation(len(labels))
    n_train = int(round(TRAIN_FRACTION * len(labels)))
    chosen = order[:n_train] if split == "train" else order[n_train:]
    return torch.from_numpy(images[chosen].copy()), torch.from_numpy(labels[chosen].copy())


@lru_cache(maxsize=1)
def _all_digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    data = load_digits()
    images = np.asarray(data.images, dtype=np.uint8)  # levels are integral floats 0..16
    labels = np.asarray(data.target, dtype=np.int64)
    images.setflags(write=False)
    labels.setflags(write=False)
    return images, labels


def to_uint8_pixels(levels: torch.Tensor) -> torch.Tensor:
    """Grey levels 0..16 -> pixel values 0..255 (``round(level * 255 / 16)``), uint8."""
    levels = levels.to(torch.int64).clamp(0, NUM_LEVELS - 1)
    return torch.div(levels * 255 + 8, 16, rounding_mode="floor").to(torch.uint8)
