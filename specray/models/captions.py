"""Token-level caption prefix of LlamaGen's text-to-image GPTs (``CaptionEmbedder`` of
``autoregressive/models/gpt.py``), and the arrangement of encoder features into that prefix.

A t2i GPT reads ``cls_token_num`` (120) caption tokens as its prefix: T5 token features projected by
a two-layer MLP (``cap_proj.fc1`` / ``cap_proj.fc2``, no biases, tanh-approximated GELU). The CFG
null caption is the learned ``uncond_embedding`` ``[120, caption_dim]`` (a persistent buffer in the
release), projected like a caption. Padded caption positions are hidden from every query by a
key-padding mask (each position still sees itself, as the official attention mask's diagonal does);
the null caption is masked with its row's caption mask, as in LlamaGen's training and sampler.

Like :class:`specray.models.conditioning.TextConditionEmbedding`, the embedder holds the batch's
captions (:meth:`CaptionEmbedder.set_captions`) and a prefix "token" selects one: id ``b`` is caption
``b``; id ``null_offset + b`` is the null caption under caption ``b``'s mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# Where the valid caption tokens sit in the prefix. "left" (padding first, the caption at the end) is
# what LlamaGen's t2i training data and its samplers use (sample_t2i.py without --no-left-padding);
# "right" is the encoder's own layout (the samplers' --no-left-padding).
CAPTION_PADDINGS = ("left", "right")


def arrange_captions(features: torch.Tensor, mask: torch.Tensor, length: int,
                     padding: str = "left") -> tuple[torch.Tensor, torch.Tensor]:
    """Encoder features ``[B, L, D]`` with their mask ``[B, L]`` as a prefix of ``length`` tokens.

    Each row's valid tokens keep their order and move to the end (``left``) or the start (``right``);
    padded positions get zero features, as the official sampler's ``caption_embs * emb_masks``.
    A row with more than ``length`` valid tokens is refused (the encoder truncates to 120 already).
    """
    if padding not in CAPTION_PADDINGS:
        raise ValueError(f"caption padding {padding!r}; allowed: {', '.join(CAPTION_PADDINGS)}")
    if features.dim() != 3 or mask.shape != features.shape[:2]:
        raise ValueError(f"caption features must be [B, L, D] with a mask [B, L], got {tuple(features.shape)} "
                         f"and {tuple(mask.shape)}")
    mask = mask.to(torch.bool)
    valid = mask.sum(1)
    if valid.numel() and int(valid.max()) > length:
        raise ValueError(f"a caption has {int(valid.max())} tokens; the model's prefix holds {length} "
                         f"(encode with max_length={length})")
    b, n, d = features.shape
    if n < length:  # pad the encoder's layout up to the prefix length
        features = torch.cat([features, features.new_zeros(b, length - n, d)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(b, length - n)], dim=1)
    # Valid tokens first, in order (a stable sort of "is padding"), then cut to the prefix length.
    order = torch.sort((~mask).to(torch.int8), dim=1, stable=True).indices[:, :length]
    slots = torch.arange(length, device=features.device)[None, :]
    if padding == "left":  # rotate each row right by its padding count
        order = torch.gather(order, 1, (slots - (length - valid[:, None])) % length)
        new_mask = slots >= (length - valid[:, None])
    else:
        new_mask = slots < valid[:, None]
    arranged = torch.gather(features, 1, order[:, :, None].expand(-1, -1, d))
    return arranged * new_mask[:, :, None].to(arranged.dtype), new_mask


class CaptionMLP(nn.Module):
    """``fc2(gelu_tanh(fc1 x))``, no biases (LlamaGen's ``MLP``)."""

    def __init__(self, in_features: int, hidden: int, out_features: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class CaptionEmbedder(nn.Module):
    """Prefix ids ``[r]`` -> projected captions ``[r, token_num, dim]`` and their key masks ``[r, token_num]``."""

    def __init__(self, caption_dim: int, dim: int, token_num: int, null_offset: int, padding: str = "left") -> None:
        super().__init__()
        if padding not in CAPTION_PADDINGS:
            raise ValueError(f"caption_padding={padding!r}; allowed: {', '.join(CAPTION_PADDINGS)}")
        self.caption_dim, self.token_num, self.null_offset, self.padding = caption_dim, token_num, null_offset, padding
        self.cap_proj = CaptionMLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim**0.5)
        self.captions: torch.Tensor | None = None  # [B, token_num, caption_dim], arranged
        self.masks: torch.Tensor | None = None  # [B, token_num] bool

    def set_captions(self, features: torch.Tensor, mask: torch.Tensor) -> None:
        """The batch's encoder features ``[B, L, caption_dim]`` and mask ``[B, L]``; prefix id ``b`` selects row ``b``."""
        if features.dim() != 3 or features.shape[-1] != self.caption_dim:
            raise ValueError(f"caption features must be [B, L, {self.caption_dim}] (token-level T5 features), "
                             f"got {tuple(features.shape)}")
        captions, masks = arrange_captions(features, mask, self.token_num, self.padding)
        device, dtype = self.uncond_embedding.device, self.uncond_embedding.dtype
        self.captions, self.masks = captions.to(device, dtype), masks.to(device)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.captions is None or self.masks is None:
            raise RuntimeError("a text-to-image GPT was called before its captions were set")
        is_null = ids >= self.null_offset
        rows = torch.where(is_null, ids - self.null_offset, ids)
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.captions.shape[0]):
            raise IndexError(f"caption index outside the batch's {self.captions.shape[0]} captions")
        features = torch.where(is_null[:, None, None], self.uncond_embedding, self.captions[rows])
        return self.cap_proj(features), self.masks[rows]


def caption_embedders(model: nn.Module) -> list[CaptionEmbedder]:
    """The caption prefix modules of ``model`` (empty for a class- or pooled-text-conditioned model)."""
    return [m for m in model.modules() if isinstance(m, CaptionEmbedder)]


def set_caption_features(features: torch.Tensor, mask: torch.Tensor, *models: nn.Module | None) -> None:
    """Give every caption-conditioned model among ``models`` the batch's token features and mask."""
    for model in models:
        if model is not None:
            for module in caption_embedders(model):
                module.set_captions(features, mask)
