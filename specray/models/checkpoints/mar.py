"""MAR releases (LTH14/mar ``checkpoint-last.pth``) with the DiffLoss head and the KL-16 VAE.

The network mirrors the official module names so the release's keys map one to one: ``class_emb``,
``fake_latent`` (the unconditional class embedding), ``z_proj`` + ``z_proj_ln``, learned encoder /
decoder / diffusion position embeddings over 64 buffer + 256 token slots, timm ``Block`` s
(``norm1``, ``attn.qkv`` with bias, ``attn.proj``, ``norm2``, ``mlp.fc1`` / ``mlp.fc2``, exact GELU),
LayerNorm eps 1e-6 everywhere, and ``diffloss.net`` (``SimpleMLPAdaLN``: a 256-dim sinusoidal time
embedding, ``cond_embed``, AdaLN res blocks, a final layer with ``2 x token_dim`` outputs: eps and
the learned-range value). Evaluation uses ``model_ema``.

:class:`MARGenerator` is what the continuous family's loop drives (``specray.methods.continuous``):
``context`` gives the decoder's z for any set of visible tokens (the MAE encoder sees only them,
the class embedding fills all 64 buffer slots, ``fake_latent`` for the null class) and
``head_output`` the DiffLoss net's eps and learned-range fraction. With the loop's one token per
step this is MAR's sampler at ``num_iter = 256`` (the FID setting): the tail of MAR's random order
is generated first, which is the loop's generation order reversed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specray.models.checkpoints.autoencoders import (
    KL_SCALE,
    KLAutoencoder,
    KLConfig,
    ldm_keys_to_llamagen,
    to_uint8_images,
)
from specray.models.checkpoints.options import MAR_SIZES, MAROptions
from specray.models.checkpoints.reading import DTYPES, load_strict, read_checkpoint, select_entry


@dataclass(frozen=True)
class MARConfig:
    width: int = 768
    depth: int = 12
    heads: int = 12
    diffloss_depth: int = 6
    diffloss_width: int = 1024
    seq_len: int = 256  # 16 x 16 KL-16 latents, patch size 1
    token_dim: int = 16
    buffer_size: int = 64
    num_classes: int = 1000
    num_sampling_steps: int = 100
    # What the continuous loop reads (ContinuousARConfig's names):
    diffusion_train_steps: int = field(default=1000, init=False)

    @property
    def num_tokens(self) -> int:
        return self.seq_len

    @property
    def diffusion_sample_steps(self) -> int:
        return self.num_sampling_steps

    @property
    def grid(self) -> int:
        side = int(math.isqrt(self.seq_len))
        if side * side != self.seq_len:
            raise ValueError(f"seq_len {self.seq_len} is not a square grid")
        return side


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, n, d))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """timm's pre-norm ViT block as MAR builds it (qkv bias, LayerNorm eps 1e-6, no layer scale)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=1e-6)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps=1e-6)
        self.mlp = Mlp(dim, 4 * dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), key_mask)
        return x + self.mlp(self.norm2(x))


def _modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale) + shift


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden: int, frequencies: int = 256) -> None:
        super().__init__()
        self.frequencies = frequencies
        self.mlp = nn.Sequential(nn.Linear(frequencies, hidden), nn.SiLU(), nn.Linear(hidden, hidden))

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        half = self.frequencies // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.in_ln = nn.LayerNorm(channels, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(channels, channels), nn.SiLU(), nn.Linear(channels, channels))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 3 * channels))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.adaLN_modulation(y).chunk(3, dim=-1)
        return x + gate * self.mlp(_modulate(self.in_ln(x), shift, scale))


class FinalLayer(nn.Module):
    def __init__(self, channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(channels, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(channels, out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(channels, 2 * channels))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=-1)
        return self.linear(_modulate(self.norm_final(x), shift, scale))


class SimpleMLPAdaLN(nn.Module):
    """The DiffLoss net: eps and the learned-range value ``v`` for a noisy token, time and z."""

    def __init__(self, token_dim: int, width: int, z_dim: int, depth: int) -> None:
        super().__init__()
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(z_dim, width)
        self.input_proj = nn.Linear(token_dim, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * token_dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        h = self.input_proj(x)
        y = self.time_embed(t) + self.cond_embed(c)
        for block in self.res_blocks:
            h = block(h, y)
        return self.final_layer(h, y)


class DiffLoss(nn.Module):
    def __init__(self, token_dim: int, width: int, z_dim: int, depth: int) -> None:
        super().__init__()
        self.net = SimpleMLPAdaLN(token_dim, width, z_dim, depth)


class MARNet(nn.Module):
    """MAR's MAE encoder / decoder and DiffLoss net (the official module names)."""

    def __init__(self, c: MARConfig) -> None:
        super().__init__()
        self.config = c
        slots = c.seq_len + c.buffer_size
        self.class_emb = nn.Embedding(c.num_classes, c.width)
        self.fake_latent = nn.Parameter(torch.zeros(1, c.width))
        self.z_proj = nn.Linear(c.token_dim, c.width)
        self.z_proj_ln = nn.LayerNorm(c.width, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, slots, c.width))
        self.encoder_blocks = nn.ModuleList(Block(c.width, c.heads) for _ in range(c.depth))
        self.encoder_norm = nn.LayerNorm(c.width, eps=1e-6)
        self.decoder_embed = nn.Linear(c.width, c.width)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, c.width))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, slots, c.width))
        self.decoder_blocks = nn.ModuleList(Block(c.width, c.heads) for _ in range(c.depth))
        self.decoder_norm = nn.LayerNorm(c.width, eps=1e-6)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, c.seq_len, c.width))
        self.diffloss = DiffLoss(c.token_dim, c.diffloss_width, c.width, c.diffloss_depth)

    def class_embedding(self, labels: torch.Tensor) -> torch.Tensor:
        """``class_emb`` rows; label ``num_classes`` (the null class) is ``fake_latent``."""
        null = labels >= self.config.num_classes
        emb = self.class_emb(labels.clamp(max=self.config.num_classes - 1))
        return torch.where(null[:, None], self.fake_latent.to(emb.dtype), emb)

    def forward(self, tokens: torch.Tensor, mask: torch.Tensor, class_embedding: torch.Tensor) -> torch.Tensor:
        """z ``[B, L, width]`` for tokens ``[B, L, C]``, ``mask [B, L]`` (True = masked) and the class embedding.

        When every row has the same number of visible tokens the encoder runs on them alone, as the
        official code does; otherwise on all slots with the masked ones excluded as attention keys
        (the same result: masked slots never reach the visible ones, and the decoder replaces them).
        """
        c = self.config
        b = tokens.shape[0]
        x = self.z_proj(tokens.to(self.z_proj.weight.dtype))
        x = torch.cat([class_embedding[:, None].expand(b, c.buffer_size, -1).to(x.dtype), x], dim=1)
        x = self.z_proj_ln(x + self.encoder_pos_embed_learned)
        hidden = torch.cat([torch.zeros(b, c.buffer_size, dtype=torch.bool, device=mask.device), mask], dim=1)
        counts = (~hidden).sum(1)
        if bool((counts == counts[0]).all()):
            x = x[~hidden].reshape(b, -1, x.shape[-1])
            for block in self.encoder_blocks:
                x = block(x)
            x = self.encoder_norm(x)
            x = self.decoder_embed(x)
            full = self.mask_token.to(x.dtype).expand(b, hidden.shape[1], -1).clone()
            full[~hidden] = x.reshape(-1, x.shape[-1])
        else:
            for block in self.encoder_blocks:
                x = block(x, key_mask=~hidden)
            x = self.decoder_embed(self.encoder_norm(x))
            full = torch.where(hidden[..., None], self.mask_token.to(x.dtype), x)
        x = full + self.decoder_pos_embed_learned
        for block in self.decoder_blocks:
            x = block(x)
        x = self.decoder_norm(x)
        return x[:, c.buffer_size :] + self.diffusion_pos_embed_learned


class MARGenerator(nn.Module):
    """A MAR network as the continuous family's loop drives it (see the module docstring)."""

    masked_context = True  # the loop's ModelSide uses context() instead of a KV cache

    def __init__(self, config: MARConfig) -> None:
        super().__init__()
        self.config = config
        self.net = MARNet(config)
        # torch.compile of head_net.forward, set by specray.models.compiled.compile_head (None: eager).
        self.compiled_head: Any = None

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    def context(self, seq: torch.Tensor, order: torch.Tensor, labels: torch.Tensor, positions: torch.Tensor,
                visible: torch.Tensor) -> torch.Tensor:
        """z ``[R, m, width]`` at spatial ``positions [R, m]`` when the first ``visible [R]`` tokens of the
        generation order (``seq [R, L, C]`` in generation order, ``order [R, L]``) are visible."""
        spatial = torch.zeros_like(seq).scatter(1, order[..., None].expand_as(seq), seq)
        rank = torch.empty_like(order).scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
        mask = rank >= visible[:, None]  # masked: not yet generated
        z = self.net(spatial, mask, self.net.class_embedding(labels))
        return torch.gather(z, 1, positions[..., None].expand(-1, -1, z.shape[-1]))

    @property
    def head_net(self) -> nn.Module:
        """The DiffLoss net, the per-token network :meth:`head_output` calls."""
        return self.net.diffloss.net

    def head_output(self, x_t: torch.Tensor, timestep: torch.Tensor, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = (self.compiled_head or self.head_net)(x_t.to(self.net.z_proj.weight.dtype), timestep, z).float()
        d = self.config.token_dim
        return out[..., :d], (out[..., d:] + 1.0) / 2.0


@dataclass
class KLImageDecoder:
    """Tokens ``[B, L, C]`` in spatial order -> uint8 RGB: ``vae.decode(unpatchify(tokens) / 0.2325)``."""

    vae: KLAutoencoder | None
    grid: int

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        latents = tokens.float().reshape(tokens.shape[0], self.grid, self.grid, -1).permute(0, 3, 1, 2)
        if self.vae is None:  # no VAE named: the latent's first three channels as a picture
            return to_uint8_images(latents[:, :3].clamp(-1, 1), rounding="mar")
        images = self.vae.decode(latents.to(self.vae.post_quant_conv.weight.device) / KL_SCALE)
        return to_uint8_images(images, rounding="mar")


def mar_config(options: MAROptions) -> MARConfig:
    arch = dict(options.arch or MAR_SIZES[options.size])
    allowed = {f.name for f in fields(MARConfig) if f.init}
    return MARConfig(num_sampling_steps=options.num_sampling_steps, **{k: v for k, v in arch.items() if k in allowed})


def kl_config(options: MAROptions) -> KLConfig:
    arch = dict(options.vae_arch or {})
    if "ch_mult" in arch:
        arch["ch_mult"] = tuple(arch["ch_mult"])
    return KLConfig(**arch)


def load_vae(path: str, config: KLConfig, device: torch.device | str) -> KLAutoencoder:
    vae = KLAutoencoder(config)
    state = select_entry(read_checkpoint(path), ("model", None), path)
    # kl16.ckpt may carry the training loss's modules (LPIPS / discriminator): known extras, not weights.
    load_strict(vae, ldm_keys_to_llamagen(state, len(config.ch_mult)), path, ignore_prefixes=("loss.",))
    return vae.to(device).eval()


def load(options: MAROptions, device: torch.device | str) -> tuple[MARGenerator, dict[str, Any]]:
    """``(model, metadata)`` as the continuous family's ``load_model`` returns them."""
    config = mar_config(options)
    model = MARGenerator(config)
    state = select_entry(read_checkpoint(options.path), (options.weights,), options.path)
    load_strict(model.net, state, options.path)
    model = model.to(device=device, dtype=DTYPES[options.dtype]).eval()
    vae = load_vae(options.vae, kl_config(options), device) if options.vae is not None else None
    side = config.grid * (2 ** (len(vae.config.ch_mult) - 1) if vae is not None else 1)
    meta = {"image_decoder": KLImageDecoder(vae, config.grid), "size": options.size, "weights": options.weights,
            "image_shape": (side, side, 3)}
    return model, meta
