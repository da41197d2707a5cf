"""notebooks/analysis.ipynb runs top to bottom on a small synthetic run (nbclient, python3 kernel)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import torch

from specray.eval.reduce import reduce_run
from tests.eval_synthetic import standard_arms, write_run

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "analysis.ipynb"


def test_analysis_notebook_executes(tmp_path, monkeypatch):
    from nbclient import NotebookClient

    torch.set_num_threads(1)
    root = tmp_path / "run"
    write_run(str(root), standard_arms(), per_class=5, batch_size=10, shard_batches=2,
              eval_options={"plots": False})
    reduce_run(str(root), print_table=False)
    monkeypatch.setenv("SPECRAY_RUN", str(root))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "rows, arms" in text
    images = [o for o in outputs if o.output_type == "display_data" and "image/png" in o.get("data", {})]
    tables = [o for o in outputs if o.output_type == "execute_result" and "text/html" in o.get("data", {})]
    assert tables and "fid" in tables[-1]["data"]["text/html"] and "nfe_ratio" in tables[-1]["data"]["text/html"]
    assert len(images) >= 3  # acceptance plots, speed vs quality, the grid
