"""FID: streaming feature statistics, and the Fréchet distance through torch-fidelity.

Two ways to the same number (the tests hold them to 1e-6 relative):

* ``fid_torch_fidelity(images_a, images_b)`` hands uint8 image sets to
  ``torch_fidelity.calculate_metrics(..., feature_extractor="specray-digits")``.
  It keeps every image of both sets in memory.
* ``FeatureMoments`` accumulates (count, mean, scatter) in float64 batch by batch
  and merges across shards (Chan et al.'s pairwise update), so memory does not
  grow with the sample count; ``frechet_distance`` then applies torch-fidelity's
  own ``fid_statistics_to_metric`` to the two (mu, sigma).

Weighted updates serve the Poisson bootstrap (``specray/eval/bootstrap.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass
class FeatureMoments:
    """Weighted count, mean and centred scatter matrix of feature vectors, in float64.

    ``update`` with weights ``w`` treats row ``i`` as observed ``w_i`` times
    (integer Poisson weights for the bootstrap, ones otherwise).
    """

    dim: int
    count: float = 0.0
    mean: np.ndarray = field(default=None)  # type: ignore[assignment]
    scatter: np.ndarray = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.mean is None:
            self.mean = np.zeros(self.dim, dtype=np.float64)
        if self.scatter is None:
            self.scatter = np.zeros((self.dim, self.dim), dtype=np.float64)

    def update(self, features: np.ndarray, weights: np.ndarray | None = None) -> None:
        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"features must be [N, {self.dim}], got shape {x.shape}")
        w = np.ones(len(x)) if weights is None else np.asarray(weights, dtype=np.float64)
        n_batch = float(w.sum())
        if n_batch == 0.0:
            return
        batch_mean = (w[:, None] * x).sum(0) / n_batch
        centred = x - batch_mean
        batch_scatter = (w[:, None] * centred).T @ centred
        self._merge_parts(n_batch, batch_mean, batch_scatter)

    def merge(self, other: FeatureMoments) -> None:
        if other.dim != self.dim:
            raise ValueError(f"cannot merge moments of dim {other.dim} into dim {self.dim}")
        self._merge_parts(other.count, other.mean, other.scatter)

    def _merge_parts(self, n_b: float, mean_b: np.ndarray, scatter_b: np.ndarray) -> None:
        if n_b == 0.0:
            return
        n_a = self.count
        n = n_a + n_b
        delta = mean_b - self.mean
        self.mean = self.mean + delta * (n_b / n)
        self.scatter = self.scatter + scatter_b + np.outer(delta, delta) * (n_a * n_b / n)
        self.count = n

    def statistics(self) -> tuple[np.ndarray, np.ndarray]:
        """(mu, sigma) with sigma the unbiased covariance, as ``np.cov`` (torch-fidelity) computes it."""
        if self.count < 2:
            raise ValueError(f"need at least 2 samples for a covariance, have {self.count}")
        return self.mean.copy(), self.scatter / (self.count - 1.0)


def frechet_distance(stats_a: tuple[np.ndarray, np.ndarray], stats_b: tuple[np.ndarray, np.ndarray]) -> float:
    """Fréchet distance between two Gaussians by torch-fidelity's own formula."""
    from torch_fidelity.metric_fid import KEY_METRIC_FID, fid_statistics_to_metric

    (mu_a, sigma_a), (mu_b, sigma_b) = stats_a, stats_b
    as64 = lambda a: np.asarray(a, dtype=np.float64)  # noqa: E731
    metric = fid_statistics_to_metric(
        {"mu": as64(mu_a), "sigma": as64(sigma_a)}, {"mu": as64(mu_b), "sigma": as64(sigma_b)}, verbose=False
    )
    return float(metric[KEY_METRIC_FID])


class UInt8ImageDataset(Dataset):
    """uint8 images as torch-fidelity wants them: each item ``[3, H, W]`` uint8.

    Accepts ``[N,H,W]`` grey, ``[N,H,W,3]`` or ``[N,3,H,W]``.
    """

    def __init__(self, images: torch.Tensor) -> None:
        if images.dtype != torch.uint8:
            raise ValueError(f"images must be uint8, got {images.dtype}")
        if images.dim() == 3:
            images = images[:, None].expand(-1, 3, -1, -1)
        elif images.dim() == 4 and images.shape[-1] == 3 and images.shape[1] != 3:
            images = images.permute(0, 3, 1, 2)
        if images.dim() != 4 or images.shape[1] != 3:
            raise ValueError(f"images must be [N,H,W], [N,H,W,3] or [N,3,H,W]; got {tuple(images.shape)}")
        self.images = images.contiguous()

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.images[index]


def fid_torch_fidelity(
    images_a: torch.Tensor,
    images_b: torch.Tensor,
    feature_extractor: str | None = None,
    cuda: bool = False,
    batch_size: int = 256,
    **kwargs,
) -> float:
    """FID between two uint8 image sets by ``torch_fidelity.calculate_metrics``.

    No caching (nothing written under ``~/.cache``), no worker processes, nothing downloaded.
    """
    import torch_fidelity

    from specray.eval.digits_features import register_with_torch_fidelity

    name = feature_extractor or register_with_torch_fidelity()
    metrics = torch_fidelity.calculate_metrics(
        input1=UInt8ImageDataset(images_a),
        input2=UInt8ImageDataset(images_b),
        fid=True,
        feature_extractor=name,
        cuda=cuda,
        batch_size=batch_size,
        cache=False,
        save_cpu_ram=True,
        verbose=False,
        **kwargs,
    )
    return float(metrics["frechet_inception_distance"])


class DigitsFeatureExtractor:
    """The torch-fidelity extractor object, used directly for streaming (same weights, same code path)."""

    def __init__(self, device: torch.device | str = "cpu", feature: str = "fc1") -> None:
        from torch_fidelity.utils import create_feature_extractor

        from specray.eval.digits_features import register_with_torch_fidelity

        self.device = torch.device(device)
        self.extractor = create_feature_extractor(
            register_with_torch_fidelity(), [feature], cuda=False, verbose=False
        ).to(self.device)
        self.dim = int(self.extractor.model.fc1.out_features if feature != "logits" else self.extractor.model.fc2.out_features)

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> np.ndarray:
        """uint8 images (any layout ``UInt8ImageDataset`` accepts) -> float64 ``[N, dim]``."""
        batch = UInt8ImageDataset(images).images.to(self.device)
        (features,) = self.extractor(batch)
        return features.cpu().numpy()


def digits_reference_images() -> torch.Tensor:
    """The FID reference: all 1797 digits images (train + held-out), uint8 0..255 ``[N, 8, 8]``.

    All of them rather than the train split: the reference should be the data
    distribution, and 1797 samples estimate its statistics better than 1617.
    """
    from specray.models.digits import load_digits_split, to_uint8_pixels

    train, _ = load_digits_split("train")
    heldout, _ = load_digits_split("heldout")
    return to_uint8_pixels(torch.cat([train, heldout]))
