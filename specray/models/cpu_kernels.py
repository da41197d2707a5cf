"""specray's C++ kernels for the discrete models' decode steps and verify calls on a CPU (``csrc/``): a model's layers
in one call, with the work around them (:class:`~specray.models.discrete_ar.FusedLayers`), the attention of
:mod:`~specray.models.decode_attention`, the K/V writes of :class:`~specray.models.discrete_ar.BlockWrite`, the RMSNorm
of :mod:`~specray.models.cpu_norm`, the speculative rounds' decisions and draws of
:mod:`~specray.methods.discrete.cpu_rounds`, the static-tree rounds' decisions, children draws
(:mod:`~specray.methods.discrete.cpu_tree_rounds`) and K/V moves, the discrete rounds' bookkeeping (positions, masks,
uniforms, the draft and verify calls' inputs and commits: ``cpu_rounds.bookkeeping``; the tally's prefix rounds:
:meth:`~specray.methods.common.RoundTally.flush`), the diffusion rounds' draws
(:mod:`~specray.methods.diffusion.cpu_draws`), log ratios (:mod:`~specray.methods.diffusion.cpu_ratios`), drafted states
(:mod:`~specray.methods.diffusion.cpu_draft`), verdicts (:mod:`~specray.methods.diffusion.rules`) and residual draws
(:mod:`~specray.methods.diffusion.residual`, these two where a process has loaded it already), the work after a
diffusion round's verify call in one call (:mod:`~specray.methods.diffusion.cpu_commit`), a diffusion round's slots
(:mod:`~specray.methods.diffusion.cpu_slots`), and the hash of :mod:`specray.rng` likewise, one extension.

It is built on first use with torch's C++ extension tools (g++ and ninja; about 45 s on 2 cores, then cached
under ``~/.cache/torch_extensions``, one folder per Python environment). Where it cannot be built (no AVX2, no compiler), or with
``SPECRAY_DECODE_KERNEL=0``, :func:`extension` is None and torch's own operations do the same work: the
kernels never change a value, only the time.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

NAME = "specray_cpu_kernels"
CSRC = Path(__file__).with_name("csrc")
SOURCES = tuple(CSRC / name for name in ("bindings.cpp", "decode_attention.cpp", "cache_write.cpp", "rms_norm.cpp",
                                         "rounds.cpp", "tree_rounds.cpp", "chain_bookkeeping.cpp",
                                         "tree_bookkeeping.cpp", "gaussian_draft.cpp", "splitmix.cpp",
                                         "residual_draw.cpp", "verdicts.cpp", "cached_layers.cpp", "round_draws.cpp",
                                         "round_ratios.cpp", "round_commit.cpp",
                                         "round_slots.cpp"))
# -ffp-contract=off: only the fused multiply-adds the attention kernel writes out may fuse (its sums must
# follow the BLAS's order); the AVX2 defines select ATen's 8-lane vector code, whose exp it reproduces.
CFLAGS = ["-O2", "-mavx2", "-mfma", "-ffp-contract=off", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"]
ENABLED = os.environ.get("SPECRAY_DECODE_KERNEL", "1") != "0"
BUILD_NOTICE_S = 5.0  # a load taking longer compiled the extension (a cached one loads in well under a second)

_lock = threading.Lock()
_built: dict[str, ModuleType | None] = {}
# Not _lock: a check builds the extension first. Reentrant: a check that draws (specray.rng) checks the hash's kernel.
_check_lock = threading.RLock()
_checked: dict[tuple[str, int, int], bool] = {}  # (function, threads, size): it gave torch's values


def extension() -> ModuleType | None:
    """The compiled extension (built once per process), or None: off, no AVX2, or the build failed (logged once)."""
    if "module" not in _built:
        with _lock:
            if "module" not in _built:
                _built["module"] = _build() if ENABLED else None
    return _built["module"]


def loaded() -> ModuleType | None:
    """The extension if this process has loaded it already, else None (never builds or loads it)."""
    return _built.get("module")


def _build_directory() -> Path:
    """This environment's own build folder under torch's extensions root. torch's default folder is shared
    by every environment with the same Python and CUDA versions; their torch include paths differ, so two
    of them (a Ray job's runtime environment and the user's, a CI virtualenv and a developer's) would
    each rebuild it in turn."""
    from torch.utils.cpp_extension import get_default_build_root

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    environment = hashlib.sha256(str(Path(torch.__file__).resolve().parent).encode()).hexdigest()[:12]
    folder = root / f"{NAME}-{environment}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _build() -> ModuleType | None:
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        log.info("specray CPU kernels: CPU capability %s; using torch's operations", capability)
        return None
    began = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        # Said before the wait: a first use (or changed sources) compiles, silently, for most of a minute.
        log.info("specray CPU kernels: loading (a first use in an environment compiles them: about 45 s "
                 "on 2 cores)")
        module = load(name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=CFLAGS, verbose=False,
                      build_directory=str(_build_directory()))
    except Exception as exc:  # no compiler, no ninja, headers missing: torch's operations do the same work
        log.warning("specray CPU kernels: the extension did not build (%s); using torch's operations", exc)
        return None
    took = time.perf_counter() - began
    if took > BUILD_NOTICE_S:  # it was compiled (changed sources, too): say where the wait went
        log.info("specray CPU kernels: compiled in %.0f s, cached for later runs", took)
    return module


def checked(name: str, size: int, matches: Callable[[Callable, int], bool]) -> Callable | None:
    """The extension's function ``name`` if ``matches(function, size)`` held at this thread count, else None: the
    check runs once per (function, thread count, size), on plain tensors. A kernel whose sums follow torch's order
    serves a size only after giving torch's values there (those orders may change with a torch build)."""
    key = (name, torch.get_num_threads(), size)
    if key not in _checked:
        with _check_lock:
            if key not in _checked:
                module = extension()
                with torch.inference_mode(False):
                    _checked[key] = module is not None and matches(getattr(module, name), size)
                if module is not None and not _checked[key]:
                    log.info("specray CPU kernels: %s differs from torch's operations at size %d, %d threads; "
                             "using torch's there", name, size, key[1])
    return getattr(extension(), name) if _checked[key] else None


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, but NaN for NaN (its payload is the hardware's)."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan = a.isnan()
    return bool(torch.equal(nan, b.isnan()) and torch.equal(a.view(ints)[~nan], b.view(ints)[~nan]))
