"""The reducer's options (``eval.options`` in a job), validated with the job, before anything runs.

Torch-free, so ``specray validate`` checks them on a machine without torch.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field

from specray.methods.params import StrictParams

DIGITS_EXTRACTOR = "specray-digits"
INCEPTION_EXTRACTOR = "inception-v3-compat"
FEATURE_EXTRACTORS = (DIGITS_EXTRACTOR, INCEPTION_EXTRACTOR)


class ReduceOptions(StrictParams):
    """How the reducer scores a run; every field has a default that suits the digits presets."""

    model_config = ConfigDict(frozen=True)
    kind = "reducer option"

    device: str = "cpu"
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
