"""A job on a cluster that cannot place its actors yet waits, says so, asks the autoscaler, and completes
when a node arrives: a ``ray.cluster_utils.Cluster`` head with 0 CPUs (as ``cluster.yaml``'s head, which
runs only the driver), ``actors: auto``, and a worker node added after the job started."""

from __future__ import annotations

import json
import logging
import threading
import time

import pytest

from specray.spec import load_job
from tests import runtime_families as families
from tests.test_runtime import images_by_key

pytestmark = pytest.mark.slow

ARMS = [{"name": "target_only", "method": "target_only"}, {"name": "fake_sd", "method": "fake_sd", "params": {"gamma": 3}}]


def test_job_waits_for_a_node_and_completes_when_it_arrives(tmp_path, caplog):
    import ray
    from ray.autoscaler._private.constants import AUTOSCALER_RESOURCE_REQUEST_CHANNEL
    from ray.autoscaler.v2.utils import is_autoscaler_v2
    from ray.cluster_utils import Cluster
    from ray.experimental.internal_kv import _internal_kv_get

    from specray.runtime.coordinator import run_job

    families.install()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        ray.init(address=cluster.address, runtime_env=families.ray_runtime_env(), configure_logging=False)
        spec = load_job(families.job(families.FAULTY, tmp_path / "run", ARMS, actors="auto"))
        outcome: dict = {}

        def run() -> None:
            try:
                outcome["result"] = run_job(spec, show_progress=False)
            except BaseException as exc:  # noqa: BLE001  (reported by the main thread)
                outcome["error"] = exc

        caplog.set_level(logging.INFO, logger="specray.runtime")
        driver = threading.Thread(target=run, daemon=True)
        driver.start()
        deadline = time.monotonic() + 60
        while "waiting for the cluster" not in caplog.text:
            assert driver.is_alive() and time.monotonic() < deadline, (outcome, caplog.text)
            time.sleep(0.5)
        # the job asked the autoscaler for one {CPU: 1} bundle per actor, and nothing ran yet
        assert "asked the autoscaler for 6 x {'CPU': 1.0}" in caplog.text
        if not is_autoscaler_v2():  # v1 keeps the request in the GCS key-value store
            assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == [{"CPU": 1.0}] * 6
        assert not (tmp_path / "run" / "samples").exists()
        waiting = next(r.getMessage() for r in caplog.records if "waiting for the cluster" in r.getMessage())
        assert waiting.startswith("waiting for the cluster: 0 of 6 generation actors placed, 6 wait for a node "
                                  "with {'CPU': 1.0} free"), waiting

        cluster.add_node(num_cpus=2)
        driver.join(timeout=240)
        assert not driver.is_alive(), "the job did not finish after the node arrived"
        assert "error" not in outcome, outcome.get("error")
        result = outcome["result"]
        assert result.manifest["num_rows"] == 2 * 48 and result.retries == 0
        assert len(images_by_key(tmp_path / "run")) == 2 * 48
        if not is_autoscaler_v2():
            assert json.loads(_internal_kv_get(AUTOSCALER_RESOURCE_REQUEST_CHANNEL)) == []  # request withdrawn
    finally:
        ray.shutdown()
        cluster.shutdown()
