"""The job spec: what to generate, with which arms, and where to write it.

A job file (YAML) or dict is loaded by :func:`load_job` into a :class:`JobSpec`.
Everything is validated here, before Ray starts; every error is a
:class:`SpecError` whose message starts with the path of the bad field
(``arms[2].params.gamma: ...``) and names the allowed values.

Example::

    job_id: digits-compare
    seed: 0
    output: runs/compare            # local path or s3://bucket/prefix
    conditions: {kind: class_labels, per_class: 100, classes: all}
    batch_size: 50
    shard_batches: 2                # or shard_size: 100 (a multiple of batch_size)
    actors: auto                    # or an int
    num_cpus_per_actor: 1
    num_gpus_per_actor: 0           # fractions allowed: 0.5 puts two actors on a GPU
    max_shard_retries: 3
    compile: false                  # true: torch.compile the AR families' decode steps / diffusion head
    arms:
      - {name: target_only, family: discrete_ar, method: target_only,
         target: digits-gpt-target, draft: digits-gpt-draft}
      - {name: sd, family: discrete_ar, method: sd,
         target: digits-gpt-target, draft: digits-gpt-draft, params: {gamma: 4}}
    eval: {fid: true, reference: digits, baseline: target_only}
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from specray.urls import redact_urls

SPEC_FORMAT_VERSION = 1
CONDITION_KINDS = ("class_labels", "prompts")
DATASET_PARTITIONS = ("date", "run")
_ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")  # used with fullmatch: no trailing newline
NAME_MAX_CHARS = 128  # names become folder and file names

# Bounds that keep validation and planning cheap whatever a job file says (each error says why).
JOB_FILE_MAX_BYTES = 1024 * 1024  # a job file is a few KiB; reading is bounded before parsing
YAML_MAX_NODES = 100_000  # nodes after alias expansion (an alias bomb expands to billions)
YAML_MAX_DEPTH = 64  # nesting, aliases included
MAX_SAMPLES = 100_000_000  # per job: the reducer keeps one bit per sample and arm
MAX_SHARDS = 100_000  # per arm: the manifest lists every (arm, shard) file
MAX_SHARD_FILES = 1_000_000  # shards x arms: one manifest entry and one existence check each
MAX_ARMS = 1_000
MAX_BATCH_SIZE = 65_536
MAX_SEED = 2**62  # seeds are int64 counters (rng.py); seed + seed_offset must stay below 2**63


class SpecError(ValueError):
    """A job spec that cannot run. The message starts with the field path."""

    def __init__(self, field_path: str, message: str):
        self.field_path = field_path
        self.message = redact_urls(message)  # a URL's user:password is never shown, whoever built the message
        super().__init__(f"{field_path}: {self.message}" if field_path else self.message)

    def __reduce__(self):  # picklable across processes despite the two-argument constructor
        return (type(self), (self.field_path, self.message))


@dataclass(frozen=True)
class PromptSource:
    """Where a prompt job's prompts come from and how they are read (``specray.prompts``).

    ``num_prompts`` and ``digest`` are measured when the job is validated; the digest joins the
    job's fingerprint, so a run is never resumed with a different prompt set.
    """

    source: str
    format: str = "auto"
    text_column: str = "prompt"
    id_column: str = "id"
    captions: str = "first"
    first: int | None = None
    sample: int | None = None
    sample_seed: int = 0
    max_chars: int = 2000
    encoder: str | None = None  # None: the text encoder the target was trained with
    encoder_path: str | None = None
    num_prompts: int = 0
    digest: str = ""

    def read_options(self) -> dict[str, Any]:
        """The keyword arguments of :func:`specray.prompts.load_prompts`."""
        return {k: getattr(self, k) for k in ("source", "format", "text_column", "id_column", "captions", "first",
                                             "sample", "sample_seed", "max_chars")}


@dataclass(frozen=True)
class ConditionSpec:
    """What each sample is conditioned on.

    ``class_labels``: ``per_class`` samples of each class in ``classes`` (None for "all classes the
    target knows" until :func:`load_job` resolves it to an explicit tuple).
    ``prompts``: ``repeats`` samples of each prompt of ``prompts`` (sample ``i`` shows prompt
    ``i % P``, its ``i // P``-th repeat).
    """

    kind: str = "class_labels"
    per_class: int = 100
    classes: tuple[int, ...] | None = None
    repeats: int = 1
    prompts: PromptSource | None = None

    @property
    def num_samples(self) -> int:
        if self.prompts is not None:
            return self.repeats * self.prompts.num_prompts
        assert self.classes is not None, "classes not resolved"
        return self.per_class * len(self.classes)


@dataclass(frozen=True)
class ArmSpec:
    """One (family, target, draft, method, params) to generate with.

    ``params`` are resolved: the family's defaults merged in and validated.
    """

    name: str
    family: str
    method: str
    target: str | dict[str, Any]  # a preset name, a checkpoint path, or a {format: ...} mapping
    draft: str | dict[str, Any] | None
    params: dict[str, Any] = field(default_factory=dict)
    seed_offset: int = 0  # the arm's samples use seed job.seed + seed_offset (e.g. target_only replicas for FID noise)

    @property
    def group_key(self) -> tuple[str, str, str | None]:
        """Arms with the same key share one model pair (and one actor per shard): the family and the
        models' keys (``specray.models.refs.ref_key``)."""
        from specray.models.refs import ref_key

        return (self.family, ref_key(self.target), ref_key(self.draft))

    @property
    def target_key(self) -> str:
        """The target as one string (Parquet rows, reports): a name, a path, or canonical JSON."""
        return self.group_key[1]

    @property
    def draft_key(self) -> str | None:
        return self.group_key[2]

    def fingerprint(self) -> str:
        identity = {"name": self.name, "family": self.family, "method": self.method,
                    "target": self.target, "draft": self.draft, "params": self.params}
        if self.seed_offset:  # only when set, so fingerprints of existing runs stay valid
            identity["seed_offset"] = self.seed_offset
        return _hash(identity)


@dataclass(frozen=True)
class EvalSpec:
    """What the reducer computes. ``options`` passes reducer-specific settings through."""

    fid: bool = True
    reference: str = "digits"
    baseline: str | None = None  # arm that speedups are measured against
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class DatasetSpec:
    """Write a dataset (one Parquet partition per run or date, plus a dataset card) instead of an eval run.

    ``value`` is resolved by :func:`load_job`: the date (``YYYY-MM-DD``, UTC today unless given) or
    the run id (the job fingerprint unless given), so rerunning the same partition resumes it.
    """

    partition: str = "date"  # one of DATASET_PARTITIONS
    value: str = ""
    name: str | None = None  # title of the dataset card (default: the job id)
    description: str = ""

    @property
    def partition_dir(self) -> str:
        """Hive-style directory of this partition, e.g. ``date=2026-11-29``."""
        return f"{self.partition}={self.value}"


@dataclass(frozen=True)
class JobSpec:
    job_id: str
    seed: int
    output: str
    conditions: ConditionSpec
    arms: tuple[ArmSpec, ...]
    batch_size: int = 32
    shard_batches: int = 4
    actors: str | int = "auto"
    num_cpus_per_actor: float = 1.0
    num_gpus_per_actor: float = 0.0
    max_shard_retries: int = 3
    eval: EvalSpec = field(default_factory=EvalSpec)
    # s3fs options without credentials (endpoint_url, region_name...); credentials come from the AWS environment.
    storage_options: dict[str, Any] = field(default_factory=dict)
    dataset: DatasetSpec | None = None
    compile: bool = False  # the families' compiled paths (specray.models.compiled)

    @property
    def shard_size(self) -> int:
        return self.batch_size * self.shard_batches

    @property
    def num_samples(self) -> int:
        return self.conditions.num_samples

    @property
    def intra_op_threads(self) -> int:
        """torch's thread count in an actor on a CPU: one per CPU Ray reserves for it (at least one)."""
        return max(1, int(self.num_cpus_per_actor))

    def prompt_set(self):
        """A prompt job's :class:`~specray.prompts.PromptSet` (read once per process), else None."""
        source = self.conditions.prompts
        if source is None:
            return None
        from specray.prompts import load_prompts

        prompts = load_prompts(**source.read_options(), storage_options=self.storage_options)
        if prompts.digest != source.digest:
            raise SpecError("conditions.source", f"{_short(source.source)} changed since the job was validated "
                                                 f"(digest {prompts.digest}, expected {source.digest})")
        return prompts

    def arm(self, name: str) -> ArmSpec:
        for arm in self.arms:
            if arm.name == name:
                return arm
        raise KeyError(name)

    def arm_groups(self) -> list[tuple[tuple[str, str, str | None], tuple[ArmSpec, ...]]]:
        """Arms grouped by model pair, in first-appearance order; arm order kept inside a group."""
        groups: dict[tuple[str, str, str | None], list[ArmSpec]] = {}
        for arm in self.arms:
            groups.setdefault(arm.group_key, []).append(arm)
        return [(key, tuple(arms)) for key, arms in groups.items()]

    def fingerprint(self) -> str:
        """Hash of everything that determines the samples (not output, actors, retries...)."""
        return _hash(self.sample_determining())

    def sample_determining(self) -> dict[str, Any]:
        return _plain({
            "format": SPEC_FORMAT_VERSION,
            "job_id": self.job_id,
            "seed": self.seed,
            "conditions": self._conditions_determining(),
            "batch_size": self.batch_size,
            "arms": {arm.name: arm.fingerprint() for arm in self.arms},
            # Compiled kernels round differently from eager ones, which can change a sample (rarely):
            # a run does not mix the two. Only when set, so existing runs keep their fingerprints.
            **({"compile": True} if self.compile else {}),
            # On a CPU torch's BLAS and attention sum in another order at another thread count (its one-query
            # attention gives other bits in ~4 % of outputs at 2 threads than at 1). Only when not 1, as above.
            **({"intra_op_threads": self.intra_op_threads} if self.intra_op_threads != 1 else {}),
        })

    def _conditions_determining(self) -> dict[str, Any]:
        c = self.conditions
        if c.prompts is None:  # the same dict as before prompts existed: class jobs keep their fingerprints
            return {"kind": c.kind, "per_class": c.per_class, "classes": c.classes}
        # the prompt set by its content (digest), not by where the file lies or how it was read
        p = c.prompts
        return {"kind": c.kind, "repeats": c.repeats, "num_prompts": p.num_prompts, "digest": p.digest,
                "encoder": p.encoder, "encoder_path": p.encoder_path}

    def conditions_dict(self) -> dict[str, Any]:
        """The conditions as a job file gives them (prompt sources with their measured count and digest)."""
        c = self.conditions
        if c.prompts is None:
            return {"kind": c.kind, "per_class": c.per_class, "classes": list(c.classes or [])}
        fields = {k: v for k, v in asdict(c.prompts).items() if k not in ("first", "sample", "sample_seed")}
        subset = ({"first": c.prompts.first} if c.prompts.first is not None else
                  {"sample": c.prompts.sample, "seed": c.prompts.sample_seed} if c.prompts.sample is not None else None)
        return {"kind": c.kind, "repeats": c.repeats, **fields, "subset": subset}

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :func:`load_job` accepts again (params already resolved)."""
        data = asdict(self)
        data["conditions"] = self.conditions_dict()
        data["arms"] = [asdict(a) for a in self.arms]
        return data


# ---------------------------------------------------------------- loading


def load_job(source: str | os.PathLike | Mapping[str, Any], **overrides: Any) -> JobSpec:
    """Load and validate a job from a YAML path or a dict.

    ``overrides`` replace top-level fields (``output``, ``actors``...) and
    ``per_class`` replaces ``conditions.per_class``; they are validated too.
    """
    if isinstance(source, Mapping):
        data = dict(source)
    else:
        data = read_job_file(Path(source))
    per_class = overrides.pop("per_class", None)
    for key, value in overrides.items():
        if value is not None:
            data[key] = value
    if per_class is not None:
        conditions = dict(data.get("conditions") or {})
        # per_class is the samples per condition: per class label, or per prompt (its repeats)
        conditions["repeats" if conditions.get("kind") == "prompts" else "per_class"] = per_class
        data["conditions"] = conditions
    return parse_job(data)


def read_job_file(path: Path) -> dict[str, Any]:
    """The mapping a YAML job file holds (SpecError naming the file, and the line when it is not one).

    Bounded whatever the file holds: at most :data:`JOB_FILE_MAX_BYTES` are read, and the YAML is
    refused before it is built when its aliases would expand past :data:`YAML_MAX_NODES` nodes or
    nest deeper than :data:`YAML_MAX_DEPTH` (see :func:`check_yaml_expansion`).
    """
    import yaml

    where = f"job file {str(path)!r}"
    try:
        if not path.is_file():
            raise SpecError("", f"{where} does not exist (or is not a regular file)")
        with open(path, "rb") as handle:
            raw = handle.read(JOB_FILE_MAX_BYTES + 1)
    except OSError as exc:
        raise SpecError("", f"{where} cannot be read: {exc.strerror or type(exc).__name__}") from None
    if len(raw) > JOB_FILE_MAX_BYTES:
        raise SpecError("", f"{where} is larger than {JOB_FILE_MAX_BYTES // 1024} KiB; a job file names arms "
                            "and settings, not data (list conditions or prompts in a file it points to)")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError("", f"{where} is not UTF-8 text (byte {exc.start})") from None
    try:
        check_yaml_expansion(text, where)
        data = yaml.load(text, Loader=_safe_loader())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise SpecError("", f"{where} is not valid YAML{at}: {problem}") from None
    except (ValueError, OverflowError, RecursionError) as exc:  # e.g. an integer of 10^5 digits, 2026-13-45
        if isinstance(exc, SpecError):
            raise
        raise SpecError("", f"{where} holds a value YAML cannot build: {str(exc).splitlines()[0][:200]}") from None
    if not isinstance(data, dict):
        raise SpecError("", f"{where} must hold a mapping of fields, got {type(data).__name__}")
    return data


def _safe_loader():
    import yaml

    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: same rules, faster


def check_yaml_expansion(text: str, where: str = "job file") -> None:
    """Refuse YAML whose aliases expand beyond :data:`YAML_MAX_NODES` nodes or :data:`YAML_MAX_DEPTH` levels.

    Walks the parser's events once (no objects are built), keeping for each anchor the size and
    height its node has when every alias inside it is expanded, so the check costs one pass
    over the text however large the expansion would be.
    """
    import yaml

    sizes: dict[str, tuple[int, int]] = {}  # anchor -> (expanded nodes, expanded height)
    stack: list[list[Any]] = []  # open collections: [anchor, nodes, height of the tallest child]
    total = 0

    def add(nodes: int, height: int, anchor: str | None) -> None:
        nonlocal total
        total += nodes
        depth = len(stack) + height
        if total > YAML_MAX_NODES:
            raise SpecError("", f"{where} expands to more than {YAML_MAX_NODES} YAML nodes (through anchors "
                                "and aliases, &name / *name); refusing it before building it")
        if depth > YAML_MAX_DEPTH:
            raise SpecError("", f"{where} nests deeper than {YAML_MAX_DEPTH} levels (aliases included)")
        if stack:
            stack[-1][1] += nodes
            stack[-1][2] = max(stack[-1][2], height)
        if anchor is not None:
            sizes[anchor] = (nodes, height)

    for event in yaml.parse(text, Loader=_safe_loader()):
        if isinstance(event, yaml.AliasEvent):
            if event.anchor not in sizes:
                raise SpecError("", f"{where}: alias *{event.anchor} refers to no complete anchor (undefined, or "
                                    "a node that contains the alias itself)")
            add(*sizes[event.anchor], None)
        elif isinstance(event, yaml.ScalarEvent):
            add(1, 1, event.anchor)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) + 1 > YAML_MAX_DEPTH:
                raise SpecError("", f"{where} nests deeper than {YAML_MAX_DEPTH} levels")
            stack.append([event.anchor, 1, 0])
            total += 1
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, nodes, child_height = stack.pop()
            total -= nodes  # add() counts the finished collection into its parent and the total again
            add(nodes, child_height + 1, anchor)


_TOP_LEVEL = {
    "job_id", "seed", "output", "conditions", "arms", "batch_size", "shard_batches", "shard_size",
    "actors", "num_cpus_per_actor", "num_gpus_per_actor", "max_shard_retries", "eval",
    "storage_options", "dataset", "compile",
}


def parse_job(data: Mapping[str, Any]) -> JobSpec:
    if not isinstance(data, Mapping):
        raise SpecError("", f"a job must be a mapping of fields, got {type(data).__name__}")
    _reject_unknown("", data, _TOP_LEVEL)
    _check_plain("", data)
    for required in ("output", "arms"):
        if required not in data:
            raise SpecError(required, "is required")
    job_id = _name("job_id", data.get("job_id", "specray-job"))
    seed = _integer("seed", data.get("seed", 0), minimum=0, maximum=MAX_SEED)
    output = _validate_output("output", data["output"])
    batch_size = _integer("batch_size", data.get("batch_size", 32), minimum=1, maximum=MAX_BATCH_SIZE)
    shard_batches = _shard_batches(data, batch_size)
    actors = data.get("actors", "auto")
    if actors != "auto":
        actors = _integer("actors", actors, minimum=1, maximum=100_000, allowed_text='"auto" or an integer >= 1')
    num_cpus = _number("num_cpus_per_actor", data.get("num_cpus_per_actor", 1), minimum=0.0, maximum=1024.0)
    num_gpus = _number("num_gpus_per_actor", data.get("num_gpus_per_actor", 0), minimum=0.0, maximum=64.0)
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise SpecError("num_gpus_per_actor", f"must be a fraction <= 1 or a whole number, got {num_gpus}")
    if num_cpus == 0 and num_gpus == 0:
        raise SpecError("num_cpus_per_actor", "must be > 0 when num_gpus_per_actor is 0")
    retries = _integer("max_shard_retries", data.get("max_shard_retries", 3), minimum=0, maximum=1000)

    arms = _arms("arms", data["arms"])
    compile_steps = _compile("compile", data.get("compile", False), arms)
    storage_options = _storage_options("storage_options", data.get("storage_options"))
    conditions = _conditions("conditions", data.get("conditions", {}), arms, storage_options)
    _check_sizes(conditions, arms, batch_size, shard_batches, "shard_size" in data)
    eval_spec = _eval("eval", data.get("eval", {}), arms)
    if eval_spec.fid and conditions.num_samples < 2:
        field_name = "repeats" if conditions.prompts is not None else "per_class"
        raise SpecError(f"conditions.{field_name}", f"{conditions.num_samples} sample per arm; FID needs at least 2 "
                                                    f"(raise {field_name}, or set eval.fid: false)")
    spec = JobSpec(
        job_id=job_id, seed=seed, output=output, conditions=conditions, arms=arms,
        batch_size=batch_size, shard_batches=shard_batches, actors=actors,
        num_cpus_per_actor=num_cpus, num_gpus_per_actor=num_gpus, max_shard_retries=retries,
        eval=eval_spec, storage_options=storage_options, compile=compile_steps,
    )
    dataset = _dataset("dataset", data.get("dataset"), spec)
    return replace(spec, dataset=dataset) if dataset is not None else spec


def _compile(path: str, raw: Any, arms: tuple[ArmSpec, ...]) -> bool:
    from specray.families import FAMILIES

    if not isinstance(raw, bool):
        raise SpecError(path, f"must be true or false, got {_short(raw)}")
    if raw:
        able = [name for name, family in FAMILIES.items() if family.compile is not None]
        for i, arm in enumerate(arms):
            if FAMILIES[arm.family].compile is None:
                raise SpecError(path, f"arms[{i}] ({arm.name!r}) is family {arm.family!r}, which has no compiled "
                                      f"path; families with one: {', '.join(able) or 'none'} "
                                      "(set compile: false, or run that arm in another job)")
    return raw


def _shard_batches(data: Mapping[str, Any], batch_size: int) -> int:
    if "shard_batches" in data and "shard_size" in data:
        raise SpecError("shard_size", "give either shard_batches or shard_size, not both")
    if "shard_size" in data:
        size = _integer("shard_size", data["shard_size"], minimum=1, maximum=MAX_SAMPLES)
        if size % batch_size:
            raise SpecError("shard_size", f"must be a multiple of batch_size ({batch_size}), got {size}")
        return size // batch_size
    return _integer("shard_batches", data.get("shard_batches", 4), minimum=1, maximum=MAX_SAMPLES)


def _check_sizes(conditions: "ConditionSpec", arms: tuple["ArmSpec", ...], batch_size: int, shard_batches: int,
                 by_size: bool) -> None:
    """Refuse jobs too large to plan and verify, before anything is planned (arithmetic only)."""
    samples = conditions.num_samples
    if samples > MAX_SAMPLES:
        raise SpecError("conditions.per_class", f"per_class {conditions.per_class} x {len(conditions.classes or ())} "
                                                f"classes = {samples} samples, more than the {MAX_SAMPLES} a job may "
                                                "have (the reducer keeps one bit per sample and arm in memory); "
                                                "split it into several jobs with different seeds")
    shards = -(-samples // (batch_size * shard_batches))
    field_name = "shard_size" if by_size else "shard_batches"
    if shards > MAX_SHARDS:
        raise SpecError(field_name, f"{samples} samples in shards of {batch_size * shard_batches} make {shards} "
                                    f"shards per arm, more than {MAX_SHARDS} (the manifest lists every file); "
                                    "make shards larger")
    if shards * len(arms) > MAX_SHARD_FILES:
        raise SpecError(field_name, f"{shards} shards x {len(arms)} arms = {shards * len(arms)} files, more than "
                                    f"{MAX_SHARD_FILES} (one manifest entry and one existence check each); "
                                    "make shards larger or split the arms into several jobs")


_ARM_FIELDS = {"name", "family", "method", "target", "draft", "params", "seed_offset"}


def _arms(path: str, raw: Any) -> tuple[ArmSpec, ...]:
    from specray.families import FAMILIES
    from specray.methods.params import ParamError

    if not isinstance(raw, list) or not raw:
        raise SpecError(path, "must be a non-empty list of arms")
    if len(raw) > MAX_ARMS:
        raise SpecError(path, f"has {len(raw)} arms, more than {MAX_ARMS}; split them into several jobs")
    arms: list[ArmSpec] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(raw):
        at = f"{path}[{i}]"
        if not isinstance(item, Mapping):
            raise SpecError(at, f"must be a mapping with fields {sorted(_ARM_FIELDS)}")
        _reject_unknown(at, item, _ARM_FIELDS)
        for required in ("family", "method", "target"):
            if required not in item:
                raise SpecError(f"{at}.{required}", "is required")
        family_name = _string(f"{at}.family", item["family"])
        if family_name not in FAMILIES:
            raise SpecError(f"{at}.family", f"unknown family {_short(family_name)}; allowed: {', '.join(sorted(FAMILIES))}")
        family = FAMILIES[family_name]
        method = _string(f"{at}.method", item["method"])
        if method not in family.methods:
            raise SpecError(f"{at}.method", f"unknown method {_short(method)} for family {family_name!r}; "
                                            f"allowed: {', '.join(family.methods)}")
        name = _name(f"{at}.name", item.get("name", method))
        if name in seen:
            raise SpecError(f"{at}.name", f"duplicate arm name {name!r} (also arms[{seen[name]}]); arm names must be unique")
        seen[name] = i
        target = _model_ref(f"{at}.target", item["target"], family_name)
        draft = item.get("draft")
        if draft is not None:
            draft = _model_ref(f"{at}.draft", draft, family_name)
        try:  # the method's parameter class is the one place its parameters are checked
            params = family.parse_params(method, _with_official_defaults(family, method, target, item.get("params")))
        except ParamError as exc:
            raise SpecError(f"{at}.params" + (f".{exc.field}" if exc.field else ""), redact_urls(exc.message)) from None
        if params.needs_draft and draft is None:
            raise SpecError(f"{at}.draft", f"method {method!r} with these params needs a draft model; "
                                           f"name one (a preset of family {family_name!r} or a checkpoint)")
        problem = family.check_arm(params, target, draft) if family.check_arm is not None else None
        if problem is not None:
            raise SpecError(f"{at}.{problem[0]}", problem[1])
        seed_offset = _integer(f"{at}.seed_offset", item.get("seed_offset", 0), minimum=0, maximum=MAX_SEED)
        arms.append(ArmSpec(name=name, family=family_name, method=method, target=target, draft=draft,
                            params=params.to_dict(), seed_offset=seed_offset))
    return tuple(arms)


def _with_official_defaults(family: Any, method: str, target: Any, raw: Any) -> Any:
    """An arm's params with the unset ones taken from its release's official sampler (a target named
    as ``{format: ...}``; see ``specray.models.checkpoints.options``); the params as given otherwise."""
    from specray.families import format_options

    options = format_options(family.name, target)
    official = getattr(options, "sampling_defaults", None)  # optional for a format's options class
    if official is None or not (raw is None or isinstance(raw, Mapping)):
        return raw
    fields = family.method(method).params.model_fields
    defaults = {k: v for k, v in official().items() if k in fields}
    return {**defaults, **(raw or {})}


def _model_ref(path: str, value: Any, family: str) -> str | dict[str, Any]:
    """A preset name of the arm's family, a checkpoint path, or a ``{format: NAME, ...}`` mapping
    validated by the family's options class for that format."""
    if isinstance(value, Mapping):
        return _formatted_model_ref(path, value, family)
    return _string_model_ref(path, _string(path, value), family)


_PICKLE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def _string_model_ref(path: str, name: str, family_name: str) -> str:
    """A string reference that a loader of ``family_name`` can read, checked without reading tensors.

    Strings name a built-in preset (its weights file must be there) or a local ``.safetensors``
    file whose metadata holds the model's ``config`` (what the families' loaders build the model
    from). Everything else -- a directory, a pickle (.pt/.pth/.bin/.ckpt), a remote URL -- is read
    only through a ``{format: NAME, ...}`` mapping, when the family has such a format.
    """
    from specray.families import family
    from specray.models.presets import get_preset

    formats = ", ".join(family(family_name).formats) or "none yet"
    mapping_hint = f"name it as {{format: NAME, path: ...}} with a format of family {family_name!r} ({formats})"
    if not _looks_like_checkpoint(name):
        try:
            preset = get_preset(name)
        except KeyError as exc:
            raise SpecError(path, str(exc.args[0])) from None
        if preset.family != family_name:
            raise SpecError(path, f"preset {name!r} belongs to family {preset.family!r}, not {family_name!r}")
        if preset.role == "feature":
            raise SpecError(path, f"preset {name!r} is a feature extractor, not a generator")
        if family(family_name).metadata.get("preset_weights") and not preset.weights_path.is_file():
            raise SpecError(path, f"preset {name!r} has no weights file at {str(preset.weights_path)!r}; "
                                  f"run `specray train {name}` to make it")
        return name
    if "://" in name:
        from specray.urls import redact_url

        raise SpecError(path, f"checkpoint {redact_url(name)!r} is a URL; checkpoints are read from local files "
                              f"(copy it to the node first) or {mapping_hint}")
    file = Path(name).expanduser()
    suffix = file.suffix.lower()
    if suffix in _PICKLE_SUFFIXES:
        raise SpecError(path, f"checkpoint {name!r}: no loader reads a {suffix} file named by a string (it may be "
                              f"a pickle); give a .safetensors file with a 'config' entry in its metadata, or "
                              f"{mapping_hint}")
    if not file.exists():
        raise SpecError(path, f"checkpoint {name!r} does not exist; give an existing .safetensors file "
                              "or a built-in preset name")
    if file.is_dir():
        raise SpecError(path, f"checkpoint {name!r} is a directory; a string names one .safetensors file. To "
                              f"read a folder, {mapping_hint}")
    if suffix != ".safetensors" or not file.is_file():
        raise SpecError(path, f"checkpoint {name!r} is not a .safetensors file; give one, or {mapping_hint}")
    problem = safetensors_header_problem(file)
    if problem:
        raise SpecError(path, f"checkpoint {name!r} is not a valid safetensors file: {problem}")
    config = safetensors_metadata(file).get("config")
    try:
        config_ok = isinstance(json.loads(config), dict) if isinstance(config, str) else False
    except ValueError:
        config_ok = False
    if not config_ok:
        raise SpecError(path, f"checkpoint {name!r} has no JSON 'config' entry in its safetensors metadata; the "
                              f"loaders of family {family_name!r} build the model from it (specray's trainers "
                              f"write it), or {mapping_hint}")
    return name


def _formatted_model_ref(path: str, value: Mapping[str, Any], family_name: str) -> dict[str, Any]:
    from specray.families import family
    from specray.methods.params import ParamError

    fmt = value.get("format")
    if "format" not in value:
        raise SpecError(f"{path}.format", "is required in a model mapping ({format: NAME, ...options})")
    try:
        entry = family(family_name).model_format(_string(f"{path}.format", fmt))
    except KeyError as exc:
        raise SpecError(f"{path}.format", str(exc.args[0])) from None
    try:
        options = entry.options.parse({k: v for k, v in value.items() if k != "format"})
    except ParamError as exc:
        raise SpecError(f"{path}" + (f".{exc.field}" if exc.field else ""), redact_urls(exc.message)) from None
    return {"format": entry.name, **options.to_dict()}


def _looks_like_checkpoint(name: str) -> bool:
    return "/" in name or "://" in name or name.lower().endswith((".safetensors", *_PICKLE_SUFFIXES))


# A safetensors file: 8-byte little-endian header length, a JSON header, then the tensor bytes.
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def safetensors_header_problem(file: Path) -> str | None:
    """Why ``file`` is not a complete safetensors file (None when its header is sound)."""
    size = file.stat().st_size
    with open(file, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) < 8:
            return f"{size} bytes, shorter than the 8-byte header length"
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len == 0 or header_len > min(_SAFETENSORS_MAX_HEADER, size - 8):
            return f"header length {header_len} does not fit the file ({size} bytes): corrupt or truncated"
        raw = handle.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return f"header is not JSON ({exc.__class__.__name__}): corrupt"
    if not isinstance(header, dict):
        return "header is not a JSON object: corrupt"
    data_bytes = size - 8 - header_len
    end = 0
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            start, stop = (int(v) for v in info["data_offsets"])
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            width = _SAFETENSORS_DTYPE_BYTES[info["dtype"]]
        except (KeyError, TypeError, ValueError):
            return f"tensor {tensor!r} has a malformed header entry: corrupt"
        if not 0 <= start <= stop or stop - start != count * width:
            return f"tensor {tensor!r} has inconsistent offsets: corrupt"
        end = max(end, stop)
    if end > data_bytes:
        return f"tensors need {end} data bytes but the file holds {data_bytes}: truncated"
    if not any(k != "__metadata__" for k in header):
        return "it holds no tensors"
    return None


def safetensors_metadata(file: Path) -> dict[str, str]:
    """The ``__metadata__`` of a sound safetensors file (ValueError saying what is wrong otherwise);
    reads the header only."""
    problem = safetensors_header_problem(file)
    if problem:
        raise ValueError(problem)
    with open(file, "rb") as handle:
        (header_len,) = struct.unpack("<Q", handle.read(8))
        metadata = json.loads(handle.read(header_len)).get("__metadata__")
    return dict(metadata) if isinstance(metadata, dict) else {}


_STORAGE_OPTION_FIELDS = {"endpoint_url", "region_name", "anon", "requester_pays", "config_kwargs"}
_CREDENTIAL_OPTION_WORDS = ("key", "secret", "token", "password", "credential", "profile")


def _storage_options(path: str, raw: Any) -> dict[str, Any]:
    """s3fs options for an s3:// output; credentials are refused here (they would be stored with the run)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be a mapping with fields {sorted(_STORAGE_OPTION_FIELDS)}")
    for key in raw:
        if any(word in str(key).lower() for word in _CREDENTIAL_OPTION_WORDS):
            raise SpecError(f"{path}.{key}", "credentials are never read from a job file (it is copied into "
                                             "_job.json and the manifest); set AWS_ACCESS_KEY_ID / "
                                             "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) in the environment instead")
    _reject_unknown(path, raw, _STORAGE_OPTION_FIELDS)
    from specray.urls import CREDENTIALS_BELONG, has_userinfo, redact_url

    endpoint = raw.get("endpoint_url")
    if endpoint is not None:
        endpoint = _string(f"{path}.endpoint_url", endpoint)
        if has_userinfo(endpoint):
            raise SpecError(f"{path}.endpoint_url", f"{redact_url(endpoint)!r} carries credentials in the URL; "
                                                    f"they are never read from a job: {CREDENTIALS_BELONG}")
        if not re.match(r"^https?://[^/@\s]+(/.*)?$", endpoint):
            raise SpecError(f"{path}.endpoint_url", f"must be http(s)://HOST[:PORT], got {_short(endpoint)}")
    if raw.get("region_name") is not None:
        _string(f"{path}.region_name", raw["region_name"])
    for flag in ("anon", "requester_pays"):
        if flag in raw and not isinstance(raw[flag], bool):
            raise SpecError(f"{path}.{flag}", f"must be true or false, got {_short(raw[flag])}")
    if "config_kwargs" in raw and not isinstance(raw["config_kwargs"], Mapping):
        raise SpecError(f"{path}.config_kwargs", "must be a mapping (botocore Config arguments)")
    return _plain({k: v for k, v in raw.items() if v is not None})


_DATASET_FIELDS = {"partition", "value", "date", "run_id", "name", "description"}


def _dataset(path: str, raw: Any, spec: "JobSpec") -> DatasetSpec | None:
    """Resolve the dataset partition (today's UTC date, or the job fingerprint as run id) once, here."""
    from datetime import date, datetime, timezone

    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be a mapping with fields {sorted(_DATASET_FIELDS)}")
    _reject_unknown(path, raw, _DATASET_FIELDS)
    partition = raw.get("partition", "date")
    if partition not in DATASET_PARTITIONS:
        raise SpecError(f"{path}.partition", f"unknown partition {_short(partition)}; allowed: {', '.join(DATASET_PARTITIONS)}")
    alias = "date" if partition == "date" else "run_id"
    other = "run_id" if partition == "date" else "date"
    if other in raw:
        raise SpecError(f"{path}.{other}", f"only used with partition: {other.replace('_id', '')}; "
                                           f"this dataset is partitioned by {partition}")
    if "value" in raw and alias in raw:
        raise SpecError(f"{path}.value", f"give either value or {alias}, not both")
    at = f"{path}.{alias}" if alias in raw else f"{path}.value"
    value = raw.get(alias, raw.get("value"))
    if partition == "date":
        if value in (None, "", "today"):
            value = datetime.now(timezone.utc).date().isoformat()
        elif isinstance(value, date):  # YAML reads an unquoted 2026-11-29 as a date
            value = value.isoformat()
        else:
            try:
                value = date.fromisoformat(_string(at, value)).isoformat()
            except ValueError:
                raise SpecError(at, f'must be "today" or a date YYYY-MM-DD, got {_short(value)}') from None
    else:
        if value in (None, ""):
            value = spec.fingerprint()
        value = _name(at, value)
    name = raw.get("name")
    if name is not None:
        name = _string(f"{path}.name", name)
    description = raw.get("description") or ""
    if not isinstance(description, str):
        raise SpecError(f"{path}.description", f"must be a string, got {_short(description)}")
    return DatasetSpec(partition=partition, value=value, name=name, description=description)


_CONDITION_FIELDS = {"kind", "per_class", "classes"}
_PROMPT_FIELDS = {"kind", "source", "format", "text_column", "id_column", "captions", "subset", "repeats",
                  "max_chars", "encoder", "encoder_path", "num_prompts", "digest"}


def _conditions(path: str, raw: Any, arms: tuple[ArmSpec, ...],
                storage_options: Mapping[str, Any] | None = None) -> ConditionSpec:
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be a mapping with fields {sorted(_CONDITION_FIELDS)}")
    kind = _string(f"{path}.kind", raw.get("kind", "class_labels"))
    if kind not in CONDITION_KINDS:
        raise SpecError(f"{path}.kind", f"unknown condition kind {_short(kind)}; allowed: {', '.join(CONDITION_KINDS)}")
    _check_condition_models(path, kind, arms)
    if kind == "prompts":
        return _prompt_conditions(path, raw, arms, storage_options)
    _reject_unknown(path, raw, _CONDITION_FIELDS)
    per_class = _integer(f"{path}.per_class", raw.get("per_class", 100), minimum=1, maximum=MAX_SAMPLES)
    num_classes = _num_classes(arms)
    classes_raw = raw.get("classes", "all")
    if classes_raw == "all" or classes_raw is None:
        if num_classes is None:
            raise SpecError(f"{path}.classes", "the target presets do not say how many classes they have; list the classes")
        classes = tuple(range(num_classes))
    else:
        if not isinstance(classes_raw, list) or not classes_raw:
            raise SpecError(f"{path}.classes", f'must be "all" or a non-empty list of class labels, got '
                                               f'{_short(classes_raw)}')
        if len(classes_raw) > MAX_SAMPLES:
            raise SpecError(f"{path}.classes", f"lists {len(classes_raw)} classes, more than {MAX_SAMPLES}")
        classes = tuple(_integer(f"{path}.classes[{i}]", c, minimum=0, maximum=MAX_SAMPLES)
                        for i, c in enumerate(classes_raw))
        seen: dict[int, int] = {}
        for i, label in enumerate(classes):
            if num_classes is not None and label >= num_classes:
                raise SpecError(f"{path}.classes[{i}]", f"class label {label} out of range; allowed: 0..{num_classes - 1}")
            if label in seen:
                raise SpecError(f"{path}.classes[{i}]", f"class label {label} listed twice")
            seen[label] = i
    return ConditionSpec(kind=kind, per_class=per_class, classes=classes)


def _prompt_conditions(path: str, raw: Mapping[str, Any], arms: tuple[ArmSpec, ...],
                       storage_options: Mapping[str, Any] | None) -> ConditionSpec:
    """``kind: prompts``: the prompt set is read and checked now, before Ray starts."""
    from specray.prompts import COCO_CAPTIONS, FORMATS, PromptSetError, load_prompts
    from specray.urls import CREDENTIALS_BELONG, has_userinfo, redact_url

    _reject_unknown(path, raw, _PROMPT_FIELDS)
    if "source" not in raw:
        raise SpecError(f"{path}.source", "is required for prompts: a JSONL, CSV, Parquet or COCO captions file, "
                                          "a datasets folder (local or s3://), or builtin:digits-captions")
    source = _string(f"{path}.source", raw["source"])
    if has_userinfo(source):
        raise SpecError(f"{path}.source", f"{redact_url(source)!r} carries credentials in the URL: "
                                          f"{CREDENTIALS_BELONG}")
    fmt = _choice(f"{path}.format", raw.get("format", "auto"), FORMATS)
    captions = _choice(f"{path}.captions", raw.get("captions", "first"), COCO_CAPTIONS)
    first, sample, sample_seed = _prompt_subset(f"{path}.subset", raw.get("subset"))
    encoder, encoder_path = _text_encoder(path, raw, arms)
    options = PromptSource(
        source=source, format=fmt, captions=captions, first=first, sample=sample, sample_seed=sample_seed,
        text_column=_string(f"{path}.text_column", raw.get("text_column", "prompt")),
        id_column=_string(f"{path}.id_column", raw.get("id_column", "id")),
        max_chars=_integer(f"{path}.max_chars", raw.get("max_chars", 2000), minimum=1, maximum=100_000),
        encoder=encoder, encoder_path=encoder_path)
    try:
        prompts = load_prompts(**options.read_options(), storage_options=storage_options)
    except PromptSetError as exc:
        raise SpecError(f"{path}.{exc.field}", exc.message) from None
    for name, measured in (("num_prompts", len(prompts)), ("digest", prompts.digest)):
        if name in raw and raw[name] != measured:  # a recorded job pins its prompt set
            raise SpecError(f"{path}.{name}", f"the job records {_short(raw[name])} but {_short(source)} now gives "
                                              f"{measured}: the prompt set changed")
    repeats = _integer(f"{path}.repeats", raw.get("repeats", 1), minimum=1, maximum=MAX_SAMPLES)
    if repeats * len(prompts) > MAX_SAMPLES:
        raise SpecError(f"{path}.repeats", f"{repeats} x {len(prompts)} prompts is more than {MAX_SAMPLES} samples")
    return ConditionSpec(kind="prompts", per_class=repeats, classes=None, repeats=repeats,
                         prompts=replace(options, num_prompts=len(prompts), digest=prompts.digest))


def _prompt_subset(path: str, raw: Any) -> tuple[int | None, int | None, int]:
    if raw is None:
        return None, None, 0
    if not isinstance(raw, Mapping) or not ({"first"} == set(raw) or set(raw) in ({"sample"}, {"sample", "seed"})):
        raise SpecError(path, f"must be {{first: N}} or {{sample: N, seed: S}}, got {_short(raw)}")
    if "first" in raw:
        return _integer(f"{path}.first", raw["first"], minimum=1, maximum=MAX_SAMPLES), None, 0
    return (None, _integer(f"{path}.sample", raw["sample"], minimum=1, maximum=MAX_SAMPLES),
            _integer(f"{path}.seed", raw.get("seed", 0), minimum=0, maximum=MAX_SEED))


def _text_encoder(path: str, raw: Mapping[str, Any], arms: tuple[ArmSpec, ...]) -> tuple[str, str | None]:
    """The encoder every arm's model was trained with (a job may name another: ``encoder``, ``encoder_path``)."""
    from specray.prompts import ENCODERS

    trained = {_preset_config(ref).get("text_encoder", "minilm") for arm in arms for ref in (arm.target, arm.draft)
               if _preset_config(ref).get("condition") == "text"}
    if "encoder" in raw:
        encoder = _choice(f"{path}.encoder", raw["encoder"], ENCODERS)
    elif len(trained) == 1:
        encoder = trained.pop()
    else:
        raise SpecError(f"{path}.encoder", f"the arms' models were trained with different text encoders "
                                           f"({sorted(trained)}) or do not say which; give encoder: one of "
                                           f"{', '.join(ENCODERS)}" if trained else
                                           f"the arms' models do not say which text encoder they were trained "
                                           f"with; give encoder: one of {', '.join(ENCODERS)}")
    encoder_path = raw.get("encoder_path")
    if encoder == "t5":
        encoder_path = _string(f"{path}.encoder_path", encoder_path)
        if "://" not in encoder_path and not Path(encoder_path).is_dir():
            raise SpecError(f"{path}.encoder_path", f"{_short(encoder_path)} is not a folder (a T5 encoder saved "
                                                    "with save_pretrained: config.json and its weights)")
    elif encoder_path is not None:
        raise SpecError(f"{path}.encoder_path", f"only the t5 encoder reads a folder; {encoder!r} is built in")
    return encoder, encoder_path


def _check_condition_models(path: str, kind: str, arms: tuple[ArmSpec, ...]) -> None:
    """Prompts need text-conditioned models and class labels class-conditioned ones (presets are known now)."""
    for i, arm in enumerate(arms):
        for role in ("target", "draft"):
            ref = getattr(arm, role)
            if isinstance(ref, Mapping):  # a release format says which conditions its models take
                text = _format_conditions(arm.family, ref) == "prompts"
            elif _preset_config(ref):
                text = _preset_config(ref).get("condition") == "text"
            else:
                continue
            if text != (kind == "prompts"):
                name = getattr(arm, role)
                wanted = "text-conditioned" if kind == "prompts" else "class-conditioned"
                raise SpecError(f"arms[{i}].{role}", f"{_short(name)} is {'text' if text else 'class'}-conditioned "
                                                     f"but {path}.kind is {kind!r}, which needs {wanted} models")


def _format_conditions(family_name: str, ref: Mapping[str, Any]) -> str:
    from specray.families import FAMILIES

    entry = FAMILIES.get(family_name)
    model_format = entry.formats.get(str(ref.get("format"))) if entry is not None else None
    return model_format.conditions if model_format is not None else "class_labels"


def _preset_config(ref: Any) -> dict[str, Any]:
    """A preset's config; {} for anything else (a checkpoint file, a format mapping, none)."""
    from specray.models.presets import PRESETS

    if isinstance(ref, str) and ref in PRESETS:
        return dict(PRESETS[ref].config)
    return {}


def _choice(path: str, value: Any, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise SpecError(path, f"must be one of {', '.join(allowed)}, got {_short(value)}")
    return value


def _num_classes(arms: tuple[ArmSpec, ...]) -> int | None:
    """The smallest class count among the arms' target (and draft) presets and release checkpoints."""
    from specray.families import format_options
    from specray.models.presets import get_preset

    counts = []
    for arm in arms:
        for ref in (arm.target, arm.draft):
            known = getattr(format_options(arm.family, ref), "num_classes", None)  # optional, as above
            if known is not None:
                counts.append(int(known))
            if not isinstance(ref, str) or _looks_like_checkpoint(ref):
                continue
            n = get_preset(ref).config.get("num_classes")
            if n is not None:
                counts.append(int(n))
    return min(counts) if counts else None


_EVAL_FIELDS = {"fid", "reference", "baseline", "options"}


def _eval(path: str, raw: Any, arms: tuple[ArmSpec, ...]) -> EvalSpec:
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be a mapping with fields {sorted(_EVAL_FIELDS)}")
    _reject_unknown(path, raw, _EVAL_FIELDS)
    fid = raw.get("fid", True)
    if not isinstance(fid, bool):
        raise SpecError(f"{path}.fid", f"must be true or false, got {_short(fid)}")
    reference = _reference(f"{path}.reference", raw.get("reference", "digits"))
    names = [a.name for a in arms]
    baseline = raw.get("baseline")
    if baseline is None:
        baseline = next((a.name for a in arms if a.method == "target_only"), None)
    elif baseline not in names:
        raise SpecError(f"{path}.baseline", f"unknown arm {_short(baseline)}; allowed: {', '.join(names)}")
    options = raw.get("options") or {}
    if not isinstance(options, Mapping):
        raise SpecError(f"{path}.options", "must be a mapping")
    from specray.eval.options import ReduceOptions
    from specray.methods.params import ParamError

    try:  # checked now, not after generation
        ReduceOptions.parse(options)
    except ParamError as exc:
        raise SpecError(f"{path}.options" + (f".{exc.field}" if exc.field else ""), redact_urls(exc.message)) from None
    return EvalSpec(fid=fid, reference=reference, baseline=baseline, options=_plain(options))


def _reference(path: str, value: Any) -> str:
    """FID reference statistics the reducer can read (checked now, not after generation)."""
    from specray.eval.options import check_reference

    reference = _string(path, value)
    try:
        check_reference(reference)
    except ValueError as exc:
        raise SpecError(path, str(exc)) from None
    return reference


# ---------------------------------------------------------------- field checks


def _validate_output(path: str, value: Any) -> str:
    from specray.urls import CREDENTIALS_BELONG, has_userinfo, redact_url

    output = _string(path, value)
    if "://" in output:
        scheme = output.split("://", 1)[0]
        if scheme not in ("s3", "file", "memory"):
            raise SpecError(path, f"unsupported URI scheme {_short(scheme)}; allowed: a local path, file://, s3://")
        if has_userinfo(output):
            raise SpecError(path, f"{redact_url(output)!r} carries credentials in the URL; they are never read "
                                  f"from a job (it is stored with the run): {CREDENTIALS_BELONG}")
        return output
    if "\0" in output:
        raise SpecError(path, "a local path cannot contain a NUL character")
    # Writable without writing anything: the nearest existing ancestor must be a writable directory.
    probe = Path(output).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise SpecError(path, f"{_short(output)} cannot be created: {str(probe)!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecError(path, f"{_short(output)} cannot be written: no write permission on {str(probe)!r}")
    return output


def _reject_unknown(path: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    for key in data:
        if key not in allowed:
            name = str(key) if str(key).strip() else repr(key)  # an empty key still gets a visible name
            at = f"{path}.{name}" if path else name
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SpecError(at, f"unknown field; allowed: {', '.join(sorted(allowed))}{hint}")


def _short(value: Any, limit: int = 80) -> str:
    from specray.urls import safe_repr

    return safe_repr(value, limit)


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(path, f"must be a non-empty string, got {_short(value)}")
    return value


def _name(path: str, value: Any) -> str:
    """A name that becomes a folder or file name: letters, digits, '_', '-', '.', matched in full."""
    name = _string(path, value)
    if len(name) > NAME_MAX_CHARS or not _ARM_NAME.fullmatch(name):
        raise SpecError(path, f"must be 1-{NAME_MAX_CHARS} letters, digits, '_', '-', '.' starting with a letter "
                              f"or digit (it names a directory), got {_short(name)}")
    return name


def _integer(path: str, value: Any, *, minimum: int, maximum: int | None = None,
             allowed_text: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(path, f"must be {allowed_text or f'an integer >= {minimum}'}, got {_short(value)}")
    if maximum is not None and value > maximum:
        raise SpecError(path, f"must be at most {maximum}, got {_short(value)}")
    return int(value)


def _number(path: str, value: Any, *, minimum: float, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum \
            or (isinstance(value, float) and math.isnan(value)):
        raise SpecError(path, f"must be a number >= {minimum}, got {_short(value)}")
    if value > maximum:
        raise SpecError(path, f"must be at most {maximum}, got {_short(value)}")
    return float(value)


_PLAIN_TYPES = (str, int, float, bool, type(None))


def _check_plain(path: str, value: Any, depth: int = 0) -> None:
    """Job data is JSON-like: mappings with string keys, lists, strings, numbers, booleans, null.

    YAML also builds sets, binary and timestamps; they are refused here by field (dates only where a
    date is meant), so nothing later meets a value it cannot store or hash.
    """
    from datetime import date

    if depth > YAML_MAX_DEPTH:
        raise SpecError(path, f"nests deeper than {YAML_MAX_DEPTH} levels")
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, str):
                at = f"{path}.{_short(key)}" if path else _short(key)
                raise SpecError(at, f"a key of type {type(key).__name__}; keys must be strings (field names)")
            _check_plain(f"{path}.{key}" if path else key, item, depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(f"{path}[{i}]", item, depth + 1)
    elif isinstance(value, date) and path in ("dataset.date", "dataset.value"):
        return
    elif not isinstance(value, _PLAIN_TYPES):
        raise SpecError(path, f"must be a string, number, boolean, list or mapping, got a "
                              f"{type(value).__name__} ({_short(value)})")


def _plain(value: Any) -> Any:
    """JSON-compatible copy (tuples -> lists) so fingerprints and manifests are stable."""
    return json.loads(json.dumps(value, sort_keys=True))


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the built-in demo

DEMO_PATH = Path(__file__).with_name("demo.yaml")  # the demo's one definition (package data)
# `specray run` with no job file runs these in turn: the class-label demo, then its prompt part.
DEMO_PATHS = (DEMO_PATH, Path(__file__).with_name("demo_prompts.yaml"))


def builtin_demo_dict() -> dict[str, Any]:
    """The demo job as plain data (``specray/demo.yaml``)."""
    return read_job_file(DEMO_PATH)


def builtin_demo_job(**overrides: Any) -> JobSpec:
    """Every method of the three families on the digits presets, 100 samples per class, output runs/demo."""
    return load_job(builtin_demo_dict(), **overrides)


def with_output(spec: JobSpec, output: str) -> JobSpec:
    return replace(spec, output=_validate_output("output", output))
