"""Per-token diffusion head sampling (MAR's DiffLoss head, IDDPM conventions).

A token is sampled by a short ancestral DDPM chain on a respaced cosine
schedule (``specray.models.continuous_schedule``). The network only supplies ε̂
(and, with learned variance, the interpolation fraction f of IDDPM's "learned
range"); CFG and temperature enter here. The same chain serves target-only
sampling, CSpD and the toy heads with exact scores in the tests.

Step indexing: respaced steps ``i = T-1 … 0``; ``i = 0`` is the spec's t = 1,
the final step, which MAR samples deterministically (x_0 = μ_1). Noise for step
``i`` is ``noise[:, i]``; ``noise[:, 0]`` is only read when the final step is
given its noise (CSpD exact mode).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from specray.models.continuous_schedule import DiffusionSchedule

# eps_fn(x_t, i) -> (ε̂, f) where f is the learned-range fraction in [0, 1] or None (fixed small variance).
EpsFn = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class ChainOutput:
    """Result of one head chain per slot, what CSpD needs to verify it.

    ``x0``: the token; ``mu1``/``s1``: mean and std (τ·σ_1) of the final step;
    ``slog``: Σ_{i≥1} Σ_k log σ_{i,k} over the stochastic steps (float64).
    """

    x0: torch.Tensor
    mu1: torch.Tensor
    s1: torch.Tensor
    slog: torch.Tensor


def run_chain(
    eps_fn: EpsFn,
    schedule: DiffusionSchedule,
    x_T: torch.Tensor,
    noise: torch.Tensor,
    tau: float = 1.0,
    final_step_noise: bool = False,
    clip_x0: float | None = None,
) -> ChainOutput:
    """Ancestral sampling x_{i-1} = μ + τ·σ ⊙ noise[:, i] from x_T [n, d].

    ``noise`` is [n, T, d]. The initial x_T is not scaled by τ (MAR). With
    ``final_step_noise`` the last step adds τ·σ_1 ⊙ noise[:, 0]; otherwise x_0 = μ_1.
    ``clip_x0`` clamps x̂0 inside every mean (the transitions stay Gaussian, so
    CSpD's densities are unchanged in form). The first respaced step jumps from
    ᾱ ≈ 1e-8 to ᾱ ≈ 1e-3, multiplying ε̂ errors by ~300 in μ; MAR's large heads
    learn ε̂ ≈ x_t well enough there, small heads on bounded pixel tokens need
    the clamp.
    """
    n_steps = schedule.num_steps
    if noise.shape[-2] != n_steps:
        raise ValueError(f"noise must have {n_steps} steps on dim -2, got shape {tuple(noise.shape)}")
    x = x_T
    slog = torch.zeros(x.shape[:-1], dtype=torch.float64, device=x.device)
    for i in range(n_steps - 1, 0, -1):
        eps, frac = eps_fn(x, i)
        mean, logvar = schedule.transition(x, i, eps, frac, clip_x0)
        slog = slog + 0.5 * logvar.to(torch.float64).sum(-1)
        x = mean + tau * torch.exp(0.5 * logvar) * noise[..., i, :]
    eps, frac = eps_fn(x, 0)
    mu1, logvar1 = schedule.transition(x, 0, eps, frac, clip_x0)
    s1 = tau * torch.exp(0.5 * logvar1)
    x0 = mu1 + s1 * noise[..., 0, :] if final_step_noise else mu1
    return ChainOutput(x0=x0, mu1=mu1, s1=s1, slog=slog)


def guided_eps_fn(
    model: torch.nn.Module,
    schedule: DiffusionSchedule,
    z_cond: torch.Tensor,
    z_uncond: torch.Tensor | None,
    cfg_scale: torch.Tensor | float = 1.0,
) -> EpsFn:
    """ε̂ of a continuous_ar head with classifier-free guidance inside the head.

    Guided ε = ε_u + w·(ε_c − ε_u) (w per slot, ``[n, 1]`` or a float); the
    variance is the conditional branch's learned variance (MAR). Both branches
    are evaluated at the same state x_t, so the guided step is a Gaussian
    kernel of the state (MAR runs the unconditional half on its own, slightly
    different state; we keep one state so the chain is a Markov chain and the
    CSpD densities are exactly the sampler's).
    """
    timesteps = schedule.timesteps.to(z_cond.device)
    n = z_cond.shape[0]

    def eps_fn(x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = timesteps[i].expand(n)
        if z_uncond is None:
            return model.head_output(x, t, z_cond)
        eps, frac = model.head_output(torch.cat([x, x]), torch.cat([t, t]), torch.cat([z_cond, z_uncond]))
        eps_c, eps_u = eps[:n], eps[n:]
        return eps_u + cfg_scale * (eps_c - eps_u), None if frac is None else frac[:n]

    return eps_fn
