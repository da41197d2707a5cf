"""Per-call cost of verification at the real model sizes, and the speedups the papers' acceptance implies.

For each model at its release size (random weights: only the cost matters), at batch 1, 8, 32 and 128:
the time of one call, the time of one verify call (gamma + 1 tokens for the GPTs, a window of gamma
tokens for MAR, gamma states for the diffusion models), their ratio, and the speedup that the
acceptance figures below would give at those measured costs:

* LlamaGen-XL target, LlamaGen-B draft, gamma 4: mean accepted length tau (bonus included) of the COOL-SD
  paper's LlamaGen-XL rows (LANTERN++ 2.67, COOL-SD delta 1.1: 2.73, delta 2: 3.34; spec discrete_sd 8).
  speedup = N c_XL(1) / ((N / tau) (gamma c_B(1) + c_XL(gamma + 1))), CFG rows doubled.
* MAR-H target, MAR-B draft, CSpD gamma 32: 21 target calls and 243 draft calls per image (spec cspd 7.7);
  a MAR call is the encoder/decoder pass plus the 100-step DiffLoss chains of the tokens it emits.
* DDPM-CIFAR10 and DiT-XL/2, gamma 7, K = 1000 / 250 steps: block efficiency E (steps per round) of this
  project's digits benchmark (Free drafter 5.81, Frozen 6.05 at K = 1000; docs/benchmarks.md, "Diffusion family"), as
  no paper reports one; Free: (K / E) rounds of one call on gamma states; Frozen: one call on 1 + one on
  gamma - 1 states per round.

Run on a GPU: ``python bench/gpu.py [--dtype bfloat16] [--out gpu.json]``. ``--quick`` runs tiny
configurations at batch 1 and 2 on the CPU (what the test runs). Medians of ``--reps`` timed calls after
one warm-up; CUDA is synchronised around every call. Each model is made once, on the device, and ``--out`` is
written after every batch size (a run stopped early keeps what it measured). ``bench/gpu_session.sh`` runs this
with the other GPU measurements.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

GAMMA_AR, GAMMA_MAR, GAMMA_DIFF = 4, 32, 7
LLAMAGEN_TAU = {"lantern++": 2.67, "cool_sd_1.1": 2.73, "cool_sd_2": 3.34}
MAR_CALLS = {"target": 21, "draft": 243, "tokens": 256}
DIFF_EFFICIENCY = {"free": 5.81, "frozen": 6.05}

FULL = {
    "gpt": {"GPT-B": dict(n_layer=12, n_head=12, dim=768), "GPT-XL": dict(n_layer=36, n_head=20, dim=1280)},
    "gpt_common": dict(vocab_size=16384, num_classes=1000, grid_size=24, multiple_of=256),
    "mar": {"MAR-B": dict(width=768, depth=12, heads=12, diffloss_depth=6, diffloss_width=1024),
            "MAR-H": dict(width=1280, depth=20, heads=16, diffloss_depth=12, diffloss_width=1536)},
    "mar_steps": 100,
    "unet": dict(sample_size=32, block_out_channels=(128, 256, 256, 256), layers_per_block=2,
                 down_block_types=("DownBlock2D", "AttnDownBlock2D", "DownBlock2D", "DownBlock2D"),
                 up_block_types=("UpBlock2D", "UpBlock2D", "AttnUpBlock2D", "UpBlock2D"),
                 freq_shift=1, flip_sin_to_cos=False, downsample_padding=0, norm_eps=1e-6),
    "dit": dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                sample_size=32, patch_size=2, num_embeds_ada_norm=1000),
    "steps": {"ddpm": 1000, "dit": 250},
    "batches": (1, 8, 32, 128),
}
QUICK = {
    "gpt": {"GPT-B": dict(n_layer=1, n_head=2, dim=32), "GPT-XL": dict(n_layer=2, n_head=2, dim=32)},
    "gpt_common": dict(vocab_size=64, num_classes=10, grid_size=4, multiple_of=32),
    "mar": {"MAR-B": dict(width=32, depth=1, heads=2, diffloss_depth=1, diffloss_width=32),
            "MAR-H": dict(width=32, depth=2, heads=2, diffloss_depth=2, diffloss_width=32)},
    "mar_steps": 4,
    "unet": dict(sample_size=8, block_out_channels=(32, 32), layers_per_block=1,
                 down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D")),
    "dit": dict(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
                sample_size=4, patch_size=2, num_embeds_ada_norm=10),
    "steps": {"ddpm": 20, "dit": 10},
    "batches": (1, 2),
}


def timed(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median seconds of ``reps`` calls after one warm-up."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        fn()
        sync()
        times = []
        for _ in range(reps):
            began = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def build_models(cfg: dict, device: torch.device, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """Every model once, made on ``device`` (random weights: only the cost matters; no host copies to move)."""
    from diffusers import DiTTransformer2DModel, UNet2DModel

    from specray.models.checkpoints.mar import MARConfig, MARNet
    from specray.models.discrete_ar import DiscreteGPT, GPTConfig

    models: dict[str, torch.nn.Module] = {}
    with torch.device(device):
        for name, arch in cfg["gpt"].items():
            models[name] = DiscreteGPT(GPTConfig(**cfg["gpt_common"], **arch))
        for name, arch in cfg["mar"].items():
            models[name] = MARNet(MARConfig(**arch))
        models["DDPM-CIFAR10"] = UNet2DModel(in_channels=3, out_channels=3, **cfg["unet"])
        models["DiT-XL-2"] = DiTTransformer2DModel(**cfg["dit"])
    return {name: model.to(device=device, dtype=dtype).eval() for name, model in models.items()}


def gpt_costs(models: dict, cfg: dict, batch: int, device: torch.device, reps: int) -> dict[str, float]:
    """One call of 1 token and one of gamma + 1 tokens per row, CFG rows doubled, half the image as context."""
    out = {}
    for name in cfg["gpt"]:
        model = models[name]
        rows = 2 * batch
        cache = model.new_cache(rows)
        start = model.config.num_image_tokens // 2
        cache.lengths.fill_(start)
        for n in (1, GAMMA_AR + 1):
            tokens = torch.randint(0, model.config.vocab_size, (rows, n), device=device)
            positions = start + torch.arange(n, device=device).expand(rows, n)
            out[f"{name}/{n}"] = timed(lambda: model.forward_step(tokens, positions, cache, prefix=False), device, reps)
    return out


def mar_costs(models: dict, cfg: dict, batch: int, device: torch.device, dtype: torch.dtype,
              reps: int) -> dict[str, float]:
    """Encoder/decoder pass (half the tokens visible, CFG rows doubled) plus the DiffLoss chains of 1 or
    gamma tokens per row."""
    out = {}
    for name in cfg["mar"]:
        net = models[name]
        rows, L = 2 * batch, net.config.seq_len
        tokens = torch.randn(rows, L, net.config.token_dim, device=device, dtype=dtype)
        mask = torch.zeros(rows, L, dtype=torch.bool, device=device)
        mask[:, L // 2 :] = True
        labels = torch.randint(0, net.config.num_classes, (rows,), device=device)
        for n in (1, GAMMA_MAR):
            def call(n: int = n) -> torch.Tensor:
                z = net(tokens, mask, net.class_embedding(labels))[:, :n].reshape(rows * n, -1)
                x = torch.randn(rows * n, net.config.token_dim, device=device, dtype=dtype)
                t = torch.zeros(rows * n, dtype=torch.int64, device=device)
                for _ in range(cfg["mar_steps"]):
                    x = net.diffloss.net(x, t, z)[:, : net.config.token_dim]
                return x

            out[f"{name}/{n}"] = timed(call, device, reps)
    return out


def denoiser_costs(models: dict, cfg: dict, batch: int, device: torch.device, dtype: torch.dtype,
                   reps: int) -> dict[str, float]:
    """A UNet (DDPM-CIFAR10) and a DiT-XL/2 call on B, gamma - 1 and gamma * B states (DiT: CFG doubled)."""
    out = {}
    unet, dit = models["DDPM-CIFAR10"], models["DiT-XL-2"]
    size = cfg["unet"]["sample_size"]
    for mult in (1, GAMMA_DIFF - 1, GAMMA_DIFF):
        x = torch.randn(batch * mult, 3, size, size, device=device, dtype=dtype)
        t = torch.full((batch * mult,), 500, device=device)
        out[f"DDPM-CIFAR10/{mult}"] = timed(lambda: unet(x, t).sample, device, reps)
    size = cfg["dit"]["sample_size"]
    for mult in (1, GAMMA_DIFF - 1, GAMMA_DIFF):
        rows = 2 * batch * mult
        x = torch.randn(rows, 4, size, size, device=device, dtype=dtype)
        t = torch.full((rows,), 500, device=device)
        labels = torch.randint(0, cfg["dit"]["num_embeds_ada_norm"], (rows,), device=device)
        out[f"DiT-XL-2/{mult}"] = timed(lambda: dit(x, timestep=t, class_labels=labels).sample, device, reps)
    return out


def predictions(c: dict[str, float], cfg: dict) -> dict[str, float]:
    """Speedups implied by the acceptance figures at the measured costs (formulas in the module docstring)."""
    n_tokens = cfg["gpt_common"]["grid_size"] ** 2
    out = {}
    round_cost = GAMMA_AR * c["GPT-B/1"] + c[f"GPT-XL/{GAMMA_AR + 1}"]
    for name, tau in LLAMAGEN_TAU.items():
        out[f"llamagen_{name}"] = n_tokens * c["GPT-XL/1"] / (n_tokens / tau * round_cost)
    mar = MAR_CALLS["tokens"] * c["MAR-H/1"] / (MAR_CALLS["target"] * c[f"MAR-H/{GAMMA_MAR}"] + MAR_CALLS["draft"] * c["MAR-B/1"])
    out["mar_cspd_g32"] = mar
    for model, steps in (("DDPM-CIFAR10", cfg["steps"]["ddpm"]), ("DiT-XL-2", cfg["steps"]["dit"])):
        free = steps * c[f"{model}/1"] / (steps / DIFF_EFFICIENCY["free"] * c[f"{model}/{GAMMA_DIFF}"])
        frozen = steps * c[f"{model}/1"] / (steps / DIFF_EFFICIENCY["frozen"] * (c[f"{model}/1"] + c[f"{model}/{GAMMA_DIFF - 1}"]))
        out[f"{model}_block_free"], out[f"{model}_block_frozen"] = free, frozen
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configurations, batch 1 and 2, CPU")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu (--quick: cpu)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--reps", type=int, default=None, help="timed calls per measurement (default 10; quick 2)")
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    from specray.runtime.hardware import device_name

    cfg = QUICK if args.quick else FULL
    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    dtype = getattr(torch, args.dtype)
    reps = args.reps or (2 if args.quick else 10)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 (TF32 off, as everywhere)
    models = build_models(cfg, device, dtype)
    result = {"device": str(device), "device_name": device_name(device),
              "dtype": args.dtype, "quick": args.quick, "reps": reps, "torch": torch.__version__, "rows": []}
    for batch in cfg["batches"]:
        costs = {**gpt_costs(models, cfg, batch, device, reps), **mar_costs(models, cfg, batch, device, dtype, reps),
                 **denoiser_costs(models, cfg, batch, device, dtype, reps)}
        ratios = {"GPT-XL verify/1": costs[f"GPT-XL/{GAMMA_AR + 1}"] / costs["GPT-XL/1"],
                  "MAR-H window/1": costs[f"MAR-H/{GAMMA_MAR}"] / costs["MAR-H/1"],
                  "DDPM gamma states/1": costs[f"DDPM-CIFAR10/{GAMMA_DIFF}"] / costs["DDPM-CIFAR10/1"],
                  "DiT gamma states/1": costs[f"DiT-XL-2/{GAMMA_DIFF}"] / costs["DiT-XL-2/1"]}
        result["rows"].append({"batch": batch, "costs_s": costs, "ratios": ratios,
                               "predicted_speedup": predictions(costs, cfg)})
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
        print("  ms: " + ", ".join(f"{k} {v * 1e3:.3g}" for k, v in costs.items()))
        print("  predicted: " + ", ".join(f"{k} {v:.2f}x" for k, v in result["rows"][-1]["predicted_speedup"].items()))
        if args.out is not None:  # after every batch: a run stopped early keeps what it measured
            args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
