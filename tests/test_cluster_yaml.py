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
    assert not any("-c constraints.txt" in cmd or "torch==" in cmd for cmd in config["setup_commands"])


def test_nodes_use_token_authentication_with_the_users_token():
    config = load()
    assert config["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [cmd for cmd in config[key] if "ray start" in cmd]
        assert starts and all(cmd.startswith("RAY_AUTH_MODE=token ray start") for cmd in starts), key


def test_the_example_jobs_actors_fit_a_gpu_node_type_that_starts_at_zero():
    """What `actors: auto` asks the autoscaler for (one bundle per actor) fits a worker type it can add."""
    from specray.runtime.coordinator import actor_bundle
    from specray.spec import load_job

    config = load()
    head = config["available_node_types"][config["head_node_type"]]
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    spec = load_job(CLUSTER_YAML.parent / "jobs" / "fid50k.yaml")
    bundle = actor_bundle(spec)
    assert bundle.get("GPU", 0) > 0, "the 50k evaluation asks for GPUs"
    assert not all(head["resources"].get(k, 0) >= v for k, v in bundle.items()), "actors must not land on the head"
    fits = [name for name, node in workers.items()
            if node["min_workers"] == 0 and node["max_workers"] > 0
            and all(node["resources"].get(k, 0) >= v for k, v in bundle.items())]
    assert fits, (bundle, workers)
