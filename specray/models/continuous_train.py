"""Training of the built-in continuous presets (`specray train digits-mar-*`).

The loss is MAR's diffusion loss on each token given its z, IDDPM "hybrid":
ε-prediction MSE plus, with learned variance, the variational bound term with
the mean stopped (KL to the true posterior for t > 0, Gaussian NLL of x_0 at
t = 0). Each image gets a random generation order (raster order a quarter of
the time) so one network serves both orders. Deterministic for a given seed on
CPU with one thread.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from specray.models.continuous_ar import ContinuousAR, ContinuousARConfig, levels_to_tokens, parameter_count
from specray.models.continuous_schedule import DiffusionSchedule
from specray.models.digits import load_digits_split
from specray.models.presets import get_preset
from specray.models.weights import save_fp16

DEFAULT_TRAIN = {
    "steps": 3000,
    "batch_size": 64,
    "lr": 1e-3,
    "weight_decay": 0.01,
    "warmup_steps": 100,
    "diffusion_batch_mul": 4,
    "raster_fraction": 0.25,
}


def diffusion_loss(
    model: ContinuousAR,
    schedule: DiffusionSchedule,
    x0: torch.Tensor,
    z: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Per-token diffusion loss; ``x0 [n, d]``, ``z [n, C]``."""
    n = x0.shape[0]
    t = torch.randint(0, schedule.num_steps, (n,), generator=generator, device=x0.device)
    noise = torch.randn(x0.shape, generator=generator, device=x0.device)
    x_t = schedule.q_sample(x0, t, noise)
    eps, frac = model.head_output(x_t, schedule.timesteps.to(x0.device)[t], z)
    loss = ((eps - noise) ** 2).mean(-1)
    if frac is not None:
        # variational bound with the mean frozen: trains the variance only (IDDPM hybrid loss)
        mean_model = schedule.posterior_mean(schedule.predict_x0(x_t, t, eps.detach()), x_t, t)
        logvar_model = schedule.model_log_variance(t, frac, x_t)
        mean_true = schedule.posterior_mean(x0, x_t, t)
        logvar_true = schedule.posterior_log_variance_clipped.to(x0.device)[t].to(x0.dtype).unsqueeze(-1)
        kl = 0.5 * (-1.0 + logvar_model - logvar_true + torch.exp(logvar_true - logvar_model)
                    + (mean_true - mean_model) ** 2 * torch.exp(-logvar_model))
        nll = 0.5 * (math.log(2 * math.pi) + logvar_model + (x0 - mean_model) ** 2 * torch.exp(-logvar_model))
        vb = torch.where((t == 0).unsqueeze(-1), nll, kl).mean(-1) / math.log(2.0)
        loss = loss + vb
    return loss.mean()


def batch_loss(
    model: ContinuousAR,
    schedule: DiffusionSchedule,
    tokens: torch.Tensor,
    labels: torch.Tensor,
    raster_fraction: float,
    diffusion_batch_mul: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    b, n, d = tokens.shape
    order = torch.argsort(torch.rand(b, n, generator=generator), dim=1)
    raster = torch.rand(b, generator=generator) < raster_fraction
    order[raster] = torch.arange(n)
    z = model.forward_train(tokens, order, labels)
    in_order = torch.gather(tokens, 1, order.unsqueeze(-1).expand(-1, -1, d))
    x0 = in_order.reshape(b * n, d).repeat(diffusion_batch_mul, 1)
    zz = z.reshape(b * n, -1).repeat(diffusion_batch_mul, 1)
    return diffusion_loss(model, schedule, x0, zz, generator)


@torch.no_grad()
def heldout_loss(model: ContinuousAR, schedule: DiffusionSchedule, seed: int, repeats: int = 4) -> float:
    images, labels = load_digits_split("heldout")
    tokens = levels_to_tokens(images)
    if model.config.condition == "text":  # each image's first caption
        from specray.models.text_training import caption_bank

        labels = caption_bank("heldout").conditions(model, torch.arange(labels.shape[0]))
    gen = torch.Generator().manual_seed(seed + 12345)
    model.eval()
    losses = [float(batch_loss(model, schedule, tokens, labels, 0.25, 4, gen)) for _ in range(repeats)]
    model.train()
    return sum(losses) / len(losses)


def train_preset(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Train preset ``name`` deterministically and write ``<out_dir>/<name>.safetensors`` (fp16)."""
    
    preset = get_preset(name)
    if preset.family != "continuous_ar":
        raise ValueError(f"preset {name!r} is family {preset.family!r}, not 'continuous_ar'")
    config = ContinuousARConfig.from_dict(preset.config)
    hp = {**DEFAULT_TRAIN, **preset.train}
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = ContinuousAR(config)
    schedule = DiffusionSchedule.cosine(config.diffusion_train_steps)
    images, labels = load_digits_split("train")
    tokens = levels_to_tokens(images)
    if config.condition == "text":  # captions in the place of labels (the class path draws nothing more)
        from specray.models.text_training import caption_bank

        bank = caption_bank("train")
        conditions = lambda idx: bank.conditions(model, idx, gen)  # noqa: E731
    else:
        conditions = lambda idx: labels[idx].clone()  # noqa: E731
    opt = torch.optim.AdamW(model.parameters(), lr=hp["lr"], weight_decay=hp["weight_decay"], betas=(0.9, 0.98))
    steps, warmup = int(hp["steps"]), int(hp["warmup_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    start = time.time()
    recent: list[float] = []
    for step in range(steps):
        idx = torch.randint(0, tokens.shape[0], (int(hp["batch_size"]),), generator=gen)
        y = conditions(idx)
        drop = torch.rand(y.shape, generator=gen) < config.class_dropout_prob
        y[drop] = config.num_classes  # null class for CFG
        loss = batch_loss(model, schedule, tokens[idx], y, hp["raster_fraction"], hp["diffusion_batch_mul"], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        recent = (recent + [loss.item()])[-200:]
        if step % 500 == 0 or step == steps - 1:
            print(f"[{name}] step {step} loss {sum(recent) / len(recent):.4f} ({time.time() - start:.0f}s)", flush=True)
    held = heldout_loss(model, schedule, seed)
    metadata = {
        "name": name,
        "family": "continuous_ar",
        "config": json.dumps(preset.config, sort_keys=True),
        "train": json.dumps(hp, sort_keys=True),
        "seed": str(seed),
        "steps": str(steps),
        "train_loss": f"{sum(recent) / len(recent):.5f}",
        "heldout_loss": f"{held:.5f}",
        "parameters": str(parameter_count(model)),
        "train_seconds": f"{time.time() - start:.1f}",
    }
    path = save_fp16(model, Path(out_dir) / f"{name}.safetensors", metadata)
    print(f"[{name}] wrote {path}: {metadata}", flush=True)
    return path
