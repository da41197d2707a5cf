"""Speedup of an arm over its ``target_only`` baseline, from paired wall times.

An actor runs every arm of a shard batch by batch (arms in job order), so the
same batch of sample_ids is timed for each arm on the same actor at nearly the
same time. A *batch record* is one (actor, shard, batch) of one arm; pairing
an arm's records with the baseline's on the same key gives per-batch ratios
``baseline_wall / arm_wall`` whose median is the reported speedup (robust to
stragglers), with a bootstrap interval over batches. The throughput ratio
(sum of baseline wall over sum of arm wall on the paired batches) is reported
beside it.

Warm-up: the first batch of each (arm, actor, shard) is dropped when the shard
has more batches (it is the only batch that can pay one-off costs once the
model is loaded; without execution timestamps the first batch an actor ran
cannot be told apart from the first batch of each of its shards, so every
shard's first is dropped -- a superset of the true warm-up batches).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from specray.eval.bootstrap import bootstrap_statistic

if TYPE_CHECKING:
    import pyarrow as pa

BatchKey = tuple[str, int, int]  # (actor, shard index, batch index)


@dataclass
class BatchTimes:
    """One arm's batch wall times: key -> (wall seconds, rows)."""

    walls: dict[BatchKey, float] = field(default_factory=dict)
    rows: dict[BatchKey, int] = field(default_factory=dict)

    def add(self, key: BatchKey, wall_s: float, rows: int) -> None:
        previous = self.walls.get(key)
        if previous is not None and abs(previous - wall_s) > 1e-12:
            raise ValueError(
                f"batch {key} has two different batch_wall_time_s values ({previous} and {wall_s}); "
                "rows of one batch must share it"
            )
        self.walls[key] = float(wall_s)
        self.rows[key] = self.rows.get(key, 0) + int(rows)

    def without_warmup(self) -> BatchTimes:
        first: dict[tuple[str, int], int] = {}
        count: dict[tuple[str, int], int] = {}
        for actor, shard, batch in self.walls:
            first[(actor, shard)] = min(batch, first.get((actor, shard), batch))
            count[(actor, shard)] = count.get((actor, shard), 0) + 1
        kept = BatchTimes()
        for key, wall in self.walls.items():
            actor, shard, batch = key
            if count[(actor, shard)] > 1 and batch == first[(actor, shard)]:
                continue
            kept.walls[key] = wall
            kept.rows[key] = self.rows[key]
        return kept


def record_batch_times(times: BatchTimes, batch: pa.RecordBatch, shard: int, sample_ids: np.ndarray,
                       nominal_batch_size: int | None) -> bool:
    """Add a record batch of one shard's rows to ``times``: each row under (actor, shard, batch index),
    the index ``sample_id // nominal_batch_size`` (the plan cuts batches at multiples of the batch
    size; None: the rows' largest ``batch_size``). Returns whether the rows have an actor column."""
    walls = batch.column("batch_wall_time_s").to_numpy()
    has_actor = "actor" in batch.schema.names
    if has_actor:
        actors = ["" if a is None else str(a) for a in batch.column("actor").to_pylist()]
    else:
        actors = [""] * batch.num_rows  # rows of one shard task ran on one actor
    nominal = nominal_batch_size or int(batch.column("batch_size").to_numpy().astype(np.int64).max())
    for actor, index, wall in zip(actors, (sample_ids // nominal).tolist(), walls.tolist()):
        times.add((actor, shard, index), wall, 1)
    return has_actor


@dataclass
class SpeedupResult:
    speedup: float  # median over paired batches of baseline_wall / arm_wall
    speedup_ci: tuple[float, float]
    throughput_speedup: float  # sum(baseline_wall) / sum(arm_wall) over paired batches
    throughput_ci: tuple[float, float]
    num_pairs: int
    warmup_dropped: bool
    pairing: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "speedup": self.speedup,
            "speedup_ci": list(self.speedup_ci),
            "throughput_speedup": self.throughput_speedup,
            "throughput_ci": list(self.throughput_ci),
            "num_pairs": self.num_pairs,
            "warmup_dropped": self.warmup_dropped,
            "pairing": self.pairing,
        }


def paired_walls(arm: BatchTimes, baseline: BatchTimes) -> np.ndarray:
    """``[P, 2]`` (arm_wall, baseline_wall) on keys both have, in key order."""
    keys = sorted(set(arm.walls) & set(baseline.walls))
    return np.array([[arm.walls[k], baseline.walls[k]] for k in keys], dtype=np.float64).reshape(-1, 2)


def _median_ratio(pairs: np.ndarray) -> float:
    return float(np.median(pairs[:, 1] / pairs[:, 0]))


def _throughput_ratio(pairs: np.ndarray) -> float:
    return float(pairs[:, 1].sum() / pairs[:, 0].sum())


def speedup_over_baseline(
    arm: BatchTimes,
    baseline: BatchTimes,
    *,
    drop_warmup: bool = True,
    num_replicates: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
    pairing: str = "actor,shard,batch",
) -> SpeedupResult:
    """Median per-batch speedup and throughput speedup with bootstrap intervals over paired batches."""
    pairs = paired_walls(arm.without_warmup(), baseline.without_warmup()) if drop_warmup else np.zeros((0, 2))
    warmup_dropped = drop_warmup and len(pairs) > 0
    if not warmup_dropped:  # nothing left after warm-up removal (one batch per shard): keep everything
        pairs = paired_walls(arm, baseline)
    if len(pairs) == 0:
        nan = float("nan")
        return SpeedupResult(nan, (nan, nan), nan, (nan, nan), 0, warmup_dropped, pairing)
    if (pairs <= 0).any():
        raise ValueError("batch_wall_time_s must be positive for every paired batch")
    return SpeedupResult(
        speedup=_median_ratio(pairs),
        speedup_ci=bootstrap_statistic(pairs, _median_ratio, num_replicates, seed, confidence),
        throughput_speedup=_throughput_ratio(pairs),
        throughput_ci=bootstrap_statistic(pairs, _throughput_ratio, num_replicates, seed + 1, confidence),
        num_pairs=len(pairs),
        warmup_dropped=warmup_dropped,
        pairing=pairing,
    )


# ---------------------------------------------------------------- latency at batch 1, NFE ratio


def latency_speedup(
    arm: BatchTimes,
    baseline: BatchTimes,
    *,
    drop_warmup: bool = True,
    num_replicates: int = 1000,
    seed: int = 0,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """Latency speedup at batch 1: per-sample wall times paired by (actor, shard, sample_id).

    At batch size 1 a batch record *is* one sample's latency, and the batch key of a
    sample is its sample_id, so pairs are the same sample on the same actor. The value
    is mean baseline latency / mean arm latency over the pairs (with the warm-up
    batches dropped), with a bootstrap interval over paired samples; the median
    per-sample ratio is given beside it. Runs at a larger batch size have no latency
    measurement (a sample's wall time is the batch's share): ``available`` is false.
    """
    sizes = set(arm.rows.values()) | set(baseline.rows.values())
    if sizes != {1}:
        return {"available": False,
                "reason": f"latency needs batch size 1; this run's batches hold {sorted(sizes)[-1] if sizes else 0} "
                          "samples (run a job with batch_size: 1 for latency)"}
    result = speedup_over_baseline(arm, baseline, drop_warmup=drop_warmup, num_replicates=num_replicates,
                                   seed=seed, confidence=confidence, pairing="actor,shard,sample_id")
    return {"available": True, "speedup": result.throughput_speedup, "ci": list(result.throughput_ci),
            "median_ratio": result.speedup, "median_ratio_ci": list(result.speedup_ci),
            "num_pairs": result.num_pairs, "warmup_dropped": result.warmup_dropped}


def ratio_with_paired_bootstrap(
    baseline_total: float, arm_total: float, baseline_replicates: np.ndarray, arm_replicates: np.ndarray,
    confidence: float = 0.95,
) -> dict[str, Any]:
    """``baseline_total / arm_total`` with the percentile interval of the replicate ratios.

    The replicate sums come from the same Poisson weights keyed by sample_id in both
    arms (``ArmAccumulator.target_calls_boot``), so each replicate resamples the same
    samples in both: a paired bootstrap of the ratio of totals.
    """
    from specray.eval.bootstrap import percentile_interval

    if not arm_total:
        return {"value": None, "ci": [None, None]}
    ok = arm_replicates > 0
    ratios = baseline_replicates[ok] / arm_replicates[ok]
    return {"value": float(baseline_total / arm_total), "ci": list(percentile_interval(ratios, confidence))}
