"""The reducer: a run's committed shards -> FID, acceptance, speedup -> ``report/``.

``reduce_run(run_dir)`` reads ``_manifest.json`` and only the shards it lists,
streams them arm by arm (record batches of ``batch_rows``), and writes
``report/report.json`` and ``report/grid.png``.

FID is against the digits data (all 1797 images) in the feature space of the
project's digits classifier (torch-fidelity extractor ``specray-digits``). The
point value comes from ``torch_fidelity.calculate_metrics`` while an arm's
images fit ``image_budget_bytes``; otherwise (and always, as a cross-check)
from streamed float64 moments through torch-fidelity's Fréchet formula.

Noise: every arm carries a 95% Poisson-bootstrap interval over its samples
(percentile interval shifted by the bootstrap bias, see ``bias_shifted_interval``),
and, against its baseline, the interval of the *paired* bootstrap difference
(the same sample_ids resampled in both arms); ``within_noise`` is true when
that interval contains 0. ``halves`` gives FID of the even and odd sample_ids
separately (a split-half view of seed-to-seed spread at N/2 samples).

report.json (``format`` "specray-report/1")::

    {format, run, job_id, num_rows,
     fid_setup: {feature_extractor, feature_layer, feature_dim, reference, reference_count,
                 extractor_heldout_accuracy, bootstrap_replicates, bootstrap_seed, confidence},
     options: {...},
     arms: [{arm, method, family, target, draft, device, baseline, num_samples,
             fid: {value, source, streaming, ci, bootstrap_std, halves: [even, odd],
                   diff_vs_baseline: {value, ci, within_noise} | null},
             acceptance: {mean_acceptance_length, draft_acceptance_rate, acceptance_by_position,
                          num_tokens, num_spec_steps, num_draft_tokens, num_accepted_draft_tokens,
                          target_calls, draft_calls},
             nfe_ratio,
             speedup: {speedup, speedup_ci, throughput_speedup, throughput_ci, num_pairs,
                       warmup_dropped, pairing} | null}],
     table: {columns: [...], rows: [[...]]},
     grid: {path, sample_ids, arms}}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from specray.eval.accumulate import ArmAccumulator
from specray.eval.bootstrap import bias_shifted_interval
from specray.eval.fid import DigitsFeatureExtractor, FeatureMoments, digits_reference_images, fid_torch_fidelity, frechet_distance
from specray.eval.report import TABLE_COLUMNS, format_table, grid_png, table_rows, write_json
from specray.eval.shards import RunManifest, decode_images, iter_shard_batches, read_manifest
from specray.eval.speedup import speedup_over_baseline
from specray.runtime.store import RunStore

REPORT_FORMAT = "specray-report/1"
SUPPORTED_REFERENCES = ("digits",)


@dataclass(frozen=True)
class ReduceOptions:
    device: str = "cpu"
    batch_rows: int = 1024  # rows per streamed record batch
    bootstrap_replicates: int = 200
    bootstrap_seed: int = 0
    confidence: float = 0.95
    grid_per_class: int = 2  # grid columns: this many smallest sample_ids of each class
    image_budget_bytes: int = 256 * 2**20  # per arm, for torch-fidelity's in-memory calculate_metrics
    drop_warmup: bool = True
    speedup_replicates: int = 1000

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ReduceOptions:
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - allowed)
        if unknown:
            raise ValueError(f"eval.options: unknown reducer option(s) {unknown}; allowed: {sorted(allowed)}")
        options = cls(**values)
        if options.bootstrap_replicates < 2:
            raise ValueError(f"bootstrap_replicates must be >= 2, got {options.bootstrap_replicates}")
        if not 0.0 < options.confidence < 1.0:
            raise ValueError(f"confidence must be in (0, 1), got {options.confidence}")
        return options


def reduce_run(
    run_dir: str,
    *,
    print_table: bool = True,
    options: ReduceOptions | None = None,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score a committed run and write ``<run_dir>/report/{report.json,grid.png}``; returns the report dict.

    ``options`` default to the job's ``eval.options`` from the manifest, then to ``ReduceOptions()``.
    """
    store = RunStore(run_dir, storage_options)
    manifest = read_manifest(store)
    spec_eval = (manifest.raw.get("spec") or {}).get("eval") or {}
    if options is None:
        options = ReduceOptions.from_dict(dict(spec_eval.get("options") or {}))
    reference = spec_eval.get("reference", "digits")
    if reference not in SUPPORTED_REFERENCES:
        raise ValueError(f"eval.reference {reference!r} is not supported yet; allowed: {list(SUPPORTED_REFERENCES)}")

    extractor = DigitsFeatureExtractor(options.device)
    reference_images = digits_reference_images()
    reference_moments = FeatureMoments(extractor.dim)
    reference_moments.update(extractor(reference_images))
    reference_stats = reference_moments.statistics()

    arm_results: dict[str, dict[str, Any]] = {}
    accumulators: dict[str, ArmAccumulator] = {}
    bootstrap_fids: dict[str, np.ndarray] = {}
    for arm in manifest.arm_names:
        acc = _stream_arm(store, manifest, arm, extractor, options)
        fid, bootstrap_fids[arm] = _arm_fid(acc, reference_stats, reference_images, options)
        acc.bootstrap = None  # type: ignore[assignment]  # free B*d^2 floats before the next arm
        acc.images = None
        accumulators[arm] = acc
        arm_results[arm] = _arm_entry(arm, manifest, acc, fid)

    for arm, entry in arm_results.items():
        baseline = _baseline_for(arm, manifest, arm_results)
        entry["baseline"] = baseline
        if baseline is None:
            continue
        diff = bootstrap_fids[arm] - bootstrap_fids[baseline]
        diff_value = entry["fid"]["value"] - arm_results[baseline]["fid"]["value"]
        ci = bias_shifted_interval(diff, diff_value, options.confidence)
        entry["fid"]["diff_vs_baseline"] = {
            "value": diff_value,
            "ci": list(ci),
            "within_noise": bool(ci[0] <= 0.0 <= ci[1]),
        }
        base_calls = accumulators[baseline].totals.target_calls
        entry["nfe_ratio"] = base_calls / accumulators[arm].totals.target_calls if accumulators[arm].totals.target_calls else None
        pairing = "actor,shard,batch" if accumulators[arm].has_actor_column else "shard,batch (no actor column; a shard task runs on one actor)"
        entry["speedup"] = speedup_over_baseline(
            accumulators[arm].times,
            accumulators[baseline].times,
            drop_warmup=options.drop_warmup,
            num_replicates=options.speedup_replicates,
            seed=options.bootstrap_seed,
            confidence=options.confidence,
            pairing=pairing,
        ).to_dict()

    arms = [arm_results[a] for a in manifest.arm_names]
    from specray.eval.digits_features import weights_metadata

    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "run": run_dir,
        "job_id": manifest.raw.get("job_id"),
        "num_rows": sum(a["num_samples"] for a in arms),
        "fid_setup": {
            "feature_extractor": "specray-digits",
            "feature_layer": "fc1",
            "feature_dim": extractor.dim,
            "reference": "digits (all 1797 images of sklearn load_digits, 0..16 -> 0..255)",
            "reference_count": int(reference_images.shape[0]),
            "extractor_heldout_accuracy": float(weights_metadata().get("heldout_accuracy", "nan")),
            "bootstrap_replicates": options.bootstrap_replicates,
            "bootstrap_seed": options.bootstrap_seed,
            "confidence": options.confidence,
        },
        "options": dataclasses.asdict(options),
        "arms": arms,
    }
    report["table"] = {"columns": list(TABLE_COLUMNS), "rows": table_rows(report)}
    report["grid"] = _write_grid(store, manifest.arm_names, accumulators)
    write_json(store, "report/report.json", report)
    if print_table:
        print(format_table(report))
    return report


def _stream_arm(
    store: RunStore, manifest: RunManifest, arm: str, extractor: DigitsFeatureExtractor, options: ReduceOptions
) -> ArmAccumulator:
    acc = ArmAccumulator(
        name=arm,
        feature_dim=extractor.dim,
        bootstrap_replicates=options.bootstrap_replicates,
        bootstrap_seed=options.bootstrap_seed,
        grid_per_class=options.grid_per_class,
        image_budget_bytes=options.image_budget_bytes,
        nominal_batch_size=manifest.batch_size,
    )
    entries = sorted((e for e in manifest.shards if e.arm == arm), key=lambda e: e.shard)
    for entry in entries:
        rows = 0
        for batch in iter_shard_batches(store, entry, options.batch_rows):
            images = decode_images(batch.column("image"))
            features = extractor(torch.from_numpy(images))
            acc.update(batch, entry.shard, images, features)
            rows += batch.num_rows
        if entry.rows >= 0 and rows != entry.rows:
            raise ValueError(f"shard {entry.path}: manifest lists {entry.rows} rows, file has {rows}")
    if acc.totals.num_samples < 2:
        raise ValueError(f"arm {arm!r}: {acc.totals.num_samples} samples in the manifest's shards; FID needs at least 2")
    return acc


def _arm_fid(
    acc: ArmAccumulator, reference_stats, reference_images: torch.Tensor, options: ReduceOptions
) -> tuple[dict[str, Any], np.ndarray]:
    streaming = frechet_distance(acc.moments.statistics(), reference_stats)
    if acc.images is not None:
        images = torch.from_numpy(np.concatenate(acc.images))
        value = fid_torch_fidelity(images, reference_images, cuda=options.device.startswith("cuda"))
        source = "torch_fidelity.calculate_metrics"
    else:
        value, source = streaming, "streamed moments + torch_fidelity fid_statistics_to_metric"
    replicates = np.array(
        [frechet_distance(acc.bootstrap.statistics(b), reference_stats) for b in range(acc.bootstrap.num_replicates)]
    )
    halves = [
        frechet_distance(half.statistics(), reference_stats) if half.count >= 2 else None for half in acc.halves
    ]
    low, high = bias_shifted_interval(replicates, value, options.confidence)
    fid = {
        "value": value,
        "source": source,
        "streaming": streaming,
        "ci": [max(0.0, low), high],  # FID is a squared distance: never below 0
        "bootstrap_std": float(np.std(replicates, ddof=1)),
        "halves": halves,
        "diff_vs_baseline": None,
    }
    return fid, replicates


def _arm_entry(arm: str, manifest: RunManifest, acc: ArmAccumulator, fid: dict[str, Any]) -> dict[str, Any]:
    info = manifest.arm_info(arm)
    totals = acc.totals
    return {
        "arm": arm,
        "method": info.get("method", acc.metadata.get("method")),
        "family": info.get("family", acc.metadata.get("family")),
        "target": info.get("target", acc.metadata.get("target")),
        "draft": info.get("draft", acc.metadata.get("draft")),
        "device": acc.metadata.get("device"),
        "baseline": None,
        "num_samples": totals.num_samples,
        "fid": fid,
        "acceptance": {
            "mean_acceptance_length": totals.mean_acceptance_length,
            "draft_acceptance_rate": totals.draft_acceptance_rate,
            "acceptance_by_position": totals.acceptance_by_position,
            "num_tokens": totals.num_tokens,
            "num_spec_steps": totals.num_spec_steps,
            "num_draft_tokens": totals.num_draft_tokens,
            "num_accepted_draft_tokens": totals.num_accepted_draft_tokens,
            "target_calls": totals.target_calls,
            "draft_calls": totals.draft_calls,
        },
        "nfe_ratio": None,
        "speedup": None,
    }


def _baseline_for(arm: str, manifest: RunManifest, results: dict[str, dict[str, Any]]) -> str | None:
    """The job's ``eval.baseline`` if it names an arm of the same family/target, else the first
    ``target_only`` arm with the same family and target (an arm that is one is its own baseline)."""
    entry = results[arm]
    same_model = lambda other: (results[other]["family"], results[other]["target"]) == (entry["family"], entry["target"])  # noqa: E731
    named = manifest.baseline_arm
    if named is not None:
        if named not in results:
            raise ValueError(f"eval.baseline {named!r} is not an arm of this run; arms: {list(results)}")
        if same_model(named):
            return named
    for other in results:
        if results[other]["method"] == "target_only" and same_model(other):
            return other
    return None


def _write_grid(store: RunStore, arm_names: list[str], accumulators: dict[str, ArmAccumulator]) -> dict[str, Any]:
    kept = {arm: accumulators[arm].grid.images_by_id() for arm in arm_names}
    common = sorted(set.intersection(*(set(k) for k in kept.values()))) if kept else []
    # order columns by class then sample_id, so each class's samples sit together
    label_of = {sid: kept[arm_names[0]][sid][0] for sid in common}
    sample_ids = sorted(common, key=lambda sid: (label_of[sid], sid))
    store.commit_bytes("report/grid.png", grid_png(arm_names, kept, sample_ids))
    return {"path": "report/grid.png", "sample_ids": sample_ids, "arms": arm_names}
