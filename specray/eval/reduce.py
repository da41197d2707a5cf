"""The reducer: a run's committed shards -> checks -> FID/IS/PR, acceptance, speedup -> ``report/``.

``reduce_run(run_dir)`` reads ``_manifest.json`` and only the shards it lists:

1. pre-scoring checks (``checks.py``: count == N, no duplicate sample_ids/seeds, label
   balance) -- a failure raises ``RunCheckError`` before anything is scored;
2. streams each arm in record batches of ``batch_rows`` through the feature extractor
   (``extractors.py``: ``specray-digits`` or ``inception-v3-compat`` from local weights),
   accumulating float64 feature moments, Poisson-bootstrap moments keyed by sample_id, IS
   sums, a few grid images and batch wall times -- memory does not grow with N;
3. FID against the reference statistics of ``eval.reference`` (``reference.py``: digits,
   ADM ``.npz``, torch-fidelity stats, image folder, Parquet). The point value comes from
   ``torch_fidelity.calculate_metrics`` for the digits reference while an arm's images fit
   ``image_budget_bytes``, otherwise from streamed moments through torch-fidelity's formula
   (its pass over the images recalls the streamed pass's features of identical batches:
   ``forward_memo.py``);
4. speedups against the baseline (``speedup.py``): throughput at the run's batch size,
   latency at batch 1, the NFE ratio, each with a 95% bootstrap interval; warm-up dropped;
5. "within noise": the paired bootstrap FID difference and, with seed replicas
   (``seed_offset``), the seed-to-seed spread (``noise.py``);
6. writes ``report/report.json``, ``report.md``, plots (``plots.py``) and ``grid.png``.

report.json (``format`` "specray-report/1")::

    {format, run, job_id, num_rows, checks: {passed, skipped, num_samples_per_arm, class_counts},
     fid_setup: {feature_extractor, feature_layer, feature_dim, isc_layer, prc_layer, reference,
                 reference_kind, reference_count, extractor_heldout_accuracy, bootstrap_replicates,
                 bootstrap_seed, confidence},
     options: {...},
     arms: [{arm, method, family, target, draft, device, baseline, num_samples, params,
             fid: {value, source, streaming, ci, bootstrap_std, halves: [even, odd],
                   diff_vs_baseline: {value, ci, within_noise} | null,
                   seed_spread: {group, mean, sd, num_seeds, z, within} | null},
             inception_score: {mean, std, splits} | null,
             precision_recall: {available, precision, recall, f_score, ...} | null,
             acceptance: {mean_acceptance_length, draft_acceptance_rate, acceptance_by_position,
                          accepted_length_histogram: {counts, exact}, acceptance_timeline,
                          num_tokens, num_spec_steps, num_draft_tokens, num_accepted_draft_tokens,
                          target_calls, draft_calls},
             nfe_ratio, nfe_ratio_ci,
             speedup: {speedup, speedup_ci, throughput_speedup, throughput_ci, num_pairs,
                       warmup_dropped, pairing, batch_size,
                       latency: {available, speedup, ci, median_ratio, median_ratio_ci, num_pairs} |
                                {available: false, reason}} | null}],
     seed_spread: [{family, target, arms, seed_offsets, fids, mean, sd, num_seeds, criterion, lossless_arms}],
     throughput: {feature_extraction_s, images_per_s},
     table: {columns: [...], rows: [[...]]},
     grid: {path, sample_ids, arms}}
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import numpy as np
import torch

from specray.eval.accumulate import ArmAccumulator
from specray.eval.bootstrap import bias_shifted_interval
from specray.eval.checks import MIN_SAMPLES_PER_ARM, RunCheckError, check_run  # noqa: F401  (RunCheckError re-exported)
from specray.eval.extractors import ImageFeatureExtractor
from specray.eval.fid import digits_reference_images, fid_torch_fidelity, frechet_distance
from specray.eval.forward_memo import forward_memo
from specray.eval.noise import claimed_law, law_note, seed_spread, target_only_params
from specray.eval.options import ReduceOptions
from specray.eval.quality import precision_recall
from specray.eval.reference import ReferenceStatistics, load_reference
from specray.eval.report import TABLE_COLUMNS, format_table, grid_png, render_report_files, table_rows, write_json
from specray.eval.shards import RunManifest, decode_images, iter_shard_batches, read_manifest
from specray.eval.speedup import latency_speedup, ratio_with_paired_bootstrap, speedup_over_baseline
from specray.eval.verify import partial_view, verify_files
from specray.runtime.progress import Progress
from specray.runtime.store import RunStore

REPORT_FORMAT = "specray-report/1"

# Below this many paired batches a bootstrap interval over batches has too few distinct values to
# mean much (with one pair it collapses to a point); the report says so instead of showing it bare.
MIN_SPEEDUP_PAIRS = 10
# Below this many samples per feature dimension the arm's feature covariance is poorly estimated
# (below 1 it is singular: rank <= N - 1 < d) and FID is dominated by its O(d/N) bias and its noise.
MIN_FID_SAMPLES_PER_DIM = 2


def reduce_run(
    run_dir: str,
    *,
    print_table: bool = True,
    options: ReduceOptions | None = None,
    storage_options: dict[str, Any] | None = None,
    reference: str | None = None,
    show_progress: bool | None = None,
    partial: bool = False,
) -> dict[str, Any]:
    """Score a committed run and write ``<run_dir>/report/`` (report.json, report.md, plots, grid); returns the report.

    ``options`` default to the job's ``eval.options`` from the manifest, then to ``ReduceOptions()``;
    ``reference`` defaults to the job's ``eval.reference`` (see ``specray.eval.reference``).
    Progress (reference, feature extraction per arm, where the report went) goes to stderr when
    ``show_progress`` (default: ``print_table``).
    Every listed file is verified first (``verify.py``: path, size, sha256, its own identity) and
    raises ``RunCheckError`` (a ValueError) naming the bad files, as does a failed pre-scoring
    check. ``partial``: score the files that verify and say in the report what is missing.
    """
    show_progress = print_table if show_progress is None else show_progress
    say = _say if show_progress else (lambda message: None)
    store = RunStore(run_dir, storage_options)
    manifest = read_manifest(store)
    spec_eval = (manifest.raw.get("spec") or {}).get("eval") or {}
    if options is None:
        options = ReduceOptions.parse(spec_eval.get("options") or {})
    reference_name = reference or spec_eval.get("reference", "digits")
    verified = verify_files(store, manifest, partial=partial)
    partial_info = None
    if not verified.complete:
        manifest, partial_info = partial_view(manifest, verified)
    checks = check_run(store, manifest, partial=partial_info is not None) if options.checks else None

    extractor = ImageFeatureExtractor(options.feature_extractor, options.device, options.inception_weights)
    say(f"reduce: {len(manifest.arm_names)} arms, {manifest.num_rows} rows; reference statistics of "
        f"{reference_name!r} through {extractor.name}")
    reference_stats = load_reference(reference_name, extractor, batch_rows=options.batch_rows,
                                     prc_max_samples=options.prc_max_samples if options.prc else 0)
    reference_images = None
    if reference_stats.kind == "digits" and extractor.name == "specray-digits":
        reference_images = digits_reference_images()  # lets torch-fidelity's calculate_metrics give the point FID

    arm_results: dict[str, dict[str, Any]] = {}
    accumulators: dict[str, ArmAccumulator] = {}
    bootstrap_fids: dict[str, np.ndarray] = {}
    scorer = _alignment_scorer(manifest, options, reference_stats.kind)
    extraction_s = 0.0
    with Progress(manifest.num_rows, what="features", enabled=show_progress) as progress:
        for index, arm in enumerate(manifest.arm_names):
            with _second_pass_memo(extractor, reference_images, options):
                acc, seconds = _stream_arm(store, manifest, arm, extractor, options, progress, scorer)
                extraction_s += seconds
                arm_results[arm] = _score_arm(arm, manifest, acc, reference_stats, reference_images, options,
                                              bootstrap_fids)
            accumulators[arm] = acc
            progress.note(f"reduce: [{index + 1}/{len(manifest.arm_names)}] {arm}: {acc.totals.num_samples} "
                          f"images, FID {arm_results[arm]['fid']['value']:.2f}")
    say("reduce: speedups, noise, report")
    _pair_with_baselines(manifest, arm_results, accumulators, bootstrap_fids, options)
    report = _assemble(run_dir, manifest, checks, extractor, reference_stats, options, arm_results, extraction_s,
                       partial_info)
    report["grid"] = _write_grid(store, manifest.arm_names, accumulators)
    write_json(store, "report/report.json", report)
    render_report_files(store, report, plots=options.plots)
    if print_table:
        print(format_table(report))
    say(f"report: {store.full_path('report/report.md')} (report.json, plots and grid.png beside it)")
    return report


def _second_pass_memo(extractor: ImageFeatureExtractor, reference_images: torch.Tensor | None,
                      options: ReduceOptions) -> contextlib.AbstractContextManager:
    """torch-fidelity's pass over an arm's kept images recalls the streamed pass's FID features of the same
    batches (``forward_memo``): both cut the images into batches of 256, so every batch of a shard whose rows
    are a multiple of 256 is found. Only for the digits extractor on the CPU, where torch-fidelity runs."""
    if reference_images is None or extractor.device.type != "cpu":
        return contextlib.nullcontext()
    return forward_memo([extractor.layers["fid"]], options.image_budget_bytes)


def _say(message: str) -> None:
    import sys

    print(message, file=sys.stderr, flush=True)


def _score_arm(arm: str, manifest: RunManifest, acc: ArmAccumulator, reference_stats: ReferenceStatistics,
               reference_images: torch.Tensor | None, options: ReduceOptions,
               bootstrap_fids: dict[str, np.ndarray]) -> dict[str, Any]:
    """One arm's own numbers (FID, IS, PR, acceptance); frees what the next arm does not need."""
    fid, bootstrap_fids[arm] = _arm_fid(acc, reference_stats, reference_images, options)
    acc.bootstrap = None  # type: ignore[assignment]  # free B*d^2 floats before the next arm
    acc.images = None
    entry = _arm_entry(arm, manifest, acc, fid)
    entry["inception_score"] = acc.isc.result() if acc.isc is not None else None
    entry["precision_recall"] = _precision_recall(acc, reference_stats, options)
    acc.prc = None  # type: ignore[assignment]
    entry["alignment"] = acc.alignment.result(options.confidence) if acc.alignment is not None else None
    return entry


def _pair_with_baselines(manifest: RunManifest, arm_results: dict[str, dict[str, Any]],
                         accumulators: dict[str, ArmAccumulator], bootstrap_fids: dict[str, np.ndarray],
                         options: ReduceOptions) -> None:
    """Speedups against the family's baseline; FID differences against the target_only of the law the arm claims."""
    for arm, entry in arm_results.items():
        entry["law_baseline"], entry["claimed_law"] = _law_baseline_for(arm, manifest, arm_results)
        entry["law_note"] = law_note(entry["family"], entry["method"], entry.get("params"))
    for arm, entry in arm_results.items():
        baseline = _baseline_for(arm, manifest, arm_results)
        entry["baseline"] = baseline
        if baseline is None:
            continue
        compared = entry["law_baseline"] if entry["claimed_law"] is not None else baseline
        if compared is not None and compared != arm:
            diff = bootstrap_fids[arm] - bootstrap_fids[compared]
            diff_value = entry["fid"]["value"] - arm_results[compared]["fid"]["value"]
            ci = bias_shifted_interval(diff, diff_value, options.confidence)
            entry["fid"]["diff_vs_baseline"] = {
                "baseline": compared,
                "same_law": entry["claimed_law"] is not None,
                "value": diff_value,
                "ci": list(ci),
                "within_noise": bool(ci[0] <= 0.0 <= ci[1]),
            }
        if compared is not None and compared != arm:
            _alignment_difference(entry, arm_results[compared], accumulators[arm], accumulators[compared], compared,
                                  options.confidence)
        arm_acc, base_acc = accumulators[arm], accumulators[baseline]
        nfe = ratio_with_paired_bootstrap(base_acc.totals.target_calls, arm_acc.totals.target_calls,
                                          base_acc.target_calls_boot, arm_acc.target_calls_boot, options.confidence)
        entry["nfe_ratio"] = nfe["value"]
        entry["nfe_ratio_ci"] = nfe["ci"]
        pairing = "actor,shard,batch" if arm_acc.has_actor_column else "shard,batch (no actor column; a shard task runs on one actor)"
        entry["speedup"] = speedup_over_baseline(
            arm_acc.times,
            base_acc.times,
            drop_warmup=options.drop_warmup,
            num_replicates=options.speedup_replicates,
            seed=options.bootstrap_seed,
            confidence=options.confidence,
            pairing=pairing,
        ).to_dict()
        entry["speedup"]["batch_size"] = manifest.batch_size
        entry["speedup"]["latency"] = latency_speedup(
            arm_acc.times, base_acc.times, drop_warmup=options.drop_warmup,
            num_replicates=options.speedup_replicates, seed=options.bootstrap_seed, confidence=options.confidence,
        )
        entry["speedup"]["warning"] = _few_pairs_warning(entry["speedup"]["num_pairs"])


def _alignment_difference(entry: dict[str, Any], base_entry: dict[str, Any], acc: ArmAccumulator,
                          base_acc: ArmAccumulator, baseline: str, confidence: float) -> None:
    """The arm's alignment minus its baseline's, with a paired bootstrap interval and the verdict."""
    from specray.eval.bootstrap import percentile_interval

    mine, theirs = entry.get("alignment"), base_entry.get("alignment")
    if not mine or not theirs or mine["value"] is None or theirs["value"] is None:
        return
    diff = acc.alignment.replicates()[0] - base_acc.alignment.replicates()[0]  # same sample ids: paired
    ci = percentile_interval(diff, confidence)
    mine["diff_vs_baseline"] = {"baseline": baseline, "value": mine["value"] - theirs["value"], "ci": list(ci),
                                "within_noise": bool(ci[0] <= 0.0 <= ci[1])}


def _few_pairs_warning(num_pairs: int) -> str | None:
    if num_pairs >= MIN_SPEEDUP_PAIRS:
        return None
    if num_pairs <= 1:
        return (f"{num_pairs} paired batch: no interval (it needs several batches per arm; "
                f"run more samples or a smaller batch_size)")
    return (f"interval from {num_pairs} paired batches (under {MIN_SPEEDUP_PAIRS}): it understates the "
            "uncertainty; run more samples or a smaller batch_size")


def _few_samples_warning(num_samples: int, feature_dim: int) -> str | None:
    wanted = MIN_FID_SAMPLES_PER_DIM * feature_dim
    if num_samples >= wanted:
        return None
    singular = (f"; below {feature_dim} its covariance is singular" if num_samples <= feature_dim else "")
    return (f"FID from {num_samples} samples of {feature_dim}-dim features{singular}: it is biased upward and "
            f"noisy, and not comparable with FIDs at other sample counts; use at least {wanted} samples per arm")


def _assemble(run_dir: str, manifest: RunManifest, checks: dict | None, extractor: ImageFeatureExtractor,
              reference_stats: ReferenceStatistics, options: ReduceOptions, arm_results: dict[str, dict[str, Any]],
              extraction_s: float, partial_info: dict[str, Any] | None) -> dict[str, Any]:
    arms = [arm_results[a] for a in manifest.arm_names]
    for entry in arms:
        entry["fid"]["warning"] = _few_samples_warning(entry["num_samples"], extractor.fid_dim)
    arm_infos = {a: {**manifest.arm_info(a), **{k: arm_results[a][k] for k in ("family", "method", "target", "draft")}}
                 for a in manifest.arm_names}
    spreads = seed_spread(arms, arm_infos, options.seed_spread_sd)
    from specray.eval.digits_features import weights_metadata

    num_rows = sum(a["num_samples"] for a in arms)
    report: dict[str, Any] = {
        "format": REPORT_FORMAT,
        "run": run_dir,
        "job_id": manifest.raw.get("job_id"),
        "num_rows": num_rows,
        "partial": partial_info,  # None: every listed file verified and was scored
        "checks": {"passed": checks is not None, "skipped": checks is None,
                   "num_samples_per_arm": next(iter(checks.values())).rows if checks else None,
                   "class_counts": {str(k): v for k, v in next(iter(checks.values())).class_counts.items()}
                   if checks else None},
        "fid_setup": {
            "feature_extractor": extractor.name,
            "feature_layer": extractor.layers["fid"],
            "feature_dim": extractor.fid_dim,
            "isc_layer": extractor.layers["isc"] if options.isc else None,
            "prc_layer": extractor.layers["prc"] if options.prc else None,
            "reference": reference_stats.source,
            "reference_kind": reference_stats.kind,
            "reference_count": reference_stats.count,
            "extractor_heldout_accuracy": float(weights_metadata().get("heldout_accuracy", "nan"))
            if extractor.name == "specray-digits" else None,
            "bootstrap_replicates": options.bootstrap_replicates,
            "bootstrap_seed": options.bootstrap_seed,
            "confidence": options.confidence,
        },
        "options": options.to_dict(),
        "arms": arms,
        "seed_spread": spreads,
        "throughput": {"feature_extraction_s": extraction_s,
                       "images_per_s": num_rows / extraction_s if extraction_s > 0 else None},
    }
    report["table"] = {"columns": list(TABLE_COLUMNS), "rows": table_rows(report)}
    return report


def _alignment_scorer(manifest: RunManifest, options: ReduceOptions, reference_kind: str):
    """The text-image alignment scorer of a prompt run (None for class-label runs or when off)."""
    conditions = (manifest.raw.get("spec") or {}).get("conditions") or {}
    name = options.alignment_scorer(reference_kind) if conditions.get("kind") == "prompts" else None
    if name is None:
        return None
    from specray.eval.alignment import load_scorer

    return load_scorer(name, options.device, options.clip_model)


def _stream_arm(
    store: RunStore, manifest: RunManifest, arm: str, extractor: ImageFeatureExtractor, options: ReduceOptions,
    progress: Progress | None = None, scorer: Any = None,
) -> tuple[ArmAccumulator, float]:
    acc = ArmAccumulator(
        name=arm,
        feature_dim=extractor.fid_dim,
        bootstrap_replicates=options.bootstrap_replicates,
        bootstrap_seed=options.bootstrap_seed,
        grid_per_class=options.grid_per_class,
        image_budget_bytes=options.image_budget_bytes,
        nominal_batch_size=manifest.batch_size,
        isc_classes=extractor.isc_dim if options.isc else 0,
        isc_splits=options.isc_splits,
        prc_max_samples=options.prc_max_samples if options.prc else 0,
    )
    if scorer is not None:
        from specray.eval.alignment import AlignmentAccumulator

        acc.alignment = AlignmentAccumulator(scorer, options.bootstrap_seed, options.bootstrap_replicates)
    seconds = 0.0
    entries = sorted((e for e in manifest.shards if e.arm == arm), key=lambda e: e.shard)
    for entry in entries:
        rows = 0
        for batch in iter_shard_batches(store, entry, options.batch_rows):
            began = time.perf_counter()
            images = decode_images(batch.column("image"))
            features = extractor(images)
            acc.update(batch, entry.shard, images, features)
            if acc.alignment is not None and "prompt" in batch.schema.names:
                acc.alignment.update(batch.column("sample_id").to_numpy().astype(np.int64), images,
                                     batch.column("prompt").to_pylist())
            seconds += time.perf_counter() - began
            rows += batch.num_rows
            if progress is not None:
                progress.advance(batch.num_rows)
        if entry.rows >= 0 and rows != entry.rows:
            raise ValueError(f"shard {entry.path}: manifest lists {entry.rows} rows, file has {rows}")
    if acc.totals.num_samples < MIN_SAMPLES_PER_ARM:
        raise RunCheckError("size", f"arm {arm!r}: {acc.totals.num_samples} samples in the manifest's shards; FID "
                                    f"needs at least {MIN_SAMPLES_PER_ARM}")
    return acc, seconds


def _arm_fid(
    acc: ArmAccumulator, reference: ReferenceStatistics, reference_images: torch.Tensor | None, options: ReduceOptions
) -> tuple[dict[str, Any], np.ndarray]:
    reference_stats = reference.stats
    streaming = frechet_distance(acc.moments.statistics(), reference_stats)
    if acc.images is not None and reference_images is not None:
        images = torch.from_numpy(np.concatenate(acc.images))
        value = fid_torch_fidelity(images, reference_images, cuda=options.device.startswith("cuda"))
        source = "torch_fidelity.calculate_metrics"
    else:
        value, source = streaming, "streamed moments + torch_fidelity fid_statistics_to_metric"
    # A replicate of a tiny run can draw fewer than two samples (no covariance): it counts as missing.
    replicates = np.array(
        [frechet_distance(acc.bootstrap.statistics(b), reference_stats) if acc.bootstrap.count[b] >= 2 else np.nan
         for b in range(acc.bootstrap.num_replicates)]
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
        "bootstrap_std": float(np.nanstd(replicates, ddof=1)) if np.isfinite(replicates).sum() > 1 else None,
        "halves": halves,
        "diff_vs_baseline": None,
        "seed_spread": None,
    }
    return fid, replicates


def _precision_recall(acc: ArmAccumulator, reference: ReferenceStatistics, options: ReduceOptions) -> dict[str, Any] | None:
    if not options.prc:
        return None
    generated = acc.prc.features()
    if reference.prc_features is None or generated is None:
        return {"available": False, "reason": f"reference {reference.kind!r} has statistics only, no features"
                if reference.prc_features is None else "no generated features kept"}
    return {"available": True, **precision_recall(generated, reference.prc_features, options.prc_neighborhood)}


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
            "accepted_length_histogram": totals.accepted_length_histogram,
            "acceptance_timeline": totals.acceptance_timeline,
        },
        "extra_totals": dict(totals.extra_sums),
        "resampling": _resampling(totals.extra_sums),
        "params": info.get("params"),
        "nfe_ratio": None,
        "nfe_ratio_ci": None,
        "speedup": None,
    }


def _resampling(sums: dict[str, float]) -> dict[str, Any] | None:
    """CSpD's acceptance-rejection resampler: tokens resampled and how often the try cap was hit."""
    if "resampled_tokens" not in sums:
        return None
    resampled, hits = int(sums["resampled_tokens"]), int(sums.get("resample_cap_hits", 0))
    return {"resampled_tokens": resampled, "resample_cap_hits": hits,
            "cap_hit_rate": hits / resampled if resampled else None}


def _law_baseline_for(arm: str, manifest: RunManifest,
                      results: dict[str, dict[str, Any]]) -> tuple[str | None, dict[str, Any] | None]:
    """The target_only arm (same family and target) whose parameters are the law ``arm`` claims, and that law.

    (None, None) for an arm that claims no law (lossy methods, target_only itself); (None, law) when
    the run has no target_only arm of that law. Among seed replicas the lowest seed_offset is taken.
    """
    entry = results[arm]
    if entry["method"] == "target_only":
        return None, None
    law = claimed_law(entry["family"], entry["method"], entry.get("params"))
    if law is None:
        return None, None
    from specray.eval.checks import seed_offset

    matches = [other for other in results
               if results[other]["method"] == "target_only"
               and (results[other]["family"], results[other]["target"]) == (entry["family"], entry["target"])
               and target_only_params(results[other]["family"], results[other].get("params")) == law]
    if not matches:
        return None, law
    return min(matches, key=lambda other: seed_offset(manifest.arm_info(other))), law


def _baseline_for(arm: str, manifest: RunManifest, results: dict[str, dict[str, Any]]) -> str | None:
    """The arm an arm's speedup is measured against, and its FID difference when it claims no law (an
    arm that is a ``target_only`` one is its own baseline).

    First choice, one of the same model pair (family, target and draft): arms of one pair run on the
    same actor, batch by batch, so their wall times pair. Among those, the job's ``eval.baseline``
    if it is one, else the first ``target_only`` arm. Failing that, the same with the same family
    and target only (an arm with another draft, e.g. an EAGLE head, whose pair has no ``target_only``).
    """
    entry = results[arm]
    named = manifest.baseline_arm
    if named in manifest.dropped_arms:
        named = None  # a partial report that lost the baseline arm: fall back to a target_only of the same model
    if named is not None and named not in results:
        raise ValueError(f"eval.baseline {named!r} is not an arm of this run; arms: {list(results)}")
    candidates = ([named] if named is not None else []) + [o for o in results if results[o]["method"] == "target_only"]
    for fields in (("family", "target", "draft"), ("family", "target")):
        for other in candidates:
            if all(results[other][f] == entry[f] for f in fields):
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
