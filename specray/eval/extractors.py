"""Feature extractors for FID / IS / precision-recall, all through torch-fidelity's own modules.

* ``specray-digits`` -- the project's digits classifier (built-in presets):
  FID on ``fc1``, IS on ``logits``, precision/recall on ``fc1_relu``.
* ``inception-v3-compat`` -- torch-fidelity's TF-compatible InceptionV3 (the
  field's FID): FID on ``2048``, IS on ``logits_unbiased``, precision/recall on
  ``2048``. Weights come from a local file (``eval.options.inception_weights``
  or ``SPECRAY_INCEPTION_WEIGHTS``) or torch-fidelity's download cache; nothing
  is downloaded. The file is read with ``torch.load(weights_only=True)`` (or
  safetensors) -- never unpickled -- and handed to torch-fidelity's constructor.

``extractor(images)`` maps uint8 images to float64 arrays per purpose:
``{"fid": [N, d], "isc": [N, C], "prc": [N, d']}``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import numpy as np
import torch

from specray.eval.fid import UInt8ImageDataset
from specray.eval.options import DIGITS_EXTRACTOR as DIGITS_NAME
from specray.eval.options import FEATURE_EXTRACTORS as EXTRACTORS
from specray.eval.options import INCEPTION_EXTRACTOR as INCEPTION_NAME

INCEPTION_WEIGHTS_ENV = "SPECRAY_INCEPTION_WEIGHTS"

# purpose -> layer, per extractor (torch-fidelity's defaults for each metric)
LAYERS = {
    DIGITS_NAME: {"fid": "fc1", "isc": "logits", "prc": "fc1_relu"},
    INCEPTION_NAME: {"fid": "2048", "isc": "logits_unbiased", "prc": "2048"},
}


class InceptionWeightsMissing(FileNotFoundError):
    """No InceptionV3 weights on this machine; the message says where to put them."""


def inception_cache_path() -> Path:
    """Where torch-fidelity's ``load_state_dict_from_url`` caches the InceptionV3 weights."""
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    return Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(URL_INCEPTION_V3)


def resolve_inception_weights(weights_path: str | os.PathLike | None = None) -> Path:
    """The weights file to use: the given path, else ``$SPECRAY_INCEPTION_WEIGHTS``, else torch-fidelity's cache."""
    from torch_fidelity.feature_extractor_inceptionv3 import URL_INCEPTION_V3

    if weights_path is None:
        weights_path = os.environ.get(INCEPTION_WEIGHTS_ENV) or None
    cache = inception_cache_path()
    path = Path(weights_path) if weights_path is not None else cache
    if not path.is_file():
        given = f"the given path {str(path)!r} does not exist. " if weights_path is not None else ""
        raise InceptionWeightsMissing(
            f"InceptionV3 weights for {INCEPTION_NAME!r} not found: {given}specray never downloads at run time. "
            f"Download {URL_INCEPTION_V3} on a machine with internet and put it at {str(cache)!r} "
            f"(torch-fidelity's cache), or anywhere and pass its path as eval.options.inception_weights "
            f"or the environment variable {INCEPTION_WEIGHTS_ENV}."
        )
    return path


def load_state_dict_safely(path: Path) -> dict[str, torch.Tensor]:
    """A plain tensor state dict from ``.safetensors`` or a ``.pth``/``.pt`` read with ``weights_only=True``."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict of tensors (InceptionV3 weights), got {type(state).__name__}")
    return state


def build_inception(weights_path: str | os.PathLike | None, layers: list[str], device: torch.device):
    """torch-fidelity's ``FeatureExtractorInceptionV3`` with safely loaded weights."""
    from torch_fidelity import feature_extractor_inceptionv3 as inception_module

    state = load_state_dict_safely(resolve_inception_weights(weights_path))
    # torch-fidelity would torch.load(weights_only=False) a path, or download when given none; hand it the
    # already-safe state dict through the name its constructor calls instead.
    with mock.patch.object(inception_module, "load_state_dict_from_url", lambda *args, **kwargs: state):
        model = inception_module.FeatureExtractorInceptionV3(INCEPTION_NAME, layers, feature_extractor_weights_path=None)
    return model.to(device)


@dataclass
class FeatureSet:
    """What one extractor call returns: features per purpose (float64)."""

    fid: np.ndarray
    isc: np.ndarray | None
    prc: np.ndarray | None


class ImageFeatureExtractor:
    """A torch-fidelity feature extractor evaluated for FID, IS and precision/recall at once."""

    def __init__(self, name: str = DIGITS_NAME, device: torch.device | str = "cpu",
                 inception_weights: str | os.PathLike | None = None, batch_size: int = 256) -> None:
        if name not in LAYERS:
            raise ValueError(f"feature_extractor: unknown extractor {name!r}; allowed: {list(EXTRACTORS)}")
        self.name = name
        self.layers = LAYERS[name]
        self.device = torch.device(device)
        self.batch_size = batch_size
        unique = sorted(set(self.layers.values()))
        self._order = unique
        if name == DIGITS_NAME:
            from torch_fidelity.utils import create_feature_extractor

            from specray.eval.digits_features import register_with_torch_fidelity

            self.model = create_feature_extractor(register_with_torch_fidelity(), unique, cuda=False, verbose=False)
            self.model = self.model.to(self.device)
            config = self.model.model
            dims = {"fc1": config.fc1.out_features, "fc1_relu": config.fc1.out_features, "logits": config.fc2.out_features}
        else:
            self.model = build_inception(inception_weights, unique, self.device)
            dims = {"2048": 2048, "logits_unbiased": 1008}
        self.fid_dim = int(dims[self.layers["fid"]])
        self.isc_dim = int(dims[self.layers["isc"]])
        self.prc_dim = int(dims[self.layers["prc"]])
        self.model.eval()

    @torch.no_grad()
    def __call__(self, images: torch.Tensor | np.ndarray) -> FeatureSet:
        """uint8 ``[N,H,W]``, ``[N,H,W,3]`` or ``[N,3,H,W]`` -> features (batched by ``batch_size``)."""
        if isinstance(images, np.ndarray):
            images = torch.from_numpy(images)
        data = UInt8ImageDataset(images).images
        outputs: dict[str, list[np.ndarray]] = {layer: [] for layer in self._order}
        for start in range(0, data.shape[0], self.batch_size):
            chunk = data[start : start + self.batch_size].to(self.device)
            for layer, value in zip(self._order, self.model(chunk)):
                outputs[layer].append(value.detach().to("cpu", torch.float64).numpy())
        joined = {k: np.concatenate(v) if v else np.zeros((0, 1)) for k, v in outputs.items()}
        return FeatureSet(joined[self.layers["fid"]], joined[self.layers["isc"]], joined[self.layers["prc"]])
