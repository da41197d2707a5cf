"""The batch PNG decoder gives PIL's arrays exactly, for every scanline filter, and defers everything else to PIL."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, PngImagePlugin

from specray.runtime.images import decode_image, decode_image_column, encode_png
from specray.runtime.png_batch import MAX_PIXELS, decode_png_batch


def _paeth(left: int, up: int, upper_left: int) -> int:
    estimate = left + up - upper_left
    to_left, to_up, to_upper_left = abs(estimate - left), abs(estimate - up), abs(estimate - upper_left)
    if to_left <= to_up and to_left <= to_upper_left:
        return left
    return up if to_up <= to_upper_left else upper_left


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(data, zlib.crc32(kind)))


def png_with_filters(pixels: np.ndarray, filters: list[int]) -> bytes:
    """A PNG of uint8 ``[H, W]`` or ``[H, W, 3]`` whose row y is written with filter ``filters[y]`` (0-4).

    Written here byte by byte from the PNG specification, so that every filter is exercised whatever
    filters PIL's encoder would choose.
    """
    height, width = pixels.shape[:2]
    channels = 1 if pixels.ndim == 2 else 3
    rows = pixels.reshape(height, width * channels).astype(int)
    raw = bytearray()
    for y, kind in enumerate(filters):
        raw.append(kind)
        for x in range(width * channels):
            left = rows[y, x - channels] if x >= channels else 0
            up = rows[y - 1, x] if y > 0 else 0
            upper_left = rows[y - 1, x - channels] if y > 0 and x >= channels else 0
            predictor = [0, left, up, (left + up) // 2, _paeth(left, up, upper_left)][kind]
            raw.append((rows[y, x] - predictor) % 256)
    header = struct.pack(">IIBBBBB", width, height, 8, 0 if channels == 1 else 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(bytes(raw))) + _chunk(b"IEND", b"")


def pil_arrays(blobs: list[bytes]) -> np.ndarray:
    arrays = []
    for blob in blobs:
        with Image.open(io.BytesIO(blob)) as image:
            arrays.append(np.asarray(image))
    return np.stack(arrays)


@pytest.mark.parametrize("channels", [1, 3])
def test_every_filter_decodes_as_pil_does(channels):
    """40 random 6x7 images (seed 0), each row with a random filter of the five, plus images whose rows all use
    one filter: exactly PIL's arrays. Noise and flat images both, so Paeth's ties and Average's odd sums occur."""
    generator = np.random.default_rng(0)
    shape = (6, 7) if channels == 1 else (6, 7, 3)
    blobs = []
    for i in range(40):
        pixels = generator.integers(0, 256, shape, dtype=np.uint8) if i % 4 else np.full(shape, 17 * i % 256, np.uint8)
        filters = generator.integers(0, 5, 6).tolist() if i < 30 else [i % 5] * 6
        blobs.append(png_with_filters(pixels, filters))
    got = decode_png_batch(blobs)
    assert got is not None and got.dtype == np.uint8 and got.shape == (40, *shape)
    np.testing.assert_array_equal(got, pil_arrays(blobs))


def _paeth_ties_to_upper_left(left, up, upper_left):
    to_left, to_up, to_upper_left = np.abs(up - upper_left), np.abs(left - upper_left), np.abs(left + up - 2 * upper_left)
    return np.where((to_left <= to_up) & (to_left <= to_upper_left), left, np.where(to_upper_left <= to_up, upper_left, up))


@pytest.mark.parametrize("wrong", ["paeth ties", "average rounded up"])
def test_a_wrong_filter_rule_is_caught(wrong, monkeypatch):
    """Negative control: 40 noise images (seed 3), every row Average or Paeth, decode to other pixels than
    PIL's when Paeth prefers the upper-left pixel to the upper one on a tie, or Average rounds up."""
    from specray.runtime import png_batch

    generator = np.random.default_rng(3)
    blobs = [png_with_filters(generator.integers(0, 256, (8, 8), dtype=np.uint8), generator.integers(3, 5, 8).tolist())
             for _ in range(40)]
    np.testing.assert_array_equal(decode_png_batch(blobs), pil_arrays(blobs))
    if wrong == "paeth ties":
        monkeypatch.setattr(png_batch, "_paeth", _paeth_ties_to_upper_left)
    else:
        monkeypatch.setattr(png_batch, "_average", lambda left, up: (left + up + 1) >> 1)
    assert not np.array_equal(decode_png_batch(blobs), pil_arrays(blobs))


@pytest.mark.parametrize("shape", [(8, 8), (5, 9, 3), (32, 32)])
def test_encode_png_output_takes_the_fast_path(shape):
    """What the actors write (PIL's encoder, its own filter choice) decodes here, to the pixels written."""
    images = np.random.default_rng(2).integers(0, 256, (12, *shape), dtype=np.uint8)
    images[::3] //= 64  # smoother images: PIL then picks other filters than for noise
    got = decode_png_batch([encode_png(image) for image in images])
    assert got is not None
    np.testing.assert_array_equal(got, images)


def _with_text_chunk(image: np.ndarray) -> bytes:
    info = PngImagePlugin.PngInfo()
    info.add_text("note", "x")
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def _saved(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


GREY = np.arange(64, dtype=np.uint8).reshape(8, 8)
BLOB = encode_png(GREY)
OTHER_KINDS = {
    "palette": _saved(Image.fromarray(GREY).convert("P")),
    "grey+alpha": _saved(Image.fromarray(np.stack([GREY, GREY], -1))),
    "rgba": _saved(Image.fromarray(np.stack([GREY] * 4, -1))),
    "16-bit": _saved(Image.fromarray(GREY.astype(np.uint16) * 257)),
    "text chunk": _with_text_chunk(GREY),
    "bad checksum": BLOB[:-1] + bytes([BLOB[-1] ^ 1]),
    "truncated": BLOB[:-12],
    "trailing bytes": BLOB + b"\x00",
    "not a png": b"GIF89a" + BLOB[6:],
    "too large": encode_png(np.zeros((33, 32), np.uint8)),
    # an 8x8 header over a stream that inflates to 1 MiB: never inflated past the image's 72 bytes here
    "inflates past its size": b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", 8, 8, 8, 0, 0, 0, 0))
    + _chunk(b"IDAT", zlib.compress(bytes(2**20))) + _chunk(b"IEND", b""),
}


@pytest.mark.parametrize("name", sorted(OTHER_KINDS))
def test_anything_else_is_left_to_pil(name):
    assert decode_png_batch([BLOB, OTHER_KINDS[name]]) is None
    assert decode_png_batch([OTHER_KINDS[name]]) is None


def test_the_column_decoder_falls_back_and_keeps_its_errors():
    """Mixed sizes, a palette image or a missing cell go image by image, with decode_image's arrays and errors."""
    assert MAX_PIXELS >= 8 * 8
    palette = OTHER_KINDS["palette"]
    np.testing.assert_array_equal(decode_image_column([BLOB, palette]), np.stack([GREY, decode_image(palette)]))
    with pytest.raises(ValueError, match="differ in shape"):
        decode_image_column([BLOB, encode_png(np.zeros((4, 4), np.uint8))])
    with pytest.raises(ValueError, match="image 1 of a batch has no bytes"):
        decode_image_column([BLOB, None])
    assert decode_png_batch([]) is None


def test_a_stream_that_inflates_past_its_image_is_not_inflated():
    """The 8x8 image over a 1 MiB stream: decoding allocates far less than the stream would inflate to."""
    import tracemalloc

    tracemalloc.start()
    try:
        assert decode_png_batch([OTHER_KINDS["inflates past its size"]]) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**16
