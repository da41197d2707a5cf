"""Entrypoint for ``ray job submit``: run one specray job on the cluster the submission runs on.

    ray job submit --address http://HEAD:8265 --working-dir . -- \
        python jobs/submit.py jobs/fid50k.yaml --output s3://bucket/specray/fid50k

Ray sets RAY_ADDRESS for the entrypoint, so the driver joins that cluster (it never starts its
own). The job spec is validated before anything touches Ray or the output. Progress lines go to
stderr, which ``ray job logs`` shows. A job with a ``dataset:`` section publishes a dataset
partition; any other job writes a run and (unless --no-reduce) its FID / speedup report.

Exit codes: 0 done, 2 bad input (spec, output, credentials), 1 a shard exhausted its retries.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]
if (_REPO / "specray" / "__init__.py").is_file() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))  # the uploaded working dir's specray, when submitted with --working-dir .

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="jobs/submit.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("job_file", help="job spec (YAML)")
    parser.add_argument("--output", help="output directory or s3:// URI (overrides the spec)")
    parser.add_argument("--per-class", type=int, help="samples per class (overrides conditions.per_class)")
    parser.add_argument("--seed", type=int, help="job seed (overrides the spec; e.g. a new seed per nightly run)")
    parser.add_argument("--date", help="dataset jobs: the partition date YYYY-MM-DD (default: today, UTC)")
    parser.add_argument("--run-id", help="dataset jobs partitioned by run: the run id")
    parser.add_argument("--actors", type=int, help="number of generation actors (default: what the cluster offers)")
    parser.add_argument("--ray-address", help="cluster to join (default: RAY_ADDRESS, as ray job submit sets it)")
    parser.add_argument("--no-reduce", action="store_true", help="only generate; no FID / speedup report")
    return parser.parse_args(argv)


def load_spec(args: argparse.Namespace):
    """The validated spec with the command-line overrides applied."""
    import yaml

    from specray.spec import SpecError, load_job

    path = Path(args.job_file)
    data = yaml.safe_load(path.read_text()) if path.is_file() else None
    if not isinstance(data, dict):
        return load_job(path)  # raises the loader's error (missing file, bad YAML, not a mapping)
    if args.seed is not None:
        data["seed"] = args.seed
    if args.date is not None or args.run_id is not None:
        if not isinstance(data.get("dataset"), dict):
            raise SpecError("dataset", "--date / --run-id need a job with a dataset: section")
        key = "date" if args.date is not None else "run_id"
        data["dataset"] = {**{k: v for k, v in data["dataset"].items() if k not in ("value", "date", "run_id")},
                           key: args.date if args.date is not None else args.run_id}
    return load_job(data, output=args.output, per_class=args.per_class, actors=args.actors)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr)
    args = parse_args(argv)
    from specray.runtime.coordinator import ShardFailedError, run_job
    from specray.spec import SpecError

    try:
        spec = load_spec(args)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if "://" not in spec.output and not os.path.isabs(spec.output) and os.environ.get("RAY_JOB_SUBMISSION_ID"):
        logging.warning("output %r is relative: it lands in this job's working directory on the head node; "
                        "pass --output with an absolute path or an s3:// URI to keep it", spec.output)
    ray_address = args.ray_address or os.environ.get("RAY_ADDRESS")
    try:
        if spec.dataset is not None:
            from specray.runtime.dataset import run_dataset_job

            result = run_dataset_job(spec, ray_address=ray_address)
            print(f"partition {result.partition}: {result.num_rows} rows in {len(result.files)} files under "
                  f"{result.output}" + (" (already published)" if result.already_published else ""), flush=True)
            return 0
        run = run_job(spec, ray_address=ray_address)
    except SpecError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except ShardFailedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(f"wrote {run.manifest['num_rows']} rows to {run.output} ({run.tasks_run} shard tasks run, "
          f"{run.tasks_skipped} already committed, {run.retries} retries, {run.wall_time_s:.1f} s)", flush=True)
    if not args.no_reduce and spec.eval.fid:
        from specray.eval.reduce import reduce_run

        reduce_run(run.output, print_table=True, storage_options=spec.storage_options or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
