"""The per-sample statistics record every decoding loop returns.

Field names follow the design's data section (vLLM's speculative-decoding
metric names where one exists).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class SampleStats:
    """What one sample cost and how much of its draft was accepted.

    ``mean_acceptance_length`` is tokens (or denoising steps) emitted per target
    call, the bonus/correction included; ``target_only`` has 1.0.
    ``accepted_per_position[i]`` counts rounds in which draft position ``i`` was
    accepted (length gamma; empty for non-speculative methods).
    ``extra`` holds family-specific numbers (resampling tries, cap hits, states
    evaluated...); it is stored as a JSON column.
    """

    num_tokens: int
    num_spec_steps: int = 0
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    target_calls: int = 0
    draft_calls: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def draft_acceptance_rate(self) -> float:
        if self.num_draft_tokens == 0:
            return float("nan")
        return self.num_accepted_draft_tokens / self.num_draft_tokens

    @property
    def mean_acceptance_length(self) -> float:
        if self.target_calls == 0:
            return float("nan")
        return self.num_tokens / self.target_calls

    def as_row(self) -> dict[str, Any]:
        row = asdict(self)
        row["draft_acceptance_rate"] = self.draft_acceptance_rate
        row["mean_acceptance_length"] = self.mean_acceptance_length
        return row
