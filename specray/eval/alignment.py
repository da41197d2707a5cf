"""Text-image alignment of prompt-conditioned runs: per-sample scores, and the shuffled control.

- ``digits`` (the built-in text models): the digits classifier's prediction and the attribute
  levels measured on the generated image (``specray.models.digits_captions``) against what the
  prompt names; a sample scores the share of named items (digit, size, weight, slant) it matches.
- ``clip`` (real runs): CLIP score (100 * cosine of image and text embeddings, floored at 0) through
  ``torchmetrics`` from a local CLIP model folder (``eval.options.clip_model``).

The *shuffled control* scores every image against another sample's prompt (a fixed derangement),
so "target_only's alignment is clearly above chance" is read off one run: the gap between the
two numbers is what the prompts explain.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

SCORERS = ("digits", "clip")


def derangement(n: int, seed: int = 0) -> np.ndarray:
    """A permutation of ``range(n)`` with no fixed point (n >= 2): a seeded shift of a seeded order."""
    if n < 2:
        return np.arange(n)
    order = np.random.default_rng(seed).permutation(n)
    shifted = np.empty(n, dtype=np.int64)
    shifted[order] = np.roll(order, 1)
    return shifted


class DigitsAlignment:
    """Agreement of generated digits with their prompts (digit and attribute levels)."""

    name = "digits"

    def __init__(self, device: torch.device | str = "cpu") -> None:
        from specray.eval.digits_features import load_model

        self.device = torch.device(device)
        self.classifier = load_model(device=self.device)

    @torch.inference_mode()
    def scores(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        """float64 ``[N]`` in [0, 1]: share of the prompt's named items the image matches (NaN: names none)."""
        from specray.eval.digits_features import uint8_to_model_input
        from specray.models.digits_captions import ATTRIBUTES, attribute_levels, parse_caption

        batch = torch.from_numpy(np.ascontiguousarray(images))
        if batch.dim() == 4:  # RGB -> grey
            batch = batch.float().mean(-1).round().to(torch.uint8)
        predicted = self.classifier(uint8_to_model_input(batch.to(self.device))).argmax(-1).cpu().numpy()
        out = np.full(len(prompts), np.nan)
        for i, prompt in enumerate(prompts):
            named = parse_caption(prompt)
            levels = attribute_levels(batch[i].numpy())
            checks = [] if named.digit is None else [predicted[i] == named.digit]
            checks += [levels[a] == getattr(named, a) for a in ATTRIBUTES if getattr(named, a) is not None]
            if checks:
                out[i] = float(np.mean(checks))
        return out


class ClipAlignment:
    """CLIP score from a local model folder (transformers layout), through torchmetrics."""

    name = "clip"

    def __init__(self, model_path: str, device: torch.device | str = "cpu") -> None:
        from transformers import CLIPModel, CLIPProcessor

        self.device = torch.device(device)
        self.model = CLIPModel.from_pretrained(model_path, local_files_only=True).to(self.device).eval()
        self.processor = CLIPProcessor.from_pretrained(model_path, local_files_only=True)

    @torch.inference_mode()
    def scores(self, images: np.ndarray, prompts: Sequence[str]) -> np.ndarray:
        from torchmetrics.functional.multimodal import clip_score

        rgb = images if images.ndim == 4 else np.repeat(images[..., None], 3, axis=-1)
        pixels = torch.from_numpy(np.ascontiguousarray(rgb)).permute(0, 3, 1, 2)
        out = np.empty(len(prompts))
        loaded = lambda: (self.model, self.processor)  # noqa: E731 - torchmetrics takes a loader callable
        for i in range(len(prompts)):  # per sample: torchmetrics averages over what it is given
            out[i] = float(clip_score(pixels[i : i + 1].to(self.device), [prompts[i]], model_name_or_path=loaded))
        return out


def load_scorer(name: str, device: torch.device | str = "cpu", clip_model: str | None = None):
    if name == "digits":
        return DigitsAlignment(device)
    if name == "clip":
        if not clip_model:
            raise ValueError("the clip alignment score needs eval.options.clip_model (a local CLIP model folder)")
        return ClipAlignment(clip_model, device)
    raise ValueError(f"unknown alignment score {name!r}; allowed: {', '.join(SCORERS)}")


def aligned_and_shuffled(scorer, images: np.ndarray, prompts: Sequence[str],
                         seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Per-sample scores against the sample's own prompt and against a deranged prompt."""
    other = derangement(len(prompts), seed)
    return scorer.scores(images, prompts), scorer.scores(images, [prompts[j] for j in other])
