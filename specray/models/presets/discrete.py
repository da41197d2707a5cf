"""Built-in discrete presets (registered on import).

The target and the draft are LlamaGen-style class-conditional GPTs over the 8x8 digits with 17
grey-level tokens (identity tokenizer). The draft is ~22x cheaper per token
than the target in FLOPs (see ``specray.models.discrete_ar.flops_per_token``).
``digits-gpt-eagle`` is an EAGLE draft head for the target (one layer of the target's shape on its
hidden states, ``specray.models.eagle_head``), self-distilled from the target's generations.

The target is deep and narrow (12 layers, dim 64) rather than wide: at batch 1 on a CPU these
models are bound by per-layer dispatch, not FLOPs, so a call's cost grows with the number of
layers. Depth makes the target's call cost clearly above the 1-layer draft's in that regime
too, as with real targets (LlamaGen on a GPU), where speculative decoding is meant to pay.
"""

from specray.models.presets import TEXT_NULL_INDEX, Preset, register

_COMMON = {"vocab_size": 17, "num_classes": 10, "grid_size": 8, "class_dropout_prob": 0.1, "prefix_rope": "zeros"}
# Shapes and recipes shared by the class and the text presets
_TARGET_SHAPE = {"dim": 64, "n_layer": 12, "n_head": 4}
_DRAFT_SHAPE = {"dim": 48, "n_layer": 1, "n_head": 2}
_TARGET_TRAIN = {"steps": 1200, "batch_size": 32, "lr": 2e-3, "weight_decay": 0.05, "warmup_steps": 100}
_DRAFT_TRAIN = {"steps": 3000, "batch_size": 64, "lr": 4e-3, "weight_decay": 0.01, "warmup_steps": 100}

DIGITS_GPT_TARGET = register(
    Preset(
        name="digits-gpt-target",
        family="discrete_ar",
        role="target",
        config={**_COMMON, **_TARGET_SHAPE},
        train=dict(_TARGET_TRAIN),
    )
)

DIGITS_GPT_DRAFT = register(
    Preset(
        name="digits-gpt-draft",
        family="discrete_ar",
        role="draft",
        config={**_COMMON, **_DRAFT_SHAPE},
        train=dict(_DRAFT_TRAIN),
    )
)

DIGITS_GPT_EAGLE = register(
    Preset(
        name="digits-gpt-eagle",
        family="discrete_ar",
        role="draft",
        # One layer of the target's shape (dim 64, 4 heads, SwiGLU 192), EAGLE-1 layout.
        config={"kind": "eagle_head", "vocab_size": 17, "dim": 64, "n_head": 4, "ffn_hidden": 192, "grid_size": 8,
                "cls_token_num": 1, "norm_eps": 1e-5, "rope_base": 10000.0, "prefix_rope": "zeros",
                "fc_bias": True, "input_norm": False, "resid_dropout_p": 0.0, "ffn_dropout_p": 0.0},
        train={"target": "digits-gpt-target", "samples": 4000, "heldout_samples": 200, "cfg_scale": 1.5,
               "steps": 4000, "batch_size": 64, "lr": 3e-3, "warmup_steps": 100},
    )
)

# Text-conditioned (prompt) presets: the same architectures, the class token replaced by a MiniLM
# prompt embedding (specray.models.conditioning), trained on captions of the digits.
_TEXT = {**_COMMON, "num_classes": TEXT_NULL_INDEX, "condition": "text", "text_dim": 384}

DIGITS_GPT_TEXT_TARGET = register(
    Preset(
        name="digits-gpt-text-target",
        family="discrete_ar",
        role="target",
        config={**_TEXT, **_TARGET_SHAPE, "text_encoder": "minilm"},
        train=dict(_TARGET_TRAIN),
    )
)

DIGITS_GPT_TEXT_DRAFT = register(
    Preset(
        name="digits-gpt-text-draft",
        family="discrete_ar",
        role="draft",
        config={**_TEXT, **_DRAFT_SHAPE, "text_encoder": "minilm"},
        train=dict(_DRAFT_TRAIN),
    )
)
