"""Training an EAGLE draft head by self-distillation (`specray train digits-gpt-eagle`).

The recipe of EAGLE-1 as LANTERN trains its LlamaGen heads:

* data: the target's own generations (its sampler with CFG, ``samples`` images, labels cycling
  over the classes), drawn with the counter-based generator, and the target's last hidden states
  (after the final norm) along them, teacher-forced, for the cond stream and the uncond (null
  class) stream; a training sequence is the uncond one with probability ``uncond_fraction``
  (LANTERN: 0.1);
* input: at position ``s`` the hidden state at ``s - 1`` plus uniform noise
  ``(U - 1/2) · std · 512 / L`` (EAGLE's feature noise, ``L`` the sequence length), and the token
  fed at ``s``; targets: the hidden state at ``s`` (smooth-L1, weight ``v_w``) and the target's
  distribution there through its frozen output layer (cross-entropy, weight ``p_w`` = 0.1);
* AdamW (β = 0.9, 0.95) with linear warm-up and cosine decay, gradient values clipped (EAGLE: 0.5).

Every random choice (generations, batch order, streams, noise, initial weights) comes from the seed,
so a rerun gives the same weights on the same hardware and thread count. The record stored with the
weights includes the held-out acceptance ``alpha`` = E[Σ min(P, Q)] of the head's first draft
against the target under the sampler's CFG, on generations the head never saw.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specray.methods.discrete.params import Sampling
from specray.methods.discrete.processing import process_with
from specray.models.configs import dataclass_from_dict
from specray.models.discrete_ar import DiscreteGPT, load_model
from specray.models.eagle_head import HEAD_KIND, EagleHead, EagleHeadConfig, head_logits

# Generations for training are drawn at seeds apart from any job's, so a job never scores on them.
GENERATION_SEED_OFFSET = 1_000_003


@dataclass(frozen=True)
class HeadTrainConfig:
    target: str = "digits-gpt-target"
    samples: int = 4000
    heldout_samples: int = 200
    cfg_scale: float = 1.5
    generation_batch: int = 100
    steps: int = 4000
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 100
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.0
    grad_clip_value: float = 0.5
    v_w: float = 1.0
    p_w: float = 0.1
    noise_std: float = 0.2
    noise_length_scale: float = 512.0
    uncond_fraction: float = 0.1

    @classmethod
    def from_dict(cls, d: dict) -> "HeadTrainConfig":
        return dataclass_from_dict(cls, d, "head training")


@dataclass
class Distillation:
    """Target generations and the target's hidden states along them (cond and uncond streams)."""

    labels: torch.Tensor  # [n]
    tokens: torch.Tensor  # [n, N]
    features: torch.Tensor  # [2, n, N, D]: stream 0 cond, 1 uncond


@torch.no_grad()
def distill(target: DiscreteGPT, count: int, first_id: int, cfg_scale: float, seed: int, batch: int) -> Distillation:
    """``count`` target generations with sample ids ``first_id ..`` and their hidden states."""
    from specray.methods.discrete.loop import generate_tokens
    from specray.models.pair import ModelPair

    pair = ModelPair("discrete_ar", "target", None, target, None, target.output.weight.device, {})
    ids = torch.arange(first_id, first_id + count)
    labels = ids % target.config.num_classes
    tokens = torch.cat([
        generate_tokens("target_only", {"cfg_scale": cfg_scale}, pair, labels[i : i + batch], ids[i : i + batch],
                        GENERATION_SEED_OFFSET + seed)[0].cpu()
        for i in range(0, count, batch)
    ])
    streams = []
    for drop in (False, True):
        streams.append(torch.cat([
            target.features(labels[i : i + batch], tokens[i : i + batch],
                            torch.full((min(batch, count - i),), drop)).cpu()
            for i in range(0, count, batch)
        ]))
    return Distillation(labels, tokens, torch.stack(streams))


def _lr_at(step: int, cfg: HeadTrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def feature_noise(features: torch.Tensor, cfg: HeadTrainConfig, generator: torch.Generator) -> torch.Tensor:
    """EAGLE's uniform feature noise: ``(U - 1/2) · std · 512 / L`` for sequences ``[B, L, D]``."""
    u = torch.rand(features.shape, generator=generator, dtype=features.dtype)
    return (u - 0.5) * cfg.noise_std * cfg.noise_length_scale / features.shape[1]


def _head_inputs(data: Distillation, rows: torch.Tensor, stream: torch.Tensor):  # noqa: ANN202
    """Inputs and targets of the head on sequences ``rows`` of streams ``stream`` (positions 1 .. N-1)."""
    feats = data.features[stream, rows]  # [b, N, D]
    n = feats.shape[1]
    positions = torch.arange(1, n).expand(rows.shape[0], n - 1)
    return feats[:, :-1], data.tokens[rows, :-1], positions, feats[:, 1:]


def head_losses(head: EagleHead, target: DiscreteGPT, features: torch.Tensor, tokens: torch.Tensor,
                positions: torch.Tensor, wanted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(smooth-L1 on the hidden states, cross-entropy against the target's distribution), both means."""
    predicted = head(features, tokens, positions)
    value_loss = F.smooth_l1_loss(predicted, wanted, reduction="none").mean(-1).mean()
    with torch.no_grad():
        target_p = torch.softmax(head_logits(target, wanted), -1)
    prob_loss = -(target_p * torch.log_softmax(head_logits(target, predicted), -1)).sum(-1).mean()
    return value_loss, prob_loss


@torch.no_grad()
def first_draft_alpha(head: EagleHead, target: DiscreteGPT, data: Distillation, cfg_scale: float) -> dict[str, float]:
    """Mean ``Σ min(P, Q)`` (the first draft's acceptance probability under ``sd``) and top-1 agreement of
    the head's CFG-combined law with the target's, from the true hidden states along ``data``."""
    sampling = Sampling(cfg_scale=cfg_scale)
    laws = []
    for source in ("target", "head"):
        logits = []
        for stream in (0, 1):
            features, tokens, positions, wanted = _head_inputs(data, torch.arange(len(data.labels)),
                                                               torch.full((len(data.labels),), stream))
            logits.append(head_logits(target, wanted if source == "target" else head(features, tokens, positions)))
        laws.append(process_with(sampling, logits[0], logits[1] if sampling.uses_uncond else None))
    P, Q = laws
    return {"alpha": float(torch.minimum(P, Q).sum(-1).mean()),
            "top1": float((P.argmax(-1) == Q.argmax(-1)).float().mean())}


def train_head(target: DiscreteGPT, cfg: HeadTrainConfig, seed: int = 0, log_every: int = 0,
               config: EagleHeadConfig | None = None) -> tuple[EagleHead, dict[str, float], Distillation]:
    """Self-distil a fresh head for ``target``: the head (fp32, eval mode), its training record and the
    held-out generations (``heldout_samples`` sample ids after the training ones)."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    data = distill(target, cfg.samples, 0, cfg.cfg_scale, seed, cfg.generation_batch)
    heldout = distill(target, cfg.heldout_samples, cfg.samples, cfg.cfg_scale, seed, cfg.generation_batch)
    generation_seconds = time.perf_counter() - start
    head = EagleHead.for_target(target)
    if config is not None and head.config != config:
        raise ValueError(f"head config {config} differs from the target's shape {head.config}")
    head.train()
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    recent: list[tuple[float, float]] = []
    for step in range(cfg.steps):
        rows = torch.randint(0, cfg.samples, (cfg.batch_size,), generator=generator)
        stream = (torch.rand(cfg.batch_size, generator=generator) < cfg.uncond_fraction).long()
        features, tokens, positions, wanted = _head_inputs(data, rows, stream)
        features = features + feature_noise(features, cfg, generator)
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, cfg)
        value_loss, prob_loss = head_losses(head, target, features, tokens, positions, wanted)
        loss = cfg.v_w * value_loss + cfg.p_w * prob_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_value_(trainable, cfg.grad_clip_value)
        optimizer.step()
        recent = (recent + [(value_loss.item(), prob_loss.item())])[-50:]
        if log_every and (step + 1) % log_every == 0:
            v, p = (sum(x) / len(recent) for x in zip(*recent))
            print(f"step {step + 1}/{cfg.steps} smooth-L1 {v:.4f} cross-entropy {p:.4f}", flush=True)
    head.eval()
    v, p = (sum(x) / len(recent) for x in zip(*recent))
    record = {"final_value_loss": v, "final_prob_loss": p, "generation_seconds": generation_seconds,
              "train_seconds": time.perf_counter() - start - generation_seconds}
    return head, record, heldout


def save_head(head: EagleHead, path: Path, metadata: dict[str, str]) -> Path:
    """fp16 safetensors with the head's config (``kind: eagle_head``) and the training record."""
    from specray.models.weights import save_fp16

    return save_fp16(head, path, {"config": head.config.to_json(), **metadata})


def train_head_preset(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Train head preset ``name`` against its target and write ``out_dir/<name>.safetensors``."""
    from specray.models.presets import get_preset

    preset = get_preset(name)
    raw = dict(preset.config)
    if raw.pop("kind", None) != HEAD_KIND:
        raise ValueError(f"preset {name!r} is not an EAGLE head (config kind {preset.config.get('kind')!r})")
    cfg = HeadTrainConfig.from_dict(preset.train)
    # The target as trained into the same folder (`specray train all --out-dir`), else the package's.
    fresh = Path(out_dir) / f"{cfg.target}.safetensors"
    target = load_model(str(fresh) if fresh.exists() else cfg.target, "cpu")
    head, record, heldout = train_head(target, cfg, seed=seed, log_every=500, config=EagleHeadConfig.from_dict(raw))
    # Score the weights as stored (fp16-rounded).
    head.load_state_dict({k: v.to(torch.float16).float() for k, v in head.state_dict().items()})
    scores = first_draft_alpha(head, target, heldout, cfg.cfg_scale)
    metadata = {
        "preset": name,
        "target": cfg.target,
        "seed": str(seed),
        "steps": str(cfg.steps),
        "train": json.dumps(asdict(cfg)),
        "final_smooth_l1": f"{record['final_value_loss']:.6f}",
        "final_cross_entropy": f"{record['final_prob_loss']:.6f}",
        "heldout_first_draft_alpha": f"{scores['alpha']:.6f}",
        "heldout_top1_agreement": f"{scores['top1']:.6f}",
        "generation_seconds": f"{record['generation_seconds']:.1f}",
        "train_seconds": f"{record['train_seconds']:.1f}",
        "torch_version": torch.__version__,
        "torch_threads": str(torch.get_num_threads()),
    }
    path = save_head(head, Path(out_dir) / f"{name}.safetensors", metadata)
    print(f"{name}: held-out first-draft alpha {scores['alpha']:.4f}, top-1 {scores['top1']:.4f} -> {path}")
    return path
