"""FID reference statistics: where the (mu, sigma) that arms are compared against come from.

``eval.reference`` (a string in the job spec) selects one of:

* ``digits`` -- all 1797 scikit-learn digits through the extractor (built-in presets);
* ``npz:PATH`` or a path ending ``.npz`` -- an ADM-style reference batch
  (``mu``, ``sigma``; the ``arr_0`` images ADM also ships are not needed),
  read with ``allow_pickle=False``;
* ``fidelity-stats:PATH`` or a path ending ``.pt`` -- a torch-fidelity statistics
  file (``{"mu", "sigma"}`` as torch-fidelity's cache writes them), read with
  ``torch.load(weights_only=True)`` allowing only numpy arrays;
* ``folder:PATH`` or a directory of images (png/jpg/jpeg/bmp/webp, sorted by name);
* ``parquet:PATH`` or a ``.parquet`` file / directory of them with an ``image``
  column (Hugging Face image structs, as specray writes).

Image references are streamed through the same extractor as the arms
(float64 moments), so their memory does not grow with their size; they also
keep up to ``prc_max_samples`` feature rows for precision/recall. Statistics
files carry no features: precision/recall then reports itself unavailable.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specray.eval.extractors import ImageFeatureExtractor
from specray.eval.fid import FeatureMoments
from specray.eval.options import REFERENCE_KINDS as PREFIXES  # noqa: F401  (re-exported)
from specray.eval.options import parse_reference as _parse_reference
from specray.runtime.images import decode_image, decode_image_column, stack_images

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


@dataclass
class ReferenceStatistics:
    mu: np.ndarray
    sigma: np.ndarray
    count: int | None  # images behind the statistics, when known
    kind: str  # one of PREFIXES
    source: str  # a human-readable description
    prc_features: np.ndarray | None = None  # [M, d'] feature rows for precision/recall (image references only)

    @property
    def stats(self) -> tuple[np.ndarray, np.ndarray]:
        return self.mu, self.sigma


def parse_reference(reference: str) -> tuple[str, str]:
    """``"kind:path"`` or a bare path / ``digits`` -> (kind, path) (the spec checks the same, torch-free)."""
    try:
        return _parse_reference(reference)
    except ValueError as exc:
        raise ValueError(f"eval.reference: {exc}") from None


def load_reference(reference: str, extractor: ImageFeatureExtractor, *, batch_rows: int = 1024,
                   prc_max_samples: int = 0) -> ReferenceStatistics:
    kind, path = parse_reference(reference)
    if kind in ("npz", "fidelity-stats", "folder", "parquet") and not os.path.exists(path):
        raise FileNotFoundError(f"eval.reference: {kind} reference {path!r} does not exist")
    if kind == "npz":
        mu, sigma = read_adm_npz(path)
        return _checked(ReferenceStatistics(mu, sigma, None, kind, f"ADM reference batch {path}"), extractor)
    if kind == "fidelity-stats":
        mu, sigma = read_fidelity_stats(path)
        return _checked(ReferenceStatistics(mu, sigma, None, kind, f"torch-fidelity statistics {path}"), extractor)
    if kind == "digits":
        from specray.eval.fid import digits_reference_images

        batches: Iterator[np.ndarray] = iter([digits_reference_images().numpy()])
        source = "digits (all 1797 images of sklearn load_digits, 0..16 -> 0..255)"
    elif kind == "folder":
        batches = iter_folder_images(path, batch_rows)
        source = f"image folder {path}"
    else:
        batches = iter_parquet_images(path, batch_rows)
        source = f"Parquet images {path}"
    return stream_reference(batches, extractor, kind, source, prc_max_samples)


def stream_reference(batches: Iterator[np.ndarray], extractor: ImageFeatureExtractor, kind: str, source: str,
                     prc_max_samples: int = 0) -> ReferenceStatistics:
    moments = FeatureMoments(extractor.fid_dim)
    kept: list[np.ndarray] = []
    kept_rows = 0
    for images in batches:
        features = extractor(images)
        moments.update(features.fid)
        if kept_rows < prc_max_samples and features.prc is not None:
            take = features.prc[: prc_max_samples - kept_rows]
            kept.append(take)
            kept_rows += len(take)
    if moments.count < 2:
        raise ValueError(f"eval.reference: {source} holds {int(moments.count)} images; FID needs at least 2")
    mu, sigma = moments.statistics()
    prc = np.concatenate(kept) if kept else None
    return ReferenceStatistics(mu, sigma, int(moments.count), kind, source, prc)


def _checked(ref: ReferenceStatistics, extractor: ImageFeatureExtractor) -> ReferenceStatistics:
    d = extractor.fid_dim
    if ref.mu.shape != (d,) or ref.sigma.shape != (d, d):
        raise ValueError(
            f"eval.reference: {ref.source} has mu {ref.mu.shape} and sigma {ref.sigma.shape}, but the "
            f"{extractor.name!r} extractor gives {d}-dim features; use statistics computed with the same "
            f"extractor (eval.options.feature_extractor: {extractor.name})"
        )
    return ref


# ---------------------------------------------------------------- statistics files


def read_adm_npz(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``mu``, ``sigma`` of an ADM reference batch (as float64)."""
    with np.load(path, allow_pickle=False) as data:
        missing = [k for k in ("mu", "sigma") if k not in data.files]
        if missing:
            raise ValueError(f"{path}: ADM reference .npz lacks {missing}; it has {data.files}")
        return np.asarray(data["mu"], dtype=np.float64), np.asarray(data["sigma"], dtype=np.float64)


def write_adm_npz(path: str | os.PathLike, mu: np.ndarray, sigma: np.ndarray) -> None:
    np.savez(path, mu=np.asarray(mu), sigma=np.asarray(sigma))


def _numpy_safe_globals() -> list:
    import numpy as np_module

    core = getattr(np_module, "_core", None) or np_module.core
    dtypes = [type(np_module.dtype(t)) for t in ("float64", "float32")]
    return [core.multiarray._reconstruct, np_module.ndarray, np_module.dtype, *dtypes]


def read_fidelity_stats(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """``{"mu", "sigma"}`` from a torch-fidelity statistics ``.pt`` (numpy arrays or tensors), never unpickled."""
    with torch.serialization.safe_globals(_numpy_safe_globals()):
        data = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(data, dict) or not {"mu", "sigma"} <= set(data):
        raise ValueError(f"{path}: a torch-fidelity statistics file is a dict with 'mu' and 'sigma'; "
                         f"got {type(data).__name__} {sorted(data) if isinstance(data, dict) else ''}")
    as64 = lambda v: (v.numpy() if isinstance(v, torch.Tensor) else np.asarray(v)).astype(np.float64)  # noqa: E731
    return as64(data["mu"]), as64(data["sigma"])


def write_fidelity_stats(path: str | os.PathLike, mu: np.ndarray, sigma: np.ndarray) -> None:
    """The format torch-fidelity's cache uses (``torch.save`` of a dict of numpy arrays)."""
    torch.save({"mu": np.asarray(mu), "sigma": np.asarray(sigma)}, str(path))


# ---------------------------------------------------------------- image references


def iter_folder_images(path: str, batch_rows: int) -> Iterator[np.ndarray]:
    files = sorted(p for p in Path(path).rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES)
    if not files:
        raise ValueError(f"eval.reference: folder {path!r} holds no images ({', '.join(IMAGE_SUFFIXES)})")
    for start in range(0, len(files), batch_rows):
        yield stack_images([decode_image(f.read_bytes()) for f in files[start : start + batch_rows]],
                           f"eval.reference: folder {path!r}")


def iter_parquet_images(path: str, batch_rows: int) -> Iterator[np.ndarray]:
    import pyarrow.parquet as pq

    files = [Path(path)] if Path(path).is_file() else sorted(Path(path).rglob("*.parquet"))
    for file in files:
        parquet = pq.ParquetFile(str(file))
        if "image" not in parquet.schema_arrow.names:
            raise ValueError(f"eval.reference: {file} has no 'image' column (struct<bytes, path>)")
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=["image"]):
            column = batch.column("image")
            yield decode_image_column(column if hasattr(column, "field") else column.to_pylist(),
                                      f"eval.reference: {file}")
