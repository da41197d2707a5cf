"""The image codec: uint8 arrays <-> PNG bytes, and the Parquet image column built from them.

Images are stored the way Hugging Face ``datasets`` stores an ``Image()`` feature: a
``struct<bytes: binary, path: string>`` holding PNG bytes. Encoding is deterministic (same
pixels, same bytes), which is what makes "byte-identical images" checkable at all.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import numpy as np
import pyarrow as pa

from specray.runtime.png_batch import decode_png_batch

IMAGE_TYPE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
_GREY_MODES = ("L", "P", "1", "I;16")
_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def encode_png(image: np.ndarray) -> bytes:
    """PNG bytes of a uint8 ``[H, W]`` (grey) or ``[H, W, 3]`` (RGB) image.

    Deterministic: fixed compression level, no timestamps or text chunks.
    """
    from PIL import Image

    if image.dtype != np.uint8:
        raise TypeError(f"image must be uint8, got {image.dtype}")
    if not (image.ndim == 2 or (image.ndim == 3 and image.shape[2] == 3)):
        raise ValueError(f"image must be [H, W] or [H, W, 3], got shape {tuple(image.shape)}")
    pil = Image.fromarray(image)  # uint8 [H, W] is mode L, [H, W, 3] is RGB
    buffer = io.BytesIO()
    pil.save(buffer, format="PNG", compress_level=6, optimize=False)
    return buffer.getvalue()


def decode_image(blob: bytes) -> np.ndarray:
    """uint8 ``[H, W]`` for grey-level images, ``[H, W, 3]`` for everything else."""
    from PIL import Image

    # A PNG opens as one without probing the other formats first, and an image already grey ("L") or RGB
    # is read as it is, not converted (a copy): a fifth less time on the reducer's 8x8 digits PNGs.
    formats = ("PNG",) if blob[:8] == _PNG_SIGNATURE else None
    with Image.open(io.BytesIO(blob), formats=formats) as pil:
        if pil.mode not in ("L", "RGB"):
            pil = pil.convert("L" if pil.mode in _GREY_MODES else "RGB")
        return np.asarray(pil)


def stack_images(images: list[np.ndarray], where: str) -> np.ndarray:
    """One uint8 array ``[N, ...]``; images of different shapes are refused, naming ``where``."""
    shapes = {a.shape for a in images}
    if len(shapes) > 1:
        raise ValueError(f"{where}: images differ in shape {sorted(shapes)}; they must share one size")
    return np.stack(images).astype(np.uint8, copy=False)


def image_cell(image: np.ndarray) -> dict[str, bytes | None]:
    """The Parquet ``image`` value of one image."""
    return {"bytes": encode_png(image), "path": None}


def decode_image_column(column: pa.Array | Iterable[bytes | None], where: str = "a batch") -> np.ndarray:
    """An ``image`` column (struct<bytes, path>, or plain bytes) -> uint8 ``[N, H, W(, 3)]``."""
    blobs = column.field("bytes").to_pylist() if hasattr(column, "field") else list(column)
    batch = decode_png_batch(blobs)  # specray's own small PNGs all at once; None: anything else, one by one
    if batch is not None:
        return batch
    decoded = []
    for i, blob in enumerate(blobs):
        if blob is None:
            raise ValueError(f"image {i} of {where} has no bytes (image.path references are not supported)")
        decoded.append(decode_image(blob))
    return stack_images(decoded, where)
