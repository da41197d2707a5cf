"""The digits feature extractor used for FID on the built-in presets (registered on import).

A small CNN classifier trained on the digits train split; its penultimate layer
(``fc1``, pre-activation) is the FID feature space, its logits serve Inception
Score. The model and its trainer live in ``specray/eval/digits_features.py``;
torch-fidelity knows it as ``specray-digits``.
"""

from specray.models.presets import Preset, register

DIGITS_FEATURES = register(
    Preset(
        name="digits-features",
        family="feature",
        role="feature",
        config={
            "conv_channels": [32, 64, 64],  # 8x8 -> 8x8 -> 4x4 -> 2x2
            "feature_dim": 64,  # penultimate layer width: the FID feature dimension
            "num_classes": 10,
            "image_size": 8,
        },
        train={
            "epochs": 40,
            "batch_size": 64,
            "learning_rate": 2e-3,
            "weight_decay": 1e-4,
            "max_shift": 1,  # random translation augmentation, pixels
            "split_seed": 0,  # load_digits_split's fixed 90/10 split
        },
    )
)
