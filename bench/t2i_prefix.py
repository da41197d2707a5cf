"""Cost of LlamaGen t2i's 120-slot caption prefix against the c2i single class slot, per call.

The same GPT (random weights) is built twice over a 16x16 grid (256 px): class-conditioned
(``cls_token_num`` 1) and caption-conditioned (120 caption slots, key-padding mask, half of them
padding). For each, at half the image as context and CFG rows doubled, the median time of a decode
call (1 token per row) and of a verify call (gamma + 1 tokens per row), side by side with the ratios
t2i / c2i (c2i and t2i calls alternate, and the ratio is the median of the paired ratios, so load
from other processes hits both alike) and verify / decode. The prefill (writing the caption) too.

    python bench/t2i_prefix.py                  # GPT-B on the CPU (minutes on 2 cores)
    python bench/t2i_prefix.py --size GPT-XL --device cuda
    python bench/t2i_prefix.py --quick          # a tiny GPT, seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

# bench/gpu.py's timer (a warm-up, then the median of timed calls, CUDA synchronised).
from gpu import timed

from specray.models.captions import set_caption_features
from specray.models.checkpoints.options import LLAMAGEN_SIZES
from specray.models.discrete_ar import DiscreteGPT, GPTConfig
from specray.models.presets import TEXT_NULL_INDEX

GAMMA = 4
SIZES = {**LLAMAGEN_SIZES, "tiny": {"n_layer": 2, "n_head": 2, "dim": 32}}


def models(size: str, device: torch.device) -> dict[str, DiscreteGPT]:
    common = dict(vocab_size=16384 if size != "tiny" else 64, grid_size=16, multiple_of=256 if size != "tiny" else 32,
                  **SIZES[size])
    c2i = GPTConfig(num_classes=1000, **common)
    t2i = GPTConfig(num_classes=TEXT_NULL_INDEX, condition="caption", cls_token_num=120,
                    caption_dim=2048 if size != "tiny" else 16, **common)
    return {name: DiscreteGPT(config).to(device).eval() for name, config in (("c2i", c2i), ("t2i", t2i))}


def calls(model: DiscreteGPT, batch: int, device: torch.device) -> dict[str, Callable[[], torch.Tensor]]:
    """The model's prefill, decode and verify calls on a batch (its cache filled to half the image)."""
    rows = 2 * batch  # cond and uncond streams
    ids = torch.arange(batch, device=device)
    if model.caption_conditioned:
        features = torch.randn(batch, 120, model.config.caption_dim, device=device)
        mask = torch.arange(120, device=device)[None, :] < 60  # half the caption slots are padding
        set_caption_features(features, mask.expand(batch, -1), model)
        prefix = torch.cat([ids, model.null_prefix(ids)])[:, None]
    else:
        prefix = torch.cat([ids % 1000, torch.full_like(ids, model.null_class)])[:, None]
    cache = model.new_cache(rows)
    zero = torch.zeros(rows, 1, dtype=torch.int64, device=device)
    out = {"prefill": lambda: model.forward_step(prefix, zero, cache, prefix=True)}
    start = model.config.num_image_tokens // 2
    for name, n in (("decode", 1), ("verify", GAMMA + 1)):
        tokens = torch.randint(0, model.config.vocab_size, (rows, n), device=device)
        positions = start + torch.arange(n, device=device).expand(rows, n)
        out[name] = lambda t=tokens, p=positions: model.forward_step(t, p, cache, prefix=False)
    return out


@torch.inference_mode()
def once(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    """Seconds of one call (CUDA synchronised around it)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    began = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - began


def paired_costs(nets: dict[str, DiscreteGPT], batch: int, device: torch.device, reps: int) -> dict[str, dict]:
    """Median seconds per call of each model, c2i and t2i calls alternating (a busy machine slows both
    alike), and the median of the per-repetition ratios t2i / c2i."""
    fns = {name: calls(net, batch, device) for name, net in nets.items()}
    out: dict[str, dict] = {}
    for call in ("prefill", "decode", "verify"):
        times: dict[str, list[float]] = {"c2i": [], "t2i": []}
        for name in ("c2i", "t2i"):
            timed(fns[name][call], device, 1)  # warm-up
        for _ in range(reps):
            for name in ("c2i", "t2i"):
                times[name].append(once(fns[name][call], device))
        ratios = [t / c for c, t in zip(times["c2i"], times["t2i"])]
        out[call] = {"c2i": statistics.median(times["c2i"]), "t2i": statistics.median(times["t2i"]),
                     "ratio": statistics.median(ratios), "times": times}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="GPT-B", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--quick", action="store_true", help="the tiny GPT, 5 repetitions")
    parser.add_argument("--json", help="also write every number here")
    args = parser.parse_args()
    size, reps = ("tiny", 5) if args.quick else (args.size, args.reps)
    device = torch.device(args.device)
    torch.manual_seed(0)
    if device.type == "cpu":
        torch.set_num_threads(1)  # comparable between runs on a shared machine
    nets = models(size, device)
    results = {}
    print(f"{size} on {device}, grid 16x16, CFG rows doubled, medians of {reps} calls (ms); t2i/c2i: median of "
          "paired ratios")
    print(f"{'batch':>5} {'call':>8} {'c2i':>9} {'t2i':>9} {'t2i/c2i':>8}")
    for batch in args.batches:
        measured = paired_costs(nets, batch, device, reps)
        results[batch] = measured
        for call in ("prefill", "decode", "verify"):
            m = measured[call]
            print(f"{batch:>5} {call:>8} {1e3 * m['c2i']:>9.2f} {1e3 * m['t2i']:>9.2f} {m['ratio']:>8.2f}")
        for name in ("c2i", "t2i"):
            ratio = measured["verify"][name] / measured["decode"][name]
            print(f"{batch:>5} {name} verify/decode {ratio:.2f}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"size": size, "device": str(device), "reps": reps, "gamma": GAMMA, "seconds": results}, handle,
                      indent=2)


if __name__ == "__main__":
    main()
