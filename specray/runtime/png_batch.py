"""Many small PNGs decoded at once: the reducer's fast path for the images specray itself writes.

PIL spends ~85 µs of Python per image opening an 8x8 digits PNG, 150,000 of them in a 50k job's
reducer. The images ``encode_png`` writes are one simple kind of PNG (8-bit grey or RGB, not
interlaced, chunks IHDR, IDAT and IEND only), so a record batch of them is decoded here with one
``zlib.decompress`` per image and the scanline filters undone with numpy across the whole batch.

``decode_png_batch`` returns ``None`` for anything else (another chunk, bit depth, colour type, a bad
checksum, images of different sizes, a large image) and the caller decodes image by image with PIL:
where it answers, it gives PIL's arrays exactly (tests/test_png_batch.py compares them).
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence

import numpy as np

_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_CHANNELS = {0: 1, 2: 3}  # colour type -> samples per pixel: grey, RGB
# Average and Paeth rows are undone pixel by pixel (vectorised over images only): past this many pixels
# an image, PIL's C decoder is faster than that loop.
MAX_PIXELS = 32 * 32


def _chunks(blob: bytes) -> list[tuple[bytes, bytes]] | None:
    """``[(type, data), ...]`` of a PNG with good CRCs, or None."""
    if blob[:8] != _SIGNATURE:
        return None
    chunks, at = [], 8
    while at + 12 <= len(blob):
        (length,) = struct.unpack_from(">I", blob, at)
        end = at + 8 + length
        if end + 4 > len(blob):
            return None
        kind, data = blob[at + 4 : at + 8], blob[at + 8 : end]
        if zlib.crc32(data, zlib.crc32(kind)) != struct.unpack_from(">I", blob, end)[0]:
            return None
        chunks.append((kind, data))
        at = end + 4
        if kind == b"IEND":
            return chunks if at == len(blob) else None
    return None


def _filtered_scanlines(blob: bytes | None) -> tuple[bytes, bytes] | None:
    """(IHDR data, decompressed filtered scanlines) of a PNG of the simple kind, or None."""
    chunks = _chunks(blob) if isinstance(blob, bytes) else None
    if not chunks or chunks[0][0] != b"IHDR" or chunks[-1][0] != b"IEND":
        return None
    if any(kind != b"IDAT" for kind, _ in chunks[1:-1]) or len(chunks) < 3:
        return None
    header = chunks[0][1]
    if len(header) != 13:
        return None
    width, height, depth, colour, compression, filtering, interlace = struct.unpack(">IIBBBBB", header)
    if depth != 8 or colour not in _CHANNELS or (compression, filtering, interlace) != (0, 0, 0):
        return None
    if not 0 < width * height <= MAX_PIXELS:
        return None
    expected = height * (1 + width * _CHANNELS[colour])
    inflater = zlib.decompressobj()
    try:  # at most one byte more than the image holds: a stream that inflates further is left to PIL
        raw = inflater.decompress(b"".join(data for _, data in chunks[1:-1]), expected + 1)
    except zlib.error:
        return None
    return (header, raw) if len(raw) == expected and inflater.eof else None


def _paeth(left: np.ndarray, up: np.ndarray, upper_left: np.ndarray) -> np.ndarray:
    """The neighbour closest to ``left + up - upper_left``; ties go to left, then up (the PNG specification)."""
    to_left, to_up, to_upper_left = np.abs(up - upper_left), np.abs(left - upper_left), np.abs(left + up - 2 * upper_left)
    return np.where((to_left <= to_up) & (to_left <= to_upper_left), left, np.where(to_up <= to_upper_left, up, upper_left))


def _average(left: np.ndarray, up: np.ndarray) -> np.ndarray:
    return (left + up) >> 1  # rounded down


def _unfilter_sequential(line: np.ndarray, prior: np.ndarray, average: np.ndarray, channels: int) -> np.ndarray:
    """Average (``average`` true) or Paeth rows: each pixel predicted from the one just reconstructed."""
    rows, length = line.shape
    filtered = line.reshape(rows, -1, channels).astype(np.int16)
    above = prior.reshape(rows, -1, channels).astype(np.int16)
    out = np.empty((rows, length // channels, channels), np.uint8)
    left = np.zeros((rows, channels), np.int16)
    upper_left = np.zeros((rows, channels), np.int16)
    use_average = average[:, None]
    for x in range(filtered.shape[1]):
        up = above[:, x]
        predicted = np.where(use_average, _average(left, up), _paeth(left, up, upper_left))
        left, upper_left = (filtered[:, x] + predicted) & 0xFF, up
        out[:, x] = left
    return out.reshape(rows, length)


def _unfilter(raw: np.ndarray, channels: int) -> np.ndarray | None:
    """``[N, H, 1 + W*C]`` filter byte + filtered scanline -> pixels ``[N, H, W*C]`` (uint8 sums wrap mod 256)."""
    count, height, stride = raw.shape
    out = np.empty((count, height, stride - 1), np.uint8)
    prior = np.zeros((count, stride - 1), np.uint8)
    for y in range(height):
        kind, line, row = raw[:, y, 0], raw[:, y, 1:], out[:, y]
        if kind.max() > 4:
            return None
        none, sub, up, other = kind == 0, kind == 1, kind == 2, kind >= 3
        row[none] = line[none]
        row[up] = line[up] + prior[up]
        if sub.any():  # Sub: running sum along the row, per channel
            row[sub] = np.cumsum(line[sub].reshape(int(sub.sum()), -1, channels), axis=1, dtype=np.uint8).reshape(-1, stride - 1)
        if other.any():
            row[other] = _unfilter_sequential(line[other], prior[other], kind[other] == 3, channels)
        prior = row
    return out


def decode_png_batch(blobs: Sequence[bytes | None]) -> np.ndarray | None:
    """uint8 ``[N, H, W]`` (grey) or ``[N, H, W, 3]`` (RGB), the arrays PIL gives; None: decode them one by one."""
    if not blobs:
        return None
    parts = [_filtered_scanlines(blob) for blob in blobs]
    if any(part is None for part in parts) or len({header for header, _ in parts}) != 1:
        return None
    width, height, _, colour = struct.unpack_from(">IIBB", parts[0][0])
    channels = _CHANNELS[colour]
    raw = np.frombuffer(b"".join(data for _, data in parts), np.uint8).reshape(len(parts), height, 1 + width * channels)
    pixels = _unfilter(raw, channels)
    if pixels is None:
        return None
    return pixels.reshape(len(parts), height, width) if channels == 1 else pixels.reshape(len(parts), height, width, 3)
