"""Bad input fails before Ray starts: via `specray run`, exit code 2, the field and the allowed values named,
no Traceback, and nothing written (no output directory, no S3 object, no Ray instance).

The jobs use the real families and presets (what a user runs). tests/test_spec.py checks the loader's
messages field by field; this file checks the whole command for each case of issue 5 item 9 and the
other mistakes a user makes.
"""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from specray.cli import specray
from specray.spec import SpecError, load_job, safetensors_header_problem
from tests.conftest import boto3_client


def _preset_weights(name: str) -> Path:
    from specray.models.presets import get_preset

    path = get_preset(name).weights_path
    if not path.exists():
        pytest.skip(f"preset {name} is not trained")
    return path


def base_job(out: Path | str) -> dict:
    arm = {"family": "discrete_ar", "target": "digits-gpt-target", "draft": "digits-gpt-draft"}
    return {"job_id": "validation", "seed": 0, "output": str(out), "conditions": {"per_class": 1},
            "batch_size": 2, "shard_batches": 2,
            "arms": [{"name": "target_only", "method": "target_only", **arm},
                     {"name": "sd", "method": "sd", "params": {"gamma": 4}, **arm}],
            "eval": {"fid": False}}


def invoke(tmp_path: Path, job: dict | str, *extra: str):
    """`specray run JOB --no-reduce`; asserts the command failed cleanly before Ray started."""
    import ray

    path = tmp_path / "job.yaml"
    path.write_text(job if isinstance(job, str) else yaml.safe_dump(job))
    result = CliRunner().invoke(specray, ["run", str(path), "--no-reduce", "--quiet", *extra])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.startswith("error: ")
    assert not ray.is_initialized(), "Ray was started for a job that cannot run"
    return result


def _set(job: dict, path: str, value) -> dict:
    job = copy.deepcopy(job)
    parts = [p for chunk in path.split(".") for p in chunk.replace("]", "").split("[")]
    node = job
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value
    return job


CASES = [
    # (id, field to change, bad value, field named in the error, words naming the allowed values)
    ("unknown family", "arms[1].family", "gan", "arms[1].family",
     "unknown family 'gan'; allowed: continuous_ar, diffusion, discrete_ar"),
    ("unknown method", "arms[1].method", "medusa", "arms[1].method",
     "allowed: target_only, sd, block, lantern, cool_sd, uniform_rsd"),
    ("method of another family", "arms[1].method", "cspd", "arms[1].method",
     "unknown method 'cspd' for family 'discrete_ar'; allowed: target_only, sd,"),
    ("duplicate arm names", "arms[1].name", "target_only", "arms[1].name",
     "duplicate arm name 'target_only' (also arms[0])"),
    ("per_class 0", "conditions.per_class", 0, "conditions.per_class", "must be an integer >= 1, got 0"),
    ("negative batch size", "batch_size", -4, "batch_size", "must be an integer >= 1, got -4"),
    ("zero shard batches", "shard_batches", 0, "shard_batches", "must be an integer >= 1, got 0"),
    ("gamma 0", "arms[1].params.gamma", 0, "arms[1].params.gamma", "must be an integer in [1, 64], got 0"),
    ("misspelt param", "arms[1].params", {"gama": 3}, "arms[1].params.gama",
     "allowed: ['cfg_interval', 'cfg_scale', 'gamma', 'temperature', 'top_k', 'top_p', 'tree']"),
    ("class out of range", "conditions.classes", [3, 10], "conditions.classes[1]",
     "class label 10 out of range; allowed: 0..9"),
    ("unknown preset", "arms[0].target", "digits-gpt-huge", "arms[0].target",
     "unknown preset 'digits-gpt-huge'; built-in presets are: "),
    ("preset of another family", "arms[0].draft", "digits-ddpm-draft", "arms[0].draft",
     "belongs to family 'diffusion', not 'discrete_ar'"),
    ("missing checkpoint", "arms[0].target", "/nonexistent/gpt.safetensors", "arms[0].target",
     "checkpoint '/nonexistent/gpt.safetensors' does not exist"),
    ("shard_size not a multiple", "shard_size", 3, "shard_size", "give either shard_batches or shard_size"),
    ("misspelt top-level key", "batch_sise", 8, "batch_sise", "did you mean 'batch_size'?"),
    ("misspelt arm key", "arms[0].taget", "x", "arms[0].taget", "did you mean 'target'?"),
    ("credentials in the job file", "storage_options", {"secret": "hunter2-secret"}, "storage_options.secret",
     "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"),
    ("bad endpoint", "storage_options", {"endpoint_url": "minio:9000"}, "storage_options.endpoint_url",
     "must be http(s)://HOST[:PORT]"),
    ("unsupported output scheme", "output", "gs://bucket/run", "output", "allowed: a local path, file://, s3://"),
    ("bad dataset partition", "dataset", {"partition": "hour"}, "dataset.partition", "allowed: date, run"),
    ("arms not a list", "arms", {"name": "x"}, "arms", "must be a non-empty list of arms"),
]


@pytest.mark.parametrize("field,value,named,words", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_field_exits_2_names_field_and_writes_nothing(tmp_path, field, value, named, words):
    out = tmp_path / "out"
    job = base_job(out)
    if field == "shard_size":
        job[field] = value  # together with shard_batches
    else:
        job = _set(job, field, value)
    result = invoke(tmp_path, job)
    assert result.stderr.startswith(f"error: {named}: "), result.stderr
    assert words in result.stderr, result.stderr
    assert "hunter2-secret" not in result.output
    assert not out.exists()


def test_shard_size_must_be_a_multiple_of_batch_size(tmp_path):
    job = base_job(tmp_path / "out")
    del job["shard_batches"]
    job["shard_size"] = 3
    result = invoke(tmp_path, job)
    assert "error: shard_size: must be a multiple of batch_size (2), got 3" in result.stderr


def test_malformed_yaml_and_missing_file(tmp_path):
    result = invoke(tmp_path, "job_id: x\narms:\n  - {name: a, family: discrete_ar\n")
    assert "is not valid YAML at line" in result.stderr
    result = invoke(tmp_path, "- a\n- list\n")
    assert "must hold a mapping of fields, got list" in result.stderr
    missing = CliRunner().invoke(specray, ["run", str(tmp_path / "nope.yaml")])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr


@pytest.mark.parametrize("damage", ["garbage", "truncated", "header-length", "not-json", "empty"])
def test_corrupt_checkpoint_is_named(tmp_path, damage):
    weights = _preset_weights("digits-gpt-target").read_bytes()
    bad = tmp_path / f"{damage}.safetensors"
    bad.write_bytes({
        "garbage": b"this is not a safetensors file at all, just text" * 10,
        "truncated": weights[: len(weights) // 2],
        "header-length": struct.pack("<Q", 10**12) + weights[8:],
        "not-json": struct.pack("<Q", 16) + b"{not json......}" + weights[-64:],
        "empty": b"",
    }[damage])
    out = tmp_path / "out"
    result = invoke(tmp_path, _set(base_job(out), "arms[0].target", str(bad)))
    assert result.stderr.startswith(f"error: arms[0].target: checkpoint '{bad}' is not a valid safetensors file")
    expected = {"truncated": "truncated", "header-length": "does not fit the file", "not-json": "not JSON",
                "empty": "shorter than the 8-byte header", "garbage": "does not fit the file"}[damage]
    assert expected in result.stderr
    assert not out.exists()


def test_a_sound_checkpoint_passes_the_header_check(tmp_path):
    """Positive control: the preset's own weights file, given as a path, validates."""
    weights = _preset_weights("digits-gpt-target")
    assert safetensors_header_problem(weights) is None
    job = _set(base_job(tmp_path / "out"), "arms[0].target", str(weights))
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    result = CliRunner().invoke(specray, ["validate", str(path)])
    assert result.exit_code == 0 and result.stdout.startswith("ok: validation: 10 samples x 2 arms")


def test_output_with_a_file_in_the_way(tmp_path):
    blocker = tmp_path / "results"
    blocker.write_text("not a directory")
    result = invoke(tmp_path, base_job(blocker / "run"))
    assert result.stderr.startswith("error: output: ") and "is a file" in result.stderr
    assert blocker.read_text() == "not a directory"
    result = invoke(tmp_path, base_job(blocker))  # the output itself is a file
    assert result.stderr.startswith("error: output: ") and "is a file" in result.stderr


def test_output_in_a_missing_bucket(moto_server, tmp_path):
    result = invoke(tmp_path, base_job("s3://specray-no-such-bucket/runs/r1"))
    assert result.stderr.startswith("error: output: output 's3://specray-no-such-bucket/runs/r1' cannot be written")
    assert "bucket 'specray-no-such-bucket' does not exist" in result.stderr
    assert "specray-no-such-bucket" not in [b["Name"] for b in boto3_client(moto_server).list_buckets()["Buckets"]]


def test_s3_credentials_refused(s3_bucket, moto_auth, tmp_path, monkeypatch):
    """moto enforces IAM: the environment's keys are unknown (and then valid but without permission)."""
    uri = f"{s3_bucket}/runs/r1"
    result = invoke(tmp_path, base_job(uri))
    assert result.stderr.startswith(f"error: output: output {uri!r} cannot be written: S3 credentials refused "
                                    "(InvalidAccessKeyId)")
    assert "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY" in result.stderr
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", moto_auth.denied.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", moto_auth.denied.secret_access_key)
    result = invoke(tmp_path, base_job(uri))
    assert "S3 credentials refused: access denied" in result.stderr
    assert moto_auth.denied.secret_access_key not in result.output
    client = boto3_client(moto_auth.endpoint, aws_access_key_id=moto_auth.allowed.access_key_id,
                          aws_secret_access_key=moto_auth.allowed.secret_access_key)
    assert client.list_objects_v2(Bucket=s3_bucket[len("s3://"):]).get("KeyCount", 0) == 0  # nothing written


def test_overrides_are_validated_like_the_file(tmp_path):
    out = tmp_path / "out"
    result = invoke(tmp_path, base_job(out), "--batch-size", "0")
    assert result.stderr.startswith("error: batch_size: must be an integer >= 1, got 0")
    result = invoke(tmp_path, base_job(out), "--output", "ftp://host/run")
    assert result.stderr.startswith("error: output: unsupported URI scheme 'ftp'")
    assert not out.exists()


def test_every_error_names_a_field_the_spec_has(tmp_path):
    """The loader's field paths point at real keys (or the top level), so users can find them."""
    for _id, field, value, named, _words in CASES:
        job = base_job(tmp_path / "out")
        job = {**job, field: value} if field == "shard_size" else _set(job, field, value)
        with pytest.raises(SpecError) as info:
            load_job(job)
        assert info.value.field_path == named
    assert json.dumps(base_job(tmp_path / "x"))  # the base job itself is valid:
    load_job(base_job(tmp_path / "x"))
