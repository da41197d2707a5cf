"""Where a run's files go: Parquet shards and JSON records over fsspec.

A run directory (local path or ``s3://`` URI) holds

- ``samples/<arm>/shard-<k>-of-<K>.parquet`` -- one file per (arm, shard); ``samples/`` is one
  Parquet dataset (pandas, pyarrow, duckdb and ``datasets`` read it in one call);
- ``_job.json`` -- written when a run starts: the spec and its fingerprint, so a
  rerun can check it may resume here;
- ``_manifest.json`` -- written LAST, after every shard is committed.

Every file is committed atomically by :meth:`RunStore.commit_bytes`: the bytes are
built completely in memory first, then made visible in one step through
:func:`specray.runtime.fs.atomic_write_bytes` -- a temp file in the same
directory plus ``os.replace`` locally, one complete PUT (or a completed
multipart upload) on S3, which never exposes partial objects. Temp names start
with ``.`` so Parquet dataset readers skip them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from specray.runtime import fs as storage
from specray.runtime.images import IMAGE_TYPE

MANIFEST_NAME = "_manifest.json"
JOB_RECORD_NAME = "_job.json"
LEASE_NAME = "_lease.json"
TEMP_MARKER = ".tmp-"
TEMP_TAG_PREFIX = "specray-"  # + the job fingerprint: whose temp file it is
SHARD_IDENTITY_KEY = b"specray.shard"  # Parquet key-value metadata: which (job, arm, shard) a file holds
S3_PART_SIZE = 8 * 1024 * 1024  # multipart part size for large files (S3 needs >= 5 MiB)

# One row per (arm, sample): the design's Data section plus actor and extra_stats. This is the row
# schema's one declaration; rows_to_table refuses any row that does not match it exactly.
SAMPLE_SCHEMA = pa.schema([
    ("job_id", pa.string()),
    ("arm", pa.string()),
    ("method", pa.string()),
    ("family", pa.string()),
    ("target", pa.string()),
    ("draft", pa.string()),
    ("sample_id", pa.int64()),
    ("seed", pa.int64()),
    ("class_label", pa.int64()),  # -1 in a prompt job
    ("prompt_id", pa.string()),  # a prompt job's prompt (null in a class-label job)
    ("prompt", pa.string()),
    ("repeat", pa.int64()),  # which repeat of its prompt the sample is (sample_id // number of prompts)
    ("image", IMAGE_TYPE),
    ("height", pa.int32()),
    ("width", pa.int32()),
    ("num_tokens", pa.int64()),
    ("num_spec_steps", pa.int64()),
    ("num_draft_tokens", pa.int64()),
    ("num_accepted_draft_tokens", pa.int64()),
    ("draft_acceptance_rate", pa.float64()),
    ("mean_acceptance_length", pa.float64()),
    ("accepted_per_position", pa.list_(pa.int32())),
    ("target_calls", pa.int64()),
    ("draft_calls", pa.int64()),
    ("batch_size", pa.int32()),
    ("batch_wall_time_s", pa.float64()),
    ("sample_wall_time_s", pa.float64()),
    ("params", pa.string()),
    ("specray_version", pa.string()),
    ("torch_version", pa.string()),
    ("device", pa.string()),
    ("actor", pa.string()),  # "<node id[:8]>:<pid>" of the worker that generated the row (pairs speedups per actor)
    ("extra_stats", pa.string()),
])


class RowSchemaError(ValueError):
    """A row whose columns are not exactly :data:`SAMPLE_SCHEMA`'s."""


def rows_to_table(rows: list[dict[str, Any]]) -> pa.Table:
    """A table of sample rows; a row with a missing or an extra column is an error (never a null or a drop)."""
    expected = set(SAMPLE_SCHEMA.names)
    for i, row in enumerate(rows):
        if row.keys() != expected:
            missing, extra = sorted(expected - row.keys()), sorted(row.keys() - expected)
            raise RowSchemaError(f"row {i} (arm {row.get('arm')!r}, sample_id {row.get('sample_id')!r}) does not "
                                 f"match the row schema (specray.runtime.store.SAMPLE_SCHEMA): missing columns "
                                 f"{missing}, unexpected columns {extra}")
    return pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA)


_HF_VALUE_TYPES = {pa.string(): "string", pa.binary(): "binary", pa.int64(): "int64", pa.int32(): "int32",
                   pa.float64(): "float64", pa.float32(): "float32", pa.bool_(): "bool"}


def _hf_feature(name: str, dtype: pa.DataType) -> dict[str, Any] | None:
    if name == "image" and dtype == IMAGE_TYPE:
        return {"_type": "Image"}
    if pa.types.is_list(dtype):
        inner = _hf_feature("", dtype.value_type)
        return {"feature": inner, "_type": "Sequence"} if inner else None
    return {"dtype": _HF_VALUE_TYPES[dtype], "_type": "Value"} if dtype in _HF_VALUE_TYPES else None


def huggingface_features(schema: pa.Schema) -> dict[str, Any] | None:
    """The Hugging Face ``datasets`` Features of ``schema`` ("image" decodes as an Image).

    None when a column has a type this mapping does not know (``datasets`` then infers from Arrow).
    """
    features = {field.name: _hf_feature(field.name, field.type) for field in schema}
    return None if any(f is None for f in features.values()) else features


def with_huggingface_metadata(table: pa.Table) -> pa.Table:
    """Attach the schema metadata ``datasets`` reads, so ``load_dataset("parquet", ...)`` yields images."""
    features = huggingface_features(table.schema)
    if features is None:
        return table
    text = json.dumps({"info": {"features": features}}, sort_keys=True)
    return table.replace_schema_metadata({**(table.schema.metadata or {}), b"huggingface": text.encode()})


@dataclass(frozen=True)
class ShardIdentity:
    """Which job, arm and shard a Parquet file holds, stored in the file's own metadata.

    The reducer compares it with the manifest entry that lists the file, so a file copied over
    another arm's or another job's (even with a manifest whose checksums were made to match) is
    refused instead of scored.
    """

    job_fingerprint: str
    arm: str
    shard: int
    num_shards: int

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_metadata(cls, metadata: Mapping[bytes, bytes] | None) -> "ShardIdentity | None":
        """The identity in a file's schema metadata; None when absent or malformed."""
        raw = (metadata or {}).get(SHARD_IDENTITY_KEY)
        if raw is None:
            return None
        try:
            data = json.loads(raw)
            return cls(str(data["job_fingerprint"]), str(data["arm"]), int(data["shard"]), int(data["num_shards"]))
        except (ValueError, KeyError, TypeError):
            return None


# Whether read_parquet decodes on pyarrow's thread pool (False: in the calling thread; see read_parquet).
PARQUET_THREADS = False


def read_parquet(source: Any, columns: list[str] | None = None) -> pa.Table:
    """A whole Parquet file (a path or an open binary file) as a table, read in the calling thread.

    Not ``pq.read_table``: its dataset scanner can leave the last reference to a Python file object with one of
    pyarrow's I/O threads after the call returns; if the process then exits, that thread takes the GIL while the
    interpreter finalizes and the process aborts ("terminate called without an active exception", exit status
    134): pyarrow 26.0.1, 33 of 200 runs of a script reading twelve shards through ``open()`` and exiting. Nor
    ``ParquetFile(...).read`` on pyarrow's thread pool: the same abort, rarer (5 of 900 runs of a script reading
    four files of 2,000 rows through ``open()``, three such processes at a time on two cores), and none of 1,500
    with its columns decoded in the calling thread (:data:`PARQUET_THREADS`). ``iter_batches``, how the reducer reads
    shards, aborted in none of 600 runs of the same script with pyarrow's threads, so it keeps them.
    """
    return pq.ParquetFile(source).read(columns=columns, use_threads=PARQUET_THREADS)


def table_to_parquet_bytes(table: pa.Table, identity: ShardIdentity | None = None) -> bytes:
    table = with_huggingface_metadata(table)
    if identity is not None:
        table = table.replace_schema_metadata({**(table.schema.metadata or {}), SHARD_IDENTITY_KEY: identity.to_json()})
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="zstd")
    return buffer.getvalue()


@dataclass(frozen=True)
class CommittedFile:
    """A committed (arm, shard) file as the manifest lists it."""

    path: str  # relative to the run's output
    rows: int
    sha256: str
    bytes: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class RunStore:
    """Files of one run, under ``output`` (a local path or an ``s3://`` URI).

    All I/O goes through :mod:`specray.runtime.fs`, which owns the atomic-write
    rules per backend (temp + rename locally; one PUT / completed multipart on S3).
    """

    part_size: int = S3_PART_SIZE

    def __init__(self, output: str, storage_options: dict[str, Any] | None = None, *, run_tag: str = ""):
        """``run_tag`` (the job fingerprint) names this run's temp files, so that its clean-up removes
        only what a writer of this job left behind (never another program's files)."""
        self.output = output
        self.storage_options = storage_options
        self.fs, self.root = storage.resolve(output, storage_options)
        self.is_local = _is_local(self.fs)
        if run_tag and not re.fullmatch(r"[A-Za-z0-9]+", run_tag):
            raise ValueError(f"run_tag must be letters and digits, got {run_tag!r}")
        self.temp_tag = f"{TEMP_TAG_PREFIX}{run_tag}" if run_tag else ""

    def uri(self, relpath: str) -> str:
        return storage.join(self.output, relpath)

    def full_path(self, relpath: str) -> str:
        return self.uri(relpath)

    # -- reading --------------------------------------------------------

    def is_committed(self, relpath: str) -> bool:
        """A file exists only once complete, so existence is commitment."""
        return storage.exists(self.uri(relpath), self.storage_options)

    def read_bytes(self, relpath: str) -> bytes:
        return storage.read_bytes(self.uri(relpath), self.storage_options)

    def read_json(self, relpath: str) -> dict[str, Any] | None:
        if not self.is_committed(relpath):
            return None
        return json.loads(self.read_bytes(relpath))

    def describe(self, relpath: str) -> CommittedFile:
        """Row count and checksum of a committed shard (for shards committed by an earlier run)."""
        data = self.read_bytes(relpath)
        rows = pq.ParquetFile(io.BytesIO(data)).metadata.num_rows
        return CommittedFile(relpath, rows, hashlib.sha256(data).hexdigest(), len(data))

    def read_table(self, relpath: str) -> pa.Table:
        return read_parquet(io.BytesIO(self.read_bytes(relpath)))

    # -- writing --------------------------------------------------------

    def commit_bytes(self, relpath: str, data: bytes) -> None:
        """Make ``data`` visible at ``relpath`` in one step (never partially).

        Streams through :func:`specray.runtime.fs.atomic_writer` in ``part_size`` pieces: on S3 a
        payload above one part becomes a multipart upload that is completed only after the last
        part, and aborted if the writer fails, so an interrupted write leaves no object behind.
        """
        view = memoryview(data)
        block = self.part_size if len(view) > self.part_size else None
        with storage.atomic_writer(self.uri(relpath), self.storage_options, block_size=block,
                                   temp_tag=self.temp_tag) as handle:
            for start in range(0, len(view), self.part_size):
                handle.write(view[start:start + self.part_size])

    def write_shard(self, relpath: str, table: pa.Table, identity: ShardIdentity | None = None) -> CommittedFile:
        """Commit one (arm, shard) file; ``identity`` goes into its metadata (the runtime always gives it)."""
        data = table_to_parquet_bytes(table, identity)
        self.commit_bytes(relpath, data)
        return CommittedFile(relpath, table.num_rows, hashlib.sha256(data).hexdigest(), len(data))

    def write_json(self, relpath: str, payload: dict[str, Any]) -> None:
        self.commit_bytes(relpath, (json.dumps(payload, indent=2, sort_keys=True) + "\n").encode())

    def delete(self, relpath: str) -> None:
        storage.remove(self.uri(relpath), self.storage_options)

    def remove_stale_temps(self) -> list[str]:
        """Delete the temp files that writers of this run (same ``run_tag``) left behind when killed.

        Only names this run's writers make (``.<name>.tmp-specray-<run_tag>-<32 hex>``) are removed;
        any other file, dot-prefixed or not, is left alone. Local only: object stores have no temps.
        A store without a ``run_tag`` removes nothing.
        """
        if not self.temp_tag or not self.is_local or not os.path.isdir(self.root):
            return []
        own = re.compile(rf"\..+{re.escape(TEMP_MARKER + self.temp_tag)}-[0-9a-f]{{32}}")
        removed = []
        for dirpath, _dirs, files in os.walk(self.root):  # symlinked folders are not followed
            for name in files:
                path = os.path.join(dirpath, name)
                if own.fullmatch(name) and not os.path.islink(path):
                    os.remove(path)
                    removed.append(path)
        return removed

    def list_files(self, prefix: str = "") -> list[str]:
        """Relative paths of the committed files under ``prefix`` (temp files are never listed)."""
        base = self.uri(prefix) if prefix else self.output
        base_uri = storage.join(self.output, "")
        return sorted(u[len(base_uri):].lstrip("/") for u in storage.list_files(base, "", self.storage_options))


def _is_local(fs: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)
