"""The coordinator: plan shards, skip committed ones, run the rest on a pool of actors, write the manifest.

The driver touches no accelerator: it only plans, dispatches and counts. Work
units are :class:`ShardTask` s (one shard of one arm group). A task that fails
is retried on another actor (up to ``max_shard_retries`` times per task; then
:class:`ShardFailedError` names the shard). An actor that died (SIGKILL, lost
node, preempted spot instance) or reported a CUDA / out-of-memory
:class:`~specray.runtime.actor.DeviceFailure` is killed and replaced; work goes
only to actors that are up, so a replacement waiting for resources blocks
nothing. Output is written by the actors, one atomic file per (arm, shard), so
a retried or resumed task can never leave a sample twice. The driver's memory
is bounded by the number of shards and actors, not by the number of samples.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import pyarrow
import ray
import torch

import specray
from specray.runtime import fs as storage
from specray.runtime.lease import OutputLease
from specray.runtime.plan import SAMPLES_DIR, ShardPlan, ShardTask, shard_relpath
from specray.runtime.progress import Progress
from specray.runtime.store import JOB_RECORD_NAME, MANIFEST_NAME, CommittedFile, RunStore
from specray.spec import JobSpec, SpecError, with_output

log = logging.getLogger("specray.runtime")

MANIFEST_FORMAT = 1
FIRST_WAIT_NOTICE_S = 5.0  # say that the job waits for nodes this soon after it starts waiting
STARVED_WARNING_S = 30.0  # then repeat it this often while nothing runs
# The job-wide entries of JobSpec.sample_determining a resumed run must keep (arms are compared one by one),
# each with its value when a record leaves it out (set only when not the default).
RESUME_KEYS = {"job_id": None, "seed": None, "conditions": None, "batch_size": None, "compile": False,
               "intra_op_threads": 1}


class ShardFailedError(RuntimeError):
    """A shard exhausted its retries. Committed shards stay valid; a rerun resumes."""


@dataclass
class RunResult:
    output: str
    manifest: dict[str, Any]
    num_tasks: int
    tasks_run: int
    tasks_skipped: int
    retries: int
    actors: int
    wall_time_s: float
    rows_written: int = 0
    actors_replaced: int = 0
    actor_startup_s: float = 0.0  # from dispatch start until the first actor could take work


# ---------------------------------------------------------------- planning and resume


def plan_tasks(spec: JobSpec, plan: ShardPlan, store: RunStore) -> tuple[list[ShardTask], int]:
    """Tasks still to run (arms whose file is missing), and the number of rows already committed.

    One listing of ``samples/`` (not one existence check per file: on S3 that is one request per
    thousand files instead of one per file); shards are visited one at a time, never listed.
    """
    committed = set(store.list_files("samples"))
    groups = spec.arm_groups()
    prompt_set = spec.prompt_set()
    tasks: list[ShardTask] = []
    committed_rows = 0
    for shard in plan.iter_shards():
        prompts = None
        for key, arms in groups:
            missing = tuple(a for a in arms if shard_relpath(a.name, shard.index, shard.num_shards) not in committed)
            committed_rows += shard.num_samples * (len(arms) - len(missing))
            if missing:
                if prompt_set is not None and prompts is None:
                    prompts = {i: (prompt_set.ids[i], prompt_set.texts[i]) for i in plan.prompt_indices(shard)}
                tasks.append(ShardTask(shard=shard, group_key=key, arms=missing, prompts=prompts))
    return tasks, committed_rows


def check_resume(spec: JobSpec, plan: ShardPlan, store: RunStore) -> dict[str, Any] | None:
    """Refuse an output that holds samples of an incompatible spec. Returns the previous record."""
    previous = store.read_json(JOB_RECORD_NAME)
    if previous is None:
        if store.list_files("samples"):
            raise SpecError("output", f"{spec.output!r} holds sample files but no {JOB_RECORD_NAME}; "
                                      "it is not a specray run of this job. Choose another output")
        return None
    where = f"output {spec.output!r} holds a run of a different job"
    if any(path.startswith(f"{SAMPLES_DIR}/arm=") for path in store.list_files(SAMPLES_DIR)):
        raise SpecError("output", f"output {spec.output!r} holds a run written with samples/arm=<arm>/ folders "
                                  "by an earlier specray; this one writes samples/<arm>/, and resuming would "
                                  "leave both. Choose another output (the old run still reduces as it is)")
    if previous.get("format") != MANIFEST_FORMAT:
        raise SpecError("output", f"{where} (record format {previous.get('format')}); choose another output")
    old, new = previous["sample_determining"], spec.sample_determining()
    for key, absent in RESUME_KEYS.items():
        was, now = old.get(key, absent), new.get(key, absent)
        if was != now:
            raise SpecError("output", f"{where}: {key} was {was!r}, now {now!r}; resuming would "
                                      "mix incompatible samples. Choose another output or delete it")
    if previous["layout"] != plan.layout():
        raise SpecError("output", f"{where}: shard layout was {previous['layout']}, now {plan.layout()}; "
                                  "keep shard_batches as it was to resume, or choose another output")
    for name, fingerprint in old["arms"].items():
        if name not in new["arms"]:
            raise SpecError("output", f"{where}: arm {name!r} is no longer in the job; add it back or choose another output")
        if new["arms"][name] != fingerprint:
            raise SpecError("output", f"{where}: arm {name!r} changed (family, models, method or params); "
                                      "resuming would mix incompatible samples. Rename the arm or choose another output")
    return previous


def job_record(spec: JobSpec, plan: ShardPlan) -> dict[str, Any]:
    return {"format": MANIFEST_FORMAT, "job_id": spec.job_id, "fingerprint": spec.fingerprint(),
            "sample_determining": spec.sample_determining(), "layout": plan.layout(),
            "spec": public_spec(spec)}


def public_spec(spec: JobSpec) -> dict[str, Any]:
    """The spec as the manifest stores it: no credentials (user:password stripped from URIs)."""
    return storage.redact(spec.to_dict())


# ---------------------------------------------------------------- Ray


def connect_ray(ray_address: str | None = None, num_cpus: int | None = None) -> bool:
    """Join a cluster (``ray_address``, or RAY_ADDRESS as ``ray job submit`` sets it) or start a local Ray.

    A running cluster is joined only when asked (``--ray-address auto`` or
    RAY_ADDRESS=auto): "auto" also finds Ray instances that other drivers on
    the machine started for themselves and will shut down under us.
    Returns True when this call started Ray (the caller shuts it down).
    """
    if ray.is_initialized():
        return False
    if ray_address:
        ray.init(address=ray_address)
        return False
    if os.environ.get("RAY_ADDRESS"):
        ray.init()
        return False
    with _loopback_only():
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)
    return True


def _started_by_this_process() -> bool:
    """Whether this process's ``ray.init`` started the Ray instance it is connected to (a fixed local
    instance: no autoscaler, nothing to wait for) rather than joining a cluster."""
    node = getattr(ray._private.worker, "_global_node", None)
    return bool(node is not None and getattr(node, "head", False))


def actor_bundle(spec: JobSpec) -> dict[str, float]:
    """What one generation actor asks the cluster for."""
    bundle = {"CPU": spec.num_cpus_per_actor}
    if spec.num_gpus_per_actor > 0:
        bundle["GPU"] = spec.num_gpus_per_actor
    return {k: v for k, v in bundle.items() if v > 0}


def pool_size_for(spec: JobSpec, wanted: str | int, num_tasks: int, *, own_ray: bool,
                  resources: dict[str, float]) -> int:
    """How many generation actors to start.

    ``actors: auto`` on a Ray instance of our own is what it offers (it cannot grow; nothing fitting
    is refused now). On a cluster it is one actor per task still to run: the actors the cluster
    cannot place yet wait, and the autoscaler is asked for them (:func:`request_capacity`), so
    nodes that start later take work as they arrive. An explicit count is taken as given.
    """
    if wanted == "auto":
        wanted = default_actor_count(spec, resources) if own_ray else num_tasks
    return max(1, min(int(wanted), num_tasks))


def request_capacity(spec: JobSpec, pool_size: int) -> None:
    """Ask the cluster's autoscaler for one bundle per actor (replaces any earlier request of this driver)."""
    from ray.autoscaler.sdk import request_resources

    bundles = [actor_bundle(spec)] * pool_size
    request_resources(bundles=bundles)
    log.info("asked the autoscaler for %d x %s (one bundle per generation actor)", pool_size, bundles[0])


def release_capacity() -> None:
    """Withdraw this driver's request, so the autoscaler may scale the nodes down when they idle."""
    from ray.autoscaler.sdk import request_resources

    try:
        request_resources(bundles=[])
    except Exception as exc:  # the cluster may be gone; nothing to withdraw then
        log.debug("could not withdraw the resource request: %s", exc)
@contextlib.contextmanager
def _loopback_only():
    """Make the local Ray instance listen on 127.0.0.1 only.

    Ray gives a node its routable address and then its GCS, raylet and workers listen on every
    interface; ``ray.init`` turns an explicit 127.0.0.1 back into that address. Ray's switch for
    single-machine use (the one it sets by itself on macOS and Windows) makes it pick 127.0.0.1,
    and with that node address its servers bind to loopback. Nothing outside this machine needs
    them: a job that spans machines joins a cluster (``--ray-address``) and never comes here.
    """
    try:
        from ray._private import ray_constants
    except ImportError:  # a Ray without the switch: start it as Ray chooses (token auth still guards it)
        log.warning("this Ray has no single-machine switch; the local Ray instance listens on all interfaces")
        yield
        return
    name = getattr(ray_constants, "ENABLE_RAY_CLUSTERS_ENV_VAR", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
    saved_env, saved_flag = os.environ.get(name), getattr(ray_constants, "ENABLE_RAY_CLUSTER", True)
    os.environ[name] = "0"  # read by the processes Ray spawns
    ray_constants.ENABLE_RAY_CLUSTER = False  # read by this process's ray.init
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag
        if saved_env is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved_env


def default_actor_count(spec: JobSpec, resources: dict[str, float]) -> int:
    """As many actors as the cluster offers for the per-actor request."""
    if spec.num_gpus_per_actor > 0:
        gpus = resources.get("GPU", 0.0)
        if gpus < spec.num_gpus_per_actor:
            raise SpecError("num_gpus_per_actor", f"asks for {spec.num_gpus_per_actor} GPU per actor but the "
                                                  f"cluster has {gpus} GPUs; set num_gpus_per_actor: 0 to run on CPU")
        return max(1, int(gpus / spec.num_gpus_per_actor + 1e-9))
    cpus = resources.get("CPU", 0.0)
    if cpus < spec.num_cpus_per_actor:
        raise SpecError("num_cpus_per_actor", f"asks for {spec.num_cpus_per_actor} CPUs per actor but the "
                                              f"cluster has {cpus} CPUs")
    return int(cpus / spec.num_cpus_per_actor + 1e-9)


# ---------------------------------------------------------------- the run


def run_job(spec: JobSpec, *, ray_address: str | None = None, num_cpus: int | None = None,
            actors: int | None = None, storage_options: dict[str, Any] | None = None,
            show_progress: bool = True, lease: OutputLease | None = None) -> RunResult:
    """Run ``spec`` to completion (resuming from committed shards) and write the manifest.

    The run holds the output's lease (:mod:`specray.runtime.lease`) from before it reads the output
    until it returns; a second run of the same output is refused with :class:`OutputBusyError`.
    ``lease``: one the caller already holds on ``spec.output`` (dataset jobs hold theirs longer).
    """
    started = time.time()
    # The spec's storage options (endpoint, region; never credentials), then the caller's on top.
    storage_options = {**getattr(spec, "storage_options", {}), **(storage_options or {})} or None
    if "://" not in spec.output and not os.path.isabs(spec.output):
        # Actors may run in another working directory: give them the driver's meaning of the path.
        spec = with_output(spec, os.path.abspath(spec.output))
    plan = ShardPlan.of(spec)
    try:  # before Ray starts: a refused output costs nothing and leaves nothing behind
        storage.check_writable(spec.output, storage_options)
    except storage.StorageError as exc:
        raise SpecError("output", str(exc)) from None
    store = RunStore(spec.output, storage_options, run_tag=spec.fingerprint())
    owned = lease is None
    if owned:
        lease = OutputLease(store, job_id=spec.job_id, fingerprint=spec.fingerprint()).acquire()
    try:
        return _run_leased(spec, plan, store, lease, started, ray_address=ray_address, num_cpus=num_cpus,
                           actors=actors, storage_options=storage_options, show_progress=show_progress)
    finally:
        if owned:
            lease.release()


def _run_leased(spec: JobSpec, plan: ShardPlan, store: RunStore, lease: OutputLease, started: float, *,
                ray_address: str | None, num_cpus: int | None, actors: int | None,
                storage_options: dict[str, Any] | None, show_progress: bool) -> RunResult:
    check_resume(spec, plan, store)
    store.remove_stale_temps()  # this job's own leftovers only (their names carry its fingerprint)
    tasks, committed_rows = plan_tasks(spec, plan, store)
    total_rows = plan.num_samples * len(spec.arms)
    log.info("job %s: %d samples x %d arms = %d rows in %d shards; %d rows already committed, %d tasks to run",
             spec.job_id, plan.num_samples, len(spec.arms), total_rows, plan.num_shards, committed_rows, len(tasks))

    written: dict[str, CommittedFile] = {}
    retries, replaced, pool_size, devices, device_names, startup = 0, 0, 0, [], [], 0.0
    own_ray = True
    started_ray = connect_ray(ray_address, num_cpus) if tasks else False
    try:
        if tasks:
            wanted = actors if actors is not None else spec.actors
            own_ray = started_ray or _started_by_this_process()
            # may refuse (a Ray of our own that lacks the resources): nothing written yet
            pool_size = pool_size_for(spec, wanted, len(tasks), own_ray=own_ray, resources=ray.cluster_resources())
            if not own_ray:
                request_capacity(spec, pool_size)
            if store.is_committed(MANIFEST_NAME):
                store.delete(MANIFEST_NAME)  # the manifest means "complete"; it is not, until the end
        store.write_json(JOB_RECORD_NAME, job_record(spec, plan))
        if tasks:
            with Progress(total_rows, committed_rows, enabled=show_progress) as progress:
                dispatcher = _Dispatcher(spec, storage_options, pool_size, progress, lease,
                                         first_notice_s=STARVED_WARNING_S if own_ray else FIRST_WAIT_NOTICE_S)
                try:
                    written = dispatcher.run(tasks)
                finally:
                    dispatcher.shutdown()
                    store.remove_stale_temps()  # temp files of writers killed mid-commit (never visible)
                retries, replaced, devices = dispatcher.retries, dispatcher.replaced, dispatcher.devices
                device_names = dispatcher.device_names
                startup = dispatcher.startup_s
    finally:
        if tasks and not own_ray and ray.is_initialized():
            release_capacity()
        if started_ray:
            ray.shutdown()

    manifest = build_manifest(spec, plan, store, written, started=started, retries=retries,
                              actors=pool_size, devices=devices, device_names=device_names, tasks_run=len(tasks))
    lease.check()  # a run whose lease was taken over must not claim the output is complete
    store.write_json(MANIFEST_NAME, manifest)
    wall = time.time() - started
    log.info("job %s complete in %.1f s: %d tasks run, %d retries; manifest at %s",
             spec.job_id, wall, len(tasks), retries, store.full_path(MANIFEST_NAME))
    return RunResult(output=spec.output, manifest=manifest, num_tasks=plan.num_shards * len(spec.arm_groups()),
                     tasks_run=len(tasks), tasks_skipped=plan.num_shards * len(spec.arm_groups()) - len(tasks),
                     retries=retries, actors=pool_size, wall_time_s=wall,
                     rows_written=sum(f.rows for f in written.values()), actors_replaced=replaced,
                     actor_startup_s=startup)


class _Dispatcher:
    """Hands tasks to ready actors, retries failures elsewhere, replaces dead or broken actors.

    Memory stays bounded by the number of tasks and actors: the driver holds task
    indices, counters and one small record per committed file, never sample data.
    Work goes only to actors that answered :meth:`ShardWorker.info`, so a
    replacement that the cluster cannot place yet (a node was lost) holds no task
    hostage: the others take the queue while it waits for resources.
    """

    def __init__(self, spec: JobSpec, storage_options: dict[str, Any] | None, pool_size: int, progress: Progress,
                 lease: OutputLease | None = None, first_notice_s: float = STARVED_WARNING_S):
        self.spec = spec
        self.lease = lease
        self.first_notice_s = first_notice_s  # on a cluster, say soon that the job waits for nodes
        self.storage_options = storage_options
        self.progress = progress
        self.retries = 0
        self.replaced = 0
        self.devices: list[str] = []
        self.device_names: list[str] = []  # each actor's device in words (specray.runtime.hardware)
        self._next_actor_id = 0
        self.actors: dict[int, Any] = {}  # actor id -> handle (ids are never reused)
        self.tags: dict[int, str] = {}  # actor id -> "<node>:<pid>", once it answered
        self._starting: dict[Any, int] = {}  # info ref -> actor id, until the actor is placed and constructed
        self._idle: collections.deque[int] = collections.deque()
        self._start_failures = 0
        self._said_waiting = False
        self._created = time.monotonic()
        self.startup_s = 0.0
        self._max_start_failures = 3 * pool_size + spec.max_shard_retries
        for _ in range(pool_size):
            self._start_actor()

    def _start_actor(self) -> int:
        from specray.runtime.actor import GenerationActor

        actor_id = self._next_actor_id
        self._next_actor_id += 1
        handle = GenerationActor.options(
            num_cpus=self.spec.num_cpus_per_actor, num_gpus=self.spec.num_gpus_per_actor,
        ).remote(self.spec, self.storage_options)
        self.actors[actor_id] = handle
        self._starting[handle.info.remote()] = actor_id
        return actor_id

    def run(self, tasks: list[ShardTask]) -> dict[str, CommittedFile]:
        pending = collections.deque(range(len(tasks)))
        failures: dict[int, int] = collections.Counter()
        avoid: dict[int, set[int]] = collections.defaultdict(set)  # task -> actors it failed on
        # A task runs as a Ray streaming generator: ("rows", n) per batch of each arm, then ("done", records).
        in_flight: dict[Any, tuple[int, int]] = {}  # generator -> (actor id, task index)
        counted: dict[int, int] = collections.Counter()  # task -> rows shown as done before it committed
        written: dict[str, CommittedFile] = {}
        failure: ShardFailedError | None = None
        waiting_since = time.monotonic()

        while pending or in_flight:
            if self.lease is not None:
                self.lease.check()
            self._assign(tasks, pending, in_flight, avoid)
            ready, _ = ray.wait([*in_flight, *self._starting], num_returns=1, timeout=1.0)
            self.progress.tick()
            if not ready:
                waiting_since = self._warn_if_starved(in_flight, waiting_since)
                continue
            waiting_since = time.monotonic()
            if ready[0] in self._starting:
                self._on_started(ready[0])
                continue
            stream = ready[0]
            actor_id, index = in_flight[stream]
            task = tasks[index]
            try:
                kind, value = ray.get(next(stream))
            except (ray.exceptions.RayError, StopIteration) as exc:
                in_flight.pop(stream)
                self.progress.retract(counted.pop(index, 0))  # those rows run again
                if _is_deterministic(exc):
                    # The same input fails the same way on any actor: stop now instead of retrying.
                    raise ShardFailedError(f"{task.label} failed and is not retried (the same input fails the "
                                           f"same way every time): {_short_error(exc)}. Shards already "
                                           "committed stay valid: fix the cause and rerun the job to resume") from None
                failures[index] += 1
                self.retries += 1
                self.progress.retry()
                avoid[index].add(actor_id)
                reason = _short_error(exc) if isinstance(exc, ray.exceptions.RayError) else "the task ended early"
                self._after_failure(actor_id, task, exc, reason)
                if failures[index] > self.spec.max_shard_retries:
                    # Let the shards in flight finish (their commits are valid), then fail.
                    failure = failure or ShardFailedError(
                        f"{task.label} failed {failures[index]} times (max_shard_retries="
                        f"{self.spec.max_shard_retries}); last error: {reason}. Shards already committed "
                        f"stay valid: fix the cause and rerun the job to resume")
                    pending.clear()
                    continue
                log.warning("%s failed on actor %d (attempt %d): %s; retrying on another actor",
                            task.label, actor_id, failures[index], reason)
                pending.appendleft(index)
                continue
            if kind == "rows":
                counted[index] += value
                self.progress.advance(value)
                continue
            in_flight.pop(stream)
            for record in value:
                committed = CommittedFile(**record)
                written[committed.path] = committed
            self.progress.advance(task.num_rows - counted.pop(index, 0))
            self._idle.append(actor_id)
        if failure is not None:
            raise failure
        return written

    def _after_failure(self, actor_id: int, task: ShardTask, exc: BaseException, reason: str) -> None:
        """A dead actor, or one whose device failed, is replaced; after an ordinary error it takes work again."""
        from specray.runtime.actor import DeviceFailure

        who = f"actor {actor_id} ({self.tags.get(actor_id, '?')})"
        if isinstance(exc, ray.exceptions.RayTaskError) and not isinstance(exc.cause, DeviceFailure):
            self._idle.append(actor_id)
            return
        if isinstance(exc, ray.exceptions.RayTaskError):
            log.warning("%s had a device failure in %s (%s); replacing it", who, task.label, reason)
        else:
            log.warning("%s died while running %s (%s); replacing it", who, task.label, reason)
        self._replace(actor_id)

    def _on_started(self, ref: Any) -> None:
        actor_id = self._starting.pop(ref)
        try:
            info = ray.get(ref)
        except ray.exceptions.RayError as exc:
            self._start_failures += 1
            if self._start_failures > self._max_start_failures:
                raise RuntimeError(f"generation actors keep dying before they start ({self._start_failures} "
                                   f"times); last error: {_short_error(exc)}") from None
            log.warning("actor %d died while starting (%s); replacing it", actor_id, _short_error(exc))
            self._replace(actor_id)
            return
        self.tags[actor_id] = info.get("actor", "?")
        if not self.startup_s:
            self.startup_s = time.monotonic() - self._created
        self.devices.append(info["device"])
        self.device_names.append(info["device_name"])
        log.info("actor %d ready: %s on %s (%s)", actor_id, self.tags[actor_id], info["device"], info["device_name"])
        self._idle.append(actor_id)

    def _assign(self, tasks: list[ShardTask], pending: collections.deque,
                in_flight: dict[Any, tuple[int, int]], avoid: dict[int, set[int]]) -> None:
        for _ in range(len(self._idle)):
            if not pending:
                return
            actor_id = self._idle.popleft()
            choice = next((i for i in pending if actor_id not in avoid[i]), None)
            if choice is None:
                # Every pending task already failed here; use this actor only if no other actor is left to try.
                others = [a for a in self.actors if a != actor_id]
                first = pending[0]
                if others and not all(a in avoid[first] for a in others):
                    self._idle.append(actor_id)
                    continue
                choice = first
            pending.remove(choice)
            stream = self.actors[actor_id].run_task_stream.options(num_returns="streaming").remote(tasks[choice])
            in_flight[stream] = (actor_id, choice)

    def _replace(self, actor_id: int) -> None:
        handle = self.actors.pop(actor_id)
        if actor_id in self._idle:
            self._idle.remove(actor_id)
        ray.kill(handle, no_restart=True)
        self.replaced += 1
        self._start_actor()

    def _warn_if_starved(self, in_flight: dict[Any, tuple[int, int]], since: float) -> float:
        """Nothing runs: say that the job waits for the cluster to place its actors (soon, then now and then)."""
        waited = time.monotonic() - since
        first = not self._said_waiting
        if in_flight or waited < (self.first_notice_s if first else STARVED_WARNING_S):
            return since
        self._said_waiting = True
        placed = len(self.actors) - len(self._starting)
        log.warning("waiting for the cluster: %d of %d generation actors placed, %d wait for a node with %s free "
                    "(the autoscaler was asked for them; nodes may take minutes to start); available now: %s",
                    placed, len(self.actors), len(self._starting), actor_bundle(self.spec),
                    _short_resources(ray.available_resources()))
        return time.monotonic()

    def shutdown(self) -> None:
        for handle in self.actors.values():
            ray.kill(handle, no_restart=True)
        self.actors.clear()
        self._starting.clear()
        self._idle.clear()


def _short_resources(resources: dict[str, float]) -> dict[str, float]:
    """CPU, GPU and memory of a resource dict (not Ray's per-node bookkeeping entries)."""
    return {k: round(v, 2) for k, v in resources.items() if k in ("CPU", "GPU") or k.startswith("accelerator_type")}
def _is_deterministic(exc: BaseException) -> bool:
    from specray.runtime.actor import DeterministicFailure

    return isinstance(exc, ray.exceptions.RayTaskError) and isinstance(exc.cause, DeterministicFailure)


def _short_error(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {cause}"
    text = str(exc).strip().splitlines()
    return text[-1] if text else type(exc).__name__


# ---------------------------------------------------------------- manifest


def build_manifest(spec: JobSpec, plan: ShardPlan, store: RunStore, written: dict[str, CommittedFile], *,
                   started: float, retries: int, actors: int, devices: list[str], device_names: list[str],
                   tasks_run: int) -> dict[str, Any]:
    """Count every committed (arm, shard) file; fail if one is missing or has the wrong row count."""
    shards = []
    for arm in spec.arms:
        for shard in plan.iter_shards():
            path = shard_relpath(arm.name, shard.index, shard.num_shards)
            committed = written.get(path) or store.describe(path)
            if committed.rows != shard.num_samples:
                raise RuntimeError(f"{path} has {committed.rows} rows, expected {shard.num_samples}")
            shards.append({"arm": arm.name, "shard": shard.index, "num_shards": shard.num_shards,
                           "first_sample_id": shard.start, **committed.to_dict()})
    finished = time.time()
    return {
        "format": MANIFEST_FORMAT,
        "job_id": spec.job_id,
        "fingerprint": spec.fingerprint(),
        "spec": public_spec(spec),
        "layout": plan.layout(),
        "arms": [{"name": a.name, "family": a.family, "method": a.method, "target": a.target, "draft": a.draft,
                  "params": a.params, "seed_offset": a.seed_offset, "fingerprint": a.fingerprint()}
                 for a in spec.arms],
        "num_rows": sum(s["rows"] for s in shards),
        "shards": shards,
        "versions": {"specray": specray.__version__, "torch": torch.__version__, "ray": ray.__version__,
                     "pyarrow": pyarrow.__version__, "python": platform.python_version()},
        "timings": {"started_at": _iso(started), "finished_at": _iso(finished), "wall_time_s": finished - started,
                    "tasks_run": tasks_run, "retries": retries, "actors": actors, "devices": sorted(devices),
                    "device_names": sorted(set(device_names))},
    }


def _iso(timestamp: float) -> str:
    return datetime.fromtimestamp(timestamp, tz=timezone.utc).isoformat(timespec="seconds")
