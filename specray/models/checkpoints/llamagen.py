"""LlamaGen class-conditional GPTs (``c2i_*.pt``) and the VQ-16 tokenizer (``vq_ds16_c2i.pt``).

The GPT is :class:`specray.models.discrete_ar.DiscreteGPT`, whose module names are LlamaGen's, so
the release's keys map one to one. What the release format adds (spec checkpoints.md):

* B / L / XL files are ``{"model": state_dict}`` (training checkpoints may also hold ``ema``,
  ``optimizer``, ``steps``, ``args``; the official sampler uses ``model``, and so does this loader);
  XXL and 3B are bare consolidated FSDP state dicts; deepspeed ``module`` / ``state_dict`` wrappers
  and the HF mixin's ``.safetensors`` are read too, in the official sampler's order.
* 1001 class rows (row 1000 is the null class), ``cls_token_num`` 1, 2-D RoPE with the class
  token's entry zero, head_dim 100 for GPT-3B, ``multiple_of`` 256, no biases, untied output.
* The VQ file is ``{"model": state_dict}`` including the ``quantize.codebook_used`` buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from specray.models.checkpoints.autoencoders import VQConfig, VQModel, to_uint8_images
from specray.models.checkpoints.options import LLAMAGEN_SIZES, LlamaGenOptions
from specray.models.checkpoints.reading import DTYPES, load_strict, read_checkpoint, select_entry
from specray.models.discrete_ar import DiscreteGPT, GPTConfig

GPT_ENTRIES = (None, "model", "module", "state_dict")  # FSDP (the file itself), DDP, deepspeed, other


def gpt_config(options: LlamaGenOptions, vq: VQConfig, **condition: Any) -> GPTConfig:
    """The GPT of a release: its size's architecture (or ``arch``) over the tokenizer's grid;
    ``condition``: the conditioning fields of a text-to-image release (the default is c2i's)."""
    arch = dict(options.arch or LLAMAGEN_SIZES[options.size])
    if options.image_size % vq.downsample:
        raise ValueError(f"image_size {options.image_size} is not a multiple of the tokenizer's "
                         f"downsampling {vq.downsample}")
    fields = {"vocab_size": vq.codebook_size, "num_classes": 1000, "multiple_of": 256, **condition,
              **{k: int(v) for k, v in arch.items()}}
    return GPTConfig(grid_size=options.image_size // vq.downsample, class_dropout_prob=0.1, norm_eps=1e-5,
                     rope_base=10000.0, **fields)


def vq_config(options: LlamaGenOptions) -> VQConfig:
    arch = dict(options.tokenizer_arch or {})
    if "ch_mult" in arch:
        arch["ch_mult"] = tuple(arch["ch_mult"])
    allowed = {f.name for f in fields(VQConfig)}
    return VQConfig(**{k: v for k, v in arch.items() if k in allowed})


def read_gpt_state(path: str | Path) -> dict[str, torch.Tensor]:
    obj = read_checkpoint(path)
    if isinstance(obj, dict) and "model" not in obj and any(k.startswith(("layers.", "_orig_mod.")) for k in obj):
        return select_entry(obj, (None,), path)
    return select_entry(obj, GPT_ENTRIES[1:] + (None,), path)


def load_gpt(options: LlamaGenOptions, vq: VQConfig, device: torch.device | str, **condition: Any) -> DiscreteGPT:
    model = DiscreteGPT(gpt_config(options, vq, **condition))
    load_strict(model, read_gpt_state(options.path), options.path)
    return model.to(device=device, dtype=DTYPES[options.dtype]).eval()


def load_vq(path: str | Path, config: VQConfig, device: torch.device | str) -> VQModel:
    model = VQModel(config)
    state = select_entry(read_checkpoint(path), ("model", None), path)
    load_strict(model, state, path)
    return model.to(device).eval()


@dataclass
class VQImageDecoder:
    """Tokens ``[B, h*w]`` -> uint8 RGB ``[B, S, S, 3]`` through the VQ decoder (float32), resized to
    ``output_size`` as LlamaGen's FID sampler does."""

    vq: VQModel
    grid: tuple[int, int]
    output_size: int | None

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        images = self.vq.decode_code(tokens.to(self.vq.post_quant_conv.weight.device), self.grid)
        return to_uint8_images(images, self.output_size, rounding="llamagen")

    def codebook(self) -> torch.Tensor:
        return self.vq.quantize.codebook().detach()


@dataclass
class LlamaGenModel:
    """What the discrete family's ``load_pair`` receives for a ``llamagen-c2i`` reference."""

    gpt: DiscreteGPT
    decoder: VQImageDecoder | None
    info: dict[str, Any]


def load(options: LlamaGenOptions, device: torch.device | str, **condition: Any) -> LlamaGenModel:
    """A release's GPT (``condition``: as :func:`gpt_config`) and, when named, its VQ tokenizer."""
    vq_cfg = vq_config(options)
    gpt = load_gpt(options, vq_cfg, device, **condition)
    decoder = None
    if options.tokenizer is not None:
        vq = load_vq(options.tokenizer, vq_cfg, device)
        if vq_cfg.codebook_size != gpt.config.vocab_size:
            raise ValueError(f"tokenizer codebook {vq_cfg.codebook_size} != GPT vocab {gpt.config.vocab_size}")
        grid = (gpt.config.grid_size, gpt.config.grid_size)
        decoder = VQImageDecoder(vq, grid, options.output_size)
    info = {"tokenizer": "vq" if decoder is not None else "none", "size": options.size,
            "image_size": options.image_size, "dtype": options.dtype}
    return LlamaGenModel(gpt, decoder, info)
