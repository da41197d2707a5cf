"""Reading release checkpoints safely and mapping them onto a model strictly.

Two rules hold for every format:

* **Nothing is unpickled with arbitrary code.** A ``.safetensors`` file is read with safetensors;
  a pickle (``.pt``, ``.pth``, ``.ckpt``, ``.bin``) only with ``torch.load(weights_only=True)``,
  which builds tensors, containers and plain numbers and refuses every other global. The one class
  allowed on top is ``argparse.Namespace`` (an attribute bag with no code of its own: MAR and
  LlamaGen training checkpoints keep their command-line ``args`` in one). A file that needs more
  is refused with :class:`CheckpointError`, naming ``specray convert``.
* **Keys are matched strictly.** The official loaders use ``load_state_dict(strict=False)``,
  which silently ignores missing and unexpected keys (a ``_orig_mod.`` prefix would load nothing
  and still "work"). :func:`load_strict` strips that prefix and then refuses any missing key,
  unexpected key or wrong shape, naming it. Weights are upcast or cast to the model's dtype after
  matching, never assumed.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

# The weight dtypes a checkpoint option may name (``dtype: bfloat16``), as torch dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

PICKLE_SUFFIXES = (".pt", ".pth", ".ckpt", ".bin")
COMPILED_PREFIX = "_orig_mod."
SAFE_EXTRA_GLOBALS = [argparse.Namespace]


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded as given; the message names the file and what is wrong."""


def convert_hint(path: Path) -> str:
    return (f"convert it once, on a machine where you trust the file, with "
            f"`specray convert {path} {path.with_suffix('.safetensors')} --trust-pickle` "
            "(writes safetensors + its config) and name the .safetensors file instead")


def read_checkpoint(path: str | Path) -> Any:
    """The object a checkpoint file holds: a dict of tensors for safetensors, else what the pickle
    holds, read with ``weights_only=True``. Raises :class:`CheckpointError` on a missing, truncated
    or unsafe file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint file does not exist")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from None
    try:
        with torch.serialization.safe_globals(SAFE_EXTRA_GLOBALS):
            return torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:
        text = str(exc)
        if "Weights only load failed" in text or "Unsupported global" in text or "unsupported GLOBAL" in text:
            blocked = _blocked_global(text)
            raise CheckpointError(
                f"{path}: refused: the pickle needs arbitrary code to load{blocked} and specray never "
                f"unpickles untrusted code; {convert_hint(path)}") from None
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt?): "
                              f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}") from None


def _blocked_global(text: str) -> str:
    for line in text.splitlines():
        if "GLOBAL" in line and ("unsupported" in line.lower() or "Unsupported" in line):
            return f" ({line.strip().rstrip('.')})"
    return ""


def select_entry(obj: Any, entries: Iterable[str | None], path: str | Path) -> dict[str, torch.Tensor]:
    """The state dict inside a checkpoint: the first of ``entries`` present (``None`` = the object
    itself, as in FSDP files), which must be a flat mapping of names to tensors."""
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{path}: expected a mapping of tensors, got {type(obj).__name__}")
    tried = []
    for entry in entries:
        candidate = obj if entry is None else obj.get(entry)
        tried.append("the file itself" if entry is None else repr(entry))
        if isinstance(candidate, Mapping) and candidate and all(isinstance(v, torch.Tensor) for v in candidate.values()):
            return dict(candidate)
    keys = ", ".join(repr(k) for k in list(obj)[:8])
    raise CheckpointError(f"{path}: no state dict found (tried {', '.join(tried)}); top-level keys: {keys}")


def strip_compiled_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop torch.compile's ``_orig_mod.`` prefix (anywhere at the start of a key)."""
    return {key.replace(COMPILED_PREFIX, "", 1) if key.startswith(COMPILED_PREFIX) else key: value
            for key, value in state.items()}


def load_strict(module: torch.nn.Module, state: Mapping[str, torch.Tensor], source: str | Path,
                ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Copy ``state`` into ``module``'s parameters and persistent buffers, refusing any mismatch.

    ``ignore_prefixes``: key prefixes that a release is known to carry for training only (they are
    dropped, not loaded). Tensors are cast to the dtype of the module's own tensor.
    """
    state = {k: v for k, v in strip_compiled_prefix(state).items() if not k.startswith(ignore_prefixes)}
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing key(s) {_names(missing)}")
        if unexpected:
            parts.append(f"unexpected key(s) {_names(unexpected)}")
        raise CheckpointError(f"{source}: does not match the model: {'; '.join(parts)} "
                              f"(wrong size/format, or a file of another model?)")
    for key, tensor in own.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise CheckpointError(f"{source}: key {key!r} has shape {tuple(state[key].shape)}, the model "
                                  f"expects {tuple(tensor.shape)} (wrong size option?)")
    converted = {k: v.to(own[k].dtype) for k, v in state.items()}
    module.load_state_dict(converted, strict=True)


def _names(keys: list[str], limit: int = 6) -> str:
    shown = ", ".join(repr(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")
