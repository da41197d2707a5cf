"""Typed method parameters: the one place a method's parameters are declared and validated.

Every method has one parameter class (a pydantic model) in its family's ``params.py``: fields with
their types, defaults and bounds, plus cross-field checks. Validation is strict (``4.0`` is not
an integer, ``"4"`` not a number, ``true`` not 1), unknown fields are refused, and it runs once,
when the job is loaded: :meth:`MethodParams.parse` turns a job's ``params`` mapping into an
instance or raises :class:`ParamError` naming the field and the values it allows.

A parameter class also says what the method promises: ``lossless`` (its samples follow the
target's law exactly; the reducer's "within noise" verdicts are made for these arms) and
``needs_draft`` (the arm must name a draft model). This module imports no torch.
"""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from specray.urls import safe_repr

# The draft length of every family: tokens, continuous tokens or denoising steps drafted per round.
# CSpD's paper sweeps it up to 32; 64 leaves room without letting a typo allocate a huge round.
GAMMA_MAX = 64
Gamma = Annotated[int, Field(ge=1, le=GAMMA_MAX, description="draft length per round")]


class ParamError(ValueError):
    """A bad parameter. ``field`` is the parameter's name ("" for the mapping as a whole).

    Cross-field checks raise it inside a validator; :meth:`StrictParams.parse` unwraps it from
    pydantic's error, so it keeps its field name and wording.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}" if field else message)

    def __reduce__(self):  # picklable across processes despite the two-argument constructor
        return (type(self), (self.field, self.message))


class StrictParams(BaseModel):
    """Typed settings read from a job file: strict types, no unknown fields, errors naming the field."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, validate_default=True)
    kind: ClassVar[str] = "field"  # what an unknown key is called in errors

    @classmethod
    def parse(cls, raw: Mapping[str, Any] | None) -> "StrictParams":
        """A validated instance from a job's ``params`` mapping (defaults filled in)."""
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ParamError("", f"must be a mapping of parameter names to values, got {type(raw).__name__}")
        try:
            return cls.model_validate(dict(raw))
        except ValidationError as exc:
            raise _first_error(cls, exc) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (what the spec, the fingerprint and the manifest store)."""
        return self.model_dump(mode="json")


class MethodParams(StrictParams):
    """Base of every method's parameter class."""

    kind: ClassVar[str] = "parameter"

    @property
    def lossless(self) -> bool:
        """Whether the method's samples follow the target model's law exactly."""
        return False

    @property
    def needs_draft(self) -> bool:
        """Whether the arm must name a draft model."""
        return False

    def target_law(self, target_only: type["MethodParams"]) -> dict[str, Any] | None:
        """The ``target_only`` parameters (``target_only``: the family's class for them) whose samples
        follow the law this method claims for its own; None when it claims none (not lossless).

        By default a lossless method samples the law of ``target_only`` with the same values of the
        fields the two share (the family's sampler settings); a method whose law differs overrides this.
        The reducer makes each lossless arm's "within noise" verdict against a ``target_only`` arm
        with exactly these parameters.
        """
        if not self.lossless:
            return None
        shared = {name: getattr(self, name) for name in target_only.model_fields if name in type(self).model_fields}
        return target_only.parse(shared).to_dict()

    @property
    def law_note(self) -> str | None:
        """What the claimed law means, when it is not simply "target_only's" (shown beside the verdict)."""
        return None


def _first_error(cls: type[StrictParams], exc: ValidationError) -> ParamError:
    error = exc.errors(include_url=False)[0]
    raised = (error.get("ctx") or {}).get("error")
    if isinstance(raised, ParamError):  # a cross-field check's own error
        return raised
    name = str(error["loc"][0]) if error["loc"] else ""
    if error["type"] == "extra_forbidden":
        return ParamError(name, f"unknown {cls.kind}; allowed: {sorted(cls.model_fields)}")
    if name in cls.model_fields:
        return ParamError(name, f"must be {allowed_values(cls, name)}, got {safe_repr(error.get('input'))}")
    return ParamError(name, error["msg"])


def allowed_values(cls: type[StrictParams], name: str) -> str:
    """What field ``name`` accepts, in words ("an integer in [1, 64]", "one of 'a', 'b'", ...)."""
    info = cls.model_fields[name]
    return _describe(info.annotation, info.metadata)


def _describe(annotation: Any, metadata: list[Any]) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _describe(args[0], [*args[1:], *metadata])
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        text = " or ".join(_describe(a, metadata) for a in options)
        return f"{text} or null" if len(options) < len(args) else text
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if annotation is bool:
        return "true or false"
    if annotation is str:
        return "a string"
    if annotation in (int, float):
        kind = "an integer" if annotation is int else "a number"
        return kind + _bounds(metadata)
    if origin in (list, tuple):
        return f"a list of {_describe(args[0], []) if args else 'values'}"
    if origin is dict or annotation is dict:
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _bounds(metadata: list[Any]) -> str:
    low = high = None
    for item in metadata:
        for constraint in getattr(item, "metadata", [item]):
            if isinstance(constraint, annotated_types.Ge):
                low = ("[", constraint.ge)
            elif isinstance(constraint, annotated_types.Gt):
                low = ("(", constraint.gt)
            elif isinstance(constraint, annotated_types.Le):
                high = ("]", constraint.le)
            elif isinstance(constraint, annotated_types.Lt):
                high = (")", constraint.lt)
    if low and high:
        return f" in {low[0]}{_num(low[1])}, {_num(high[1])}{high[0]}"
    if low:
        return f" {'>=' if low[0] == '[' else '>'} {_num(low[1])}"
    if high:
        return f" {'<=' if high[0] == ']' else '<'} {_num(high[1])}"
    return ""


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and math.isfinite(value) else str(value)
