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
import os
import re
import struct
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

SPEC_FORMAT_VERSION = 1
CONDITION_KINDS = ("class_labels",)
DATASET_PARTITIONS = ("date", "run")
_ARM_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")  # used with fullmatch: no trailing newline


class SpecError(ValueError):
    """A job spec that cannot run. The message starts with the field path."""

    def __init__(self, field_path: str, message: str):
        self.field_path = field_path
        self.message = message
        super().__init__(f"{field_path}: {message}" if field_path else message)

    def __reduce__(self):  # picklable across processes despite the two-argument constructor
        return (type(self), (self.field_path, self.message))


@dataclass(frozen=True)
class ConditionSpec:
    """Class-label conditions: ``per_class`` samples of each class in ``classes``.

    ``classes`` is None for "all classes the target knows" until
    :func:`load_job` resolves it to an explicit tuple.
    """

    kind: str = "class_labels"
    per_class: int = 100
    classes: tuple[int, ...] | None = None

    @property
    def num_samples(self) -> int:
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

    @property
    def shard_size(self) -> int:
        return self.batch_size * self.shard_batches

    @property
    def num_samples(self) -> int:
        return self.conditions.num_samples

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
            "conditions": asdict(self.conditions),
            "batch_size": self.batch_size,
            "arms": {arm.name: arm.fingerprint() for arm in self.arms},
        })

    def to_dict(self) -> dict[str, Any]:
        """Plain data that :func:`load_job` accepts again (params already resolved)."""
        data = asdict(self)
        data["conditions"]["classes"] = list(self.conditions.classes or [])
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
        conditions["per_class"] = per_class
        data["conditions"] = conditions
    return parse_job(data)


def read_job_file(path: Path) -> dict[str, Any]:
    """The mapping a YAML job file holds (SpecError naming the file and the line when it is not one)."""
    import yaml

    if not path.is_file():
        raise SpecError("", f"job file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError("", f"job file {str(path)!r} is not valid YAML{where}: {problem}") from None
    if not isinstance(data, dict):
        raise SpecError("", f"job file {str(path)!r} must hold a mapping of fields, got {type(data).__name__}")
    return data


_TOP_LEVEL = {
    "job_id", "seed", "output", "conditions", "arms", "batch_size", "shard_batches", "shard_size",
    "actors", "num_cpus_per_actor", "num_gpus_per_actor", "max_shard_retries", "eval",
    "storage_options", "dataset",
}


def parse_job(data: Mapping[str, Any]) -> JobSpec:
    _reject_unknown("", data, _TOP_LEVEL)
    for required in ("output", "arms"):
        if required not in data:
            raise SpecError(required, "is required")
    job_id = _string("job_id", data.get("job_id", "specray-job"))
    if not _ARM_NAME.fullmatch(job_id):
        raise SpecError("job_id", f"must be letters, digits, '_', '-', '.', got {job_id!r}")
    seed = _integer("seed", data.get("seed", 0), minimum=0)
    output = _validate_output("output", data["output"])
    batch_size = _integer("batch_size", data.get("batch_size", 32), minimum=1)
    shard_batches = _shard_batches(data, batch_size)
    actors = data.get("actors", "auto")
    if actors != "auto":
        actors = _integer("actors", actors, minimum=1, allowed_text='"auto" or an integer >= 1')
    num_cpus = _number("num_cpus_per_actor", data.get("num_cpus_per_actor", 1), minimum=0.0)
    num_gpus = _number("num_gpus_per_actor", data.get("num_gpus_per_actor", 0), minimum=0.0)
    if num_gpus > 1 and num_gpus != int(num_gpus):
        raise SpecError("num_gpus_per_actor", f"must be a fraction <= 1 or a whole number, got {num_gpus}")
    if num_cpus == 0 and num_gpus == 0:
        raise SpecError("num_cpus_per_actor", "must be > 0 when num_gpus_per_actor is 0")
    retries = _integer("max_shard_retries", data.get("max_shard_retries", 3), minimum=0)

    arms = _arms("arms", data["arms"])
    conditions = _conditions("conditions", data.get("conditions", {}), arms)
    eval_spec = _eval("eval", data.get("eval", {}), arms)
    storage_options = _storage_options("storage_options", data.get("storage_options"))
    spec = JobSpec(
        job_id=job_id, seed=seed, output=output, conditions=conditions, arms=arms,
        batch_size=batch_size, shard_batches=shard_batches, actors=actors,
        num_cpus_per_actor=num_cpus, num_gpus_per_actor=num_gpus, max_shard_retries=retries,
        eval=eval_spec, storage_options=storage_options,
    )
    dataset = _dataset("dataset", data.get("dataset"), spec)
    return replace(spec, dataset=dataset) if dataset is not None else spec


def _shard_batches(data: Mapping[str, Any], batch_size: int) -> int:
    if "shard_batches" in data and "shard_size" in data:
        raise SpecError("shard_size", "give either shard_batches or shard_size, not both")
    if "shard_size" in data:
        size = _integer("shard_size", data["shard_size"], minimum=1)
        if size % batch_size:
            raise SpecError("shard_size", f"must be a multiple of batch_size ({batch_size}), got {size}")
        return size // batch_size
    return _integer("shard_batches", data.get("shard_batches", 4), minimum=1)


_ARM_FIELDS = {"name", "family", "method", "target", "draft", "params", "seed_offset"}


def _arms(path: str, raw: Any) -> tuple[ArmSpec, ...]:
    from specray.families import FAMILIES
    from specray.methods.params import ParamError

    if not isinstance(raw, list) or not raw:
        raise SpecError(path, "must be a non-empty list of arms")
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
            raise SpecError(f"{at}.family", f"unknown family {family_name!r}; allowed: {', '.join(sorted(FAMILIES))}")
        family = FAMILIES[family_name]
        method = _string(f"{at}.method", item["method"])
        if method not in family.methods:
            raise SpecError(f"{at}.method", f"unknown method {method!r} for family {family_name!r}; "
                                            f"allowed: {', '.join(family.methods)}")
        name = _string(f"{at}.name", item.get("name", method))
        if not _ARM_NAME.fullmatch(name):
            raise SpecError(f"{at}.name", f"must be letters, digits, '_', '-', '.' (it names a directory), got {name!r}")
        if name in seen:
            raise SpecError(f"{at}.name", f"duplicate arm name {name!r} (also arms[{seen[name]}]); arm names must be unique")
        seen[name] = i
        target = _model_ref(f"{at}.target", item["target"], family_name)
        draft = item.get("draft")
        if draft is not None:
            draft = _model_ref(f"{at}.draft", draft, family_name)
        try:  # the method's parameter class is the one place its parameters are checked
            params = family.parse_params(method, item.get("params"))
        except ParamError as exc:
            raise SpecError(f"{at}.params" + (f".{exc.field}" if exc.field else ""), exc.message) from None
        if params.needs_draft and draft is None:
            raise SpecError(f"{at}.draft", f"method {method!r} with these params needs a draft model; "
                                           f"name one (a preset of family {family_name!r} or a checkpoint)")
        problem = family.check_arm(params, target, draft) if family.check_arm is not None else None
        if problem is not None:
            raise SpecError(f"{at}.{problem[0]}", problem[1])
        seed_offset = _integer(f"{at}.seed_offset", item.get("seed_offset", 0), minimum=0)
        arms.append(ArmSpec(name=name, family=family_name, method=method, target=target, draft=draft,
                            params=params.to_dict(), seed_offset=seed_offset))
    return tuple(arms)


def _model_ref(path: str, value: Any, family: str) -> str | dict[str, Any]:
    """A preset name of the arm's family, a checkpoint path, or a ``{format: NAME, ...}`` mapping
    validated by the family's options class for that format."""
    from specray.models.presets import get_preset

    if isinstance(value, Mapping):
        return _formatted_model_ref(path, value, family)
    name = _string(path, value)
    if _looks_like_checkpoint(name):
        if "://" not in name:
            _check_local_checkpoint(path, name)
        return name
    try:
        preset = get_preset(name)
    except KeyError as exc:
        raise SpecError(path, str(exc.args[0])) from None
    if preset.family != family:
        raise SpecError(path, f"preset {name!r} belongs to family {preset.family!r}, not {family!r}")
    if preset.role == "feature":
        raise SpecError(path, f"preset {name!r} is a feature extractor, not a generator")
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
        raise SpecError(f"{path}" + (f".{exc.field}" if exc.field else ""), exc.message) from None
    return {"format": entry.name, **options.to_dict()}


def _looks_like_checkpoint(name: str) -> bool:
    return "/" in name or "://" in name or name.endswith((".safetensors", ".pt", ".bin"))


# A safetensors file: 8-byte little-endian header length, a JSON header, then the tensor bytes.
_SAFETENSORS_MAX_HEADER = 100 * 1024 * 1024
_SAFETENSORS_DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2,
                            "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_local_checkpoint(path: str, name: str) -> None:
    """A local checkpoint must exist; a .safetensors one must have a sound header covering the file.

    Reads only the header (never the tensors, never a pickle), so a corrupt or truncated file is
    refused before Ray starts.
    """
    file = Path(name).expanduser()
    if not file.exists():
        raise SpecError(path, f"checkpoint {name!r} does not exist; give an existing .safetensors file "
                              "or a built-in preset name")
    if file.suffix != ".safetensors" or not file.is_file():
        return  # directories / other formats are checked by the family loader
    problem = safetensors_header_problem(file)
    if problem:
        raise SpecError(path, f"checkpoint {name!r} is not a valid safetensors file: {problem}")


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
    endpoint = raw.get("endpoint_url")
    if endpoint is not None:
        endpoint = _string(f"{path}.endpoint_url", endpoint)
        if not re.match(r"^https?://[^/@\s]+(/.*)?$", endpoint):
            raise SpecError(f"{path}.endpoint_url", f"must be http(s)://HOST[:PORT] without user:password, "
                                                    f"got {endpoint.split('@')[-1]!r}")
    if raw.get("region_name") is not None:
        _string(f"{path}.region_name", raw["region_name"])
    for flag in ("anon", "requester_pays"):
        if flag in raw and not isinstance(raw[flag], bool):
            raise SpecError(f"{path}.{flag}", f"must be true or false, got {raw[flag]!r}")
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
        raise SpecError(f"{path}.partition", f"unknown partition {partition!r}; allowed: {', '.join(DATASET_PARTITIONS)}")
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
                raise SpecError(at, f'must be "today" or a date YYYY-MM-DD, got {value!r}') from None
    else:
        if value in (None, ""):
            value = spec.fingerprint()
        value = _string(at, value)
        if not _ARM_NAME.fullmatch(value):
            raise SpecError(at, f"must be letters, digits, '_', '-', '.' (it names a directory), got {value!r}")
    name = raw.get("name")
    if name is not None:
        name = _string(f"{path}.name", name)
    description = raw.get("description") or ""
    if not isinstance(description, str):
        raise SpecError(f"{path}.description", f"must be a string, got {description!r}")
    return DatasetSpec(partition=partition, value=value, name=name, description=description)


_CONDITION_FIELDS = {"kind", "per_class", "classes"}


def _conditions(path: str, raw: Any, arms: tuple[ArmSpec, ...]) -> ConditionSpec:
    if not isinstance(raw, Mapping):
        raise SpecError(path, f"must be a mapping with fields {sorted(_CONDITION_FIELDS)}")
    _reject_unknown(path, raw, _CONDITION_FIELDS)
    kind = _string(f"{path}.kind", raw.get("kind", "class_labels"))
    if kind not in CONDITION_KINDS:
        raise SpecError(f"{path}.kind", f"unknown condition kind {kind!r}; allowed: {', '.join(CONDITION_KINDS)}")
    per_class = _integer(f"{path}.per_class", raw.get("per_class", 100), minimum=1)
    num_classes = _num_classes(arms)
    classes_raw = raw.get("classes", "all")
    if classes_raw == "all" or classes_raw is None:
        if num_classes is None:
            raise SpecError(f"{path}.classes", "the target presets do not say how many classes they have; list the classes")
        classes = tuple(range(num_classes))
    else:
        if not isinstance(classes_raw, list) or not classes_raw:
            raise SpecError(f"{path}.classes", f'must be "all" or a non-empty list of class labels, got {classes_raw!r}')
        classes = tuple(_integer(f"{path}.classes[{i}]", c, minimum=0) for i, c in enumerate(classes_raw))
        for i, label in enumerate(classes):
            if num_classes is not None and label >= num_classes:
                raise SpecError(f"{path}.classes[{i}]", f"class label {label} out of range; allowed: 0..{num_classes - 1}")
            if label in classes[:i]:
                raise SpecError(f"{path}.classes[{i}]", f"class label {label} listed twice")
    return ConditionSpec(kind=kind, per_class=per_class, classes=classes)


def _num_classes(arms: tuple[ArmSpec, ...]) -> int | None:
    """The smallest class count among the arms' target (and draft) presets."""
    from specray.models.presets import get_preset

    counts = []
    for arm in arms:
        for ref in (arm.target, arm.draft):
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
        raise SpecError(f"{path}.fid", f"must be true or false, got {fid!r}")
    reference = _string(f"{path}.reference", raw.get("reference", "digits"))
    names = [a.name for a in arms]
    baseline = raw.get("baseline")
    if baseline is None:
        baseline = next((a.name for a in arms if a.method == "target_only"), None)
    elif baseline not in names:
        raise SpecError(f"{path}.baseline", f"unknown arm {baseline!r}; allowed: {', '.join(names)}")
    options = raw.get("options") or {}
    if not isinstance(options, Mapping):
        raise SpecError(f"{path}.options", "must be a mapping")
    from specray.eval.options import ReduceOptions
    from specray.methods.params import ParamError

    try:  # checked now, not after generation
        ReduceOptions.parse(options)
    except ParamError as exc:
        raise SpecError(f"{path}.options" + (f".{exc.field}" if exc.field else ""), exc.message) from None
    return EvalSpec(fid=fid, reference=reference, baseline=baseline, options=_plain(options))


# ---------------------------------------------------------------- field checks


def _validate_output(path: str, value: Any) -> str:
    output = _string(path, value)
    if "://" in output:
        scheme = output.split("://", 1)[0]
        if scheme not in ("s3", "file", "memory"):
            raise SpecError(path, f"unsupported URI scheme {scheme!r}; allowed: a local path, file://, s3://")
        return output
    # Writable without writing anything: the nearest existing ancestor must be a writable directory.
    probe = Path(output).absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise SpecError(path, f"{output!r} cannot be created: {str(probe)!r} is a file")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise SpecError(path, f"{output!r} cannot be written: no write permission on {str(probe)!r}")
    return output


def _reject_unknown(path: str, data: Mapping[str, Any], allowed: set[str]) -> None:
    for key in data:
        if key not in allowed:
            at = f"{path}.{key}" if path else str(key)
            close = difflib.get_close_matches(str(key), sorted(allowed), n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise SpecError(at, f"unknown field; allowed: {', '.join(sorted(allowed))}{hint}")


def _string(path: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(path, f"must be a non-empty string, got {value!r}")
    return value


def _integer(path: str, value: Any, *, minimum: int, allowed_text: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise SpecError(path, f"must be {allowed_text or f'an integer >= {minimum}'}, got {value!r}")
    return int(value)


def _number(path: str, value: Any, *, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
        raise SpecError(path, f"must be a number >= {minimum}, got {value!r}")
    return float(value)


def _plain(value: Any) -> Any:
    """JSON-compatible copy (tuples -> lists) so fingerprints and manifests are stable."""
    return json.loads(json.dumps(value, sort_keys=True))


def _hash(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- the built-in demo

DEMO_PATH = Path(__file__).with_name("demo.yaml")  # the demo's one definition (package data)


def builtin_demo_dict() -> dict[str, Any]:
    """The demo job as plain data (``specray/demo.yaml``)."""
    return read_job_file(DEMO_PATH)


def builtin_demo_job(**overrides: Any) -> JobSpec:
    """Every method of the three families on the digits presets, 100 samples per class, output runs/demo."""
    return load_job(builtin_demo_dict(), **overrides)


def with_output(spec: JobSpec, output: str) -> JobSpec:
    return replace(spec, output=_validate_output("output", output))
