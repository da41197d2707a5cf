"""Pre-scoring checks: refuse to score a run whose samples are not the ones the spec asked for.

One cheap pass over the manifest's shards reading only ``sample_id``, ``seed``
and ``class_label`` (Parquet column projection: no images are decoded) checks,
for every arm:

1. **count**: the arm has exactly N rows, N = the manifest's ``layout.num_samples``
   (else ``conditions.per_class * len(conditions.classes)`` from the spec);
2. **no duplicates**: every sample_id appears once, and the sample_ids are
   exactly ``0..N-1``; every row carries the arm's seed (job seed + the arm's
   ``seed_offset``), so no (seed, sample_id) randomness key repeats; and arms
   that are seed replicas of each other (same family/target/draft/method/params
   except ``seed_offset``) do not share a seed -- they would be copies, not
   independent replicas;
3. **label balance**: each class of ``conditions.classes`` has ``per_class``
   rows, and sample ``i`` has class ``classes[i % len(classes)]`` (the plan's rule).

Memory: one bit-set of N booleans and a class histogram per arm, whatever the
shard count. A failure raises :class:`RunCheckError` naming the arm, the check
and what was expected.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from specray.eval.shards import RunManifest
from specray.runtime.store import RunStore

CHECK_COLUMNS = ("sample_id", "seed", "class_label")


class RunCheckError(ValueError):
    """A run that must not be scored. ``check`` is one of "count", "duplicates", "seeds", "labels"."""

    def __init__(self, check: str, message: str):
        self.check = check
        super().__init__(f"refusing to score the run ({check} check failed): {message}")

    def __reduce__(self):
        return (type(self), (self.check, self.args[0]))


@dataclass(frozen=True)
class ExpectedSamples:
    num_samples: int
    classes: tuple[int, ...] | None  # None: the manifest does not say; label checks are skipped
    per_class: int | None
    job_seed: int | None


@dataclass
class ArmCheckSummary:
    arm: str
    rows: int
    seeds: list[int]
    class_counts: dict[int, int] = field(default_factory=dict)


def expected_samples(manifest: RunManifest) -> ExpectedSamples:
    spec = manifest.raw.get("spec") or {}
    conditions = spec.get("conditions") or {}
    classes = conditions.get("classes")
    classes = tuple(int(c) for c in classes) if classes else None
    per_class = conditions.get("per_class")
    per_class = int(per_class) if per_class is not None else None
    layout = manifest.raw.get("layout") or {}
    if layout.get("num_samples") is not None:
        n = int(layout["num_samples"])
    elif classes is not None and per_class is not None:
        n = per_class * len(classes)
    else:
        raise RunCheckError("count", "the manifest gives neither layout.num_samples nor spec.conditions "
                                     "(per_class, classes), so the expected sample count N is unknown")
    seed = spec.get("seed", manifest.raw.get("seed"))
    return ExpectedSamples(n, classes, per_class, int(seed) if seed is not None else None)


def seed_offset(arm_info: dict[str, Any]) -> int:
    """The arm's ``seed_offset`` (arm field or params entry; 0 when absent)."""
    value = arm_info.get("seed_offset", (arm_info.get("params") or {}).get("seed_offset", 0))
    return int(value or 0)


def replica_key(arm_info: dict[str, Any]) -> str:
    """Arms with equal keys differ at most in ``seed_offset``: they are seed replicas."""
    params = {k: v for k, v in (arm_info.get("params") or {}).items() if k != "seed_offset"}
    return json.dumps([arm_info.get("family"), arm_info.get("target"), arm_info.get("draft"),
                       arm_info.get("method"), params], sort_keys=True, default=str)


MIN_SAMPLES_PER_ARM = 2  # a covariance (FID) needs two samples


def check_run(store: RunStore, manifest: RunManifest, *, partial: bool = False) -> dict[str, ArmCheckSummary]:
    """Run every check on every arm; raise :class:`RunCheckError` at the first failure.

    ``partial``: the manifest lists only some shards of each arm (a partial report); each arm must
    then hold exactly the samples of its listed shards, and the class balance is not checked.
    """
    expected = expected_samples(manifest)
    if expected.classes is not None and expected.per_class is not None:
        if expected.per_class * len(expected.classes) != expected.num_samples:
            raise RunCheckError("labels", f"spec asks for per_class={expected.per_class} x {len(expected.classes)} "
                                          f"classes = {expected.per_class * len(expected.classes)} samples but the "
                                          f"layout has num_samples={expected.num_samples}")
    if expected.num_samples < MIN_SAMPLES_PER_ARM:
        raise RunCheckError("size", f"the run has {expected.num_samples} sample per arm; FID and its bootstrap need "
                                    f"at least {MIN_SAMPLES_PER_ARM} (raise conditions.per_class)")
    summaries = {arm: _check_arm(store, manifest, arm, expected, partial) for arm in manifest.arm_names}
    _check_replica_seeds(manifest, summaries)
    return summaries


def _present_samples(manifest: RunManifest, arm: str, n: int) -> np.ndarray:
    """Which sample_ids the arm's listed shards hold (shard k: ids k*S .. (k+1)*S-1, S the shard size)."""
    layout = manifest.raw.get("layout") or {}
    size = int(layout.get("batch_size") or 0) * int(layout.get("shard_batches") or 0)
    if size <= 0:
        raise RunCheckError("count", "the manifest's layout gives no batch_size x shard_batches; a partial "
                                     "run's expected samples are unknown")
    present = np.zeros(n, dtype=bool)
    for entry in manifest.shards:
        if entry.arm == arm:
            present[entry.shard * size:(entry.shard + 1) * size] = True
    return present


def _check_arm(store: RunStore, manifest: RunManifest, arm: str, expected: ExpectedSamples,
               partial: bool = False) -> ArmCheckSummary:
    n = expected.num_samples
    present = _present_samples(manifest, arm, n) if partial else None
    seen = np.zeros(n, dtype=bool)
    class_counts: dict[int, int] = {}
    seeds: set[int] = set()
    rows = 0
    entries = [e for e in manifest.shards if e.arm == arm]
    if not entries:
        raise RunCheckError("count", f"arm {arm!r} has no shards in the manifest; expected {n} samples")
    classes = np.asarray(expected.classes, dtype=np.int64) if expected.classes is not None else None
    for entry in entries:
        with store.fs.open(store.full_path(entry.path), "rb") as handle:
            parquet = pq.ParquetFile(handle)
            available = set(parquet.schema_arrow.names)
            columns = [c for c in CHECK_COLUMNS if c in available]
            if "sample_id" not in columns:
                raise RunCheckError("duplicates", f"shard {entry.path} has no sample_id column")
            for batch in parquet.iter_batches(batch_size=65536, columns=columns):
                ids = batch.column("sample_id").to_numpy(zero_copy_only=False).astype(np.int64)
                rows += len(ids)
                bad = (ids < 0) | (ids >= n)
                if bad.any():
                    raise RunCheckError("duplicates", f"arm {arm!r}: sample_id {int(ids[bad][0])} is outside "
                                                      f"0..{n - 1} (N={n}) in {entry.path}")
                order = np.sort(ids)
                repeated = order[1:][order[1:] == order[:-1]]
                if len(repeated) or seen[ids].any():
                    sid = int(repeated[0]) if len(repeated) else int(ids[seen[ids]][0])
                    raise RunCheckError("duplicates", f"arm {arm!r}: sample_id {sid} appears more than once "
                                                      f"(found again in {entry.path}); a sample must be scored once")
                seen[ids] = True
                if "seed" in columns:
                    seeds.update(int(s) for s in np.unique(batch.column("seed").to_numpy(zero_copy_only=False)))
                if "class_label" in columns:
                    labels = batch.column("class_label").to_numpy(zero_copy_only=False).astype(np.int64)
                    if classes is not None:
                        wanted = classes[ids % len(classes)]
                        wrong = labels != wanted
                        if wrong.any():
                            i = int(np.argmax(wrong))
                            raise RunCheckError("labels", f"arm {arm!r}: sample_id {int(ids[i])} has class_label "
                                                          f"{int(labels[i])}, the spec's plan gives class "
                                                          f"{int(wanted[i])} (classes[sample_id % {len(classes)}])")
                    for label, count in zip(*np.unique(labels, return_counts=True)):
                        class_counts[int(label)] = class_counts.get(int(label), 0) + int(count)
    if present is not None:
        if (seen != present).any():
            odd = np.flatnonzero(seen != present)[:5].tolist()
            raise RunCheckError("count", f"arm {arm!r}: its listed shards should hold {int(present.sum())} samples, "
                                         f"found {rows} (sample_ids out of place include {odd})")
    elif rows != n:
        missing = np.flatnonzero(~seen)[:5].tolist()
        raise RunCheckError("count", f"arm {arm!r} has {rows} samples, the spec asked for N={n}"
                                     + (f" (missing sample_ids include {missing})" if missing else ""))
    _check_seeds(arm, manifest, expected, seeds)
    if present is None:
        _check_balance(arm, expected, class_counts)
    return ArmCheckSummary(arm, rows, sorted(seeds), class_counts)


def _check_seeds(arm: str, manifest: RunManifest, expected: ExpectedSamples, seeds: set[int]) -> None:
    if not seeds:
        return
    if len(seeds) > 1:
        raise RunCheckError("seeds", f"arm {arm!r} mixes seeds {sorted(seeds)}; one arm must use one seed "
                                     "(a resumed run mixed incompatible samples?)")
    if expected.job_seed is not None:
        info = manifest.arm_info(arm)
        offset = seed_offset(info)
        wanted = expected.job_seed + offset
        (got,) = seeds
        # the runtime may store either the effective seed or the job seed with the offset in params
        if got not in (wanted, expected.job_seed):
            raise RunCheckError("seeds", f"arm {arm!r} has seed {got}; the spec gives seed {expected.job_seed}"
                                         + (f" + seed_offset {offset} = {wanted}" if offset else ""))


def _check_balance(arm: str, expected: ExpectedSamples, counts: dict[int, int]) -> None:
    if expected.classes is None or expected.per_class is None or not counts:
        return
    wanted = {c: expected.per_class for c in expected.classes}
    if counts != wanted:
        diff = {c: counts.get(c, 0) for c in sorted(set(counts) | set(wanted)) if counts.get(c, 0) != wanted.get(c, 0)}
        raise RunCheckError("labels", f"arm {arm!r}: label balance {diff} (class: count) differs from the spec's "
                                      f"per_class={expected.per_class} for classes {list(expected.classes)}")


def effective_seed(stored_seed: int | None, job_seed: int | None, offset: int) -> int:
    """The seed an arm's samples were drawn with: the stored seed when it already includes the
    offset (differs from the job seed), else job seed + ``seed_offset``."""
    base = stored_seed if stored_seed is not None else (job_seed or 0)
    return base + offset if base == (job_seed if job_seed is not None else base) else base


def _check_replica_seeds(manifest: RunManifest, summaries: dict[str, ArmCheckSummary]) -> None:
    """Seed replicas must not share an effective seed (a duplicate replica is not independent)."""
    job_seed = expected_samples(manifest).job_seed
    by_key: dict[str, dict[int, str]] = {}
    for arm in manifest.arm_names:
        info = manifest.arm_info(arm)
        if "method" not in info:
            continue
        seeds = summaries[arm].seeds
        seed = effective_seed(seeds[0] if seeds else None, job_seed, seed_offset(info))
        group = by_key.setdefault(replica_key(info), {})
        if seed in group:
            raise RunCheckError("seeds", f"arms {group[seed]!r} and {arm!r} are seed replicas of the same "
                                         f"configuration with the same seed {seed}; give them different "
                                         "seed_offset values")
        group[seed] = arm
