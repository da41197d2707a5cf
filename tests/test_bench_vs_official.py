"""bench/vs_official.py and tools/make_reference_fixtures.py import the official code from a copy outside
the repository; without it they stop at once and say how to get it (no timing here)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _official_code_module():
    spec = importlib.util.spec_from_file_location("official_code", REPO / "tools" / "official_code.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_without_official_code_says_where_it_looked_and_how_to_get_it(tmp_path):
    root = tmp_path / "no-official-here"
    env = {"PYTHONPATH": str(REPO), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1",
           "SPECRAY_OFFICIAL": str(root)}  # the default location comes from the environment
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "vs_official.py"), "--quick"], capture_output=True,
                          text=True, timeout=120, cwd=REPO, env=env)
    assert proc.returncode != 0
    message = proc.stderr
    assert f"not found at {root / 'LlamaGen'}" in message
    assert "git clone https://github.com/FoundationVision/LlamaGen" in message
    assert "git clone https://github.com/LTH14/mar" in message
    assert f"--official {root}" in message and "SPECRAY_OFFICIAL" in message
    assert "Traceback" not in message


def test_a_partial_copy_names_the_missing_files(tmp_path):
    official_code = _official_code_module()
    (tmp_path / "mar" / "models").mkdir(parents=True)
    (tmp_path / "mar" / "models" / "mar.py").write_text("")
    with pytest.raises(SystemExit) as failure:
        official_code.import_official(tmp_path, "mar")
    message = str(failure.value)
    assert "models/diffloss.py" in message and "diffusion/respace.py" in message
    assert "models/mar.py" not in message.split("missing")[1].split("\n")[0]
    assert str(tmp_path / "mar") not in sys.path


def test_the_table_gives_each_ratio_with_its_interval(capsys):
    sys.path.insert(0, str(REPO))
    from bench.vs_official import Row, print_table

    row = Row("llamagen", 1, "cpu")
    row.official_s, row.specray_s = [2.0] * 5, [1.0, 0.8, 1.0, 2.5, 1.6]
    row.ratios = {"cpu": [2.0, 2.5, 2.0, 0.8, 1.25], "wall": [2.0] * 5}
    assert row.ratio() == 2.0
    assert row.interval() == (0.8, 2.5)  # five repetitions: their whole range
    assert row.interval("wall") == (2.0, 2.0)
    print_table([row])
    line = capsys.readouterr().out.splitlines()[2]
    assert line.split()[4:7] == ["2.00x", "0.80-2.50", "2.00x"]
