"""Job spec loading and validation: every bad field is named, before Ray starts."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import yaml

from specray.spec import SpecError, builtin_demo_dict, builtin_demo_job, load_job
from tests.test_runtime import FAKE_FAMILY, fake_job, install_fake_family, uninstall_fake_family


@pytest.fixture(autouse=True, scope="module")
def fake_family():
    install_fake_family()
    yield
    uninstall_fake_family()


def _with(job: dict, path: str, value) -> dict:
    """A copy of ``job`` with the field at a dotted path (``arms[1].params.gamma``) set or deleted."""
    job = copy.deepcopy(job)
    parts = [p for chunk in path.split(".") for p in chunk.replace("]", "").split("[")]
    node = job
    for part in parts[:-1]:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    last = parts[-1]
    if value is _DELETE:
        del node[last]
    elif isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return job


_DELETE = object()

BAD_FIELDS = [
    # (field path to change, bad value, expected field path in the error, words the message must contain)
    ("arms[1].family", "nope", "arms[1].family", "allowed: "),
    ("arms[1].method", "medusa", "arms[1].method", "allowed: target_only, fake_sd"),
    ("arms[1].name", "target_only", "arms[1].name", "duplicate arm name"),
    ("arms[1].params.gamma", 0, "arms[1].params.gamma", "must be an integer in [1, 64], got 0"),
    ("arms[1].params.gamma", "four", "arms[1].params.gamma", "integer"),
    ("arms[1].target", "no-such-model", "arms[1].target", "unknown preset 'no-such-model'"),
    ("arms[1].draft", "no-such-draft", "arms[1].draft", "built-in presets are"),
    ("arms[1].target", "digits-features", "arms[1].target", "belongs to family"),
    ("arms[1].target", "/nonexistent/model.safetensors", "arms[1].target", "does not exist"),
    ("arms[0].colour", "red", "arms[0].colour", "unknown field"),
    ("arms", [], "arms", "non-empty list"),
    ("arms", _DELETE, "arms", "required"),
    ("conditions.per_class", 0, "conditions.per_class", "integer >= 1, got 0"),
    ("conditions.per_class", -3, "conditions.per_class", "integer >= 1"),
    ("conditions.classes", [0, 4], "conditions.classes[1]", "out of range; allowed: 0..3"),
    ("conditions.classes", [1, 1], "conditions.classes[1]", "listed twice"),
    ("conditions.classes", "some", "conditions.classes", '"all" or a non-empty list'),
    ("conditions.kind", "captions", "conditions.kind", "allowed: class_labels, prompts"),
    ("batch_size", 0, "batch_size", "integer >= 1, got 0"),
    ("batch_size", 2.5, "batch_size", "integer >= 1"),
    ("shard_batches", 0, "shard_batches", "integer >= 1"),
    ("shard_size", 6, "shard_size", "give either shard_batches or shard_size"),
    ("actors", 0, "actors", '"auto" or an integer >= 1'),
    ("actors", "many", "actors", '"auto" or an integer >= 1'),
    ("num_gpus_per_actor", -1, "num_gpus_per_actor", "number >= 0"),
    ("num_gpus_per_actor", 1.5, "num_gpus_per_actor", "fraction"),
    ("max_shard_retries", -1, "max_shard_retries", "integer >= 0"),
    ("seed", -1, "seed", "integer >= 0"),
    ("job_id", "bad id!", "job_id", "letters, digits"),
    ("output", "ftp://host/x", "output", "unsupported URI scheme 'ftp'"),
    ("eval.baseline", "nope", "eval.baseline", "allowed: target_only, fake_sd"),
    ("eval.fid", "yes", "eval.fid", "true or false"),
    ("colour", "red", "colour", "unknown field; allowed: "),
]


@pytest.mark.parametrize("path,value,field_path,words", BAD_FIELDS, ids=[f"{c[0]}={c[1]!r}" for c in BAD_FIELDS])
def test_bad_fields_are_named(tmp_path, path, value, field_path, words):
    job = _with(fake_job(tmp_path / "out"), path, value)
    with pytest.raises(SpecError) as info:
        load_job(job)
    assert info.value.field_path == field_path
    assert str(info.value).startswith(f"{field_path}: ")
    assert words in str(info.value)
    assert not (tmp_path / "out").exists()


def test_shard_size_must_be_a_multiple_of_batch_size(tmp_path):
    job = fake_job(tmp_path / "out")
    del job["shard_batches"]
    with pytest.raises(SpecError, match=r"^shard_size: must be a multiple of batch_size \(4\), got 6"):
        load_job({**job, "shard_size": 6})
    assert load_job({**job, "shard_size": 12}).shard_batches == 3


def test_unwritable_output_is_refused(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SpecError, match="^output: .* is a file"):
        load_job(fake_job(blocker / "run"))
    if os.geteuid() != 0:  # root may write anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(SpecError, match="^output: .*no write permission"):
            load_job(fake_job(locked / "run"))


def test_malformed_yaml_names_the_line(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("job_id: x\narms: [\n  - {name: a\n")
    with pytest.raises(SpecError, match=r"not valid YAML at line \d+"):
        load_job(path)
    path.write_text("- just\n- a list\n")
    with pytest.raises(SpecError, match="must hold a mapping"):
        load_job(path)
    with pytest.raises(SpecError, match="does not exist"):
        load_job(tmp_path / "missing.yaml")


def test_valid_job_resolves_defaults_classes_and_groups(tmp_path):
    job = fake_job(tmp_path / "out")
    job["arms"][0]["params"] = None
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    spec = load_job(path)
    assert spec.conditions.classes == (0, 1, 2, 3) and spec.num_samples == 24
    assert spec.arm("fake_sd").params == {"gamma": 3} and spec.arm("target_only").params == {}
    assert spec.eval.baseline == "target_only"  # the target_only arm by default
    assert [len(arms) for _key, arms in spec.arm_groups()] == [2]
    assert spec.shard_size == 8
    # Round trip: the stored spec loads to the same spec.
    assert load_job(spec.to_dict()) == spec


def test_overrides_are_validated_too(tmp_path):
    job = fake_job(tmp_path / "out")
    spec = load_job(job, output=str(tmp_path / "other"), per_class=2, actors=1)
    assert spec.output == str(tmp_path / "other") and spec.num_samples == 8 and spec.actors == 1
    with pytest.raises(SpecError, match="^conditions.per_class:"):
        load_job(job, per_class=0)


def test_fingerprint_tracks_what_determines_samples(tmp_path):
    base = load_job(fake_job(tmp_path / "a"))
    same = [fake_job(tmp_path / "b"), fake_job(tmp_path / "a", actors=1, shard_batches=3, max_shard_retries=9),
            fake_job(tmp_path / "a", num_cpus_per_actor=1.5)]  # still one thread
    for job in same:
        assert load_job(job).fingerprint() == base.fingerprint()
    changed = [
        fake_job(tmp_path / "a", seed=8),
        fake_job(tmp_path / "a", batch_size=8),
        _with(fake_job(tmp_path / "a"), "arms[1].params.gamma", 2),
        _with(fake_job(tmp_path / "a"), "conditions.per_class", 5),
        _with(fake_job(tmp_path / "a"), "arms[1].name", "renamed"),
        fake_job(tmp_path / "a", num_cpus_per_actor=2),  # two threads on a CPU: other sums
    ]
    for job in changed:
        assert load_job(job).fingerprint() != base.fingerprint()


def test_arms_of_different_pairs_form_separate_groups(tmp_path):
    job = fake_job(tmp_path / "out")
    job["arms"].append({"name": "no_draft", "family": FAKE_FAMILY, "method": "target_only", "target": "fake-target"})
    spec = load_job(job)
    groups = spec.arm_groups()
    assert [key for key, _ in groups] == [(FAKE_FAMILY, "fake-target", "fake-draft"), (FAKE_FAMILY, "fake-target", None)]
    assert [a.name for a in groups[0][1]] == ["target_only", "fake_sd"]


def test_builtin_demo_has_every_method_of_the_three_families():
    data = builtin_demo_dict()
    methods = {(a["family"], a["method"]) for a in data["arms"]}
    discrete = {("discrete_ar", m) for m in ("target_only", "sd", "block", "lantern", "cool_sd", "uniform_rsd")}
    assert discrete <= methods
    assert {("continuous_ar", "target_only"), ("continuous_ar", "cspd"),
            ("diffusion", "target_only"), ("diffusion", "spec_block")} <= methods
    assert data["output"] == "runs/demo" and data["conditions"]["per_class"] == 100
    spec = builtin_demo_job()
    assert spec.num_samples == 1000
    # Every arm group (model pair) has a target_only arm: each arm is timed on the same actor as its baseline.
    assert {key[0] for key, _ in spec.arm_groups()} == {"discrete_ar", "continuous_ar", "diffusion"}
    for _, arms in spec.arm_groups():
        assert any(a.method == "target_only" for a in arms)
    # The COOL-SD paper's comparison on one EAGLE head: Eagle-1 (sd), LANTERN++ and COOL-SD, on a tree.
    head_arms = {a.method for a in spec.arms if a.draft == "digits-gpt-eagle" and a.params.get("tree")}
    assert {"sd", "lantern", "cool_sd"} <= head_arms
    # The actors parse each arm's stored params again: every arm's must parse to themselves.
    from specray.families import family as family_table

    for arm in spec.arms:
        assert family_table(arm.family).parse_params(arm.method, arm.params).to_dict() == arm.params, arm.name
    # Each family has target_only replicas at other seeds for the FID seed spread.
    for family in ("discrete_ar", "continuous_ar", "diffusion"):
        offsets = {a.seed_offset for a in spec.arms if a.family == family and a.method == "target_only"}
        assert len(offsets) >= 3


def test_example_jobs_validate():
    jobs = sorted((Path(__file__).resolve().parents[1] / "jobs").glob("*.yaml"))
    assert jobs, "jobs/*.yaml missing"
    for path in jobs:
        try:
            load_job(path)
        except SpecError as exc:
            raise AssertionError(f"{path.name}: {exc}") from None


def test_the_demo_is_defined_once_in_the_package():
    from specray.spec import DEMO_PATH

    assert DEMO_PATH.parent == Path(__import__("specray").__file__).parent
    assert yaml.safe_load(DEMO_PATH.read_text()) == builtin_demo_dict()
    assert not (Path(__file__).resolve().parents[1] / "jobs" / "demo.yaml").exists()
