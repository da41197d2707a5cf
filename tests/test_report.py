"""The report: report.md tables and plots, seed-to-seed spread, latency at batch 1, accepted-length histogram,
regenerate, and comparing two runs."""

from __future__ import annotations

import io
import json

import pytest
import torch
from PIL import Image

from specray.eval.accumulate import AcceptanceTotals
from specray.eval.compare import compare_markdown, compare_runs
from specray.eval.reduce import reduce_run
from specray.eval.report import regenerate
from tests.eval_synthetic import SyntheticArm, standard_arms, write_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory) -> tuple[str, dict]:
    """5 arms x 200 samples (per_class 20, batch 20): target_only + 2 seed replicas (other digits), a lossless
    sd arm (other digits, 2.5x faster per sample), a lantern arm of uniform noise."""
    root = str(tmp_path_factory.mktemp("run"))
    write_run(root, standard_arms())
    return root, reduce_run(root, print_table=False)


def test_report_files_and_tables(reduced):
    root, report = reduced
    from pathlib import Path

    out = Path(root) / "report"
    md = (out / "report.md").read_text()
    assert "## discrete_ar" in md
    for column in ("FID [95% CI]", "IS", "mean acc. length", "acc. rate", "speedup [95% CI]", "NFE ratio [95% CI]"):
        assert column in md
    for png in ("pareto-discrete_ar.png", "acceptance-by-position.png", "accepted-length.png",
                "acceptance-timeline.png", "grid.png"):
        image = Image.open(io.BytesIO((out / png).read_bytes()))
        assert image.size[0] > 300 and image.size[1] > 150, png
        assert f"({png})" in md
    on_disk = json.loads((out / "report.json").read_text())
    arms = {a["arm"]: a for a in on_disk["arms"]}
    sd = arms["sd"]
    # 64 tokens / 16 target calls; paired bootstrap NFE interval around 4 (constant per-sample calls: exact)
    assert sd["nfe_ratio"] == pytest.approx(4.0) and sd["nfe_ratio_ci"] == pytest.approx([4.0, 4.0])
    # throughput: every sd batch is 0.004/0.01 of target_only's wall time -> 2.5x
    assert sd["speedup"]["throughput_speedup"] == pytest.approx(2.5)
    assert sd["speedup"]["latency"]["available"] is False and "batch size 1" in sd["speedup"]["latency"]["reason"]
    # per sample 16 rounds, positions accepted [12, 9, 6, 3] -> lengths 0..4: [4, 3, 3, 3, 3]; x 200 samples
    assert sd["acceptance"]["accepted_length_histogram"] == {"counts": [800, 600, 600, 600, 600], "exact": True}
    assert sd["acceptance"]["acceptance_timeline"] == pytest.approx([0.75, 0.5, 0.25, 0.125])
    assert on_disk["checks"]["passed"] and on_disk["checks"]["num_samples_per_arm"] == 200
    assert arms["sd"]["inception_score"]["mean"] > 2 * arms["noisy"]["inception_score"]["mean"]


def test_seed_spread_and_within_noise(reduced):
    """target_only at 3 seeds (3 disjoint sets of 200 digits): the lossless sd arm (a 4th set) lies within
    2 sd of their mean; the noise arm is lossy so it gets no seed-spread verdict but is outside bootstrap noise."""
    _, report = reduced
    (spread,) = report["seed_spread"]
    assert spread["arms"] == ["target_only", "target_only_s1", "target_only_s2"]
    assert spread["seed_offsets"] == [0, 1, 2] and spread["num_seeds"] == 3 and spread["sd"] > 0
    arms = {a["arm"]: a for a in report["arms"]}
    assert arms["sd"]["fid"]["seed_spread"]["within"] is True
    assert "noisy" not in spread["lossless_arms"]
    assert arms["noisy"]["fid"]["diff_vs_baseline"]["within_noise"] is False
    assert arms["sd"]["fid"]["diff_vs_baseline"]["within_noise"] is True


def test_seed_spread_negative_control(tmp_path):
    """A 'lossless' sd arm made of uniform noise is outside the seed spread."""
    import numpy as np

    noise = np.random.default_rng(1).integers(0, 256, size=(100, 8, 8), dtype=np.uint8)
    arms = [SyntheticArm("target_only"), SyntheticArm("s1", params={"seed_offset": 1}, image_offset=300),
            SyntheticArm("sd", method="sd", images=noise, accepted_per_position=[1], spec_steps=64)]
    write_run(str(tmp_path), arms, per_class=10, batch_size=10, shard_batches=5, eval_options={"isc": False})
    report = reduce_run(str(tmp_path), print_table=False)
    verdict = {a["arm"]: a for a in report["arms"]}["sd"]["fid"]["seed_spread"]
    assert verdict["within"] is False and verdict["num_seeds"] == 2


def test_latency_speedup_at_batch_one(tmp_path):
    """batch_size 1: per-sample latencies paired by (actor, shard, sample_id); sd is 2.5x faster per sample.
    First sample of each shard is warm-up (dropped): 40 samples, 4 shards -> 36 pairs."""
    arms = [SyntheticArm("target_only", seconds_per_sample=0.01),
            SyntheticArm("sd", method="sd", image_offset=100, seconds_per_sample=0.004, accepted_per_position=[8],
                         spec_steps=32)]
    write_run(str(tmp_path), arms, per_class=4, batch_size=1, shard_batches=10,
              eval_options={"isc": False, "plots": False})
    report = reduce_run(str(tmp_path), print_table=False)
    latency = {a["arm"]: a for a in report["arms"]}["sd"]["speedup"]["latency"]
    assert latency["available"] and latency["num_pairs"] == 36 and latency["warmup_dropped"]
    assert latency["speedup"] == pytest.approx(2.5) and latency["median_ratio"] == pytest.approx(2.5)
    assert latency["ci"][0] <= 2.5 <= latency["ci"][1]


def test_accepted_length_histogram_derivation():
    """Per-round accepted lengths [0, 2, 4, 4, 1] with gamma 4 -> positions accepted [4, 3, 2, 2]; derived counts
    match the true per-round histogram. Negative control: non-prefix counters are flagged inexact."""
    totals = AcceptanceTotals(num_spec_steps=5, accepted_per_position=[4, 3, 2, 2])
    assert totals.accepted_length_histogram == {"counts": [1, 1, 1, 0, 2], "exact": True}
    bad = AcceptanceTotals(num_spec_steps=5, accepted_per_position=[1, 3, 2, 2])
    assert bad.accepted_length_histogram["exact"] is False


def test_regenerate_and_compare(reduced, tmp_path):
    root, report = reduced
    from pathlib import Path

    (Path(root) / "report" / "report.md").unlink()
    (Path(root) / "report" / "grid.png").unlink()
    again = regenerate(root)
    assert (Path(root) / "report" / "report.md").exists() and (Path(root) / "report" / "grid.png").exists()
    assert again["arms"][0]["fid"]["value"] == report["arms"][0]["fid"]["value"]

    # tonight's run: the sd arm regressed to noise
    import numpy as np

    arms = standard_arms()
    arms[3].images = np.random.default_rng(9).integers(0, 256, size=(200, 8, 8), dtype=np.uint8)
    other = str(tmp_path / "tonight")
    write_run(other, arms)
    reduce_run(other, print_table=False)
    comparison = compare_runs(root, other)
    assert comparison["changed"] == ["sd"]
    assert comparison["arms"][3]["metrics"]["fid"]["changed"] is True
    assert comparison["arms"][3]["metrics"]["fid"]["diff"] > 100
    md = compare_markdown(comparison)
    assert "| sd |" in md and "⚠" in md
