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
from typing import Literal

import torch

from specray.families import Family, Method, register_family, resolve, unregister_family
from specray.methods.params import Gamma, MethodParams
from tests import test_runtime as base

FAULTY = "faulty"
GPUPROBE = "gpuprobe"
FAULT_KINDS = ("oom", "cuda", "raise")

class _Common(MethodParams):
    sleep_s: float = 0.0
    busy_dir: str = ""


class FaultyTargetOnly(_Common):
    pass


class FaultySD(_Common):
    gamma: Gamma = 2


class Faulty(_Common):
    marker_dir: str = ""
    faults: dict[str, Literal["oom", "cuda", "raise"]] = {}
    times: int = 1


def _inside_actor() -> bool:
    import ray

    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


def faulty_run_batch(method, params, pair, labels, sample_ids, seed):
    method, params = resolve(FAULTY, method, params)
    busy = Path(params.busy_dir) / f"busy-{os.getpid()}" if params.busy_dir else None
    if busy is not None:
        busy.write_text(",".join(map(str, sample_ids.tolist())))
    try:
        if params.sleep_s and _inside_actor():
            time.sleep(params.sleep_s)
        if method.name == "faulty":
            _maybe_fault(params, sample_ids)
        inner = "fake_sd" if method.name == "fake_sd" else "target_only"
        return base.run_batch(inner, {"gamma": params.gamma} if inner == "fake_sd" else {},
                              pair, labels, sample_ids, seed)
    finally:
        if busy is not None:
            busy.unlink(missing_ok=True)


def _maybe_fault(params: Faulty, sample_ids: torch.Tensor) -> None:
    for key, kind in params.faults.items():
        sid = int(key)
        if sid not in sample_ids.tolist():
            continue
        marker = Path(params.marker_dir) / f"attempts-{sid}"
        attempts = int(marker.read_text()) if marker.exists() else 0
        if attempts >= params.times:
            continue
        marker.write_text(str(attempts + 1))
        if kind == "oom":
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        if kind == "cuda":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (injected)")
        raise RuntimeError(f"injected failure at sample {sid}")


def gpuprobe_load_pair(target, draft, device):
    import ray

    if device.type != "cuda":
        raise RuntimeError(f"gpuprobe expects the CUDA device Ray assigned, got {device}")
    pair = base.load_pair(target, draft, torch.device("cpu"))  # no CUDA on the test machine
    pair.info.update(assigned_device=str(device), gpu_ids=[str(g) for g in ray.get_gpu_ids()],
                     cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))
    return pair


def gpuprobe_run_batch(method, params, pair, labels, sample_ids, seed):
    time.sleep(0.2)  # long enough that every actor of the pool gets a shard
    result = base.run_batch("target_only", {}, pair, labels, sample_ids, seed)
    for stats in result.stats:
        stats.extra = {**pair.info, "cuda_initialized": torch.cuda.is_initialized()}
    return result


FAMILIES = (
    Family(name=FAULTY, summary="the fake sampler with injected faults and sleeps",
           methods={"target_only": Method("target_only", FaultyTargetOnly), "fake_sd": Method("fake_sd", FaultySD),
                    "faulty": Method("faulty", Faulty)},
           loop=lambda: faulty_run_batch, load_pair=lambda: base.load_pair, trainer=lambda: None),
    Family(name=GPUPROBE, summary="records the device and GPU ids Ray assigned",
           methods={"target_only": Method("target_only", base.FakeTargetOnly)},
           loop=lambda: gpuprobe_run_batch, load_pair=lambda: gpuprobe_load_pair, trainer=lambda: None),
)


def install() -> None:
    """Register the fake, faulty and gpuprobe families and their presets (driver and every worker)."""
    from specray.models.presets import PRESETS, Preset

    base.install_fake_family()
    for entry in FAMILIES:
        register_family(entry)
        for name, role in ((f"{entry.name}-target", "target"), (f"{entry.name}-draft", "draft")):
            PRESETS.setdefault(name, Preset(name, entry.name, role, {"num_classes": base.NUM_CLASSES}))


def uninstall() -> None:
    from specray.models.presets import PRESETS

    for entry in FAMILIES:
        unregister_family(entry.name)
        PRESETS.pop(f"{entry.name}-target", None)
        PRESETS.pop(f"{entry.name}-draft", None)
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
