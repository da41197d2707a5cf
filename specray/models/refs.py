"""Model references as a job names them, torch-free.

A job's ``target`` / ``draft`` is either a string (a built-in preset's name, or a path to a
``.safetensors`` file whose metadata holds its ``config``) or a mapping ``{format: NAME, ...}``
whose other fields are the format's options (a path, a size, a tokenizer...). The family table
lists the formats each family loads (``Family.formats``), each with a typed options class that the
spec validates before Ray starts.

A reference's *key* is one string for either kind (the mapping as canonical JSON): it groups arms
that share a model, names the model in Parquet rows and manifests, and turns back into the
reference with :func:`ref_from_key`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

ModelRef = str | dict[str, Any]


def ref_key(ref: ModelRef | None) -> str | None:
    """One string per reference: the string itself, or the mapping as canonical JSON."""
    if ref is None or isinstance(ref, str):
        return ref
    return json.dumps(dict(ref), sort_keys=True, separators=(",", ":"))


def ref_from_key(key: str | None) -> ModelRef | None:
    """The reference a key was made from."""
    if key is not None and key.startswith("{"):
        return json.loads(key)
    return key


def ref_path(ref: ModelRef | None) -> str | None:
    """The file or folder a reference reads (None for a preset name)."""
    if isinstance(ref, Mapping):
        path = ref.get("path")
        return str(path) if path is not None else None
    if ref is not None and ("/" in ref or ref.endswith((".safetensors", ".pt", ".pth", ".bin", ".ckpt"))):
        return ref
    return None
