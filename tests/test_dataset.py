"""Dataset output: Parquet partitioned per date or run, HF image column, a dataset card; readers.

The fake family of tests/test_runtime.py generates (24 samples x 2 arms per partition), so a
partition costs a few seconds. Readers checked: pyarrow, pandas, duckdb, and Hugging Face
``datasets.load_dataset("parquet", ...)`` when it is installed.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from click.testing import CliRunner

from specray.runtime.dataset import (
    CARD_NAME,
    PARTITION_RECORD,
    STAGING_DIR,
    model_versions,
    published_name,
    run_dataset_job,
)
from specray.runtime.store import SAMPLE_SCHEMA
from specray.spec import SpecError, load_job
from tests.test_runtime import REPO_ROOT, fake_family, fake_job  # noqa: F401 (fixture)

NUM_SHARDS = 3
ARMS = ("target_only", "fake_sd")


@pytest.fixture(scope="module")
def ray_ds(fake_family):  # noqa: F811
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, runtime_env={
        "env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
                     "OMP_NUM_THREADS": "1"},
        "worker_process_setup_hook": "tests.test_runtime.install_fake_family",
    })
    yield ray
    ray.shutdown()


def dataset_job(root: Path, date: str = "2026-11-29", **fields) -> dict:
    job = fake_job(root, **fields)
    job["dataset"] = {"partition": "date", "date": date, "name": "fake-nightly",
                      "description": "Fake digits for the dataset tests."}
    return job


@pytest.fixture(scope="module")
def two_nights(ray_ds, tmp_path_factory):
    """A dataset with two date partitions (different seeds per night), published by two jobs."""
    root = tmp_path_factory.mktemp("nightly") / "ds"
    first = run_dataset_job(load_job(dataset_job(root, "2026-11-29")), show_progress=False)
    second = run_dataset_job(load_job(dataset_job(root, "2026-11-30", seed=8)), show_progress=False)
    return root, first, second


def test_layout_partition_record_and_no_staging_left(two_nights):
    root, first, second = two_nights
    files = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    expected = [CARD_NAME]
    for date in ("2026-11-29", "2026-11-30"):
        expected += [f"data/date={date}/{published_name(arm, k, NUM_SHARDS)}" for arm in ARMS for k in range(NUM_SHARDS)]
        expected.append(f"data/date={date}/{PARTITION_RECORD}")
    assert files == sorted(expected)  # no _staging, no temp files
    assert not (root / STAGING_DIR).exists()
    assert first.num_rows == second.num_rows == 48 and not first.already_published
    record = json.loads((root / "data/date=2026-11-29" / PARTITION_RECORD).read_text())
    assert record["rows_per_arm"] == {"target_only": 24, "fake_sd": 24} and record["value"] == "2026-11-29"
    for entry in record["files"]:
        assert hashlib.sha256((root / entry["path"]).read_bytes()).hexdigest() == entry["sha256"]
    # Files keep the run schema; the image column is the HF image struct and decodes as PNG.
    table = pq.read_table(root / record["files"][0]["path"])
    assert table.schema.names == SAMPLE_SCHEMA.names
    assert str(table.schema.field("image").type) == "struct<bytes: binary, path: string>"
    features = json.loads(table.schema.metadata[b"huggingface"])["info"]["features"]
    assert features["image"] == {"_type": "Image"}
    from PIL import Image

    assert Image.open(io.BytesIO(table.column("image")[0].as_py()["bytes"])).size == (6, 6)


def test_pyarrow_pandas_and_duckdb_read_the_partitions(two_nights):
    root = two_nights[0]
    table = pq.read_table(root / "data")  # hive partitioning: 'date' from the directory names
    assert table.num_rows == 96 and "date" in table.column_names
    per_date = {str(d): 0 for d in table.column("date").to_pylist()}
    for d in table.column("date").to_pylist():
        per_date[str(d)] += 1
    assert per_date == {"2026-11-29": 48, "2026-11-30": 48}

    import pandas as pd

    frame = pd.read_parquet(root / "data")
    assert len(frame) == 96 and frame.groupby(frame["date"].astype(str)).size().to_dict() == per_date
    assert frame["image"].iloc[0]["bytes"].startswith(b"\x89PNG")
    assert not frame.duplicated(["date", "arm", "sample_id"]).any()

    import duckdb

    rows = duckdb.sql(f"select cast(date as varchar) as d, arm, count(*) as n, count(distinct sample_id) as ids "
                      f"from read_parquet('{root}/data/*/*.parquet', hive_partitioning=true) "
                      f"group by d, arm order by d, arm").fetchall()
    assert rows == [(d, arm, 24, 24) for d in ("2026-11-29", "2026-11-30") for arm in sorted(ARMS)]
    # Different seeds per night -> different images (the partitions are not copies of each other).
    nights = {d: frame[(frame["date"].astype(str) == d) & (frame["arm"] == "target_only")]
              .sort_values("sample_id")["image"].map(lambda i: i["bytes"]).tolist() for d in per_date}
    assert sum(a != b for a, b in zip(*nights.values())) > 12


def test_huggingface_datasets_loads_images(two_nights, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    root = two_nights[0]
    files = sorted(str(p) for p in root.glob("data/*/*.parquet"))
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 96
    assert isinstance(ds.features["image"], datasets.Image)
    first = ds[0]
    assert first["image"].size == (6, 6) and first["arm"] in ARMS


def test_dataset_card_has_spec_models_and_counts(two_nights):
    root = two_nights[0]
    card = (root / CARD_NAME).read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["configs"][0]["data_files"][0]["path"] == "data/*/*.parquet"
    assert "# fake-nightly" in card and "Fake digits for the dataset tests." in card
    assert "| 2026-11-29 | fake-test | 7 | 48 | fake_sd: 24, target_only: 24 | 6 |" in card
    assert "| 2026-11-30 | fake-test | 8 | 48 |" in card and "96 rows in all" in card
    assert "| fake-target | preset | target | fake |" in card
    spec_yaml = yaml.safe_load(card.split("```yaml")[1].split("```")[0])
    assert spec_yaml["job_id"] == "fake-test" and spec_yaml["seed"] == 8  # the latest run's spec
    assert spec_yaml["output"] == str(root) and STAGING_DIR not in card


def test_model_versions_hash_preset_weights_and_training_record():
    try:
        spec = load_job({"output": "/tmp/unused-specray-out", "arms": [
            {"name": "sd", "family": "discrete_ar", "method": "sd", "target": "digits-gpt-target",
             "draft": "digits-gpt-draft"}]})
    except SpecError as exc:
        pytest.skip(f"discrete family not available: {exc}")
    from specray.models.presets import get_preset

    versions = {m["name"]: m for m in model_versions(spec)}
    for name in ("digits-gpt-target", "digits-gpt-draft"):
        path = get_preset(name).weights_path
        if not path.exists():
            pytest.skip(f"{name} is not trained")
        assert versions[name]["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
        assert {"seed", "steps", "final_train_loss"} <= set(versions[name]["training"])


def test_rerun_of_a_published_partition_generates_nothing(two_nights):
    root = two_nights[0]
    again = run_dataset_job(load_job(dataset_job(root, "2026-11-29")), show_progress=False)
    assert again.already_published and again.num_rows == 48
    with pytest.raises(SpecError, match=r"^dataset: partition 'date=2026-11-29' .* already holds job 'fake-test' "
                                        r"with another spec"):
        run_dataset_job(load_job(dataset_job(root, "2026-11-29", seed=99)), show_progress=False)


def test_crash_before_publishing_resumes_from_staging(ray_ds, tmp_path):
    """The staging run completed but the driver died before publishing: a rerun only publishes."""
    from specray.runtime.coordinator import run_job
    from specray.spec import with_output

    root = tmp_path / "ds"
    spec = load_job(dataset_job(root, partition_dir := "2026-12-01"))
    staging = root / STAGING_DIR / f"date={partition_dir}"
    run_job(with_output(spec, str(staging)), show_progress=False)
    staged = {str(p.relative_to(staging)): p.read_bytes() for p in staging.rglob("*.parquet")}
    result = run_dataset_job(spec, show_progress=False)
    assert not result.already_published and result.num_rows == 48
    assert not staging.exists()
    published = {f: (root / f).read_bytes() for f in result.files}
    assert len(published) == len(staged) == 6
    assert sorted(published.values()) == sorted(staged.values())  # published as committed, not regenerated


def test_run_partition_and_cli(ray_ds, tmp_path):
    """partition: run (default id = the job fingerprint) through `specray run`."""
    root = tmp_path / "ds"
    job = fake_job(root)
    job["conditions"] = {**job["conditions"], "per_class": 2}
    job["dataset"] = {"partition": "run"}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    from specray.cli import specray

    result = CliRunner().invoke(specray, ["run", str(path), "--quiet"])
    assert result.exit_code == 0, result.output
    fingerprint = load_job(job).fingerprint()
    assert f"partition run={fingerprint} published: 16 rows in 2 files" in result.stdout
    assert (root / f"data/run={fingerprint}" / PARTITION_RECORD).exists() and (root / CARD_NAME).exists()
    assert not (root / "report").exists()  # a dataset has no evaluation report


@pytest.mark.parametrize("dataset,field,words", [
    ({"partition": "week"}, "dataset.partition", "allowed: date, run"),
    ({"partition": "date", "date": "2026-02-30"}, "dataset.date", 'must be "today" or a date YYYY-MM-DD'),
    ({"partition": "date", "run_id": "x"}, "dataset.run_id", "only used with partition: run"),
    ({"partition": "run", "run_id": "a/b"}, "dataset.run_id", "letters, digits"),
    ({"partition": "date", "shards": 3}, "dataset.shards", "unknown field"),
])
def test_bad_dataset_sections_are_named(fake_family, tmp_path, dataset, field, words):  # noqa: F811
    job = fake_job(tmp_path / "ds")
    job["dataset"] = dataset
    with pytest.raises(SpecError) as info:
        load_job(job)
    assert info.value.field_path == field and words in str(info.value)


def test_today_is_resolved_once_and_round_trips(fake_family, tmp_path):  # noqa: F811
    from datetime import datetime, timezone

    spec = load_job(dataset_job(tmp_path / "ds", "today"))
    assert spec.dataset.value == datetime.now(timezone.utc).date().isoformat()
    assert load_job(spec.to_dict()) == spec
    assert spec.dataset.partition_dir == f"date={spec.dataset.value}"
    shutil.rmtree(tmp_path / "ds", ignore_errors=True)


def test_huggingface_features_metadata_and_unknown_types():
    import pyarrow as pa

    from specray.runtime.store import huggingface_features, with_huggingface_metadata

    features = huggingface_features(SAMPLE_SCHEMA)
    assert features["image"] == {"_type": "Image"} and features["sample_id"] == {"dtype": "int64", "_type": "Value"}
    assert features["accepted_per_position"] == {"feature": {"dtype": "int32", "_type": "Value"}, "_type": "Sequence"}
    odd = pa.table({"x": pa.array([1], pa.int16())})
    assert with_huggingface_metadata(odd).schema.metadata is None  # unknown type: left to datasets' inference
