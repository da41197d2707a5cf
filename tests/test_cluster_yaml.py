"""cluster.yaml validates against the autoscaler schema that ships with Ray."""

from pathlib import Path

import yaml
from ray.autoscaler._private.util import validate_config

CLUSTER_YAML = Path(__file__).resolve().parents[1] / "cluster.yaml"


def load():
    return yaml.safe_load(CLUSTER_YAML.read_text())


def test_cluster_yaml_matches_ray_schema():
    validate_config(load())  # raises jsonschema.ValidationError on any schema violation


def test_cluster_has_gpu_workers_and_private_dashboard():
    config = load()
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    assert workers and all("InstanceType" in v["node_config"] for v in workers.values())
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}
    head_cmds = " ".join(config["head_start_ray_commands"])
    assert "--dashboard-host=127.0.0.1" in head_cmds and "0.0.0.0" not in head_cmds
    assert any("specray" in cmd for cmd in config["setup_commands"])
