"""diffusers release folders: pixel DDPMs (``UNet2DModel`` + ``DDPMScheduler``, google/ddpm-*).

The UNet and the scheduler are diffusers' own classes, built from the folder's ``config.json`` and
``scheduler_config.json``; the weights are read safely (``diffusion_pytorch_model.safetensors``, or
the ``.bin`` pickle with ``weights_only=True``) and matched strictly, after renaming the legacy
attention keys of early hub files (``query`` / ``key`` / ``value`` / ``proj_attn`` ->
``to_q`` / ``to_k`` / ``to_v`` / ``to_out.0``, what diffusers does on load). Early scheduler
configs (``"timesteps": 1000``, class ``GaussianDDPMScheduler``) are read too. The variance type
(``fixed_large`` for CIFAR-10, ``fixed_small`` for the 256-px models) and ``clip_sample`` are the
scheduler's: the diffusion family's steps follow them (``specray.models.diffusion.gaussian_steps``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from specray.models.checkpoints.options import DDPMOptions, weights_in
from specray.models.checkpoints.reading import DTYPES, load_strict, read_checkpoint, select_entry

_LEGACY_ATTENTION = {"query": "to_q", "key": "to_k", "value": "to_v", "proj_attn": "to_out.0"}
# Keys of early scheduler configs: renamed, or dropped (bookkeeping of old diffusers versions).
_SCHEDULER_RENAMES = {"timesteps": "num_train_timesteps"}
_SCHEDULER_DROPPED = ("tensor_format",)


def rename_legacy_attention(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    pattern = re.compile(r"^(.*\.attentions\.\d+)\.(query|key|value|proj_attn)\.(weight|bias)$")
    out = {}
    for key, value in state.items():
        match = pattern.match(key)
        out[f"{match.group(1)}.{_LEGACY_ATTENTION[match.group(2)]}.{match.group(3)}" if match else key] = value
    return out


def read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not a readable JSON config ({exc})") from None


def ddpm_scheduler(folder: Path):
    from diffusers import DDPMScheduler

    raw = read_json(folder / "scheduler_config.json")
    config = {_SCHEDULER_RENAMES.get(k, k): v for k, v in raw.items()
              if not k.startswith("_") and k not in _SCHEDULER_DROPPED}
    return DDPMScheduler.from_config(config)


def load_unet(folder: Path, dtype: str, device: torch.device | str):
    from specray.models.diffusion import UNet  # diffusers' UNet2DModel, with a cheaper dtype

    config = {k: v for k, v in read_json(folder / "config.json").items() if not k.startswith("_")}
    unet = UNet.from_config(config)
    weights = weights_in(folder, "diffusion_pytorch_model")
    if weights is None:
        raise FileNotFoundError(f"{folder}: no diffusion_pytorch_model.safetensors or .bin")
    state = rename_legacy_attention(select_entry(read_checkpoint(weights), (None,), weights))
    load_strict(unet, state, weights)
    return unet.to(device=device, dtype=DTYPES[dtype]).eval()


def load_ddpm(options: DDPMOptions, device: torch.device | str):
    """``(Denoiser, config)`` as the diffusion family's ``load_denoiser`` returns them."""
    from specray.models.diffusion import Denoiser

    folder = Path(options.path).expanduser()
    unet = load_unet(folder, options.dtype, device)
    scheduler = ddpm_scheduler(folder)
    num_classes = int(unet.config.num_class_embeds or 1)
    config = {
        "num_classes": num_classes, "sample_size": int(unet.config.sample_size),
        "channels": int(unet.config.in_channels),
        "num_train_timesteps": int(scheduler.config.num_train_timesteps),
        "beta_schedule": scheduler.config.beta_schedule, "variance_type": scheduler.config.variance_type,
        "clip_sample": bool(scheduler.config.clip_sample), "scheduler": scheduler,
    }
    return Denoiser(unet, num_classes).to(device).eval(), config


# ---- latent DiT (facebook/DiT-XL-2-256 as diffusers saves it) --------------------------------------


class DiTDenoiser(torch.nn.Module):
    """eps of a diffusers ``DiTTransformer2DModel`` with classifier-free guidance, as ``DiTPipeline``
    runs it: the batch is doubled with the null class (index ``num_classes``), all latent channels are
    guided, and the learned-variance channels are dropped (the speculative rules need one fixed
    variance per step for target and draft; DiT's own sample.py uses the learned range instead)."""

    def __init__(self, transformer, num_classes: int) -> None:
        super().__init__()
        self.transformer = transformer
        self.null_class = num_classes
        self.channels = int(transformer.config.in_channels)

    def _eps(self, x: torch.Tensor, t: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        out = self.transformer(x.to(self.transformer.dtype), timestep=t, class_labels=labels).sample
        return out[:, : self.channels].to(x.dtype)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, labels: torch.Tensor,
                guidance_scale: float = 1.0) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if guidance_scale == 1.0:
            return self._eps(x, timesteps, labels)
        both = self._eps(torch.cat([x, x]), torch.cat([timesteps, timesteps]),
                         torch.cat([labels, torch.full_like(labels, self.null_class)]))
        cond, uncond = both.chunk(2)
        return uncond + guidance_scale * (cond - uncond)


class LatentImageDecoder:
    """Latents -> uint8 RGB through the pipeline's ``AutoencoderKL``: ``decode(latents / scaling_factor)``,
    then ``round(clamp(x / 2 + 0.5, 0, 1) * 255)`` (DiTPipeline + PIL)."""

    def __init__(self, vae) -> None:
        self.vae = vae

    @torch.inference_mode()
    def __call__(self, latents: torch.Tensor) -> torch.Tensor:
        images = self.vae.decode(latents.to(self.vae.dtype) / self.vae.config.scaling_factor).sample.float()
        pixels = torch.round((images / 2 + 0.5).clamp(0, 1) * 255).to(torch.uint8)
        return pixels.permute(0, 2, 3, 1).contiguous().cpu()


def _diffusers_model(cls, folder: Path, dtype: str, device: torch.device | str):
    config = {k: v for k, v in read_json(folder / "config.json").items() if not k.startswith("_")}
    model = cls.from_config(config)
    weights = weights_in(folder, "diffusion_pytorch_model")
    if weights is None:
        raise FileNotFoundError(f"{folder}: no diffusion_pytorch_model.safetensors or .bin")
    load_strict(model, select_entry(read_checkpoint(weights), (None,), weights), weights)
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def load_dit(options, device: torch.device | str):
    """``(DiTDenoiser, config)`` for the diffusion family: latents, DDPM steps, the VAE as image decoder."""
    from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel

    folder = Path(options.path).expanduser()
    transformer = _diffusers_model(DiTTransformer2DModel, folder / "transformer", options.dtype, device)
    vae = _diffusers_model(AutoencoderKL, folder / "vae", "float32", device)  # decode in float32
    raw = read_json(folder / "scheduler" / "scheduler_config.json")
    keep = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule")
    # Whatever sampler class the folder names, its betas define DDPM steps; latents are not clipped and
    # the step variance is the fixed posterior one (the learned channels are dropped, as DiTPipeline does).
    scheduler = DDPMScheduler(**{k: raw[k] for k in keep if k in raw}, clip_sample=False, variance_type="fixed_small")
    num_classes = int(transformer.config.num_embeds_ada_norm)
    config = {
        "num_classes": num_classes, "sample_size": int(transformer.config.sample_size),
        "channels": int(transformer.config.in_channels),
        "num_train_timesteps": int(scheduler.config.num_train_timesteps),
        "beta_schedule": scheduler.config.beta_schedule, "variance_type": "fixed_small", "clip_sample": False,
        "scheduler": scheduler, "image_decoder": LatentImageDecoder(vae),
    }
    return DiTDenoiser(transformer, num_classes).to(device).eval(), config
