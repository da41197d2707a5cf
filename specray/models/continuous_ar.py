"""Continuous-token AR family: a MAR-style model whose tokens are vectors.

Tokens are the 2×2 patches of an 8×8 digit scaled to [-1, 1]: 16 tokens of
dimension 4, position ``p = 4·row + col`` of the 4×4 patch grid.

The transformer is a two-stream ("query stream") causal decoder, which gives
both of MAR's needs with a KV cache:

* the **content stream** is a causal transformer over ``[class, x_{o_1}, …]``
  in generation order, each token embedded with its spatial position; its
  keys/values are cached;
* a **query** for spatial position ``p`` (learned query vector + embedding of
  ``p``) attends to the first ``v`` cached content entries (class + v−1 tokens)
  and to itself; it is never cached. Its output ``z`` conditions the head.

So the model predicts any position from any visible prefix: raster order
(``order = 0..15``), MAR's random order (one token per step), and CSpD's
window verification where the window's drafted tokens stay masked (queries
see only the verified prefix) all use the same network. Training uses random
orders (and raster order part of the time).

The per-token head is MAR's ``SimpleMLPAdaLN``: an MLP of residual blocks
whose LayerNorms are modulated (shift/scale/gate) by time embedding + z. It
outputs ε̂ and, with learned variance, the IDDPM range value v ∈ [-1, 1].
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.conditioning import TextConditionEmbedding
from specray.models.pair import ModelPair

GRID = 4  # 4×4 patches
PATCH = 2
NUM_TOKENS = GRID * GRID
TOKEN_DIM = PATCH * PATCH
IMAGE_SHAPE = (8, 8)


# -- tokens <-> images ------------------------------------------------------------------------------
def levels_to_tokens(levels: torch.Tensor) -> torch.Tensor:
    """Grey levels 0..16 ``[N, 8, 8]`` -> tokens ``float32 [N, 16, 4]`` in [-1, 1]."""
    x = levels.to(torch.float32) / 8.0 - 1.0
    n = x.shape[0]
    x = x.reshape(n, GRID, PATCH, GRID, PATCH).permute(0, 1, 3, 2, 4)
    return x.reshape(n, NUM_TOKENS, TOKEN_DIM)


def tokens_to_unit_images(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens ``[N, 16, 4]`` -> float images ``[N, 8, 8]`` in token units (no clamping)."""
    n = tokens.shape[0]
    x = tokens.reshape(n, GRID, GRID, PATCH, PATCH).permute(0, 1, 3, 2, 4)
    return x.reshape(n, *IMAGE_SHAPE)


def tokens_to_uint8(tokens: torch.Tensor) -> torch.Tensor:
    """Tokens -> uint8 pixels ``[N, 8, 8]`` on CPU: [-1, 1] maps linearly to 0..255."""
    x = tokens_to_unit_images(tokens.detach().to(torch.float32).cpu())
    return torch.round((x.clamp(-1.0, 1.0) + 1.0) * 127.5).to(torch.uint8)


# -- configuration ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class ContinuousARConfig:
    num_classes: int = 10
    num_tokens: int = NUM_TOKENS
    token_dim: int = TOKEN_DIM
    dim: int = 128
    n_layer: int = 4
    n_head: int = 4
    head_width: int = 256
    head_blocks: int = 3
    learn_sigma: bool = True
    class_dropout_prob: float = 0.1
    diffusion_train_steps: int = 1000
    diffusion_sample_steps: int = 50
    condition: str = "class"  # "class": a class entry at slot 0; "text": the prompt's features there
    text_dim: int = 384
    text_encoder: str = "minilm"  # the encoder whose features the model was trained on ("text" only)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "ContinuousARConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(values) - known
        if unknown:
            raise ValueError(f"unknown continuous_ar config fields {sorted(unknown)}; allowed: {sorted(known)}")
        return cls(**values)


# -- KV cache of the content stream ---------------------------------------------------------------
@dataclass
class ContentCache:
    """Per-layer keys/values ``[B, S, H, dh]`` of the content stream and the valid length per row.

    Slot 0 holds the class entry; slot ``j`` the j-th generated token. Rows may
    have different lengths (LLM-style verification); stale slots past
    ``length`` are simply overwritten by later appends.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    length: torch.Tensor  # int64 [B]

    def truncate(self, new_length: torch.Tensor) -> None:
        self.length = torch.minimum(self.length, new_length.to(self.length))


# -- building blocks --------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-LN transformer block; attention runs over externally supplied keys/values."""

    def __init__(self, dim: int, n_head: int) -> None:
        super().__init__()
        self.n_head = n_head
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def split_qkv(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        b, n, d = h.shape
        q, k, v = self.qkv(self.norm1(h)).reshape(b, n, 3, self.n_head, d // self.n_head).unbind(2)
        return q, k, v  # [B, n, H, dh]

    def finish(self, h: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        # q [B, n, H, dh], k/v [B, S, H, dh], mask [B, n, S] (True = attend)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask.unsqueeze(1)
        )
        h = h + self.proj(out.transpose(1, 2).reshape(h.shape))
        return h + self.mlp(self.norm2(h))


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    half = dim // 2
    if torch.compiler.is_compiling():  # the graph computes them itself
        freqs = time_frequencies(half, max_period, t.device)
    else:
        freqs = _cached_time_frequencies(half, max_period, t.device)
    args = t.to(torch.float32).unsqueeze(-1) * freqs
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def time_frequencies(half: int, max_period: float, device: torch.device) -> torch.Tensor:
    """The timestep embedding's ``half`` frequencies."""
    return torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=device) / half)


@functools.lru_cache(maxsize=16)
def _cached_time_frequencies(half: int, max_period: float, device: torch.device) -> torch.Tensor:
    """:func:`time_frequencies`, computed once per size and device (the same ops, so the same values);
    read-only. A head call at a few rows costs about 2 µs an op, and the head runs 50 times a token."""
    with torch.inference_mode(False):  # a plain tensor, whichever mode the first call came in
        return time_frequencies(half, max_period, device)


def _sequential(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """``layers(x)`` through each layer's ``forward``: ``Module.__call__`` costs about a microsecond a
    call, up to 38 times a head call."""
    for layer in layers:
        x = layer.forward(x)
    return x


class AdaLNResBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 3 * width))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = _sequential(self.modulation, c).chunk(3, dim=-1)
        return x + gate * _sequential(self.mlp, self.norm.forward(x) * (1 + scale) + shift)


class DiffusionHead(nn.Module):
    """MAR's per-token MLP with AdaLN conditioning on (timestep, z)."""

    def __init__(self, token_dim: int, cond_dim: int, width: int, blocks: int, learn_sigma: bool) -> None:
        super().__init__()
        self.out_dim = token_dim * (2 if learn_sigma else 1)
        self.width = width
        self.input_proj = nn.Linear(token_dim, width)
        self.time_mlp = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.cond_proj = nn.Linear(cond_dim, width)
        self.blocks = nn.ModuleList(AdaLNResBlock(width) for _ in range(blocks))
        self.final_norm = nn.LayerNorm(width, elementwise_affine=False, eps=1e-6)
        self.final_modulation = nn.Sequential(nn.SiLU(), nn.Linear(width, 2 * width))
        self.out = nn.Linear(width, self.out_dim)
        for block in self.blocks:  # adaLN-zero: blocks start as identity
            nn.init.zeros_(block.modulation[-1].weight)
            nn.init.zeros_(block.modulation[-1].bias)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, x_t: torch.Tensor, timestep: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        c = _sequential(self.time_mlp, timestep_embedding(timestep, self.width)) + self.cond_proj.forward(z)
        h = self.input_proj.forward(x_t)
        for block in self.blocks:
            h = block.forward(h, c)
        shift, scale = _sequential(self.final_modulation, c).chunk(2, dim=-1)
        return self.out.forward(self.final_norm.forward(h) * (1 + scale) + shift)


# -- the model ----------------------------------------------------------------------------------
class ContinuousAR(nn.Module):
    def __init__(self, config: ContinuousARConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        if c.condition == "text":  # slot 0 reads the batch's prompt features (null = num_classes)
            self.class_embed = TextConditionEmbedding(c.text_dim, c.dim, c.num_classes)
        elif c.condition == "class":
            self.class_embed = nn.Embedding(c.num_classes + 1, c.dim)  # last id = null class (CFG)
        else:
            raise ValueError(f"condition={c.condition!r}; allowed: class, text")
        self.token_proj = nn.Linear(c.token_dim, c.dim)
        self.pos_embed = nn.Parameter(torch.randn(c.num_tokens, c.dim) * 0.02)
        self.query_embed = nn.Parameter(torch.randn(c.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(c.dim, c.n_head) for _ in range(c.n_layer))
        self.norm = nn.LayerNorm(c.dim)
        self.head = DiffusionHead(c.token_dim, c.dim, c.head_width, c.head_blocks, c.learn_sigma)
        # torch.compile of head.forward, set by specray.models.compiled.compile_head (None: eager).
        self.compiled_head: Any = None

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    # content stream --------------------------------------------------------------------------
    def new_cache(self, labels: torch.Tensor, extra_slots: int = 0) -> ContentCache:
        """A cache holding only the class entry (slot 0) for each row."""
        b = labels.shape[0]
        c = self.config
        slots = 1 + c.num_tokens + extra_slots
        shape = (b, slots, c.n_head, c.dim // c.n_head)
        dev, dt = self.pos_embed.device, self.pos_embed.dtype
        cache = ContentCache(
            keys=[torch.zeros(shape, device=dev, dtype=dt) for _ in self.blocks],
            values=[torch.zeros(shape, device=dev, dtype=dt) for _ in self.blocks],
            length=torch.zeros(b, dtype=torch.int64, device=dev),
        )
        self._append(cache, self.class_embed(labels.to(dev)).unsqueeze(1), torch.ones(b, dtype=torch.int64, device=dev))
        return cache

    def append_tokens(
        self, cache: ContentCache, tokens: torch.Tensor, positions: torch.Tensor, n_valid: torch.Tensor | None = None
    ) -> None:
        """Append ``tokens [B, m, d]`` at spatial ``positions [B, m]``; ``n_valid[B]`` of them count (rest is padding)."""
        h = self.token_proj(tokens.to(self.pos_embed.dtype)) + self.pos_embed[positions]
        if n_valid is None:
            n_valid = torch.full((tokens.shape[0],), tokens.shape[1], dtype=torch.int64, device=h.device)
        self._append(cache, h, n_valid)

    def _append(self, cache: ContentCache, h: torch.Tensor, n_valid: torch.Tensor) -> None:
        b, m, _ = h.shape
        rows = torch.arange(b, device=h.device).unsqueeze(1)
        slots = cache.length.unsqueeze(1) + torch.arange(m, device=h.device)  # [B, m]
        capacity = cache.keys[0].shape[1]
        if int(slots.max()) >= capacity:
            raise ValueError(f"content cache overflow: need slot {int(slots.max())}, capacity {capacity}")
        key_index = torch.arange(capacity, device=h.device)
        mask = key_index.view(1, 1, -1) <= slots.unsqueeze(-1)  # causal over the cache
        for layer, block in enumerate(self.blocks):
            q, k, v = block.split_qkv(h)
            # out-of-place writes keep autograd intact when training through the cache
            cache.keys[layer] = cache.keys[layer].index_put((rows, slots), k)
            cache.values[layer] = cache.values[layer].index_put((rows, slots), v)
            h = block.finish(h, q, cache.keys[layer], cache.values[layer], mask)
        cache.length = cache.length + n_valid.to(cache.length)

    # query stream ----------------------------------------------------------------------------
    def query(self, cache: ContentCache, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """Conditioning vectors ``z [B, m, dim]`` for spatial ``positions [B, m]``.

        Query j of row b attends to the first ``visible[b, j]`` cache slots (class
        entry included) and to itself.
        """
        b, m = positions.shape
        g = self.query_embed + self.pos_embed[positions]
        capacity = cache.keys[0].shape[1]
        key_index = torch.arange(capacity, device=g.device)
        cache_mask = key_index.view(1, 1, -1) < visible.unsqueeze(-1)  # [B, m, S]
        self_mask = torch.eye(m, dtype=torch.bool, device=g.device).expand(b, m, m)
        mask = torch.cat([cache_mask, self_mask], dim=-1)
        for layer, block in enumerate(self.blocks):
            q, k, v = block.split_qkv(g)
            keys = torch.cat([cache.keys[layer], k], dim=1)
            values = torch.cat([cache.values[layer], v], dim=1)
            g = block.finish(g, q, keys, values, mask)
        return self.norm(g)

    # head ---------------------------------------------------------------------------------------
    @property
    def head_net(self) -> nn.Module:
        """The per-token network ``(x_t, timestep, z) -> output`` that :meth:`head_output` calls."""
        return self.head

    def head_output(self, x_t: torch.Tensor, timestep: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """ε̂ and the learned-range fraction f = (v+1)/2 (None without learned variance)."""
        out = (self.compiled_head or self.head)(x_t, timestep, z)
        d = self.config.token_dim
        if not self.config.learn_sigma:
            return out, None
        return out[..., :d], (out[..., d:] + 1.0) / 2.0

    # training forward ------------------------------------------------------------------------
    def forward_train(self, tokens: torch.Tensor, order: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """z for every token in generation order: query i sees class + tokens o_1..o_{i-1}."""
        b, n, _ = tokens.shape
        in_order = torch.gather(tokens, 1, order.unsqueeze(-1).expand(-1, -1, tokens.shape[-1]))
        cache = self.new_cache(labels)
        self.append_tokens(cache, in_order[:, :-1], order[:, :-1])
        visible = torch.arange(1, n + 1, device=tokens.device).expand(b, n)
        return self.query(cache, order, visible)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def flops_per_token(config: ContinuousARConfig, sample_steps: int | None = None) -> int:
    """Rough multiply-adds per generated token: one query pass + the head chain."""
    c = config
    transformer = c.n_layer * 12 * c.dim * c.dim
    head = (c.head_blocks * 5 + 4) * c.head_width * c.head_width
    return transformer + (sample_steps or c.diffusion_sample_steps) * head


# -- weights and pairs ----------------------------------------------------------------------------
def load_model(name_or_path: str | dict, device: torch.device | str = "cpu") -> tuple[ContinuousAR, dict[str, str]]:
    """Build a model from a preset name, a ``.safetensors`` path with a ``config`` metadata entry, or a
    ``{format: ...}`` reference loaded by the family table's loader for that format."""
    import json

    if isinstance(name_or_path, dict):
        from specray.families import load_formatted_model

        return load_formatted_model("continuous_ar", name_or_path, device)

    from safetensors import safe_open
    from safetensors.torch import load_file

    from specray.models.presets import get_preset

    if name_or_path.endswith(".safetensors"):
        path = Path(name_or_path)
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
        config = ContinuousARConfig.from_dict(json.loads(metadata["config"]))
    else:
        preset = get_preset(name_or_path)
        if preset.family != "continuous_ar":
            raise ValueError(f"preset {name_or_path!r} is family {preset.family!r}, not 'continuous_ar'")
        path = preset.weights_path
        config = ContinuousARConfig.from_dict(preset.config)
        if not path.exists():
            raise FileNotFoundError(f"weights for {name_or_path!r} missing at {path}; run `specray train {name_or_path}`")
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
    model = ContinuousAR(config)
    state = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
    model.load_state_dict(state)
    return model.to(device).eval(), metadata


def load_pair(target: str | dict, draft: str | dict | None, device: torch.device) -> ModelPair:
    from specray.models.refs import ref_key

    target_model, target_meta = load_model(target, device)
    draft_model, draft_meta = (None, {}) if draft is None else load_model(draft, device)
    if draft_model is not None and draft_model.config.diffusion_sample_steps != target_model.config.diffusion_sample_steps:
        raise ValueError("target and draft must share diffusion_sample_steps (trajectory alignment needs one schedule)")
    info = {
        "image_shape": target_meta.get("image_shape", IMAGE_SHAPE),
        "image_decoder": target_meta.get("image_decoder"),  # a release's VAE; the presets' tokens are pixels
        "num_tokens": target_model.config.num_tokens,
        "token_dim": target_model.config.token_dim,
        "target_config": asdict(target_model.config),
        "draft_config": None if draft_model is None else asdict(draft_model.config),
        "target_metadata": target_meta,
        "draft_metadata": draft_meta,
    }
    return ModelPair("continuous_ar", ref_key(target), ref_key(draft), target_model, draft_model,
                     torch.device(device), info)
