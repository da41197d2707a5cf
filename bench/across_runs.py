"""Efficiency across runs: reports of one family bench, each run in its own process, combined.

A family bench's ``eff 90%`` counts the noise between the repetitions of one run. Runs of the same code, each in its
own process, can disagree by more than that: on the AVX-512 development machine two runs of ``bench/diffusion.py
--batches 1`` gave block verification with the Frozen drafter 0.926-0.962 and 0.976-1.001, and five runs at batch 32,
minutes apart, gave it with the Free drafter 0.865 twice and 0.935-0.942 three times (``docs/benchmarks.md``). What
stays fixed for a process's life (where its memory lies, the prices it measured) moves every repetition of a run
alike, so only runs in separate processes sample it.

This script reads the ``--json`` reports of one family bench (``bench/discrete.py``, ``continuous.py`` or
``diffusion.py``; the same models, gamma, clock and machine), one report per run, and prints for each batch size
(and number of steps) and speculative arm: each run's efficiency, their median, a confidence interval for that
median over the runs (:func:`~bench.pricing.median_interval`: of five runs their lowest and highest, 94 %), the
verdict against ``--threshold`` (met where the interval's lowest point reaches it, under where its highest point
does not, else undecided), and the widest of the runs' own intervals. Fewer than five runs cannot reach 90 %: the
header gives the interval's coverage. Above the arms, ``(base ovh)`` gives each run's ``target_only`` time over its
calls' prices: an arm's efficiency is about that over its own ``ovh``, so the base's ``ovh`` moves every arm of a
run alike. ``(arms median)`` gives each run's median over its arms, and the footnote the two rows' rank correlation
across the runs (Spearman's; near 1: the base moved the runs).

    for k in 1 2 3 4 5; do python bench/diffusion.py --batches 1 --reps 9 --no-replay --json runs/d$k.json; done
    python bench/across_runs.py runs/d*.json [--threshold 0.95] [--json across.json]

or, the runs made by this script one after the other (``--runs``, default 5), each report and output kept in
``--out``:

    python bench/across_runs.py --run "python bench/diffusion.py --batches 1 --reps 9 --no-replay" --out runs/d1
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import scipy.stats

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.pricing import INTERVAL_LEVEL, interval_text, median_interval  # noqa: E402

# What every report must share: the same bench on the same machine (reps and seeds may differ).
SAME = ("target", "draft", "head", "gamma", "device", "machine", "threads", "torch", "clock")
BASE_ARM = "target_only"  # the speedups' base: efficiency 1 by definition


@dataclass
class Row:
    group: str  # "batch 32", or "K=100, batch 1" for the diffusion bench
    arm: str
    efficiencies: list[float]  # one per run, in the order given
    median: float
    interval: tuple[float, float]  # for the median over the runs
    verdict: str  # met, under or undecided against the threshold
    within: tuple[float, float]  # the lowest and highest point of the runs' own intervals


def interval_coverage(runs: int, level: float = INTERVAL_LEVEL) -> float:
    """The coverage of :func:`~bench.pricing.median_interval` of ``runs`` values: that of the order statistics
    ``x_(k)``, ``x_(runs+1-k)`` with the largest ``k`` reaching ``level``, or of the whole range where none does."""
    binomial = scipy.stats.binom(runs, 0.5)
    reaching = [k for k in range(1, runs // 2 + 1) if 1 - 2 * binomial.cdf(k - 1) >= level]
    return float(1 - 2 * binomial.cdf(max(reaching, default=1) - 1))


def verdict(interval: tuple[float, float], threshold: float) -> str:
    if interval[0] >= threshold:
        return "met"
    return "under" if interval[1] < threshold else "undecided"


def groups(report: dict[str, Any], name: str) -> dict[str, list[dict[str, Any]]]:
    """A report's arms by group: ``batches`` (discrete, continuous) or ``configs`` (diffusion, with its steps)."""
    entries = report.get("batches", report.get("configs"))
    if entries is None:
        raise ValueError(f"{name}: has neither 'batches' nor 'configs': not a family bench's --json report")
    return {(f"K={e['num_steps']}, " if "num_steps" in e else "") + f"batch {e['batch']}": e["arms"] for e in entries}


def combine(reports: dict[str, dict[str, Any]], threshold: float,
            level: float = INTERVAL_LEVEL) -> list[Row]:
    """Rows for every group and speculative arm of the first report, from all ``reports`` ``{file name: report}``;
    a report that differs from the first in a field of :data:`SAME`, or lacks one of its groups or arms, is refused
    by name."""
    (first_name, first), *others = reports.items()
    for name, report in others:
        for field in SAME:
            if report.get(field) != first.get(field):
                raise ValueError(f"{name}: {field!r} is {report.get(field)!r}, but {first.get(field)!r} in "
                                 f"{first_name}: combine runs of one bench on one machine")
    by_report = {name: groups(report, name) for name, report in reports.items()}
    clock = first["clock"]
    rows = []
    for group, arms in by_report[first_name].items():
        for arm in (a["name"] for a in arms if a["name"] != BASE_ARM):
            measured = []
            for name, report_groups in by_report.items():
                found = [a for a in report_groups.get(group, []) if a["name"] == arm]
                if not found:
                    raise ValueError(f"{name}: no arm {arm!r} at {group}; {first_name} has it")
                figures = found[0].get("clocks", {}).get(clock, {})
                if not {"efficiency", "efficiency_interval"} <= figures.keys():
                    raise ValueError(f"{name}: arm {arm!r} at {group} has no efficiency and interval on the {clock} "
                                     "clock (a report from before the benches printed eff 90%?)")
                measured.append(figures)
            efficiencies = [m["efficiency"] for m in measured]
            interval = median_interval(efficiencies, level)
            rows.append(Row(group, arm, efficiencies, statistics.median(efficiencies), interval,
                            verdict(interval, threshold),
                            (min(m["efficiency_interval"][0] for m in measured),
                             max(m["efficiency_interval"][1] for m in measured))))
    return rows


def base_overheads(reports: dict[str, dict[str, Any]]) -> dict[str, list[float | None]]:
    """Per group, each run's ``target_only`` overhead (its time over its calls' prices; None where a report lacks it).
    An arm's efficiency is about the base's overhead over its own, so a run whose base calls cost what their prices
    say (a low base overhead) reads every arm low."""
    clock = next(iter(reports.values()))["clock"]
    by_group: dict[str, list[float | None]] = {}
    for name, report in reports.items():
        for group, arms in groups(report, name).items():
            base = [a for a in arms if a["name"] == BASE_ARM]
            by_group.setdefault(group, []).append(base[0].get("clocks", {}).get(clock, {}).get("overhead")
                                                  if base else None)
    return by_group


def run_medians(rows: list[Row]) -> dict[str, list[float]]:
    """Per group, each run's median efficiency over its speculative arms: what moves a whole run."""
    by_group: dict[str, list[list[float]]] = {}
    for r in rows:
        by_group.setdefault(r.group, []).append(r.efficiencies)
    return {group: [statistics.median(run) for run in zip(*arms)] for group, arms in by_group.items()}


def base_tracking(base: dict[str, list[float | None]], medians: dict[str, list[float]]) -> dict[str, float | None]:
    """Per group, Spearman's rank correlation of the runs' base ``ovh`` with their median efficiency (near 1: the
    base moved the runs); None where fewer than three runs have a base ``ovh`` or either side is constant."""
    tracking: dict[str, float | None] = {}
    for group, values in medians.items():
        pairs = [(b, m) for b, m in zip(base.get(group, []), values) if b is not None]
        rho = None
        if len(pairs) >= 3 and len({b for b, _ in pairs}) > 1 and len({m for _, m in pairs}) > 1:
            rho = float(scipy.stats.spearmanr(*zip(*pairs)).statistic)
        tracking[group] = rho
    return tracking


def table(rows: list[Row], runs: int, coverage: float, base: dict[str, list[float | None]],
          medians: dict[str, list[float]]) -> str:
    """The rows by group; above each group's arms, where ``base`` has a value, its ``(base ovh)`` and ``(arms median)``
    (:func:`base_overheads`, :func:`run_medians`)."""
    lines = []
    for group in dict.fromkeys(r.group for r in rows):
        lines += [f"\n## {group}", f"{'arm':<18} " + " ".join(f"{f'run {k + 1}':>6}" for k in range(runs)) +
                  f" {'median':>6} {f'runs {coverage:.0%}':>11} {f'verdict {coverage:.0%}':>11} {'runs own 90%':>12}"]
        if any(v is not None for v in base.get(group, [])):
            shown = ["-" if v is None else f"{v:.3f}" for v in base[group]]
            lines.append(f"{'(base ovh)':<18} " + " ".join(f"{v:>6}" for v in shown))
            lines.append(f"{'(arms median)':<18} " + " ".join(f"{v:>6.3f}" for v in medians[group]))
        lines += [f"{r.arm:<18} " + " ".join(f"{e:>6.3f}" for e in r.efficiencies) + f" {r.median:>6.3f} "
                  f"{interval_text(r.interval, 3):>11} {r.verdict:>11} {interval_text(r.within, 3):>12}"
                  for r in rows if r.group == group]
    return "\n".join(lines)


def header(first: dict[str, Any], runs: int, coverage: float, threshold: float) -> str:
    models = f"{first['target']} vs {first['draft']}" + (f" and {first['head']}" if first.get("head") else "")
    short = "" if coverage >= INTERVAL_LEVEL else f"; fewer than 5 runs fall short of {INTERVAL_LEVEL:.0%}"
    return (f"# efficiency across {runs} runs, each its own process ({first['clock']} clock): {models}, gamma "
            f"{first['gamma']}, {first['machine']}; the runs' median and its {coverage:.0%} interval "
            f"(distribution-free), threshold {threshold}{short}")


def make_runs(command: list[str], runs: int, out: Path) -> list[Path]:
    """Run ``command`` (a family bench's words) ``runs`` times, one after the other, each its own process, its report in
    ``out/run<k>.json`` and its output in ``out/run<k>.log``; a run that fails stops the others, named with its log."""
    out.mkdir(parents=True, exist_ok=True)
    reports = []
    for k in range(1, runs + 1):
        report, log = out / f"run{k}.json", out / f"run{k}.log"
        print(f"# run {k}/{runs} from {time.strftime('%H:%M:%S')}: {shlex.join(command)} --json {report}",
              file=sys.stderr, flush=True)
        start = time.monotonic()
        with log.open("w") as log_file:
            exit_code = subprocess.run([*command, "--json", str(report)], stdout=log_file,
                                       stderr=subprocess.STDOUT).returncode
        if exit_code != 0 or not report.is_file():
            tail = "".join(log.read_text(errors="replace").splitlines(keepends=True)[-5:])
            raise RuntimeError(f"run {k} of {runs} exited with {exit_code}"
                               f"{'' if report.is_file() else ' and wrote no report'}; its output is in {log}, "
                               f"ending:\n{tail}")
        print(f"# run {k}/{runs} took {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        reports.append(report)
    return reports


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("reports", type=Path, nargs="*", help="--json reports of one family bench, one per run")
    ap.add_argument("--run", default=None, metavar="COMMAND",
                    help="make the runs here instead: a family bench's command line, without --json")
    ap.add_argument("--runs", type=int, default=None, help="how many runs --run makes (default 5: their range, 94 %%)")
    ap.add_argument("--out", type=Path, default=None,
                    help="with --run: an empty or new folder for the runs' reports and output")
    ap.add_argument("--threshold", type=float, default=0.95, help="the efficiency an arm must reach (default 0.95)")
    ap.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.run is not None:
        if args.reports:
            ap.error("give either reports or --run, not both")
        if args.out is None:
            ap.error("--run needs --out, the folder that keeps each run's report and output")
        if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
            ap.error(f"--out {args.out}: not an empty folder; give a new one, so no earlier run's report is counted")
        try:
            words = shlex.split(args.run)
        except ValueError as e:
            ap.error(f"--run: cannot split {args.run!r} into words: {e}")
        if not words or any(w == "--json" or w.startswith("--json=") for w in words):
            ap.error("--run: give a family bench's command line, without --json; each run's report goes to --out")
        args.runs = 5 if args.runs is None else args.runs
        if args.runs < 2:
            ap.error(f"--runs {args.runs}: make at least 2 runs: one run has no spread across runs")
        try:
            args.reports = make_runs(words, args.runs, args.out)
        except (OSError, RuntimeError) as e:
            ap.exit(1, f"{ap.prog}: error: {e}\n")
    elif args.out is not None or args.runs is not None:
        ap.error("--out and --runs go with --run")
    twice = [path for path in dict.fromkeys(args.reports) if args.reports.count(path) > 1]
    if twice:
        ap.error(f"{twice[0]}: given more than once; each run's report counts once")
    if len(args.reports) < 2:
        ap.error("give the reports of at least two runs: one run has no spread across runs")
    reports = {}
    for path in args.reports:
        try:
            reports[str(path)] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"{path}: cannot read a JSON report: {e}")
    try:
        rows = combine(reports, args.threshold)
    except ValueError as e:
        ap.error(str(e))
    runs, coverage = len(reports), interval_coverage(len(reports))
    print(header(next(iter(reports.values())), runs, coverage, args.threshold))
    base, medians = base_overheads(reports), run_medians(rows)
    print(table(rows, runs, coverage, base, medians))
    tracking = base_tracking(base, medians)
    if any(v is not None for values in base.values() for v in values):
        print(f"\n# base ovh: {BASE_ARM}'s time over its calls' prices, per run; an arm's efficiency is about the "
              "base's ovh over its own, so a run whose base ovh is low reads every arm low; arms median: the run's "
              "median efficiency over its arms; their rank correlation (Spearman) across the runs: " +
              ", ".join(f"{group} {'-' if rho is None else f'{rho:.2f}'}" for group, rho in tracking.items()))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": [str(p) for p in args.reports], "coverage": coverage,
                                         "threshold": args.threshold, "rows": [asdict(r) for r in rows],
                                         "base_overheads": base, "run_medians": medians,
                                         "base_rank_correlation": tracking}, indent=2))
        print(f"\n# wrote {args.json}")


if __name__ == "__main__":
    main()
