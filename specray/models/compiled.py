"""The compiled decode path of the discrete family (job field ``compile: true``).

The discrete models' KV cache is static: ``[rows, max_len]`` slots per layer, slot = sequence
position, written at each row's own positions (:class:`~specray.models.discrete_ar.KVCache`). So
the decode step on every row (:meth:`DiscreteGPT.decode_all_rows`) has fixed shapes and no host
sync, and ``torch.compile(fullgraph=True)`` captures it whole: one graph per call shape (a
decode step, a verify of gamma + 1 tokens, a draft catch-up of 2), compiled on first use. On a
GPU the graphs are also replayed as CUDA graphs (``mode="reduce-overhead"``); the cache tensors
are then marked static (:meth:`DiscreteGPT.new_cache`), since every step writes them in place, and
each batch's new cache is recorded once.

Calls the compiled step does not cover run eager, as before: the prefix (position 0) and calls on
a subset of the cache rows (the tail rounds once fewer than half the rows take part), and the
EAGLE-head arms' tree calls. The compiled kernels are not the eager ones, so the logits differ in
the last bits (~1e-6). Both paths are exact samplers of the same law, and the tokens are the same
almost always (``tests/test_compiled.py``, ``bench/compiled.py`` compare them), but not always: a
speculative round's residual ``[p - q]_+`` is a difference of nearly equal laws where target and
draft agree, which magnifies last-bit differences, so a residual draw can change. On the fid50k
job's first 1,024 samples, 0 of 1,024 target_only samples and 2 of 2,048 sd / cool_sd samples
differed. Hence ``compile`` is part of the job's fingerprint, and eager stays the default.
"""

from __future__ import annotations

import logging

import torch

from specray.models.discrete_ar import DiscreteGPT
from specray.models.pair import ModelPair

log = logging.getLogger(__name__)


def compile_gpt(model: DiscreteGPT) -> None:
    """Route ``model``'s all-rows decode steps through ``torch.compile`` (idempotent)."""
    if model.compiled_decode is not None:
        return
    cuda = model.output.weight.device.type == "cuda"
    compiled = torch.compile(model.decode_all_rows, fullgraph=True, dynamic=False,
                             mode="reduce-overhead" if cuda else None)

    def decode(*args: torch.Tensor | list[torch.Tensor]) -> torch.Tensor:
        try:
            return compiled(*args)
        except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported) as exc:
            # A compiler that cannot build this step (no C++ toolchain, an unsupported op on this
            # device) must not fail the shard: the eager step samples the same law.
            log.warning("torch.compile failed for the decode step (%s: %s); this model runs eager from now on",
                        type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            model.compiled_decode = model.decode_all_rows
            return model.decode_all_rows(*args)

    model.compiled_decode = decode


def compile_pair(pair: ModelPair) -> None:
    """Compile the decode steps of the pair's GPTs (an EAGLE-head draft stays eager)."""
    for model in (pair.target, pair.draft):
        if isinstance(model, DiscreteGPT) and not model.caption_conditioned:
            compile_gpt(model)
