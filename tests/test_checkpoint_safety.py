"""Release checkpoints are read safely and strictly: a missing key, an extra key, a wrong shape, a
truncated file or a pickle that would run code is refused with a named error, and nothing is written."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specray.cli import main
from specray.families import format_options
from specray.models.checkpoints.convert import convert
from specray.models.checkpoints.llamagen import load, read_gpt_state
from specray.models.checkpoints.reading import CheckpointError
from specray.spec import SpecError, load_job
from tests.checkpoint_fixtures import FIXTURES, llamagen_target

TINY = FIXTURES / "llamagen" / "c2i_tiny.pt"


def tiny_state() -> dict[str, torch.Tensor]:
    return torch.load(TINY, weights_only=True)["model"]


def load_gpt(path: Path):
    return load(format_options("discrete_ar", llamagen_target(path=str(path), tokenizer=None)), "cpu")


def job(tmp_path: Path, target: dict) -> dict:
    return {"job_id": "bad", "output": str(tmp_path / "run"), "conditions": {"per_class": 2, "classes": [0]},
            "batch_size": 1, "max_shard_retries": 0,
            "arms": [{"name": "t", "family": "discrete_ar", "method": "target_only", "target": target}]}


class WritesFile:
    """Unpickling this runs code (creates a file): what a malicious checkpoint does."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_pickle_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    sentinel = tmp_path / "pwned"
    bad = tmp_path / "evil.pt"
    torch.save({"model": tiny_state(), "payload": WritesFile(str(sentinel))}, bad)
    with pytest.raises(CheckpointError) as info:
        load_gpt(bad)
    assert "specray convert" in str(info.value) and str(bad) in str(info.value)
    with pytest.raises(CheckpointError):  # convert refuses it too unless told the file is trusted
        convert(bad, tmp_path / "out.safetensors")
    assert not sentinel.exists()
    assert not (tmp_path / "out.safetensors").exists()


@pytest.mark.parametrize("change,words", [
    ("missing", "missing key(s) 'layers.1.ffn_norm.weight'"),
    ("extra", "unexpected key(s) 'layers.2.attention.wqkv.weight'"),
    ("shape", "key 'output.weight' has shape (63, 32), the model expects (64, 32)"),
])
def test_key_mismatches_are_refused_by_name(tmp_path, change, words):
    state = tiny_state()
    if change == "missing":
        del state["layers.1.ffn_norm.weight"]
    elif change == "extra":
        state["layers.2.attention.wqkv.weight"] = torch.zeros(96, 32)
    else:
        state["output.weight"] = state["output.weight"][:63]
    path = tmp_path / "c2i.pt"
    torch.save({"model": state}, path)
    with pytest.raises(CheckpointError) as info:
        load_gpt(path)
    assert words in str(info.value), str(info.value)


def test_compiled_prefix_is_stripped_and_stored_dtype_upcast(tmp_path):
    state = {"_orig_mod." + k: v.to(torch.bfloat16) for k, v in tiny_state().items()}
    path = tmp_path / "c2i.pt"
    torch.save({"model": state}, path)
    model = load_gpt(path).gpt
    assert model.output.weight.dtype == torch.float32
    assert torch.equal(model.output.weight, tiny_state()["output.weight"].to(torch.bfloat16).float())


def test_truncated_file_is_refused_at_spec_time_and_by_the_loader(tmp_path):
    path = tmp_path / "c2i.pt"
    path.write_bytes(TINY.read_bytes()[: TINY.stat().st_size // 2])
    with pytest.raises(SpecError) as info:
        load_job(job(tmp_path, llamagen_target(path=str(path))))
    assert info.value.field_path == "arms[0].target.path" and "truncated or corrupt" in str(info.value)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):  # the loader alone refuses it too
        read_gpt_state(path)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("field,value,words", [
    ("path", "missing.pt", "does not exist"),
    ("size", "GPT-XS", "must be one of 'GPT-B'"),
    ("arch", None, "is required with size 'custom'"),
    ("dtype", "float64", "must be one of 'float32', 'bfloat16', 'float16'"),
    ("tokenzier", "x", "unknown option"),
])
def test_bad_reference_fields_are_named_at_spec_time(tmp_path, field, value, words):
    target = llamagen_target(**{field: value})
    with pytest.raises(SpecError) as info:
        load_job(job(tmp_path, target))
    assert info.value.field_path == f"arms[0].target.{field}" and words in str(info.value), str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_run_with_a_mismatched_checkpoint_fails_and_commits_nothing(tmp_path):
    """The key check needs the tensors, so it happens in the actor: the job fails (exit 1) with the
    loader's message and no shard or manifest is written."""
    state = tiny_state()
    del state["norm.weight"]
    path = tmp_path / "c2i.pt"
    torch.save({"model": state}, path)
    import yaml

    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job(tmp_path, llamagen_target(path=str(path)))))
    proc = subprocess.run([sys.executable, "-m", "specray.cli", "run", str(job_file), "--num-cpus", "1", "--quiet",
                           "--no-reduce"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "missing key(s) 'norm.weight'" in proc.stderr
    assert not list((tmp_path / "run").rglob("*.parquet")) and not (tmp_path / "run" / "_manifest.json").exists()


def test_convert_writes_safetensors_with_config_that_loads_identically(tmp_path, capsys):
    source = tmp_path / "checkpoint.pth"
    torch.save({"model": tiny_state(), "args": argparse.Namespace(gpt_model="GPT-B", image_size=384), "epoch": 3},
               source)
    dest = tmp_path / "c2i.safetensors"
    main_args = ["convert", str(source), str(dest), "--entry", "model"]
    with pytest.raises(SystemExit) as exit_info:
        main(main_args)
    assert exit_info.value.code in (0, None)
    from safetensors import safe_open

    with safe_open(str(dest), framework="pt") as f:
        meta = f.metadata()
    assert meta["entry"] == "model" and '"image_size": 384' in meta["config"]
    a, b = load_gpt(TINY).gpt, load_gpt(dest).gpt
    labels, tokens = torch.tensor([1, 2]), torch.randint(0, 64, (2, 16))
    assert torch.equal(a(labels, tokens), b(labels, tokens))
