"""Small things a user sees: plot names in the README, the Pareto plot's axis, the dataset card's metrics,
`specray compare`'s legend, `specray train --help`."""

from __future__ import annotations

import re
from pathlib import Path

from click.testing import CliRunner

from specray.cli import specray
from specray.eval.compare import compare_markdown
from specray.eval.plots import all_plots, pareto_xlabel
from specray.runtime.fs import redact

README = Path(__file__).resolve().parents[1] / "README.md"


def _report() -> dict:
    def arm(name, family, baseline, speed=None):
        return {"arm": name, "family": family, "method": "target_only" if speed is None else "sd", "baseline": baseline,
                "fid": {"value": 5.0, "ci": [4.0, 6.0]},
                "speedup": {"throughput_speedup": speed or 1.0, "throughput_ci": [0.9, 1.1]},
                "acceptance": {"acceptance_by_position": [0.5] if speed else [],
                               "accepted_length_histogram": {"counts": [1, 1] if speed else []},
                               "acceptance_timeline": [0.5] if speed else []}}

    return {"fid_setup": {"feature_extractor": "specray-digits"}, "seed_spread": [],
            "arms": [arm("target_only", "discrete_ar", "target_only"), arm("sd", "discrete_ar", "target_only", 1.2),
                     arm("mar_target_only", "continuous_ar", "mar_target_only"),
                     arm("mar_cspd", "continuous_ar", "mar_target_only", 1.5)]}


def test_readme_names_the_plot_files_the_report_writes():
    written = set(all_plots(_report()))
    assert written == {"pareto-discrete_ar.png", "pareto-continuous_ar.png", "acceptance-by-position.png",
                       "accepted-length.png", "acceptance-timeline.png"}
    tour = README.read_text().split("### A tour of the output", 1)[1].split("```")[1]
    named = set(re.findall(r"[\w<>-]+\.png", tour))
    assert {name.replace("<family>", "discrete_ar") for name in named} | {"pareto-continuous_ar.png"} >= written
    assert all(name.replace("<family>", "discrete_ar") in written | {"grid.png"} for name in named), named


def test_pareto_axis_names_each_familys_baseline():
    assert pareto_xlabel(_report(), "continuous_ar") == "throughput speedup over mar_target_only (95% CI)"
    assert pareto_xlabel(_report(), "discrete_ar") == "throughput speedup over target_only (95% CI)"


def test_dataset_card_metrics_per_token_are_not_taken_for_credentials():
    training = redact({"training": {"heldout_nll_nats_per_token": "3.21", "session_token": "abcd1234",
                                    "auth_token": "s3cr3t!", "num_tokens": 16}})["training"]
    assert training["heldout_nll_nats_per_token"] == "3.21" and training["num_tokens"] == 16
    assert training["session_token"] == training["auth_token"] == "<redacted>"


def _comparison(changed: bool) -> dict:
    metric = {"a": 1.0, "b": 2.0 if changed else 1.0, "diff": 1.0 if changed else 0.0, "changed": changed}
    from specray.eval.compare import METRICS

    return {"run_a": "a", "run_b": "b", "fid_setup_differs": {}, "only_in_a": [], "only_in_b": [],
            "arms": [{"arm": "sd", "metrics": {m: dict(metric) for m, *_ in METRICS}}],
            "changed": ["sd"] if changed else []}


def test_compare_prints_its_legend_only_when_a_row_is_flagged():
    assert "⚠" not in compare_markdown(_comparison(False))
    flagged = compare_markdown(_comparison(True))
    assert "⚠:" in flagged and "| sd |" in flagged


def test_train_help_lists_the_presets():
    from specray.models.presets.train import all_preset_names

    # Wide enough that click does not wrap a preset name at its hyphens.
    text = CliRunner().invoke(specray, ["train", "--help"], terminal_width=400, max_content_width=400).output
    assert all(name in text for name in all_preset_names()), text
