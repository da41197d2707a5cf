"""LlamaGen-style class-conditional GPT over discrete image tokens, with a ragged KV cache.

Module and parameter names follow LlamaGen's ``autoregressive/models/gpt.py``
(``tok_embeddings``, ``cls_embedding.embedding_table``, ``layers.{i}.attention.wqkv/wo``,
``layers.{i}.feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``, ``norm``,
``output``) so a LlamaGen c2i checkpoint can be mapped onto it later.

Sequence layout (c2i, one prefix token): sequence position 0 holds the class
embedding (row ``num_classes`` of the table is the CFG null class); position
``p >= 1`` holds image token ``p - 1``. The logits at position ``p`` predict
image token ``p``. RoPE is 2-D over the image grid; the prefix position gets
LlamaGen's all-zero cos/sin rows by default (``prefix_rope="zeros"``, what the
released checkpoints were trained with) or the identity rotation
(``prefix_rope="identity"``).

Caption prefix (``condition="caption"``, LlamaGen t2i): sequence position 0 stands for the
whole caption, ``cls_token_num`` (120) cache slots of projected T5 token features
(:mod:`specray.models.captions`); position ``p >= 1`` sits in slot ``p + cls_token_num - 1``.
So the loops keep their layout (position 0 is the condition, position ``p`` predicts image
token ``p``) while the model attends over the real slots, with the caption's padded slots
masked as keys. All prefix slots get the zero RoPE rows, as in the official table.

The cache holds ``[rows, max_len]`` slots per layer (on a CPU ``max_len`` rounded up,
:func:`kv_slots`), slot = sequence position; an eager CPU cache holds only the first slots its calls
have needed so far (:meth:`KVCache.reserve`). Each row has its own length; a call writes K/V at the
rows' own positions and each query attends to slots ``<= its position``, so slots left stale by a
rejected draft are invisible once a later call rewrites them. On a CPU a call attends
over the cache's first slots only, rounded up past its last position, or past ``max_seq_len`` where
later positions are padding (:func:`attention_span`): the same bits as the whole cache at every
real position, at the cost of the filled part.
"""

from __future__ import annotations

import functools
import math
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from specray.models import buffer_reuse, cpu_kernels, cpu_norm, decode_attention
from specray.models.captions import CAPTION_PADDINGS, CaptionEmbedder
from specray.models.conditioning import TextConditionEmbedding
from specray.models.pair import ModelPair

PREFIX_ROPE_MODES = ("zeros", "identity")
CONDITIONS = ("class", "text", "caption")
# Rotary pair swap (the same values either way): from this many elements on, one cat of the pairs'
# two halves beats index_select's per-element gather; below, the gather's lower fixed cost wins
# (2-core CPU, 8 heads of q and k of 16: 4.5 against 10 µs at 2 rows, 330 against 80 µs at 256 rows x 5 tokens).
PAIR_SWAP_BY_SLICES = 8192
# A masked slot adds an exact zero to attention's sums, so a prefix of the cache gives the bits of
# the whole cache when the CPU kernel sums in the same order over both. It blocks the keys by 512 and,
# within a block, sums in one order over every whole number of 16-slot vectors up to 192 and over the
# whole block: on AVX2 past 192 keys its matrix products sum in another order, and a length off the
# vectors gets a scalar tail (both CPUs measured, tests/test_attention_span.py). So on a CPU spans and
# caches have such lengths (cpu_attention_slots); ATTENTION_SPANS = False makes every call attend
# over the whole cache (the tests' and bench/attention_span.py's reference).
ATTENTION_SPAN_QUANTUM = 16
ATTENTION_SPAN_BLOCK = 512
ATTENTION_SPAN_SHORT = 192
ATTENTION_SPANS = True
# Below this many tokens per call (rows x positions) the per-value K/V write's lower fixed cost wins
# over BlockWrite's (2-core CPU, dim 64: 7 against 15 us at 2 rows x 1 token).
BLOCK_WRITE_MIN_TOKENS = 256
# Whether BlockWrite copies with the C++ extension where it is built (False: torch's indexed write; for A/B).
BLOCK_WRITE_KERNEL = True
# Whether an eager CPU cache grows with its calls' spans (KVCache.reserve) instead of holding every slot
# from the start (False: static, for A/B). A call then reads whole head blocks, one contiguous stretch
# of memory, where it would read each block's first slots and skip the rest: at fid50k's batch of 128
# the attention reads caches larger than the CPU's caches, and skipping made those reads up to 2x slower.
GROWING_CACHES = True
# Only a cache that would take more than this with every slot held grows. A smaller one sits in the CPU's caches, where
# reading each block's first slots costs what reading whole blocks does, and growing it costs a copy of every layer's
# slots per growth and its per-tensor Python: at batch 1 the digits presets' target cache (1 MB) grew four times a
# batch and the draft's four more, some 1.9 ms of a 30-36 ms sd batch (0 restores growing for every cache, for A/B).
GROWING_CACHE_MIN_BYTES = 4 << 20
# A cache whose calls read it few times a batch (new_cache's few_reads: the speculative loop's target, one verify call
# a round against target_only's call a token) grows only where it would not fit in the CPU's last-level cache: a growth
# copies every held slot, and what it saves is each call's reads of short stretches, cheap from that cache. On the
# AVX-512 machine (260 MB of L3) the 50k job's sd and cool_sd batches ran 4-5 % shorter against target_only's with
# their target caches whole (126 MB at batch 128), and in turns in one process sd at batch 32 (31 MB) 1.09x faster;
# on the AMD EPYC machine (32 MB) growing read sd 1.06x faster at 128 and 0.95x at 32 (docs/benchmarks.md). False:
# such caches grow as any other (for A/B).
FEW_READS_WHOLE_IN_LAST_LEVEL_CACHE = True
# Whether an eager CPU call runs its layers in one call of the C++ extension where it is built (fused_layers: the
# same ATen operations without Python's share of their dispatch; False: the Python layers, for A/B).
FUSED_LAYERS = True
# Whether such a call of a GPT's cached forward also does the work around its layers in that C++ call (the
# embedding, rotary and mask lookups, the cache lengths, the final norm and the output layer: a third of a
# batch-1 draft step's time in Python; False: those in Python around the fused layers, for A/B).
FUSED_STEP = True
# Whether a CPU call's decisions (the cache's growth, the span, the K/V write) read its positions from one host
# copy (HostPositions) instead of a torch reduction each (False: those reductions, for A/B).
HOST_POSITIONS = True
# Whether such a C++ call also makes the probabilities its caller asks for (CfgSoftmax; False: Python makes them
# from the call's logits, for A/B).
FUSED_SOFTMAX = True
# Whether a compiled decode step (specray.models.compiled) makes the probabilities its caller asks for in its graph
# (False: Python makes them from the graph's logits, for A/B). After a compiled CPU call the six small operations of
# a batch-1 CfgSoftmax cost 30-46 us, 9 us timed alone; in the graph they are one fused loop.
COMPILED_SOFTMAX = True


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 17
    num_classes: int = 10
    grid_size: int = 8  # image is grid_size x grid_size tokens
    dim: int = 128
    n_layer: int = 4
    n_head: int = 4
    multiple_of: int = 32  # FFN hidden size rounding (LlamaGen uses 256 for its large models)
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    class_dropout_prob: float = 0.1
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0
    token_dropout_p: float = 0.0
    prefix_rope: str = "zeros"
    cls_token_num: int = 1
    condition: str = "class"  # "class": a class label at position 0; "text": a prompt's features there;
    # "caption": cls_token_num projected token features of a prompt (LlamaGen t2i)
    text_dim: int = 384  # width of the prompt features ("text" only)
    text_encoder: str = "minilm"  # the encoder whose features the model was trained on ("text" only)
    caption_dim: int = 2048  # width of the token features ("caption" only; flan-t5-xl: 2048)
    caption_padding: str = "left"  # where a caption's padding goes in the prefix ("caption" only)

    def __post_init__(self) -> None:
        if self.dim % self.n_head:
            raise ValueError(f"dim={self.dim} must be divisible by n_head={self.n_head}")
        if (self.dim // self.n_head) % 4:
            raise ValueError(f"head_dim={self.dim // self.n_head} must be divisible by 4 for 2-D RoPE")
        if self.prefix_rope not in PREFIX_ROPE_MODES:
            raise ValueError(f"prefix_rope={self.prefix_rope!r}; allowed: {', '.join(PREFIX_ROPE_MODES)}")
        if self.condition not in CONDITIONS:
            raise ValueError(f"condition={self.condition!r}; allowed: {', '.join(CONDITIONS)}")
        if self.cls_token_num != 1 and self.condition != "caption":
            raise ValueError("cls_token_num must be 1 (one conditioning token) unless condition is 'caption'")
        if self.cls_token_num < 1:
            raise ValueError(f"cls_token_num={self.cls_token_num} must be at least 1")
        if self.caption_padding not in CAPTION_PADDINGS:
            raise ValueError(f"caption_padding={self.caption_padding!r}; allowed: {', '.join(CAPTION_PADDINGS)}")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def num_image_tokens(self) -> int:
        return self.grid_size * self.grid_size

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        allowed = set(cls.__dataclass_fields__)
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}; allowed: {sorted(allowed)}")
        return cls(**d)


def flops_per_token(config: GPTConfig, context: int | None = None) -> int:
    """Forward multiply-add FLOPs (2 per MAC) for one token, weights plus attention over ``context`` keys."""
    context = config.num_image_tokens // 2 + 1 if context is None else context
    per_layer = 2 * (config.dim * 3 * config.dim + config.dim * config.dim + 3 * config.dim * config.ffn_hidden)
    attention = 2 * 2 * config.dim * context  # scores + weighted sum
    head = 2 * config.dim * config.vocab_size
    return config.n_layer * (per_layer + attention) + head


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.is_cpu and not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            return self._cpu_inference(x)
        if x.dtype == torch.float32:  # skip the no-op casts (dispatch overhead dominates at these sizes)
            return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.weight
        xf = x.float()
        out = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight

    def _cpu_inference(self, x: torch.Tensor) -> torch.Tensor:
        """The float32 branch's values for CPU inference, in one kernel call where it serves
        (:mod:`~specray.models.cpu_norm`): at these sizes the operations' dispatch is most of their time."""
        return cpu_norm.rms_norm(x, self.weight, self.eps)


class LabelEmbedding(nn.Module):
    """Class embedding with an extra CFG null row (index ``num_classes``) and label dropout."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels: torch.Tensor, drop_mask: torch.Tensor | None = None) -> torch.Tensor:
        if drop_mask is not None:
            labels = torch.where(drop_mask, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.wqkv = nn.Linear(config.dim, 3 * config.dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.resid_dropout = nn.Dropout(config.resid_dropout_p)
        pair_swap = torch.arange(config.head_dim).view(-1, 2).flip(-1).reshape(-1)  # 1, 0, 3, 2, ...
        self.register_buffer("pair_swap", pair_swap, persistent=False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: torch.Tensor,
        kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor] | None,
        attend: Callable[..., torch.Tensor] = F.scaled_dot_product_attention,
    ) -> torch.Tensor:
        """``x [R, n, D]``; ``rope``: see :func:`apply_rope`; ``mask [R, 1, n, S]``: bool (True = may attend),
        or its :func:`additive_mask` (on a CPU the eager calls over the cache build it once for every layer).

        ``kv`` = (k_cache, v_cache, read_rows, write_rows, positions): cache tensors
        ``[R_all, S, H, hd]`` written at ``[write_rows [R, 1], positions [R, n]]`` (or at two slices, or
        by a :class:`BlockWrite` given as ``write_rows``: see :func:`cache_write_index`) and then read
        for ``read_rows`` (None: all cache rows in order, read without a gather copy).
        Without it, attention runs over the ``n`` given positions only. ``attend``: the attention
        function, SDPA's signature (:func:`explicit_attention` while torch.compile captures the step,
        which fuses it into a few loops; a decode step's kernel on a CPU, :mod:`~specray.models.decode_attention`).
        """
        r, n, d = x.shape
        qkv = F.linear(x, self.wqkv.weight)  # module call overhead matters at these sizes
        # Rotate q and k in one pass (elementwise, so bit-identical to rotating them apart).
        qk = apply_rope(qkv[..., : 2 * d].view(r, n, 2 * self.n_head, self.head_dim), rope, self.pair_swap)
        q = qk[:, :, : self.n_head]
        k = qk[:, :, self.n_head :]
        v = qkv[..., 2 * d :].view(r, n, self.n_head, self.head_dim)
        if kv is not None:
            k_cache, v_cache, read_rows, write_rows, positions = kv
            if isinstance(write_rows, BlockWrite):
                write_rows.write(k_cache, k)
                write_rows.write(v_cache, v)
            else:
                if k.dtype != k_cache.dtype:  # only then: a no-op cast still costs a dispatch (~1.5 us)
                    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
                k_cache[write_rows, positions] = k
                v_cache[write_rows, positions] = v
            span = mask.shape[-1]  # the mask covers the first `span` slots (attention_span)
            if span < k_cache.shape[1]:
                k_cache, v_cache = k_cache[:, :span], v_cache[:, :span]
            k = k_cache if read_rows is None else gather_rows(k_cache, read_rows)
            v = v_cache if read_rows is None else gather_rows(v_cache, read_rows)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        out = F.linear(out.transpose(1, 2).reshape(r, n, -1), self.wo.weight)
        return self.resid_dropout(out) if self.training else out


def attention_span(last_slots: torch.Tensor, max_len: int, what: str = "slot", fed: int | None = None,
                   checked: int | None = None) -> int:
    """How many leading cache slots a call whose queries see no slot past ``last_slots`` attends over
    (refusing, as :func:`_check_slots`, slots past the cache; ``what`` names them in the error).

    On a CPU: :func:`cpu_attention_slots` of ``max(last_slots) + 1``, at most ``max_len`` (a CPU
    cache's own length is such a length, :func:`kv_slots`); reading the scalar is a host sync, free
    there. Elsewhere, while torch.compile captures a step (static shapes, no sync), and with
    :data:`ATTENTION_SPANS` off, the whole cache.

    ``fed``: the slots a real token can occupy (slot = position, :attr:`DiscreteGPT.max_seq_len`). A
    query past them is padding whose output the caller discards, so on a CPU the span stops there:
    a speculative loop's padded last verify or a parked row would otherwise make every row of the
    call attend over the whole cache (80 slots of the presets' speculative cache against 64).

    ``checked``: the largest of ``last_slots``, already checked by the caller (:meth:`KVCache.reserve`),
    so that the call reads it on the host once.
    """
    if checked is not None:
        last: int | None = checked
    else:
        last = None if torch.compiler.is_compiling() else _check_slots(what, last_slots, max_len)
    if last is None or not ATTENTION_SPANS:
        return max_len
    needed = last + 1 if fed is None else min(last + 1, fed)
    return min(max_len, cpu_attention_slots(needed))


def cpu_attention_slots(needed: int) -> int:
    """The fewest key slots, at least ``needed``, over which the CPU attention kernel sums in the order it
    uses over every longer such length: whole 512-slot blocks, then whole 16-slot vectors up to 192
    or one more whole block (see :data:`ATTENTION_SPAN_QUANTUM`). 69 -> 80, 200 -> 512, 600 -> 608."""
    start = (needed - 1) // ATTENTION_SPAN_BLOCK * ATTENTION_SPAN_BLOCK
    tail = -(-(needed - start) // ATTENTION_SPAN_QUANTUM) * ATTENTION_SPAN_QUANTUM
    return start + (tail if tail <= ATTENTION_SPAN_SHORT else ATTENTION_SPAN_BLOCK)


def call_rows(tokens: torch.Tensor, cache: "KVCache", rows: torch.Tensor | None
              ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The cache rows a call over explicit slots reads (``rows``; by default all, or the first ``r`` where it feeds
    fewer rows than the cache has) and the row column ``[r, 1]`` its K/V writes index."""
    if rows is None and tokens.shape[0] != cache.rows:
        rows = torch.arange(tokens.shape[0], device=tokens.device)
    return rows, (torch.arange(tokens.shape[0], device=tokens.device) if rows is None else rows)[:, None]


def cache_write_index(positions: torch.Tensor, rows: torch.Tensor | None, head_major: bool = False,
                      host: HostPositions | None = None
                      ) -> tuple[torch.Tensor | slice | BlockWrite, torch.Tensor | slice]:
    """Where a call writes its K/V: ``[rows, positions]`` as index tensors (rows default to all).

    On a CPU (not while torch.compile captures a step), with the same values written:

    - every cache row written at the same slots (target_only's steps, the first rounds): the two
      slices ``[:, p:p + n]``, a strided copy, about 2.5x cheaper than the indexed write (~1.5 ms of
      a 25 ms call at 256 rows);
    - else, from :data:`BLOCK_WRITE_MIN_TOKENS` tokens on into a ``head_major`` cache (:func:`kv_slots`),
      when every row's positions are consecutive: a :class:`BlockWrite`.

    The checks read the positions on the host, a sync that is free on a CPU (from ``host``, their host copy,
    where the caller made one).
    """
    on_cpu = positions.device.type == "cpu" and not torch.compiler.is_compiling()
    r, n = positions.shape
    if rows is None and on_cpu:
        start = _level_start(positions) if host is None else host.level_start()
        if start is not None:  # a row's positions are consecutive: equal starts, equal slots
            return slice(None), slice(start, start + n)
    write_rows = torch.arange(r, device=positions.device) if rows is None else rows
    if (on_cpu and head_major and r * n >= BLOCK_WRITE_MIN_TOKENS
            and (_consecutive(positions) if host is None else host.consecutive())):
        return BlockWrite(write_rows, positions), positions
    return write_rows[:, None], positions


def _level_start(positions: torch.Tensor) -> int | None:
    """The rows' common first position, or None where they start apart."""
    lo, hi = torch.aminmax(positions[:, 0])  # one reduction for both ends
    start = int(lo)
    return start if start == int(hi) else None


class HostPositions:
    """A CPU call's positions ``[r, n]`` read to the host once (one ``tolist``), for the decisions around the call:
    the cache's growth and the span (:attr:`last`) and the K/V write (:func:`cache_write_index`), in place of a
    torch reduction and scalar reads for each (a max, an aminmax, three reads: about 7 of a batch-1 draft call's
    136 µs made as the loops make it)."""

    __slots__ = ("rows", "last")

    def __init__(self, rows: list[list[int]]) -> None:
        self.rows = rows
        self.last = max(map(max, rows))  # the largest position

    def level_start(self) -> int | None:
        """:func:`_level_start` on the host."""
        first = self.rows[0][0]
        return first if all(row[0] == first for row in self.rows) else None

    def consecutive(self) -> bool:
        """:func:`_consecutive` on the host."""
        return all(row[0] >= 0 and row == list(range(row[0], row[0] + len(row))) for row in self.rows)


def host_positions(positions: torch.Tensor) -> HostPositions | None:
    """The :class:`HostPositions` of a CPU call (:data:`HOST_POSITIONS`), else None: off the CPU a read is a sync,
    under torch.compile a graph break, and without positions there is nothing to read."""
    if (not HOST_POSITIONS or positions.device.type != "cpu" or torch.compiler.is_compiling()
            or positions.numel() == 0):
        return None
    return HostPositions(positions.tolist())


def _consecutive(positions: torch.Tensor) -> bool:
    """Whether every row of ``positions [r, n]`` is ``p, p + 1, .., p + n - 1`` with ``p >= 0``."""
    starts = positions[:, :1]
    steps = torch.arange(positions.shape[1], device=positions.device)
    return int(starts.min()) >= 0 and torch.equal(positions - starts, steps.expand_as(positions))


class BlockWrite:
    """K/V of ``n`` consecutive positions per row written as one block of ``n * head_dim`` values per
    (row, head): in the head-major cache (:func:`kv_slots`) those slots are contiguous. The C++ row
    copies of :mod:`~specray.models.cpu_kernels` write them where the extension is built (2.5-2.8x
    cheaper than the indexed write below at 256 rows x 5 tokens); else ``rows * heads`` indexed blocks
    replace the per-value index of the ``[rows, positions]`` write (~1.6x cheaper than it). The same
    values land in the same slots either way. A cache stored otherwise takes the per-value write."""

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        self.rows, self.positions = rows, positions
        self.first_slots = positions[:, 0].contiguous()  # [r]: each row's first slot
        self._blocks: torch.Tensor | None = None  # the indexed write's (row, head) blocks and their first slots
        self._starts: torch.Tensor | None = None

    def write(self, cache: torch.Tensor, x: torch.Tensor) -> None:
        """``cache[rows, positions] = x`` for ``x [r, n, H, hd]``."""
        storage = cache.transpose(1, 2)  # [R, H, S, hd]
        if not storage.is_contiguous():
            cache[self.rows[:, None], self.positions] = x.to(cache.dtype)
            return
        kernels = cpu_kernels.extension() if BLOCK_WRITE_KERNEL else None
        if kernels is not None and kernels.write_blocks(storage, x, self.rows, self.first_slots):
            return  # served: float32, indices in range
        r, n, heads, d = x.shape
        slots = storage.shape[2]
        if self._blocks is None or self._blocks.numel() != r * heads:  # once per model call: every layer's K and V
            self._blocks = (self.rows[:, None] * heads + torch.arange(heads, device=x.device)).reshape(-1)
            self._starts = self.first_slots[:, None].expand(-1, heads).reshape(-1)  # each block's first slot
        # Block (row, head, p) = slots p .. p + n - 1 of that row and head: overlapping windows of one view.
        windows = storage.as_strided((storage.shape[0] * heads, slots - n + 1, n * d), (slots * d, d, 1))
        windows[self._blocks, self._starts] = x.transpose(1, 2).reshape(r * heads, n * d).to(cache.dtype)


def gather_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``cache[rows]`` for a ``[R, S, H, hd]`` cache stored head-major (:func:`kv_slots`), by one
    ``index_select`` of whole rows of the storage: the same values in the same head-major layout,
    2-2.5x cheaper than the advanced index at 10-84 of 256 rows (dim 64, 64 slots)."""
    return cache.transpose(1, 2).index_select(0, rows).transpose(1, 2)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """On a CPU, a bool attention mask (True = may attend) as the SDPA dispatcher converts it there, 0 or
    -inf in ``dtype``: built once per call rather than in every layer's kernel call, the kernel receives
    the same values. Elsewhere the bool mask itself (a GPU's attention backends convert it their own
    way: cuDNN's to -65504)."""
    if mask.device.type != "cpu":
        return mask
    return torch.where(mask, 0.0, float("-inf")).to(dtype)


# Slots x span of the largest mask table kept (causal_mask): 80 x 80 for the presets, 256 KB at most in float32.
MASK_TABLE_MAX_ELEMENTS = 1 << 16
MASK_TABLES = True  # False: build every call's mask (for A/B)


@functools.lru_cache(maxsize=64)
def _mask_table(span: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """Row ``p``: :func:`additive_mask` of ``slot <= p`` over the first ``span`` slots, for ``p < slots``."""
    with torch.inference_mode(False):  # a table made inside a loop's inference mode serves every later call
        return additive_mask(torch.arange(slots)[:, None] >= torch.arange(span)[None, :], dtype)


def causal_bool_mask(positions: torch.Tensor, span: int) -> torch.Tensor:
    """``[r, 1, n, span]``: True where a query at ``positions [r, n]`` may attend (slot <= its position)."""
    key_slots = torch.arange(span, device=positions.device)
    return (key_slots[None, None, :] <= positions[:, :, None])[:, None]


def causal_mask(positions: torch.Tensor, span: int, slots: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask ``[r, 1, n, span]`` of queries at ``positions [r, n]`` (each below ``slots``) that see
    every slot up to their own: on a CPU, rows of a table kept per (span, slots), one lookup a call where building
    it takes four operations (7.5 us of a batch-1 draft call's 160); the same values."""
    table = causal_mask_table(positions, span, slots, dtype)
    if table is None:
        return additive_mask(causal_bool_mask(positions, span), dtype)
    return F.embedding(positions, table)[:, None]


def causal_mask_table(positions: torch.Tensor, span: int, slots: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The table :func:`causal_mask` reads its rows from, or None where it builds the mask."""
    if not MASK_TABLES or positions.device.type != "cpu" or span * slots > MASK_TABLE_MAX_ELEMENTS:
        return None
    return _mask_table(span, slots, dtype)


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor) -> torch.Tensor:
    """``softmax(q kᵀ / √d + mask) v`` written out, for the compiled decode step: on a CPU, torch.compile
    fuses it into a few loops (3× faster than the SDPA kernel it would call for 1-token queries);
    eager calls keep the SDPA kernel (the two agree to ~1e-6)."""
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
    scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w3 = nn.Linear(config.dim, config.ffn_hidden, bias=False)
        self.w2 = nn.Linear(config.ffn_hidden, config.dim, bias=False)
        self.ffn_dropout = nn.Dropout(config.ffn_dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, self.w1.weight), F.linear(x, self.w3.weight)
        # Without autograd, in place: the same kernels and values, two [tokens, ffn_hidden] buffers fewer.
        hidden = F.silu(gate) * up if torch.is_grad_enabled() else F.silu(gate, inplace=True).mul_(up)
        out = F.linear(hidden, self.w2.weight)
        return self.ffn_dropout(out) if self.training else out


class TransformerBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x, rope, mask, kv=None, attend=F.scaled_dot_product_attention):  # type: ignore[no-untyped-def]
        # The submodules' forward directly: Module.__call__ costs about a microsecond a call, 5 a layer.
        h = x + self.attention.forward(self.attention_norm.forward(x), rope, mask, kv, attend)
        return h + self.feed_forward.forward(self.ffn_norm.forward(h))


def precompute_rope_2d(config: GPTConfig) -> torch.Tensor:
    """``[cls_token_num + grid^2, head_dim/2, 2]`` (cos, sin): first half of each head rotates by row, second by column."""
    half_dim = config.head_dim // 2
    freqs = 1.0 / (config.rope_base ** (torch.arange(0, half_dim, 2)[: half_dim // 2].float() / half_dim))
    t = torch.arange(config.grid_size, dtype=torch.float32)
    freqs = torch.outer(t, freqs)  # [grid, half_dim/2]
    g = config.grid_size
    freqs_grid = torch.cat(
        [freqs[:, None, :].expand(-1, g, -1), freqs[None, :, :].expand(g, -1, -1)], dim=-1
    )  # [grid(row), grid(col), head_dim/2]
    grid_cache = torch.stack([torch.cos(freqs_grid), torch.sin(freqs_grid)], dim=-1).flatten(0, 1)
    prefix = torch.zeros(config.cls_token_num, config.head_dim // 2, 2)
    if config.prefix_rope == "identity":
        prefix[..., 0] = 1.0
    return torch.cat([prefix, grid_cache], dim=0)


def apply_rotary(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """Rotate adjacent pairs of ``x [R, n, H, hd]`` by ``rope [R, n, hd/2, 2]`` (LlamaGen's convention)."""
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    rope = rope[:, :, None]  # broadcast over heads
    out = torch.stack(
        [
            xs[..., 0] * rope[..., 0] - xs[..., 1] * rope[..., 1],
            xs[..., 1] * rope[..., 0] + xs[..., 0] * rope[..., 1],
        ],
        dim=-1,
    )
    return out.flatten(3).type_as(x)


def rotary_factors(rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` as ``[R, n, 1, hd]`` for :func:`apply_rotary_factors`, from ``rope [R, n, hd/2, 2]``.

    ``cos`` repeats each pair's cosine, ``sin`` is ``(-sin, +sin)`` per pair; computed once per
    forward and shared by every layer's q and k.
    """
    cos, sin = rope[..., 0], rope[..., 1]
    return (torch.stack([cos, cos], dim=-1).flatten(-2)[:, :, None],
            torch.stack([-sin, sin], dim=-1).flatten(-2)[:, :, None])


def apply_rotary_factors(x: torch.Tensor, factors: tuple[torch.Tensor, torch.Tensor],
                         pair_swap: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`apply_rotary` in fewer ops, bit for bit: ``x0 c + x1 (-s) == x0 c - x1 s`` in IEEE arithmetic.

    ``pair_swap`` (optional) is the index ``[1, 0, 3, 2, ...]`` over ``hd`` that swaps each pair:
    on inputs below :data:`PAIR_SWAP_BY_SLICES` elements, gathering by it is the cheaper swap.
    """
    cos, sin = factors
    if x.dtype != torch.float32:
        return apply_rotary_factors(x.float(), factors, pair_swap).type_as(x)
    if pair_swap is None or x.numel() >= PAIR_SWAP_BY_SLICES:
        pairs = x.unflatten(-1, (-1, 2))
        swapped = torch.cat([pairs[..., 1:], pairs[..., :1]], dim=-1).flatten(-2)  # (x1, x0) per pair
    else:
        swapped = x.index_select(-1, pair_swap)
    return x * cos + swapped * sin


def rotary_complex(rope: torch.Tensor) -> torch.Tensor:
    """``rope [R, n, hd/2, 2]`` (float32 or float64, pairs contiguous) as complex ``[R, n, 1, hd/2]``
    for :func:`apply_rotary_complex` (a view: no copy)."""
    return torch.view_as_complex(rope)[:, :, None]


def apply_rotary_complex(x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """:func:`apply_rotary` as one complex product of each pair ``a + ib`` with ``c + is``: ``(ac − bs) +
    i(as + bc)``. On a CPU its kernels round each product and each sum once, as apply_rotary does (no
    fused multiply-add), so the bits are the same (tests/test_discrete_model.py), in one kernel instead
    of four. ``x [R, n, H, hd]`` float32 with its last dimension contiguous."""
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * factor).flatten(-2)


def complex_rotary_applies(table: torch.Tensor) -> bool:
    """Whether a forward rotates q and k by :func:`apply_rotary_complex`: in float32 inference on a CPU,
    outside torch.compile's capture (the compiled step keeps the real form, which it fuses)."""
    return (table.device.type == "cpu" and table.dtype == torch.float32 and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def register_rotary_tables(module: nn.Module, config: Any) -> None:
    """Give ``module`` the tables :func:`rotary_at` reads, as non-persistent buffers (checkpoints hold
    neither): ``rope_table`` (:func:`precompute_rope_2d` of ``config``) and ``rope_factors``, the
    :func:`rotary_factors` of every table row stacked as (cos, sin) ``[L, 2, hd]`` (one index op per
    forward)."""
    module.register_buffer("rope_table", precompute_rope_2d(config), persistent=False)
    cos, sin = rotary_factors(module.rope_table[None])
    module.register_buffer("rope_factors", torch.cat([cos, sin], dim=2)[0], persistent=False)


def rotary_at(positions: torch.Tensor, table: torch.Tensor,
              factors: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The rotary factors of ``positions`` for every layer of a forward (:func:`apply_rope`), read from
    a model's tables: ``table [L, hd/2, 2]`` (:func:`precompute_rope_2d`) and ``factors [L, 2, hd]``
    (its :func:`rotary_factors`, stacked). Complex where :func:`complex_rotary_applies`, else the
    ``(cos, sin)`` pair. Positions past the table (slots whose outputs are discarded: the padding
    of a row's last round) read its last row."""
    index = positions.clamp(0, table.shape[0] - 1)
    if complex_rotary_applies(table):
        return rotary_complex(table[index])
    stacked = factors[index]  # [r, n, 2, hd]
    return stacked[:, :, 0:1], stacked[:, :, 1:2]


def apply_rope(x: torch.Tensor, rope: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
               pair_swap: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate ``x [R, n, H, hd]`` by a forward's rotary factors: a complex tensor
    (:func:`rotary_complex`) or a ``(cos, sin)`` pair (:func:`rotary_factors`); the same bits."""
    if isinstance(rope, torch.Tensor):
        return apply_rotary_complex(x, rope)
    return apply_rotary_factors(x, rope, pair_swap)


def kv_slots(*leading: int, max_len: int, n_head: int, head_dim: int, like: torch.Tensor,
             static: bool = False, zeroed: bool = True) -> torch.Tensor:
    """Zeroed K or V slots ``[*leading, slots, n_head, head_dim]`` (the cache's index order) stored
    head-major, ``[*leading, n_head, slots, head_dim]`` in memory: attention reads each head's keys
    contiguously (the CPU attention kernel runs ~30% faster on them; same values, same results).

    ``slots`` is ``max_len``, on a CPU rounded up to :func:`cpu_attention_slots`: a call whose span
    reaches the cache's end then sums as one that stops short of it, so a row's bits do not depend on
    how far its batch companions are (69 slots against 64 differ in the last bits on AVX2).
    Inside :func:`specray.models.buffer_reuse.reusing`, the previous run's slots, zeroed again (on any device where
    ``static``: a CUDA graph records their address). ``zeroed=False``: not zeroed, for a caller that writes every
    slot itself."""
    if like.device.type == "cpu":
        max_len = cpu_attention_slots(max_len)
    allocate = buffer_reuse.zeros if zeroed else buffer_reuse.empty
    storage = allocate(*leading, n_head, max_len, head_dim, dtype=like.dtype, device=like.device, static=static)
    return storage.transpose(-3, -2)


def _check_slots(what: str, slots: torch.Tensor, max_len: int, last: int | None = None) -> int | None:
    """Refuse slots past the cache; the largest slot (``last`` if the caller read it), or None off the CPU. On
    CPU only: on an accelerator reading the maximum would be a host sync per call, and an out-of-range index
    raises there anyway (a device-side assert)."""
    if last is None:
        if slots.device.type != "cpu":
            return None
        last = int(slots.max())
    if last >= max_len:
        raise ValueError(f"{what} {last} exceeds cache max_len={max_len}")
    return last


@functools.lru_cache(maxsize=4)
def last_level_cache_bytes(caches: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> int | None:
    """The size of the CPU's last-level cache as Linux reports it (the highest level of ``caches``), or None where
    it does not."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    levels = {}
    for index in caches.glob("index*"):
        try:
            level, size = (index / "level").read_text().strip(), (index / "size").read_text().strip()
            levels[int(level)] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
        except (OSError, ValueError):  # a file missing or not a size: that level unknown
            continue
    return levels[max(levels)] if levels else None


def _grown(old: torch.Tensor, slots: int) -> torch.Tensor:
    """The K or V slots ``old`` in a cache of ``slots`` slots (:func:`kv_slots`): the held ones copied, the
    rest zero."""
    rows, held, heads, head_dim = old.shape
    new = kv_slots(rows, max_len=slots, n_head=heads, head_dim=head_dim, like=old, zeroed=False)
    new[:, :held] = old.detach()  # a cache is not part of any graph
    new[:, held:].zero_()  # only the new slots: the held ones are written just above
    return new


@dataclass(frozen=True)
class CfgSoftmax:
    """A call's probabilities instead of its logits: the float32 softmax of ``u + cfg_scale (c - u)``, the rows'
    first half ``c`` guided by their second ``u`` (the CFG streams' rows), or of every row without ``cfg_scale``.
    The operations of the default sampler (:func:`specray.methods.discrete.processing.process_logits`: no
    temperature, top-k or top-p), so the same values; an eager CPU call makes them in its C++ call
    (:meth:`FusedLayers.step`), six dispatches fewer among the model's own."""

    cfg_scale: float | None = None

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.cfg_scale is not None:
            r = logits.shape[0] // 2
            cond, uncond = logits[:r], logits[r:]
            logits = uncond + self.cfg_scale * (cond - uncond)
        return torch.softmax(logits, dim=-1, dtype=torch.float32)


def _softmax_arguments(softmax: CfgSoftmax | None) -> tuple[bool, float | None]:
    """The C++ steps' ``(softmax, cfg_scale)``: a :class:`CfgSoftmax` made in the call (:data:`FUSED_SOFTMAX`), else
    the logits (:func:`_softmax_after_call` then names what to make of them)."""
    return (True, softmax.cfg_scale) if softmax is not None and FUSED_SOFTMAX else (False, None)


def _softmax_after_call(softmax: CfgSoftmax | None) -> CfgSoftmax | None:
    """The :class:`CfgSoftmax` left for Python after a C++ step asked for ``softmax`` (:func:`_softmax_arguments`)."""
    return None if FUSED_SOFTMAX else softmax


def maybe_softmax(softmax: CfgSoftmax | None, logits: torch.Tensor) -> torch.Tensor:
    """``logits``, or their :class:`CfgSoftmax` where the call asked for it."""
    return logits if softmax is None else softmax(logits)


@dataclass
class KVCache:
    """Per-layer K/V slots ``[rows, max_len, H, hd]`` and each row's valid length.

    Static (every slot held from the start), or growing (``slots`` set): the tensors hold the first
    slots the calls have needed so far, grown by :meth:`reserve` before each call.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    lengths: torch.Tensor  # int64 [rows]: sequence positions 0..length-1 hold committed K/V
    # Caption models: which prefix slots hold caption tokens ([rows, cls_token_num] bool); the
    # others are hidden from every query but their own.
    prefix_valid: torch.Tensor | None = None
    slots: int | None = None  # a growing cache's full length (max_len); None: static

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def max_len(self) -> int:
        return self.slots if self.slots is not None else int(self.keys[0].shape[1])

    def reserve(self, written: torch.Tensor, reads: int = 0, what: str = "position",
                last: int | None = None) -> int | None:
        """Before a call that writes slots ``written`` (refused past :attr:`max_len`, ``what`` names them) and attends
        over the first ``reads`` slots: grow a growing cache to both, rounded up as
        :func:`cpu_attention_slots` rounds, which covers the span a :meth:`DiscreteGPT.forward_step` call
        attends over (:func:`attention_span`); the call then reads every held slot of its rows.

        The held slots are copied and the new ones are zero, as a static cache's are before a write: the
        call gives the same bits either way (the attention kernel sums in one order over such spans).
        Returns the largest slot written (``last`` where the caller read it, :class:`HostPositions`), for the
        call's :func:`attention_span`; None for a static cache, which it leaves alone and does not check.
        """
        if self.slots is None:
            return None
        last = _check_slots(what, written, self.slots, last)
        # A forward_step call's span, cpu_attention_slots(min(last + 1, fed)), is at most this; without spans, all.
        want = min(self.slots, cpu_attention_slots(max(last + 1, reads))) if ATTENTION_SPANS else self.slots
        if want > self.keys[0].shape[1]:
            for tensors in (self.keys, self.values):
                tensors[:] = [_grown(old, want) for old in tensors]
        return last

    def crop(self, lengths: torch.Tensor, rows: torch.Tensor | None = None) -> None:
        """Declare only the first ``lengths`` slots of ``rows`` valid (later slots become stale)."""
        if rows is None:
            self.lengths.copy_(lengths)
        else:
            self.lengths[rows] = lengths.to(self.lengths.dtype)


class FusedLayers:
    """A model's layers in one call of the C++ extension (``cached_layers``, ``csrc/cached_layers.cpp``): the ATen
    operations :class:`TransformerBlock` runs in eager float32 CPU inference, in the same order on the same
    arguments, so the same values; at batch 1 a digits target call spent about half of its time in Python's
    share of those operations' dispatch. Called as the loop over the layers, with what that loop would choose per
    call (the rotary factor, the mask, :func:`cache_write_index`'s write, the rows read, the attention kernel)."""

    def __init__(self, layers: list[nn.Module]) -> None:
        first = layers[0]
        self.n_head, self.eps = first.attention.n_head, first.ffn_norm.eps
        self.width = first.ffn_norm.weight.shape[0]
        # The parameters themselves: in-place loads and device moves keep them (their data is read at each call).
        # An EAGLE head's layer may have no input norm (None).
        self.weights = [w for layer in layers for w in (
            None if layer.attention_norm is None else layer.attention_norm.weight,
            layer.attention.wqkv.weight, layer.attention.wo.weight,
            layer.ffn_norm.weight, layer.feed_forward.w1.weight, layer.feed_forward.w3.weight,
            layer.feed_forward.w2.weight)]
        # A GPT's parameters around its layers (step, tree_step), bound at its first call: a lookup through
        # nn.Module's attribute access each, several microseconds a call among the model's own operations.
        self._around: tuple[torch.Tensor, torch.Tensor, float, torch.Tensor] | None = None

    def __call__(self, h: torch.Tensor, rope: torch.Tensor, mask: torch.Tensor, keys: list[torch.Tensor],
                 values: list[torch.Tensor], read_rows: torch.Tensor | None, write_rows: Any, write_slots: Any,
                 attention_kernel: bool = False) -> torch.Tensor:
        return cpu_kernels.extension().cached_layers(
            h, rope, mask, keys, values, self.weights, self.n_head, self.eps, cpu_norm.kernel(self.width) is not None,
            attention_kernel, *self._write(write_rows, write_slots), read_rows)

    def step(self, model: "DiscreteGPT", inputs: torch.Tensor, embedded: bool, positions: torch.Tensor,
             mask: torch.Tensor, mask_is_table: bool, keys: list[torch.Tensor], values: list[torch.Tensor],
             rows: torch.Tensor | None, write_rows: Any, write_slots: Any, lengths: torch.Tensor,
             attention_kernel: bool, softmax: CfgSoftmax | None = None) -> torch.Tensor:
        """:meth:`DiscreteGPT._cached_layers` in one call (``cached_step``): the layers as :meth:`__call__` runs
        them, and around them the embedding of the image tokens ``inputs`` (unless ``embedded``), the rotary factors
        and the mask (``mask_is_table``: :func:`causal_mask_table`'s table) read at the ``positions``, the cache
        ``lengths`` of the ``rows`` set, the final norm and the output layer; the logits, or their ``softmax``."""
        embedding, norm, eps, output = self._around_layers(model)
        out = cpu_kernels.extension().cached_step(
            inputs, None if embedded else embedding, positions, model.rope_table, mask, mask_is_table, keys, values,
            self.weights, self.n_head, self.eps, cpu_norm.kernel(self.width) is not None, attention_kernel,
            *self._write(write_rows, write_slots), rows, lengths, norm, eps, output, *_softmax_arguments(softmax))
        return maybe_softmax(_softmax_after_call(softmax), out)

    def tree_step(self, model: "DiscreteGPT", inputs: torch.Tensor, embedded: bool, positions: torch.Tensor,
                  visible: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  rows: torch.Tensor | None, write_rows: torch.Tensor, slots: torch.Tensor,
                  softmax: CfgSoftmax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`DiscreteGPT.forward_tree_logits` in one call (``tree_step``): the embedding (unless ``embedded``),
        the rotary factors, the additive mask of ``visible``, the layers, the final norm and the output layer (and
        the ``softmax`` of its logits)."""
        embedding, norm, eps, output = self._around_layers(model)
        hidden, out = cpu_kernels.extension().tree_step(
            inputs, None if embedded else embedding, positions, model.rope_table, visible, keys, values, self.weights,
            self.n_head, self.eps, cpu_norm.kernel(self.width) is not None, write_rows, slots, rows, norm, eps, output,
            *_softmax_arguments(softmax))
        return hidden, maybe_softmax(_softmax_after_call(softmax), out)

    def _around_layers(self, model: "DiscreteGPT") -> tuple[torch.Tensor, torch.Tensor, float, torch.Tensor]:
        """The GPT's token embedding, final norm weight and eps, and output weight (the parameters themselves, as
        :attr:`weights` keeps them; a model keeps one FusedLayers, :func:`fused_layers_of`)."""
        if self._around is None:
            self._around = (model.tok_embeddings.weight, model.norm.weight, model.norm.eps, model.output.weight)
        return self._around

    def head_step(self, head: nn.Module, features: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
                  visible: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                  rows: torch.Tensor | None, write_rows: torch.Tensor, slots: torch.Tensor,
                  output: torch.Tensor, softmax: CfgSoftmax | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An EAGLE head's :meth:`~specray.models.eagle_head.EagleHead.forward_cached_logits` in one call
        (``head_step``): its input layer on the embedded ``tokens`` and the ``features``, the rotary factors, its
        layer under the bool mask ``visible`` and the logits by ``output`` (the target's output layer; and their
        ``softmax``)."""
        predicted, out = cpu_kernels.extension().head_step(
            tokens, features, head.embed_tokens.weight, head.fc.weight, head.fc.bias, positions, head.rope_table,
            visible, keys, values, self.weights, self.n_head, self.eps, cpu_norm.kernel(self.width) is not None,
            write_rows, slots, rows, output, *_softmax_arguments(softmax))
        return predicted, maybe_softmax(_softmax_after_call(softmax), out)

    @staticmethod
    def _write(write_rows: Any, write_slots: Any) -> tuple[int, int, torch.Tensor | None, torch.Tensor | None]:
        """``(kind, start, rows, slots)`` of the C++ K/V write for :func:`cache_write_index`'s choice."""
        if isinstance(write_slots, slice):  # every row at the same slots
            return 0, write_slots.start, None, None
        if isinstance(write_rows, BlockWrite) and BLOCK_WRITE_KERNEL:  # the C++ row copies
            return 1, 0, write_rows.rows, write_rows.first_slots
        if isinstance(write_rows, BlockWrite):  # with the row copies switched off, torch's indexed write
            return 2, 0, write_rows.rows[:, None], write_rows.positions
        return 2, 0, write_rows, write_slots


def fused_layers(model: nn.Module, h: torch.Tensor, rope: Any, keys: list[torch.Tensor]) -> FusedLayers | None:
    """The :class:`FusedLayers` of ``model.layers`` where they serve this call (:data:`FUSED_LAYERS`, the extension
    built, eager float32 inference on a CPU with the complex rotary factor, :func:`complex_rotary_applies`), else
    None: the Python layers run, with the same values. ``h``: the layers' input (its dtype and device count)."""
    return fused_layers_of(model, h, keys) if isinstance(rope, torch.Tensor) else None


def fused_layers_of(model: nn.Module, x: torch.Tensor, keys: list[torch.Tensor]) -> FusedLayers | None:
    """:func:`fused_layers` for a call whose rotary factor is complex (the caller checked), with ``x`` of the
    layers' input dtype and device."""
    if (not FUSED_LAYERS or x.dtype != torch.float32 or x.device.type != "cpu" or keys[0].dtype != torch.float32
            or model.training or torch.is_grad_enabled()):
        return None
    fused = _FUSED.get(model)
    if fused is None:
        if cpu_kernels.extension() is None:
            return None
        fused = _FUSED[model] = FusedLayers(list(model.layers))
    return fused


# Each model's FusedLayers, kept beside it (not on it: a model stays as picklable and copyable as before).
_FUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class DiscreteGPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        if config.condition == "text":  # position 0 reads the batch's prompt features (null = num_classes)
            self.cls_embedding = TextConditionEmbedding(config.text_dim, config.dim, config.num_classes)
        elif config.condition == "caption":  # position 0 stands for cls_token_num caption slots
            self.cls_embedding = CaptionEmbedder(config.caption_dim, config.dim, config.cls_token_num,
                                                 config.num_classes, config.caption_padding)
        else:
            self.cls_embedding = LabelEmbedding(config.num_classes, config.dim, config.class_dropout_prob)
        self.tok_dropout = nn.Dropout(config.token_dropout_p)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        register_rotary_tables(self, config)
        self.apply(self._init_weights)
        # torch.compile of decode_all_rows, set by specray.models.compiled.compile_gpt (None: eager).
        self.compiled_decode: Any = None

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def null_class(self) -> int:
        return self.config.num_classes

    @property
    def caption_conditioned(self) -> bool:
        return self.config.condition == "caption"

    def null_prefix(self, tokens: torch.Tensor) -> torch.Tensor:
        """What the CFG unconditional stream is fed at position 0 in place of ``tokens``: the null
        class; for a caption model the null caption under the row's own caption mask (id + offset)."""
        if self.caption_conditioned:
            return tokens + self.null_class
        return torch.full_like(tokens, self.null_class)

    @property
    def max_seq_len(self) -> int:
        """Sequence positions that are ever fed: the prefix plus image tokens 0..N-2."""
        return self.config.cls_token_num + self.config.num_image_tokens - 1

    # ---- embedding ---------------------------------------------------------------------

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Position 0 holds a class label (null = num_classes), later positions image tokens."""
        is_prefix = positions < self.config.cls_token_num
        cls = self.cls_embedding(torch.where(is_prefix, tokens, 0).clamp(0, self.config.num_classes))
        tok = self.tok_embeddings(torch.where(is_prefix, 0, tokens).clamp(0, self.config.vocab_size - 1))
        return torch.where(is_prefix[..., None], cls, tok)

    def _rotary(self, positions: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rotary_at(positions, self.rope_table, self.rope_factors)

    # ---- training / full-sequence forward ----------------------------------------------

    def forward(
        self, labels: torch.Tensor, image_tokens: torch.Tensor, drop_class: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Teacher-forced logits ``[B, N, V]`` float32: row ``i`` predicts image token ``i``.

        ``labels [B]``; ``image_tokens [B, N]`` (only tokens ``0..N-2`` are fed);
        ``drop_class [B]`` bool replaces the class with the null class (CFG training).
        """
        return self.output(self.features(labels, image_tokens, drop_class)).float()

    def features(
        self, labels: torch.Tensor, image_tokens: torch.Tensor, drop_class: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The last hidden state after the final norm, ``[B, N, D]``, of :meth:`forward` (what an
        EAGLE draft head reads, and what the output layer maps to logits)."""
        if self.caption_conditioned:
            raise ValueError("teacher-forced forward takes class labels; a caption model runs through forward_step")
        b, n = image_tokens.shape
        cls = self.cls_embedding(labels, drop_class)[:, None]
        tok = self.tok_embeddings(image_tokens[:, : n - 1])
        h = self.tok_dropout(torch.cat([cls, tok], dim=1))
        positions = torch.arange(n, device=h.device).expand(b, n)
        rope = self._rotary(positions)
        mask = torch.ones(n, n, dtype=torch.bool, device=h.device).tril()[None, None]
        for layer in self.layers:
            h = layer(h, rope, mask)
        return self.norm(h)

    # ---- cached incremental forward ----------------------------------------------------

    def new_cache(self, batch_rows: int, max_len: int | None = None, few_reads: bool = False) -> KVCache:
        """Empty cache for ``batch_rows`` rows (both CFG halves count as rows). ``few_reads``: its calls read it few
        times a batch, so on a CPU it grows only where it would not fit in the last-level cache
        (:data:`FEW_READS_WHOLE_IN_LAST_LEVEL_CACHE`)."""
        max_len = self.max_seq_len if max_len is None else max_len
        p = self.output.weight
        # A compiled step's caches are static inputs of its CUDA graphs: the same buffers, at the same addresses,
        # batch after batch (buffer_reuse), or each batch records the graphs again.
        static = self.compiled_decode is not None
        shape = {"max_len": max_len, "n_head": self.config.n_head, "head_dim": self.config.head_dim, "like": p,
                 "static": static}
        prefix_valid = None
        if self.caption_conditioned:
            prefix_valid = torch.ones(batch_rows, self.config.cls_token_num, dtype=torch.bool, device=p.device)
        slots = None
        per_slot = 2 * len(self.layers) * self.config.n_head * self.config.head_dim * p.element_size()  # K and V
        full_bytes = batch_rows * cpu_attention_slots(max_len) * per_slot
        whole_up_to = GROWING_CACHE_MIN_BYTES
        if few_reads and FEW_READS_WHOLE_IN_LAST_LEVEL_CACHE:
            whole_up_to = max(whole_up_to, last_level_cache_bytes() or 0)
        if (GROWING_CACHES and p.device.type == "cpu" and self.compiled_decode is None and not self.caption_conditioned
                and full_bytes > whole_up_to):
            # A growing cache (KVCache.reserve): the first span's slots now, the rest as calls need them (a large one:
            # GROWING_CACHE_MIN_BYTES).
            slots, shape["max_len"] = cpu_attention_slots(max_len), ATTENTION_SPAN_QUANTUM
        if static or torch.is_grad_enabled():
            # A buffer each: a graph's inputs, none a view of another's; and where autograd records the calls' writes
            # (outside the loops' inference mode), which it refuses into views of one buffer.
            keys = [kv_slots(batch_rows, **shape) for _ in self.layers]
            values = [kv_slots(batch_rows, **shape) for _ in self.layers]
        else:  # every layer's K and V views of one buffer: one allocation, where a buffer each cost 6-10 us apiece
            layers = len(self.layers)
            blocks = kv_slots(2 * layers, batch_rows, **shape)
            keys, values = [blocks[i] for i in range(layers)], [blocks[layers + i] for i in range(layers)]
        cache = KVCache(
            keys=keys,
            values=values,
            lengths=buffer_reuse.zeros(batch_rows, dtype=torch.int64, device=p.device, static=static),
            prefix_valid=prefix_valid,
            slots=slots,
        )
        if self.compiled_decode is not None and p.device.type == "cuda":
            # CUDA graphs write these inputs in place: their addresses are part of the recording.
            for tensor in (*cache.keys, *cache.values, cache.lengths):
                torch._dynamo.mark_static_address(tensor, guard=False)
        return cache

    def forward_step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        cache: KVCache,
        rows: torch.Tensor | None = None,
        prefix: bool | None = None,
        softmax: CfgSoftmax | None = None,
    ) -> torch.Tensor:
        """Logits ``[r, n, V]`` float32 for ``tokens [r, n]`` at sequence ``positions [r, n]`` (their ``softmax``
        where given, :class:`CfgSoftmax`).

        Writes their K/V into cache rows ``rows`` (default: all cache rows in order, read
        without a gather copy; the first ``r`` rows when ``r < cache.rows``) at slots ``positions`` and sets those rows' length to
        ``last position + 1``. A token at position 0 is a class label.
        Positions of a row must be consecutive and start at or before its cache length. A position
        at or past :attr:`max_seq_len` (a padded verify's tail, a parked row) is padding: its logits are
        not the model's (on a CPU it sees the first ``max_seq_len`` slots only, :func:`attention_span`).
        ``prefix=False`` promises that no position is 0 (skips the class-embedding path; same result).
        A caption model's position 0 (a caption id, see :mod:`specray.models.captions`) fills its
        ``cls_token_num`` prefix slots; every row of such a call must start at position 0.
        """
        if rows is None and tokens.shape[0] != cache.rows:
            rows = torch.arange(tokens.shape[0], device=tokens.device)  # the first r rows
        if positions.shape != tokens.shape:
            raise ValueError(f"positions shape {tuple(positions.shape)} != tokens shape {tuple(tokens.shape)}")
        if self.caption_conditioned:
            return maybe_softmax(softmax, self._caption_step(tokens, positions, cache, rows, prefix))
        if rows is None and prefix is False and self.compiled_decode is not None:
            cache.reserve(positions)  # a compiled step's cache is static: nothing to grow or check
            # The loops only feed positions inside the cache; the compiled step skips the check's host sync.
            if COMPILED_SOFTMAX:
                return self.compiled_decode(tokens, positions, cache.keys, cache.values, cache.lengths,
                                            softmax=softmax)
            logits = self.compiled_decode(tokens, positions, cache.keys, cache.values, cache.lengths)
            return maybe_softmax(softmax, logits)
        host = host_positions(positions)
        checked = cache.reserve(positions, last=None if host is None else host.last)  # None: a static cache's
        if checked is None and host is not None:  # a static CPU cache: checked here, with the host copy
            checked = _check_slots("position", positions, cache.max_len, host.last)
        if rows is None and prefix is False:  # the layers check the positions (attention_span)
            return self.decode_all_rows(tokens, positions, cache.keys, cache.values, cache.lengths, checked, host,
                                        softmax)
        if prefix is not False:
            return self._cached_layers(self._embed(tokens, positions), positions, cache.keys, cache.values,
                                       cache.lengths, rows, checked=checked, host=host, softmax=softmax)
        return self._cached_layers(tokens, positions, cache.keys, cache.values, cache.lengths, rows, checked=checked,
                                   embedded=False, host=host, softmax=softmax)

    def decode_all_rows(self, tokens: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                        values: list[torch.Tensor], lengths: torch.Tensor, checked: int | None = None,
                        host: HostPositions | None = None, softmax: CfgSoftmax | None = None) -> torch.Tensor:
        """:meth:`forward_step` on every cache row, image tokens only (no position 0): the decode step
        of the loops, written so that ``torch.compile(fullgraph=True)`` captures it whole
        (:mod:`specray.models.compiled`): fixed shapes, K/V written at the rows' positions in the
        static cache, no host sync. ``checked``: the largest position, checked (:meth:`KVCache.reserve`);
        ``host``: the positions' host copy, if read; ``softmax``: as :meth:`forward_step`'s."""
        return self._cached_layers(tokens, positions, keys, values, lengths, None,
                                   compiled=torch.compiler.is_compiling(), checked=checked, embedded=False, host=host,
                                   softmax=softmax)

    def _embed_image(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens.clamp(0, self.config.vocab_size - 1), self.tok_embeddings.weight)

    def _cached_layers(self, inputs: torch.Tensor, positions: torch.Tensor, keys: list[torch.Tensor],
                       values: list[torch.Tensor], lengths: torch.Tensor, rows: torch.Tensor | None,
                       compiled: bool = False, checked: int | None = None, embedded: bool = True,
                       host: HostPositions | None = None, softmax: CfgSoftmax | None = None) -> torch.Tensor:
        """The layers over the cache from the embedded inputs ``h [r, n, D]`` (``embedded=False``: from the image
        tokens ``[r, n]``); logits ``[r, n, V]`` float32, or their ``softmax``. ``checked``: the largest position if
        the caller checked it (:func:`attention_span`); ``host``: the positions' host copy, if read
        (:func:`cache_write_index`)."""
        # Refuses positions past the cache; a query past max_seq_len is padding (attention_span).
        span = attention_span(positions, keys[0].shape[1], "position", fed=self.max_seq_len, checked=checked)
        like = inputs if embedded else self.tok_embeddings.weight  # the layers' input dtype and device
        write_rows, write_slots = cache_write_index(positions, rows, head_major=True, host=host)
        fused = None if compiled or not complex_rotary_applies(self.rope_table) else fused_layers_of(self, like, keys)
        if fused is not None and FUSED_STEP:  # the whole forward in one C++ call, the same values
            attend = decode_attention.attention_for(like, self.config.head_dim, positions.shape[1], span)
            table = causal_mask_table(positions, span, keys[0].shape[1], like.dtype)
            mask = causal_mask(positions, span, keys[0].shape[1], like.dtype) if table is None else table
            kernel = attend is not F.scaled_dot_product_attention
            return fused.step(self, inputs, embedded, positions, mask, table is not None, keys, values, rows,
                              write_rows, write_slots, lengths, attention_kernel=kernel, softmax=softmax)
        h = inputs if embedded else self._embed_image(inputs)
        rope = self._rotary(positions)
        if compiled:
            mask = causal_bool_mask(positions, span)
            attend = explicit_attention
        else:
            mask = causal_mask(positions, span, keys[0].shape[1], h.dtype)
            attend = decode_attention.attention_for(h, self.config.head_dim, h.shape[1], span)
        if fused is not None:
            h = fused(h, rope, mask, keys, values, rows, write_rows, write_slots,
                      attention_kernel=attend is not F.scaled_dot_product_attention)
        else:
            for i, layer in enumerate(self.layers):
                h = layer.forward(h, rope, mask, (keys[i], values[i], rows, write_rows, write_slots), attend)
        if rows is None:
            lengths.copy_(positions[:, -1] + 1)
        else:
            lengths[rows] = positions[:, -1] + 1
        logits = F.linear(self.norm.forward(h), self.output.weight)
        return maybe_softmax(softmax, logits if logits.dtype == torch.float32 else logits.float())

    def _caption_step(self, tokens: torch.Tensor, positions: torch.Tensor, cache: KVCache,
                      rows: torch.Tensor | None, prefix: bool | None) -> torch.Tensor:
        """:meth:`forward_step` of a caption model: positions map to slots ``p + cls_token_num - 1``,
        position 0 to the whole caption prefix; caption padding is masked as keys."""
        prefix_len = self.config.cls_token_num
        write_rows = (torch.arange(tokens.shape[0], device=tokens.device) if rows is None else rows)
        starts = positions[:, 0] == 0
        with_prefix = prefix is not False and bool(starts.any())
        if with_prefix and not bool(starts.all()):
            raise ValueError("a caption model's call must start every row at position 0 or none")
        tok = self._embed_image(tokens)
        slots = positions + (prefix_len - 1)
        if with_prefix:
            caption, caption_mask = self.cls_embedding(tokens[:, 0])
            cache.prefix_valid[write_rows] = caption_mask
            h = torch.cat([caption.to(tok.dtype), tok[:, 1:]], dim=1)
            prefix_slots = torch.arange(prefix_len, device=tokens.device).expand(tokens.shape[0], -1)
            slots = torch.cat([prefix_slots, slots[:, 1:]], dim=1)
        else:
            h = tok
        span = attention_span(slots, cache.max_len, fed=self.max_seq_len)  # refuses slots past the cache
        rope = self._rotary(slots)
        key_slots = torch.arange(span, device=tokens.device)
        valid = cache.prefix_valid if rows is None else cache.prefix_valid[rows]
        visible = torch.cat([valid, valid.new_ones(valid.shape[0], span - prefix_len)], dim=1)  # span >= prefix_len
        causal = key_slots[None, None, :] <= slots[:, :, None]
        own_slot = key_slots[None, None, :] == slots[:, :, None]
        mask = additive_mask((causal & (visible[:, None, :] | own_slot))[:, None], h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, (cache.keys[i], cache.values[i], rows, write_rows[:, None], slots))
        if with_prefix:  # the prefix's last slot predicts image token 0
            h = h[:, prefix_len - 1:]
        if rows is None:
            cache.lengths.copy_(positions[:, -1] + 1)
        else:
            cache.lengths[rows] = positions[:, -1] + 1
        return self.output(self.norm(h)).float()

    def prefill(self, labels: torch.Tensor, cache: KVCache, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Write the class prefix and return the logits ``[r, V]`` of image token 0."""
        tokens = labels.to(torch.int64)[:, None]
        return self.forward_step(tokens, torch.zeros_like(tokens), cache, rows)[:, 0]

    # ---- masked forward over explicit cache slots (static-tree verification, EAGLE heads) ----

    def forward_tree(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor,
        cache: KVCache,
        rows: torch.Tensor | None = None,
        prefix: bool = False,
    ) -> torch.Tensor:
        """Post-norm hidden states ``[r, n, D]`` of ``tokens [r, n]`` at sequence ``positions [r, n]``.

        Unlike :meth:`forward_step`, where a token's cache slot is its position and it sees every
        earlier slot, here K/V go to cache ``slots [r, n]`` and ``visible [r, n, S]`` (bool) says which
        slots each token attends to: the nodes of a draft tree share positions (one per depth) but not
        slots, and each sees only the committed prefix and its own ancestors. ``rows`` as in
        :meth:`forward_step`; cache lengths are left alone (the caller knows which slots are
        committed). ``prefix=True`` allows class labels at position 0. Logits: ``self.output(...)``.
        ``visible`` may cover only the cache's first ``S <= max_len`` slots (attention then reads only
        those; :func:`attention_span` of the call's slots gives the whole cache's bits on a CPU).
        """
        rows, write_rows = self._tree_rows(tokens, slots, visible, cache, rows)
        if prefix:
            h = self._embed(tokens, positions)
        else:
            h = self._embed_image(tokens)
        rope = self._rotary(positions)
        mask = additive_mask(visible[:, None], h.dtype)
        fused = fused_layers(self, h, rope, cache.keys)
        if fused is not None:
            return self.norm(fused(h, rope, mask, cache.keys, cache.values, rows, write_rows, slots))
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, mask, (cache.keys[i], cache.values[i], rows, write_rows, slots))
        return self.norm(h)

    def forward_tree_logits(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        visible: torch.Tensor,
        cache: KVCache,
        rows: torch.Tensor | None = None,
        prefix: bool = False,
        softmax: CfgSoftmax | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward_tree`'s hidden states and their logits ``[r, n, V]`` float32 (``self.output``; their
        ``softmax`` where given): in one C++ call where the fused layers serve it (:data:`FUSED_STEP`), the same
        values."""
        fused = (fused_layers_of(self, self.tok_embeddings.weight, cache.keys)
                 if FUSED_STEP and complex_rotary_applies(self.rope_table) else None)
        if fused is None:
            hidden = self.forward_tree(tokens, positions, slots, visible, cache, rows, prefix)
            return hidden, maybe_softmax(softmax, self.output(hidden).float())
        rows, write_rows = self._tree_rows(tokens, slots, visible, cache, rows)
        return fused.tree_step(self, self._embed(tokens, positions) if prefix else tokens, prefix, positions, visible,
                               cache.keys, cache.values, rows, write_rows, slots, softmax)

    def _tree_rows(self, tokens: torch.Tensor, slots: torch.Tensor, visible: torch.Tensor, cache: KVCache,
                   rows: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A tree call's :func:`call_rows`, its slots checked and the cache grown to them."""
        if cache.reserve(slots, visible.shape[-1], "slot") is None:  # a static cache: reserve checked nothing
            _check_slots("slot", slots, cache.max_len)
        return call_rows(tokens, cache, rows)


# ---- loading ------------------------------------------------------------------------------


def load_model(name_or_path: str | Path | dict, device: torch.device | str = "cpu") -> nn.Module:
    """A preset by name, a ``.safetensors`` file whose metadata holds ``config`` (JSON), or a
    ``{format: ...}`` reference loaded by the family table's loader for that format.

    A config with ``kind: eagle_head`` is an EAGLE draft head (``specray.models.eagle_head``)."""
    import json

    if isinstance(name_or_path, dict):
        return load_generator(name_or_path, device)[0]

    from safetensors import safe_open
    from safetensors.torch import load_file

    path = Path(name_or_path)
    if path.suffix == ".safetensors" and path.exists():
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        if "config" not in meta:
            raise ValueError(f"{path}: safetensors metadata lacks 'config'")
        raw = json.loads(meta["config"])
    else:
        from specray.models.presets import get_preset

        preset = get_preset(str(name_or_path))
        if preset.family != "discrete_ar":
            raise ValueError(f"preset {preset.name!r} is family {preset.family!r}, expected 'discrete_ar'")
        raw = preset.config
        path = preset.weights_path
        if not path.exists():
            raise FileNotFoundError(f"weights of preset {preset.name!r} missing at {path}; run `specray train {preset.name}`")
    if raw.get("kind") == "eagle_head":
        from specray.models.eagle_head import load_head

        return load_head(raw, path, device)
    model = DiscreteGPT(GPTConfig.from_dict(raw))
    state = {k: v.float() for k, v in load_file(str(path)).items()}
    model.load_state_dict(state)
    return model.to(device).eval()


def load_generator(ref: str | Path | dict, device: torch.device | str) -> tuple[DiscreteGPT, Any, dict[str, Any]]:
    """The GPT, the image decoder of its tokens (None: the tokens are the presets' grey levels) and
    what the loader reports, for a preset, a ``.safetensors`` path or a ``{format: ...}`` reference."""
    if isinstance(ref, dict):
        from specray.families import load_formatted_model

        loaded = load_formatted_model("discrete_ar", ref, device)
        if isinstance(loaded, nn.Module):  # a format whose loader returns the model alone (a GPT, a head)
            return loaded, None, {}
        return loaded.gpt, loaded.decoder, loaded.info  # a release: the GPT and its tokenizer
    return load_model(ref, device), None, {}


def load_pair(target: str | dict, draft: str | dict | None, device: torch.device | str) -> ModelPair:
    """Target and draft GPTs on ``device`` plus the info the discrete loop needs.

    A release's tokenizer (the target's) decodes the images: ``info["image_decoder"]``, and its
    L2-normalised VQ codebook is ``info["codebook"]`` (token latents, e.g. for LANTERN neighbourhoods).
    """
    from specray.models.refs import ref_key

    device = torch.device(device)
    target_model, decoder, target_info = load_generator(target, device)
    if not isinstance(target_model, DiscreteGPT):
        raise ValueError(f"target {target!r} is a {type(target_model).__name__}, not a GPT; an EAGLE head can only be a draft")
    draft_model = load_generator(draft, device)[0] if draft is not None else None
    tc = target_model.config
    draft_kind = None if draft_model is None else "gpt"
    if draft_model is not None and not isinstance(draft_model, DiscreteGPT):
        from specray.models.eagle_head import check_head_for_target

        check_head_for_target(draft_model, target_model, draft)
        draft_kind = "eagle_head"
    elif draft_model is not None:
        dc = draft_model.config
        shared = ("vocab_size", "num_classes", "grid_size", "condition")
        for field in shared + (("caption_dim",) if tc.condition == "caption" else ()):
            if getattr(dc, field) != getattr(tc, field):
                raise ValueError(
                    f"draft {draft!r} {field}={getattr(dc, field)} differs from target {target!r} {field}={getattr(tc, field)}"
                )
    if device.type == "cpu":  # the kernels' one-off build and checks here, not inside a timed batch
        cpu_kernels.extension()
        if tc.head_dim == decode_attention.HEAD_DIM:
            decode_attention.prepare()
        for model in (target_model, draft_model):
            if model is not None:
                cpu_norm.kernel(model.config.dim)
    info = {
        "image_shape": (tc.grid_size, tc.grid_size),
        "vocab_size": tc.vocab_size,
        "num_classes": tc.num_classes,
        "num_tokens": tc.num_image_tokens,
        "token_embeddings": target_model.tok_embeddings.weight.detach(),
        "target_config": asdict(tc),
        "draft_config": asdict(draft_model.config) if draft_model is not None else None,
        "draft_kind": draft_kind,
        "tokenizer": "identity_digits" if decoder is None else "vq",
        "image_decoder": decoder,
        "codebook": decoder.codebook() if decoder is not None else None,
        "target_loader": target_info,
    }
    return ModelPair(
        family="discrete_ar",
        target_name=ref_key(target),
        draft_name=ref_key(draft),
        target=target_model,
        draft=draft_model,
        device=device,
        info=info,
    )
