"""EAGLE draft head for the discrete GPT (spec discrete_sd §6; EAGLE-1, as LANTERN uses it).

One decoder layer of the target's architecture. At sequence position ``s`` it reads the target's
last hidden state (after the final norm) at ``s - 1`` together with the embedding of the token fed
at ``s``, ``fc([embed(x_s), f_{s-1}])``, runs the layer, and returns a predicted hidden state
``f̂_s``; the target's frozen output layer turns it into the logits of image token ``s``. Drafting
feeds its own ``f̂`` back in place of the target's features for the positions it drafts.

Layout (EAGLE-1 / LANTERN's ``cnets``): the embedding is a frozen copy of the target's input
embeddings, ``fc`` has a bias, and the layer has no input norm (EAGLE-1 drops the first layer's
``input_layernorm``; ``input_norm: true`` keeps one). Module names follow the discrete GPT's
LlamaGen names (``layer.attention.wqkv``, ``layer.feed_forward.w1/w2/w3``, ``layer.ffn_norm``);
``specray.models.lantern_drafter`` maps LANTERN's Hugging-Face-style names onto them.

Rotary positions are the target's: the head at position ``s`` rotates by the target's 2-D RoPE row
``s`` (the grid cell of the token it embeds), which is LANTERN's convention for LlamaGen heads.
Like the GPT, the head keeps a static K/V cache over explicit slots, so draft trees (nodes sharing a
position) and ragged rows run as one call.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models import discrete_ar
from specray.models.configs import dataclass_from_dict
from specray.models.discrete_ar import (
    PREFIX_ROPE_MODES,
    Attention,
    CfgSoftmax,
    DiscreteGPT,
    FeedForward,
    KVCache,
    RMSNorm,
    call_rows,
    complex_rotary_applies,
    fused_layers,
    fused_layers_of,
    kv_slots,
    maybe_softmax,
    register_rotary_tables,
    rotary_at,
)
from specray.models.draft_formats import HEAD_KIND, EagleHeadFile


@dataclass(frozen=True)
class EagleHeadConfig:
    """Shape of a head; ``dim``, the vocabulary and the rotary grid must match the target's."""

    vocab_size: int
    dim: int
    n_head: int
    ffn_hidden: int
    grid_size: int
    cls_token_num: int = 1
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    prefix_rope: str = "zeros"
    fc_bias: bool = True
    input_norm: bool = False
    # Read by the shared attention / feed-forward modules; a head runs without dropout.
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0

    def __post_init__(self) -> None:
        if self.dim % self.n_head or (self.dim // self.n_head) % 4:
            raise ValueError(f"dim={self.dim} must split into n_head={self.n_head} heads of a size divisible by 4")
        if self.prefix_rope not in PREFIX_ROPE_MODES:
            raise ValueError(f"prefix_rope={self.prefix_rope!r}; allowed: {', '.join(PREFIX_ROPE_MODES)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @classmethod
    def for_target(cls, target: DiscreteGPT, **overrides: Any) -> "EagleHeadConfig":
        """One layer shaped like the target's (EAGLE: the head is a layer of the target's architecture)."""
        c = target.config
        fields = dict(vocab_size=c.vocab_size, dim=c.dim, n_head=c.n_head, ffn_hidden=c.ffn_hidden,
                      grid_size=c.grid_size, cls_token_num=c.cls_token_num, norm_eps=c.norm_eps,
                      rope_base=c.rope_base, prefix_rope=c.prefix_rope)
        return cls(**{**fields, **overrides})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EagleHeadConfig":
        return dataclass_from_dict(cls, d, "EagleHeadConfig")

    def to_json(self) -> str:
        return json.dumps({"kind": HEAD_KIND, **asdict(self)})


class EagleLayer(nn.Module):
    """The target's decoder layer, with the input norm optional (EAGLE-1 has none)."""

    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.dim, config.norm_eps) if config.input_norm else None
        self.attention = Attention(config)  # type: ignore[arg-type]  # reads the same fields as GPTConfig
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.feed_forward = FeedForward(config)  # type: ignore[arg-type]

    def forward(self, x, rope, mask, kv=None):  # type: ignore[no-untyped-def]
        normed = x if self.attention_norm is None else self.attention_norm(x)
        h = x + self.attention(normed, rope, mask, kv)
        return h + self.feed_forward(self.ffn_norm(h))


class EagleHead(nn.Module):
    def __init__(self, config: EagleHeadConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.dim)
        self.embed_tokens.weight.requires_grad_(False)  # a frozen copy of the target's
        self.fc = nn.Linear(2 * config.dim, config.dim, bias=config.fc_bias)
        self.layer = EagleLayer(config)
        register_rotary_tables(self, config)

    @classmethod
    def for_target(cls, target: DiscreteGPT, **overrides: Any) -> "EagleHead":
        """A fresh head shaped for ``target`` with its embeddings copied in (training starts here)."""
        head = cls(EagleHeadConfig.for_target(target, **overrides))
        head.embed_tokens.weight.data.copy_(target.tok_embeddings.weight.detach())
        nn.init.normal_(head.fc.weight, std=0.02)
        if head.fc.bias is not None:
            nn.init.zeros_(head.fc.bias)
        for module in head.layer.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        return head.to(target.output.weight.device)

    def check_target(self, target: DiscreteGPT) -> None:
        """Refuse a target whose vocabulary, width or rotary grid the head was not built for."""
        c, t = self.config, target.config
        for name in ("vocab_size", "dim", "grid_size", "cls_token_num", "rope_base", "prefix_rope"):
            if getattr(c, name) != getattr(t, name):
                raise ValueError(f"EAGLE head {name}={getattr(c, name)!r} does not match the target's {getattr(t, name)!r}")

    @property
    def layers(self) -> list[EagleLayer]:
        """The head's one layer, listed as a GPT's layers are (what :func:`fused_layers` runs)."""
        return [self.layer]

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rotary_at(positions, self.rope_table, self.rope_factors)

    def _input(self, features: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        embedded = F.embedding(tokens.clamp(0, self.config.vocab_size - 1), self.embed_tokens.weight)
        return self.fc(torch.cat([embedded, features.to(embedded.dtype)], dim=-1))

    def forward(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Training / reference forward, causal over the given sequence: ``f̂ [B, L, D]``.

        ``features [B, L, D]``: the target's hidden state at ``positions - 1``; ``tokens [B, L]`` the
        tokens fed at ``positions [B, L]`` (increasing along L).
        """
        length = tokens.shape[1]
        mask = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()[None, None]
        return self.layer(self._input(features, tokens), self._rotary(positions), mask)

    def new_cache(self, rows: int, max_len: int) -> KVCache:
        shape = {"max_len": max_len, "n_head": self.config.n_head, "head_dim": self.config.head_dim,
                 "like": self.fc.weight}
        return KVCache(keys=[kv_slots(rows, **shape)], values=[kv_slots(rows, **shape)],
                       lengths=torch.zeros(rows, dtype=torch.int64, device=self.fc.weight.device))

    def forward_cached(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                       slots: torch.Tensor, visible: torch.Tensor, cache: KVCache,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """``f̂ [r, n, D]`` with K/V written to ``slots [r, n]`` of cache ``rows`` and attention over the
        slots ``visible [r, n, S]`` allows (as :meth:`DiscreteGPT.forward_tree`)."""
        rows, write_rows = call_rows(tokens, cache, rows)
        h, rope, mask = self._input(features, tokens), self._rotary(positions), visible[:, None]
        fused = fused_layers(self, h, rope, cache.keys)
        if fused is not None:  # the layer in one C++ call, the same values
            return fused(h, rope, mask, cache.keys, cache.values, rows, write_rows, slots)
        return self.layer(h, rope, mask, (cache.keys[0], cache.values[0], rows, write_rows, slots))

    def forward_cached_logits(self, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                              slots: torch.Tensor, visible: torch.Tensor, cache: KVCache, target: DiscreteGPT,
                              rows: torch.Tensor | None = None, softmax: CfgSoftmax | None = None
                              ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_cached`'s predictions and their logits by the ``target``'s output layer
        (:func:`head_logits`; their ``softmax`` where given): in one C++ call where the fused layers serve it
        (:data:`~specray.models.discrete_ar.FUSED_STEP`), the same values."""
        serves = (discrete_ar.FUSED_STEP and complex_rotary_applies(self.rope_table)
                  and features.dtype == torch.float32)
        fused = fused_layers_of(self, self.fc.weight, cache.keys) if serves else None
        if fused is None:
            predicted = self.forward_cached(features, tokens, positions, slots, visible, cache, rows)
            return predicted, maybe_softmax(softmax, head_logits(target, predicted))
        rows, write_rows = call_rows(tokens, cache, rows)
        return fused.head_step(self, features, tokens, positions, visible, cache.keys, cache.values, rows, write_rows,
                               slots, target.output.weight, softmax)


def head_logits(target: DiscreteGPT, features: torch.Tensor) -> torch.Tensor:
    """Logits of the target's frozen output layer on (predicted) hidden states, float32."""
    return F.linear(features, target.output.weight).float()


def load_head(raw_config: dict[str, Any], path, device: torch.device | str = "cpu") -> EagleHead:  # noqa: ANN001
    """A head from its config (``kind: eagle_head``) and a safetensors file of its weights."""
    from safetensors.torch import load_file

    config = EagleHeadConfig.from_dict({k: v for k, v in raw_config.items() if k != "kind"})
    head = EagleHead(config)
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    missing = sorted(set(head.state_dict()) - set(state))
    unexpected = sorted(set(state) - set(head.state_dict()))
    if missing or unexpected:
        raise ValueError(f"{path}: EAGLE head weights do not fit its config: missing {missing}, unexpected {unexpected}")
    head.load_state_dict(state)
    return head.to(device).eval()


def check_head_for_target(head: EagleHead, target: DiscreteGPT, name: Any = None) -> None:
    """Refuse a head built for another target: shapes first, then its copy of the token embeddings
    (a head reads the target's hidden states, so it only works with the target it was trained on)."""
    try:
        head.check_target(target)
    except ValueError as exc:
        raise ValueError(f"draft {name!r}: {exc}") from None
    mine, theirs = head.embed_tokens.weight.detach(), target.tok_embeddings.weight.detach()
    scale = float(theirs.abs().max())
    if not torch.allclose(mine, theirs.to(mine.dtype), rtol=1e-2, atol=1e-3 * max(scale, 1e-6)):
        diff = float((mine - theirs.to(mine.dtype)).abs().max())
        raise ValueError(f"draft {name!r}: the EAGLE head's token embeddings differ from the target's "
                         f"(max |diff| {diff:.3g}): it was trained for another target")


def load_head_file(options: EagleHeadFile, device: torch.device | str = "cpu") -> EagleHead:
    """The family table's loader for ``{format: eagle-head, path: ...}``."""
    from pathlib import Path

    from specray.models.draft_formats import head_file_config

    path = Path(options.path).expanduser()
    return load_head(head_file_config(path), path, device)
