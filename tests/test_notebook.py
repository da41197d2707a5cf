"""notebooks/analysis.ipynb runs top to bottom on small synthetic runs (nbclient, python3 kernel), computes
each family's speedups against that family's baseline equal to report.json's, and draws one speed-quality
plane per family."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nbformat
import pytest
import torch

from specray.eval.reduce import reduce_run
from tests.eval_synthetic import demo_arms, standard_arms, write_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"
DUMP = "print('SUMMARY=' + summary[['baseline', 'throughput_speedup', 'nfe_ratio']].to_json(orient='index'))"


def _execute(run_dir: Path, cwd: Path, monkeypatch, extra_cell: str | None = None):
    from nbclient import NotebookClient

    monkeypatch.setenv("SPECRAY_RUN", str(run_dir))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    if extra_cell:
        notebook.cells.append(nbformat.v4.new_code_cell(extra_cell))
    NotebookClient(notebook, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(cwd)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    return outputs


def test_analysis_notebook_executes(tmp_path, monkeypatch):
    torch.set_num_threads(1)
    root = tmp_path / "run"
    write_run(str(root), standard_arms(), per_class=5, batch_size=10, shard_batches=2,
              eval_options={"plots": False})
    reduce_run(str(root), print_table=False)
    outputs = _execute(root, tmp_path, monkeypatch)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "rows, arms" in text
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    tables = [o for o in outputs if o.output_type == "execute_result" and "text/html" in o.get("data", {})]
    assert tables and "fid" in tables[-1]["data"]["text/html"] and "nfe_ratio" in tables[-1]["data"]["text/html"]
    assert len(images) >= 3  # acceptance plots, speed vs quality, the grid


@pytest.mark.slow
def test_notebook_speedups_equal_report_json_for_every_demo_arm(tmp_path, monkeypatch):
    """The demo's 19 arms (3 families, 3 baselines), 2 actors, 4 shards of 2 batches: warm-up batches dropped.

    Negative control in the same kernel: the old rule (one baseline for every family) gives other
    speedups than report.json for the continuous and diffusion arms.
    """
    torch.set_num_threads(1)
    root = tmp_path / "run"
    write_run(str(root), demo_arms(), per_class=8, batch_size=10, shard_batches=2, eval_options={"plots": False})
    report = reduce_run(str(root), print_table=False)
    one_baseline = ("baseline = {arm: 'target_only' for arm in arms}\n"
                    "summary['throughput_speedup'] = [throughput_speedup(a) for a in arms]\n" + DUMP)
    outputs = _execute(root, tmp_path, monkeypatch, DUMP + "\n" + one_baseline)
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    dumps = [json.loads(chunk.splitlines()[0]) for chunk in text.split("SUMMARY=")[1:]]
    summary, single = dumps
    assert set(summary) == {arm["arm"] for arm in report["arms"]}
    baselines = set()
    for arm in report["arms"]:
        mine = summary[arm["arm"]]
        assert mine["baseline"] == arm["baseline"], arm["arm"]
        assert math.isclose(mine["throughput_speedup"], arm["speedup"]["throughput_speedup"], rel_tol=1e-9), arm["arm"]
        assert math.isclose(mine["nfe_ratio"], arm["nfe_ratio"], rel_tol=1e-9), arm["arm"]
        baselines.add(arm["baseline"])
    # each model pair's own target_only: the EAGLE head's pair has target_only_eagle
    assert baselines == {"target_only", "target_only_eagle", "mar_target_only", "ddpm_target_only"}
    wrong = {a["arm"] for a in report["arms"]
             if not math.isclose(single[a["arm"]]["throughput_speedup"], a["speedup"]["throughput_speedup"],
                                 rel_tol=1e-6)}
    other_baseline = {a["arm"] for a in report["arms"] if a["baseline"] != "target_only"}
    assert {a["arm"] for a in report["arms"] if a["family"] != "discrete_ar"} <= wrong <= other_baseline
    # one speed-quality plane per family, its x-axis naming that family's baseline
    sources = "".join(cell.source for cell in nbformat.read(NOTEBOOK, as_version=4).cells)
    assert 'xlabel="throughput speedup over " + ", ".join(bases)' in sources
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    assert len(images) == 1 + 3 + 1  # acceptance plots, one plane per family, the grid
