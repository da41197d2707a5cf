"""Compare two runs (e.g. last night against tonight, or before and after an upgrade).

:func:`compare_runs`, from the two report.json files: for every arm in both runs, FID, IS, mean
acceptance length, acceptance rate, throughput speedup and NFE ratio of each run, their difference
(B - A), and for FID and speedup whether the two 95% intervals overlap (``changed`` is true when
they do not: a difference beyond either run's own noise). Arms present in one run only are
listed. Nothing is rescored; both runs must have been reduced.

:func:`compare_samples`, from the two runs' shards (no report needed): per (arm, sample_id),
whether the image bytes and the sample's acceptance statistics are identical. Same job, seed and
batch size on the same kind of hardware should give zero differences: a sample is a pure function
of (seed, sample_id, arm).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from specray.eval.report import _fmt, markdown_table
from specray.runtime.store import RunStore, read_parquet

METRICS = (
    # name, path into an arm entry, interval path (or None)
    ("fid", ("fid", "value"), ("fid", "ci")),
    ("inception_score", ("inception_score", "mean"), None),
    ("mean_acceptance_length", ("acceptance", "mean_acceptance_length"), None),
    ("draft_acceptance_rate", ("acceptance", "draft_acceptance_rate"), None),
    ("throughput_speedup", ("speedup", "throughput_speedup"), ("speedup", "throughput_ci")),
    ("nfe_ratio", ("nfe_ratio",), ("nfe_ratio_ci",)),
)


def _get(entry: dict[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = entry
    for key in path:
        if not isinstance(value, dict):
            return None
        value = value.get(key)
    return value


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def _load(run: str, storage_options: dict[str, Any] | None) -> dict[str, Any]:
    report = RunStore(run, storage_options).read_json("report/report.json")
    if report is None:
        raise FileNotFoundError(f"{run}: no report/report.json; run `specray reduce {run}` first")
    return report


def compare_reports(report_a: dict[str, Any], report_b: dict[str, Any]) -> dict[str, Any]:
    arms_a = {a["arm"]: a for a in report_a["arms"]}
    arms_b = {a["arm"]: a for a in report_b["arms"]}
    common = [name for name in arms_a if name in arms_b]
    rows = []
    for name in common:
        a, b = arms_a[name], arms_b[name]
        metrics: dict[str, Any] = {}
        for metric, path, ci_path in METRICS:
            va, vb = _get(a, path), _get(b, path)
            record: dict[str, Any] = {"a": va, "b": vb, "diff": vb - va if _finite(va) and _finite(vb) else None}
            if ci_path is not None:
                ca, cb = _get(a, ci_path), _get(b, ci_path)
                record["ci_a"], record["ci_b"] = ca, cb
                if ca and cb and all(_finite(v) for v in (*ca, *cb)):
                    overlap = ca[0] <= cb[1] and cb[0] <= ca[1]
                    record["intervals_overlap"] = overlap
                    record["changed"] = not overlap
            metrics[metric] = record
        rows.append({"arm": name, "method": b.get("method"), "family": b.get("family"), "metrics": metrics})
    setup_keys = ("feature_extractor", "feature_layer", "reference")
    setup_a, setup_b = report_a.get("fid_setup") or {}, report_b.get("fid_setup") or {}
    return {
        "run_a": report_a.get("run"), "run_b": report_b.get("run"),
        "job_a": report_a.get("job_id"), "job_b": report_b.get("job_id"),
        "fid_setup_differs": {k: [setup_a.get(k), setup_b.get(k)] for k in setup_keys if setup_a.get(k) != setup_b.get(k)},
        "arms": rows,
        "only_in_a": [n for n in arms_a if n not in arms_b],
        "only_in_b": [n for n in arms_b if n not in arms_a],
        "changed": [r["arm"] for r in rows if any(m.get("changed") for m in r["metrics"].values())],
    }


def compare_runs(run_a: str, run_b: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Differences of run B against run A (both already reduced)."""
    return compare_reports(_load(run_a, storage_options), _load(run_b, storage_options))


def compare_markdown(comparison: dict[str, Any]) -> str:
    lines = [f"# specray compare: {comparison['run_a']} (A) → {comparison['run_b']} (B)", ""]
    if comparison["fid_setup_differs"]:
        lines += [f"**FID setups differ** ({comparison['fid_setup_differs']}): FID values are not comparable.", ""]
    columns = ["arm"] + [f"{m} A → B (Δ)" for m, *_ in METRICS] + ["changed"]
    rows = []
    for row in comparison["arms"]:
        cells = [row["arm"]]
        for metric, *_ in METRICS:
            record = row["metrics"][metric]
            text = f"{_fmt(record['a'], 3)} → {_fmt(record['b'], 3)} ({_signed(record['diff'])})"
            if record.get("changed"):
                text += " ⚠"
            cells.append(text)
        changed = [m for m, r in row["metrics"].items() if r.get("changed")]
        cells.append(", ".join(changed) if changed else "-")
        rows.append(cells)
    lines.append(markdown_table(columns, rows))
    if comparison["changed"]:  # the legend explains a mark; without one it would only puzzle
        lines += ["", "⚠: the two runs' 95% intervals do not overlap (a change beyond either run's noise)."]
    if comparison["only_in_a"]:
        lines.append(f"Arms only in A: {comparison['only_in_a']}")
    if comparison["only_in_b"]:
        lines.append(f"Arms only in B: {comparison['only_in_b']}")
    return "\n".join(lines) + "\n"


def _signed(value: Any) -> str:
    return "-" if not _finite(value) else f"{value:+.3f}"


# Columns that a sample's seed, id and arm determine (not timings, actors, devices or versions).
SAMPLE_DETERMINED = (
    "method", "family", "target", "draft", "seed", "class_label", "params", "height", "width", "num_tokens",
    "num_spec_steps", "num_draft_tokens", "num_accepted_draft_tokens", "draft_acceptance_rate",
    "mean_acceptance_length", "accepted_per_position", "target_calls", "draft_calls", "extra_stats",
)


def _sample_digests(run: str, storage_options: dict[str, Any] | None) -> dict[str, dict[int, tuple[str, str]]]:
    """arm -> sample_id -> (sha256 of the image bytes, sha256 of the sample-determined columns)."""
    from specray.eval.shards import read_manifest

    store = RunStore(run, storage_options)
    manifest = read_manifest(store)
    digests: dict[str, dict[int, tuple[str, str]]] = {}
    for entry in manifest.shards:
        with store.fs.open(store.full_path(entry.path), "rb") as handle:
            table = read_parquet(handle, columns=["sample_id", "image", *SAMPLE_DETERMINED])
        for row in table.to_pylist():
            image = hashlib.sha256(row.pop("image")["bytes"] or b"").hexdigest()
            sample_id = row.pop("sample_id")
            stats = hashlib.sha256(json.dumps(row, sort_keys=True).encode()).hexdigest()
            digests.setdefault(entry.arm, {})[sample_id] = (image, stats)
    return digests


def compare_samples(run_a: str, run_b: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Per arm: samples in both runs, and how many differ in image bytes / in acceptance statistics."""
    a, b = _sample_digests(run_a, storage_options), _sample_digests(run_b, storage_options)
    arms = []
    for arm in [name for name in a if name in b]:
        common = a[arm].keys() & b[arm].keys()
        arms.append({
            "arm": arm, "samples": len(common),
            "only_in_a": len(a[arm].keys() - common), "only_in_b": len(b[arm].keys() - common),
            "images_differ": sum(a[arm][i][0] != b[arm][i][0] for i in common),
            "stats_differ": sum(a[arm][i][1] != b[arm][i][1] for i in common),
        })
    identical = all(r["images_differ"] == r["stats_differ"] == r["only_in_a"] == r["only_in_b"] == 0 for r in arms)
    return {"run_a": run_a, "run_b": run_b, "arms": arms, "identical": identical and a.keys() == b.keys(),
            "only_in_a": [n for n in a if n not in b], "only_in_b": [n for n in b if n not in a]}


def compare_samples_text(comparison: dict[str, Any]) -> str:
    lines = [f"specray compare --samples: {comparison['run_a']} (A) -> {comparison['run_b']} (B)"]
    for row in comparison["arms"]:
        lines.append(f"  {row['arm']}: {row['samples']} samples, images differ: {row['images_differ']}, "
                     f"acceptance statistics differ: {row['stats_differ']}"
                     + (f", only in A: {row['only_in_a']}, only in B: {row['only_in_b']}"
                        if row["only_in_a"] or row["only_in_b"] else ""))
    for side in ("only_in_a", "only_in_b"):
        if comparison[side]:
            lines.append(f"  arms {side.replace('_', ' ')}: {comparison[side]}")
    lines.append("identical" if comparison["identical"] else "DIFFERENT")
    return "\n".join(lines) + "\n"
