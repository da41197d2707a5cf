"""The reducer's options (``eval.options`` in a job), validated with the job, before anything runs.

Torch-free, so ``specray validate`` checks them on a machine without torch.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from specray.methods.params import ParamError, StrictParams

DIGITS_EXTRACTOR = "specray-digits"
INCEPTION_EXTRACTOR = "inception-v3-compat"
FEATURE_EXTRACTORS = (DIGITS_EXTRACTOR, INCEPTION_EXTRACTOR)


class ReduceOptions(StrictParams):
    """How the reducer scores a run; every field has a default that suits the digits presets."""

    model_config = ConfigDict(frozen=True)
    kind = "reducer option"

    device: str = "cpu"  # "cpu", "cuda" or "cuda:N" (the reducer runs in the driver, on the head node)
    batch_rows: Annotated[int, Field(ge=1)] = 1024  # rows per streamed record batch
    bootstrap_replicates: Annotated[int, Field(ge=2)] = 200
    bootstrap_seed: Annotated[int, Field(ge=0)] = 0
    confidence: Annotated[float, Field(gt=0, lt=1)] = 0.95
    grid_per_class: Annotated[int, Field(ge=0)] = 2  # grid columns: this many smallest sample_ids of each class
    image_budget_bytes: Annotated[int, Field(ge=0)] = 256 * 2**20  # per arm, for torch-fidelity's calculate_metrics
    drop_warmup: bool = True
    speedup_replicates: Annotated[int, Field(ge=2)] = 1000
    checks: bool = True  # pre-scoring checks (count, duplicates, seeds, label balance)
    feature_extractor: Literal["specray-digits", "inception-v3-compat"] = DIGITS_EXTRACTOR
    inception_weights: str | None = None  # local InceptionV3 weights (else $SPECRAY_INCEPTION_WEIGHTS / cache)
    isc: bool = True  # Inception Score (IS) on the extractor's logits
    isc_splits: Annotated[int, Field(ge=1)] = 10
    prc: bool = False  # precision/recall (torch-fidelity prc) on up to prc_max_samples samples per arm
    prc_max_samples: Annotated[int, Field(ge=1)] = 2000
    prc_neighborhood: Annotated[int, Field(ge=1)] = 3
    seed_spread_sd: Annotated[float, Field(gt=0)] = 2.0  # "within seed spread": |FID - mean| <= this many sd
    plots: bool = True

    @field_validator("device")
    @classmethod
    def _known_device(cls, value: str) -> str:
        if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
            raise ParamError("device", f"must be 'cpu', 'cuda' or 'cuda:N', got {value!r}")
        return value

    @field_validator("inception_weights")
    @classmethod
    def _weights_exist(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).expanduser().is_file():
            raise ParamError("inception_weights", f"{value!r} is not a file; give a local InceptionV3 weights file "
                                                  "(.pth read with weights_only=True, or .safetensors)")
        return value


# ---------------------------------------------------------------- eval.reference

REFERENCE_KINDS = ("digits", "npz", "fidelity-stats", "folder", "parquet")
REFERENCE_ALLOWED = ("'digits', 'npz:PATH' (ADM mu/sigma), 'fidelity-stats:PATH' (torch-fidelity statistics .pt), "
                     "'folder:PATH' (images), 'parquet:PATH' (image column), or a path ending .npz/.pt/.parquet "
                     "or an existing directory")


def parse_reference(reference: str) -> tuple[str, str]:
    """``"kind:path"`` or a bare path / ``digits`` -> (kind, path); ValueError naming the allowed forms."""
    if reference == "digits":
        return "digits", ""
    for prefix in REFERENCE_KINDS[1:]:
        if reference.startswith(prefix + ":"):
            return prefix, reference[len(prefix) + 1 :]
    if reference.endswith(".npz"):
        return "npz", reference
    if reference.endswith((".pt", ".pth")):
        return "fidelity-stats", reference
    if reference.endswith(".parquet"):
        return "parquet", reference
    path = Path(reference)
    if path.is_dir():
        return ("parquet" if any(path.rglob("*.parquet")) else "folder"), reference
    raise ValueError(f"cannot tell what {reference!r} is; allowed: {REFERENCE_ALLOWED}")


def check_reference(reference: str) -> None:
    """Refuse, before anything runs, a reference the reducer could not read (ValueError, no field prefix).

    Reads no tensors: the kind is known, the path exists and has the right shape on disk (a file or a
    folder), and an ADM ``.npz`` holds ``mu`` and ``sigma`` (its member list, read without unpickling).
    """
    kind, path = parse_reference(reference)
    if kind == "digits":
        return
    if "://" in path:
        raise ValueError(f"{kind} reference {path!r}: the reducer reads references from a local path only")
    file = Path(path).expanduser()
    if not file.exists():
        raise ValueError(f"{kind} reference {path!r} does not exist")
    wants_file = kind in ("npz", "fidelity-stats")
    if wants_file and not file.is_file() or kind == "folder" and not file.is_dir():
        raise ValueError(f"{kind} reference {path!r} must be a {'file' if wants_file else 'folder'}")
    if kind == "npz":
        import zipfile

        try:
            with zipfile.ZipFile(file) as archive:
                members = {os.path.splitext(name)[0] for name in archive.namelist()}
        except zipfile.BadZipFile:
            raise ValueError(f"npz reference {path!r} is not an .npz archive") from None
        missing = sorted({"mu", "sigma"} - members)
        if missing:
            raise ValueError(f"npz reference {path!r} lacks {missing} (an ADM reference batch holds mu and "
                             f"sigma); it has {sorted(members)}")
