"""The compiled paths of the AR families (job field ``compile: true``).

**Discrete family: the decode step.** The discrete models' KV cache is static: ``[rows, max_len]``
slots per layer, slot = sequence position, written at each row's own positions
(:class:`~specray.models.discrete_ar.KVCache`). So
the decode step on every row (:meth:`DiscreteGPT.decode_all_rows`) has fixed shapes and no host
sync, and ``torch.compile(fullgraph=True)`` captures it whole: one graph per call shape (a
decode step, a verify of gamma + 1 tokens, a draft catch-up of 2), compiled on first use. On a
GPU the graphs are also replayed as CUDA graphs (``triton.cudagraphs``, what ``mode="reduce-overhead"`` sets;
a mode excludes the options a step needs); the cache tensors are then marked static
(:meth:`DiscreteGPT.new_cache`), since every step writes them in place, and each batch's caches are the previous
batch's buffers at the same addresses (:mod:`~specray.models.buffer_reuse`), so the graphs recorded on the first
batch of each shape replay on the later ones. A step asked for its probabilities (the default sampler's
``CfgSoftmax``) makes them in its graph (``discrete_ar.COMPILED_SOFTMAX``): after a compiled CPU call the CFG mix
and softmax cost 30-46 us at batch 1 as separate operations, a fused loop in the graph next to nothing.

Calls the compiled step does not cover run eager, as before: the prefix (position 0) and calls on
a subset of the cache rows (the tail rounds once fewer than half the rows take part), and the
EAGLE-head arms' tree calls. The compiled kernels are not the eager ones, so the logits differ in
the last bits (~1e-6). Both paths are exact samplers of the same law, and the tokens are the same
almost always (``tests/test_compiled.py``, ``bench/compiled.py`` compare them), but not always: a
speculative round's residual ``[p - q]_+`` is a difference of nearly equal laws where target and
draft agree, which magnifies last-bit differences, so a residual draw can change. On the fid50k
job's first 1,024 samples, 0 of 1,024 target_only samples and 2 of 2,048 sd / cool_sd samples
differed (so too with the probabilities made in the graph). Hence ``compile`` is part of the job's fingerprint,
and eager stays the default.

A compiled model's step or head has a code object of its own (:func:`_own_code`) and no guards on the model's own
attributes (``guard_filter_fn``): torch checks a graph's guards at every call, and with the models sharing their
code and every parameter guarded, a batch-1 CPU step spent more on those checks than on some of its kernels.

**Continuous family: the diffusion head.** A continuous token costs a chain of head calls (50
steps for the presets), and the head is a small MLP whose time on a CPU is mostly per-operation
dispatch, so the head network is what compiles (:func:`compile_head`): one graph with the number of
rows symbolic (``dynamic=True``; a single row is a second graph), whatever the window and the
active rows. The transformer calls stay eager. The head's outputs differ from eager in the last
bits, so the float tokens do too (~1e-6); the uint8 images written and the acceptance statistics
are what ``tests/test_compiled.py`` and ``bench/compiled.py`` compare. No CUDA graphs here: the row
count changes from call to call.
"""

from __future__ import annotations

import logging
import types
from collections.abc import Callable
from typing import Any

import torch

from specray.models.discrete_ar import DiscreteGPT
from specray.models.pair import ModelPair

log = logging.getLogger(__name__)

# Graphs torch may compile for one code object: a model's decode step or head (each its own code, _own_code).
# torch's default, 8, is a few batch sizes' shapes of a model (decode and verify or catch-up, each asked for logits
# or probabilities); a job with tail batches or arms of several gammas needs more. Past the limit a fullgraph compile
# fails, so the limit is raised (never lowered) when a model compiles, and a call that still hits it runs eager
# (:func:`_eager_on_failure`).
RECOMPILE_LIMIT = 64
# As this torch names them: older builds (pyproject allows 2.4, as a GPU image keeps its own) may call the limit
# cache_size_limit and lack the guard filter or the hard-failure error; without them a compile runs as before.
_LIMIT_NAME = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
_LIMIT_HIT = tuple(getattr(torch._dynamo.exc, name) for name in ("FailOnRecompileLimitHit", "FailOnCacheLimitHit")
                   if hasattr(torch._dynamo.exc, name))
_SKIP_MODULE_GUARDS = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
_NO_MODULE_GUARDS = {} if _SKIP_MODULE_GUARDS is None else {"guard_filter_fn": _SKIP_MODULE_GUARDS}


def _allow_recompiles() -> None:
    setattr(torch._dynamo.config, _LIMIT_NAME, max(getattr(torch._dynamo.config, _LIMIT_NAME), RECOMPILE_LIMIT))


def _own_code(method: Callable) -> Callable:
    """The bound ``method`` with a code object of its own. torch.compile keeps its graphs, and checks their guards
    at each call, per code object, and a class's models share their methods' code: a draft's decode step then
    checked the guards of the target's graphs (a hundred tensors each) before its own, 64 us alone and 142 us with
    the target's three call shapes beside it, at batch 1 on a CPU. Its own code keeps a model's graphs apart."""
    function = method.__func__
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    own.__kwdefaults__, own.__qualname__ = function.__kwdefaults__, function.__qualname__
    return types.MethodType(own, method.__self__)


def _eager_on_failure(compiled: Callable, eager: Callable, what: str, give_up: Callable[[], None]) -> Callable:
    """``compiled``, or ``eager`` from the first call that fails to compile on: a compiler that cannot
    build ``what`` (no C++ toolchain, an unsupported op on this device) must not fail the shard, and
    the eager call samples the same law. ``give_up`` switches the model to eager for good. A call shape past
    torch's recompile limit runs eager alone (said once): the shapes compiled already stay compiled."""
    limit_told = False

    def call(*args: torch.Tensor | list[torch.Tensor], **kwargs: Any) -> torch.Tensor:
        nonlocal limit_told
        try:
            return compiled(*args, **kwargs)
        except (torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported) as exc:
            log.warning("torch.compile failed for %s (%s: %s); this model runs eager from now on",
                        what, type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            give_up()
            return eager(*args, **kwargs)
        except _LIMIT_HIT:
            if not limit_told:
                limit_told = True
                log.warning("torch.compile reached its recompile limit (torch._dynamo.config.%s = %d) for %s; call "
                            "shapes not compiled yet run eager", _LIMIT_NAME,
                            getattr(torch._dynamo.config, _LIMIT_NAME), what)
            return eager(*args, **kwargs)

    return call


def compile_gpt(model: DiscreteGPT) -> None:
    """Route ``model``'s all-rows decode steps through ``torch.compile`` (idempotent)."""
    if model.compiled_decode is not None:
        return
    _allow_recompiles()
    cuda = model.output.weight.device.type == "cuda"
    # On a CPU the step's kernels are called from a C++ wrapper, not from Python: at batch 1 that call overhead is
    # what the compiled step has over the eager layers, which run in one C++ call too (discrete_ar.FusedLayers).
    # CUDA graphs on a GPU (mode="reduce-overhead" is this option; a mode excludes options). No guards on the
    # model's own attributes: its code is its own (_own_code), its parameters are the graph's inputs at each call,
    # and a model's layers do not change shape; the inputs' and caches' guards stay. A batch-1 CPU step otherwise
    # checks a guard per parameter and cache tensor (a hundred for the digits target) at every call.
    options = {"triton.cudagraphs": True} if cuda else {"cpp_wrapper": True}
    compiled = torch.compile(_own_code(model.decode_all_rows), fullgraph=True, dynamic=False,
                             options={**options, **_NO_MODULE_GUARDS})
    model.compiled_decode = _eager_on_failure(compiled, model.decode_all_rows, "the decode step",
                                              lambda: setattr(model, "compiled_decode", model.decode_all_rows))


def compile_head(model: torch.nn.Module) -> None:
    """Route a continuous model's diffusion-head calls (``model.head_net``) through ``torch.compile``
    (idempotent)."""
    if model.compiled_head is not None:
        return
    net = model.head_net
    _allow_recompiles()
    compiled = torch.compile(_own_code(net.forward), fullgraph=True, dynamic=True,
                             options=_NO_MODULE_GUARDS or None)

    def fresh(*args: torch.Tensor) -> torch.Tensor:
        # Inputs as fresh contiguous tensors: the loop passes views (a timestep expanded from the
        # schedule's table, slices and reshapes), and torch.compile guards on a view's base and
        # storage offset, which would make one more graph per kind of view.
        return compiled(*(a if a._base is None and a.is_contiguous() else a.contiguous().clone() for a in args))

    model.compiled_head = _eager_on_failure(fresh, net, "the diffusion head",
                                            lambda: setattr(model, "compiled_head", net))


def compile_pair(pair: ModelPair) -> None:
    """Compile the decode steps of the pair's GPTs (an EAGLE-head draft stays eager)."""
    for model in (pair.target, pair.draft):
        if isinstance(model, DiscreteGPT) and not model.caption_conditioned:
            compile_gpt(model)


def compile_continuous_pair(pair: ModelPair) -> None:
    """Compile the diffusion heads of a continuous pair's models."""
    for model in (pair.target, pair.draft):
        if model is not None:
            compile_head(model)
