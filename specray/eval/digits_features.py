"""The digits feature extractor: a small CNN classifier, registered with torch-fidelity.

FID on the built-in presets needs a feature space in which 8x8 digits are
meaningful; Inception on upsampled 8x8 images is not. This module trains a small
classifier on the digits train split (``specray train digits-features``) and
exposes its penultimate layer to torch-fidelity as the feature extractor
``specray-digits``:

    torch_fidelity.calculate_metrics(input1=..., input2=..., fid=True,
                                     feature_extractor="specray-digits", cuda=False)

Inputs follow torch-fidelity's convention, uint8 ``[N, 3, H, W]``; the extractor
averages the channels to grey and area-resizes to 8x8 when needed.

Features provided: ``fc1`` (pre-activation penultimate layer, the FID default:
no dead ReLU units, so covariances are full rank), ``fc1_relu`` and ``logits``
(the Inception Score default). Features are returned in float64 so torch-fidelity's
statistics (``np.mean``/``np.cov``) are computed in float64.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specray.eval import forward_memo

FEATURE_EXTRACTOR_NAME = "specray-digits"
PRESET_NAME = "digits-features"
FEATURES = ("fc1", "fc1_relu", "logits")


class DigitsClassifier(nn.Module):
    """conv32 -> conv64 -> pool -> conv64 -> pool -> fc(feature_dim) -> fc(classes) on 8x8 grey in [0, 1]."""

    def __init__(self, conv_channels: list[int], feature_dim: int, num_classes: int, image_size: int = 8) -> None:
        super().__init__()
        c1, c2, c3 = conv_channels
        self.image_size = image_size
        self.conv1 = nn.Conv2d(1, c1, 3, padding=1)
        self.conv2 = nn.Conv2d(c1, c2, 3, padding=1)
        self.conv3 = nn.Conv2d(c2, c3, 3, padding=1)
        pooled = image_size // 4
        self.fc1 = nn.Linear(c3 * pooled * pooled, feature_dim)
        self.fc2 = nn.Linear(feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x: float [N, 1, 8, 8] in [0, 1] -> {"fc1", "fc1_relu", "logits"}."""
        h = F.relu(self.conv1(x))
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        h = F.max_pool2d(F.relu(self.conv3(h)), 2)
        fc1 = self.fc1(h.flatten(1))
        fc1_relu = F.relu(fc1)
        return {"fc1": fc1, "fc1_relu": fc1_relu, "logits": self.fc2(fc1_relu)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x)["logits"]


def uint8_to_model_input(images: torch.Tensor, image_size: int = 8) -> torch.Tensor:
    """uint8 ``[N,3,H,W]``, ``[N,1,H,W]``, ``[N,H,W,3]`` or ``[N,H,W]`` -> float32 ``[N,1,8,8]`` in [0, 1]."""
    if images.dtype != torch.uint8:
        raise ValueError(f"images must be uint8 (0..255), got dtype {images.dtype}")
    x = images
    if x.dim() == 3:  # [N, H, W] grey
        x = x[:, None]
    elif x.dim() == 4 and x.shape[1] not in (1, 3) and x.shape[-1] in (1, 3):  # channels last
        x = x.permute(0, 3, 1, 2)
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"images must be [N,3,H,W], [N,1,H,W], [N,H,W,3] or [N,H,W]; got shape {tuple(images.shape)}")
    x = x.to(torch.float32).mean(dim=1, keepdim=True) / 255.0
    if x.shape[-2:] != (image_size, image_size):
        x = F.adaptive_avg_pool2d(x, image_size)  # area resize: digits presets already are 8x8
    return x


# ---------------------------------------------------------------------------------------------
# weights


def _preset():
    from specray.models.presets import get_preset

    return get_preset(PRESET_NAME)


def build_model() -> DigitsClassifier:
    config = _preset().config
    return DigitsClassifier(config["conv_channels"], config["feature_dim"], config["num_classes"], config["image_size"])


def load_model(weights_path: str | os.PathLike | None = None, device: torch.device | str = "cpu") -> DigitsClassifier:
    """The trained classifier in float32, eval mode (weights read with safetensors: no unpickling)."""
    from safetensors.torch import load_file

    path = Path(weights_path) if weights_path is not None else _preset().weights_path
    if not path.is_file():
        raise FileNotFoundError(
            f"digits feature extractor weights not found at {path}; run `specray train {PRESET_NAME}` to create them"
        )
    model = build_model()
    state = {k: v.to(torch.float32) for k, v in load_file(str(path)).items()}
    model.load_state_dict(state)
    return model.to(device).eval().requires_grad_(False)


def weights_metadata(weights_path: str | os.PathLike | None = None) -> dict[str, str]:
    from safetensors import safe_open

    path = Path(weights_path) if weights_path is not None else _preset().weights_path
    with safe_open(str(path), framework="pt") as handle:
        return dict(handle.metadata() or {})


# ---------------------------------------------------------------------------------------------
# training


@dataclass
class TrainRecord:
    seed: int
    epochs: int
    steps: int
    train_loss: float
    train_accuracy: float
    heldout_accuracy: float
    heldout_nll: float
    wall_time_s: float


def _random_shift(x: torch.Tensor, max_shift: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels (zero fill): cheap augmentation."""
    if max_shift == 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    offsets = torch.randint(0, 2 * max_shift + 1, (n, 2), generator=generator)
    rows = offsets[:, 0, None] + torch.arange(h)[None]  # [n, h]
    cols = offsets[:, 1, None] + torch.arange(w)[None]  # [n, w]
    idx_n = torch.arange(n)[:, None, None]
    return padded[idx_n, 0, rows[:, :, None], cols[:, None, :]][:, None]


def _evaluate(model: DigitsClassifier, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    with torch.no_grad():
        logits = model(x)
        nll = F.cross_entropy(logits, y).item()
        accuracy = (logits.argmax(-1) == y).double().mean().item()
    return accuracy, nll


def train_model(seed: int = 0) -> tuple[DigitsClassifier, TrainRecord]:
    """Deterministic training on the digits train split (single thread; a few seconds on one core)."""
    from specray.models.digits import load_digits_split, to_uint8_pixels

    hp = _preset().train
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(1)  # determinism and fairness to the other engineers' processes
    try:
        torch.manual_seed(seed)
        generator = torch.Generator().manual_seed(seed)
        train_images, train_labels = load_digits_split("train", seed=hp["split_seed"])
        heldout_images, heldout_labels = load_digits_split("heldout", seed=hp["split_seed"])
        x_train = uint8_to_model_input(to_uint8_pixels(train_images))
        x_heldout = uint8_to_model_input(to_uint8_pixels(heldout_images))

        model = build_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=hp["learning_rate"], weight_decay=hp["weight_decay"])
        n = x_train.shape[0]
        steps_per_epoch = (n + hp["batch_size"] - 1) // hp["batch_size"]
        total_steps = hp["epochs"] * steps_per_epoch
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=total_steps)
        start = time.perf_counter()
        step = 0
        running_loss = 0.0
        for _ in range(hp["epochs"]):
            model.train()
            order = torch.randperm(n, generator=generator)
            running_loss, seen = 0.0, 0
            for begin in range(0, n, hp["batch_size"]):
                idx = order[begin : begin + hp["batch_size"]]
                xb = _random_shift(x_train[idx], hp["max_shift"], generator)
                loss = F.cross_entropy(model(xb), train_labels[idx])
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                running_loss += loss.item() * len(idx)
                seen += len(idx)
                step += 1
            running_loss /= seen
        model.eval()
        train_accuracy, _ = _evaluate(model, x_train, train_labels)
        heldout_accuracy, heldout_nll = _evaluate(model, x_heldout, heldout_labels)
        record = TrainRecord(
            seed=seed,
            epochs=hp["epochs"],
            steps=step,
            train_loss=running_loss,
            train_accuracy=train_accuracy,
            heldout_accuracy=heldout_accuracy,
            heldout_nll=heldout_nll,
            wall_time_s=time.perf_counter() - start,
        )
    finally:
        torch.set_num_threads(previous_threads)
    return model.requires_grad_(False), record


def train_preset(name: str, out_dir: Path, seed: int = 0) -> Path:
    """Train ``digits-features`` and write ``<out_dir>/digits-features.safetensors``; returns the path."""
    from safetensors.torch import save_file

    if name != PRESET_NAME:
        raise ValueError(f"train_preset: name must be {PRESET_NAME!r} for the feature trainer, got {name!r}")
    model, record = train_model(seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{PRESET_NAME}.safetensors"
    metadata = {
        "preset": PRESET_NAME,
        "seed": str(record.seed),
        "epochs": str(record.epochs),
        "steps": str(record.steps),
        "train_loss": f"{record.train_loss:.6f}",
        "train_accuracy": f"{record.train_accuracy:.6f}",
        "heldout_accuracy": f"{record.heldout_accuracy:.6f}",
        "heldout_nll": f"{record.heldout_nll:.6f}",
        "config": json.dumps(_preset().config, sort_keys=True),
        "train": json.dumps(_preset().train, sort_keys=True),
        "torch_version": torch.__version__,
    }
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    tmp = path.with_suffix(".safetensors.tmp")
    save_file(state, str(tmp), metadata=metadata)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------------------------
# torch-fidelity


def _feature_extractor_class():
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase

    class FeatureExtractorSpecrayDigits(FeatureExtractorBase):
        """torch-fidelity adapter: uint8 [N,3,H,W] -> digits classifier features (float64)."""

        def __init__(
            self,
            name: str,
            features_list: list[str],
            feature_extractor_weights_path: str | None = None,
            feature_extractor_internal_dtype: str | None = None,
            **kwargs,
        ) -> None:
            super().__init__(name, features_list)
            if feature_extractor_internal_dtype not in (None, "float32", "float64"):
                raise ValueError(
                    "feature_extractor_internal_dtype must be 'float32' or 'float64', "
                    f"got {feature_extractor_internal_dtype!r}"
                )
            self.internal_dtype = torch.float64 if feature_extractor_internal_dtype == "float64" else torch.float32
            self.model = load_model(feature_extractor_weights_path).to(self.internal_dtype)
            self.identity = (FEATURE_EXTRACTOR_NAME, str(feature_extractor_weights_path), str(self.internal_dtype))

        @staticmethod
        def get_provided_features_list():
            return FEATURES

        @staticmethod
        def get_default_feature_layer_for_metric(metric):
            return {"isc": "logits", "fid": "fc1", "kid": "fc1", "prc": "fc1_relu"}[metric]

        @staticmethod
        def can_be_compiled():
            return False

        @staticmethod
        def get_dummy_input_for_compile():
            return torch.zeros(1, 3, 8, 8, dtype=torch.uint8)

        def forward(self, x: torch.Tensor):
            memo = forward_memo.active()  # the reducer's: torch-fidelity's pass recalls the streamed pass's batches
            key = memo.key(x, self.identity) if memo is not None else None
            out = memo.recall(key, self.features_list) if memo is not None else None
            if out is None:
                out = self.model.features(uint8_to_model_input(x, self.model.image_size).to(self.internal_dtype))
                if memo is not None:
                    memo.keep(key, out)
            # float64 so torch-fidelity's np.mean/np.cov run in float64
            return tuple(out[name].to(torch.float64) for name in self.features_list)

    return FeatureExtractorSpecrayDigits


def register_with_torch_fidelity() -> str:
    """Register ``specray-digits`` with torch-fidelity (idempotent); returns the name."""
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY, register_feature_extractor

    if FEATURE_EXTRACTOR_NAME not in FEATURE_EXTRACTORS_REGISTRY:
        register_feature_extractor(FEATURE_EXTRACTOR_NAME, _feature_extractor_class())
    return FEATURE_EXTRACTOR_NAME


register_with_torch_fidelity()
