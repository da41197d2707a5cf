"""The per-token diffusion schedule of the continuous family (IDDPM conventions).

Cosine betas over 1000 training steps, respaced evenly for sampling, with the
posterior quantities the DDPM mean and IDDPM's learned-range variance need.
Used by training (models layer) and by the samplers in
``specray.methods.diffusion_head``; all arithmetic is float64.

Step indexing: respaced index ``i = T-1 … 0``; ``i = 0`` is the final step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def cosine_betas(num_steps: int = 1000, max_beta: float = 0.999) -> torch.Tensor:
    """IDDPM's cosine schedule, float64."""

    def alpha_bar(t: float) -> float:
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [min(1 - alpha_bar((i + 1) / num_steps) / alpha_bar(i / num_steps), max_beta) for i in range(num_steps)]
    return torch.tensor(betas, dtype=torch.float64)


def respaced_timesteps(num_train_steps: int, num_sample_steps: int) -> list[int]:
    """Evenly strided subset of the training steps (IDDPM ``space_timesteps(N, "K")``)."""
    if not 1 <= num_sample_steps <= num_train_steps:
        raise ValueError(f"num_sample_steps must be in [1, {num_train_steps}], got {num_sample_steps}")
    if num_sample_steps == 1:
        return [0]
    stride = (num_train_steps - 1) / (num_sample_steps - 1)
    return sorted({round(i * stride) for i in range(num_sample_steps)})


@dataclass
class DiffusionSchedule:
    """A (possibly respaced) DDPM schedule with IDDPM's posterior quantities, float64."""

    timesteps: torch.Tensor  # original training timestep of each respaced index (model input)
    betas: torch.Tensor
    alphas_cumprod: torch.Tensor
    alphas_cumprod_prev: torch.Tensor
    posterior_log_variance_clipped: torch.Tensor
    posterior_mean_coef1: torch.Tensor
    posterior_mean_coef2: torch.Tensor

    @property
    def num_steps(self) -> int:
        return int(self.betas.shape[0])

    @classmethod
    def cosine(cls, num_train_steps: int = 1000, num_sample_steps: int | None = None) -> "DiffusionSchedule":
        base = cosine_betas(num_train_steps)
        used = respaced_timesteps(num_train_steps, num_sample_steps or num_train_steps)
        base_ac = torch.cumprod(1.0 - base, dim=0)
        betas, last = [], 1.0
        for t in used:
            betas.append(1.0 - float(base_ac[t]) / last)
            last = float(base_ac[t])
        return cls.from_betas(torch.tensor(betas, dtype=torch.float64), torch.tensor(used, dtype=torch.int64))

    @classmethod
    def from_betas(cls, betas: torch.Tensor, timesteps: torch.Tensor) -> "DiffusionSchedule":
        ac = torch.cumprod(1.0 - betas, dim=0)
        ac_prev = torch.cat([torch.ones(1, dtype=torch.float64), ac[:-1]])
        post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
        post_var_clipped = torch.cat([post_var[1:2], post_var[1:]]) if len(betas) > 1 else post_var.clamp(min=1e-20)
        return cls(
            timesteps=timesteps,
            betas=betas,
            alphas_cumprod=ac,
            alphas_cumprod_prev=ac_prev,
            posterior_log_variance_clipped=torch.log(post_var_clipped),
            posterior_mean_coef1=betas * torch.sqrt(ac_prev) / (1.0 - ac),
            posterior_mean_coef2=(1.0 - ac_prev) * torch.sqrt(1.0 - betas) / (1.0 - ac),
        )

    # -- training-time quantities --------------------------------------------------------------
    def q_sample(self, x0: torch.Tensor, i: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        ac = self.alphas_cumprod.to(x0.device)[i].to(x0.dtype).unsqueeze(-1)
        return torch.sqrt(ac) * x0 + torch.sqrt(1.0 - ac) * noise

    def posterior_mean(self, x0: torch.Tensor, x_t: torch.Tensor, i: torch.Tensor | int) -> torch.Tensor:
        c1 = _take(self.posterior_mean_coef1, i, x_t)
        c2 = _take(self.posterior_mean_coef2, i, x_t)
        return c1 * x0 + c2 * x_t

    def predict_x0(self, x_t: torch.Tensor, i: torch.Tensor | int, eps: torch.Tensor) -> torch.Tensor:
        ac = _take(self.alphas_cumprod, i, x_t)
        return torch.sqrt(1.0 / ac) * x_t - torch.sqrt(1.0 / ac - 1.0) * eps

    def model_log_variance(self, i: torch.Tensor | int, frac: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
        """IDDPM learned range: f·log β + (1−f)·log β̃ (β̃ clipped); fixed small variance if f is None."""
        min_log = _take(self.posterior_log_variance_clipped, i, like)
        if frac is None:
            return min_log.expand_as(like)
        max_log = _take(torch.log(self.betas), i, like)
        return frac * max_log + (1.0 - frac) * min_log

    def transition(
        self, x_t: torch.Tensor, i: int, eps: torch.Tensor, frac: torch.Tensor | None, clip_x0: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log-variance of p(x_{i-1} | x_i) for ε̂; x̂0 clamped to ±clip_x0 if given (MAR: no clipping)."""
        x0 = self.predict_x0(x_t, i, eps)
        if clip_x0 is not None:
            x0 = x0.clamp(-clip_x0, clip_x0)
        return self.posterior_mean(x0, x_t, i), self.model_log_variance(i, frac, x_t)


def _take(values: torch.Tensor, i: torch.Tensor | int, like: torch.Tensor) -> torch.Tensor:
    if isinstance(i, int):
        return values[i].to(device=like.device, dtype=like.dtype)
    return values.to(like.device)[i].to(like.dtype).unsqueeze(-1)


