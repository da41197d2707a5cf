"""Attention over the filled span of the KV cache against the whole cache, side by side in one run.

On a CPU a discrete-AR call attends over the cache's first slots only, rounded up past its last
position (:func:`specray.models.discrete_ar.attention_span`); ``whole`` is what every call did before
(``ATTENTION_SPANS`` off). For each batch size and arm (fid50k's: target_only, sd, cool_sd,
gamma 4, CFG 1.5, on digits-gpt-target with the draft digits-gpt-draft) it prints:

- ``whole`` / ``span``: ms per sample, median over repetitions, process CPU time; the two settings
  take turns batch by batch (:func:`bench.pricing.run_in_turns`);
- ``ratio``: median over repetitions of whole time / span time (> 1: the span is faster);
- ``differ``: samples whose tokens or statistics differ between the two, on any repetition (the
  span is meant to change no bit: 0).

    python bench/attention_span.py [--batches 1,32,64] [--reps 5] [--samples-b1 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compiled import _discrete, _same  # noqa: E402
from bench.pricing import batches_of, paired_speedup, per_repetition, run_in_turns, since, stamp  # noqa: E402
from specray.models import discrete_ar  # noqa: E402

ARMS = (("target_only", {}), ("sd", {"gamma": 4}), ("cool_sd", {"gamma": 4}))
SETTINGS = {"whole": lambda: setattr(discrete_ar, "ATTENTION_SPANS", False),
            "span": lambda: setattr(discrete_ar, "ATTENTION_SPANS", True)}


def arguments(doc: str, argv: list[str] | None, batches: str = "1,32,64",
              extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The side-by-side benches' options (``extra`` adds a bench's own)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(ap)
    ap.add_argument("--batches", default=batches, help="jobs/fid50k.yaml runs at 128")
    ap.add_argument("--samples-b1", type=int, default=4, help="samples at batch 1 (one batch at larger sizes)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None)
    return ap.parse_args(argv)


def side_by_side(title: str, settings: dict[str, Callable[[], None]], args: argparse.Namespace) -> None:
    """fid50k's arms under two ``settings`` (name: what applies it; the second is left applied), taking
    turns batch by batch: ms per sample, the first's time over the second's, and the samples that differ."""
    torch.set_num_threads(1)
    pair = discrete_ar.load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    first, second = settings
    print(f"# {title}: cpu, torch {torch.__version__}, process CPU time, {args.reps} reps")
    print(f"{'batch':>5} {'method':<12} {first:>10} {second:>10} {'ratio':>6} {'differ':>8}")
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        work = batches_of(args.samples_b1 if batch == 1 else batch, batch)
        for method, params in ARMS:
            outputs: dict[str, list] = {name: [] for name in settings}

            def run(name: str, unit: tuple) -> dict[str, float]:
                settings[name]()
                start = stamp()
                outputs[name] += _discrete(method, params, pair, *unit, args.seed)
                return since(start)

            run(second, work[0])  # warm-up
            outputs[second].clear()
            elapsed, _ = run_in_turns(list(settings), work, args.reps, run, between=lambda: None)
            settings[second]()
            times = {name: [r["cpu"] for r in per_repetition(elapsed[name], len(work))] for name in settings}
            samples = len(work) * batch
            pairs = zip(outputs[first], outputs[second])  # sample by sample, repetition after repetition
            differ = len({i % samples for i, (a, b) in enumerate(pairs) if not _same(a, b)})
            row = {"batch": batch, "method": method, "samples": samples, "differ": differ,
                   "ratio": paired_speedup(times[first], times[second]),
                   **{f"{name}_ms_per_sample": statistics.median(t) * 1e3 / samples for name, t in times.items()}}
            rows.append(row)
            print(f"{batch:>5} {method:<12} {row[f'{first}_ms_per_sample']:>8.2f}ms "
                  f"{row[f'{second}_ms_per_sample']:>8.2f}ms {row['ratio']:>6.2f} {differ:>4}/{samples}", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"clock": "cpu", "rows": rows}, indent=2))


def main(argv: list[str] | None = None) -> None:
    side_by_side("whole cache vs attention span", SETTINGS, arguments(__doc__, argv))


if __name__ == "__main__":
    main()
