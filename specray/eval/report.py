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

TABLE_COLUMNS = ("arm", "FID [95% CI]", "mean acc. length", "acc. rate", "speedup [95% CI]")


def _fmt(value: float | None, digits: int = 3) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}"


def _fmt_interval(value: float | None, interval: list[float] | None, digits: int) -> str:
    text = _fmt(value, digits)
    if interval and text != "-" and all(v is not None and math.isfinite(v) for v in interval):
        text += f" [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"
    return text


def table_rows(report: dict[str, Any]) -> list[list[str]]:
    rows = []
    for arm in report["arms"]:
        fid = arm.get("fid") or {}
        speed = arm.get("speedup") or {}
        rows.append([
            arm["arm"],
            _fmt_interval(fid.get("value"), fid.get("ci"), 2),
            _fmt(arm["acceptance"]["mean_acceptance_length"], 3),
            _fmt(arm["acceptance"]["draft_acceptance_rate"], 3),
            _fmt_interval(speed.get("speedup"), speed.get("speedup_ci"), 2),
        ])
    return rows


def format_table(report: dict[str, Any]) -> str:
    rows = [list(TABLE_COLUMNS)] + table_rows(report)
    widths = [max(len(r[i]) for r in rows) for i in range(len(TABLE_COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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
    fig.suptitle("same sample_ids across arms (columns: sample_id, class)", fontsize=8, y=1.0 + 0.35 / (0.6 * len(arm_names) + 0.5))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
