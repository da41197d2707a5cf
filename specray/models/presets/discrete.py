"""Built-in discrete presets (registered on import).

Both are LlamaGen-style class-conditional GPTs over the 8x8 digits with 17
grey-level tokens (identity tokenizer). The draft is ~14x cheaper per token
than the target (see ``specray.models.discrete_ar.flops_per_token``).
"""

from specray.models.presets import Preset, register

_COMMON = {"vocab_size": 17, "num_classes": 10, "grid_size": 8, "class_dropout_prob": 0.1, "prefix_rope": "zeros"}

DIGITS_GPT_TARGET = register(
    Preset(
        name="digits-gpt-target",
        family="discrete_ar",
        role="target",
        config={**_COMMON, "dim": 96, "n_layer": 4, "n_head": 4},
        train={"steps": 800, "batch_size": 32, "lr": 3e-3, "weight_decay": 0.05, "warmup_steps": 50},
    )
)

DIGITS_GPT_DRAFT = register(
    Preset(
        name="digits-gpt-draft",
        family="discrete_ar",
        role="draft",
        config={**_COMMON, "dim": 48, "n_layer": 1, "n_head": 2},
        train={"steps": 3000, "batch_size": 64, "lr": 4e-3, "weight_decay": 0.01, "warmup_steps": 100},
    )
)
