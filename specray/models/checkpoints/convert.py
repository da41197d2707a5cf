"""``specray convert``: a release pickle -> a ``.safetensors`` file (+ its config) that every loader reads.

Without ``trust_pickle`` the source is read like any checkpoint (``torch.load(weights_only=True)``):
useful to turn a ``.pt`` into safetensors once. A file whose pickle needs arbitrary code (a class
outside tensors and containers) can only be read with ``trust_pickle=True``, which runs its code:
the caller asserts that the file comes from a trusted source. The output holds one state dict (the
first of ``entry`` / ``model_ema`` / ``model`` / ``module`` / ``state_dict`` / the file itself) and,
in its metadata, the source's name and sha256, the entry taken and the file's ``args`` as JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from specray.models.checkpoints.reading import CheckpointError, read_checkpoint, select_entry

DEFAULT_ENTRIES = ("model_ema", "model", "module", "state_dict", None)


def convert(source: str | Path, dest: str | Path, entry: str | None = None, trust_pickle: bool = False) -> Path:
    from safetensors.torch import save_file

    source, dest = Path(source), Path(dest)
    if dest.suffix != ".safetensors":
        raise CheckpointError(f"{dest}: the output must end in .safetensors")
    if trust_pickle:
        if not source.is_file():
            raise CheckpointError(f"{source}: checkpoint file does not exist")
        obj = torch.load(str(source), map_location="cpu", weights_only=False)  # the caller trusts this file
    else:
        obj = read_checkpoint(source)
    entries = (entry,) if entry is not None else DEFAULT_ENTRIES
    state = select_entry(obj, entries, source)
    taken = entry if entry is not None else next(
        (e for e in DEFAULT_ENTRIES if e is None or (isinstance(obj, dict) and obj.get(e) is not None)), None)
    metadata = {"source": source.name, "source_sha256": _sha256(source), "entry": str(taken)}
    if isinstance(obj, dict) and obj.get("args") is not None:
        metadata["config"] = json.dumps(_plain(obj["args"]), sort_keys=True, default=str)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(partial), metadata=metadata)
    os.replace(partial, dest)  # never a half-written output under the final name
    return dest


def _plain(args: Any) -> Any:
    return vars(args) if hasattr(args, "__dict__") else args


def _sha256(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
