"""The generation actor: holds model pairs on its device, runs arms on shards, commits Parquet.

:class:`ShardWorker` is a plain class (usable in-process, e.g. by benchmarks);
:data:`GenerationActor` is the same class as a Ray actor. The coordinator sets
``num_cpus``/``num_gpus`` through ``.options(...)``; the worker places models on
the GPU Ray assigned, reads that GPU's name for the manifest (where CUDA is available), and touches
CUDA nowhere else.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import numpy as np
import ray
import torch

import specray
from specray.families import FAMILIES, Method, resolve
from specray.methods.common import GenerationResult
from specray.methods.params import MethodParams
from specray.models.pair import ModelPair
from specray.models.refs import ref_from_key
from specray.runtime.hardware import device_name
from specray.runtime.heap import keep_freed_memory
from specray.runtime.images import image_cell
from specray.runtime.plan import ShardPlan, ShardTask, shard_relpath
from specray.runtime.store import RunStore, ShardIdentity, rows_to_table
from specray.spec import ArmSpec, JobSpec

log = logging.getLogger(__name__)


def assigned_device() -> torch.device:
    """``cuda:N`` for the GPU Ray assigned to this worker, else CPU.

    Ray restricts ``CUDA_VISIBLE_DEVICES`` to the assigned GPUs, so the
    assigned id's position in that list is its CUDA index here.
    """
    gpu_ids = _ray_gpu_ids()
    if not gpu_ids:
        return torch.device("cpu")
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    index = visible.index(gpu_ids[0]) if gpu_ids[0] in visible else int(gpu_ids[0])
    return torch.device(f"cuda:{index}")


def _ray_gpu_ids() -> list[str]:
    """GPU ids Ray assigned to this process; none outside Ray (never starts Ray as a side effect)."""
    if not ray.is_initialized():
        return []
    try:
        return [str(g) for g in ray.get_gpu_ids()]
    except Exception:
        return []


class DeterministicFailure(RuntimeError):
    """A failure that the same input reproduces on any actor: a checkpoint a loader refuses, a bad
    parameter. The coordinator fails the job at once, naming the shard and the cause, instead of
    retrying it (actor deaths, lost nodes and device errors are retried as before)."""


class DeviceFailure(RuntimeError):
    """A CUDA / out-of-memory error: this actor's device state is not trusted any more.

    The coordinator kills the actor that raised it and starts a replacement,
    instead of retrying on a process in a broken state.
    """


def actor_tag() -> str:
    """``<node id[:8]>:<pid>``: which worker process generated a row (speedups are paired per actor)."""
    try:
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    except Exception:
        node = None
    return f"{(node or 'local')[:8]}:{os.getpid()}"


def is_fatal_device_error(exc: BaseException) -> bool:
    """Errors after which this process's device state cannot be trusted (replace the actor)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    text = f"{type(exc).__name__}: {exc}"
    return any(marker in text for marker in ("CUDA error", "CUDA out of memory", "CUBLAS_STATUS", "cuDNN error",
                                            "device-side assert"))


class ShardWorker:
    """Runs :class:`ShardTask` s of one job and commits one Parquet file per (arm, shard)."""

    def __init__(self, spec: JobSpec, storage_options: dict[str, Any] | None = None):
        self.spec = spec
        self.plan = ShardPlan.of(spec)
        self.store = RunStore(spec.output, storage_options, run_tag=spec.fingerprint())
        self.device = assigned_device()
        if self.device.type == "cpu":
            # One intra-op thread per CPU Ray gave us: actors on one node must not oversubscribe it.
            torch.set_num_threads(spec.intra_op_threads)
            keep_freed_memory()  # the speculative loops' calls change shape: no page faults for reused memory
        self._pairs: dict[tuple[str, str, str | None], ModelPair] = {}
        self._methods: dict[str, tuple[Method, MethodParams]] = {}  # arm name -> entry and typed params
        self._prompt_cache = None  # a prompt job's text encoder with its per-prompt cache, loaded once
        self._versions = {"specray_version": specray.__version__, "torch_version": torch.__version__}
        self.actor = actor_tag()
        self._broken: str | None = None  # set by a device failure: refuse further work

    def info(self) -> dict[str, Any]:
        """Who and where this worker is; the coordinator awaits it before handing out work."""
        return {"device": str(self.device), "device_name": device_name(self.device), "pid": os.getpid(),
                "host": socket.gethostname(), "actor": self.actor, "threads": torch.get_num_threads(),
                "keeps_freed_memory": self.device.type == "cpu" and keep_freed_memory()}

    def gpu_assignment(self) -> dict[str, Any]:
        """What Ray gave this worker and what it made of it (read by the GPU-pinning test)."""
        return {"gpu_ids": _ray_gpu_ids(), "device": str(self.device), "actor": self.actor,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "cuda_initialized": torch.cuda.is_initialized()}

    def run_task(self, task: ShardTask) -> list[dict[str, Any]]:
        """Generate every arm of ``task`` on its shard and commit the files; returns their records."""
        for kind, value in self.run_task_stream(task):
            if kind == "done":
                return value
        raise RuntimeError(f"{task.label}: the task ended without committing")  # unreachable

    def run_task_stream(self, task: ShardTask):
        """:meth:`run_task` as a stream: ``("rows", n)`` after each batch of each arm (progress), then
        ``("done", records)``. The coordinator calls it as a Ray streaming generator."""
        if self._broken is not None:
            raise DeviceFailure(f"actor {self.actor} had a device failure earlier ({self._broken}); not reusing it")
        try:
            steps = self._run(task)
            while True:
                try:
                    yield "rows", next(steps)
                except StopIteration as finished:
                    yield "done", [f.to_dict() for f in finished.value]
                    return
        except BaseException as exc:
            if is_fatal_device_error(exc):
                self._broken = f"{type(exc).__name__}: {exc}"
                log.error("fatal device error on %s (%s) in %s: %s", self.device, self.actor, task.label, exc)
                raise DeviceFailure(f"{task.label} on {self.device} ({self.actor}): {self._broken}") from exc
            raise

    def _pair(self, key: tuple[str, str, str | None]) -> ModelPair:
        if key not in self._pairs:
            family, target, draft = key
            try:
                pair = FAMILIES[family].load_pair()(ref_from_key(target), ref_from_key(draft), self.device)
                if self.spec.compile:  # the spec checked that the family has a compiled path
                    FAMILIES[family].compile()(pair)
                self._pairs[key] = pair
            except Exception as exc:
                if is_fatal_device_error(exc) or _is_transient_io(exc):
                    raise
                raise DeterministicFailure(f"loading {family} models target={target!r} draft={draft!r} failed: "
                                           f"{type(exc).__name__}: {exc}") from exc
        return self._pairs[key]

    def _method(self, arm: ArmSpec) -> tuple[Method, MethodParams]:
        """The arm's method entry and typed parameters (the spec validated them; this only types them)."""
        if arm.name not in self._methods:
            try:
                self._methods[arm.name] = resolve(arm.family, arm.method, arm.params)
            except (KeyError, TypeError, ValueError) as exc:
                raise DeterministicFailure(f"arm {arm.name!r}: parameters refused: {exc}") from exc
        return self._methods[arm.name]

    def _timed_batch(self, run_batch, arm: ArmSpec, pair: ModelPair, labels: torch.Tensor,
                     sample_ids: torch.Tensor) -> tuple[GenerationResult, float]:
        """One batch of one arm and its wall time, the device's queued work included."""
        method, params = self._method(arm)
        began = time.perf_counter()
        result = run_batch(method, params, pair, labels, sample_ids, self.arm_seed(arm))
        if pair.device.type == "cuda":
            torch.cuda.synchronize(pair.device)
        return result, time.perf_counter() - began

    def _run(self, task: ShardTask):
        """A generator: yields the rows of each batch as it is done, returns the committed files."""
        relpaths = {arm.name: shard_relpath(arm.name, task.shard.index, task.shard.num_shards) for arm in task.arms}
        # A retry after a death between commit and reply finds some files already there: they hold
        # exactly what this run would write (samples are pure functions of seed and id), so keep them.
        done = {name: self.store.describe(path) for name, path in relpaths.items() if self.store.is_committed(path)}
        arms = [arm for arm in task.arms if arm.name not in done]
        if not arms:
            return [done[arm.name] for arm in task.arms]
        for arm in arms:
            self._method(arm)  # a refused parameter fails before any model is loaded
        pair = self._pair(task.group_key)
        run_batch = FAMILIES[task.group_key[0]].loop()
        rows: dict[str, list[dict[str, Any]]] = {arm.name: [] for arm in arms}
        prompt_features = self._shard_prompt_features(task)
        # Batch-major, arms in job order: each arm sees the same batches with the same
        # seeds on the same actor at nearly the same time (paired wall times).
        for start, stop in task.shard.batch_ranges():
            sample_ids, labels = self.plan.batch(start, stop)
            conditions = labels
            if prompt_features is not None:
                features, row_of = prompt_features
                conditions = features.select([row_of[int(i)] for i in labels]).to(pair.device)
            for arm in arms:
                result, wall = self._timed_batch(run_batch, arm, pair, conditions, sample_ids)
                rows[arm.name].extend(self._rows(arm, result, wall, sample_ids, labels, task.prompts))
                yield len(sample_ids)
        fingerprint = self.spec.fingerprint()
        for arm in arms:
            identity = ShardIdentity(fingerprint, arm.name, task.shard.index, task.shard.num_shards)
            done[arm.name] = self.store.write_shard(relpaths[arm.name], rows_to_table(rows.pop(arm.name)), identity)
        return [done[arm.name] for arm in task.arms]

    def _shard_prompt_features(self, task: ShardTask):
        """A prompt job's features of the shard's prompts, encoded in one call (prompts this actor
        encoded for an earlier shard come from its cache), and each prompt index's row in them."""
        if task.prompts is None:
            return None
        if self._prompt_cache is None:
            from specray.models.text import PromptCache, load_text_encoder

            source = self.spec.conditions.prompts
            try:
                encoder = load_text_encoder(source.encoder, self.device, source.encoder_path)
            except (OSError, ValueError) as exc:
                raise DeterministicFailure(f"text encoder {source.encoder!r} cannot be loaded: "
                                           f"{type(exc).__name__}: {exc}") from exc
            self._prompt_cache = PromptCache(encoder)
        order = list(task.prompts)
        features = self._prompt_cache.features([task.prompts[i][0] for i in order],
                                               [task.prompts[i][1] for i in order])
        return features, {index: row for row, index in enumerate(order)}

    def arm_seed(self, arm: ArmSpec) -> int:
        """The seed of every sample of ``arm``: the job seed shifted by the arm's ``seed_offset``."""
        return self.spec.seed + int(getattr(arm, "seed_offset", 0))

    def _rows(self, arm: ArmSpec, result: GenerationResult, wall_s: float, sample_ids: torch.Tensor,
              labels: torch.Tensor, prompts: dict[int, tuple[str, str]] | None = None) -> list[dict[str, Any]]:
        """One row per sample. A prompt job's ``labels`` are prompt indices: its rows hold the prompt
        id, text and repeat, and ``class_label`` -1 (no class)."""
        images = result.images.detach().to("cpu").numpy()
        batch = len(sample_ids)
        if images.shape[0] != batch or len(result.stats) != batch:
            raise RuntimeError(f"arm {arm.name!r}: run_batch returned {images.shape[0]} images and "
                               f"{len(result.stats)} stats for a batch of {batch}")
        params = json.dumps(arm.params, sort_keys=True)
        rows = []
        for row, stats in enumerate(result.stats):
            image = np.ascontiguousarray(images[row].astype(np.uint8, copy=False))
            record = stats.as_row()
            extra = record.pop("extra")
            rows.append({
                "job_id": self.spec.job_id, "arm": arm.name, "method": arm.method, "family": arm.family,
                "target": arm.target_key, "draft": arm.draft_key,
                "sample_id": int(sample_ids[row]), "seed": self.arm_seed(arm),
                **self._condition_columns(int(sample_ids[row]), int(labels[row]), prompts),
                "image": image_cell(image),
                "height": int(image.shape[0]), "width": int(image.shape[1]),
                **record,
                "accepted_per_position": [int(v) for v in record["accepted_per_position"]],
                "batch_size": batch, "batch_wall_time_s": wall_s, "sample_wall_time_s": wall_s / batch,
                "params": params, **self._versions, "device": str(self.device), "actor": self.actor,
                "extra_stats": json.dumps(extra, sort_keys=True, default=_json_default),
            })
        return rows

    def _condition_columns(self, sample_id: int, label: int, prompts: dict[int, tuple[str, str]] | None
                           ) -> dict[str, Any]:
        if prompts is None:
            return {"class_label": label, "prompt_id": None, "prompt": None, "repeat": None}
        prompt_id, text = prompts[label]
        return {"class_label": -1, "prompt_id": prompt_id, "prompt": text,
                "repeat": sample_id // self.plan.num_prompts}


def _is_transient_io(exc: BaseException) -> bool:
    """An I/O error that may pass (a network filesystem hiccup), as opposed to a missing or refused file."""
    return isinstance(exc, OSError) and not isinstance(exc, (FileNotFoundError, IsADirectoryError,
                                                             NotADirectoryError, PermissionError))


def _json_default(value: Any) -> Any:
    if isinstance(value, (np.generic, torch.Tensor)):
        return value.tolist()
    return str(value)


GenerationActor = ray.remote(max_restarts=0, max_task_retries=0)(ShardWorker)
