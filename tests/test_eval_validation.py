"""The job's ``eval:`` section is validated with the rest of the job, before any generation.

Each case is refused by ``specray validate`` (exit 2, the field path first) and by ``specray run``
before Ray starts, with nothing written; a sound ``eval:`` section with a real reference file passes.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from specray.cli import specray
from tests.test_validation import base_job, invoke


def _validate(tmp_path: Path, job: dict):
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return CliRunner().invoke(specray, ["validate", str(path)])


def _with_eval(tmp_path: Path, **fields) -> dict:
    job = base_job(tmp_path / "out")
    job["eval"] = {"fid": True, **fields}
    return job


def _npz(tmp_path: Path, **arrays) -> Path:
    path = tmp_path / "ref.npz"
    np.savez(path, **arrays)
    return path


CASES = {
    "misspelled option": ({"options": {"bootstrap_replicatse": 50}}, "eval.options.bootstrap_replicatse",
                          r"unknown reducer option; allowed: \[.*'bootstrap_replicates'"),
    "unknown feature extractor": ({"options": {"feature_extractor": "inception"}}, "eval.options.feature_extractor",
                                  "must be one of 'specray-digits', 'inception-v3-compat', got 'inception'$"),
    "missing reference file": ({"reference": "/nonexistent/imagenet256.npz"}, "eval.reference",
                               "npz reference '/nonexistent/imagenet256.npz' does not exist"),
    "reference of no known kind": ({"reference": "/nonexistent/stats.bin"}, "eval.reference",
                                   r"cannot tell what '/nonexistent/stats.bin' is; allowed: 'digits', 'npz:PATH'"),
    "missing inception weights": ({"options": {"feature_extractor": "inception-v3-compat",
                                               "inception_weights": "/nonexistent/pt_inception.pth"}},
                                  "eval.options.inception_weights", "'/nonexistent/pt_inception.pth' is not a file"),
    "unknown reducer device": ({"options": {"device": "gpu"}}, "eval.options.device",
                               "must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_eval_section_is_refused_by_validate_and_run(tmp_path, case):
    fields, field_path, words = CASES[case]
    job = _with_eval(tmp_path, **fields)
    result = _validate(tmp_path, job)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith(f"error: {field_path}: "), result.stderr
    assert re.search(words, result.stderr.strip()), result.stderr
    ran = invoke(tmp_path, job)  # specray run: exit 2 before Ray, nothing written
    assert ran.stderr.startswith(f"error: {field_path}: ")
    assert not (tmp_path / "out").exists()


def test_npz_reference_without_mu_and_sigma_is_refused(tmp_path):
    path = _npz(tmp_path, arr_0=np.zeros((2, 8, 8, 3), dtype=np.uint8))  # images only, no statistics
    result = _validate(tmp_path, _with_eval(tmp_path, reference=f"npz:{path}"))
    assert result.exit_code == 2
    assert result.stderr.startswith("error: eval.reference: ") and "lacks ['mu', 'sigma']" in result.stderr


def test_a_sound_eval_section_passes(tmp_path):
    path = _npz(tmp_path, mu=np.zeros(4), sigma=np.eye(4))
    result = _validate(tmp_path, _with_eval(tmp_path, reference=str(path),
                                            options={"device": "cuda:1", "bootstrap_replicates": 50}))
    assert result.exit_code == 0, result.output
    assert result.output.startswith("ok: validation:")
