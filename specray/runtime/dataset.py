"""Dataset output: a generation job that publishes one Parquet partition per run or date, plus a card.

A job with a ``dataset:`` section (see :class:`specray.spec.DatasetSpec`) writes, under its ``output``::

    README.md                                   the dataset card (spec, model versions, counts)
    data/date=2026-11-29/<arm>-00000-of-00003.parquet   (or data/run=<run id>/...)
    data/date=2026-11-29/_partition.json        written last: the partition is complete
    _staging/date=2026-11-29/                   the run while it is generated (removed once published)

The partition is generated as an ordinary run in ``_staging/<partition>`` (so it resumes after a
crash exactly like any run), then each committed shard is published into ``data/<partition>/``
with one atomic step (hard link + rename locally, a server-side copy on S3), the partition record
is written, and the staging run is deleted. The files keep the run's schema: the ``image`` column
is ``struct<bytes, path>`` with PNG bytes (the Hugging Face datasets image convention) and the
Parquet schema metadata carries the ``datasets`` features, so ``load_dataset("parquet", ...)``
decodes images. ``data/`` reads as a hive-partitioned dataset (pyarrow, pandas, duckdb): the
``date``/``run`` column comes from the directory name; ``_``-prefixed files are skipped by readers.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import uuid
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

import specray
from specray.runtime import fs as storage
from specray.runtime.lease import OutputLease
from specray.runtime.store import SAMPLE_SCHEMA, RunStore
from specray.spec import JobSpec, SpecError, with_output

log = logging.getLogger("specray.dataset")

DATA_DIR = "data"
STAGING_DIR = "_staging"
PARTITION_RECORD = "_partition.json"
CARD_NAME = "README.md"
PARTITION_FORMAT = 1


@dataclass
class DatasetResult:
    output: str  # the dataset root
    partition: str  # e.g. "date=2026-11-29"
    files: list[str]  # published Parquet files, relative to the root
    num_rows: int
    already_published: bool  # the partition was complete before this call (nothing generated)
    record: dict[str, Any]  # the partition record (_partition.json)


def partition_relpath(spec: JobSpec, name: str = "") -> str:
    assert spec.dataset is not None
    return "/".join(p for p in (DATA_DIR, spec.dataset.partition_dir, name) if p)


def published_name(arm: str, shard: int, num_shards: int) -> str:
    """File name of an (arm, shard) in a partition: ``<arm>-00000-of-00003.parquet`` (HF's shard naming)."""
    width = max(5, len(str(num_shards)))
    return f"{arm}-{shard:0{width}d}-of-{num_shards:0{width}d}.parquet"


def run_dataset_job(spec: JobSpec, *, ray_address: str | None = None, num_cpus: int | None = None,
                    actors: int | None = None, storage_options: dict[str, Any] | None = None,
                    show_progress: bool = True) -> DatasetResult:
    """Generate (or resume) the spec's partition, publish it under ``data/``, and rewrite the card."""
    if spec.dataset is None:
        raise SpecError("dataset", "this job has no dataset section; use specray.run_job for an evaluation run")
    if "://" not in spec.output and not os.path.isabs(spec.output):
        spec = with_output(spec, os.path.abspath(spec.output))
    options = {**spec.storage_options, **(storage_options or {})} or None
    try:  # before Ray starts: nothing is written when the root is unusable
        storage.check_writable(spec.output, options)
    except storage.StorageError as exc:
        raise SpecError("output", str(exc)) from None
    root = RunStore(spec.output, options)
    staging = storage.join(spec.output, STAGING_DIR, spec.dataset.partition_dir)
    # One writer per partition, from the first look at it to the last published file.
    with OutputLease(RunStore(staging, options), job_id=spec.job_id, fingerprint=spec.fingerprint()) as lease:
        return _publish_leased(spec, root, staging, options, lease, ray_address=ray_address, num_cpus=num_cpus,
                               actors=actors, show_progress=show_progress)


def _publish_leased(spec: JobSpec, root: RunStore, staging: str, options: dict[str, Any] | None, lease: Any, *,
                    ray_address: str | None, num_cpus: int | None, actors: int | None,
                    show_progress: bool) -> DatasetResult:
    from specray.runtime.coordinator import run_job

    record_path = partition_relpath(spec, PARTITION_RECORD)
    record = root.read_json(record_path)
    if record is not None:
        if record.get("fingerprint") != spec.fingerprint():
            raise SpecError("dataset", f"partition {spec.dataset.partition_dir!r} of {spec.output!r} already holds "
                                       f"job {record.get('job_id')!r} with another spec (fingerprint "
                                       f"{record.get('fingerprint')}, now {spec.fingerprint()}); choose another "
                                       f"{'date' if spec.dataset.partition == 'date' else 'run_id'} or delete it")
        log.info("partition %s is already published; nothing to generate", spec.dataset.partition_dir)
        _remove_tree(staging, options)  # a crash after the record but before the clean-up
        write_card(spec, root)
        return DatasetResult(spec.output, spec.dataset.partition_dir, [f["path"] for f in record["files"]],
                             record["num_rows"], True, record)

    result = run_job(with_output(spec, staging), ray_address=ray_address, num_cpus=num_cpus, actors=actors,
                     storage_options=options, show_progress=show_progress, lease=lease)
    record = publish_partition(spec, root, RunStore(staging, options), result.manifest)
    _remove_tree(staging, options)
    write_card(spec, root)
    log.info("published %d rows to %s", record["num_rows"], root.uri(partition_relpath(spec)))
    return DatasetResult(spec.output, spec.dataset.partition_dir, [f["path"] for f in record["files"]],
                         record["num_rows"], False, record)


def publish_partition(spec: JobSpec, root: RunStore, run: RunStore, manifest: dict[str, Any]) -> dict[str, Any]:
    """Publish every committed shard of the staging run; the partition record is written last."""
    files = []
    for shard in manifest["shards"]:
        relpath = partition_relpath(spec, published_name(shard["arm"], shard["shard"], shard["num_shards"]))
        _publish_file(run, shard["path"], root, relpath)
        files.append({"path": relpath, "arm": shard["arm"], "shard": shard["shard"], "rows": shard["rows"],
                      "sha256": shard["sha256"], "bytes": shard["bytes"]})
    rows_per_arm: dict[str, int] = {}
    for f in files:
        rows_per_arm[f["arm"]] = rows_per_arm.get(f["arm"], 0) + f["rows"]
    record = {
        "format": PARTITION_FORMAT,
        "job_id": spec.job_id,
        "fingerprint": spec.fingerprint(),
        "partition": spec.dataset.partition,
        "value": spec.dataset.value,
        "published_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "num_rows": sum(f["rows"] for f in files),
        "rows_per_arm": rows_per_arm,
        "num_samples": manifest["layout"]["num_samples"],
        "files": files,
        "seed": spec.seed,
        "spec": {**manifest["spec"], "output": storage.redact(spec.output)},  # redacted by the coordinator
        "versions": manifest.get("versions", {}),
        "timings": manifest.get("timings", {}),
        "models": model_versions(spec),
    }
    root.write_json(partition_relpath(spec, PARTITION_RECORD), record)
    return record


def _publish_file(run: RunStore, src: str, root: RunStore, dst: str) -> None:
    """Make the committed ``src`` visible at ``dst`` in one step, without rewriting its bytes."""
    if run.is_local:
        source, target = run.uri(src), root.uri(dst)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        temp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.tmp-{uuid.uuid4().hex}")
        try:
            try:
                os.link(source, temp)  # no copy when both live on one filesystem
            except OSError:
                shutil.copyfile(source, temp)
            os.replace(temp, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.remove(temp)
        return
    # S3 CopyObject: server-side, and the new object appears only when the copy is complete.
    fs, source = storage.resolve(run.uri(src), run.storage_options)
    _, target = storage.resolve(root.uri(dst), root.storage_options)
    fs.copy(source, target)


def _remove_tree(uri: str, storage_options: dict[str, Any] | None) -> None:
    fs, path = storage.resolve(uri, storage_options)
    with contextlib.suppress(FileNotFoundError):
        if fs.exists(path):
            fs.rm(path, recursive=True)
    if not storage.is_s3(uri):  # object stores have no empty directories to leave behind
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path.rstrip("/")))  # _staging/, only when no other partition is staged


# ---------------------------------------------------------------- model versions


def model_versions(spec: JobSpec) -> list[dict[str, Any]]:
    """Each model the arms use: preset/checkpoint, sha256 of its weights, and its training record."""
    from specray.models.presets import PRESETS, _load_all
    from specray.models.refs import ref_path

    _load_all()
    seen: dict[str, dict[str, Any]] = {}
    for arm in spec.arms:
        for role, ref, key in (("target", arm.target, arm.target_key), ("draft", arm.draft, arm.draft_key)):
            if key is None or key in seen:
                continue
            entry: dict[str, Any] = {"name": key, "role": role, "family": arm.family}
            if isinstance(ref, str) and ref in PRESETS:
                path: Path | None = PRESETS[ref].weights_path
                entry["kind"] = "preset"
            else:
                location = ref_path(ref)
                path = Path(location) if location and "://" not in location else None
                entry["kind"] = "checkpoint"
            if path is not None and path.is_file():
                entry["sha256"] = _sha256(path)
                entry["bytes"] = path.stat().st_size
                if path.suffix == ".safetensors":
                    entry["training"] = _safetensors_metadata(path)
            seen[key] = storage.redact(entry)
    return list(seen.values())


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _safetensors_metadata(path: Path) -> dict[str, Any]:
    """The training record a preset stores in its safetensors metadata (header only; values JSON-decoded)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as handle:
            metadata = dict(handle.metadata() or {})
    except Exception as exc:  # noqa: BLE001 - a card must still be written
        return {"error": f"unreadable metadata: {type(exc).__name__}"}
    decoded: dict[str, Any] = {}
    for key, value in metadata.items():
        try:
            decoded[key] = json.loads(value)
        except (TypeError, ValueError):
            decoded[key] = value
    return decoded


# ---------------------------------------------------------------- the dataset card


def partition_records(root: RunStore) -> list[dict[str, Any]]:
    """Every published partition's record, sorted by partition value."""
    records = []
    for relpath in root.list_files(DATA_DIR):
        if relpath.endswith("/" + PARTITION_RECORD):
            record = root.read_json(relpath)
            if record is not None:
                records.append(record)
    return sorted(records, key=lambda r: (r.get("partition", ""), r.get("value", "")))


def write_card(spec: JobSpec, root: RunStore) -> str:
    """(Re)write README.md from every published partition; returns its text."""
    text = render_card(spec, partition_records(root))
    root.commit_bytes(CARD_NAME, text.encode())
    return text


def render_card(spec: JobSpec, records: list[dict[str, Any]]) -> str:
    assert spec.dataset is not None
    dataset = spec.dataset
    title = dataset.name or spec.job_id
    total = sum(r["num_rows"] for r in records)
    front = {
        "pretty_name": title,
        "tags": ["image-generation", "speculative-decoding", "specray"],
        "size_categories": [_size_category(total)],
        "configs": [{"config_name": "default",
                     "data_files": [{"split": "train", "path": f"{DATA_DIR}/*/*.parquet"}]}],
    }
    latest = next((r for r in records if r.get("fingerprint") == spec.fingerprint()
                   and r.get("value") == dataset.value), records[-1] if records else None)
    models = (latest or {}).get("models") or model_versions(spec)
    lines = [
        "---", yaml.safe_dump(front, sort_keys=False).rstrip(), "---", "",
        f"# {title}", "",
        dataset.description or f"Images generated by specray job `{spec.job_id}` with speculative decoding.", "",
        f"Partitioned by **{dataset.partition}** (`{DATA_DIR}/{dataset.partition}=<value>/`). "
        f"{len(records)} partition(s), {total} rows in all. One row per (arm, sample); the `image` column is "
        "`struct<bytes: binary, path: string>` holding PNG bytes (the Hugging Face datasets image convention).",
        "", "## Partitions", "",
        f"| {dataset.partition} | job | seed | rows | rows per arm | files | published at |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        per_arm = ", ".join(f"{arm}: {n}" for arm, n in r.get("rows_per_arm", {}).items())
        lines.append(f"| {r['value']} | {r['job_id']} | {r.get('seed', '')} | {r['num_rows']} | {per_arm} | "
                     f"{len(r['files'])} | "
                     f"{r.get('published_at', '')} |")
    lines += ["", "## Models", "",
              "| model | kind | role | family | sha256 | training |", "|---|---|---|---|---|---|"]
    for m in models:
        training = m.get("training") or {}
        summary = ", ".join(f"{k}={training[k]}" for k in ("seed", "steps", "final_train_loss",
                                                             "heldout_nll_nats_per_token", "torch_version")
                            if k in training)
        lines.append(f"| {m['name']} | {m.get('kind', '')} | {m['role']} | {m['family']} | "
                     f"`{m.get('sha256', 'n/a')}` | {summary} |")
    versions = (latest or {}).get("versions") or {"specray": specray.__version__}
    lines += ["", "## Versions", "", *[f"- {k}: {v}" for k, v in sorted(versions.items())],
              "", "## Columns", "",
              ", ".join(f"`{f.name}` ({f.type})" for f in SAMPLE_SCHEMA), "",
              "## Reading it", "", "```python",
              "import pandas as pd",
              f"df = pd.read_parquet('{DATA_DIR}')  # adds the '{dataset.partition}' column from the directory names",
              "import duckdb",
              f"duckdb.sql(\"select * from read_parquet('{DATA_DIR}/*/*.parquet', hive_partitioning=true)\")",
              "from datasets import load_dataset",
              f"ds = load_dataset('parquet', data_files='{DATA_DIR}/*/*.parquet', split='train')  # image -> PIL",
              "```", "",
              "## Job spec (latest run)", "", "```yaml",
              yaml.safe_dump((latest or {}).get("spec") or storage.redact(spec.to_dict()), sort_keys=False).rstrip(),
              "```", ""]
    return "\n".join(lines)


def _size_category(rows: int) -> str:
    for limit, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"),
                         (1_000_000, "100K<n<1M")):
        if rows < limit:
            return label
    return "n>1M"
