"""Parameters of the continuous family's methods (spec cspd.md); torch-free.

CSpD's ``mode`` names a setting of the three paper/code conflicts (spec §2.5, §9.1-2):

============ ================= ====== ================
mode         sigma_orientation kappa  final_step_noise
============ ================= ====== ================
``exact``    none              1      True
``paper``    paper             1      False
``code``     code              42     False
============ ================= ====== ================

``paper`` and ``code`` accept explicit overrides of the three (ablations); ``exact`` refuses them.
``exact`` is the default because it is the only setting in which each accepted or resampled token
is exactly distributed as the target's head given the same context (spec §5.6); in the windowed
scheme the speedup is set by call counts, not by the acceptance rate (§1.4a), so exactness costs
no speed there.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from specray.methods.params import Gamma, MethodParams, ParamError

MODES: dict[str, dict[str, Any]] = {
    "exact": {"sigma_orientation": "none", "kappa": 1.0, "final_step_noise": True},
    "paper": {"sigma_orientation": "paper", "kappa": 1.0, "final_step_noise": False},
    "code": {"sigma_orientation": "code", "kappa": 42.0, "final_step_noise": False},
}


class Common(MethodParams):
    """The token sampler every method shares (MAR's settings; per-token head chain)."""

    order: Literal["random", "raster"] = "random"
    temperature: Annotated[float, Field(gt=0)] = 1.0
    cfg: Annotated[float, Field(ge=0)] = 1.0
    cfg_schedule: Literal["constant", "linear"] = "constant"
    sample_steps: Annotated[int, Field(ge=2, le=1000)] | None = None  # None: the model's own
    clip_denoised: bool = True  # clamp x̂0 to [-1, 1] (MAR: False; see methods/continuous/head.py)


class TargetOnly(Common):
    """One token per AR step, each sampled by the target's head chain."""

    final_step_noise: bool = False

    @property
    def lossless(self) -> bool:
        return True


class CSpD(Common):
    """Continuous speculative decoding: aligned draft, windowed verification, residual resampling."""

    gamma: Gamma = 4
    prefill_ratio: Annotated[float, Field(ge=0, lt=1)] = 0.05  # ρ: steps k <= ρ·L are target steps
    mode: Literal["exact", "paper", "code"] = "exact"
    sigma_orientation: Literal["paper", "code", "none"] | None = None  # None: from mode
    kappa: Annotated[float, Field(gt=0)] | None = None
    final_step_noise: bool | None = None
    window: Literal["mar", "sequential"] = "mar"
    no_align: bool = False
    max_tries: Annotated[int, Field(ge=1, le=100_000)] = 100  # residual cap; hits are counted

    @model_validator(mode="after")
    def _apply_mode(self) -> "CSpD":
        for key, value in MODES[self.mode].items():
            current = getattr(self, key)
            if current is None:
                setattr(self, key, value)
            elif self.mode == "exact" and current != value:
                raise ParamError(key, f"must be {value!r} (or unset) in mode 'exact', got {current!r}")
        return self

    @property
    def lossless(self) -> bool:
        return self.mode == "exact"

    @property
    def law_note(self) -> str | None:
        # Exact mode samples the head's final step with noise, so its law is target_only's with
        # final_step_noise: true (the shared fields carry it over). With window: mar the target being
        # matched emits each window in one parallel step (spec §1.4c), not token by token.
        if self.lossless and self.window == "mar":
            return ("window: mar is exact for the target emitting each window in one parallel step; "
                    "target_only samples token by token, so a gap here measures the windowed scheme")
        return None

    @property
    def needs_draft(self) -> bool:
        return True
