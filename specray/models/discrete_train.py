"""Deterministic training of the discrete presets on the digits (`specray train digits-gpt-*`).

Next-token cross-entropy over the 64 grey-level tokens of each image, class
label as prefix, class dropout for classifier-free guidance, AdamW with linear
warmup and cosine decay. Data order and class dropout come from one seeded
generator, so a rerun with the same seed gives the same weights on the same
hardware and thread count.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specray.models.configs import dataclass_from_dict
from specray.models.digits import load_digits_split
from specray.models.discrete_ar import DiscreteGPT, GPTConfig


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1500
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.05
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        return dataclass_from_dict(cls, d, "training")


def image_tokens(images: torch.Tensor) -> torch.Tensor:
    """Identity tokenizer: grey levels in raster order, ``[N, 64]`` int64."""
    return images.reshape(images.shape[0], -1).to(torch.int64)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


@torch.no_grad()
def heldout_nll(model: DiscreteGPT, seed: int = 0) -> float:
    """Mean NLL (nats/token) of the held-out split under the conditional model (no CFG); a
    text-conditioned model reads each image's first caption."""
    images, labels = load_digits_split("heldout", seed=0)
    tokens = image_tokens(images)
    if model.config.condition == "text":
        from specray.models.text_training import caption_bank

        labels = caption_bank("heldout").conditions(model, torch.arange(labels.shape[0]))
    was_training = model.training
    model.eval()
    logits = model(labels, tokens)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1)).item()
    model.train(was_training)
    return nll


def train_model(
    model_config: GPTConfig, train_config: TrainConfig, seed: int = 0, log_every: int = 0
) -> tuple[DiscreteGPT, dict[str, float]]:
    """Train a fresh model; returns it (fp32, eval mode) and its training record."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    images, labels = load_digits_split("train", seed=0)
    tokens = image_tokens(images)
    n = tokens.shape[0]
    model = DiscreteGPT(model_config)
    if model_config.condition == "text":  # captions in the place of labels (the class path draws nothing more)
        from specray.models.text_training import caption_bank

        bank = caption_bank("train")
        conditions = lambda idx: bank.conditions(model, idx, generator)  # noqa: E731
    else:
        conditions = lambda idx: labels[idx]  # noqa: E731
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": train_config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=train_config.lr,
        betas=train_config.betas,
    )
    model.train()
    order = torch.randperm(n, generator=generator)
    cursor = 0
    recent: list[float] = []
    start = time.perf_counter()
    for step in range(train_config.steps):
        if cursor + train_config.batch_size > n:
            order = torch.randperm(n, generator=generator)
            cursor = 0
        idx = order[cursor : cursor + train_config.batch_size]
        cursor += train_config.batch_size
        drop = torch.rand(idx.shape[0], generator=generator) < model_config.class_dropout_prob
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, train_config)
        logits = model(conditions(idx), tokens[idx], drop_class=drop)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[idx].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        optimizer.step()
        recent = (recent + [loss.item()])[-50:]
        if log_every and (step + 1) % log_every == 0:
            print(f"step {step + 1}/{train_config.steps} loss {sum(recent) / len(recent):.4f}", flush=True)
    model.eval()
    record = {
        "final_train_loss": sum(recent) / len(recent),
        "train_seconds": time.perf_counter() - start,
    }
    return model, record


def save_model(model: DiscreteGPT, path: Path, metadata: dict[str, str]) -> Path:
    """fp16 safetensors (the presets stay small) with the config and training record as metadata."""
    from specray.models.weights import save_fp16

    return save_fp16(model, path, {"config": json.dumps(asdict(model.config)), **metadata})


def train_preset(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Train preset ``name`` and write ``out_dir/<name>.safetensors``; returns that path."""
    from specray.models.presets import get_preset

    preset = get_preset(name)
    if preset.family != "discrete_ar":
        raise ValueError(f"preset {name!r} is family {preset.family!r}; this trainer handles 'discrete_ar'")
    if preset.config.get("kind") == "eagle_head":
        from specray.models.eagle_train import train_head_preset

        return train_head_preset(name, out_dir, seed)
    model_config = GPTConfig.from_dict(preset.config)
    train_config = TrainConfig.from_dict(preset.train)
    model, record = train_model(model_config, train_config, seed=seed, log_every=100)
    # Report the held-out NLL of the weights as stored (fp16-rounded).
    model.load_state_dict({k: v.to(torch.float16).float() for k, v in model.state_dict().items()})
    record["heldout_nll"] = heldout_nll(model)
    metadata = {
        "preset": name,
        "seed": str(seed),
        "steps": str(train_config.steps),
        "train": json.dumps(asdict(train_config)),
        "final_train_loss": f"{record['final_train_loss']:.6f}",
        "heldout_nll_nats_per_token": f"{record['heldout_nll']:.6f}",
        "train_seconds": f"{record['train_seconds']:.1f}",
        "torch_version": torch.__version__,
    }
    path = save_model(model, Path(out_dir) / f"{name}.safetensors", metadata)
    print(f"{name}: train loss {record['final_train_loss']:.4f}, held-out NLL {record['heldout_nll']:.4f} -> {path}")
    return path
