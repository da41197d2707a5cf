"""Training the built-in text-conditioned presets: captions of the digits and their MiniLM features.

:class:`CaptionBank` holds ``captions_per_image`` captions of every image of a digits split
(``specray.models.digits_captions``: the digit and the attributes the image measures, phrased in
varied ways) and their MiniLM features, computed once. A trainer asks it for the conditions of a
batch: it picks one caption per image (uniformly, from the trainer's generator), hands the
features to the model's text condition module, and returns the row ids the model reads them by, in
the place a class-conditional trainer passes labels. Class-conditional presets never touch it, so
their training (and their committed weights) are unchanged.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from specray.models.conditioning import set_prompt_features
from specray.models.digits import Split, load_digits_split, to_uint8_pixels
from specray.models.digits_captions import image_captions

CAPTIONS_PER_IMAGE = 4
_SPLIT_OFFSET = {"train": 0, "heldout": 100_000}  # keeps the two splits' phrasings apart


class CaptionBank:
    """Captions of one digits split and their features ``[N, K, D]`` (row order of ``load_digits_split``)."""

    def __init__(self, split: Split, captions_per_image: int = CAPTIONS_PER_IMAGE, encoder=None) -> None:
        images, labels = load_digits_split(split)
        pixels = to_uint8_pixels(images).numpy()
        self.captions = [image_captions(_SPLIT_OFFSET[split] + i, pixels[i], int(labels[i]), captions_per_image)
                         for i in range(len(labels))]
        if encoder is None:
            from specray.models.text import MiniLMEncoder

            encoder = MiniLMEncoder()
        flat = [text for caps in self.captions for text in caps]
        chunks = [encoder.encode(flat[i : i + 512]).pooled for i in range(0, len(flat), 512)]
        self.features = torch.cat(chunks).reshape(len(labels), captions_per_image, -1)

    def conditions(self, model: torch.nn.Module, rows: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
        """Give ``model`` the features of one caption per image ``rows`` (a random one with a
        generator, the first without) and return the condition ids ``0..len(rows)-1``."""
        if generator is None:
            choice = torch.zeros(rows.shape[0], dtype=torch.int64)
        else:
            choice = torch.randint(0, self.features.shape[1], (rows.shape[0],), generator=generator)
        set_prompt_features(self.features[rows, choice], model)
        return torch.arange(rows.shape[0])


@lru_cache(maxsize=4)
def caption_bank(split: Split, captions_per_image: int = CAPTIONS_PER_IMAGE) -> CaptionBank:
    """The split's bank, built once per process (encoding every caption takes a while on a CPU)."""
    return CaptionBank(split, captions_per_image)
