"""Prompt sets: text conditions read from a file, validated before Ray starts, torch-free.

A job with ``conditions: {kind: prompts, source: PATH_OR_S3_URI, ...}`` generates
``repeats`` images for every prompt of the set. Every prompt has a stable id, so sharding,
per-sample seeds, resume and byte-identical output across actor counts work exactly as for class
labels: sample ``i`` shows prompt ``i % P`` (its ``i // P``-th repeat), so every prefix of the
samples covers the prompts evenly.

Formats (``format: auto`` picks one from the file name):

- ``coco``: the MS-COCO captions annotation JSON (``captions_val2017.json``). ``captions: first``
  (default) takes each image's caption with the smallest annotation id, ``all`` takes every caption;
  the prompt id is the annotation id, and the image id is kept (COCO FID uses the images).
- ``jsonl``: one JSON object per line; ``csv``: a header row; ``parquet``: a table; ``hf``: a Hugging
  Face ``datasets`` folder (``save_to_disk``). The prompt is in ``text_column`` (default
  ``prompt``), its id in ``id_column`` (default ``id``; when the file has no such column the id is the
  row number, which is stable for the same file).

``subset`` keeps the first N prompts (``{first: N}``) or a seeded sample of N (``{sample: N,
seed: S}``: the N prompts whose keyed hash is smallest, independent of file order). The set's
digest (sha256 over ids and texts, in order) joins the job's fingerprint, so a run is never resumed
with a different prompt set.
"""

from __future__ import annotations

import csv
import functools
import hashlib
import io
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

FORMATS = ("auto", "coco", "jsonl", "csv", "parquet", "hf")
ENCODERS = ("minilm", "t5")  # text encoders (specray.models.text)
BUILTIN_SOURCES = {  # prompt sets shipped with the package, named like presets
    "builtin:digits-captions": "data/digits_captions_heldout.jsonl",
}
COCO_CAPTIONS = ("first", "all")
MAX_FILE_BYTES = 512 * 2**20  # a prompt file larger than this is refused before it is read
MAX_PROMPTS = 2_000_000
DEFAULT_MAX_CHARS = 2000


class PromptSetError(ValueError):
    """A prompt set that cannot be used. ``field`` is the condition field it is about."""

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        return (type(self), (self.field, self.message))


@dataclass(frozen=True)
class PromptSet:
    """The prompts of a job, in order, with their stable ids."""

    ids: tuple[str, ...]
    texts: tuple[str, ...]
    source: str
    image_ids: tuple[int, ...] | None = None  # COCO only: the image each caption describes

    def __post_init__(self) -> None:
        if len(self.ids) != len(self.texts):
            raise ValueError("ids and texts differ in length")

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def digest(self) -> str:
        hasher = hashlib.sha256()
        for prompt_id, text in zip(self.ids, self.texts):
            hasher.update(json.dumps([prompt_id, text]).encode())
        return hasher.hexdigest()[:16]


def read_prompt_set(source: str, *, fmt: str = "auto", text_column: str = "prompt", id_column: str = "id",
                    captions: str = "first", storage_options: Mapping[str, Any] | None = None,
                    max_chars: int = DEFAULT_MAX_CHARS) -> PromptSet:
    """The prompts of ``source`` (a local path or URI), validated: ids unique, texts non-empty strings
    of at most ``max_chars`` characters. Raises :class:`PromptSetError` naming the field and the row."""
    fmt = _resolve_format(source, fmt)
    if fmt == "coco":
        rows, image_ids = _coco_rows(_read_json(source, storage_options), captions, source)
    else:
        rows, image_ids = _table_rows(source, fmt, text_column, id_column, storage_options), None
    ids, texts = [], []
    seen: dict[str, int] = {}
    for index, (prompt_id, text) in enumerate(rows):
        where = f"{source}: prompt {index} (id {prompt_id!r})"
        if not isinstance(text, str) or not text.strip():
            raise PromptSetError(f"{'caption' if fmt == 'coco' else text_column}", f"{where} is not a non-empty string: {text!r}")
        if len(text) > max_chars:
            raise PromptSetError("max_chars", f"{where} has {len(text)} characters, more than max_chars={max_chars}; "
                                              "raise max_chars or shorten it")
        if prompt_id in seen:
            raise PromptSetError(id_column if fmt != "coco" else "source",
                                 f"{source}: duplicate prompt id {prompt_id!r} (prompts {seen[prompt_id]} and {index})")
        seen[prompt_id] = index
        ids.append(prompt_id)
        texts.append(text)
        if len(ids) > MAX_PROMPTS:
            raise PromptSetError("source", f"{source} holds more than {MAX_PROMPTS} prompts; use subset")
    if not ids:
        raise PromptSetError("source", f"{source} holds no prompts")
    return PromptSet(tuple(ids), tuple(texts), source, image_ids)


def load_prompts(source: str, *, format: str = "auto", text_column: str = "prompt", id_column: str = "id",
                 captions: str = "first", first: int | None = None, sample: int | None = None, sample_seed: int = 0,
                 max_chars: int = DEFAULT_MAX_CHARS, storage_options: Mapping[str, Any] | None = None) -> PromptSet:
    """A job's prompt set: read, checked and cut to its subset; read once per process per source."""
    key = json.dumps([source, format, text_column, id_column, captions, first, sample, sample_seed, max_chars,
                      dict(storage_options or {})], sort_keys=True, default=str)
    return _load_cached(key)


@functools.lru_cache(maxsize=8)
def _load_cached(key: str) -> PromptSet:
    source, fmt, text_column, id_column, captions, first, sample, sample_seed, max_chars, storage = json.loads(key)
    path = source
    if source.startswith("builtin:"):
        if source not in BUILTIN_SOURCES:
            raise PromptSetError("source", f"unknown built-in prompt set {source!r}; allowed: "
                                           f"{', '.join(BUILTIN_SOURCES)}")
        from importlib.resources import files

        path = str(files("specray").joinpath(BUILTIN_SOURCES[source]))
    prompts = read_prompt_set(path, fmt=fmt, text_column=text_column, id_column=id_column, captions=captions,
                              storage_options=storage, max_chars=max_chars)
    prompts = take_subset(prompts, first=first, sample=sample, seed=sample_seed)
    return PromptSet(prompts.ids, prompts.texts, source, prompts.image_ids)


def take_subset(prompts: PromptSet, first: int | None = None, sample: int | None = None,
                seed: int = 0) -> PromptSet:
    """The first ``first`` prompts, or a seeded sample of ``sample`` prompts kept in file order."""
    if first is None and sample is None:
        return prompts
    if first is not None:
        keep = list(range(min(first, len(prompts))))
    else:
        def key(i: int) -> bytes:
            return hashlib.sha256(f"{seed}\x00{prompts.ids[i]}".encode()).digest()

        keep = sorted(sorted(range(len(prompts)), key=key)[:sample])
    return PromptSet(tuple(prompts.ids[i] for i in keep), tuple(prompts.texts[i] for i in keep), prompts.source,
                     None if prompts.image_ids is None else tuple(prompts.image_ids[i] for i in keep))


# ---- formats ------------------------------------------------------------------------------------


def _resolve_format(source: str, fmt: str) -> str:
    if fmt not in FORMATS:
        raise PromptSetError("format", f"unknown format {fmt!r}; allowed: {', '.join(FORMATS)}")
    if fmt != "auto":
        return fmt
    name = source.rstrip("/").lower()
    for suffix, guess in ((".jsonl", "jsonl"), (".csv", "csv"), (".parquet", "parquet"), (".json", "coco")):
        if name.endswith(suffix):
            return guess
    if _is_dir(source):
        return "hf"
    raise PromptSetError("format", f"cannot tell the format of {source!r} from its name; "
                                   f"give format: one of {', '.join(FORMATS[1:])}")


def _open(source: str, storage_options: Mapping[str, Any] | None, mode: str = "rb"):
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source, **dict(storage_options or {}))
        size = fs.size(path)
    except FileNotFoundError:
        raise PromptSetError("source", f"{source!r} does not exist") from None
    except (OSError, ValueError) as exc:
        raise PromptSetError("source", f"{source!r} cannot be read: {type(exc).__name__}: {exc}") from None
    if size is not None and size > MAX_FILE_BYTES:
        raise PromptSetError("source", f"{source!r} has {size} bytes, more than the {MAX_FILE_BYTES} a prompt file "
                                       "may have; split it or use subset on a smaller file")
    return fs.open(path, mode)


def _is_dir(source: str) -> bool:
    import fsspec

    try:
        fs, path = fsspec.core.url_to_fs(source)
        return fs.isdir(path)
    except (OSError, ValueError):
        return False


def _read_json(source: str, storage_options: Mapping[str, Any] | None) -> Any:
    with _open(source, storage_options) as handle:
        raw = handle.read()
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        where = f" at line {exc.lineno}, column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else ""
        raise PromptSetError("source", f"{source!r} is not valid JSON{where}: {exc}") from None


def _coco_rows(data: Any, captions: str, source: str) -> tuple[list[tuple[str, Any]], tuple[int, ...]]:
    if captions not in COCO_CAPTIONS:
        raise PromptSetError("captions", f"must be one of {', '.join(COCO_CAPTIONS)}, got {captions!r}")
    annotations = data.get("annotations") if isinstance(data, dict) else None
    if not isinstance(annotations, list):
        raise PromptSetError("source", f"{source!r} is not a COCO captions file: it has no 'annotations' list")
    chosen: dict[int, dict[str, Any]] = {}
    picked: list[dict[str, Any]] = []
    for i, ann in enumerate(annotations):
        if not isinstance(ann, dict) or not {"id", "image_id", "caption"} <= ann.keys():
            raise PromptSetError("source", f"{source!r}: annotations[{i}] lacks id, image_id or caption")
        if captions == "all":
            picked.append(ann)
        elif ann["image_id"] not in chosen or ann["id"] < chosen[ann["image_id"]]["id"]:
            chosen[ann["image_id"]] = ann
    if captions == "first":
        picked = [chosen[image] for image in sorted(chosen)]
    else:
        picked.sort(key=lambda ann: (ann["image_id"], ann["id"]))
    return [(str(ann["id"]), ann["caption"].strip() if isinstance(ann["caption"], str) else ann["caption"])
            for ann in picked], tuple(int(ann["image_id"]) for ann in picked)


def _table_rows(source: str, fmt: str, text_column: str, id_column: str,
                storage_options: Mapping[str, Any] | None) -> list[tuple[str, Any]]:
    records = _records(source, fmt, storage_options)
    columns = records[0].keys() if records else set()
    if records and text_column not in columns:
        raise PromptSetError("text_column", f"{source!r} has no column {text_column!r}; columns: {sorted(columns)}")
    rows = []
    for index, record in enumerate(records):
        if id_column in record and record[id_column] is not None:
            prompt_id = str(record[id_column])
        elif id_column in columns:
            raise PromptSetError("id_column", f"{source!r}: row {index} has no {id_column!r}")
        else:
            prompt_id = str(index)
        rows.append((prompt_id, record.get(text_column)))
    return rows


def _records(source: str, fmt: str, storage_options: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    if fmt == "hf":
        return _hf_records(source)
    if fmt == "parquet":
        from specray.runtime.store import read_parquet

        with _open(source, storage_options) as handle:
            try:
                return read_parquet(handle).to_pylist()
            except Exception as exc:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
                raise PromptSetError("source", f"{source!r} is not a readable Parquet file: {exc}") from None
    with _open(source, storage_options) as handle:
        try:
            text = handle.read().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PromptSetError("source", f"{source!r} is not UTF-8 text: {exc}") from None
    if fmt == "csv":
        return list(csv.DictReader(io.StringIO(text)))
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise PromptSetError("source", f"{source!r} line {number} is not JSON: {exc.msg}") from None
        if not isinstance(record, dict):
            raise PromptSetError("source", f"{source!r} line {number} is not a JSON object")
        records.append(record)
    return records


def _hf_records(source: str) -> Iterable[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise PromptSetError("format", "format 'hf' needs the `datasets` package (pip install datasets)") from None
    try:
        dataset = datasets.load_from_disk(source)
    except (FileNotFoundError, ValueError) as exc:
        raise PromptSetError("source", f"{source!r} is not a datasets folder (save_to_disk): {exc}") from None
    if isinstance(dataset, datasets.DatasetDict):
        raise PromptSetError("source", f"{source!r} holds several splits {list(dataset)}; point at one split's folder")
    return dataset.to_list()
