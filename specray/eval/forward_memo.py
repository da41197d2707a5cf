"""The digits extractor's outputs, remembered by input batch, for the reducer's second pass over an arm.

The reducer extracts an arm's features while it streams the shards, then hands the kept images to
torch-fidelity's ``calculate_metrics``, which runs the same extractor over the same images in batches
of the same size: on a 50k job, a third of the reduce. The extractor is a deterministic function of
its input batch (same weights, dtype, batch shape and threads), so an output recalled here is the
output computing it again would give, bit for bit; a batch not seen before is computed as always.

A memo is active only inside ``forward_memo()``, keeps only the named layers, and stops keeping at
``max_bytes``. Keys: the batch's shape, dtype and a blake2b digest of its bytes, and the model's.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_active: ForwardMemo | None = None


class ForwardMemo:
    def __init__(self, layers: Sequence[str], max_bytes: int) -> None:
        self.layers = tuple(layers)
        self.max_bytes = max_bytes
        self.bytes = 0
        self.recalled = 0  # batches answered from the memo (tests and the reduce's log)
        self._outputs: dict[tuple, dict[str, torch.Tensor]] = {}

    @staticmethod
    def key(batch: torch.Tensor, model: tuple) -> tuple | None:
        """None for a batch that is not uint8 on the CPU (a GPU reduce computes again)."""
        if batch.device.type != "cpu" or batch.dtype != torch.uint8:
            return None
        digest = hashlib.blake2b(batch.contiguous().numpy().tobytes(), digest_size=16).digest()
        return (*model, tuple(batch.shape), str(batch.dtype), digest)

    def recall(self, key: tuple | None, layers: Sequence[str]) -> dict[str, torch.Tensor] | None:
        outputs = self._outputs.get(key) if key is not None else None
        if outputs is None or any(name not in outputs for name in layers):
            return None
        self.recalled += 1
        return outputs

    def keep(self, key: tuple | None, outputs: dict[str, torch.Tensor]) -> None:
        kept = {name: outputs[name].detach() for name in self.layers if name in outputs}
        size = sum(t.numel() * t.element_size() for t in kept.values())
        if key is None or not kept or key in self._outputs or self.bytes + size > self.max_bytes:
            return
        self._outputs[key] = kept
        self.bytes += size


def active() -> ForwardMemo | None:
    return _active


@contextmanager
def forward_memo(layers: Sequence[str], max_bytes: int) -> Iterator[ForwardMemo]:
    """Remember the digits extractor's ``layers`` for the duration (one arm of a reduce)."""
    global _active
    previous, _active = _active, ForwardMemo(layers, max_bytes)
    try:
        yield _active
    finally:
        _active = previous
