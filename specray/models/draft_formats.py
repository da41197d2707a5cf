"""How a job names an EAGLE draft head for the discrete family, torch-free (validated before Ray starts).

A head is named like any draft model:

* ``draft: digits-gpt-eagle``: the built-in head preset (its config says ``kind: eagle_head``);
* ``draft: path/to/head.safetensors``, or ``draft: {format: eagle-head, path: ...}``: a head written by
  ``specray train`` (its safetensors metadata holds the config with ``kind: eagle_head``);
* ``draft: {format: lantern-llamagen, path: DIR_OR_FILE, config: CONFIG.json}``: a drafter released
  by LANTERN for LlamaGen (Hugging-Face-style keys, ``config.json`` of ``EConfig``), mapped onto the
  head by ``specray.models.lantern_drafter``.

A static tree (``params.tree``) drafts only with a head; :func:`is_head_reference` is what the spec
checks that with.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import model_validator

from specray.methods.params import ParamError, StrictParams

HEAD_KIND = "eagle_head"
HEAD_FORMATS = ("eagle-head", "lantern-llamagen")

# LANTERN's drafter model code fixes the image grid and the prefix length per LlamaGen variant
# (its ``input_type``); the head's rotary table follows from them.
LANTERN_INPUT_TYPES = {"c2i": {"grid_size": 24, "cls_token_num": 1},
                       "t2i": {"grid_size": 16, "cls_token_num": 120},
                       "t2i2": {"grid_size": 32, "cls_token_num": 120}}
_LANTERN_REQUIRED = ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps",
                     "num_hidden_layers", "input_type")


def _existing(field: str, path: str) -> Path:
    file = Path(path).expanduser()
    if not file.exists():
        raise ParamError(field, f"{path!r} does not exist")
    return file


def head_file_config(file: Path) -> dict[str, Any] | None:
    """The head config in a safetensors file's metadata, or None when the file is not a head."""
    from specray.spec import safetensors_metadata

    config = json.loads(safetensors_metadata(file).get("config", "{}"))
    return config if isinstance(config, dict) and config.get("kind") == HEAD_KIND else None


class EagleHeadFile(StrictParams):
    """``{format: eagle-head, path: FILE.safetensors}``: a head trained by specray."""

    path: str

    @model_validator(mode="after")
    def _is_head(self) -> "EagleHeadFile":
        file = _existing("path", self.path)
        try:
            config = head_file_config(file)
        except ValueError as exc:
            raise ParamError("path", f"{self.path!r} is not a valid safetensors file: {exc}") from None
        if config is None:
            raise ParamError("path", f"{self.path!r} holds no EAGLE head (its metadata config lacks kind: {HEAD_KIND}); "
                                     "write one with `specray train`")
        return self


class LanternDrafter(StrictParams):
    """``{format: lantern-llamagen, path: DIR or weights file, config: config.json}`` (config defaults to
    ``DIR/config.json``). Weights: ``model.safetensors``, or ``pytorch_model.bin`` read with
    ``torch.load(weights_only=True)``."""

    path: str
    config: str | None = None

    def weights_file(self) -> Path:
        path = Path(self.path).expanduser()
        if path.is_file():
            return path
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return path / name
        raise ParamError("path", f"{self.path!r} holds neither model.safetensors nor pytorch_model.bin")

    def config_file(self) -> Path:
        if self.config is not None:
            return Path(self.config).expanduser()
        path = Path(self.path).expanduser()
        return (path if path.is_dir() else path.parent) / "config.json"

    def read_config(self) -> dict[str, Any]:
        """The drafter's config, checked to describe a one-layer LLaMA-style head this loader maps."""
        field = "config" if self.config is not None else "path"
        file = self.config_file()
        if not file.is_file():
            raise ParamError(field, f"config file {str(file)!r} does not exist; give config: path/to/config.json")
        try:
            config = json.loads(file.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ParamError(field, f"config file {str(file)!r} is not JSON: {exc}") from None
        missing = [k for k in _LANTERN_REQUIRED if k not in config]
        if missing:
            raise ParamError(field, f"config file {str(file)!r} lacks {missing}")
        checks = {
            "num_hidden_layers": (config["num_hidden_layers"] == 1, "1 (an EAGLE head has one layer)"),
            "input_type": (config["input_type"] in LANTERN_INPUT_TYPES, f"one of {', '.join(LANTERN_INPUT_TYPES)}"),
            "num_key_value_heads": (config.get("num_key_value_heads", config["num_attention_heads"])
                                    == config["num_attention_heads"], "num_attention_heads (no grouped K/V)"),
            "hidden_act": (config.get("hidden_act", "silu") == "silu", "'silu'"),
            "pretraining_tp": (config.get("pretraining_tp", 1) == 1, "1"),
            "rope_scaling": (config.get("rope_scaling") is None, "null"),
            "qkv_bias": (not config.get("qkv_bias", False), "false"),
        }
        for key, (ok, allowed) in checks.items():
            if not ok:
                raise ParamError(field, f"config {key}={config.get(key)!r} is not supported; allowed: {allowed}")
        return config

    @model_validator(mode="after")
    def _readable(self) -> "LanternDrafter":
        _existing("path", self.path)
        self.weights_file()
        self.read_config()
        return self


def is_head_reference(ref: str | Mapping[str, Any] | None) -> bool:
    """Whether a (validated) discrete draft reference names an EAGLE head rather than a GPT."""
    if ref is None:
        return False
    if isinstance(ref, Mapping):
        return ref.get("format") in HEAD_FORMATS
    if ref.endswith(".safetensors"):
        file = Path(ref).expanduser()
        try:
            return file.is_file() and head_file_config(file) is not None
        except ValueError:
            return False
    from specray.models.presets import get_preset

    try:
        return get_preset(ref).config.get("kind") == HEAD_KIND
    except KeyError:
        return False
