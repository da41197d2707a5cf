"""The diffusion family: a class-conditional DDPM denoiser (diffusers ``UNet2DModel``) and its schedule.

What diffusers provides is used as is: the UNet (per-row timestep vector, class
embedding), ``DDPMScheduler`` for the beta / alpha-bar tables, the strided
timestep sequence and ``add_noise`` during training. What it does not expose is
written here: the affine-Gaussian coefficients ``(A_k, B_k, sigma_k)`` of every
sampling step (spec_diffusion.md section 0/1), which speculative verification
needs, and classifier-free guidance over a ragged batch.

Image convention: 1 channel, 8x8, pixels scaled to [-1, 1]. Class ``num_classes``
is the null class used for classifier-free guidance.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import DDPMScheduler, UNet2DModel
from safetensors import safe_open
from safetensors.torch import load_file

from specray.models.conditioning import TextConditionEmbedding
from specray.models.pair import ModelPair

FAMILY = "diffusion"
SAMPLERS = ("ddpm", "euler_maruyama")


class UNet(UNet2DModel):
    """diffusers' ``UNet2DModel`` whose ``dtype`` is read off its first parameter.

    The forward pass reads ``self.dtype`` twice, and diffusers' property walks every submodule looking
    for a layerwise-casting hook (none here: specray never enables one) before it returns the first
    floating parameter's dtype; for these small UNets that walk cost about a tenth of a call on CPU.
    The same dtype, so the same outputs.
    """

    @property
    def dtype(self) -> torch.dtype:
        return next(p.dtype for p in self.parameters() if p.is_floating_point())


def build_unet(config: dict[str, Any]) -> UNet2DModel:
    """A small class- (or, with ``condition: text``, prompt-) conditional UNet for ``sample_size`` x
    ``sample_size`` grey images."""
    channels = tuple(config["block_out_channels"])
    attention = set(config.get("attention_levels", ()))
    down = tuple("AttnDownBlock2D" if i in attention else "DownBlock2D" for i in range(len(channels)))
    up = tuple(t.replace("Down", "Up") for t in reversed(down))
    unet = UNet(
        sample_size=config["sample_size"],
        in_channels=1,
        out_channels=1,
        block_out_channels=channels,
        down_block_types=down,
        up_block_types=up,
        layers_per_block=config["layers_per_block"],
        norm_num_groups=config["norm_num_groups"],
        num_class_embeds=config["num_classes"] + 1 if config.get("condition", "class") == "class" else 1,
    )  # + null class for CFG
    if config.get("condition", "class") == "text":  # the class slot reads the batch's prompt features
        unet.class_embedding = TextConditionEmbedding(config.get("text_dim", 384), channels[0] * 4, config["num_classes"])
    elif config.get("condition", "class") != "class":
        raise ValueError(f"condition={config['condition']!r}; allowed: class, text")
    return unet


def make_scheduler(config: dict[str, Any]) -> DDPMScheduler:
    return DDPMScheduler(
        num_train_timesteps=config["num_train_timesteps"],
        beta_schedule=config.get("beta_schedule", "linear"),
        clip_sample=False,
        variance_type="fixed_small",
        prediction_type="epsilon",
    )


class Denoiser(torch.nn.Module):
    """Noise prediction ``eps(x_t, t, label)`` with classifier-free guidance.

    ``labels`` may contain ``null_class``; ``guidance_scale == 1`` makes one
    conditional call, otherwise one call on ``2N`` rows (conditional + null).
    """

    def __init__(self, unet: UNet2DModel, num_classes: int) -> None:
        super().__init__()
        self.unet = unet
        self.null_class = num_classes
        self.conditional = unet.config.num_class_embeds is not None  # google/ddpm-* are unconditional

    @torch.no_grad()
    def forward(self, x: torch.Tensor, timesteps: torch.Tensor, labels: torch.Tensor, guidance_scale: float = 1.0) -> torch.Tensor:
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        if not self.conditional:
            if guidance_scale != 1.0:
                raise ValueError(f"guidance_scale={guidance_scale} needs a class-conditional model; this one is "
                                 "unconditional (set guidance_scale: 1.0)")
            return self.unet(x.to(self.unet.dtype), timesteps).sample.to(x.dtype)
        if guidance_scale == 1.0:
            return self.unet(x, timesteps, class_labels=labels).sample
        null = torch.full_like(labels, self.null_class)
        both = self.unet(torch.cat([x, x]), torch.cat([timesteps, timesteps]), class_labels=torch.cat([labels, null])).sample
        cond, uncond = both.chunk(2)
        return uncond + guidance_scale * (cond - uncond)


@dataclass(frozen=True)
class GaussianSteps:
    """Coefficient tables of a K-step sampler: step k maps x at ``timesteps[k]`` to the next state.

    ``x_next = A[k] x + B[k] eps(x, timesteps[k]) + sigma[k] xi`` for k < K-1 (all sigma > 0);
    the last step is deterministic, ``x0_hat = (x - sqrt(1 - abar) eps) / sqrt(abar)``, and is
    run outside speculation (spec section 1.2, "Final step").
    """

    timesteps: torch.Tensor  # int64 [K], diffusion time of the state each step starts from
    A: torch.Tensor  # float64 [K-1]
    B: torch.Tensor  # float64 [K-1]
    sigma: torch.Tensor  # float64 [K-1]
    final_alpha_bar: float  # alpha-bar at timesteps[K-1], for the deterministic final step
    # With x0 clipping (diffusers' clip_sample) the mean is c1 clip(x0_hat) + c2 x, x0_hat = r x - r1 eps,
    # not affine in eps: (c1, c2, r, r1) per step, float64 [K-1]; None without clipping.
    clipped_mean: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_steps(self) -> int:
        return int(self.timesteps.numel())

    @property
    def num_speculative_steps(self) -> int:
        return self.num_steps - 1


def gaussian_steps(scheduler: DDPMScheduler, num_steps: int, sampler: str = "ddpm", churn: float = 1.0) -> GaussianSteps:
    """Coefficients of ``num_steps`` strided steps (diffusers' timestep spacing).

    ``sampler="ddpm"``: DDIM with stochasticity ``eta = churn`` (spec 1.1 b); ``churn = 1``
    is the strided DDPM ancestral step (diffusers ``DDPMScheduler.step`` with ``fixed_small``).
    ``sampler="euler_maruyama"``: Euler-Maruyama on the churn family of reverse SDEs with
    ``epsilon = churn`` (spec 1.1 c); ``churn = 1`` is the usual reverse SDE.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    T = scheduler.config.num_train_timesteps
    if not 2 <= num_steps <= T:
        raise ValueError(f"num_steps must be in [2, {T}], got {num_steps}")
    if not churn > 0:
        raise ValueError(f"churn must be > 0 (a deterministic step cannot be speculated), got {churn}")
    scheduler.set_timesteps(num_steps)
    timesteps = scheduler.timesteps.to(torch.int64).clone()
    abar = scheduler.alphas_cumprod.to(torch.float64)
    betas = scheduler.betas.to(torch.float64)
    t = timesteps[:-1]
    s = timesteps[1:]
    abar_t, abar_s = abar[t], abar[s]
    variance = scheduler.config.variance_type
    if variance not in ("fixed_small", "fixed_large"):
        raise ValueError(f"variance_type {variance!r} is not supported; allowed: 'fixed_small', 'fixed_large'")
    # DDPMScheduler.step's posterior mean c1 x0_hat + c2 x with the strided beta = 1 - abar_t / abar_s.
    beta = 1 - abar_t / abar_s
    c1 = torch.sqrt(abar_s) * beta / (1 - abar_t)
    c2 = torch.sqrt(abar_t / abar_s) * (1 - abar_s) / (1 - abar_t)
    r, r1 = 1 / torch.sqrt(abar_t), torch.sqrt(1 - abar_t) / torch.sqrt(abar_t)
    if sampler == "ddpm" and variance == "fixed_large":
        sigma = churn * torch.sqrt(beta)  # google/ddpm-cifar10-32: variance beta_t, mean unchanged
        A, B = c1 * r + c2, -c1 * r1
    elif sampler == "ddpm":
        sigma = churn * torch.sqrt((1 - abar_s) / (1 - abar_t)) * torch.sqrt(1 - abar_t / abar_s)
        if torch.any(1 - abar_s - sigma**2 < 0):
            raise ValueError(f"churn={churn} too large for the DDIM step (needs sigma^2 <= 1 - abar_s)")
        A = torch.sqrt(abar_s / abar_t)
        B = torch.sqrt(1 - abar_s - sigma**2) - torch.sqrt(abar_s * (1 - abar_t) / abar_t)
    else:
        h = (t - s).to(torch.float64)  # in units of training steps; beta_t is per training step
        beta = betas[t]
        A = 1 + 0.5 * beta * h
        B = -(1 + churn**2) * beta * h / (2 * torch.sqrt(1 - abar_t))
        sigma = churn * torch.sqrt(beta * h)
    clipped = None
    if scheduler.config.clip_sample:
        if sampler != "ddpm" or churn != 1.0:
            raise ValueError("clip_sample models run the DDPM step itself: sampler 'ddpm' with churn 1")
        clipped = (c1, c2, r, r1)
    return GaussianSteps(timesteps=timesteps, A=A, B=B, sigma=sigma, final_alpha_bar=float(abar[timesteps[-1]]),
                         clipped_mean=clipped)


def final_step(x: torch.Tensor, eps: torch.Tensor, alpha_bar: float, clip: bool = True) -> torch.Tensor:
    """Deterministic last step: the predicted clean image, clipped to [-1, 1] (latents: not clipped)."""
    x0 = (x - math.sqrt(1 - alpha_bar) * eps) / math.sqrt(alpha_bar)
    return x0.clamp(-1.0, 1.0) if clip else x0


def to_uint8_image(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] images ``[B, 1, H, W]`` -> uint8 ``[B, H, W]``, ``[B, 3, H, W]`` -> ``[B, H, W, 3]`` (0..255) on CPU.

    ``round((x + 1) * 127.5)`` equals diffusers' ``round((x / 2 + 0.5) * 255)``.
    """
    pixels = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).cpu()
    return pixels[:, 0] if pixels.shape[1] == 1 else pixels.permute(0, 2, 3, 1).contiguous()


def load_denoiser(name_or_path: str | dict, device: torch.device) -> tuple[Denoiser, dict[str, Any]]:
    """Load a preset (by name), a safetensors file written by ``train_preset``, or a ``{format: ...}``
    reference loaded by the family table's loader for that format."""
    from pathlib import Path

    if isinstance(name_or_path, dict):
        from specray.families import load_formatted_model

        return load_formatted_model(FAMILY, name_or_path, device)

    from specray.models.presets import get_preset

    path = Path(name_or_path)
    if path.suffix == ".safetensors":
        if not path.exists():
            raise FileNotFoundError(f"diffusion checkpoint not found: {path}")
        with safe_open(str(path), framework="pt") as f:
            config = json.loads(f.metadata()["config"])
    else:
        preset = get_preset(name_or_path)
        if preset.family != FAMILY:
            raise ValueError(f"preset {name_or_path!r} is of family {preset.family!r}, not {FAMILY!r}")
        config = dict(preset.config)
        path = preset.weights_path
        if not path.exists():
            raise FileNotFoundError(f"weights of preset {name_or_path!r} missing at {path}; run `specray train {name_or_path}`")
    unet = build_unet(config)
    state = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
    unet.load_state_dict(state)
    model = Denoiser(unet, config["num_classes"]).to(device).eval()
    return model, config


def load_pair(target: str | dict, draft: str | dict | None, device: torch.device | str) -> ModelPair:
    """Target denoiser plus an optional independent draft denoiser (same schedule and classes)."""
    from specray.models.refs import ref_key

    device = torch.device(device)
    target_model, config = load_denoiser(target, device)
    draft_model = None
    if draft is not None:
        draft_model, draft_config = load_denoiser(draft, device)
        for key in ("num_train_timesteps", "beta_schedule", "num_classes", "sample_size", "channels",
                    "variance_type", "clip_sample"):
            if draft_config.get(key) != config.get(key):
                raise ValueError(f"draft {draft!r} differs from target {target!r} in {key}: {draft_config.get(key)} vs {config.get(key)}")
    info = {
        "image_shape": (config.get("channels", 1), config["sample_size"], config["sample_size"]),
        "num_classes": config["num_classes"],
        # A release brings its own scheduler (DDPMScheduler with its config); the presets build theirs.
        "scheduler": config["scheduler"] if "scheduler" in config else make_scheduler(config),
        "image_decoder": config.get("image_decoder"),  # latent models: latents -> uint8 images
    }
    return ModelPair(FAMILY, ref_key(target), ref_key(draft), target_model, draft_model, device, info)
