"""Progress display, and a driver whose memory does not grow with the sample count.

The real 50k-sample run is ``bench/scale.py`` (too long for tests); here the same property is
checked on the fast fake family: a driver run in a subprocess at N and at 10 N samples, peak RSS
compared. The driver holds shard ranges and counters only, so the difference must stay within a
few MB (tolerance below), while a driver that kept rows or images would grow by megabytes per
thousand samples.
"""

from __future__ import annotations

import io
import json
import re
import statistics
import subprocess
import sys

import pytest

from specray.runtime.progress import Progress
from tests.test_runtime import REPO_ROOT


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_lines_in_logs_show_done_total_rate_eta_and_retries():
    stream = io.StringIO()  # not a terminal: plain lines, as in Ray job logs
    with Progress(200, already_done=40, log_interval_s=0.0, stream=stream) as progress:
        progress.advance(60)
        progress.retry()
        progress.advance(100)
    lines = stream.getvalue().splitlines()
    assert re.fullmatch(r"progress: 100/200 samples \(50\.0%\) \| [\d.]+ samples/s \| ETA [\d:]+ \| retries 0", lines[0])
    assert any(line.endswith("retries 1") and line.startswith("progress: 100/200") for line in lines)
    assert re.fullmatch(r"progress: 200/200 samples \(100\.0%\) \| [\d.]+ samples/s \| ETA 0:00:00 \| retries 1",
                        lines[-1])


def test_progress_log_interval_limits_the_lines():
    stream = io.StringIO()
    progress = Progress(100, log_interval_s=3600, stream=stream)
    for _ in range(10):
        progress.advance(5)
    assert stream.getvalue().count("\n") == 1  # the first line only; the next one is an hour away
    progress.close()
    assert stream.getvalue().splitlines()[-1].startswith("progress: 50/100 samples (50.0%)")


def test_progress_on_a_terminal_is_a_bar_with_rate_eta_and_retries():
    terminal = FakeTerminal()
    with Progress(100, already_done=10, stream=terminal) as progress:
        progress.retry()
        progress.advance(90)
    text = terminal.getvalue()
    assert "100/100" in text and "sample/s" in text and "retries=1" in text
    assert re.search(r"\[\d\d:\d\d<\d\d:\d\d", text)  # elapsed<remaining (the ETA)


def test_progress_disabled_prints_nothing():
    stream = io.StringIO()
    with Progress(10, enabled=False, stream=stream) as progress:
        progress.advance(10)
    assert stream.getvalue() == ""


DRIVER = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import ray
from tests import runtime_families as families
families.install()
ray.init(address="local", num_cpus=2, include_dashboard=False, configure_logging=False, runtime_env=families.ray_runtime_env())
from specray.runtime.coordinator import run_job
from specray.spec import load_job
result = run_job(load_job(json.loads({job!r})), show_progress=False)
print(json.dumps({{"rows": result.manifest["num_rows"], "tasks": result.tasks_run,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def driver_peak(tmp_path, per_class: int) -> dict:
    from tests import runtime_families as families

    arms = [{"name": "target_only", "method": "target_only"}, {"name": "fake_sd", "method": "fake_sd"}]
    job = families.job(families.FAULTY, tmp_path / f"run-{per_class}", arms, batch_size=50, shard_batches=2,
                       conditions={"kind": "class_labels", "per_class": per_class, "classes": "all"})
    script = DRIVER.format(root=str(REPO_ROOT), job=json.dumps(job))
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_driver_peak_memory_does_not_grow_with_samples(tmp_path):
    """N = 400 and 4000 samples (x 2 arms; 4 vs 40 shards), one driver process each; tolerance 25 MB.

    4000 samples x 2 arms of PNGs and rows would add far more than that if the driver kept them
    (rows are ~0.5 kB each as Python dicts before Parquet; the pixel tensors more).
    """
    small = driver_peak(tmp_path, 100)
    large = driver_peak(tmp_path, 1000)
    assert (small["rows"], large["rows"]) == (800, 8000) and large["tasks"] == 40
    assert large["peak_rss_mb"] - small["peak_rss_mb"] < 25.0, (small, large)


def test_scale_bench_counts_each_batch_once_per_arm_and_actor(tmp_path):
    """bench/scale.py's split of a run's time. Every row carries its batch's wall time: a sum over
    rows would give 20 times these figures, and keys without the actor would merge the two actors."""
    sys.path.insert(0, str(REPO_ROOT))
    from bench.scale import batch_seconds
    from tests.eval_synthetic import SyntheticArm, write_run

    # 200 samples in batches of 20, 2 shards of 5 batches, shard k on actor-k; walls as write_run makes them
    write_run(str(tmp_path), [SyntheticArm("target_only"), SyntheticArm("sd", method="sd", seconds_per_sample=0.004)],
              per_class=20, batch_size=20, shard_batches=5)
    walls = {arm: [per_sample * 20 * (1.0 + 0.05 * (b % 3)) for b in range(10)]
             for arm, per_sample in (("target_only", 0.01), ("sd", 0.004))}
    numbers = batch_seconds(str(tmp_path), 20)
    for arm, arm_walls in walls.items():
        assert numbers[arm]["batches"] == 10
        assert numbers[arm]["seconds"] == pytest.approx(sum(arm_walls))
        assert numbers[arm]["median_batch_s"] == pytest.approx(statistics.median(arm_walls))
    for k in range(2):
        expected = sum(w for arm_walls in walls.values() for w in arm_walls[5 * k: 5 * k + 5])
        assert numbers[f"actor:actor-{k}"]["seconds"] == pytest.approx(expected)
