"""Attention of a discrete model's decode steps and verify calls on a CPU: the bits of torch's kernel,
without its BLAS calls.

On a CPU, ``F.scaled_dot_product_attention`` runs a flash-attention kernel that makes two BLAS calls for
every (row, head): at 1 to 9 queries over 16-192 slots of 16-float heads those calls are most of its
time, and attention about half of a target step at batch 128. ``csrc/decode_attention.cpp`` computes
the same steps with the BLAS's own summation orders written out (for 1 and for 4 to 9 queries), so
every output has the same bits; alone on a call it is 2-3x faster.

Those orders belong to the BLAS build, the CPU and the thread count, and were read off MKL 2024.2 at one
thread: on its AVX2 path (an AMD EPYC) and, for one query, on its AVX-512 path (an Intel Xeon), where 4 to 9
queries sum as on the AVX2 path (:data:`ONE_QUERY_ORDERS`); the softmax's running sums follow torch's own
build for the CPU, 8 lanes (AVX2) or 16 (AVX-512). So the kernel serves a query count only after it has
matched torch's kernel value for value on every span it serves (:data:`SPANS`, :func:`_matches_torch`), in
this process at this thread count; on any difference, or when it cannot be compiled
(:mod:`~specray.models.cpu_kernels` builds it), calls stay with torch's kernel, which gives the same values
anyway. Set ``SPECRAY_DECODE_KERNEL=0`` to skip it. The choice never changes a sample, only the time.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch
import torch.nn.functional as F

from specray.models import cpu_kernels

log = logging.getLogger(__name__)

HEAD_DIM = 16
# The query counts served: one (a decode step) and 4 to 9 (a verify call of gamma + 1 = 5 tokens among them);
# the BLAS sums 2 and 3 queries in orders not written out in the kernel.
QUERIES = (1, 4, 5, 6, 7, 8, 9)
# The spans served: whole 16-slot vectors up to 192, where the attention spans of the discrete models
# keep one summation order (discrete_ar.ATTENTION_SPAN_SHORT); longer calls stay with torch's kernel.
SPANS = tuple(range(16, 193, 16))
ENABLED = cpu_kernels.ENABLED
# The BLAS orders the kernel's one-query calls can follow (csrc/decode_attention.cpp): MKL's AVX2 path's (read on an
# AMD EPYC) and its AVX-512 path's (read on an Intel Xeon); MKL picks its path by the CPU. The other query counts sum
# alike on both paths.
ONE_QUERY_ORDERS = {0: "MKL's AVX2 path", 1: "MKL's AVX-512 path"}
# torch's kernel as imported, for the check: the reference stays torch's whatever later wraps F's function.
_TORCH_ATTENTION = F.scaled_dot_product_attention

_lock = threading.Lock()
_checked: dict[tuple[int, int], bool] = {}  # (threads, queries): the kernel gave torch's values


def _function() -> Callable | None:
    """The compiled kernel (:mod:`~specray.models.cpu_kernels`, built once per process), or None where the
    extension is off or not built."""
    module = cpu_kernels.extension()
    return None if module is None else module.decode_attention


def _cases(queries: int, span: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Inputs laid out as a model call has them: q a slice of the rotated q/k block, k and v head-major
    cache slots cut to ``span``, a 0/-inf mask with the first slot always open and every other row's slots
    ending early; scores spread wide enough that some weights underflow."""
    rows, heads, slots = 24, 4, 208
    qk = torch.randn(rows, queries, 2 * heads, HEAD_DIM, generator=generator) * 3
    q = qk[:, :, :heads].transpose(1, 2)
    k, v = (torch.randn(rows, heads, slots, HEAD_DIM, generator=generator)[:, :, :span] for _ in range(2))
    keep = torch.rand(rows, 1, queries, span, generator=generator) < 0.8
    # Every other row's slots end early, anywhere, as a ragged batch's rows do (all its queries masked past it).
    ends = torch.randint(1, span + 1, (rows, 1, 1, 1), generator=generator)
    ends[1::2] = span
    keep &= torch.arange(span) < ends
    keep[..., 0] = True
    mask = torch.where(keep, 0.0, float("-inf"))
    return q, k, v, mask


def _matches_torch(kernel: Callable, queries: int, orders: str = "") -> bool:
    """Whether ``kernel`` gives torch's values at ``queries`` queries on every span of :data:`SPANS`
    (2 draws each, seed 0), at the calling thread count; the log names the first difference (``orders``: the
    one-query orders tried)."""
    generator = torch.Generator().manual_seed(0)
    for span in SPANS:
        for _ in range(2):
            q, k, v, mask = _cases(queries, span, generator)
            want = _TORCH_ATTENTION(q, k, v, attn_mask=mask)
            got = kernel(q, k, v, mask, HEAD_DIM ** -0.5)
            if got is None or not torch.equal(got, want):
                log.info("decode attention: the CPU kernel differs from torch's at %d queries%s, span %d, %d "
                         "threads", queries, orders, span, torch.get_num_threads())
                return False
    return True


def kernel(queries: int = 1) -> Callable | None:
    """The kernel if it gives torch's values at ``queries`` queries at this process's thread count, else
    None (built once per process, checked once per thread count and query count)."""
    key = (torch.get_num_threads(), queries)
    if key not in _checked:
        with _lock:
            if key not in _checked:
                built = _function()
                with torch.inference_mode(False):
                    _checked[key] = built is not None and queries in QUERIES and _checks(built, queries)
    return _function() if _checked[key] else None


def _checks(built: Callable, queries: int) -> bool:
    """:func:`_matches_torch`; at one query under each BLAS's orders the kernel knows (:data:`ONE_QUERY_ORDERS`), the
    process's current ones first, the first that matches kept for the process."""
    if queries != 1:
        matched = _matches_torch(built, queries)
    else:
        module = cpu_kernels.extension()
        current = module.get_one_query_orders()
        for orders in sorted(ONE_QUERY_ORDERS, key=lambda o: o != current):
            module.set_one_query_orders(orders)
            matched = _matches_torch(built, 1, f" under {ONE_QUERY_ORDERS[orders]}'s orders")
            if matched:
                break
    if not matched:
        log.info("decode attention: torch's kernel serves calls of %d queries at %d threads", queries,
                 torch.get_num_threads())
    return matched


def prepare() -> None:
    """Build the kernel and check every query count now, at this process's thread count (a loader calls
    it, so that the one-off work does not land inside a timed batch)."""
    for queries in QUERIES:
        kernel(queries)


def attention_for(x: torch.Tensor, head_dim: int, queries: int, span: int) -> Callable:
    """The attention function for one call of a discrete model's layers over a CPU cache: the kernel
    where it serves the call (float32 on a CPU, :data:`QUERIES` queries per row, 16-float heads, a span in
    :data:`SPANS`, and it matched torch's there), else ``F.scaled_dot_product_attention``."""
    if (queries not in QUERIES or head_dim != HEAD_DIM or span % 16 or span > SPANS[-1]
            or x.device.type != "cpu" or x.dtype != torch.float32 or not ENABLED):
        return F.scaled_dot_product_attention
    fast = kernel(queries)
    return F.scaled_dot_product_attention if fast is None else _Kernel(fast)


class _Kernel:
    """``F.scaled_dot_product_attention``'s signature over the kernel (default scale, additive mask)."""

    __slots__ = ("fast",)

    def __init__(self, fast: Callable) -> None:
        self.fast = fast

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
        out = self.fast(q, k, v, attn_mask, q.shape[-1] ** -0.5)
        # None: a call the kernel does not serve (a bool mask, a block off the 64-byte alignment the orders were read
        # at), which torch's kernel takes as given.
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask) if out is None else out
