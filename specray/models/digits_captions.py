"""Captions for scikit-learn's digits, made from what is measured on each image.

A caption names the digit and three attributes measured on the image (uint8 pixels, as the
models generate them and as ``to_uint8_pixels`` turns the dataset's grey levels into), each cut
into three levels at the dataset's tertiles:

- ``size``: the share of pixels with ink (intensity > 0.2): small / medium / large;
- ``weight``: the mean intensity of those pixels (how heavy the strokes are): light / regular / bold;
- ``slant``: the shear of the ink (horizontal shift per row going up, from the ink's second
  moments): leaning left / upright / leaning right.

Phrasing varies (several templates and synonyms, chosen by a seeded hash of the image index and
the caption number), so text models learn the attributes rather than one sentence.
:func:`parse_caption` reads the digit and the attribute levels back from any caption written with
this vocabulary; the alignment score of the built-in text models compares them with what the
generated image measures.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

ATTRIBUTES = ("size", "weight", "slant")
LEVELS = {"size": ("small", "medium", "large"), "weight": ("light", "regular", "bold"),
          "slant": ("left", "upright", "right")}
INK_THRESHOLD = 0.2  # between grey levels 3/16 and 4/16, so it never sits on a pixel value of the dataset
DIGIT_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")

# Words each level is written with (the first is the canonical one); every phrase is unique.
SYNONYMS = {
    "size": {"small": ("small", "tiny", "compact"), "medium": ("medium-sized", "mid-sized", "average-sized"),
             "large": ("large", "big", "wide")},
    "weight": {"light": ("thin", "light", "faint"), "regular": ("regular", "normal", "medium-weight"),
               "bold": ("bold", "thick", "heavy")},
    "slant": {"left": ("leaning left", "slanted left", "tilted to the left"),
              "upright": ("upright", "straight", "standing straight"),
              "right": ("leaning right", "slanted right", "tilted to the right")},
}
TEMPLATES = (
    "a {size} {weight} handwritten {word}, {slant}",
    "the digit {digit}, {size}, drawn with {weight} strokes, {slant}",
    "handwritten number {word}: {weight}, {slant}, {size}",
    "a {weight} {digit}, {slant} and {size}",
    "{size} {word} written in {weight} ink, {slant}",
    "an image of the number {digit}, {slant}, with {weight} strokes, {size}",
)


@dataclass(frozen=True)
class DigitAttributes:
    digit: int | None
    size: str | None
    weight: str | None
    slant: str | None

    def levels(self) -> dict[str, str | None]:
        return {"size": self.size, "weight": self.weight, "slant": self.slant}


def measure(image: np.ndarray) -> dict[str, float]:
    """Raw attribute values of one uint8 image ``[H, W]``."""
    x = np.asarray(image, dtype=np.float64) / 255.0
    ink = x > INK_THRESHOLD
    size = float(ink.mean())
    weight = float(x[ink].mean()) if ink.any() else 0.0
    total = x.sum()
    if total <= 0:
        return {"size": size, "weight": weight, "slant": 0.0}
    rows, cols = np.mgrid[0 : x.shape[0], 0 : x.shape[1]]
    mean_r, mean_c = (x * rows).sum() / total, (x * cols).sum() / total
    var_r = (x * (rows - mean_r) ** 2).sum() / total
    cov = (x * (rows - mean_r) * (cols - mean_c)).sum() / total
    slant = float(-cov / var_r) if var_r > 0 else 0.0  # rows grow downwards: leaning right is cov < 0
    return {"size": size, "weight": weight, "slant": slant}


@lru_cache(maxsize=1)
def thresholds() -> dict[str, tuple[float, float]]:
    """Tertiles of each attribute over all 1797 digits (the level boundaries)."""
    import torch

    from specray.models.digits import _all_digits, to_uint8_pixels

    images, _ = _all_digits()
    values = [measure(img) for img in to_uint8_pixels(torch.from_numpy(images.astype(np.int64))).numpy()]
    return {name: tuple(float(q) for q in np.quantile([v[name] for v in values], [1 / 3, 2 / 3]))
            for name in ATTRIBUTES}


def attribute_levels(image: np.ndarray) -> dict[str, str]:
    """The level of each attribute of a uint8 image."""
    values, cuts = measure(image), thresholds()
    return {name: LEVELS[name][int(values[name] > cuts[name][0]) + int(values[name] > cuts[name][1])]
            for name in ATTRIBUTES}


def caption(digit: int, levels: dict[str, str], variant: int) -> str:
    """One phrasing (``variant`` picks template and synonyms) of a digit with its attribute levels."""
    pick = hashlib.sha256(f"{digit}/{variant}".encode()).digest()
    words = {name: SYNONYMS[name][levels[name]][pick[i] % 3] for i, name in enumerate(ATTRIBUTES)}
    template = TEMPLATES[pick[3] % len(TEMPLATES)]
    return template.format(digit=digit, word=DIGIT_WORDS[digit], **words)


def image_captions(index: int, image: np.ndarray, digit: int, count: int) -> list[str]:
    """``count`` captions of digits image ``index`` (``image`` uint8)."""
    levels = attribute_levels(image)
    return [caption(digit, levels, index * 1000 + k) for k in range(count)]


_PHRASES = sorted(((phrase, name, level) for name, levels in SYNONYMS.items()
                   for level, phrases in levels.items() for phrase in phrases), key=lambda p: -len(p[0]))
_DIGIT = re.compile(r"\b(?:(\d)|(" + "|".join(DIGIT_WORDS) + r"))\b")


def parse_caption(text: str) -> DigitAttributes:
    """The digit and attribute levels a caption names (None for what it does not name)."""
    lowered = text.lower()
    found: dict[str, str] = {}
    for phrase, name, level in _PHRASES:  # longest phrases first: "medium-weight" before "medium"
        position = lowered.find(phrase)
        if position >= 0 and name not in found:
            found[name] = level
            lowered = lowered[:position] + " " * len(phrase) + lowered[position + len(phrase):]
    match = _DIGIT.search(lowered)
    digit = None
    if match:
        digit = int(match.group(1)) if match.group(1) else DIGIT_WORDS.index(match.group(2))
    return DigitAttributes(digit, found.get("size"), found.get("weight"), found.get("slant"))
