"""Built-in diffusion presets (registered on import).

``digits-ddpm`` is the target DDPM on scikit-learn's digits (8x8, 1 channel,
T = 1000 training steps, class-conditional with a null class for CFG);
``digits-ddpm-draft`` is a smaller, separately trained UNet used as the
independent draft model. Both are trained by ``specray train <name>``.
"""

from specray.models.presets import TEXT_NULL_INDEX, Preset, register

_SHARED = {"sample_size": 8, "num_classes": 10, "num_train_timesteps": 1000, "beta_schedule": "linear"}

register(
    Preset(
        name="digits-ddpm",
        family="diffusion",
        role="target",
        config={**_SHARED, "block_out_channels": [32, 64, 64], "layers_per_block": 1, "norm_num_groups": 8},
        train={"steps": 1500, "batch_size": 128, "lr": 2e-3, "warmup": 100, "label_dropout": 0.1, "ema_decay": 0.995},
    )
)

register(
    Preset(
        name="digits-ddpm-draft",
        family="diffusion",
        role="draft",
        config={**_SHARED, "block_out_channels": [16, 32], "layers_per_block": 1, "norm_num_groups": 8},
        train={"steps": 1500, "batch_size": 128, "lr": 2e-3, "warmup": 100, "label_dropout": 0.1, "ema_decay": 0.995},
    )
)

# Text-conditioned (prompt) target: the class embedding replaced by a MiniLM prompt embedding.
# Its speculative arms draft with the Free or Frozen drafter (no draft network).
register(
    Preset(
        name="digits-ddpm-text",
        family="diffusion",
        role="target",
        config={**_SHARED, "num_classes": TEXT_NULL_INDEX, "condition": "text", "text_dim": 384,
                "text_encoder": "minilm", "block_out_channels": [32, 64, 64], "layers_per_block": 1,
                "norm_num_groups": 8},
        train={"steps": 1500, "batch_size": 128, "lr": 2e-3, "warmup": 100, "label_dropout": 0.1, "ema_decay": 0.995},
    )
)
