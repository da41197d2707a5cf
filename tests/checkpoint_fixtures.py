"""The tiny release-format checkpoints under tests/fixtures/checkpoints/ (written by
tools/make_reference_fixtures.py from the official code) and the job references that name them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "checkpoints"

# Must match the configurations in tools/make_reference_fixtures.py.
LLAMAGEN_ARCH = {"n_layer": 2, "n_head": 2, "dim": 32, "vocab_size": 64, "num_classes": 10, "multiple_of": 32}
LLAMAGEN_DRAFT_ARCH = {"n_layer": 1, "n_head": 2, "dim": 32, "vocab_size": 64, "num_classes": 10, "multiple_of": 32}
LLAMAGEN_VQ_ARCH = {"codebook_size": 64, "codebook_embed_dim": 8, "z_channels": 32, "ch": 32, "ch_mult": [1, 1],
                    "num_res_blocks": 1}


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
