"""docs/extending.md, exercised: a toy method and a toy checkpoint format added through the public
contract only.

The toy is a discrete-family method with its own verification rule: it drafts gamma tokens and
rejects every one of them, so each token comes from the target's own distribution at the
position (lossless, and never faster). It is registered with ``specray.families.register_method``
in this process and, through Ray's ``worker_process_setup_hook``, in every actor; nothing else
(no module path, no ``sys.modules`` entry, no edit of specray) is needed for the spec to validate
it, the actors to run it and the reducer to read its ``lossless`` flag.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar

import pyarrow.parquet as pq
import pytest
import ray
import torch
from pydantic import model_validator

from specray import rng
from specray.families import (
    Method,
    ModelFormat,
    load_pair,
    register_format,
    register_method,
    unregister_format,
    unregister_method,
)
from specray.methods.discrete.params import Speculative
from specray.methods.discrete.rules import VerifyOutput
from specray.methods.params import ParamError, StrictParams
from specray.spec import SpecError, load_job

REPO_ROOT = Path(__file__).resolve().parents[1]


class RejectAll(Speculative):
    """Drafts gamma tokens and rejects them all; the next token is drawn from the target."""

    rule: ClassVar[str] = "reject_all"

    @property
    def lossless(self) -> bool:
        return True


def reject_all_rule(params: RejectAll, pair):
    """The rule factory the family table names: one verify function per run."""

    def verify(P, Q, drafts, u_accept, u_residual) -> VerifyOutput:
        rejected = torch.zeros(P.shape[0], dtype=torch.int64, device=P.device)
        next_token = rng.sample_categorical(P[:, 0].double(), u_residual)
        return VerifyOutput(rejected, next_token, torch.zeros_like(drafts, dtype=torch.bool))

    return verify


TOY = Method("reject_all", RejectAll, rule=lambda: reject_all_rule, summary="rejects every draft (a toy)")


def install() -> None:
    """Registers the toy; runs in the test process and, as Ray's setup hook, in every worker."""
    register_method("discrete_ar", TOY)


@pytest.fixture(scope="module")
def toy():
    install()
    yield TOY
    unregister_method("discrete_ar", TOY.name)


def _job(output: Path, **params) -> dict:
    models = {"family": "discrete_ar", "target": "digits-gpt-target", "draft": "digits-gpt-draft"}
    return {"job_id": "toy", "seed": 3, "output": str(output), "batch_size": 5, "shard_batches": 1, "actors": 1,
            "conditions": {"kind": "class_labels", "per_class": 1, "classes": "all"},
            "arms": [{"name": "target_only", "method": "target_only", **models},
                     {"name": "toy", "method": "reject_all", **models, "params": params}],
            "eval": {"fid": False}}


def test_the_toy_is_unknown_until_registered(tmp_path):
    with pytest.raises(SpecError, match=r"^arms\[1\]\.method: unknown method 'reject_all' for family 'discrete_ar'"):
        load_job(_job(tmp_path / "run"))


def test_its_parameters_are_validated_by_its_class(toy, tmp_path):
    spec = load_job(_job(tmp_path / "run", gamma=3))
    assert spec.arm("toy").params["gamma"] == 3
    with pytest.raises(SpecError, match=r"^arms\[1\]\.params\.gamma: must be an integer in \[1, 64\], got 0$"):
        load_job(_job(tmp_path / "run", gamma=0))
    with pytest.raises(SpecError, match=r"^arms\[1\]\.params\.budget: unknown parameter"):
        load_job(_job(tmp_path / "run", budget=1))


def test_the_runtime_runs_it_and_the_reducer_reads_its_flag(toy, tmp_path):
    from specray.eval.noise import is_lossless
    from specray.runtime.coordinator import run_job

    spec = load_job(_job(tmp_path / "run", gamma=3))
    paths = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    ray.init(address="local", num_cpus=1, include_dashboard=False, configure_logging=False,
             runtime_env={"env_vars": {"PYTHONPATH": paths, "OMP_NUM_THREADS": "1"},
                          "worker_process_setup_hook": f"{__name__}.install"})
    try:
        result = run_job(spec, show_progress=False)
    finally:
        ray.shutdown()
    assert result.manifest["num_rows"] == 20
    rows = pq.read_table(tmp_path / "run" / "samples" / "toy").to_pylist()
    assert len(rows) == 10 and {r["method"] for r in rows} == {"reject_all"}
    for row in rows:  # every draft rejected: one target call per token after the first
        assert row["num_accepted_draft_tokens"] == 0 and row["num_draft_tokens"] > 0
        assert row["target_calls"] == row["num_tokens"] and row["accepted_per_position"] == [0, 0, 0]
    assert is_lossless("discrete_ar", "reject_all", spec.arm("toy").params)
    assert not is_lossless("discrete_ar", "cool_sd", {"delta": 2.0})


# ---- a checkpoint format ------------------------------------------------------------------------


class PresetWeights(StrictParams):
    """A toy format: a built-in preset's weights file, named by its path."""

    path: str

    @model_validator(mode="after")
    def _exists(self) -> "PresetWeights":
        if not Path(self.path).is_file():
            raise ParamError("path", f"{self.path!r} does not exist; give a preset's .safetensors file")
        return self


def load_preset_weights(options: PresetWeights, device):
    from specray.models.discrete_ar import load_model

    return load_model(options.path, device)


@pytest.fixture
def toy_format():
    entry = register_format("discrete_ar", ModelFormat("preset-weights", PresetWeights, lambda: load_preset_weights))
    yield entry
    unregister_format("discrete_ar", entry.name)


def test_a_format_is_validated_at_spec_time_and_loaded_by_its_loader(toy_format, tmp_path):
    from specray.models.presets import get_preset

    weights = str(get_preset("digits-gpt-target").weights_path)
    job = _job(tmp_path / "run")
    job["arms"][0]["target"] = {"format": "preset-weights", "path": weights}
    job["conditions"]["classes"] = [0, 1, 2]  # a formatted model does not say how many classes it has
    spec = load_job(job)
    assert spec.arm("target_only").target == {"format": "preset-weights", "path": weights}
    assert spec.arm("target_only").target_key.startswith('{"format":"preset-weights"')
    for bad, field, words in [({"format": "nope"}, "target.format", "unknown model format 'nope'"),
                              ({"format": "preset-weights"}, "target.path", "must be"),
                              ({"format": "preset-weights", "path": str(tmp_path)}, "target.path", "does not exist"),
                              ({"format": "preset-weights", "path": weights, "size": 1}, "target.size", "unknown")]:
        job["arms"][0]["target"] = bad
        with pytest.raises(SpecError) as info:
            load_job(job)
        assert info.value.field_path == f"arms[0].{field}" and words in str(info.value), str(info.value)

    from specray.methods.discrete.loop import run_batch

    labels, ids = torch.tensor([0, 2]), torch.tensor([4, 5])
    by_format = load_pair("discrete_ar", {"format": "preset-weights", "path": weights}, None, "cpu")
    by_name = load_pair("discrete_ar", "digits-gpt-target", None, "cpu")
    assert torch.equal(run_batch("target_only", {}, by_format, labels, ids, 1).images,
                       run_batch("target_only", {}, by_name, labels, ids, 1).images)
