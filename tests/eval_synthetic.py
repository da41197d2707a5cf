"""Synthetic runs for the reducer's tests, benchmark and notebook test: real digits images written as a
specray run (Parquet shards via the runtime's RunStore + a manifest shaped like the coordinator's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from specray.runtime.images import encode_png
from specray.runtime.store import RunStore, ShardIdentity, rows_to_table

SYNTHETIC_FINGERPRINT = "5ynthet1c0000000"  # the job fingerprint the synthetic files and manifest share


@dataclass
class SyntheticArm:
    name: str
    method: str = "target_only"
    family: str = "discrete_ar"
    images: np.ndarray | None = None  # uint8 [N, 8, 8]; None: digits starting at image_offset
    image_offset: int = 0
    params: dict[str, Any] = field(default_factory=dict)
    seconds_per_sample: float = 0.01
    accepted_per_position: list[int] = field(default_factory=list)  # per sample; [] = not speculative
    spec_steps: int = 0
    timeline: dict[str, list[float]] | None = None  # extra_stats.acceptance_timeline per sample
    extra: dict[str, Any] = field(default_factory=dict)  # more extra_stats per sample
    target: str = "t"
    draft: str | None = "d"


def digits_pool() -> np.ndarray:
    from specray.eval.fid import digits_reference_images

    return digits_reference_images().numpy()


def write_run(root: str, arms: list[SyntheticArm], *, per_class: int = 20, classes: tuple[int, ...] = tuple(range(10)),
              batch_size: int = 20, shard_batches: int = 5, seed: int = 0, actor: bool = True,
              mutate_rows: Callable[[str, list[dict[str, Any]]], list[dict[str, Any]]] | None = None,
              eval_options: dict[str, Any] | None = None, pool: np.ndarray | None = None,
              reference: str = "digits") -> dict[str, Any]:
    """Write a run; ``mutate_rows(arm, rows)`` may break it (drop/duplicate/relabel rows). Returns the manifest."""
    pool = digits_pool() if pool is None else pool
    n = per_class * len(classes)
    store = RunStore(root)
    shard_size = batch_size * shard_batches
    num_shards = -(-n // shard_size)
    shards = []
    for arm in arms:
        images = arm.images if arm.images is not None else pool[np.arange(arm.image_offset, arm.image_offset + n) % len(pool)]
        rows = []
        for sid in range(n):
            batch = sid // batch_size
            rows_in_batch = min(batch_size, n - batch * batch_size)
            wall = arm.seconds_per_sample * rows_in_batch * (1.0 + 0.05 * (batch % 3))
            app = list(arm.accepted_per_position)
            gamma = len(app)
            rounds = arm.spec_steps
            drafted = gamma * rounds
            accepted = sum(app)
            tokens = 64
            target_calls = rounds if rounds else tokens
            extra = {**arm.extra, **({"acceptance_timeline": arm.timeline} if arm.timeline else {})}
            rows.append({
                "job_id": "synthetic", "arm": arm.name, "method": arm.method, "family": arm.family,
                "target": arm.target, "draft": arm.draft, "sample_id": sid,
                "seed": seed + int(arm.params.get("seed_offset", 0)), "class_label": classes[sid % len(classes)],
                "prompt_id": None, "prompt": None, "repeat": None,
                "image": {"bytes": encode_png(images[sid]), "path": None}, "height": 8, "width": 8,
                "num_tokens": tokens, "num_spec_steps": rounds, "num_draft_tokens": drafted,
                "num_accepted_draft_tokens": accepted,
                "draft_acceptance_rate": accepted / drafted if drafted else float("nan"),
                "mean_acceptance_length": tokens / target_calls, "accepted_per_position": app,
                "target_calls": target_calls, "draft_calls": drafted, "batch_size": rows_in_batch,
                "batch_wall_time_s": wall, "sample_wall_time_s": wall / rows_in_batch,
                "params": json.dumps(arm.params), "specray_version": "0", "torch_version": "0", "device": "cpu",
                "extra_stats": json.dumps(extra),
            })
        if mutate_rows is not None:
            rows = mutate_rows(arm.name, rows)
        for k in range(num_shards):
            lo, hi = k * shard_size, min((k + 1) * shard_size, n)
            part = [r for r in rows if lo <= r["sample_id"] < hi]
            if k == num_shards - 1:
                part += [r for r in rows if not 0 <= r["sample_id"] < n]
            from specray.runtime.store import SAMPLE_SCHEMA

            if "actor" in SAMPLE_SCHEMA.names:  # the runtime writes it; None when this run has no actor column
                part = [{**r, "actor": f"actor-{k % 2}" if actor else None} for r in part]
            table = rows_to_table(part)
            if actor and "actor" not in SAMPLE_SCHEMA.names:
                import pyarrow as pa

                table = table.append_column("actor", pa.array([f"actor-{k % 2}"] * len(part), pa.string()))
            path = f"samples/{arm.name}/shard-{k:05d}-of-{num_shards:05d}.parquet"
            committed = store.write_shard(path, table, ShardIdentity(SYNTHETIC_FINGERPRINT, arm.name, k, num_shards))
            shards.append({"arm": arm.name, "shard": k, "num_shards": num_shards, "first_sample_id": lo,
                           **committed.to_dict()})
    manifest = {
        "format": 1, "job_id": "synthetic", "fingerprint": SYNTHETIC_FINGERPRINT,
        "spec": {"job_id": "synthetic", "seed": seed, "batch_size": batch_size,
                 "conditions": {"kind": "class_labels", "per_class": per_class, "classes": list(classes)},
                 "eval": {"fid": True, "reference": reference, "baseline": None,
                          "options": {"bootstrap_replicates": 50, "speedup_replicates": 200, **(eval_options or {})}}},
        "layout": {"num_samples": n, "batch_size": batch_size, "shard_batches": shard_batches, "num_shards": num_shards},
        "arms": [{"name": a.name, "family": a.family, "method": a.method, "target": a.target, "draft": a.draft,
                  "params": a.params} for a in arms],
        "num_rows": sum(s["rows"] for s in shards),
        "shards": shards,
    }
    store.write_json("_manifest.json", manifest)
    return manifest


def standard_arms() -> list[SyntheticArm]:
    """target_only, a lossless sd (other digits), a seed replica of target_only, a noise arm."""
    noise = np.random.default_rng(5).integers(0, 256, size=(2000, 8, 8), dtype=np.uint8)
    timeline = {"accepted": [3.0, 2.0, 1.0, 0.5], "drafted": [4.0, 4.0, 4.0, 4.0]}
    return [
        SyntheticArm("target_only"),
        SyntheticArm("target_only_s1", params={"seed_offset": 1}, image_offset=400),
        SyntheticArm("target_only_s2", params={"seed_offset": 2}, image_offset=800),
        SyntheticArm("sd", method="sd", image_offset=1200, params={"gamma": 4}, seconds_per_sample=0.004,
                     accepted_per_position=[12, 9, 6, 3], spec_steps=16, timeline=timeline),
        SyntheticArm("noisy", method="lantern", images=noise, params={"gamma": 4}, seconds_per_sample=0.002,
                     accepted_per_position=[14, 12, 10, 8], spec_steps=13),
    ]


def demo_arms() -> list[SyntheticArm]:
    """The built-in demo's arms (names, families, methods, params, seed offsets from specray/demo.yaml) over
    digits images, with per-family speeds and acceptance counters; CSpD arms carry resampling counters."""
    from specray.spec import builtin_demo_job

    per_sample = {"discrete_ar": 0.01, "continuous_ar": 0.02, "diffusion": 0.05}  # each family's target cost
    arms = []
    for i, arm in enumerate(builtin_demo_job().arms):
        speculative = arm.method != "target_only"
        base = per_sample[arm.family]
        params = {**arm.params, **({"seed_offset": arm.seed_offset} if arm.seed_offset else {})}
        extra = {"resampled_tokens": 10, "resample_cap_hits": 1 + i % 2} if arm.method == "cspd" else {}
        arms.append(SyntheticArm(arm.name, method=arm.method, family=arm.family, params=params,
                                 image_offset=97 * i, seconds_per_sample=base / (1.0 + 0.1 * i) if speculative else base,
                                 accepted_per_position=[6, 4, 2, 1] if speculative else [],
                                 spec_steps=8 if speculative else 0, extra=extra,
                                 target=arm.target_key, draft=arm.draft_key))
    return arms
