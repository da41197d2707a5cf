"""bench/gpu.py runs in its --quick CPU mode and reports every cost, ratio and predicted speedup."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from specray.runtime.hardware import device_name

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gpu_bench_quick_mode(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu.py"), "--quick", "--reps", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["quick"] and result["device"] == "cpu" and [r["batch"] for r in result["rows"]] == [1, 2]
    assert result["device_name"] == device_name("cpu")
    for row in result["rows"]:
        assert {"GPT-XL/1", "GPT-XL/5", "GPT-B/1", "MAR-H/1", "MAR-H/32", "MAR-B/1", "DDPM-CIFAR10/7",
                "DiT-XL-2/7"} <= set(row["costs_s"])
        assert set(row["predicted_speedup"]) == {"llamagen_lantern++", "llamagen_cool_sd_1.1", "llamagen_cool_sd_2",
                                                 "mar_cspd_g32", "DDPM-CIFAR10_block_free", "DDPM-CIFAR10_block_frozen",
                                                 "DiT-XL-2_block_free", "DiT-XL-2_block_frozen"}
        values = list(row["costs_s"].values()) + list(row["ratios"].values()) + list(row["predicted_speedup"].values())
        assert all(math.isfinite(v) and v > 0 for v in values)
