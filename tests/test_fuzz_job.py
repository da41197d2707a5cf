"""Fuzzing the job loader with hypothesis: random YAML text, random YAML documents and random values
in every field of a valid job. The loader either accepts the job or raises SpecError; it never
crashes with another exception, never takes more than ``MAX_S`` per input, every refusal names a
field (or, for a file that is not a YAML mapping, the file), and no refusal echoes a secret written
as URL credentials or under a credential key.

Seeded (``derandomize``) so CI sees the same inputs every run; no example database is written.
"""

from __future__ import annotations

import copy
import math
import os
import time
from datetime import date
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specray.spec import _TOP_LEVEL, SpecError, load_job
from tests.test_validation import base_job

MAX_S = 5.0  # per input, on a loaded 2-core machine; typical inputs take milliseconds
SECRET = "fuzzSECRETvalue0123456789"
# SPECRAY_FUZZ_EXAMPLES=5000 runs a longer, random (not derandomized) search by hand.
_EXAMPLES = int(os.environ.get("SPECRAY_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_EXAMPLES or 150, deadline=None, derandomize=not _EXAMPLES, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


def check(source, where: str | None = None) -> None:
    """Load ``source``: accepted, or a SpecError that names a field (or the file) and hides the secret."""
    began = time.monotonic()
    try:
        load_job(source)
    except SpecError as exc:
        message = str(exc)
        assert SECRET not in message, message
        if exc.field_path:
            assert message.startswith(f"{exc.field_path}: ")
            root = exc.field_path.split(".")[0].split("[")[0]
            if root not in _TOP_LEVEL:  # then it names the key it refuses
                assert "unknown field" in message or "keys must be strings" in message, message
        else:  # only the file as a whole has no field: it must say which file
            assert where is not None and message.startswith(f"job file {where!r}"), message
    elapsed = time.monotonic() - began
    assert elapsed < MAX_S, f"{elapsed:.1f} s"


# ---------------------------------------------------------------- random text and documents

yaml_text = st.one_of(
    st.text(max_size=400),
    st.lists(st.sampled_from(["job_id: ", "output: ", "arms:", "\n", "  - ", "{", "}", "[", "]", "&a ", "*a ", "<<: ",
                              "!!python/object:os.system ", "!!binary ", "!!set ", "? ", ": ", "'", '"', "#", "---",
                              "seed: ", "9" * 50, "1e400", ".nan", "2026-02-30", "~", "conditions: ",
                              "s3://k:pw@b/x", "digits-gpt-target", "discrete_ar", "\t", "\\"]),
             max_size=60).map("".join),
)


@FUZZ
@given(text=yaml_text)
def test_random_yaml_text_never_crashes(tmp_path_factory, text):
    path = Path(tmp_path_factory.mktemp("fuzz")) / "job.yaml"
    path.write_text(text)
    check(str(path), where=str(path))


scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.integers(min_value=-(2**80), max_value=2**80),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=30),
                    st.sampled_from(["auto", "all", "sd", "target_only", "digits-gpt-target", "", "x\n",
                                     f"s3://AKIA:{SECRET}@bucket/run", f"http://u:{SECRET}@h:9/"]))
documents = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                          st.dictionaries(st.text(max_size=12), inner, max_size=4)),
                         max_leaves=25)


@FUZZ
@given(document=st.dictionaries(st.sampled_from(sorted(_TOP_LEVEL) + ["extra", "job"]), documents, max_size=8))
def test_random_documents_never_crash(tmp_path_factory, document):
    path = Path(tmp_path_factory.mktemp("fuzz")) / "job.yaml"
    path.write_text(yaml.safe_dump(document, allow_unicode=True))
    check(str(path), where=str(path))


# ---------------------------------------------------------------- random values in every field

FIELDS = ["job_id", "seed", "output", "batch_size", "shard_batches", "shard_size", "actors", "num_cpus_per_actor",
          "num_gpus_per_actor", "max_shard_retries", "conditions", "conditions.kind", "conditions.per_class",
          "conditions.classes", "arms", "arms[0]", "arms[1].name", "arms[1].family", "arms[1].method",
          "arms[1].target", "arms[1].draft", "arms[1].params", "arms[1].params.gamma", "arms[1].params.temperature",
          "arms[0].seed_offset", "eval", "eval.fid", "eval.baseline", "eval.reference", "eval.options",
          "storage_options", "storage_options.endpoint_url", "storage_options.config_kwargs", "dataset",
          "dataset.partition", "dataset.date", "dataset.run_id"]

values = st.one_of(documents, st.dates().map(lambda d: d), st.just(date(2026, 11, 30)),
                   st.sampled_from([0, -1, 1, 2**63, 10**9, 10**30, 1e308, float("inf"), float("nan"), True, [], {},
                                    [3, 3], [10], "cool_sd", "diffusion", "digits-ddpm", "/nonexistent/x.pt",
                                    "/tmp", {"gamma": 0}, {"key": SECRET}, {"format": "nope"}]))


def _set(job: dict, path: str, value) -> dict:
    job = copy.deepcopy(job)
    parts = [p for chunk in path.split(".") for p in chunk.replace("]", "").split("[")]
    node = job
    for part in parts:  # a path through a value the first mutation replaced is left alone
        if isinstance(node, list) != part.isdigit() or (isinstance(node, list) and int(part) >= len(node)):
            return job
        if part is parts[-1]:
            break
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
        if not isinstance(node, (dict, list)):
            return job
    if isinstance(node, list):
        node[int(parts[-1])] = value
    else:
        node[parts[-1]] = value
    return job


@FUZZ
@given(field=st.sampled_from(FIELDS), value=values, second=st.sampled_from(FIELDS), other=values)
def test_random_field_values_are_accepted_or_refused_by_field(tmp_path_factory, field, value, second, other):
    out = Path(tmp_path_factory.mktemp("fuzz")) / "out"
    job = _set(_set(base_job(out), field, value), second, other)
    check(job)
    assert not out.exists()  # validation writes nothing


def test_the_fuzzed_base_job_is_valid(tmp_path):
    """Positive control: the job the field fuzzer starts from loads, so its refusals come from the values."""
    spec = load_job(base_job(tmp_path / "out"))
    assert spec.num_samples == 10 and not math.isnan(spec.num_cpus_per_actor)


@pytest.mark.parametrize("text", ["job_id: [1, *undefined]\n", "a: &x 1\nb: *x\n" * 2, "- 1\n- 2\n", "1e400\n"])
def test_a_few_fixed_oddities(tmp_path, text):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    check(str(path), where=str(path))
