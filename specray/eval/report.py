"""Writing the report: the printed table, ``report.json`` and the image grid.

``report.json`` is the machine-readable record (schema in ``reduce.py``); the
table and grid are views of it plus the kept grid images.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np

from specray.runtime.store import RunStore

# report.md's table per family: every number, with its interval.
TABLE_COLUMNS = (
    "arm", "FID [95% CI]", "IS", "mean acc. length", "acc. rate", "speedup [95% CI]", "latency speedup @1 [95% CI]",
    "NFE ratio [95% CI]",
)
# The table printed at the end of a run: what fits 100 columns (details in report.md).
SUMMARY_COLUMNS = ("arm", "FID [95% CI]", "acc.len", "acc.rate", "speedup [95% CI]", "notes")
SUMMARY_WIDTH = 100
FEW_MARK = "!"  # an interval that rests on too few batches or samples (report.md says why)


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _fmt_interval(value: float | None, interval: list[float] | None, digits: int) -> str:
    text = _fmt(value, digits)
    if interval and text != "-" and all(v is not None and math.isfinite(v) for v in interval):
        text += f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
    return text


def _speedup_cell(speed: dict[str, Any]) -> str:
    """The throughput speedup; no interval when it rests on a single paired batch, '!' when on few."""
    if speed.get("num_pairs", 0) <= 1:
        return _fmt(speed.get("throughput_speedup"), 2) + (f" {FEW_MARK}" if speed else "")
    text = _fmt_interval(speed.get("throughput_speedup"), speed.get("throughput_ci"), 2)
    return text + (f" {FEW_MARK}" if speed.get("warning") else "")


def _fid_cell(fid: dict[str, Any]) -> str:
    return _fmt_interval(fid.get("value"), fid.get("ci"), 2) + (f" {FEW_MARK}" if fid.get("warning") else "")


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for arm in report["arms"]:
        fid = arm.get("fid") or {}
        speed = arm.get("speedup") or {}
        latency = speed.get("latency") or {}
        isc = arm.get("inception_score") or {}
        rows.append([
            arm["arm"],
            _fid_cell(fid),
            _fmt(isc.get("mean"), 2),
            _fmt(arm["acceptance"]["mean_acceptance_length"], 3),
            _fmt(arm["acceptance"]["draft_acceptance_rate"], 3),
            _speedup_cell(speed) if speed else "-",
            _fmt_interval(latency.get("speedup"), latency.get("ci"), 2) if latency.get("available") else "-",
            _fmt_interval(arm.get("nfe_ratio"), arm.get("nfe_ratio_ci"), 2),
        ])
    return rows


def _verdict_note(arm: dict[str, Any]) -> str:
    """A few words on the arm's lossless verdict, for the summary table."""
    fid = arm.get("fid") or {}
    diff = fid.get("diff_vs_baseline") or {}
    if arm.get("claimed_law") is None:
        return ""
    if not diff.get("same_law"):
        return "no law match"
    spread = fid.get("seed_spread")
    within = diff.get("within_noise") and (spread is None or spread.get("within"))
    return "within noise" if within else "OUTSIDE noise"


def summary_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for arm in report["arms"]:
        fid = arm.get("fid") or {}
        speed = arm.get("speedup") or {}
        rows.append([arm["arm"], _fid_cell(fid), _fmt(arm["acceptance"]["mean_acceptance_length"], 2),
                     _fmt(arm["acceptance"]["draft_acceptance_rate"], 3), _speedup_cell(speed) if speed else "-",
                     _verdict_note(arm)])
    return rows


def format_table(report: dict[str, Any], width: int = SUMMARY_WIDTH) -> str:
    """The end-of-run table, at most ``width`` columns: long arm names and notes are cut with '…'."""
    rows = [list(SUMMARY_COLUMNS)] + summary_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(SUMMARY_COLUMNS))]
    gaps = 2 * (len(widths) - 1)
    # long arm names give way first (down to 16), then the notes, then the arm names again
    for column, floor in ((0, 16), (5, len(SUMMARY_COLUMNS[5])), (0, 8)):
        excess = sum(widths) + gaps - width
        if excess > 0:
            widths[column] = max(floor, widths[column] - excess)
    lines = ["  ".join(_clip(cell, w).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    footer = []
    if any(FEW_MARK in cell for row in rows[1:] for cell in row[1:5]):
        footer.append(f"{FEW_MARK}: too few batches or samples for this interval (report.md says why)")
    if any(row[5] for row in rows[1:]):
        footer.append("notes: lossless arms against the target_only of the law they claim (report.md names it)")
    return "\n".join(lines + [_clip(line, width) for line in footer])


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: max(0, width - 1)] + "…"


def _json_clean(value: Any) -> Any:
    """NaN/inf -> None (strict JSON), numpy scalars -> Python."""
    if isinstance(value, dict):
        return {k: _json_clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_clean(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(store: RunStore, relpath: str, report: dict[str, Any]) -> None:
    store.commit_bytes(relpath, (json.dumps(_json_clean(report), indent=2) + "\n").encode())


def grid_png(arm_names: list[str], images: dict[str, dict[int, tuple[int, np.ndarray]]], sample_ids: list[int]) -> bytes:
    """PNG bytes of a grid: one row per arm, one column per sample_id (same ids in every row)."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = len(sample_ids)
    fig, axes = plt.subplots(
        len(arm_names), cols, figsize=(0.55 * cols + 1.6, 0.6 * len(arm_names) + 0.5), squeeze=False
    )
    for r, arm in enumerate(arm_names):
        for c, sid in enumerate(sample_ids):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            entry = images.get(arm, {}).get(sid)
            if entry is not None:
                label, image = entry
                ax.imshow(image, cmap="gray" if image.ndim == 2 else None, vmin=0, vmax=255, interpolation="nearest")
                if r == 0:
                    ax.set_title(f"{sid}\n(class {label})", fontsize=6)
            if c == 0:
                ax.set_ylabel(arm, rotation=0, ha="right", va="center", fontsize=7)
    fig.suptitle("same sample_ids across arms (columns: sample_id, class)", fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97), pad=0.3)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


# ---------------------------------------------------------------- report.md, plots, regenerate


def markdown_table(columns: list[str] | tuple[str, ...], rows: list[list[str]]) -> str:
    escape = lambda text: str(text).replace("|", "\\|")  # noqa: E731
    lines = ["| " + " | ".join(escape(c) for c in columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    lines += ["| " + " | ".join(escape(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(report: dict[str, Any], plot_names: list[str]) -> str:
    """report.md: setup, a table per family, FID-noise statements, plots and the grid."""
    setup = report["fid_setup"]
    lines = [f"# specray report: {report.get('job_id')}", "",
             f"Run `{report.get('run')}`: {report.get('num_rows')} rows, {len(report['arms'])} arms.", "",
             f"FID: {setup['feature_extractor']} features (`{setup['feature_layer']}`, {setup['feature_dim']}-dim) "
             f"against {setup['reference']}"
             + (f" ({setup['reference_count']} images)" if setup.get("reference_count") else "") + ". "
             f"Intervals are {int(setup['confidence'] * 100)}% bootstrap intervals ({setup['bootstrap_replicates']} "
             "Poisson replicates keyed by sample_id for FID and the NFE ratio; resampled paired batches for speedups)."]
    from specray.eval.verify import partial_notice_lines

    lines += partial_notice_lines(report)
    checks = report.get("checks") or {}
    if checks.get("passed"):
        lines += ["", f"Pre-scoring checks passed: every arm has {checks.get('num_samples_per_arm')} samples, no "
                      f"duplicate sample_ids or seeds, class balance {checks.get('class_counts')}."]
    table = {tuple(r[:1]): r for r in table_rows(report)}
    from specray.eval.plots import families

    latency_shown = any(((a.get("speedup") or {}).get("latency") or {}).get("available") for a in report["arms"])
    keep = [i for i, column in enumerate(TABLE_COLUMNS) if latency_shown or not column.startswith("latency")]
    for family in families(report):
        arms = [a for a in report["arms"] if a.get("family") == family]
        lines += ["", f"## {family}", ""]
        rows = [[table[(a["arm"],)][i] for i in keep] for a in arms]
        lines.append(markdown_table([TABLE_COLUMNS[i] for i in keep], rows))
        baselines = sorted({a["baseline"] for a in arms if a.get("baseline")})
        lines += ["", f"Speedup against {', '.join(f'`{b}`' for b in baselines) or 'no baseline'}: throughput "
                      "at the run's batch size (sum of paired batch wall times, warm-up batches dropped). "
                      "NFE ratio: target calls of the baseline / of the arm."
                  + ("" if latency_shown else " Latency speedup needs a run with batch size 1."), ""]
        for arm in arms:
            lines += _verdict_lines(arm)
        for arm in arms:
            lines += _warning_lines(arm)
        for arm in arms:
            resampling = arm.get("resampling")
            if resampling:
                rate = resampling.get("cap_hit_rate")
                cap = (arm.get("params") or {}).get("max_tries")
                lines.append(f"- `{arm['arm']}`: {resampling['resampled_tokens']} tokens resampled; the "
                             f"{cap if cap is not None else ''}-try cap was hit {resampling['resample_cap_hits']} "
                             f"times ({_fmt(100 * rate if rate is not None else None, 1)}%): those tokens fell back "
                             "to the target's mean and are not exactly target-distributed")
    spreads = report.get("seed_spread") or []
    if spreads:
        lines += ["", "## Seed-to-seed spread", "",
                  "target_only replicas at other seeds (`seed_offset`). Criterion for a lossless arm: "
                  "|FID − mean| ≤ 2·sd (sd over the seeds, ddof=1).", ""]
        for record in spreads:
            lines.append(f"- {record['family']}/{record['target']}: arms {record['arms']} FIDs "
                         f"{[round(v, 2) for v in record['fids']]}: mean {_fmt(record['mean'], 2)}, "
                         f"sd {_fmt(record['sd'], 2)}")
            for arm, verdict in record["lossless_arms"].items():
                lines.append(f"  - `{arm}`: z = {_fmt(verdict['z'], 2)} → "
                             + ("within the seed spread" if verdict["within"] else "OUTSIDE the seed spread"))
    prcs = [(a["arm"], a.get("precision_recall")) for a in report["arms"] if a.get("precision_recall")]
    if prcs:
        lines += ["", "## Precision / recall", ""]
        rows = [[arm, _fmt(p.get("precision"), 3), _fmt(p.get("recall"), 3), str(p.get("num_generated", "-"))]
                if p.get("available") else [arm, "-", "-", p.get("reason", "")] for arm, p in prcs]
        lines.append(markdown_table(["arm", "precision", "recall", "samples"], rows))
    lines += ["", "## Plots", ""]
    for name in plot_names:
        lines.append(f"![{name}]({name})")
    if "acceptance-timeline.png" not in plot_names:
        lines += ["", "Acceptance over the timeline: not stored by this run's loops "
                      "(needs `extra_stats.acceptance_timeline = {accepted: [...], drafted: [...]}` per sample)."]
    grid = report.get("grid") or {}
    if grid.get("path"):
        lines += ["", "## Samples", "", f"Same sample_ids in every row: {grid.get('sample_ids')}", "",
                  f"![grid]({grid['path'].split('/', 1)[-1]})"]
    return "\n".join(lines) + "\n"


def _verdict_lines(arm: dict[str, Any]) -> list[str]:
    """What the arm's FID is compared with, and whether the difference is within noise."""
    diff = (arm.get("fid") or {}).get("diff_vs_baseline")
    name = f"`{arm['arm']}`"
    if arm.get("claimed_law") is not None and not (diff and diff.get("same_law")):
        law = ", ".join(f"{k}={v}" for k, v in arm["claimed_law"].items())
        return [f"- {name} claims target_only's law with {law}, but this run has no target_only arm with "
                "those parameters: no lossless verdict (add one)"]
    if not diff:
        return []
    verdict = "within bootstrap noise" if diff["within_noise"] else "outside bootstrap noise"
    which = (f"`{diff['baseline']}`, the target_only of the law it claims" if diff.get("same_law")
             else f"`{diff['baseline']}` (no exactness claimed: for scale only)")
    text = (f"- {name}: FID − {which} = {_fmt(diff['value'], 2)} [{_fmt(diff['ci'][0], 2)}, "
            f"{_fmt(diff['ci'][1], 2)}] (paired bootstrap): {verdict}")
    spread = (arm.get("fid") or {}).get("seed_spread")
    if spread:
        text += (f"; seed spread of `{spread['group']}` over {spread['num_seeds']} seeds: "
                 f"{_fmt(spread['mean'], 2)} ± {_fmt(spread['sd'], 2)} → "
                 + ("within" if spread["within"] else "outside") + " 2 sd")
    if arm.get("law_note"):
        text += f". Note: {arm['law_note']}"
    return [text]


def _warning_lines(arm: dict[str, Any]) -> list[str]:
    out = []
    for what, record in (("FID", arm.get("fid") or {}), ("speedup", arm.get("speedup") or {})):
        if record.get("warning"):
            out.append(f"- {FEW_MARK} `{arm['arm']}` {what}: {record['warning']}")
    return out


def render_report_files(store: RunStore, report: dict[str, Any], plots: bool = True) -> list[str]:
    """Write report/report.md and the plots (from the report dict); returns the plot file names."""
    from specray.eval.plots import all_plots

    names = []
    if plots:
        for name, png in all_plots(report).items():
            store.commit_bytes(f"report/{name}", png)
            names.append(name)
    store.commit_bytes("report/report.md", render_markdown(report, names).encode())
    return names


def regenerate(run_dir: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Re-render report.md, the plots and the grid from report/report.json and the shards (no rescoring)."""
    from specray.eval.shards import decode_images, iter_shard_batches, read_manifest

    store = RunStore(run_dir, storage_options)
    report = store.read_json("report/report.json")
    if report is None:
        raise FileNotFoundError(f"{store.full_path('report/report.json')} not found; run `specray reduce {run_dir}` first")
    manifest = read_manifest(store)
    grid = report.get("grid") or {}
    wanted = set(grid.get("sample_ids") or [])
    arms = grid.get("arms") or manifest.arm_names
    kept: dict[str, dict[int, tuple[int, np.ndarray]]] = {arm: {} for arm in arms}
    for entry in manifest.shards:
        if entry.arm not in kept or not wanted:
            continue
        for batch in iter_shard_batches(store, entry):
            ids = batch.column("sample_id").to_numpy()
            rows = [i for i, sid in enumerate(ids.tolist()) if sid in wanted]
            if not rows:
                continue
            sub = batch.take(rows)
            images = decode_images(sub.column("image"))
            for sid, label, image in zip(sub.column("sample_id").to_pylist(), sub.column("class_label").to_pylist(), images):
                kept[entry.arm][int(sid)] = (int(label), image)
    if wanted:
        store.commit_bytes("report/grid.png", grid_png(arms, kept, list(grid["sample_ids"])))
    report["table"] = {"columns": list(TABLE_COLUMNS), "rows": table_rows(report)}
    write_json(store, "report/report.json", report)
    render_report_files(store, report, plots=(report.get("options") or {}).get("plots", True))
    return report
