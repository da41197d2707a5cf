"""Throughput of specray's ``target_only`` against the official samplers, on the same random weights.

Per family it builds the OFFICIAL model with random weights (LlamaGen c2i ``Transformer``; MAR with
its DiffLoss head), saves it in the release's file format and key layout in a temporary folder,
loads that file through specray's loader (``{format: llamagen-c2i}`` / ``{format: mar}``), checks
that both compute the same network outputs on one forward (LlamaGen: teacher-forced logits; MAR:
the MAE encoder/decoder's z for a fixed mask and the DiffLoss net's output), then times

* discrete: the official ``generate()`` against specray's ``generate_tokens("target_only", ...)``;
* continuous: the official ``MAR.sample_tokens()`` against specray's ``run_batch("target_only", ...)``

on the same batch (labels) and settings, and prints seconds per sample of each and the ratio
specray throughput / official throughput (the median over repetitions of the paired ratio
official time / specray time; the two run alternately, the order swapping every repetition, so
load from other processes hits both alike), with a 90 % confidence interval for that median
(:func:`~bench.pricing.median_interval` of the paired ratios; of 5 repetitions their lowest and
highest ratio). Clock: process CPU time on a CPU device (time spent waiting for a core left out;
run single-threaded, as this script sets), wall time with CUDA synchronised before and after each
call on a GPU; the other clock's ratio is printed alongside.

The official code is imported at run time from a copy kept OUTSIDE this repository (``--official``,
default ``$SPECRAY_OFFICIAL`` or ``/tmp/official``, holding ``LlamaGen/`` and ``mar/``); README.md
("Reference fixtures") and bench/README.md say how to get it. Nothing of it is committed here.

Same work on both sides:

* LlamaGen: tokens only (no VQ decode), N = grid^2 forward calls with a KV cache over the
  [cond; uncond] rows (batch doubled by CFG), the release format's official sampler settings
  (``LlamaGenOptions.sampling_defaults()`` of a custom size: CFG 1.75 on every token, temperature 1,
  no top-k / top-p). The official ``generate()`` runs eager (its sample scripts' ``--compile`` is
  left off: no CPU codegen here); ``--dtype bfloat16`` runs both sides in bf16 (the sample
  scripts' default precision; the logits check is made in float32 first).
* MAR: ``sample_tokens(num_iter = L)`` (one token per step, what specray's loop is; cosine mask
  schedule, linear CFG 3.0, temperature 1, DiffLoss with ``--mar-steps`` respaced cosine steps,
  ``clip_denoised`` off) against ``target_only`` with the release format's defaults. Neither side
  decodes latents with a VAE (specray's images without a VAE are the latents' first channels
  rescaled to uint8, a few elementwise ops once per batch). Float32 on both sides (the official
  evaluation wraps the sampler in CUDA autocast; not reproduced here).

Remaining differences, by design: the random numbers (official: ``torch.multinomial`` /
``torch.randn`` / ``np.random.shuffle``; specray: counter-based keyed draws made in a few large
calls), so tokens differ; CFG in MAR's DiffLoss (the official head runs its chain arithmetic on both
CFG halves, specray's on the conditional rows only, with the same network calls on both halves).

    python bench/vs_official.py                        # small configs, batch 1 and 8 (~2.5 min of CPU)
    python bench/vs_official.py --quick                # batch 1 and 4, 3 repetitions, 25 DiffLoss steps (~45 s)
    python bench/vs_official.py --device cuda --size base --batches 1,32   # GPT-B / MAR-B shapes on a GPU
    python bench/vs_official.py --size base --check-only   # only the output checks (no timing; CPU-friendly)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from official_code import default_root, import_official, missing_files, randomize, tensor_cuda_as_identity  # noqa: E402

from bench.pricing import interval_text, median_interval, since, stamp, sync  # noqa: E402
from specray.families import format_options  # noqa: E402

# Architectures, in specray's option names. "base" is GPT-B / MAR-B over the releases' 16 x 16 token
# grids (for a GPU). "small" keeps a single-threaded CPU run to minutes: the real vocabulary, latent
# width and 100 DiffLoss steps, but narrower, shallower networks over smaller grids (LlamaGen 8 x 8
# tokens; MAR 4 x 4, whose steps each re-encode every token and run a DiffLoss chain per token).
LLAMAGEN_ARCH = {
    "small": {"n_layer": 4, "n_head": 4, "dim": 256, "vocab_size": 16384, "num_classes": 1000, "multiple_of": 256},
    "base": {"n_layer": 12, "n_head": 12, "dim": 768, "vocab_size": 16384, "num_classes": 1000, "multiple_of": 256},
}
LLAMAGEN_GRID = {"small": 8, "base": 16}
MAR_ARCH = {
    "small": {"width": 128, "depth": 2, "heads": 4, "diffloss_depth": 2, "diffloss_width": 256, "seq_len": 16,
              "token_dim": 16, "buffer_size": 16, "num_classes": 1000},
    "base": {"width": 768, "depth": 12, "heads": 12, "diffloss_depth": 6, "diffloss_width": 1024, "seq_len": 256,
             "token_dim": 16, "buffer_size": 64, "num_classes": 1000},
}
# Of the largest |output|: float32 summation order is all that may differ. On an accelerator the BLAS (cuBLAS)
# picks its algorithm, and split-K, so its order of summation, by shape, and the two sides' calls have different
# shapes; a wrong layer or weight differs by orders of magnitude more.
LOGITS_RTOL_CPU, LOGITS_RTOL_ACCELERATOR = 1e-5, 1e-4


# ---- timing -----------------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], device: torch.device) -> dict[str, float]:
    """Both clocks of one call: ``cpu`` (process CPU time) and ``wall``."""
    sync(device)
    start = stamp()
    fn()
    sync(device)
    return since(start)


@dataclass
class Row:
    family: str
    batch: int
    clock: str  # the main clock: cpu on a CPU device, wall on CUDA
    official_s: list[float] = field(default_factory=list)  # per repetition, main clock
    specray_s: list[float] = field(default_factory=list)
    ratios: dict[str, list[float]] = field(default_factory=lambda: {"cpu": [], "wall": []})

    def per_sample(self, times: list[float]) -> float:
        return statistics.median(times) / self.batch

    def ratio(self, clock: str | None = None) -> float:
        return statistics.median(self.ratios[clock or self.clock])

    def interval(self, clock: str | None = None) -> tuple[float, float]:
        """The 90 % interval of :meth:`ratio` (the ratios are paired already, each within one repetition)."""
        return median_interval(self.ratios[clock or self.clock])


def paired_runs(family: str, official: Callable[[int, int], Any], specray: Callable[[int, int], Any], batch: int,
                reps: int, device: torch.device) -> Row:
    """``reps`` paired timings of ``official(batch, rep)`` and ``specray(batch, rep)`` after a warm-up of
    each; the order alternates every repetition."""
    row = Row(family, batch, "wall" if device.type == "cuda" else "cpu")
    official(batch, -1)
    specray(batch, -1)
    for rep in range(reps):
        runs = [("official", official), ("specray", specray)]
        times = {name: timed(partial(fn, batch, rep), device) for name, fn in (runs if rep % 2 == 0 else runs[::-1])}
        row.official_s.append(times["official"][row.clock])
        row.specray_s.append(times["specray"][row.clock])
        for clock in ("cpu", "wall"):
            row.ratios[clock].append(times["official"][clock] / times["specray"][clock])
    return row


def batch_inputs(batch: int, rep: int, num_classes: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The labels and sample ids of one repetition (both sides get the same labels)."""
    ids = torch.arange(batch, device=device) + (rep + 1) * batch
    return (ids * 37) % num_classes, ids


def seed_official(rep: int) -> None:
    """The official samplers draw from the global torch and numpy generators."""
    torch.manual_seed(rep + 1)
    np.random.seed(rep + 1)


# ---- network output checks ---------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    max_abs_diff: float
    max_abs_ref: float
    rtol: float

    @property
    def ok(self) -> bool:
        return self.max_abs_diff <= self.rtol * max(self.max_abs_ref, 1.0)

    def line(self) -> str:
        verdict = "ok" if self.ok else "MISMATCH"
        return (f"  check {self.name}: max |specray - official| = {self.max_abs_diff:.3g} "
                f"(largest |official| {self.max_abs_ref:.3g}, tolerance {self.rtol:g} of it): {verdict}")


def compare(name: str, mine: torch.Tensor, official: torch.Tensor) -> Check:
    rtol = LOGITS_RTOL_CPU if mine.device.type == "cpu" else LOGITS_RTOL_ACCELERATOR
    mine, official = mine.detach().double().cpu(), official.detach().double().cpu()
    if mine.shape != official.shape:
        raise SystemExit(f"{name}: specray shape {tuple(mine.shape)} != official {tuple(official.shape)}")
    return Check(name, float((mine - official).abs().max()), float(official.abs().max()), rtol)


# ---- LlamaGen c2i ------------------------------------------------------------------------------------


def official_llamagen(arch: dict[str, int], grid: int, device: torch.device) -> torch.nn.Module:
    from autoregressive.models.gpt import ModelArgs, Transformer

    args = ModelArgs(block_size=grid * grid, cls_token_num=1, model_type="c2i", class_dropout_prob=0.1, **arch)
    model = Transformer(args).eval()
    randomize(model, seed=1)
    return model.to(device)


def llamagen_reference(path: Path, arch: dict[str, int], grid: int, dtype: str) -> dict[str, Any]:
    """specray's reference to the saved file (no tokenizer: tokens only; VQ-16's downsampling sets the grid)."""
    return {"format": "llamagen-c2i", "path": str(path), "size": "custom", "image_size": 16 * grid,
            "arch": dict(arch), "tokenizer": None, "dtype": dtype}


@torch.no_grad()
def check_llamagen(official: torch.nn.Module, gpt: torch.nn.Module, grid: int, device: torch.device) -> Check:
    """Teacher-forced logits of 2 samples (before the official model's caches exist: it then uses none)."""
    g = torch.Generator().manual_seed(0)
    n = grid * grid
    labels = torch.tensor([3, 999], device=device)
    tokens = torch.randint(0, gpt.config.vocab_size, (2, n), generator=g).to(device)
    expected, _ = official(tokens[:, :-1], labels, input_pos=torch.arange(n, device=device))
    return compare("LlamaGen teacher-forced logits", gpt(labels, tokens), expected)


def llamagen_samplers(official: torch.nn.Module, pair: Any, settings: dict[str, Any],
                      device: torch.device) -> tuple[Callable[[int, int], Any], Callable[[int, int], Any]]:
    from autoregressive.models.generate import generate

    from specray.methods.discrete.loop import generate_tokens

    n = pair.target.config.num_image_tokens
    num_classes = pair.target.config.num_classes

    def run_official(batch: int, rep: int) -> torch.Tensor:
        labels, _ = batch_inputs(batch, rep, num_classes, device)
        seed_official(rep)
        return generate(official, labels, n, cfg_scale=settings["cfg_scale"], cfg_interval=settings["cfg_interval"],
                        temperature=settings["temperature"], top_k=settings["top_k"], top_p=settings["top_p"],
                        sample_logits=True)

    def run_specray(batch: int, rep: int) -> torch.Tensor:
        labels, ids = batch_inputs(batch, rep, num_classes, device)
        return generate_tokens("target_only", settings, pair, labels, ids, seed=rep + 1)[0]

    return run_official, run_specray


def bench_llamagen(args: argparse.Namespace, folder: Path, device: torch.device) -> list[Row]:
    from safetensors.torch import save_file

    from specray.models.discrete_ar import load_pair

    import_official(args.official, "LlamaGen")
    # generate() enters torch.backends.cuda.sdp_kernel() every step; torch warns once that it is deprecated.
    warnings.filterwarnings("ignore", message=".*sdp_kernel.*", category=FutureWarning)
    arch, grid = LLAMAGEN_ARCH[args.size], LLAMAGEN_GRID[args.size]
    official = official_llamagen(arch, grid, device)
    path = folder / "c2i_random.safetensors"  # the HF mixin's layout: the GPT's own keys
    save_file({k: v.detach().cpu().contiguous() for k, v in official.state_dict().items()}, str(path))
    check = check_llamagen(official, load_pair(llamagen_reference(path, arch, grid, "float32"), None, device).target,
                           grid, device)
    ref = llamagen_reference(path, arch, grid, args.dtype)
    settings = format_options("discrete_ar", ref).sampling_defaults()
    print(f"LlamaGen c2i (official generate() vs specray target_only): {arch}, {grid}x{grid} tokens, {args.dtype}, "
          f"settings {settings}")
    print(check.line())
    if not check.ok:
        raise SystemExit("specray's logits differ from the official model's; timing them would compare different work")
    official = official.to(dtype=getattr(torch, args.dtype))
    pair = load_pair(ref, None, device)
    run_official, run_specray = llamagen_samplers(official, pair, settings, device)
    if args.check_only:
        return []
    return [paired_runs("llamagen", run_official, run_specray, batch, args.reps, device) for batch in args.batches]


# ---- MAR ---------------------------------------------------------------------------------------------


def official_mar(arch: dict[str, int], steps: int, device: torch.device) -> torch.nn.Module:
    from models.mar import MAR

    grid = int(arch["seq_len"] ** 0.5)
    model = MAR(img_size=16 * grid, vae_stride=16, patch_size=1, encoder_embed_dim=arch["width"],
                encoder_depth=arch["depth"], encoder_num_heads=arch["heads"], decoder_embed_dim=arch["width"],
                decoder_depth=arch["depth"], decoder_num_heads=arch["heads"], mlp_ratio=4,
                norm_layer=partial(torch.nn.LayerNorm, eps=1e-6), vae_embed_dim=arch["token_dim"],
                buffer_size=arch["buffer_size"], diffloss_d=arch["diffloss_depth"], diffloss_w=arch["diffloss_width"],
                num_sampling_steps=str(steps), class_num=arch["num_classes"]).eval()
    randomize(model, seed=2)
    return model.to(device)


def mar_reference(path: Path, arch: dict[str, int], steps: int) -> dict[str, Any]:
    return {"format": "mar", "path": str(path), "size": "custom", "arch": dict(arch), "num_sampling_steps": steps}


@torch.no_grad()
def check_mar(official: torch.nn.Module, generator: torch.nn.Module, device: torch.device) -> list[Check]:
    """z of the MAE encoder/decoder for a fixed mask (cond and null class), and the DiffLoss net's output."""
    net = generator.net
    c = net.config
    g = torch.Generator().manual_seed(0)
    tokens = torch.randn(2, c.seq_len, c.token_dim, generator=g).to(device)
    order = torch.stack([torch.randperm(c.seq_len, generator=g) for _ in range(2)]).to(device)
    mask = torch.zeros(2, c.seq_len, device=device).scatter(1, order[:, : c.seq_len * 3 // 4], 1.0)
    labels = torch.tensor([3, 999], device=device)
    checks = []
    for name, null in (("cond", False), ("null class", True)):
        embedding = official.fake_latent.repeat(2, 1) if null else official.class_emb(labels)
        expected = official.forward_mae_decoder(official.forward_mae_encoder(tokens, mask, embedding), mask)
        mine = net(tokens, mask.bool(), net.class_embedding(torch.full_like(labels, c.num_classes) if null else labels))
        checks.append(compare(f"MAR z ({name})", mine, expected))
    z = expected.reshape(-1, c.width)
    x = torch.randn(z.shape[0], c.token_dim, generator=g).to(device)
    t = torch.randint(0, 1000, (z.shape[0],), generator=g).to(device)
    checks.append(compare("MAR DiffLoss net output", net.diffloss.net(x, t, z), official.diffloss.net(x, t, z)))
    return checks


def mar_samplers(official: torch.nn.Module, pair: Any, settings: dict[str, Any],
                 device: torch.device) -> tuple[Callable[[int, int], Any], Callable[[int, int], Any]]:
    from specray.methods.continuous.loop import run_batch

    config = pair.target.config

    def run_official(batch: int, rep: int) -> torch.Tensor:
        labels, _ = batch_inputs(batch, rep, config.num_classes, device)
        seed_official(rep)
        return official.sample_tokens(batch, num_iter=config.seq_len, cfg=settings["cfg"],
                                      cfg_schedule=settings["cfg_schedule"], labels=labels,
                                      temperature=settings["temperature"])

    def run_specray(batch: int, rep: int) -> torch.Tensor:
        labels, ids = batch_inputs(batch, rep, config.num_classes, device)
        return run_batch("target_only", settings, pair, labels, ids, seed=rep + 1).images

    return run_official, run_specray


def bench_mar(args: argparse.Namespace, folder: Path, device: torch.device) -> list[Row]:
    from specray.models.continuous_ar import load_pair

    import_official(args.official, "mar")
    if device.type != "cuda":
        tensor_cuda_as_identity()  # the official sampler moves its tensors with .cuda()
    arch, steps = MAR_ARCH[args.size], args.mar_steps
    official = official_mar(arch, steps, device)
    path = folder / "mar_random.pth"  # the release layout: {"model_ema": state_dict}
    torch.save({"model_ema": {k: v.detach().cpu() for k, v in official.state_dict().items()}}, path)
    ref = mar_reference(path, arch, steps)
    pair = load_pair(ref, None, device)
    checks = check_mar(official, pair.target, device)
    settings = format_options("continuous_ar", ref).sampling_defaults()
    print(f"MAR (official sample_tokens(num_iter={arch['seq_len']}) vs specray target_only): {arch}, "
          f"settings {settings}")
    for check in checks:
        print(check.line())
    if not all(check.ok for check in checks):
        raise SystemExit("specray's MAR outputs differ from the official model's; timing them would compare different work")
    run_official, run_specray = mar_samplers(official, pair, settings, device)
    if args.check_only:
        return []
    return [paired_runs("mar", run_official, run_specray, batch, args.reps, device) for batch in args.batches]


# ---- main --------------------------------------------------------------------------------------------

FAMILIES = {"llamagen": ("LlamaGen", bench_llamagen), "mar": ("mar", bench_mar)}


def print_table(rows: list[Row]) -> None:
    print(f"\n{'family':<9} {'batch':>5} {'official s/sample':>17} {'specray s/sample':>16} "
          f"{'specray/official throughput':>27} {'90%':>9} {'(other clock)':>13}")
    for row in rows:
        other = "wall" if row.clock == "cpu" else "cpu"
        print(f"{row.family:<9} {row.batch:>5} {row.per_sample(row.official_s):>17.4f} "
              f"{row.per_sample(row.specray_s):>16.4f} {row.ratio():>26.2f}x {interval_text(row.interval()):>9} "
              f"{row.ratio(other):>12.2f}x")
    print(f"(clock: {rows[0].clock} time; ratio = median over repetitions of official time / specray time; 90%: its "
          "confidence interval)")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--official", type=Path, default=default_root(),
                    help="folder holding the official LlamaGen/ and mar/ code (default: $SPECRAY_OFFICIAL or "
                         "/tmp/official)")
    ap.add_argument("--families", default="llamagen,mar", help="comma-separated: llamagen, mar")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--size", choices=sorted(LLAMAGEN_ARCH), default="small")
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes (default 1,8; --quick 1,4)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions per batch (default 5; --quick 3)")
    ap.add_argument("--mar-steps", type=int, default=None, help="DiffLoss sampling steps (default 100; --quick 25)")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="LlamaGen weights (both sides)")
    ap.add_argument("--quick", action="store_true", help="smaller batches, fewer repetitions and DiffLoss steps")
    ap.add_argument("--check-only", action="store_true", help="only the network output checks, no timing")
    ap.add_argument("--json", type=Path, default=None, help="also write every timing here")
    args = ap.parse_args()
    args.batches = [int(b) for b in (args.batches or ("1,4" if args.quick else "1,8")).split(",")]
    args.reps = args.reps or (3 if args.quick else 5)
    args.mar_steps = args.mar_steps or (25 if args.quick else 100)
    args.families = [f for f in args.families.split(",") if f]
    unknown = sorted(set(args.families) - set(FAMILIES))
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    return args


def require_official_code(root: Path, families: list[str]) -> None:
    """Fail before any work if a family's official code is missing (import_official says how to get it)."""
    for family in families:
        name = FAMILIES[family][0]
        if missing_files(root, name):
            import_official(root, name)  # exits with the instructions


def main() -> None:
    args = parse_args()
    require_official_code(args.official, args.families)
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # process CPU time is a fair clock for one thread only
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="specray-vs-official-") as tmp:
        for family in args.families:
            family_rows = FAMILIES[family][1](args, Path(tmp), device)
            if family_rows:
                print_table(family_rows)
            rows += family_rows
    if len(args.families) > 1 and rows:
        print_table(rows)
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                         "rows": [{**asdict(row), "ratio_interval": row.interval()} for row in rows]},
                                        indent=1))


if __name__ == "__main__":
    main()
