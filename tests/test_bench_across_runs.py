"""bench/across_runs.py's verdicts from the runs' reports: no timing here, only how the runs are combined."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.across_runs import (  # noqa: E402
    base_overheads,
    base_tracking,
    combine,
    interval_coverage,
    main,
    run_medians,
)


def arm(name: str, efficiency: float, own: tuple[float, float]) -> dict:
    return {"name": name, "clocks": {"cpu": {"efficiency": efficiency, "efficiency_interval": list(own)}}}


def report(arms: list[dict], gamma: int = 4, layout: str = "batches") -> dict:
    group = {"batch": 32, "arms": [arm("target_only", 1.0, (1.0, 1.0)), *arms]}
    if layout == "configs":
        group["num_steps"] = 100
    return {"target": "t", "draft": "d", "gamma": gamma, "device": "cpu", "machine": "m", "threads": 1,
            "torch": "2", "clock": "cpu", layout: [group]}


def five_runs(effs: dict[str, list[float]], own: dict[str, tuple[float, float]] | None = None,
              layout: str = "batches") -> dict[str, dict]:
    return {f"run{k}.json": report([arm(name, values[k], (own or {}).get(name, (values[k] - 0.01, values[k] + 0.01)))
                                    for name, values in effs.items()], layout=layout) for k in range(5)}


def test_five_runs_give_their_range_at_94_percent_and_a_verdict_against_the_threshold():
    # "fast": every run's own interval is wide (0.90-1.05): pooling those would leave it undecided.
    rows = combine(five_runs({"fast": [0.99, 0.96, 0.97, 0.98, 1.00], "slow": [0.90, 0.94, 0.91, 0.93, 0.92],
                              "near": [0.93, 0.97, 0.95, 0.94, 0.96]}, own={"fast": (0.90, 1.05)}), threshold=0.95)
    by_arm = {r.arm: r for r in rows}
    assert by_arm["fast"].within == pytest.approx((0.90, 1.05))
    assert set(by_arm) == {"fast", "slow", "near"}  # the base arm is not a speculative one
    assert by_arm["fast"].median == pytest.approx(0.98)
    assert by_arm["fast"].interval == pytest.approx((0.96, 1.00))
    assert [r.verdict for r in rows] == ["met", "under", "undecided"]
    assert by_arm["slow"].efficiencies == [0.90, 0.94, 0.91, 0.93, 0.92]  # in the order the runs were given
    assert by_arm["slow"].within == pytest.approx((0.89, 0.95))


def test_runs_each_sure_of_themselves_but_disagreeing_leave_the_verdict_undecided():
    # Every run's own interval is decisive (three well above 0.95, two well under): one run alone would settle it
    # either way; across the runs it is undecided.
    effs = [0.98, 0.91, 0.99, 0.92, 0.97]
    runs = {f"run{k}.json": report([arm("sd", e, (e - 0.005, e + 0.005))]) for k, e in enumerate(effs)}
    (row,) = combine(runs, threshold=0.95)
    assert row.verdict == "undecided"
    assert row.interval == pytest.approx((0.91, 0.99))
    assert row.median == pytest.approx(0.97)


def test_the_diffusion_layout_groups_by_steps_and_batch():
    rows = combine(five_runs({"token free": [0.96] * 5}, layout="configs"), threshold=0.95)
    assert [(r.group, r.arm, r.verdict) for r in rows] == [("K=100, batch 32", "token free", "met")]


def test_coverage_of_the_interval_by_the_number_of_runs():
    assert interval_coverage(5) == pytest.approx(1 - 2 / 32)  # the whole range of five
    assert interval_coverage(2) == pytest.approx(0.5)  # too few: the whole range, short of 90 %
    assert interval_coverage(15) == pytest.approx(1 - 2 * 576 / 2**15)  # the 4th to the 12th of fifteen


def test_reports_of_another_bench_or_machine_are_refused_by_file_and_field():
    runs = five_runs({"sd": [0.95] * 5})
    runs["run3.json"]["gamma"] = 7
    with pytest.raises(ValueError, match=r"run3\.json: 'gamma' is 7, but 4 in run0\.json"):
        combine(runs, threshold=0.95)


def test_a_report_without_an_arm_of_the_first_is_refused_by_name():
    runs = five_runs({"sd": [0.95] * 5, "block": [0.95] * 5})
    runs["run2.json"]["batches"][0]["arms"].pop()
    with pytest.raises(ValueError, match=r"run2\.json: no arm 'block' at batch 32"):
        combine(runs, threshold=0.95)


def test_a_report_without_the_arms_interval_is_refused_by_name():
    runs = five_runs({"sd": [0.95] * 5})
    del runs["run4.json"]["batches"][0]["arms"][1]["clocks"]["cpu"]["efficiency_interval"]
    with pytest.raises(ValueError, match=r"run4\.json: arm 'sd' at batch 32 has no efficiency and interval"):
        combine(runs, threshold=0.95)


def test_the_command_line_prints_the_table_and_exits_non_zero_on_a_bad_file(tmp_path, capsys):
    paths = []
    for name, rep in five_runs({"sd": [0.96, 0.97, 0.98, 0.96, 0.99]}).items():
        paths.append(tmp_path / name)
        paths[-1].write_text(json.dumps(rep))
    main([*map(str, paths), "--json", str(tmp_path / "across.json")])
    out = capsys.readouterr().out
    assert "runs 94%" in out and "0.960-0.990" in out and " met " in out
    assert json.loads((tmp_path / "across.json").read_text())["rows"][0]["verdict"] == "met"
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        main([str(paths[0]), str(tmp_path / "bad.json")])
    assert exit_info.value.code == 2
    assert "bad.json: cannot read a JSON report" in capsys.readouterr().err


def test_the_base_arms_overhead_is_shown_per_run_where_the_reports_have_it(tmp_path, capsys):
    runs = five_runs({"sd": [0.74, 0.83, 0.83, 0.84, 0.88]})
    for k, (name, rep) in enumerate(runs.items()):
        if k != 2:  # run 3's report lacks it
            rep["batches"][0]["arms"][0]["clocks"]["cpu"]["overhead"] = [1.05, 1.19, None, 1.24, 1.34][k]
        (tmp_path / name).write_text(json.dumps(rep))
    assert base_overheads(runs) == {"batch 32": [1.05, 1.19, None, 1.24, 1.34]}
    main([str(tmp_path / name) for name in runs] + ["--json", str(tmp_path / "across.json")])
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("(base ovh)")]
    assert line.split()[2:] == ["1.050", "1.190", "-", "1.240", "1.340"] and "# base ovh: target_only's time" in out
    assert json.loads((tmp_path / "across.json").read_text())["base_overheads"]["batch 32"][4] == 1.34


def test_each_runs_median_over_its_arms_and_its_rank_correlation_with_the_base(tmp_path, capsys):
    # Run medians over the three arms, sd's: 0.80, 0.86, 0.84, 0.90, 0.88 (ranks 1 3 2 5 4; "slow" pulls the means
    # 0.1 lower). Base ovh ranked 1 2 3 5 4: one swap of neighbouring ranks, so Spearman's rho over five runs is
    # 1 - 6 * 2 / (5 * 24) = 0.9.
    effs = {"sd": [0.80, 0.86, 0.84, 0.90, 0.88], "block": [0.82, 0.88, 0.86, 0.92, 0.90],
            "slow": [0.52, 0.58, 0.56, 0.62, 0.60]}
    runs = five_runs(effs)
    for k, rep in enumerate(runs.values()):
        rep["batches"][0]["arms"][0]["clocks"]["cpu"]["overhead"] = [1.05, 1.18, 1.20, 1.30, 1.25][k]
    assert base_tracking(base_overheads(runs), run_medians(combine(runs, 0.95))) == {"batch 32": pytest.approx(0.9)}
    for name, rep in runs.items():
        (tmp_path / name).write_text(json.dumps(rep))
    main([str(tmp_path / name) for name in runs] + ["--json", str(tmp_path / "across.json")])
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if line.startswith("(arms median)")]
    assert line.split()[2:] == ["0.800", "0.860", "0.840", "0.900", "0.880"]
    assert "rank correlation (Spearman) across the runs: batch 32 0.90" in out
    written = json.loads((tmp_path / "across.json").read_text())
    assert written["run_medians"]["batch 32"] == pytest.approx([0.80, 0.86, 0.84, 0.90, 0.88])
    assert written["base_rank_correlation"]["batch 32"] == pytest.approx(0.9)
    # Fewer than three runs with a base ovh, or a constant side, give no correlation rather than a made-up one.
    assert base_tracking({"batch 32": [1.1, None, None, None, 1.2]},
                         {"batch 32": [0.8, 0.9, 0.7, 0.6, 0.5]}) == {"batch 32": None}
    assert base_tracking({"batch 32": [1.1, 1.3, 1.2, 1.0, 1.4]}, {"batch 32": [0.8] * 5}) == {"batch 32": None}
    assert base_tracking({"batch 32": [1.1] * 5}, {"batch 32": [0.8, 0.9, 0.7, 0.6, 0.5]}) == {"batch 32": None}


@pytest.mark.parametrize("twice", [False, True])
def test_one_run_or_a_file_given_twice_is_refused(tmp_path, capsys, twice):
    path = tmp_path / "run0.json"
    path.write_text(json.dumps(five_runs({"sd": [0.96] * 5})["run0.json"]))
    with pytest.raises(SystemExit) as exit_info:
        main([str(path)] * (2 if twice else 1))
    assert exit_info.value.code == 2
    assert ("run0.json: given more than once" if twice else "at least two runs") in capsys.readouterr().err


# A family bench's stand-in for --run: it writes the report of run k (counted by the reports already in its folder),
# with its process id, and exits with FAIL_EXIT on run FAIL_RUN.
STAND_IN = """
import json, os, sys
from pathlib import Path
report = Path(sys.argv[sys.argv.index("--json") + 1])
k = len(list(report.parent.glob("run*.json")))
print("bench output of run", k + 1)
if k + 1 == int(os.environ.get("FAIL_RUN", "0")):
    sys.exit(int(os.environ["FAIL_EXIT"]))
effs = [float(e) for e in sys.argv[1].split(",")]
arms = [{"name": "target_only", "clocks": {"cpu": {"efficiency": 1.0, "efficiency_interval": [1.0, 1.0]}}},
        {"name": "sd", "clocks": {"cpu": {"efficiency": effs[k], "efficiency_interval": [effs[k] - 0.01, effs[k]]}}}]
report.write_text(json.dumps({"target": "t", "draft": "d", "gamma": 4, "device": "cpu", "machine": "m",
                              "threads": 1, "torch": "2", "clock": "cpu", "pid": os.getpid(),
                              "batches": [{"batch": 1, "arms": arms}]}))
"""


def test_run_makes_each_run_in_its_own_process_and_combines_their_reports(tmp_path, capsys):
    (tmp_path / "bench.py").write_text(STAND_IN)
    out = tmp_path / "runs"
    main(["--run", f"{sys.executable} {tmp_path / 'bench.py'} 0.97,0.99,0.96,0.98,1.00", "--out", str(out)])
    printed = capsys.readouterr()
    reports = [json.loads((out / f"run{k}.json").read_text()) for k in range(1, 6)]
    assert len({r["pid"] for r in reports}) == 5  # five processes
    effs = [r["batches"][0]["arms"][1]["clocks"]["cpu"]["efficiency"] for r in reports]
    assert effs == [0.97, 0.99, 0.96, 0.98, 1.0]
    assert (out / "run3.log").read_text() == "bench output of run 3\n"
    assert "0.970  0.990  0.960  0.980  1.000  0.980 0.960-1.000" in printed.out and " met " in printed.out
    assert "# run 5/5 took" in printed.err


def test_a_failing_run_stops_the_others_and_names_its_output(tmp_path, capsys, monkeypatch):
    (tmp_path / "bench.py").write_text(STAND_IN)
    monkeypatch.setenv("FAIL_RUN", "2")
    monkeypatch.setenv("FAIL_EXIT", "3")
    out = tmp_path / "runs"
    with pytest.raises(SystemExit) as exit_info:
        main(["--run", f"{sys.executable} {tmp_path / 'bench.py'} 0.97,0.99,0.96", "--runs", "3", "--out", str(out)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert f"run 2 of 3 exited with 3 and wrote no report; its output is in {out / 'run2.log'}" in err
    assert "bench output of run 2" in err
    assert not (out / "run3.log").exists()


@pytest.mark.parametrize("args, message", [
    (["--run", "python bench/diffusion.py --json x.json", "--out", "{tmp}/new"], "without --json"),
    (["--run", "python bench/diffusion.py --json=x.json", "--out", "{tmp}/new"], "without --json"),
    (["--run", "python bench/diffusion.py", "--out", "{tmp}/full"], "not an empty folder"),
    (["--run", "python bench/diffusion.py"], "--run needs --out"),
    (["--run", "python bench/diffusion.py", "--runs", "1", "--out", "{tmp}/new"], "--runs 1: make at least 2"),
    (["--run", "python 'bench", "--out", "{tmp}/new"], "cannot split"),
    (["{tmp}/full/run1.json", "{tmp}/full/run1.json", "--out", "{tmp}/new"], "--out and --runs go with --run"),
    (["{tmp}/full/run1.json", "--run", "python bench/diffusion.py", "--out", "{tmp}/new"], "either reports or --run"),
])
def test_run_refuses_what_would_mix_or_lose_reports(tmp_path, capsys, args, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "run1.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_info:
        main([a.format(tmp=tmp_path) for a in args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
