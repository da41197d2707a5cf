"""The image tokenizers of the releases: LlamaGen's VQ-16 and MAR's KL-16.

Both are taming-transformers convolutional autoencoders (ResNet blocks with GroupNorm(32, eps
1e-6) and swish, single-head spatial attention, stride-2 convolutions with (0, 1, 0, 1) padding
down, nearest-neighbour x2 up). The modules here use LlamaGen's names (``conv_blocks.{k}.res.{j}``,
``.attn.{j}``, ``mid.{0,1,2}``; the decoder's ``conv_blocks.0`` is the lowest resolution);
:func:`ldm_keys_to_llamagen` maps the LDM naming of the KL-16 file (``down.{i}.block.{j}``,
``mid.block_1``, ``decoder.up.{i}`` indexed by level) onto them.

* VQ-16 (``vq_ds16_c2i.pt``): attention at the lowest resolution after every res block, in the
  encoder and the decoder; codebook 16384 x 8, L2-normalised codebook *and* encoder output
  (cosine nearest neighbour); the ``quantize.codebook_used`` buffer is part of the state dict.
* KL-16 (``kl16.ckpt``): attention only in the encoder's lowest level and the mid blocks; the
  encoder outputs mean and log-variance (``quant_conv`` 2z -> 2z); tokens are decoded as
  ``decode(tokens / 0.2325)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

KL_SCALE = 0.2325  # MAR: latents are tokens * 0.2325; decode(tokens / 0.2325)


def _norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.norm1 = _norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1) if in_channels != out_channels else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    """One-head self-attention over the spatial positions (1x1 convolutions for q, k, v, out)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = _norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        y = self.norm(x)
        q, k, v = (t(y).reshape(b, 1, c, h * w).transpose(2, 3) for t in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v).transpose(2, 3).reshape(b, c, h, w)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, stride=2, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Encoder(nn.Module):
    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, out_channels: int,
                 attention_at_lowest: bool = True, in_channels: int = 3) -> None:
        super().__init__()
        levels = len(ch_mult)
        self.conv_in = nn.Conv2d(in_channels, ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level, mult in enumerate(ch_mult):
            stage = nn.Module()
            stage.res = nn.ModuleList()
            stage.attn = nn.ModuleList()
            for _ in range(num_res_blocks):
                stage.res.append(ResnetBlock(block_in, ch * mult))
                block_in = ch * mult
                if attention_at_lowest and level == levels - 1:
                    stage.attn.append(AttnBlock(block_in))
            if level != levels - 1:
                stage.downsample = Downsample(block_in)
            self.conv_blocks.append(stage)
        self.mid = nn.ModuleList([ResnetBlock(block_in, block_in), AttnBlock(block_in), ResnetBlock(block_in, block_in)])
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for stage in self.conv_blocks:
            for i, res in enumerate(stage.res):
                h = res(h)
                if len(stage.attn):
                    h = stage.attn[i](h)
            if hasattr(stage, "downsample"):
                h = stage.downsample(h)
        for block in self.mid:
            h = block(h)
        return self.conv_out(F.silu(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, ch: int, ch_mult: tuple[int, ...], num_res_blocks: int, z_channels: int,
                 attention_at_lowest: bool, out_channels: int = 3) -> None:
        super().__init__()
        levels = len(ch_mult)
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(z_channels, block_in, 3, padding=1)
        self.mid = nn.ModuleList([ResnetBlock(block_in, block_in), AttnBlock(block_in), ResnetBlock(block_in, block_in)])
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(levels)):  # conv_blocks[0] is the lowest resolution
            stage = nn.Module()
            stage.res = nn.ModuleList()
            stage.attn = nn.ModuleList()
            for _ in range(num_res_blocks + 1):
                stage.res.append(ResnetBlock(block_in, ch * ch_mult[level]))
                block_in = ch * ch_mult[level]
                if attention_at_lowest and level == levels - 1:
                    stage.attn.append(AttnBlock(block_in))
            if level != 0:
                stage.upsample = Upsample(block_in)
            self.conv_blocks.append(stage)
        self.norm_out = _norm(block_in)
        self.conv_out = nn.Conv2d(block_in, out_channels, 3, padding=1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        for block in self.mid:
            h = block(h)
        for stage in self.conv_blocks:
            for i, res in enumerate(stage.res):
                h = res(h)
                if len(stage.attn):
                    h = stage.attn[i](h)
            if hasattr(stage, "upsample"):
                h = stage.upsample(h)
        return self.conv_out(F.silu(self.norm_out(h)))


@dataclass(frozen=True)
class VQConfig:
    """LlamaGen's VQ ``ModelArgs`` (``ch`` is a hard-coded 128 there, not an argument)."""

    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    z_channels: int = 256
    ch: int = 128
    ch_mult: tuple[int, ...] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


class VectorQuantizer(nn.Module):
    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(size, dim)
        self.register_buffer("codebook_used", torch.zeros(65536))  # a training statistic, saved in the file

    def codebook(self) -> torch.Tensor:
        """The L2-normalised codebook ``[size, dim]`` (rows are not stored unit-norm)."""
        return F.normalize(self.embedding.weight, p=2, dim=-1)

    def codes(self, z: torch.Tensor) -> torch.Tensor:
        """Nearest codes ``[B, h, w]`` of ``z [B, dim, h, w]`` by cosine similarity."""
        flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, z.shape[1]), p=2, dim=-1)
        book = self.codebook()
        distance = (flat**2).sum(1, keepdim=True) + (book**2).sum(1) - 2 * flat @ book.t()
        return distance.argmin(1).reshape(z.shape[0], z.shape[2], z.shape[3])


class VQModel(nn.Module):
    """LlamaGen's VQ tokenizer: ``encode`` images to codes, ``decode_code`` codes to images in [-1, 1]."""

    def __init__(self, config: VQConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.encoder = Encoder(c.ch, c.ch_mult, c.num_res_blocks, c.z_channels)
        self.decoder = Decoder(c.ch, c.ch_mult, c.num_res_blocks, c.z_channels, attention_at_lowest=True)
        self.quantize = VectorQuantizer(c.codebook_size, c.codebook_embed_dim)
        self.quant_conv = nn.Conv2d(c.z_channels, c.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(c.codebook_embed_dim, c.z_channels, 1)

    def encode(self, images: torch.Tensor) -> torch.Tensor:
        """Codes ``[B, h, w]`` of images ``[B, 3, H, W]`` in [-1, 1]."""
        return self.quantize.codes(self.quant_conv(self.encoder(images)))

    def decode_code(self, codes: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Images ``[B, 3, H, W]`` from codes ``[B, h*w]`` in raster order."""
        z = self.quantize.codebook()[codes.reshape(codes.shape[0], *grid)].permute(0, 3, 1, 2)
        return self.decoder(self.post_quant_conv(z))


@dataclass(frozen=True)
class KLConfig:
    """MAR's ``AutoencoderKL(embed_dim=16, ch_mult=(1, 1, 2, 2, 4))`` (ch 128, 2 res blocks)."""

    embed_dim: int = 16
    ch: int = 128
    ch_mult: tuple[int, ...] = field(default=(1, 1, 2, 2, 4))
    num_res_blocks: int = 2


class KLAutoencoder(nn.Module):
    """MAR's KL-16 VAE: ``decode(latents)`` to images in [-1, 1]; ``encode_mean`` for completeness."""

    def __init__(self, config: KLConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.encoder = Encoder(c.ch, c.ch_mult, c.num_res_blocks, 2 * c.embed_dim, attention_at_lowest=True)
        self.decoder = Decoder(c.ch, c.ch_mult, c.num_res_blocks, c.embed_dim, attention_at_lowest=False)
        self.quant_conv = nn.Conv2d(2 * c.embed_dim, 2 * c.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(c.embed_dim, c.embed_dim, 1)

    def encode_mean(self, images: torch.Tensor) -> torch.Tensor:
        return self.quant_conv(self.encoder(images)).chunk(2, dim=1)[0]

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(latents))


_LDM_MID = {"block_1": "0", "attn_1": "1", "block_2": "2"}


def ldm_keys_to_llamagen(state: dict[str, torch.Tensor], num_levels: int) -> dict[str, torch.Tensor]:
    """Rename an LDM/taming autoencoder state dict (``encoder.down.{i}.block.{j}``, ``mid.block_1``,
    ``decoder.up.{i}`` by level) to the module names above. Other keys pass through unchanged."""
    out = {}
    for key, value in state.items():
        new = re.sub(r"^(encoder|decoder)\.mid\.(block_1|attn_1|block_2)\.",
                     lambda m: f"{m.group(1)}.mid.{_LDM_MID[m.group(2)]}.", key)
        new = re.sub(r"^encoder\.down\.(\d+)\.block\.", r"encoder.conv_blocks.\1.res.", new)
        new = re.sub(r"^encoder\.down\.(\d+)\.", r"encoder.conv_blocks.\1.", new)
        match = re.match(r"^decoder\.up\.(\d+)\.(.*)$", new)
        if match:
            rest = re.sub(r"^block\.", "res.", match.group(2))
            new = f"decoder.conv_blocks.{num_levels - 1 - int(match.group(1))}.{rest}"
        out[new] = value
    return out


def to_uint8_images(x: torch.Tensor, output_size: int | None = None, rounding: str = "llamagen") -> torch.Tensor:
    """Images in [-1, 1] ``[B, 3, H, W]`` -> uint8 ``[B, H', W', 3]`` on CPU.

    ``output_size``: bicubic resize first (LlamaGen evaluates its 384-px models at 256, with
    ``F.interpolate(mode="bicubic")``, no antialias). ``rounding``: ``llamagen`` is
    ``clamp(127.5 x + 128, 0, 255)`` truncated (sample_c2i_ddp.py); ``mar`` is
    ``round(clip((x + 1) / 2) * 255)`` (engine_mar.py).
    """
    x = x.float()
    if output_size is not None and x.shape[-1] != output_size:
        x = F.interpolate(x, size=(output_size, output_size), mode="bicubic")
    if rounding == "llamagen":
        pixels = torch.clamp(127.5 * x + 128.0, 0, 255).to(torch.uint8)
    else:
        pixels = torch.round(torch.clamp((x + 1) / 2, 0, 1) * 255).to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).contiguous().cpu()
