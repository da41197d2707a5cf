"""The tiny release-format checkpoints under tests/fixtures/checkpoints/ (written by
tools/make_reference_fixtures.py from the official code) and the job references that name them."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"

# Must match the configurations in tools/make_reference_fixtures.py.
LLAMAGEN_ARCH = {"n_layer": 2, "n_head": 2, "dim": 32, "vocab_size": 64, "num_classes": 10, "multiple_of": 32}
LLAMAGEN_DRAFT_ARCH = {"n_layer": 1, "n_head": 2, "dim": 32, "vocab_size": 64, "num_classes": 10, "multiple_of": 32}
LLAMAGEN_VQ_ARCH = {"codebook_size": 64, "codebook_embed_dim": 8, "z_channels": 32, "ch": 32, "ch_mult": [1, 1],
                    "num_res_blocks": 1}


def assert_close(actual, expected: np.ndarray, atol: float = 1e-5) -> None:
    """Spec checkpoints.md's rule: ``|x - ref| <= atol + 1e-5 |ref|`` elementwise (x in float64)."""
    actual = actual.detach().cpu().double().numpy()
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    excess = np.abs(actual - expected) - (atol + 1e-5 * np.abs(expected))
    assert excess.max() <= 0, f"max excess {excess.max():.3g} over the tolerance"


def reference(family: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / family / "reference.npz", allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def llamagen_target(**overrides) -> dict:
    return {"format": "llamagen-c2i", "path": str(FIXTURES / "llamagen" / "c2i_tiny.pt"), "size": "custom",
            "image_size": 8, "tokenizer": str(FIXTURES / "llamagen" / "vq_tiny.pt"), "output_size": 16,
            "arch": dict(LLAMAGEN_ARCH), "tokenizer_arch": dict(LLAMAGEN_VQ_ARCH), **overrides}


def llamagen_draft(**overrides) -> dict:
    return {"format": "llamagen-c2i", "path": str(FIXTURES / "llamagen" / "c2i_tiny_draft_fsdp.pt"),
            "size": "custom", "image_size": 8, "arch": dict(LLAMAGEN_DRAFT_ARCH),
            "tokenizer_arch": dict(LLAMAGEN_VQ_ARCH), **overrides}


LLAMAGEN_T2I_ARCH = {"n_layer": 2, "n_head": 2, "dim": 32, "vocab_size": 64, "multiple_of": 32, "caption_dim": 16}
LLAMAGEN_T2I_DRAFT_ARCH = {**LLAMAGEN_T2I_ARCH, "n_layer": 1}


def llamagen_t2i_target(**overrides) -> dict:
    """The tiny t2i GPT; its tokenizer is the c2i fixture's VQ (the t2i release's VQ-16 has the same layout)."""
    return {"format": "llamagen-t2i", "path": str(FIXTURES / "llamagen_t2i" / "t2i_tiny.pt"), "size": "custom",
            "image_size": 8, "tokenizer": str(FIXTURES / "llamagen" / "vq_tiny.pt"), "output_size": 16,
            "arch": dict(LLAMAGEN_T2I_ARCH), "tokenizer_arch": dict(LLAMAGEN_VQ_ARCH), **overrides}


def llamagen_t2i_draft(**overrides) -> dict:
    return {"format": "llamagen-t2i", "path": str(FIXTURES / "llamagen_t2i" / "t2i_tiny_draft.pt"),
            "size": "custom", "image_size": 8, "arch": dict(LLAMAGEN_T2I_DRAFT_ARCH),
            "tokenizer_arch": dict(LLAMAGEN_VQ_ARCH), **overrides}


def tiny_reference(fmt: str, role: str) -> dict:
    """The tiny stand-in for a release reference of format ``fmt`` as ``role`` ("target" / "draft")."""
    makers = {"llamagen-c2i": (llamagen_target, llamagen_draft), "diffusers-ddpm": (ddpm_target, ddpm_draft),
              "llamagen-t2i": (llamagen_t2i_target, llamagen_t2i_draft),
              "mar": (mar_target, mar_draft), "diffusers-dit": (dit_target, dit_target)}
    target, draft = makers[fmt]
    return target() if role == "target" else draft()


def with_tiny_checkpoints(job: dict, output: str, classes: list[int], per_class: int, batch_size: int) -> dict:
    """A real-checkpoint job with every ``{format: ...}`` model replaced by its tiny fixture, a few
    samples, 20 denoising / DiffLoss steps and the digits feature extractor (no InceptionV3 weights
    here); arms, methods and their other parameters as written."""
    job = {**job, "output": output, "batch_size": batch_size, "shard_batches": 1, "num_gpus_per_actor": 0,
           "conditions": {"kind": "class_labels", "per_class": per_class, "classes": classes}}
    arms = []
    for arm in job["arms"]:
        arm = dict(arm)
        for role in ("target", "draft"):
            if isinstance(arm.get(role), dict):
                arm[role] = tiny_reference(arm[role]["format"], role)
        if "k" in (arm.get("params") or {}):  # LANTERN's neighbourhood must fit the tiny vocabulary (64)
            arm["params"] = {**arm["params"], "k": min(arm["params"]["k"], 8)}
        # Fewer denoising / DiffLoss steps than the official 1000 / 250 / 100, to keep CPU runs short.
        if arm["family"] == "diffusion":
            arm["params"] = {**(arm.get("params") or {}), "num_steps": 20}
        if arm["family"] == "continuous_ar":
            arm["params"] = {**(arm.get("params") or {}), "sample_steps": 20}
        arms.append(arm)
    job["arms"] = arms
    job["eval"] = {**job.get("eval", {}), "reference": "digits", "options": {"feature_extractor": "specray-digits",
                                                                             "bootstrap_replicates": 20,
                                                                             "speedup_replicates": 20}}
    return job


def ddpm_target(**overrides) -> dict:
    return {"format": "diffusers-ddpm", "path": str(FIXTURES / "ddpm" / "ddpm_tiny"), **overrides}


def ddpm_draft(**overrides) -> dict:
    return {"format": "diffusers-ddpm", "path": str(FIXTURES / "ddpm" / "ddpm_tiny_draft"), **overrides}


MAR_ARCH = {"width": 32, "depth": 2, "heads": 2, "diffloss_depth": 2, "diffloss_width": 32, "seq_len": 16,
            "token_dim": 4, "buffer_size": 4, "num_classes": 10}
MAR_DRAFT_ARCH = {**MAR_ARCH, "depth": 1, "diffloss_depth": 1}
KL_ARCH = {"embed_dim": 4, "ch": 32, "ch_mult": [1, 1], "num_res_blocks": 1}


def mar_target(**overrides) -> dict:
    return {"format": "mar", "path": str(FIXTURES / "mar" / "mar_tiny.pth"), "size": "custom",
            "arch": dict(MAR_ARCH), "vae": str(FIXTURES / "mar" / "kl_tiny.ckpt"), "vae_arch": dict(KL_ARCH),
            **overrides}


def mar_draft(**overrides) -> dict:
    return {"format": "mar", "path": str(FIXTURES / "mar" / "mar_tiny_draft.pth"), "size": "custom",
            "arch": dict(MAR_DRAFT_ARCH), **overrides}


@pytest.fixture(scope="module", autouse=False)
def single_thread():
    """One intra-op thread while a module runs: these tiny models are dominated by per-op overhead,
    which extra threads multiply on a loaded machine (as the actors do, one thread per CPU)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def dit_target(**overrides) -> dict:
    return {"format": "diffusers-dit", "path": str(FIXTURES / "dit" / "dit_tiny"), **overrides}


def tiny_t5_folder(folder: Path, d_model: int = 16) -> Path:
    """A T5 encoder with random weights from a transformers config (``d_model`` wide, the tiny t2i GPT's
    caption_dim) and a word-level tokenizer, saved as a local folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel

    words = ["<pad>", "</s>", "<unk>", "a", "an", "the", "of", "on", "with", "man", "cat", "dog", "table", "street"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(folder))
    torch.manual_seed(0)
    config = T5Config(vocab_size=len(words), d_model=d_model, d_kv=4, d_ff=32, num_layers=2, num_heads=2)
    T5EncoderModel(config).save_pretrained(str(folder), safe_serialization=True)
    return folder
