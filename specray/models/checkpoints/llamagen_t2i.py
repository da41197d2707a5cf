"""LlamaGen text-to-image GPTs (``t2i_XL_stage1_256.pt``, ``t2i_XL_stage2_512.pt``) and their VQ-16
tokenizer (``vq_ds16_t2i.pt``).

The release is the c2i GPT with the class table replaced by the caption prefix (official
``autoregressive/models/gpt.py`` with ``model_type="t2i"``): ``cls_embedding.cap_proj.fc1/fc2``
(2048 -> 1280 -> 1280, no biases) and the ``cls_embedding.uncond_embedding`` buffer ``[120, 2048]``,
``cls_token_num`` 120 with all-zero RoPE rows for the prefix, 2-D RoPE over the image grid (16x16
at 256 px, 32x32 at 512 px). Files are ``{"model": state_dict}`` read like the c2i release's, keys
matched strictly. The VQ file has the c2i tokenizer's architecture and layout.
"""

from __future__ import annotations

import torch

from specray.models.checkpoints import llamagen
from specray.models.checkpoints.options import LlamaGenT2IOptions
from specray.models.presets import TEXT_NULL_INDEX


def condition_fields(options: LlamaGenT2IOptions) -> dict:
    """The GPTConfig fields of the caption prefix (``arch`` may set caption_dim / cls_token_num)."""
    # num_classes is the offset of the null caption ids (specray.models.captions), not a class count.
    return {"condition": "caption", "num_classes": TEXT_NULL_INDEX, "cls_token_num": 120, "caption_dim": 2048,
            "caption_padding": options.caption_padding}


def load(options: LlamaGenT2IOptions, device: torch.device | str) -> llamagen.LlamaGenModel:
    loaded = llamagen.load(options, device, **condition_fields(options))
    loaded.info["caption_padding"] = options.caption_padding
    return loaded
