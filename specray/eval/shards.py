"""Reading a run: its manifest, and the shards it lists, streamed in record batches.

Only files the manifest lists are read (a shard written after the manifest, or
a stray temp file, is never scored). Each shard is opened through fsspec
(local paths and ``s3://`` alike) and read ``batch_rows`` rows at a time, so
the reducer's memory depends on the batch size, not on the run's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from specray.runtime.images import decode_image_column
from specray.runtime.store import MANIFEST_NAME, RunStore

# Columns the reducer needs; ``actor`` is read too when a run has it.
STAT_COLUMNS = (
    "arm", "method", "family", "target", "draft", "sample_id", "class_label", "image",
    "num_tokens", "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens",
    "accepted_per_position", "target_calls", "draft_calls", "batch_size", "batch_wall_time_s",
    "sample_wall_time_s", "device",
)
OPTIONAL_COLUMNS = ("actor", "seed", "extra_stats")


MANIFEST_MAX_BYTES = 512 * 1024 * 1024  # a manifest lists at most spec.MAX_SHARD_FILES entries of ~300 bytes


class ManifestError(ValueError):
    """A ``_manifest.json`` that cannot be read as a run's manifest; the message names the field."""


@dataclass(frozen=True)
class ShardEntry:
    arm: str
    shard: int
    path: str  # relative to the run directory
    rows: int
    sha256: str | None = None
    bytes: int = -1


@dataclass(frozen=True)
class RunManifest:
    raw: dict[str, Any]
    shards: tuple[ShardEntry, ...]
    dropped_arms: tuple[str, ...] = ()  # arms a partial report could not score

    @property
    def arm_names(self) -> list[str]:
        """Arms in job order (manifest ``arms``), falling back to shard order."""
        names = [a["name"] for a in self.raw.get("arms", [])]
        for entry in self.shards:
            if entry.arm not in names:
                names.append(entry.arm)
        return names

    @property
    def num_rows(self) -> int:
        """Rows in the shards the manifest lists."""
        return sum(max(entry.rows, 0) for entry in self.shards)

    def arm_info(self, name: str) -> dict[str, Any]:
        for arm in self.raw.get("arms", []):
            if arm.get("name") == name:
                return arm
        return {"name": name}

    def restricted(self, entries: tuple[ShardEntry, ...]) -> "RunManifest":
        """The same run with only ``entries`` listed (a partial report); arms without one are dropped."""
        arms = {e.arm for e in entries}
        raw = {**self.raw, "arms": [a for a in self.raw.get("arms", []) if a.get("name") in arms]}
        dropped = tuple(a for a in self.arm_names if a not in arms)
        return RunManifest(raw, tuple(entries), dropped)

    @property
    def batch_size(self) -> int | None:
        layout = self.raw.get("layout") or {}
        value = layout.get("batch_size") or (self.raw.get("spec") or {}).get("batch_size")
        return int(value) if value else None

    @property
    def baseline_arm(self) -> str | None:
        """The job's ``eval.baseline``, if it names one."""
        return ((self.raw.get("spec") or {}).get("eval") or {}).get("baseline")


def read_manifest(store: RunStore) -> RunManifest:
    """The run's manifest; :class:`ManifestError` naming the file and the field when it is not one."""
    import json

    if not store.is_committed(MANIFEST_NAME):
        raise FileNotFoundError(
            f"{store.full_path(MANIFEST_NAME)} not found: the run is incomplete (the manifest is written last) "
            "or the path is not a run directory"
        )
    where = store.full_path(MANIFEST_NAME)
    if (store.fs.size(where) or 0) > MANIFEST_MAX_BYTES:  # size first: never allocate for a huge file
        raise ManifestError(f"{where} is larger than {MANIFEST_MAX_BYTES // 2**20} MiB; not a specray manifest")
    data = store.read_bytes(MANIFEST_NAME)
    try:
        raw = json.loads(data)
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestError(f"{where} is not valid JSON ({str(exc).splitlines()[0][:120]})") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{where} must hold a JSON object, got {type(raw).__name__}")
    entries = raw.get("shards")
    if not isinstance(entries, list):
        raise ManifestError(f"{where}: field 'shards' must be a list of shard records")
    for field_name, kind in (("arms", list), ("layout", dict), ("spec", dict)):
        if field_name in raw and not isinstance(raw[field_name], kind):
            raise ManifestError(f"{where}: field {field_name!r} must be a JSON {kind.__name__}")
    if any(not isinstance(a, dict) or not isinstance(a.get("name"), str) for a in raw.get("arms", [])):
        raise ManifestError(f"{where}: every entry of 'arms' must be an object with a string 'name'")
    shards = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ManifestError(f"{where}: shards[{i}] must be an object")
        for key, kind in (("arm", str), ("path", str), ("shard", int), ("rows", int), ("sha256", str), ("bytes", int)):
            if key in ("arm", "path") and key not in entry:
                raise ManifestError(f"{where}: shards[{i}] lacks field {key!r}")
            value = entry.get(key)
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool)):
                raise ManifestError(f"{where}: shards[{i}].{key} must be a {kind.__name__}, got {value!r:.60}")
        shards.append(ShardEntry(entry["arm"], int(entry.get("shard", i)), entry["path"], int(entry.get("rows", -1)),
                                 entry.get("sha256"), int(entry.get("bytes", -1))))
    return RunManifest(raw, tuple(shards))


def iter_shard_batches(store: RunStore, entry: ShardEntry, batch_rows: int = 1024) -> Iterator[pa.RecordBatch]:
    """Record batches of one listed shard (needed columns only)."""
    with store.fs.open(store.full_path(entry.path), "rb") as handle:
        parquet = pq.ParquetFile(handle)
        available = set(parquet.schema_arrow.names)
        missing = [c for c in STAT_COLUMNS if c not in available]
        if missing:
            raise ValueError(f"shard {entry.path} lacks columns {missing}")
        columns = list(STAT_COLUMNS) + [c for c in OPTIONAL_COLUMNS if c in available]
        yield from parquet.iter_batches(batch_size=batch_rows, columns=columns)


def decode_images(image_column: pa.Array) -> np.ndarray:
    """PNG structs -> uint8 ``[N, H, W]`` (grey) or ``[N, H, W, 3]``; every image of a batch must share a shape."""
    return decode_image_column(image_column)
