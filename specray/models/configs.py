"""Model and training configurations read from JSON (safetensors metadata, preset tables)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypeVar

T = TypeVar("T")


def dataclass_from_dict(cls: type[T], data: Mapping[str, Any], what: str) -> T:
    """``cls(**data)``, refusing unknown fields (naming them and the allowed ones); a JSON list given
    for a field whose default is a tuple becomes a tuple."""
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = set(data) - set(fields)
    if unknown:
        raise ValueError(f"unknown {what} fields {sorted(unknown)}; allowed: {sorted(fields)}")
    values = {k: tuple(v) if isinstance(fields[k].default, tuple) and isinstance(v, list) else v
              for k, v in data.items()}
    return cls(**values)
