"""The ``specray`` command line. Thin: each command parses, then calls one function."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import click

from specray.families import FAMILIES
from specray.spec import SpecError

EXIT_BAD_INPUT = 2


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    from specray.urls import redact_urls

    click.echo(f"error: {redact_urls(message)}", err=True)  # a URL's user:password never reaches the terminal
    sys.exit(code)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-v", "--verbose", is_flag=True, help="Log at DEBUG level.")
def specray(verbose: bool) -> None:
    """Speculative decoding of image generators as Ray batch jobs."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _load(job_file: str | None, *, date: str | None = None, run_id: str | None = None, **overrides):
    """The validated spec of JOB_FILE (the built-in demo when None) with the command line's overrides."""
    from specray.spec import DEMO_PATH, load_job, read_job_file

    data = read_job_file(Path(job_file) if job_file is not None else DEMO_PATH)
    if date is not None or run_id is not None:
        if not isinstance(data.get("dataset"), dict):
            raise SpecError("dataset", "--date / --run-id need a job with a dataset: section")
        key, value = ("date", date) if date is not None else ("run_id", run_id)
        kept = {k: v for k, v in data["dataset"].items() if k not in ("value", "date", "run_id")}
        data["dataset"] = {**kept, key: value}
    return load_job(data, **overrides)


@specray.command()
@click.argument("job_file", required=False, type=click.Path(dir_okay=False))
@click.option("--output", help="Output directory or s3:// URI (overrides the spec).")
@click.option("--num-cpus", type=int, help="CPUs of the local Ray instance to start (default: all).")
@click.option("--actors", type=int, help="Number of generation actors (overrides the spec; default: what the "
                                        "cluster offers).")
@click.option("--per-class", type=int, help="Samples per class (overrides conditions.per_class; in a prompt job, "
                                           "conditions.repeats).")
@click.option("--batch-size", type=int, help="Batch size (overrides the spec).")
@click.option("--seed", type=int, help="Job seed (overrides the spec; e.g. a new seed per nightly run).")
@click.option("--date", help="Dataset jobs: the partition date YYYY-MM-DD (default: today, UTC).")
@click.option("--run-id", help="Dataset jobs partitioned by run: the run id.")
@click.option("--ray-address", help="Ray cluster to join ('auto' = the one running here; default: RAY_ADDRESS "
                                    "if set, as under `ray job submit`, else start a local Ray).")
@click.option("--no-reduce", is_flag=True, help="Only generate; do not compute FID / speedup.")
@click.option("--quiet", is_flag=True, help="No progress bar.")
def run(job_file: str | None, output: str | None, num_cpus: int | None, actors: int | None,
        per_class: int | None, batch_size: int | None, seed: int | None, date: str | None, run_id: str | None,
        ray_address: str | None, no_reduce: bool, quiet: bool) -> None:
    """Run JOB_FILE (YAML), or the built-in demo when none is given (specray/demo.yaml, then its prompt
    part specray/demo_prompts.yaml); then reduce it.

    This is also what `ray job submit ... -- python jobs/submit.py JOB_FILE` runs on a cluster.
    """
    if num_cpus is not None and num_cpus < 1:
        _fail(f"--num-cpus: must be an integer >= 1, got {num_cpus}")
    from specray.spec import DEMO_PATHS

    jobs = [job_file] if job_file is not None else [str(path) for path in DEMO_PATHS]
    try:  # every job is validated before the first one runs
        specs = [_load(job, date=date, run_id=run_id, output=_demo_output(output, index), actors=actors,
                       per_class=per_class, batch_size=batch_size, seed=seed) for index, job in enumerate(jobs)]
    except SpecError as exc:
        _fail(str(exc))
    for spec in specs:
        _run_one(spec, ray_address, num_cpus, no_reduce, quiet)


def _demo_output(output: str | None, index: int) -> str | None:
    """--output for the demo's jobs: the first writes there, the prompt part beside it (``<output>-prompts``)."""
    if output is None or index == 0:
        return output
    return output.rstrip("/") + "-prompts"


def _run_one(spec, ray_address: str | None, num_cpus: int | None, no_reduce: bool, quiet: bool) -> None:
    # Only now torch and Ray: a refused job costs a torch-free validation, not their start-up.
    from specray.runtime.coordinator import ShardFailedError, run_job
    if "://" not in spec.output and not os.path.isabs(spec.output) and os.environ.get("RAY_JOB_SUBMISSION_ID"):
        logging.getLogger("specray").warning(
            "output %r is relative: it lands in this job's working directory on the head node; pass --output "
            "with an absolute path or an s3:// URI to keep it", spec.output)
    if spec.dataset is not None:  # a dataset job publishes a partition and a card; there is no report
        _run_dataset(spec, ray_address, num_cpus, quiet)
        return
    try:
        result = run_job(spec, ray_address=ray_address, num_cpus=num_cpus, show_progress=not quiet)
    except SpecError as exc:
        _fail(str(exc))
    except ShardFailedError as exc:
        _fail(str(exc), code=1)
    click.echo(f"wrote {result.manifest['num_rows']} rows to {result.output} "
               f"({result.tasks_run} shard tasks run, {result.tasks_skipped} already committed, "
               f"{result.retries} retries, {result.wall_time_s:.1f} s)")
    if no_reduce:
        return
    if not spec.eval.fid:
        click.echo(f"eval.fid is false: not scoring; `specray reduce {result.output}` scores the run later")
        return
    _reduce(result.output, spec.storage_options or None)


def _run_dataset(spec, ray_address: str | None, num_cpus: int | None, quiet: bool) -> None:
    from specray.runtime.coordinator import ShardFailedError
    from specray.runtime.dataset import run_dataset_job

    try:
        result = run_dataset_job(spec, ray_address=ray_address, num_cpus=num_cpus, show_progress=not quiet)
    except SpecError as exc:
        _fail(str(exc))
    except ShardFailedError as exc:
        _fail(str(exc), code=1)
    state = "was already published" if result.already_published else "published"
    click.echo(f"partition {result.partition} {state}: {result.num_rows} rows in {len(result.files)} files "
               f"under {result.output}")


@specray.command()
@click.argument("job_file", type=click.Path(dir_okay=False))
def validate(job_file: str) -> None:
    """Check JOB_FILE without running it."""
    from specray.runtime.plan import ShardPlan

    try:
        spec = _load(job_file)
    except SpecError as exc:
        _fail(str(exc))
    plan = ShardPlan.of(spec)
    click.echo(f"ok: {spec.job_id}: {plan.num_samples} samples x {len(spec.arms)} arms, {plan.num_shards} shards "
               f"of {plan.shard_size}, fingerprint {spec.fingerprint()}")


@specray.command()
@click.argument("source", type=click.Path(dir_okay=False))
@click.argument("dest", type=click.Path(dir_okay=False))
@click.option("--entry", help="The state dict to take (default: model_ema, model, module, state_dict, the file).")
@click.option("--trust-pickle", is_flag=True, help="Unpickle SOURCE with arbitrary code (only for a file you trust).")
def convert(source: str, dest: str, entry: str | None, trust_pickle: bool) -> None:
    """Write SOURCE's weights as DEST.safetensors (with its config) for the release-format loaders."""
    from specray.models.checkpoints.convert import convert as convert_file
    from specray.models.checkpoints.reading import CheckpointError

    try:
        out = convert_file(source, dest, entry=entry, trust_pickle=trust_pickle)
    except CheckpointError as exc:
        _fail(str(exc))
    click.echo(f"wrote {out}")


def _preset_names() -> list[str]:
    from specray.models.presets.train import all_preset_names

    return all_preset_names()


@specray.command(epilog="Presets: " + ", ".join(_preset_names()) + ".")
@click.argument("preset", default="all", type=click.Choice(["all", *_preset_names()]))
@click.option("--out-dir", type=click.Path(file_okay=False), help="Where to write weights (default: the "
                                                                  "package's presets/weights).")
@click.option("--seed", type=int, default=0, show_default=True)
def train(preset: str, out_dir: str | None, seed: int) -> None:
    """Reproduce PRESET's weights (or every preset with 'all') with its family's trainer.

    PRESET is 'all' or one of the presets listed below.
    """
    from specray.models.presets import WEIGHTS_DIR
    from specray.models.presets import train as presets_train

    names = presets_train.all_preset_names() if preset == "all" else [preset]
    target_dir = Path(out_dir) if out_dir else WEIGHTS_DIR
    for name in names:
        path = presets_train.train(name, target_dir, seed)
        click.echo(f"trained {name} -> {path}")


@specray.command()
@click.argument("family_name", required=False, metavar="FAMILY", type=click.Choice(list(FAMILIES)))
def methods(family_name: str | None) -> None:
    """List the families and methods a job can name, with every parameter's default and allowed values."""
    from specray.methods.params import allowed_values

    for entry in [FAMILIES[family_name]] if family_name else FAMILIES.values():
        click.echo(f"{entry.name}: {entry.summary}")
        for method in entry.methods.values():
            defaults = method.params.parse({})
            flags = ", ".join(f for f, on in (("lossless", defaults.lossless), ("needs a draft", defaults.needs_draft))
                              if on)
            click.echo(f"  {method.name}: {method.summary}" + (f" [{flags} by default]" if flags else ""))
            for name, value in defaults.model_dump(mode="json").items():
                click.echo(f"      {name} = {value!r}  ({allowed_values(method.params, name)})")


def _require_manifest(run_dir: str, storage_options: dict | None = None) -> None:
    from specray.runtime.fs import StorageError
    from specray.runtime.store import MANIFEST_NAME, RunStore

    try:
        finished = RunStore(run_dir, storage_options).is_committed(MANIFEST_NAME)
    except StorageError as exc:  # e.g. a URL with credentials in it: refused, redacted
        _fail(f"RUN: {exc}")
    if not finished:
        _fail(f"RUN: {run_dir!r} has no {MANIFEST_NAME}: not a finished specray run (rerun its job to finish it)")


def _reduce(run_dir: str, storage_options: dict | None = None, partial: bool = False) -> dict:
    from specray.eval.checks import RunCheckError
    from specray.eval.reduce import reduce_run
    from specray.eval.shards import ManifestError
    from specray.runtime.fs import StorageError

    try:
        _require_manifest(run_dir, storage_options)
        report = reduce_run(run_dir, print_table=True, storage_options=storage_options, partial=partial)
    except (RunCheckError, ManifestError, StorageError) as exc:
        _fail(f"RUN: {run_dir!r} refused before scoring: {exc}")
    if report.get("partial"):
        missing = report["partial"]["missing"]
        click.echo(f"partial report: {len(missing)} shard file(s) not scored (listed in report.md and report.json)",
                   err=True)
    return report


@specray.command()
@click.argument("run_dir")
@click.option("--partial", is_flag=True, help="Score the shard files that pass verification and list the missing "
                                              "or damaged ones in the report, instead of refusing the run.")
def reduce(run_dir: str, partial: bool) -> None:
    """Verify every shard file of a finished run, then compute FID and speedup and write RUN_DIR/report/."""
    _reduce(run_dir, partial=partial)


@specray.command()
@click.argument("run_dir")
def report(run_dir: str) -> None:
    """Re-render RUN_DIR/report/ (report.md, plots, grids) from report.json without rescoring."""
    from specray.eval.report import regenerate

    _require_manifest(run_dir)
    try:
        regenerate(run_dir)
    except FileNotFoundError:
        _fail(f"RUN: {run_dir!r} has no report/report.json yet; run `specray reduce {run_dir}` first")
    click.echo(f"report regenerated under {run_dir.rstrip('/')}/report/")


@specray.command()
@click.argument("run_a")
@click.argument("run_b")
@click.option("--samples", is_flag=True, help="Compare the runs sample by sample (image bytes and acceptance "
                                              "statistics per arm and sample_id) instead of their reports.")
def compare(run_a: str, run_b: str, samples: bool) -> None:
    """Show the differences between two runs (e.g. last night's against tonight's).

    Exits 1 with --samples when the runs are not identical.
    """
    from specray.eval.compare import compare_markdown, compare_runs, compare_samples, compare_samples_text

    for run_dir in (run_a, run_b):
        _require_manifest(run_dir)
    if samples:
        comparison = compare_samples(run_a, run_b)
        click.echo(compare_samples_text(comparison), nl=False)
        if not comparison["identical"]:
            sys.exit(1)
        return
    try:
        comparison = compare_runs(run_a, run_b)
    except FileNotFoundError as exc:
        _fail(str(exc))
    click.echo(compare_markdown(comparison))


def main(argv: list[str] | None = None) -> None:
    specray.main(args=argv, prog_name="specray")


if __name__ == "__main__":
    main()
