"""Per-arm streaming state: everything the report needs, updated one record batch at a time.

Memory per arm is fixed (feature moments, ``B`` bootstrap replicates, counters,
one float per batch of wall time, a few grid images) plus, only while it fits
in ``image_budget_bytes``, the arm's raw images for torch-fidelity's own
``calculate_metrics`` (which holds its inputs in memory). Past the budget the
images are dropped and FID comes from the streamed moments alone.
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from specray.eval.bootstrap import BootstrapMoments, poisson_weights
from specray.eval.extractors import FeatureSet
from specray.eval.fid import FeatureMoments
from specray.eval.quality import InceptionScoreAccumulator, PrcKeeper
from specray.eval.speedup import BatchTimes, record_batch_times


@dataclass
class AcceptanceTotals:
    """Pooled counters: ratios of sums, not means of per-sample ratios."""

    num_samples: int = 0
    num_tokens: int = 0
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    target_calls: int = 0
    draft_calls: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    sample_wall_time_s: float = 0.0
    # extra_stats["acceptance_timeline"] = {"accepted": [...], "drafted": [...]} summed over samples (bins of the
    # sequence / denoising timeline), when the loop stores it
    timeline_accepted: list[float] = field(default_factory=list)
    timeline_drafted: list[float] = field(default_factory=list)
    # numeric extra_stats summed over samples (e.g. CSpD's resampled_tokens and resample_cap_hits)
    extra_sums: dict[str, float] = field(default_factory=dict)

    def update(self, batch: pa.RecordBatch) -> None:
        column = lambda name: np.asarray(batch.column(name).to_numpy(zero_copy_only=False))  # noqa: E731
        self.num_samples += batch.num_rows
        self.num_tokens += int(column("num_tokens").sum())
        self.num_spec_steps += int(column("num_spec_steps").sum())
        self.num_draft_tokens += int(column("num_draft_tokens").sum())
        self.num_accepted_draft_tokens += int(column("num_accepted_draft_tokens").sum())
        self.target_calls += int(column("target_calls").sum())
        self.draft_calls += int(column("draft_calls").sum())
        self.sample_wall_time_s += float(column("sample_wall_time_s").sum())
        for positions in batch.column("accepted_per_position").to_pylist():
            positions = positions or []
            if len(positions) > len(self.accepted_per_position):
                self.accepted_per_position.extend([0] * (len(positions) - len(self.accepted_per_position)))
            for i, value in enumerate(positions):
                self.accepted_per_position[i] += int(value)
        if "extra_stats" in batch.schema.names:
            for text in batch.column("extra_stats").to_pylist():
                self._add_extra(text)

    def _add_extra(self, text: str | None) -> None:
        if not text or text == "{}":
            return
        extra = json.loads(text)
        for key, value in extra.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.extra_sums[key] = self.extra_sums.get(key, 0) + value
        timeline = extra.get("acceptance_timeline") or {}
        if not timeline:
            return
        for name, total in (("accepted", self.timeline_accepted), ("drafted", self.timeline_drafted)):
            values = timeline.get(name) or []
            if len(values) > len(total):
                total.extend([0.0] * (len(values) - len(total)))
            for i, value in enumerate(values):
                total[i] += float(value)

    @property
    def acceptance_timeline(self) -> list[float | None]:
        """Acceptance rate per timeline bin (accepted / drafted), from extra_stats; [] when not stored."""
        return [a / d if d else None for a, d in zip(self.timeline_accepted, self.timeline_drafted)]

    @property
    def accepted_length_histogram(self) -> dict[str, Any]:
        """Rounds by number of accepted draft tokens, ``counts[k]`` for k = 0..gamma.

        Derived from the per-sample counters, not stored per round: with prefix acceptance (a
        draft token is accepted only if all before it were, as in token and block verification)
        ``accepted_per_position[i]`` is the number of rounds with accepted length > i, so
        ``counts[k] = app[k-1] - app[k]`` (``app[-1]`` = rounds, ``app[gamma]`` = 0) is exact
        summed over samples. ``exact`` is false when the counters are not non-increasing in
        position (not prefix acceptance); the counts are then clipped at 0 and approximate.
        """
        app = self.accepted_per_position
        if not self.num_spec_steps or not app:
            return {"counts": [], "exact": True}
        bounds = [self.num_spec_steps, *app, 0]
        raw = [bounds[k] - bounds[k + 1] for k in range(len(app) + 1)]
        return {"counts": [max(0, int(v)) for v in raw], "exact": all(v >= 0 for v in raw)}

    @property
    def mean_acceptance_length(self) -> float:
        """Emitted tokens per target call, bonus included (target_only: 1.0)."""
        return self.num_tokens / self.target_calls if self.target_calls else float("nan")

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted_draft_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def acceptance_by_position(self) -> list[float]:
        """Fraction of rounds in which draft position i was accepted."""
        if not self.num_spec_steps:
            return []
        return [v / self.num_spec_steps for v in self.accepted_per_position]


@dataclass
class GridKeeper:
    """Keeps the images of the ``per_class`` smallest sample_ids of each class.

    Every arm has the same sample_ids, so every arm keeps the same ones: the
    grid shows the same samples side by side.
    """

    per_class: int
    # class -> max-heap (negated sample_id, image)
    kept: dict[int, list[tuple[int, int, np.ndarray]]] = field(default_factory=dict)

    def offer(self, sample_ids: np.ndarray, labels: np.ndarray, images: np.ndarray) -> None:
        for sid, label, image in zip(sample_ids.tolist(), labels.tolist(), images):
            heap = self.kept.setdefault(int(label), [])
            item = (-sid, sid, image)
            if len(heap) < self.per_class:
                heapq.heappush(heap, item)
            elif sid < heap[0][1]:
                heapq.heapreplace(heap, item)

    def images_by_id(self) -> dict[int, tuple[int, np.ndarray]]:
        return {sid: (label, image) for label, heap in self.kept.items() for _, sid, image in heap}


@dataclass
class ArmAccumulator:
    name: str
    feature_dim: int
    bootstrap_replicates: int
    bootstrap_seed: int
    grid_per_class: int
    image_budget_bytes: int
    nominal_batch_size: int | None
    moments: FeatureMoments = field(init=False)
    halves: tuple[FeatureMoments, FeatureMoments] = field(init=False)
    bootstrap: BootstrapMoments = field(init=False)
    totals: AcceptanceTotals = field(default_factory=AcceptanceTotals)
    times: BatchTimes = field(default_factory=BatchTimes)
    grid: GridKeeper = field(init=False)
    images: list[np.ndarray] | None = field(default_factory=list)  # None once over budget
    image_bytes: int = 0
    metadata: dict[str, str] = field(default_factory=dict)
    has_actor_column: bool = False
    isc_classes: int = 0  # > 0: accumulate the Inception Score over this many classes
    alignment: Any = None  # a prompt run's AlignmentAccumulator (specray.eval.alignment), set by the reducer
    isc_splits: int = 10
    prc_max_samples: int = 0  # > 0: keep feature rows of sample_ids below this for precision/recall
    isc: InceptionScoreAccumulator | None = field(init=False, default=None)
    prc: PrcKeeper = field(init=False)
    # Poisson-bootstrap replicate sums of target calls, keyed by sample_id like the FID bootstrap, so that
    # replicate b of two arms weights the same samples: a paired interval for the NFE ratio
    target_calls_boot: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.moments = FeatureMoments(self.feature_dim)
        self.halves = (FeatureMoments(self.feature_dim), FeatureMoments(self.feature_dim))
        self.bootstrap = BootstrapMoments(self.feature_dim, self.bootstrap_replicates, self.bootstrap_seed)
        self.grid = GridKeeper(self.grid_per_class)
        if self.isc_classes > 0:
            self.isc = InceptionScoreAccumulator(self.isc_classes, self.isc_splits)
        self.prc = PrcKeeper(self.prc_max_samples)
        self.target_calls_boot = np.zeros(self.bootstrap_replicates)

    def update(self, batch: pa.RecordBatch, shard: int, images: np.ndarray, features: np.ndarray | FeatureSet) -> None:
        sample_ids = batch.column("sample_id").to_numpy().astype(np.int64)
        if isinstance(features, FeatureSet):
            if self.isc is not None and features.isc is not None:
                self.isc.update(features.isc, sample_ids)
            self.prc.offer(features.prc, sample_ids)
            features = features.fid
        calls = batch.column("target_calls").to_numpy(zero_copy_only=False).astype(np.float64)
        weights = poisson_weights(self.bootstrap_seed, sample_ids, self.bootstrap_replicates)
        self.target_calls_boot += weights.T @ calls
        labels = batch.column("class_label").to_numpy(zero_copy_only=False).astype(np.int64)
        for key in ("method", "family", "target", "draft", "device"):
            if key not in self.metadata:
                self.metadata[key] = batch.column(key)[0].as_py()
        self.moments.update(features)
        even = sample_ids % 2 == 0
        self.halves[0].update(features[even])
        self.halves[1].update(features[~even])
        self.bootstrap.update(features, sample_ids, weights)
        self.totals.update(batch)
        self.grid.offer(sample_ids, labels, images)
        self._record_times(batch, shard, sample_ids)
        if self.images is not None:
            self.image_bytes += images.nbytes
            if self.image_bytes <= self.image_budget_bytes:
                self.images.append(images)
            else:
                self.images = None  # over budget: streamed statistics only

    def _record_times(self, batch: pa.RecordBatch, shard: int, sample_ids: np.ndarray) -> None:
        if record_batch_times(self.times, batch, shard, sample_ids, self.nominal_batch_size):
            self.has_actor_column = True
