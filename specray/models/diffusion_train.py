"""Training the built-in DDPM presets on the digits data (deterministic given the seed).

Standard epsilon-prediction DDPM loss with diffusers' ``DDPMScheduler.add_noise``,
label dropout to the null class (for classifier-free guidance), AdamW with a
cosine schedule and an EMA of the weights (diffusers ``EMAModel``). The EMA
weights are written as fp16 safetensors with the training record in the
metadata (config, seed, steps, final train loss, held-out loss).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from diffusers.optimization import get_cosine_schedule_with_warmup
from diffusers.training_utils import EMAModel

from specray.models.diffusion import FAMILY, build_unet, make_scheduler
from specray.models.digits import NUM_LEVELS, load_digits_split
from specray.models.weights import save_fp16


def digits_to_unit_range(levels: torch.Tensor) -> torch.Tensor:
    """uint8 levels 0..16 ``[N, 8, 8]`` -> float ``[N, 1, 8, 8]`` in [-1, 1]."""
    return (levels.to(torch.float32) / (NUM_LEVELS - 1) * 2 - 1).unsqueeze(1)


@torch.no_grad()
def heldout_loss(unet, scheduler, images: torch.Tensor, labels: torch.Tensor, passes: int = 8, seed: int = 1234) -> float:
    """Mean epsilon-MSE on held-out images with fixed timesteps and noise."""
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(passes):
        t = torch.randint(0, scheduler.config.num_train_timesteps, (images.shape[0],), generator=gen)
        noise = torch.randn(images.shape, generator=gen)
        pred = unet(scheduler.add_noise(images, noise, t), t, class_labels=labels).sample
        total += torch.mean((pred - noise) ** 2).item()
    return total / passes


def train_preset(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Train preset ``name`` and write ``out_dir/<name>.safetensors``; returns the path."""
    from specray.models.presets import get_preset

    preset = get_preset(name)
    if preset.family != FAMILY:
        raise ValueError(f"preset {name!r} is of family {preset.family!r}; this trainer handles {FAMILY!r}")
    config, hp = dict(preset.config), dict(preset.train)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)

    train_x, train_y = load_digits_split("train")
    held_x, held_y = load_digits_split("heldout")
    train_x, held_x = digits_to_unit_range(train_x), digits_to_unit_range(held_x)

    unet = build_unet(config)
    if config.get("condition", "class") == "text":  # captions in the place of labels
        from specray.models.text_training import caption_bank

        bank, held_bank = caption_bank("train"), caption_bank("heldout")
        conditions = lambda idx: bank.conditions(unet, idx, gen)  # noqa: E731
        held_y = held_bank.conditions(unet, torch.arange(held_y.shape[0]))
    else:
        conditions = lambda idx: train_y[idx].clone()  # noqa: E731
    scheduler = make_scheduler(config)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=hp["lr"], weight_decay=0.0)
    lr_schedule = get_cosine_schedule_with_warmup(optimizer, hp["warmup"], hp["steps"])
    ema = EMAModel(unet.parameters(), decay=hp["ema_decay"])
    null_class = config["num_classes"]
    T = config["num_train_timesteps"]

    start = time.time()
    recent: list[float] = []
    unet.train()
    for step in range(hp["steps"]):
        idx = torch.randint(0, train_x.shape[0], (hp["batch_size"],), generator=gen)
        x0, y = train_x[idx], conditions(idx)
        y[torch.rand(y.shape, generator=gen) < hp["label_dropout"]] = null_class
        t = torch.randint(0, T, (x0.shape[0],), generator=gen)
        noise = torch.randn(x0.shape, generator=gen)
        pred = unet(scheduler.add_noise(x0, noise, t), t, class_labels=y).sample
        loss = torch.mean((pred - noise) ** 2)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        lr_schedule.step()
        ema.step(unet.parameters())
        recent = (recent + [loss.item()])[-100:]
        if step % 250 == 0:
            print(f"[{name}] step {step} loss {loss.item():.4f} ({time.time() - start:.0f}s)", flush=True)

    unet.eval()
    if config.get("condition", "class") == "text":  # the held-out captions, for the held-out loss
        held_bank.conditions(unet, torch.arange(held_y.shape[0]))
    raw_heldout = heldout_loss(unet, scheduler, held_x, held_y)
    ema.copy_to(unet.parameters())
    ema_heldout = heldout_loss(unet, scheduler, held_x, held_y)
    metadata = {
        "config": json.dumps(config),
        "family": FAMILY,
        "preset": name,
        "seed": str(seed),
        "steps": str(hp["steps"]),
        "train_hparams": json.dumps(hp),
        "train_loss_last100": f"{sum(recent) / len(recent):.6f}",
        "heldout_loss": f"{ema_heldout:.6f}",
        "heldout_loss_raw_weights": f"{raw_heldout:.6f}",
        "train_time_s": f"{time.time() - start:.1f}",
        "num_parameters": str(sum(p.numel() for p in unet.parameters())),
    }
    path = save_fp16(unet, Path(out_dir) / f"{name}.safetensors", metadata)
    print(f"[{name}] wrote {path}: {json.dumps({k: metadata[k] for k in ('train_loss_last100', 'heldout_loss', 'train_time_s')})}", flush=True)
    return path


if __name__ == "__main__":  # python -m specray.models.diffusion_train NAME [OUT_DIR] [SEED]
    import sys

    torch.set_num_threads(1)
    from specray.models.presets import WEIGHTS_DIR

    train_preset(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else WEIGHTS_DIR, int(sys.argv[3]) if len(sys.argv) > 3 else 0)
