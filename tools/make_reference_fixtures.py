"""Write the reference fixtures of the release formats from the official code (random weights).

For each family this builds a tiny configuration of the OFFICIAL architecture with random weights,
saves it in the official file format and key layout under ``tests/fixtures/checkpoints/``, runs
the official code on fixed inputs and saves its outputs next to it (``reference.npz``). The tests
load the checkpoints with specray's loaders and compare their outputs with these arrays.

The official code is imported from copies kept OUTSIDE this repository (never commit it):

    OFFICIAL=/tmp/official
    git --git-dir=<LlamaGen mirror> show HEAD:autoregressive/models/gpt.py > $OFFICIAL/LlamaGen/...
    python tools/make_reference_fixtures.py --official $OFFICIAL [llamagen llamagen-t2i mar diffusers]

Expected layout: ``$OFFICIAL/LlamaGen/{autoregressive/models/gpt.py, autoregressive/models/generate.py,
tokenizer/tokenizer_image/vq_model.py, utils/drop_path.py}`` (FoundationVision/LlamaGen),
``$OFFICIAL/mar/{models/mar.py, models/diffloss.py, models/vae.py, diffusion/*.py}`` (LTH14/mar).
The diffusers models come from the installed ``diffusers`` package. README.md ("Reference
fixtures") lists the commands. Everything runs on the CPU in float32 with fixed seeds. The import
helpers are shared with ``bench/vs_official.py`` (``tools/official_code.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch
from official_code import default_root, import_official, randomize, tensor_cuda_as_identity

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "tests" / "fixtures" / "checkpoints"


def _half_rounded(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Round the weights to float16 in place (the fixture files store float16 to stay small; the
    loaders upcast) and return the float16 state dict to save."""
    with torch.no_grad():
        for p in module.state_dict(keep_vars=True).values():  # saved tensors only (not recomputed buffers)
            if p.is_floating_point():
                p.copy_(p.half().float())
    return {k: v.half() if v.is_floating_point() else v for k, v in module.state_dict().items()}


# ---- LlamaGen -----------------------------------------------------------------------------------

LLAMAGEN_GPT = dict(n_layer=2, n_head=2, dim=32, vocab_size=64, num_classes=10, multiple_of=32)
LLAMAGEN_DRAFT = dict(n_layer=1, n_head=2, dim=32, vocab_size=64, num_classes=10, multiple_of=32)
LLAMAGEN_VQ = dict(codebook_size=64, codebook_embed_dim=8, z_channels=32, ch=32, ch_mult=[1, 1], num_res_blocks=1)
LLAMAGEN_GRID = 4  # image 8 px, VQ downsampling 2
SETTINGS = {  # (cfg_scale, temperature, top_k, top_p, cfg_interval)
    "cfg4": (4.0, 1.0, 0, 1.0, -1),
    "mixed": (1.75, 0.9, 20, 0.9, 2),
}


def make_llamagen(root: Path) -> None:
    import_official(root, "LlamaGen")
    from autoregressive.models.generate import generate, logits_to_probs
    from autoregressive.models.gpt import ModelArgs, Transformer, precompute_freqs_cis_2d
    from tokenizer.tokenizer_image.vq_model import Decoder, Encoder, VQModel
    from tokenizer.tokenizer_image.vq_model import ModelArgs as VQArgs

    out = OUT / "llamagen"
    out.mkdir(parents=True, exist_ok=True)
    n = LLAMAGEN_GRID**2

    def gpt(arch, seed):
        model = Transformer(ModelArgs(block_size=n, cls_token_num=1, model_type="c2i", class_dropout_prob=0.1,
                                      **arch)).eval()
        randomize(model, seed, gain=1.5)
        return model

    target, draft = gpt(LLAMAGEN_GPT, 1), gpt(LLAMAGEN_DRAFT, 2)
    torch.save({"model": target.state_dict(), "steps": 1}, out / "c2i_tiny.pt")  # DDP layout (B / L / XL)
    torch.save(draft.state_dict(), out / "c2i_tiny_draft_fsdp.pt")  # bare FSDP layout (XXL / 3B)

    vq = VQModel(VQArgs(codebook_size=64, codebook_embed_dim=8, z_channels=32, dropout_p=0.0))
    vq.encoder = Encoder(ch=32, ch_mult=(1, 1), num_res_blocks=1, z_channels=32)
    vq.decoder = Decoder(ch=32, ch_mult=(1, 1), num_res_blocks=1, z_channels=32)
    vq.eval()
    randomize(vq, 3)
    torch.save({"model": _half_rounded(vq)}, out / "vq_tiny.pt")

    g = torch.Generator().manual_seed(0)
    labels = torch.tensor([3, 7])
    tokens = torch.randint(0, 64, (2, n), generator=g)
    ref: dict[str, np.ndarray] = {"labels": labels.numpy(), "tokens": tokens.numpy()}
    with torch.no_grad():
        full, _ = target(tokens[:, :-1], labels, input_pos=torch.arange(n))
        ref["full_logits"] = full.numpy()
        # The sampler's path: KV cache, [cond; uncond] rows, one token per call.
        target.setup_caches(max_batch_size=4, max_seq_length=1 + n, dtype=torch.float32)
        null = torch.full_like(labels, 10)
        steps = [target(None, torch.cat([labels, null]), input_pos=torch.arange(1))[0][:, -1]]
        for i in range(n - 1):
            x = tokens[:, i : i + 1]
            steps.append(target(torch.cat([x, x]), cond_idx=None, input_pos=torch.tensor([1 + i]))[0][:, -1])
        cached = torch.stack(steps, dim=1)  # [4, n, V]
        ref["cached_cond_logits"], ref["cached_uncond_logits"] = cached[:2].numpy(), cached[2:].numpy()
        for name, (cfg, temp, top_k, top_p, interval) in SETTINGS.items():
            probs = []
            for t in range(n):
                cond, uncond = cached[:2, t].clone(), cached[2:, t].clone()
                flag = t == 0 or interval == -1 or (t - 1) <= interval  # decode_n_tokens' cfg_flag
                logits = uncond + (cond - uncond) * cfg if flag else cond
                probs.append(logits_to_probs(logits, temperature=temp, top_k=top_k, top_p=top_p))
            ref[f"probs_{name}"] = torch.stack(probs, dim=1).numpy()
            greedy = generate(target, labels, n, cfg_scale=cfg, cfg_interval=interval, temperature=temp,
                              top_k=top_k, top_p=top_p, sample_logits=False)
            ref[f"greedy_{name}"] = greedy.numpy()
        ref["rope_head100_grid24"] = precompute_freqs_cis_2d(24, 100, 10000, 1).numpy()
        images = torch.rand(2, 3, 8, 8, generator=g) * 2 - 1
        ref["vq_images"] = images.numpy()
        ref["vq_codes"] = vq.encode(images)[2][2].reshape(2, -1).numpy()
        decoded = vq.decode_code(tokens, [2, 8, LLAMAGEN_GRID, LLAMAGEN_GRID])
        ref["vq_decoded"] = decoded.numpy()
        resized = torch.nn.functional.interpolate(decoded, size=(16, 16), mode="bicubic")
        ref["vq_uint8_16"] = torch.clamp(127.5 * resized + 128.0, 0, 255).permute(0, 2, 3, 1).to(torch.uint8).numpy()
    np.savez_compressed(out / "reference.npz", **ref)
    print(f"wrote {out}")


# ---- LlamaGen text-to-image -------------------------------------------------------------------------

LLAMAGEN_T2I_GPT = dict(n_layer=2, n_head=2, dim=32, vocab_size=64, multiple_of=32, caption_dim=16)
LLAMAGEN_T2I_DRAFT = dict(n_layer=1, n_head=2, dim=32, vocab_size=64, multiple_of=32, caption_dim=16)
T2I_PREFIX = 120  # cls_token_num of the release (the official CaptionEmbedder's null caption has 120 rows)
T2I_CAPTION_LENGTHS = (7, 31)  # valid T5 tokens of the two recorded captions
T2I_SETTINGS = {  # (cfg_scale, temperature, top_k, top_p): sample_t2i.py's defaults, and a mixed one
    "official": (7.5, 1.0, 1000, 1.0),
    "mixed": (4.0, 0.9, 20, 0.9),
}


def _official_t2i_inputs(features: torch.Tensor, mask: torch.Tensor, left: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """sample_t2i.py's preparation of T5 outputs: left padding by default, padded features zeroed."""
    if left:
        new_mask = torch.flip(mask, dims=[-1])
        rows = []
        for emb, m in zip(features, mask):
            valid = int(m.sum().item())
            rows.append(torch.cat([emb[valid:], emb[:valid]]))
        new_features = torch.stack(rows)
    else:
        new_features, new_mask = features, mask
    return new_features * new_mask[:, :, None], new_mask


def _t2i_attention_mask(emb_masks: torch.Tensor, length: int) -> torch.Tensor:
    """dataset/t2i.py's training mask (and generate()'s): causal, caption padding hidden, diagonal kept."""
    mask = torch.tril(torch.ones(length, length))[None].repeat(emb_masks.shape[0], 1, 1)
    mask[:, :, :T2I_PREFIX] = mask[:, :, :T2I_PREFIX] * emb_masks[:, None, :]
    eye = torch.eye(length)
    return (mask * (1 - eye) + eye).to(torch.bool)[:, None]


def make_llamagen_t2i(root: Path) -> None:
    import_official(root, "LlamaGen")
    from autoregressive.models.generate import generate, logits_to_probs
    from autoregressive.models.gpt import ModelArgs, Transformer

    out = OUT / "llamagen_t2i"
    out.mkdir(parents=True, exist_ok=True)
    n = LLAMAGEN_GRID**2

    def gpt(arch, seed):
        torch.manual_seed(seed)  # the null caption (a buffer) is drawn at construction
        model = Transformer(ModelArgs(block_size=n, cls_token_num=T2I_PREFIX, model_type="t2i",
                                      class_dropout_prob=0.1, **arch)).eval()
        randomize(model, seed, gain=1.5)
        return model

    target, draft = gpt(LLAMAGEN_T2I_GPT, 41), gpt(LLAMAGEN_T2I_DRAFT, 42)
    torch.save({"model": _half_rounded(target), "steps": 1}, out / "t2i_tiny.pt")  # {"model": ...} as released
    torch.save({"model": _half_rounded(draft)}, out / "t2i_tiny_draft.pt")

    g = torch.Generator().manual_seed(0)
    dim = LLAMAGEN_T2I_GPT["caption_dim"]
    # Encoder outputs as T5Embedder returns them: right-padded to 120, non-zero at padded positions.
    features = torch.randn(2, T2I_PREFIX, dim, generator=g)
    mask = torch.zeros(2, T2I_PREFIX, dtype=torch.long)
    for b, length in enumerate(T2I_CAPTION_LENGTHS):
        mask[b, :length] = 1
    tokens = torch.randint(0, 64, (2, n), generator=g)
    ref: dict[str, np.ndarray] = {"caption_features": features.numpy(), "caption_mask": mask.numpy(),
                                  "tokens": tokens.numpy()}
    length = T2I_PREFIX + n - 1
    with torch.no_grad():
        for name, left in (("left", True), ("right", False)):
            cond, emb_masks = _official_t2i_inputs(features, mask, left)
            full, _ = target(tokens[:, :-1], cond, input_pos=torch.arange(length),
                             mask=_t2i_attention_mask(emb_masks, length))
            ref[f"full_logits_{name}"] = full[:, T2I_PREFIX - 1:].numpy()
        cond, emb_masks = _official_t2i_inputs(features, mask, True)
        # The sampler's path (generate()): KV cache, [cond; null caption] rows under the same masks.
        target.setup_caches(max_batch_size=4, max_seq_length=length + 1, dtype=torch.float32)
        target.causal_mask[:, :, :T2I_PREFIX] *= torch.cat([emb_masks, emb_masks]).unsqueeze(1).bool()
        eye = torch.eye(target.causal_mask.size(1), dtype=torch.bool)
        target.causal_mask[:] = target.causal_mask & ~eye | eye
        null = torch.zeros_like(cond) + target.cls_embedding.uncond_embedding
        steps = [target(None, torch.cat([cond, null]), input_pos=torch.arange(T2I_PREFIX))[0][:, -1]]
        for i in range(n - 1):
            x = tokens[:, i : i + 1]
            steps.append(target(torch.cat([x, x]), cond_idx=None, input_pos=torch.tensor([T2I_PREFIX + i]))[0][:, -1])
        cached = torch.stack(steps, dim=1)  # [4, n, V]
        ref["cached_cond_logits"], ref["cached_uncond_logits"] = cached[:2].numpy(), cached[2:].numpy()
        for name, (cfg, temp, top_k, top_p) in T2I_SETTINGS.items():
            probs = [logits_to_probs(cached[2:, t] + (cached[:2, t] - cached[2:, t]) * cfg, temperature=temp,
                                     top_k=top_k, top_p=top_p) for t in range(n)]
            ref[f"probs_{name}"] = torch.stack(probs, dim=1).numpy()
            greedy = generate(target, cond, n, emb_masks, cfg_scale=cfg, temperature=temp, top_k=top_k, top_p=top_p,
                              sample_logits=False)
            ref[f"greedy_{name}"] = greedy.numpy()
        greedy = generate(target, cond, n, emb_masks, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0,
                          sample_logits=False)
        ref["greedy_nocfg"] = greedy.numpy()
    np.savez_compressed(out / "reference.npz", **ref)
    print(f"wrote {out}")


# ---- MAR + DiffLoss + KL ----------------------------------------------------------------------------

MAR_TINY = dict(img_size=8, vae_stride=2, patch_size=1, encoder_embed_dim=32, encoder_depth=2, encoder_num_heads=2,
                decoder_embed_dim=32, decoder_depth=2, decoder_num_heads=2, mlp_ratio=4, vae_embed_dim=4,
                buffer_size=4, diffloss_d=2, diffloss_w=32, num_sampling_steps="100", class_num=10)
MAR_TINY_DRAFT = {**MAR_TINY, "encoder_depth": 1, "decoder_depth": 1, "diffloss_d": 1}


class _NoiseRecorder:
    """Records every torch.randn / randn_like draw (the official DiffLoss sampler's noise)."""

    def __init__(self) -> None:
        self.draws: list[torch.Tensor] = []
        self._randn, self._randn_like = torch.randn, torch.randn_like

    def __enter__(self) -> "_NoiseRecorder":
        def randn(*args, **kwargs):
            out = self._randn(*args, **kwargs)
            self.draws.append(out.clone())
            return out

        def randn_like(x, **kwargs):
            out = self._randn_like(x, **kwargs)
            self.draws.append(out.clone())
            return out

        torch.randn, torch.randn_like = randn, randn_like
        return self

    def __exit__(self, *exc) -> None:
        torch.randn, torch.randn_like = self._randn, self._randn_like


def make_mar(root: Path) -> None:
    import argparse as ap
    from functools import partial

    import_official(root, "mar")
    tensor_cuda_as_identity()  # the official sampler moves tensors with .cuda(); this machine has no GPU
    from models.mar import MAR
    from models.vae import AutoencoderKL, Decoder, Encoder

    out = OUT / "mar"
    out.mkdir(parents=True, exist_ok=True)
    norm = partial(torch.nn.LayerNorm, eps=1e-6)

    def mar(config, seed):
        model = MAR(norm_layer=norm, **config).eval()
        randomize(model, seed)
        return model

    target, ema, draft = mar(MAR_TINY, 21), mar(MAR_TINY, 22), mar(MAR_TINY_DRAFT, 23)
    args = ap.Namespace(model="mar_tiny", num_iter=16, cfg=3.0)
    torch.save({"model": _half_rounded(target), "model_ema": _half_rounded(ema), "epoch": 1, "args": args},
               out / "mar_tiny.pth")
    torch.save({"model": _half_rounded(mar(MAR_TINY_DRAFT, 24)), "model_ema": _half_rounded(draft), "epoch": 1},
               out / "mar_tiny_draft.pth")

    vae = AutoencoderKL(embed_dim=4, ch_mult=(1, 1))
    vae.encoder = Encoder(ch=32, ch_mult=(1, 1), num_res_blocks=1, resolution=32, z_channels=4)
    vae.decoder = Decoder(ch=32, ch_mult=(1, 1), num_res_blocks=1, resolution=32, z_channels=4)
    vae.quant_conv = torch.nn.Conv2d(8, 8, 1)
    vae.post_quant_conv = torch.nn.Conv2d(4, 4, 1)
    vae.eval()
    randomize(vae, 25)
    state = _half_rounded(vae)
    state["loss.logvar"] = torch.zeros(())  # LDM training checkpoints carry their loss module
    torch.save({"model": state}, out / "kl_tiny.ckpt")

    g = torch.Generator().manual_seed(0)
    ref: dict[str, np.ndarray] = {}
    model = ema  # evaluation uses model_ema
    with torch.no_grad():
        tokens = torch.randn(2, 16, 4, generator=g)
        order = torch.stack([torch.randperm(16, generator=g) for _ in range(2)])
        mask = torch.zeros(2, 16)
        mask.scatter_(1, order[:, :10], 1.0)  # 10 of 16 masked (the first 10 of MAR's order)
        labels = torch.tensor([3, 7])
        for name, embedding in (("cond", model.class_emb(labels)), ("uncond", model.fake_latent.repeat(2, 1))):
            z = model.forward_mae_decoder(model.forward_mae_encoder(tokens, mask, embedding), mask)
            ref[f"z_{name}"] = z.numpy()
        ref.update(tokens=tokens.numpy(), mask=mask.numpy(), labels=labels.numpy())
        # One DiffLoss sample with CFG 3 at temperature 0.95, and one without CFG, for recorded noise.
        z_rows = torch.cat([torch.tensor(ref["z_cond"][:, 12]), torch.tensor(ref["z_uncond"][:, 12])])
        for name, cfg, rows in (("cfg", 3.0, z_rows), ("nocfg", 1.0, z_rows[:2])):
            with _NoiseRecorder() as rec:
                sample = model.diffloss.sample(rows, temperature=0.95, cfg=cfg)
            ref[f"diffloss_{name}_z"] = rows.numpy()
            ref[f"diffloss_{name}_xT"] = rec.draws[0][:2].numpy()
            ref[f"diffloss_{name}_noise"] = torch.stack([d[:2] for d in rec.draws[1:]], dim=1).numpy()  # step T-1 first
            ref[f"diffloss_{name}_sample"] = sample[:2].numpy()
        # The whole sampler at num_iter = L (one token per step), linear CFG 3, with recorded order and noise.
        mar_order = torch.stack([torch.randperm(16, generator=g) for _ in range(2)])
        model.sample_orders = lambda bsz: mar_order.clone()
        with _NoiseRecorder() as rec:
            sampled = model.sample_tokens(2, num_iter=16, cfg=3.0, cfg_schedule="linear", labels=labels, temperature=1.0)
        per_step = len(rec.draws) // 16  # x_T, then one draw per diffusion step
        ref["sample_order"] = mar_order.numpy()
        ref["sample_xT"] = torch.stack([rec.draws[k * per_step][:2] for k in range(16)], 1).numpy()
        ref["sample_noise"] = torch.stack([torch.stack([d[:2] for d in rec.draws[k * per_step + 1 : (k + 1) * per_step]], 1)
                                           for k in range(16)], 1).numpy()  # [B, step k, diffusion step, C]
        ref["sample_tokens"] = model.patchify(sampled).numpy()  # [B, L, C] spatial
        latents = torch.tensor(ref["sample_tokens"]).reshape(2, 4, 4, 4).permute(0, 3, 1, 2)
        images = vae.decode(latents / 0.2325)
        ref["vae_decoded"] = images.numpy()
        ref["vae_uint8"] = np.round(np.clip(((images + 1) / 2).numpy().transpose(0, 2, 3, 1) * 255, 0, 255)).astype(np.uint8)
    np.savez_compressed(out / "reference.npz", **ref)
    print(f"wrote {out}")


# ---- diffusers pixel DDPM --------------------------------------------------------------------------

DDPM_UNET = dict(sample_size=8, in_channels=3, out_channels=3, block_out_channels=(32, 32), layers_per_block=1,
                 down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                 attention_head_dim=None, freq_shift=1, flip_sin_to_cos=False, downsample_padding=0, norm_eps=1e-6)
# google/ddpm-cifar10-32's early scheduler_config.json layout.
DDPM_SCHEDULER = {"_class_name": "DDPMScheduler", "_diffusers_version": "0.1.1", "timesteps": 1000,
                  "beta_start": 0.0001, "beta_end": 0.02, "beta_schedule": "linear", "variance_type": "fixed_large",
                  "clip_sample": True, "trained_betas": None}
LEGACY = {"to_q": "query", "to_k": "key", "to_v": "value", "to_out.0": "proj_attn"}


def make_diffusers(root: Path) -> None:  # noqa: ARG001  (diffusers is the installed package)
    import json
    import re

    from diffusers import DDPMScheduler, UNet2DModel
    from diffusers.utils.torch_utils import randn_tensor
    from safetensors.torch import save_file

    out = OUT / "ddpm"
    ref: dict[str, np.ndarray] = {}
    for name, seed, legacy in (("ddpm_tiny", 11, True), ("ddpm_tiny_draft", 12, False)):
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        unet = UNet2DModel(**DDPM_UNET).eval()
        randomize(unet, seed)
        unet.save_config(folder)
        (folder / "scheduler_config.json").write_text(json.dumps(DDPM_SCHEDULER, indent=2))
        state = _half_rounded(unet)
        if legacy:  # early hub weights: legacy attention names in a pickled .bin
            state = {re.sub(r"\.(to_q|to_k|to_v|to_out\.0)\.", lambda m: f".{LEGACY[m.group(1)]}.", k): v
                     for k, v in state.items()}
            torch.save(state, folder / "diffusion_pytorch_model.bin")
        else:
            save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "diffusion_pytorch_model.safetensors"))
        if legacy:
            target = unet
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 8, 8, generator=g)
    ref["x"] = x.numpy()
    with torch.no_grad():
        ref["unet_t"] = np.array([500, 37])
        ref["unet_out"] = target(x, torch.tensor([500, 37])).sample.numpy()
        cases = {"large1000": ("fixed_large", 1000, 500), "large10": ("fixed_large", 10, 900),
                 "small1000": ("fixed_small", 1000, 500), "large1000_last": ("fixed_large", 1000, 0)}
        for case, (variance, steps, t) in cases.items():
            config = {k: v for k, v in DDPM_SCHEDULER.items() if not k.startswith("_") and k != "timesteps"}
            scheduler = DDPMScheduler(num_train_timesteps=1000, **{**config, "variance_type": variance})
            scheduler.set_timesteps(steps)
            eps = target(x, torch.tensor([t, t])).sample
            noise = randn_tensor(x.shape, generator=torch.Generator().manual_seed(5))
            prev = scheduler.step(eps, t, x, generator=torch.Generator().manual_seed(5)).prev_sample
            ref[f"step_{case}_noise"], ref[f"step_{case}"] = noise.numpy(), prev.numpy()
            ref[f"step_{case}_t"] = np.array(t)
    np.savez_compressed(out / "reference.npz", **ref)
    print(f"wrote {out}")
    make_dit()


def make_dit() -> None:
    """A tiny DiT pipeline folder (transformer/, vae/, scheduler/) as diffusers saves facebook/DiT-XL-2-256."""
    from diffusers import AutoencoderKL, DDPMScheduler, DiTTransformer2DModel

    out = OUT / "dit"
    folder = out / "dit_tiny"
    transformer = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8,
                                        num_layers=1, sample_size=4, patch_size=2, num_embeds_ada_norm=10).eval()
    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(32, 32),
                        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
                        layers_per_block=1, norm_num_groups=32, sample_size=8).eval()
    randomize(transformer, 31)
    randomize(vae, 32)
    for model in (transformer, vae):
        _half_rounded(model)
    DDPMScheduler(num_train_timesteps=1000, beta_schedule="linear").save_pretrained(folder / "scheduler")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 4, 4, generator=g)
    with torch.no_grad():
        ref = {"x": x.numpy(), "t": np.array([500, 37]), "labels": np.array([3, 10])}
        ref["transformer_out"] = transformer(x, timestep=torch.tensor([500, 37]), class_labels=torch.tensor([3, 10])).sample.numpy()
        ref["vae_decoded"] = vae.decode(x / vae.config.scaling_factor).sample.numpy()
    for name, model in (("transformer", transformer), ("vae", vae)):  # after the reference: half() rounds buffers too
        model.half().save_pretrained(folder / name)  # float16 files; the loader upcasts
    np.savez_compressed(out / "reference.npz", **ref)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--official", type=Path, default=default_root(),
                        help="folder holding LlamaGen/ and mar/ (default: $SPECRAY_OFFICIAL or /tmp/official)")
    parser.add_argument("families", nargs="*", default=["llamagen", "llamagen-t2i", "mar", "diffusers"])
    args = parser.parse_args()
    torch.manual_seed(0)
    makers = {"llamagen": make_llamagen, "llamagen-t2i": make_llamagen_t2i, "mar": make_mar,
              "diffusers": make_diffusers}
    for name in args.families:
        makers[name](args.official)


if __name__ == "__main__":
    main()
