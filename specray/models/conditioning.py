"""Text conditions for the built-in models, through the slot a class label uses.

A class-conditional model turns a label into a vector with a table lookup (LlamaGen's class
embedding, MAR's class entry, the UNet's class embedding). :class:`TextConditionEmbedding` takes
that module's place in a text-conditioned model: the "label" of row ``b`` is ``b`` itself, an index
into the batch's prompt features (set with :meth:`set_features` before the batch runs), projected
to the model's width; the null label (the model's ``num_classes``, as for classes) gives a learned
null vector, which classifier-free guidance uses as the unconditional stream and training uses for
prompt dropout. The decoding loops therefore run text-conditioned models exactly as they run
class-conditioned ones.
"""

from __future__ import annotations

import torch
from torch import nn

from specray.models.presets import TEXT_NULL_INDEX


class TextConditionEmbedding(nn.Module):
    """``ids [...] -> [..., out_dim]``: row ``ids`` of the batch's prompt features, projected; the
    null index gives the learned null vector."""

    def __init__(self, text_dim: int, out_dim: int, null_index: int = TEXT_NULL_INDEX) -> None:
        super().__init__()
        self.text_dim, self.out_dim, self.null_index = text_dim, out_dim, null_index
        self.proj = nn.Sequential(nn.Linear(text_dim, out_dim), nn.SiLU(), nn.Linear(out_dim, out_dim))
        self.null = nn.Parameter(torch.zeros(out_dim))
        self.features: torch.Tensor | None = None

    def set_features(self, features: torch.Tensor) -> None:
        """The prompt features ``[B, text_dim]`` that row indices ``0..B-1`` select."""
        if features.dim() != 2 or features.shape[1] != self.text_dim:
            raise ValueError(f"prompt features must be [B, {self.text_dim}], got {tuple(features.shape)}")
        self.features = features.to(self.null.device, self.null.dtype)

    def forward(self, ids: torch.Tensor, drop_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``drop_mask`` (training): rows whose prompt is dropped to the null vector."""
        if drop_mask is not None:
            ids = torch.where(drop_mask, torch.full_like(ids, self.null_index), ids)
        if self.features is None:
            raise RuntimeError("a text-conditioned model was called before its prompt features were set")
        is_null = ids == self.null_index
        rows = torch.where(is_null, torch.zeros_like(ids), ids)
        if rows.numel() and int(rows.max()) >= self.features.shape[0]:
            raise IndexError(f"row index {int(rows.max())} outside the batch's {self.features.shape[0]} prompts")
        projected = self.proj(self.features)[rows]
        return torch.where(is_null.unsqueeze(-1), self.null.expand_as(projected), projected)


def text_embeddings(model: nn.Module) -> list[TextConditionEmbedding]:
    """The text condition modules of ``model`` (empty for a class-conditional model)."""
    return [m for m in model.modules() if isinstance(m, TextConditionEmbedding)]


def set_prompt_features(features: torch.Tensor, *models: nn.Module | None) -> None:
    """Give every text-conditioned model among ``models`` the batch's prompt features."""
    for model in models:
        if model is not None:
            for module in text_embeddings(model):
                module.set_features(features)
