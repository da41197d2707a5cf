"""Verification before scoring: every file the manifest lists is the file the run committed.

For each (arm, shard) of the run's layout, :func:`verify_files` checks, and names the file when a
check fails:

1. the manifest lists it exactly once, at the run's own name for it
   (``samples/<arm>/shard-<k>-of-<K>.parquet``): an absolute path, a ``..``, another arm's
   file or anything outside the run folder is refused; locally the file must also resolve inside
   the run folder (no symlink out of it);
2. the file exists and has the listed size and SHA-256;
3. it is a readable Parquet file whose own metadata names the same job fingerprint, arm, shard
   and shard count (``specray.runtime.store.ShardIdentity``), with the listed row count.

Nothing is scored from a run with a problem, unless the caller asks for a *partial* report: then
the files that pass are returned, and every problem is kept to be reported as missing.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import asdict, dataclass

import pyarrow.parquet as pq

from specray.eval.checks import RunCheckError
from specray.eval.shards import RunManifest, ShardEntry
from specray.runtime.plan import shard_relpath
from specray.runtime.store import RunStore, ShardIdentity

_HASH_CHUNK = 8 * 1024 * 1024
_SHOWN_PROBLEMS = 10


@dataclass(frozen=True)
class FileProblem:
    """Why one (arm, shard) cannot be scored."""

    arm: str
    shard: int
    path: str
    problem: str

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{self.path}: {self.problem}"


@dataclass(frozen=True)
class Verified:
    """The entries that passed, in manifest order, and the problems of the others."""

    entries: tuple[ShardEntry, ...]
    problems: tuple[FileProblem, ...]
    num_shards: int

    @property
    def complete(self) -> bool:
        return not self.problems


def verify_files(store: RunStore, manifest: RunManifest, *, partial: bool = False) -> Verified:
    """Check every listed file (see the module doc); raise :class:`RunCheckError` ("files") naming
    the bad files, or with ``partial`` return the good ones and the problems."""
    layout = manifest.raw.get("layout") or {}
    num_shards = layout.get("num_shards")
    fingerprint = manifest.raw.get("fingerprint")
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards < 1:
        raise RunCheckError("files", f"the manifest's layout.num_shards is {num_shards!r}; the run's file names "
                                     "cannot be checked without it")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise RunCheckError("files", "the manifest has no job fingerprint; the files' identity cannot be checked")
    problems: list[FileProblem] = []
    listed: dict[tuple[str, int], ShardEntry] = {}
    for entry in manifest.shards:
        key = (entry.arm, entry.shard)
        expected_path = _expected_path(entry, num_shards)
        if expected_path is None:
            problems.append(FileProblem(entry.arm, entry.shard, entry.path, f"lists arm {entry.arm!r} shard "
                                        f"{entry.shard}, which is not in this run's layout of {num_shards} shards"))
        elif entry.path != expected_path:
            where = "points outside the run folder" if _outside(entry.path) else "is not this run's name for it"
            problems.append(FileProblem(entry.arm, entry.shard, entry.path, f"the manifest's path {where} (arm "
                                        f"{entry.arm!r} shard {entry.shard} is {expected_path})"))
        elif key in listed:
            problems.append(FileProblem(entry.arm, entry.shard, entry.path, "listed twice in the manifest"))
        else:
            listed[key] = entry
    for arm in manifest.arm_names:
        for shard in range(num_shards):
            if (arm, shard) not in listed:
                path = _safe_relpath(arm, shard, num_shards)
                problems.append(FileProblem(arm, shard, path, "not listed in the manifest"))
    good = []
    for entry in listed.values():
        problem = _file_problem(store, entry, fingerprint, num_shards)
        if problem is None:
            good.append(entry)
        else:
            problems.append(FileProblem(entry.arm, entry.shard, entry.path, problem))
    if problems and not partial:
        shown = "; ".join(str(p) for p in problems[:_SHOWN_PROBLEMS])
        more = f" (and {len(problems) - _SHOWN_PROBLEMS} more)" if len(problems) > _SHOWN_PROBLEMS else ""
        raise RunCheckError("files", f"{len(problems)} shard file(s) fail verification: {shown}{more}. Nothing was "
                                     "scored; rerun the job to regenerate them, or ask for a partial report "
                                     "(specray reduce --partial) that says what is missing")
    return Verified(tuple(good), tuple(problems), num_shards)


def _safe_relpath(arm: str, shard: int, num_shards: int) -> str:
    try:
        return shard_relpath(arm, shard, num_shards)
    except (TypeError, ValueError):
        return f"samples/{arm!r}"


def _expected_path(entry: ShardEntry, num_shards: int) -> str | None:
    if not 0 <= entry.shard < num_shards:
        return None
    return shard_relpath(entry.arm, entry.shard, num_shards)


def _outside(path: str) -> bool:
    norm = posixpath.normpath(path.replace("\\", "/"))
    return "://" in path or path.startswith(("/", "~")) or norm == ".." or norm.startswith("../")


def _file_problem(store: RunStore, entry: ShardEntry, fingerprint: str, num_shards: int) -> str | None:
    """Why the listed file is not the committed one (None when it is)."""
    full = store.full_path(entry.path)
    fs_path = full
    if store.is_local:
        root = os.path.realpath(store.root)
        real = os.path.realpath(fs_path)
        if os.path.commonpath([root, real]) != root:
            return f"resolves outside the run folder (to {real})"
    try:
        info = store.fs.info(fs_path)
    except FileNotFoundError:
        return "missing: the file does not exist"
    except OSError as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    if info.get("type") == "directory":
        return "is a directory, not a file"
    size = int(info.get("size") or 0)
    if entry.bytes >= 0 and size != entry.bytes:
        return f"has {size} bytes, the manifest lists {entry.bytes} (truncated or replaced)"
    digest = hashlib.sha256()
    try:
        with store.fs.open(fs_path, "rb") as handle:
            for chunk in iter(lambda: handle.read(_HASH_CHUNK), b""):
                digest.update(chunk)
    except OSError as exc:
        return f"cannot be read ({type(exc).__name__}: {exc})"
    if entry.sha256 is None:
        return "the manifest lists no sha256 for it"
    if digest.hexdigest() != entry.sha256:
        return "its sha256 does not match the manifest (the file was changed or replaced after the run)"
    try:
        with store.fs.open(fs_path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            identity = ShardIdentity.from_metadata(parquet.schema_arrow.metadata)
            rows = parquet.metadata.num_rows
    except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
        return f"is not a readable Parquet file ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    if identity is None:
        return "carries no specray shard identity in its metadata (not written by this run's actors)"
    wanted = ShardIdentity(fingerprint, entry.arm, entry.shard, num_shards)
    if identity != wanted:
        return (f"holds job {identity.job_fingerprint} arm {identity.arm!r} shard {identity.shard}/"
                f"{identity.num_shards}, but the manifest lists it as job {fingerprint} arm {entry.arm!r} shard "
                f"{entry.shard}/{num_shards} (a file copied from another arm or run)")
    if entry.rows >= 0 and rows != entry.rows:
        return f"has {rows} rows, the manifest lists {entry.rows}"
    return None


def partial_view(manifest: RunManifest, verified: Verified) -> tuple[RunManifest, dict]:
    """The manifest restricted to the files that verified (arms left with fewer than two samples are
    dropped), and the report's ``partial`` record: what is missing and why."""
    from specray.eval.checks import MIN_SAMPLES_PER_ARM

    rows: dict[str, int] = {}
    for entry in verified.entries:
        rows[entry.arm] = rows.get(entry.arm, 0) + max(entry.rows, 0)
    kept = tuple(e for e in verified.entries if rows[e.arm] >= MIN_SAMPLES_PER_ARM)
    if not kept:
        shown = "; ".join(str(p) for p in verified.problems[:_SHOWN_PROBLEMS])
        raise RunCheckError("files", f"no arm has {MIN_SAMPLES_PER_ARM} verified samples to score: {shown}")
    view = manifest.restricted(kept)
    record = {
        "missing": [p.to_dict() for p in verified.problems],
        "arms_dropped": list(view.dropped_arms),
        "shards_scored": {arm: sorted(e.shard for e in kept if e.arm == arm) for arm in view.arm_names},
        "num_shards": verified.num_shards,
        "note": "partial report: only the listed shards were scored; every number covers those samples only",
    }
    return view, record


def partial_notice_lines(report: dict) -> list[str]:
    """report.md's warning block for a partial report (empty for a complete one)."""
    partial = report.get("partial")
    if not partial:
        return []
    lines = ["", f"**Partial report.** {len(partial['missing'])} shard file(s) of {partial['num_shards']} shards per "
                 "arm failed verification and were not scored; every figure below covers the scored shards only."]
    if partial.get("arms_dropped"):
        lines.append(f"Arms not scored at all: {', '.join(partial['arms_dropped'])}.")
    lines += ["", "| arm | shard | file | problem |", "|---|---|---|---|"]
    lines += [f"| {m['arm']} | {m['shard']} | `{m['path']}` | {m['problem']} |" for m in partial["missing"][:50]]
    if len(partial["missing"]) > 50:
        lines.append(f"\n({len(partial['missing']) - 50} more in report.json)")
    return lines
