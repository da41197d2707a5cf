"""Built-in continuous presets (registered on import).

MAR-style continuous-token models over the digits: 16 tokens (2×2 patches) of
dimension 4, a two-stream causal transformer with class prefix and KV cache,
and a per-token AdaLN MLP diffusion head (ε-prediction, learned variance,
cosine schedule of 1000 steps respaced to 50 at sampling). The draft is much
cheaper per token than the target (see ``continuous_ar.flops_per_token``);
most of the cost of a token is the 50-step head chain, so the head width sets
the ratio.
"""

from specray.models.presets import TEXT_NULL_INDEX, Preset, register

_COMMON = {
    "num_classes": 10,
    "num_tokens": 16,
    "token_dim": 4,
    "learn_sigma": True,
    "class_dropout_prob": 0.1,
    "diffusion_train_steps": 1000,
    "diffusion_sample_steps": 50,
}

# Shapes and recipes shared by the class and the text presets
_TARGET_SHAPE = {"dim": 96, "n_layer": 3, "n_head": 4, "head_width": 160, "head_blocks": 3}
_DRAFT_SHAPE = {"dim": 48, "n_layer": 1, "n_head": 2, "head_width": 64, "head_blocks": 2}
_TARGET_TRAIN = {"steps": 1500, "batch_size": 32, "lr": 2e-3, "warmup_steps": 100, "diffusion_batch_mul": 2}
_DRAFT_TRAIN = {"steps": 1500, "batch_size": 32, "lr": 3e-3, "warmup_steps": 100, "diffusion_batch_mul": 2}

DIGITS_MAR_TARGET = register(
    Preset(
        name="digits-mar-target",
        family="continuous_ar",
        role="target",
        config={**_COMMON, **_TARGET_SHAPE},
        train=dict(_TARGET_TRAIN),
    )
)

DIGITS_MAR_DRAFT = register(
    Preset(
        name="digits-mar-draft",
        family="continuous_ar",
        role="draft",
        config={**_COMMON, **_DRAFT_SHAPE},
        train=dict(_DRAFT_TRAIN),
    )
)

# Text-conditioned (prompt) presets: the class entry replaced by a MiniLM prompt embedding.
_TEXT = {**_COMMON, "num_classes": TEXT_NULL_INDEX, "condition": "text", "text_dim": 384}

DIGITS_MAR_TEXT_TARGET = register(
    Preset(
        name="digits-mar-text-target",
        family="continuous_ar",
        role="target",
        config={**_TEXT, **_TARGET_SHAPE, "text_encoder": "minilm"},
        train={**_TARGET_TRAIN, "steps": 2500},
    )
)

DIGITS_MAR_TEXT_DRAFT = register(
    Preset(
        name="digits-mar-text-draft",
        family="continuous_ar",
        role="draft",
        config={**_TEXT, **_DRAFT_SHAPE, "text_encoder": "minilm"},
        train=dict(_DRAFT_TRAIN),
    )
)
