"""The report's plots, drawn from report.json alone (matplotlib, Agg backend).

* ``pareto-<family>.png`` -- FID against throughput speedup per arm, 95% intervals
  as error bars, the speed-quality Pareto front (no other arm is both faster and
  lower-FID) drawn as a step line;
* ``acceptance-by-position.png`` -- fraction of rounds in which draft position i
  was accepted, one line per speculative arm;
* ``accepted-length.png`` -- histogram of accepted draft tokens per round
  (derived exactly from per-position counters under prefix acceptance; see
  ``AcceptanceTotals.accepted_length_histogram``);
* ``acceptance-timeline.png`` -- acceptance rate over the sequence / denoising
  timeline, from ``extra_stats.acceptance_timeline`` when a loop stores it.

Each function returns PNG bytes or None when the report holds nothing to draw.
"""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    plt = _pyplot()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def families(report: dict[str, Any]) -> list[str]:
    seen: list[str] = []
    for arm in report["arms"]:
        if arm.get("family") not in seen:
            seen.append(arm.get("family"))
    return seen


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of points (speedup, fid) not dominated by another (faster or equal and lower-or-equal FID, one strictly)."""
    front = []
    for i, (s_i, f_i) in enumerate(points):
        dominated = any(
            (s_j >= s_i and f_j <= f_i) and (s_j > s_i or f_j < f_i) for j, (s_j, f_j) in enumerate(points) if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i][0])


def _speed(arm: dict[str, Any]) -> tuple[float | None, list[float] | None]:
    speed = arm.get("speedup") or {}
    if speed.get("throughput_speedup") is not None:
        return speed["throughput_speedup"], speed.get("throughput_ci")
    if arm.get("method") == "target_only":
        return 1.0, None
    return None, None


def pareto_xlabel(report: dict[str, Any], family: str) -> str:
    """The x-axis of a family's plane names the baseline its speedups were measured against."""
    baselines = sorted({a["baseline"] for a in report["arms"] if a.get("family") == family and a.get("baseline")})
    return f"throughput speedup over {', '.join(baselines) or 'target_only'} (95% CI)"


def pareto_plot(report: dict[str, Any], family: str) -> bytes | None:
    plt = _pyplot()
    groups = [g for g in report.get("seed_spread") or [] if g.get("family") == family]
    # target_only replicas at other seeds are not competing arms: they become the noise band.
    replicas = {name for g in groups for name in g["arms"][1:]}
    rows = []
    for arm in report["arms"]:
        if arm.get("family") != family or arm["arm"] in replicas:
            continue
        fid = arm.get("fid") or {}
        speed, speed_ci = _speed(arm)
        if _finite(fid.get("value")) and _finite(speed):
            rows.append((arm["arm"], speed, speed_ci, fid["value"], fid.get("ci")))
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    colors = plt.get_cmap("tab10")
    front = pareto_front([(r[1], r[3]) for r in rows])
    xs = [rows[i][1] for i in front]
    ys = [rows[i][3] for i in front]
    ax.step(xs, ys, where="post", color="0.3", linestyle="--", linewidth=1.2, zorder=1, label="Pareto front")
    ax.scatter(xs, ys, s=160, facecolors="none", edgecolors="0.2", linewidths=1.2, zorder=3)
    for i, (name, speed, speed_ci, fid, fid_ci) in enumerate(rows):
        xerr = None
        if speed_ci and all(_finite(v) for v in speed_ci):
            xerr = [[max(0.0, speed - speed_ci[0])], [max(0.0, speed_ci[1] - speed)]]
        yerr = None
        if fid_ci and all(_finite(v) for v in fid_ci):
            yerr = [[max(0.0, fid - fid_ci[0])], [max(0.0, fid_ci[1] - fid)]]
        ax.errorbar([speed], [fid], xerr=xerr, yerr=yerr, fmt="o", markersize=7, color=colors(i % 10), capsize=3,
                    elinewidth=1.0, alpha=0.85, zorder=2, label=name + (" *" if i in front else ""))
    for group in groups:
        if _finite(group.get("mean")) and _finite(group.get("sd")):
            low, high = group["mean"] - 2 * group["sd"], group["mean"] + 2 * group["sd"]
            ax.axhspan(low, high, color="0.85", alpha=0.5, zorder=0,
                       label=f"{group['arms'][0]} over {group['num_seeds']} seeds: mean ± 2 sd")
    ax.axvline(1.0, color="0.75", linewidth=0.8, zorder=0)
    ax.set_xlabel(pareto_xlabel(report, family))
    ax.set_ylabel(f"FID ({report['fid_setup']['feature_extractor']}, 95% CI)")
    ax.set_title(f"{family}: speed vs quality (lower right is better; * = on the Pareto front)", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return _png(fig)


def acceptance_by_position_plot(report: dict[str, Any]) -> bytes | None:
    plt = _pyplot()
    arms = [a for a in report["arms"] if a["acceptance"].get("acceptance_by_position")]
    if not arms:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in arms:
        rates = arm["acceptance"]["acceptance_by_position"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{arm['arm']} ({arm.get('family')})")
    ax.set_xlabel("draft position in the round")
    ax.set_ylabel("fraction of rounds accepted at this position")
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_title("acceptance rate by draft position", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def accepted_length_plot(report: dict[str, Any]) -> bytes | None:
    plt = _pyplot()
    arms = [a for a in report["arms"] if (a["acceptance"].get("accepted_length_histogram") or {}).get("counts")]
    if not arms:
        return None
    gamma = max(len(a["acceptance"]["accepted_length_histogram"]["counts"]) for a in arms)
    width = 0.8 / len(arms)
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for i, arm in enumerate(arms):
        hist = arm["acceptance"]["accepted_length_histogram"]
        counts = np.asarray(hist["counts"], dtype=np.float64)
        fractions = counts / counts.sum() if counts.sum() else counts
        label = arm["arm"] + ("" if hist.get("exact", True) else " (approx.)")
        ax.bar(np.arange(len(counts)) + (i - (len(arms) - 1) / 2) * width, fractions, width=width, label=label)
    ax.set_xticks(range(gamma))
    ax.set_xlabel("accepted draft tokens per round (emitted = accepted + 1)")
    ax.set_ylabel("fraction of rounds")
    ax.set_title("accepted length per round (derived from per-position counts)", fontsize=10)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return _png(fig)


def acceptance_timeline_plot(report: dict[str, Any]) -> bytes | None:
    plt = _pyplot()
    arms = [a for a in report["arms"] if any(v is not None for v in a["acceptance"].get("acceptance_timeline") or [])]
    if not arms:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in arms:
        rates = arm["acceptance"]["acceptance_timeline"]
        bins = len(rates)
        x = (np.arange(bins) + 0.5) / bins
        y = [np.nan if v is None else v for v in rates]
        ax.plot(x, y, marker=".", label=arm["arm"])
    ax.set_xlabel("position in the sequence / denoising timeline (fraction, bin centres)")
    ax.set_ylabel("draft acceptance rate")
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, 1)
    ax.set_title("acceptance over the generation timeline", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def all_plots(report: dict[str, Any]) -> dict[str, bytes]:
    """relative path under report/ -> PNG bytes."""
    out: dict[str, bytes] = {}
    for family in families(report):
        png = pareto_plot(report, family)
        if png:
            out[f"pareto-{family}.png"] = png
    for name, fn in (("acceptance-by-position.png", acceptance_by_position_plot),
                     ("accepted-length.png", accepted_length_plot),
                     ("acceptance-timeline.png", acceptance_timeline_plot)):
        png = fn(report)
        if png:
            out[name] = png
    return out
