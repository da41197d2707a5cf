"""The drafters LANTERN released for LlamaGen (``jadohu/llamagen_drafter``...) as EAGLE heads.

LANTERN's drafter (``models/drafters/cnets_llamagen.py``) is EAGLE-1's one-layer model written with
Hugging Face LLaMA module names; its ``config.json`` is an ``EConfig`` (LLaMA config fields plus
``input_type``). This maps both onto :class:`~specray.models.eagle_head.EagleHead`, whose names are
the discrete GPT's LlamaGen ones:

==========================================  ==========================================
LANTERN key                                 head key
==========================================  ==========================================
``embed_tokens.weight``                     ``embed_tokens.weight``
``fc.weight``, ``fc.bias``                  ``fc.weight``, ``fc.bias``
``layers.0.self_attn.{q,k,v}_proj.weight``  ``layer.attention.wqkv.weight`` (rows q, k, v)
``layers.0.self_attn.o_proj.weight``        ``layer.attention.wo.weight``
``layers.0.mlp.gate_proj.weight``           ``layer.feed_forward.w1.weight``
``layers.0.mlp.up_proj.weight``             ``layer.feed_forward.w3.weight``
``layers.0.mlp.down_proj.weight``           ``layer.feed_forward.w2.weight``
``layers.0.post_attention_layernorm.weight``  ``layer.ffn_norm.weight``
==========================================  ==========================================

The layer has no input norm (EAGLE-1's first layer drops it), ``fc`` has a bias unless the config
says ``bias: false``. The rotary table follows from ``input_type`` (LANTERN's code fixes the grid
and prefix per LlamaGen variant); the head at sequence position ``s`` uses the target's RoPE row
``s``, which is the row LANTERN's drafter uses at its index ``s - 1``. Loading is strict: a missing,
unexpected or wrongly shaped key is an error naming it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specray.models.checkpoints.reading import CheckpointError
from specray.models.draft_formats import LANTERN_INPUT_TYPES, LanternDrafter
from specray.models.eagle_head import EagleHead, EagleHeadConfig

_LAYER = "layers.0."


def head_config_from_lantern(config: dict[str, Any]) -> EagleHeadConfig:
    """The head's shape from a LANTERN ``config.json`` (already checked by :class:`LanternDrafter`)."""
    return EagleHeadConfig(
        vocab_size=int(config["vocab_size"]), dim=int(config["hidden_size"]), n_head=int(config["num_attention_heads"]),
        ffn_hidden=int(config["intermediate_size"]), norm_eps=float(config["rms_norm_eps"]),
        rope_base=10000.0, prefix_rope="zeros",  # LANTERN's drafter code fixes the base
        fc_bias=bool(config.get("bias", True)), input_norm=False, **LANTERN_INPUT_TYPES[config["input_type"]],
    )


def lantern_key_shapes(config: EagleHeadConfig) -> dict[str, tuple[int, ...]]:
    """Every key a LANTERN drafter of this shape holds, with its shape."""
    d, f, v = config.dim, config.ffn_hidden, config.vocab_size
    shapes = {"embed_tokens.weight": (v, d), "fc.weight": (d, 2 * d)}
    if config.fc_bias:
        shapes["fc.bias"] = (d,)
    for name in ("q", "k", "v", "o"):
        shapes[f"{_LAYER}self_attn.{name}_proj.weight"] = (d, d)
    shapes[f"{_LAYER}mlp.gate_proj.weight"] = (f, d)
    shapes[f"{_LAYER}mlp.up_proj.weight"] = (f, d)
    shapes[f"{_LAYER}mlp.down_proj.weight"] = (d, f)
    shapes[f"{_LAYER}post_attention_layernorm.weight"] = (d,)
    return shapes


def head_state_from_lantern(state: dict[str, torch.Tensor], config: EagleHeadConfig,
                            source: str = "checkpoint") -> dict[str, torch.Tensor]:
    """LANTERN's state dict in the head's layout (CheckpointError, a ValueError, naming any missing, unexpected or misshaped key)."""
    expected = lantern_key_shapes(config)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{source}: not a LANTERN drafter of this config: missing keys {missing}, "
                         f"unexpected keys {unexpected}")
    for key, shape in expected.items():
        if tuple(state[key].shape) != shape:
            raise CheckpointError(f"{source}: key {key!r} has shape {list(state[key].shape)}, expected {list(shape)}")
    s = {k: v.float() for k, v in state.items()}
    attn, mlp = f"{_LAYER}self_attn.", f"{_LAYER}mlp."
    out = {
        "embed_tokens.weight": s["embed_tokens.weight"],
        "fc.weight": s["fc.weight"],
        "layer.attention.wqkv.weight": torch.cat([s[f"{attn}q_proj.weight"], s[f"{attn}k_proj.weight"],
                                                  s[f"{attn}v_proj.weight"]]),
        "layer.attention.wo.weight": s[f"{attn}o_proj.weight"],
        "layer.feed_forward.w1.weight": s[f"{mlp}gate_proj.weight"],
        "layer.feed_forward.w3.weight": s[f"{mlp}up_proj.weight"],
        "layer.feed_forward.w2.weight": s[f"{mlp}down_proj.weight"],
        "layer.ffn_norm.weight": s[f"{_LAYER}post_attention_layernorm.weight"],
    }
    if config.fc_bias:
        out["fc.bias"] = s["fc.bias"]
    return out


def read_state(file: Path) -> dict[str, torch.Tensor]:
    """The drafter's tensors, read like every release checkpoint (``checkpoints/reading.py``): safetensors,
    or a pickle through ``torch.load(weights_only=True)`` only; a ``torch.compile`` prefix is dropped."""
    from specray.models.checkpoints.reading import read_checkpoint, select_entry, strip_compiled_prefix

    return strip_compiled_prefix(select_entry(read_checkpoint(file), (None,), file))


def load_lantern_drafter(options: LanternDrafter, device: torch.device | str = "cpu") -> EagleHead:
    """The family table's loader for ``{format: lantern-llamagen, ...}``."""
    config = head_config_from_lantern(options.read_config())
    file = options.weights_file()
    head = EagleHead(config)
    head.load_state_dict(head_state_from_lantern(read_state(file), config, str(file)))
    return head.to(device).eval()
