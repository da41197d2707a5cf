"""Parameters of the diffusion family's methods (spec spec_diffusion.md); torch-free."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from specray.methods.params import Gamma, MethodParams


class Common(MethodParams):
    """The sampler every method shares: ``num_steps`` respaced DDPM (or Euler-Maruyama) steps."""

    num_steps: Annotated[int, Field(ge=2, le=10_000)] = 100
    sampler: Literal["ddpm", "euler_maruyama"] = "ddpm"
    churn: Annotated[float, Field(gt=0)] = 1.0  # > 0: deterministic steps cannot be speculated
    guidance_scale: Annotated[float, Field(ge=0)] = 1.0

    @property
    def lossless(self) -> bool:
        return True


class TargetOnly(Common):
    """Plain ancestral sampling: one target call per step."""


class Speculative(Common):
    """Draft γ steps, verify them in one target call, resample the first rejected step."""

    verification: ClassVar[str]
    drafter: Literal["frozen", "free", "model"] = "free"  # free: training-free, cheapest per round
    gamma: Gamma = 7

    @property
    def needs_draft(self) -> bool:
        return self.drafter == "model"


class SpecToken(Speculative):
    """Token verification (stop at the first rejected step); reflection or the residual sampler ψ_α."""

    verification: ClassVar[str] = "token"
    rejection: Literal["reflection", "residual"] = "reflection"


class SpecBlock(Speculative):
    """Block verification; only the residual sampler ψ_α is exact here, so reflection is refused."""

    verification: ClassVar[str] = "block"
    rejection: Literal["residual"] = "residual"
