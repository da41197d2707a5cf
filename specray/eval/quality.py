"""Inception Score (streamed) and precision/recall (torch-fidelity's ``prc``) of an arm.

IS streams: sample ``i`` goes to a split drawn from a counter-based uniform
keyed by its sample_id (batch-, shard- and class-independent), and each split keeps ``sum p(y|x)`` and ``sum_x sum_y p log p``
in float64, which is all ``exp(E_x KL(p(y|x) || p(y)))`` needs:
``mean_x sum_y p log p - sum_y pbar_y log pbar_y``. With ``splits=1`` this is
exactly torch-fidelity's ``isc_features_to_metric(..., splits=1)`` (tested to
1e-6 relative). torch-fidelity splits a shuffled list instead; the mean over
splits is the same estimator with a different (deterministic) partition.

Precision/recall need nearest-neighbour balls over raw features, so they keep
the feature rows of sample_ids ``< prc_max_samples`` (a class-balanced prefix
by the plan's rule) and call ``torch_fidelity.metric_prc.prc_features_to_metric``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

ISC_SPLIT_STREAM = "isc_split"


def isc_split_of(sample_ids: np.ndarray, splits: int, seed: int = 0) -> np.ndarray:
    """Split of each sample: a counter-based uniform keyed by sample_id (not ``sample_id % splits``, which
    would put one class per split since the plan gives sample i class ``classes[i % C]``)."""
    from specray import rng

    ids = torch.as_tensor(np.asarray(sample_ids, dtype=np.int64))
    u = rng.uniform(seed, ids, ISC_SPLIT_STREAM).numpy()
    return np.minimum((u * splits).astype(np.int64), splits - 1)


@dataclass
class InceptionScoreAccumulator:
    num_classes: int
    splits: int = 10
    sum_p: np.ndarray = field(init=False)
    sum_plogp: np.ndarray = field(init=False)
    count: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if self.splits < 1:
            raise ValueError(f"isc_splits must be >= 1, got {self.splits}")
        self.sum_p = np.zeros((self.splits, self.num_classes))
        self.sum_plogp = np.zeros(self.splits)
        self.count = np.zeros(self.splits)

    def update(self, logits: np.ndarray, sample_ids: np.ndarray) -> None:
        logits_t = torch.from_numpy(np.asarray(logits, dtype=np.float64))
        p = logits_t.softmax(dim=1).numpy()
        log_p = logits_t.log_softmax(dim=1).numpy()
        plogp = (p * log_p).sum(1)
        split = isc_split_of(sample_ids, self.splits)
        np.add.at(self.sum_p, split, p)
        np.add.at(self.sum_plogp, split, plogp)
        np.add.at(self.count, split, 1.0)

    def split_scores(self) -> np.ndarray:
        scores = []
        for s in range(self.splits):
            if self.count[s] == 0:
                continue
            pbar = self.sum_p[s] / self.count[s]
            cross = float(np.sum(pbar * np.log(np.where(pbar > 0, pbar, 1.0))))
            scores.append(np.exp(self.sum_plogp[s] / self.count[s] - cross))
        return np.asarray(scores)

    def result(self) -> dict[str, Any]:
        scores = self.split_scores()
        return {"mean": float(scores.mean()) if len(scores) else None,
                "std": float(scores.std()) if len(scores) else None,  # population std, as torch-fidelity
                "splits": self.splits}


@dataclass
class PrcKeeper:
    """Feature rows of sample_ids below ``max_samples`` (order fixed by sample_id)."""

    max_samples: int
    ids: list[np.ndarray] = field(default_factory=list)
    rows: list[np.ndarray] = field(default_factory=list)

    def offer(self, features: np.ndarray | None, sample_ids: np.ndarray) -> None:
        if features is None or self.max_samples <= 0:
            return
        keep = np.asarray(sample_ids) < self.max_samples
        if keep.any():
            self.ids.append(np.asarray(sample_ids)[keep])
            self.rows.append(np.asarray(features)[keep])

    def features(self) -> np.ndarray | None:
        if not self.rows:
            return None
        ids = np.concatenate(self.ids)
        return np.concatenate(self.rows)[np.argsort(ids, kind="stable")]


def precision_recall(generated: np.ndarray, reference: np.ndarray, neighborhood: int = 3) -> dict[str, float]:
    """torch-fidelity's k-NN precision/recall (generated = input1, reference = input2)."""
    from torch_fidelity.metric_prc import prc_features_to_metric

    out = prc_features_to_metric(
        torch.from_numpy(np.ascontiguousarray(generated, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(reference, dtype=np.float32)),
        prc_neighborhood=neighborhood, prc_batch_size=10000, save_cpu_ram=True, verbose=False,
    )
    return {"precision": float(out["precision"]), "recall": float(out["recall"]), "f_score": float(out["f_score"]),
            "num_generated": int(len(generated)), "num_reference": int(len(reference)), "neighborhood": neighborhood}
