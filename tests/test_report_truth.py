"""What the report tells the user: the end-of-run table fits 100 columns, intervals that rest on too
few batches or samples say so, each lossless arm is judged against the target_only of the law it
claims (and the report names it), and CSpD's resample cap hits are counted per arm.

Synthetic runs (real digits images, tests/eval_synthetic.py) reduced by the real reducer.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specray.eval.reduce import MIN_SPEEDUP_PAIRS, reduce_run
from specray.eval.report import SUMMARY_WIDTH, format_table
from tests.eval_synthetic import SyntheticArm, demo_arms, write_run

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def demo_like(tmp_path_factory) -> tuple[str, dict]:
    """The demo's 19 arms at 50 samples each, 5 batches of 10, one batch per shard."""
    root = str(tmp_path_factory.mktemp("demo-like"))
    write_run(root, demo_arms(), per_class=5, batch_size=10, shard_batches=1, eval_options={"plots": False})
    return root, reduce_run(root, print_table=False)


def test_end_of_run_table_fits_100_columns_and_marks_thin_intervals(demo_like):
    _, report = demo_like
    text = format_table(report)
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= SUMMARY_WIDTH, text
    rows = lines[2:21]
    for row, arm in zip(rows, report["arms"]):  # each row is its arm; a name too long to fit ends in '…'
        shown = row.split()[0]
        assert shown == arm["arm"] or shown.endswith("…") and arm["arm"].startswith(shown[:-1]), row
    assert "FID [95% CI]" in lines[0] and "speedup [95% CI]" in lines[0] and "latency" not in text
    # 50 samples of 64-dim features and 5 paired batches per arm: both intervals are marked and explained
    assert all(row.count(" !") >= 2 for row in rows[1:]), text  # FID and speedup (the baseline's own FID row too)
    assert "!: too few batches or samples" in text


def test_long_arm_names_are_cut_to_fit(demo_like):
    _, report = demo_like
    renamed = {**report, "arms": [{**arm, "arm": arm["arm"] + "_with_a_very_long_descriptive_suffix_" * 2}
                                  for arm in report["arms"]]}
    text = format_table(renamed)
    assert max(len(line) for line in text.splitlines()) <= SUMMARY_WIDTH
    assert "…" in text


def test_few_samples_and_few_batches_are_warned_in_report_json_and_md(demo_like):
    root, report = demo_like
    arm = next(a for a in report["arms"] if a["arm"] == "sd")
    assert arm["fid"]["warning"].startswith("FID from 50 samples of 64-dim features; below 64 its covariance is "
                                            "singular")
    assert arm["speedup"]["num_pairs"] == 5 < MIN_SPEEDUP_PAIRS
    assert arm["speedup"]["warning"].startswith("interval from 5 paired batches")
    md = (Path(root) / "report" / "report.md").read_text()
    assert "- ! `sd` FID: FID from 50 samples" in md and "- ! `sd` speedup: interval from 5 paired batches" in md


def test_one_batch_gives_no_interval(tmp_path):
    root = str(tmp_path / "run")
    arms = [SyntheticArm("target_only"), SyntheticArm("sd", method="sd", params={"gamma": 4}, image_offset=300,
                                                      accepted_per_position=[6, 4, 2, 1], spec_steps=8)]
    write_run(root, arms, per_class=13, batch_size=130, shard_batches=1, eval_options={"plots": False})
    report = reduce_run(root, print_table=False)
    sd = report["arms"][1]
    assert sd["speedup"]["num_pairs"] == 1 and sd["speedup"]["warning"].startswith("1 paired batch: no interval")
    assert sd["fid"]["warning"] is None  # 130 samples >= 2 x 64
    row = next(line for line in format_table(report).splitlines() if line.startswith("sd "))
    assert row.count("[") == 1 and " ! " in row or row.endswith(" !"), row  # FID has its interval, speedup none


def test_lossless_arms_are_judged_against_the_target_only_of_their_law(demo_like):
    root, report = demo_like
    arms = {a["arm"]: a for a in report["arms"]}
    # exact CSpD samples the final head step with noise: its law is target_only with final_step_noise true
    for name in ("mar_cspd_exact", "mar_cspd_exact_sequential"):
        assert arms[name]["claimed_law"]["final_step_noise"] is True
        assert arms[name]["law_baseline"] == "mar_target_only"
        assert arms[name]["fid"]["diff_vs_baseline"]["baseline"] == "mar_target_only"
        assert arms[name]["fid"]["seed_spread"]["group"] == "mar_target_only"
    assert "one parallel step" in arms["mar_cspd_exact"]["law_note"]
    assert arms["mar_cspd_exact_sequential"]["law_note"] is None
    assert arms["mar_cspd_paper"]["claimed_law"] is None and arms["mar_cspd_paper"]["fid"]["seed_spread"] is None
    assert arms["sd"]["law_baseline"] == "target_only" and arms["ddpm_block_model"]["law_baseline"] == "ddpm_target_only"
    assert arms["lantern"]["claimed_law"] is None  # relaxed: no verdict, the difference is for scale only
    assert arms["lantern"]["fid"]["diff_vs_baseline"]["same_law"] is False
    md = (Path(root) / "report" / "report.md").read_text()
    assert "- `mar_cspd_exact`: FID − `mar_target_only`, the target_only of the law it claims = " in md
    assert "`lantern`: FID − `target_only` (no exactness claimed: for scale only)" in md


def test_no_verdict_against_a_target_only_of_another_law(tmp_path):
    """Negative control: with only a target_only without final-step noise, exact CSpD gets no verdict."""
    root = str(tmp_path / "run")
    arms = [SyntheticArm("mar_target_only", family="continuous_ar"),
            SyntheticArm("mar_target_only_seed1", family="continuous_ar", params={"seed_offset": 1}, image_offset=300),
            SyntheticArm("mar_cspd_exact", method="cspd", family="continuous_ar", params={"mode": "exact"},
                         image_offset=600, accepted_per_position=[3, 2, 1, 0], spec_steps=5,
                         extra={"resampled_tokens": 7, "resample_cap_hits": 2})]
    write_run(root, arms, per_class=13, batch_size=26, shard_batches=2, eval_options={"plots": False})
    report = reduce_run(root, print_table=False)
    exact = report["arms"][2]
    assert exact["claimed_law"]["final_step_noise"] is True and exact["law_baseline"] is None
    assert exact["fid"]["diff_vs_baseline"] is None and exact["fid"]["seed_spread"] is None
    assert report["seed_spread"][0]["lossless_arms"] == {}
    md = (Path(root) / "report" / "report.md").read_text()
    assert ("`mar_cspd_exact` claims target_only's law with order=random, temperature=1.0, cfg=1.0, "
            "cfg_schedule=constant, sample_steps=None, clip_denoised=True, final_step_noise=True, but this run has "
            "no target_only arm with those parameters: no lossless verdict") in md
    assert "no law match" in format_table(report)


def test_resample_cap_hits_are_counted_per_arm(demo_like):
    root, report = demo_like
    arms = {a["arm"]: a for a in report["arms"]}
    # 50 samples x (10 resampled, 1 or 2 cap hits) per CSpD arm (demo_arms alternates the hits by arm index)
    for name in ("mar_cspd_exact", "mar_cspd_exact_sequential", "mar_cspd_paper"):
        resampling = arms[name]["resampling"]
        assert resampling["resampled_tokens"] == 500
        assert resampling["resample_cap_hits"] in (50, 100)
        assert resampling["cap_hit_rate"] == resampling["resample_cap_hits"] / 500
    assert arms["sd"]["resampling"] is None
    md = (Path(root) / "report" / "report.md").read_text()
    hits = arms["mar_cspd_paper"]["resampling"]["resample_cap_hits"]
    assert f"- `mar_cspd_paper`: 500 tokens resampled; the 100-try cap was hit {hits} times" in md
