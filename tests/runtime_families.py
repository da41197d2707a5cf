"""Test families for the runtime's fault and GPU-pinning tests, built on the fake family of test_runtime.

``faulty``: the fake family's sampler (images identical to its ``target_only``), plus

- ``sleep_s`` per batch, only inside a Ray actor, so shards last long enough to be killed
  mid-way while the in-process reference run stays fast;
- ``busy_dir``: while a batch runs, the file ``busy-<pid>`` exists there, so a test can
  SIGKILL exactly the workers that are in the middle of a shard;
- ``faults`` {sample_id: kind} with kind ``oom`` (torch.cuda.OutOfMemoryError), ``cuda``
  (RuntimeError "CUDA error: ...") or ``raise`` (an ordinary error), each raised for the first
  ``times`` attempts at the batch holding that sample (attempts counted in ``marker_dir``).

``gpuprobe``: models stay on the CPU (there is no CUDA here) but ``load_pair`` insists on being
given a CUDA device, and every row's ``extra_stats`` records the device it was given, the GPU
ids Ray assigned to the process and whether CUDA got initialised.

Ray workers install both through ``worker_process_setup_hook=tests.runtime_families.install``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from tests import test_runtime as base

FAULTY = "faulty"
GPUPROBE = "gpuprobe"
FAULT_KINDS = ("oom", "cuda", "raise")

_COMMON = {"sleep_s": 0.0, "busy_dir": ""}
_FAULTY_METHODS = {
    "target_only": dict(_COMMON),
    "fake_sd": {"gamma": 2, **_COMMON},
    "faulty": {**_COMMON, "marker_dir": "", "faults": {}, "times": 1},
}


def _inside_actor() -> bool:
    import ray

    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


class faulty:  # noqa: N801 - a module-like namespace: the registry imports it by "module" path
    METHODS = _FAULTY_METHODS

    @staticmethod
    def resolve_params(method: str, params: dict) -> dict:
        if method not in _FAULTY_METHODS:
            raise ValueError(f"unknown method {method!r}; allowed: {', '.join(_FAULTY_METHODS)}")
        unknown = set(params) - set(_FAULTY_METHODS[method])
        if unknown:
            raise ValueError(f"{sorted(unknown)[0]}: unknown parameter")
        merged = {**_FAULTY_METHODS[method], **params}
        for kind in merged.get("faults", {}).values():
            if kind not in FAULT_KINDS:
                raise ValueError(f"faults: kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        return merged

    @staticmethod
    def load_pair(target, draft, device):
        return base.load_pair(target, draft, device)

    @staticmethod
    def run_batch(method, params, pair, labels, sample_ids, seed):
        busy = Path(params["busy_dir"]) / f"busy-{os.getpid()}" if params["busy_dir"] else None
        if busy is not None:
            busy.write_text(",".join(map(str, sample_ids.tolist())))
        try:
            if params["sleep_s"] and _inside_actor():
                time.sleep(params["sleep_s"])
            if method == "faulty":
                _maybe_fault(params, sample_ids)
            inner = "fake_sd" if method == "fake_sd" else "target_only"
            return base.run_batch(inner, {"gamma": params["gamma"]} if "gamma" in params else {},
                                  pair, labels, sample_ids, seed)
        finally:
            if busy is not None:
                busy.unlink(missing_ok=True)


def _maybe_fault(params: dict, sample_ids: torch.Tensor) -> None:
    for key, kind in params["faults"].items():
        sid = int(key)
        if sid not in sample_ids.tolist():
            continue
        marker = Path(params["marker_dir"]) / f"attempts-{sid}"
        attempts = int(marker.read_text()) if marker.exists() else 0
        if attempts >= params["times"]:
            continue
        marker.write_text(str(attempts + 1))
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if kind == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        raise RuntimeError(f"injected failure at sample {sid}")


class gpuprobe:  # noqa: N801
    METHODS = {"target_only": {}}

    @staticmethod
    def resolve_params(method: str, params: dict) -> dict:
        return base.resolve_params(method, params)

    @staticmethod
    def load_pair(target, draft, device):
        import ray

        if device.type != "cuda":
            raise RuntimeError(f"gpuprobe expects the CUDA device Ray assigned, got {device}")
        pair = base.load_pair(target, draft, torch.device("cpu"))  # no CUDA on the test machine
        pair.info.update(assigned_device=str(device), gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                         cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
        return pair

    @staticmethod
    def run_batch(method, params, pair, labels, sample_ids, seed):
        time.sleep(0.2)  # long enough that every actor of the pool gets a shard
        result = base.run_batch(method, params, pair, labels, sample_ids, seed)
        for stats in result.stats:
            stats.extra = {**pair.info, "cuda_initialized": torch.cuda.is_initialized()}
        return result


def install() -> None:
    """Register the fake, faulty and gpuprobe families and their presets (driver and every worker)."""
    import sys

    from specray.methods import registry as loops
    from specray.models import registry as models
    from specray.models.presets import PRESETS, Preset

    base.install_fake_family()
    for family, namespace in ((FAULTY, faulty), (GPUPROBE, gpuprobe)):
        module_name = f"{__name__}.{family}"
        sys.modules[module_name] = namespace  # the registries import families by module name
        loops.FAMILY_LOOPS[family] = module_name
        models.FAMILY_MODELS[family] = module_name
        for name, role in ((f"{family}-target", "target"), (f"{family}-draft", "draft")):
            PRESETS.setdefault(name, Preset(name, family, role, {"num_classes": base.NUM_CLASSES}))


def uninstall() -> None:
    from specray.methods import registry as loops
    from specray.models import registry as models
    from specray.models.presets import PRESETS

    for family in (FAULTY, GPUPROBE):
        loops.FAMILY_LOOPS.pop(family, None)
        models.FAMILY_MODELS.pop(family, None)
        PRESETS.pop(f"{family}-target", None)
        PRESETS.pop(f"{family}-draft", None)
    base.uninstall_fake_family()


def ray_runtime_env() -> dict:
    """runtime_env that gives Ray workers this repo on sys.path and the test families."""
    root = str(Path(__file__).resolve().parents[1])
    return {"env_vars": {"PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])),
                         "OMP_NUM_THREADS": "1"},
            "worker_process_setup_hook": f"{__name__}.install"}


def job(family: str, output: Path, arms: list[dict], **fields) -> dict:
    """A job on ``family``'s presets (4 classes)."""
    spec = {"job_id": f"{family}-test", "seed": 7, "output": str(output),
            "conditions": {"kind": "class_labels", "per_class": 12, "classes": "all"},
            "batch_size": 4, "shard_batches": 2, "actors": 2, "eval": {"fid": False},
            "arms": [{"family": family, "target": f"{family}-target", "draft": f"{family}-draft", **arm}
                     for arm in arms]}
    spec.update(fields)
    return spec
