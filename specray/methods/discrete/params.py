"""Parameters of the discrete family's methods (spec discrete_sd.md); torch-free.

Every method samples through the same logits processing (CFG on raw logits, then temperature,
top-k, top-p: :class:`Sampling`); the speculative ones add the draft length ``gamma`` and their
rule's own parameters. Defaults are the spec's, or the papers' where the spec is open (README's
table of defaults).
"""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from specray.methods.discrete.trees import TreeError, resolve_tree
from specray.methods.params import Gamma, MethodParams, ParamError


class Sampling(MethodParams):
    """The sampler every method shares; ``target_only`` is exactly this."""

    cfg_scale: Annotated[float, Field(ge=0)] = 1.5
    temperature: Annotated[float, Field(ge=0)] = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # 0 = off
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0  # 1 = off
    # LlamaGen's cfg-interval: image tokens 0 .. cfg_interval + 1 are guided, later ones use the
    # conditional logits alone (the uncond stream is still fed); -1 = guide every token.
    cfg_interval: Annotated[int, Field(ge=-1)] = -1

    @property
    def lossless(self) -> bool:
        return True

    @property
    def uses_uncond(self) -> bool:
        """Whether the unconditional stream is needed (cfg_scale != 1)."""
        return self.cfg_scale != 1.0


class TargetOnly(Sampling):
    """Plain ancestral sampling from the target."""


class Speculative(Sampling):
    """A draft -> verify -> commit method. ``rule`` names its verification rule in ``rules.py``.

    ``tree``: draft a static tree instead of a chain of ``gamma`` tokens (needs an EAGLE head as the
    draft; spec §3.5): a named tree (``trees.NAMED_TREES``) or a list of node paths. The tree's depth
    is then the draft length, so ``gamma`` is not given.
    """

    rule: ClassVar[str]
    gamma: Gamma = 4
    tree: str | list[list[int]] | None = None

    @model_validator(mode="after")
    def _tree(self) -> "Speculative":
        if self.tree is None:
            return self
        try:
            resolve_tree(self.tree)
        except TreeError as exc:
            raise ParamError("tree", str(exc)) from None
        if "gamma" in self.model_fields_set:
            raise ParamError("gamma", "a tree sets the draft length (its depth); give gamma or tree, not both")
        return self

    @property
    def needs_draft(self) -> bool:
        return True

    def to_dict(self) -> dict:
        # A chain's parameters read as before trees existed: same params column, same job fingerprint.
        # A tree's carry no gamma (its depth is the draft length), so they parse again as they were given.
        out = super().to_dict()
        out.pop("tree" if out.get("tree") is None else "gamma", None)
        return out

    @property
    def draft_length(self) -> int:
        """Tokens a round may accept: ``gamma``, or the tree's depth."""
        return self.gamma if self.tree is None else resolve_tree(self.tree).depth


class SD(Speculative):
    """Standard speculative sampling (spec §1): exact."""

    rule: ClassVar[str] = "sd"


class Block(Speculative):
    """Block verification (spec §2): exact, never fewer tokens than ``sd`` in expectation. Chains only."""

    rule: ClassVar[str] = "block"

    @model_validator(mode="after")
    def _chain_only(self) -> "Block":
        if self.tree is not None:
            raise ParamError("tree", "block verification is defined for one draft block (a chain); "
                                     "allowed: null (use sd, lantern, cool_sd or uniform_rsd on a tree)")
        return self


class Lantern(Speculative):
    """LANTERN (``mode: delta``) / LANTERN++ (``mode: lambda``) relaxed acceptance (spec §3)."""

    rule: ClassVar[str] = "lantern"
    k: Annotated[int, Field(ge=0)] = 5
    lam: float | None = 2.0
    delta: float | None = None
    mode: Literal["lambda", "delta"] = "lambda"
    residual: Literal["gstar", "official"] = "gstar"
    forbid_zero_target_mass: bool = False
    normalize_embeddings: bool = True

    @model_validator(mode="after")
    def _budget(self) -> "Lantern":
        if self.mode == "lambda" and (self.lam is None or self.lam < 1.0):
            raise ParamError("lam", f"must be a number >= 1 in mode 'lambda', got {self.lam!r}")
        if self.mode == "delta" and (self.delta is None or not 0.0 <= self.delta <= 1.0):
            raise ParamError("delta", f"must be a number in [0, 1] in mode 'delta', got {self.delta!r}")
        return self

    @property
    def lossless(self) -> bool:
        # The G* residual reduces to sd exactly when no neighbour mass can be borrowed.
        no_budget = self.k == 0 or (self.lam == 1.0 if self.mode == "lambda" else self.delta == 0.0)
        return self.residual == "gstar" and no_budget


class CoolSD(Speculative):
    """COOL-SD: ω_i = δ·exp(−ν i − μ) with the G* residual (spec §4). ``mu: null`` = mean normalisation."""

    rule: ClassVar[str] = "cool_sd"
    delta: Annotated[float, Field(ge=0)] = 1.1
    nu: float = 0.7
    mu: float | None = None

    @model_validator(mode="after")
    def _finite_schedule(self) -> "CoolSD":
        # Every ω_i must be a float64 number: an infinite one times a zero target mass is NaN, and a round
        # would then draw from a NaN law. (mu null with a large nu also fails: the mean of exp(−ν i) is 0.)
        try:
            length = self.draft_length
        except TreeError:
            return self  # Speculative._tree names the tree's fault
        try:
            finite = all(math.isfinite(omega) for omega in self.multipliers())
        except (OverflowError, ValueError):
            finite = False
        if not finite:
            raise ParamError("mu" if self.mu is not None else "nu",
                             f"the multipliers ω_i = δ·exp(−ν i − μ), i = 1..{length}, overflow float64 with "
                             f"delta={self.delta}, nu={self.nu}, mu={self.mu}; allowed: −ν i − μ ≤ 709 for every i "
                             "(mu null: |nu| small enough that the mean of exp(−ν i) is a positive float64)")
        return self

    def resolved_mu(self) -> float:
        """μ itself: mean normalisation over the full round (mean ω = δ) when ``mu`` is null."""
        if self.mu is not None:
            return self.mu
        length = self.draft_length
        return math.log(sum(math.exp(-self.nu * i) for i in range(1, length + 1)) / length)

    def multipliers(self) -> list[float]:
        """ω_i = δ·exp(−ν i − μ), i = 1..draft_length, as Python floats (``rules.cool_sd_omegas``: the tensor)."""
        mu = self.resolved_mu()
        return [self.delta * math.exp(-self.nu * i - mu) for i in range(1, self.draft_length + 1)]

    @property
    def lossless(self) -> bool:
        # With every ω_i <= 1 the relaxed rule only tightens acceptance and G* restores the law.
        return max(self.multipliers()) <= 1.0


class UniformRSD(Speculative):
    """UNIFORM-RSD: COOL-SD with a constant ω = δ (spec §4.5 ablation)."""

    rule: ClassVar[str] = "uniform_rsd"
    delta: Annotated[float, Field(ge=0)] = 1.1

    @property
    def lossless(self) -> bool:
        return self.delta <= 1.0
