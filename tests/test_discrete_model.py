"""The discrete GPT, its ragged KV cache, the logits processing, the digits data and training."""

from __future__ import annotations

import json

import pytest
import torch

from specray.methods.discrete.loop import GuidedModel, sequence_tokens
from specray.methods.discrete.processing import (
    SamplingParams,
    model_softmax,
    process_logits,
    process_with,
    top_k_mask,
    top_p_mask,
)
from specray.models import cpu_kernels, discrete_ar
from specray.models.digits import load_digits_split, to_uint8_pixels
from specray.models.discrete_ar import (
    BLOCK_WRITE_MIN_TOKENS,
    PAIR_SWAP_BY_SLICES,
    BlockWrite,
    CfgSoftmax,
    DiscreteGPT,
    GPTConfig,
    apply_rope,
    apply_rotary,
    apply_rotary_complex,
    apply_rotary_factors,
    cache_write_index,
    flops_per_token,
    gather_rows,
    kv_slots,
    load_model,
    load_pair,
    rotary_complex,
    rotary_factors,
)
from specray.models.discrete_train import TrainConfig, heldout_nll, save_model, train_model
from specray.models.presets import get_preset
from specray.models.tokenizers import to_images

torch.set_num_threads(1)
TOL = 1e-5


def tiny_model(seed: int = 0, prefix_rope: str = "zeros") -> DiscreteGPT:
    torch.manual_seed(seed)
    model = DiscreteGPT(GPTConfig(dim=32, n_layer=2, n_head=2, prefix_rope=prefix_rope)).eval()
    # Larger weights than the init so differences would show in the logits.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def random_tokens(batch: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 10, (batch,), generator=g), torch.randint(0, 17, (batch, 64), generator=g)


# ---- data ----------------------------------------------------------------------------------------


def test_digits_split_is_fixed_disjoint_and_complete():
    train_x, train_y = load_digits_split("train")
    held_x, held_y = load_digits_split("heldout")
    assert train_x.shape == (1617, 8, 8) and held_x.shape == (180, 8, 8)
    assert train_x.dtype == torch.uint8 and int(train_x.max()) == 16 and train_y.dtype == torch.int64
    again_x, again_y = load_digits_split("train")
    assert torch.equal(train_x, again_x) and torch.equal(train_y, again_y)
    assert sorted(torch.cat([train_y, held_y]).bincount().tolist()) == sorted(
        torch.as_tensor(__import__("sklearn.datasets").datasets.load_digits().target).bincount().tolist()
    )
    with pytest.raises(ValueError, match="split"):
        load_digits_split("test")  # type: ignore[arg-type]


def test_pixel_mapping_and_identity_tokenizer():
    levels = torch.arange(17)
    expected = torch.tensor([round(v * 255 / 16) for v in range(17)], dtype=torch.uint8)
    assert torch.equal(to_uint8_pixels(levels), expected)
    images = to_images(levels[:16].repeat(4)[None].expand(3, 64))
    assert images.shape == (3, 8, 8) and images.dtype == torch.uint8
    assert int(images[0, 0, 0]) == 0 and int(images[0, 1, 7]) == 239  # level 15


# ---- model and cache -------------------------------------------------------------------------------


@pytest.mark.parametrize("prefix_rope", ["zeros", "identity"])
def test_incremental_cache_matches_full_forward(prefix_rope):
    model = tiny_model(prefix_rope=prefix_rope)
    labels, tokens = random_tokens(3)
    with torch.no_grad():
        full = model(labels, tokens)  # [3, 64, V]
        for chunk in (1, 5):
            cache = model.new_cache(3)
            pieces = [model.prefill(labels, cache)[:, None]]
            pos = 1
            while pos < 64:
                positions = torch.arange(pos, min(pos + chunk, 64)).expand(3, -1)
                fed = sequence_tokens(labels, tokens, positions)
                pieces.append(model.forward_step(fed, positions, cache))
                pos += positions.shape[1]
            incremental = torch.cat(pieces, dim=1)
            assert incremental.dtype == torch.float32
            assert (incremental - full).abs().max().item() < TOL


def test_rotary_pair_swap_by_slices_and_by_gather_give_the_reference_bits():
    """Both pair swaps of apply_rotary_factors, on either side of PAIR_SWAP_BY_SLICES, equal apply_rotary."""
    g = torch.Generator().manual_seed(3)
    swap = torch.arange(16).view(-1, 2).flip(-1).reshape(-1)
    for rows in (2, PAIR_SWAP_BY_SLICES // (5 * 8 * 16) + 1):  # below the threshold, then above it
        x = torch.randn(rows, 5, 8, 16, generator=g)
        rope = torch.randn(rows, 5, 8, 2, generator=g)
        reference = apply_rotary(x, rope)
        assert torch.equal(apply_rotary_factors(x, rotary_factors(rope), swap), reference)
        assert torch.equal(apply_rotary_factors(x, rotary_factors(rope)), reference)  # no index: slices


def test_rotary_as_one_complex_product_gives_the_reference_bits():
    """apply_rotary_complex equals apply_rotary bit for bit on the CPU, at head sizes whose pairs fill
    less than a vector (16: the kernel's scalar loop) and several (64, 128: its vector loop), on a
    strided q/k view like Attention's, with angles over many turns. A product with a fused multiply-add
    would round once instead of twice and differ in some of these 300k values."""
    g = torch.Generator().manual_seed(4)
    for head_dim, rows, n in ((16, 2, 1), (16, 256, 5), (64, 3, 7), (64, 64, 5), (128, 16, 3)):
        qkv = torch.randn(rows, n, 3 * 8 * head_dim, generator=g) * 4
        x = qkv[..., : 8 * head_dim].view(rows, n, 8, head_dim)  # the q and k heads of a fused projection
        angles = torch.rand(rows, n, head_dim // 2, generator=g) * 200
        rope = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
        reference = apply_rotary(x, rope)
        assert torch.equal(apply_rotary_complex(x, rotary_complex(rope)), reference), (head_dim, rows, n)
        assert torch.equal(apply_rope(x, rotary_complex(rope)), apply_rope(x, rotary_factors(rope)))


def test_rotary_factors_are_complex_only_in_cpu_float32_inference():
    model = DiscreteGPT(GPTConfig(vocab_size=16, dim=32, n_layer=1, n_head=2, grid_size=4, num_classes=3))
    positions = torch.tensor([[1, 2]])
    with torch.no_grad():
        assert isinstance(model._rotary(positions), torch.Tensor)  # the complex form
        assert isinstance(model.double()._rotary(positions), tuple)  # float64: the real pair
    assert isinstance(model.float()._rotary(positions), tuple)  # autograd on: the real pair


def per_value_write_index(positions: torch.Tensor, rows: torch.Tensor | None, head_major: bool = False, host=None):
    """cache_write_index without its slice and block shortcuts."""
    return (torch.arange(positions.shape[0]) if rows is None else rows)[:, None], positions


def assert_same_as_per_value_writes(run, monkeypatch):
    """``run()`` -> (logits, cache) gives the same logits and K/V with the writes cache_write_index chooses
    as with every write per value; returns both caches."""
    with torch.no_grad():
        chosen, chosen_cache = run()
        monkeypatch.setattr(discrete_ar, "cache_write_index", per_value_write_index)
        per_value, per_value_cache = run()
    assert torch.equal(chosen, per_value)
    for a, b in zip(chosen_cache.keys + chosen_cache.values, per_value_cache.keys + per_value_cache.values):
        assert torch.equal(a, b)
    return chosen_cache, per_value_cache


def test_uniform_positions_write_the_cache_through_slices_with_the_same_results(monkeypatch):
    model = tiny_model()
    labels, tokens = random_tokens(4, seed=5)
    uniform = torch.arange(1, 4).expand(4, -1)
    ragged = torch.stack([torch.arange(n, n + 3) for n in (1, 1, 2, 1)])
    assert cache_write_index(uniform, None) == (slice(None), slice(1, 4))
    rows, slots = cache_write_index(ragged, None)
    assert torch.equal(rows, torch.arange(4)[:, None]) and slots is ragged
    assert isinstance(cache_write_index(uniform, torch.arange(4))[0], torch.Tensor)  # a subset of rows: indexed

    def run() -> tuple[torch.Tensor, object]:
        cache = model.new_cache(4)
        model.prefill(labels, cache)
        return model.forward_step(sequence_tokens(labels, tokens, uniform), uniform, cache), cache

    sliced_cache, indexed_cache = assert_same_as_per_value_writes(run, monkeypatch)
    assert torch.equal(sliced_cache.lengths, indexed_cache.lengths)


@pytest.mark.parametrize("kernel", [True, False], ids=["cpp-copies", "indexed"])
def test_block_write_puts_the_same_values_in_the_same_slots(kernel, monkeypatch):
    """BlockWrite against the per-value write, with the C++ row copies and with torch's indexed write:
    8 ragged rows of 5 tokens (all rows, and 5 of 12 in shuffled order), 1 token, and a row whose block
    ends in the last slot; in a cache of its own and in the second layer of a stacked one (a storage
    offset, as the EAGLE loop's caches); a cache not stored head-major takes the per-value write.
    Negative control: blocks one slot late differ."""
    monkeypatch.setattr(discrete_ar, "BLOCK_WRITE_KERNEL", kernel)
    served = _count_cpp_block_writes(monkeypatch) if kernel else None
    g = torch.Generator().manual_seed(7)
    for n, rows in ((5, None), (5, torch.tensor([9, 2, 4, 11, 0])), (1, None)):
        r = 8 if rows is None else rows.shape[0]
        starts = torch.randint(0, 16 - n + 1, (r, 1), generator=g)
        starts[0] = 16 - n  # the last block of the row
        positions = starts + torch.arange(n)
        x = torch.randn(r, n, 3, 4, generator=g)
        write_rows = torch.arange(r) if rows is None else rows
        shape = {"max_len": 16, "n_head": 3, "head_dim": 4, "like": x}  # a length a CPU cache keeps
        stacked = kv_slots(2, 12, **shape)
        for by_blocks in (kv_slots(12, **shape), stacked[1]):
            by_values = by_blocks.clone()
            BlockWrite(write_rows, positions).write(by_blocks, x)
            by_values[write_rows[:, None], positions] = x
            assert torch.equal(by_blocks, by_values)
        assert not stacked[0].any()  # the other layer untouched
        late = kv_slots(12, **shape)
        BlockWrite(write_rows, positions + (positions[:, :1] < 16 - n).long()).write(late, x)  # one slot on
        assert not torch.equal(late, by_values)
        row_major = torch.zeros(12, 16, 3, 4)  # [rows, slots, H, hd] stored as indexed: the per-value write
        BlockWrite(write_rows, positions).write(row_major, x)
        expected = torch.zeros(12, 16, 3, 4)
        expected[write_rows[:, None], positions] = x
        assert torch.equal(row_major, expected)
    if kernel:
        assert served == [True] * 9  # the head-major writes, the late one included; not the row-major one


def _count_cpp_block_writes(monkeypatch) -> list[bool]:
    """The results of the extension's write_blocks calls from now on (skips where it is not built)."""
    extension = cpu_kernels.extension()
    if extension is None:
        pytest.skip("specray's CPU kernels did not build here (see the log)")
    results: list[bool] = []
    original = extension.write_blocks

    def counted(*args):
        results.append(original(*args))
        return results[-1]

    monkeypatch.setattr(extension, "write_blocks", counted)
    return results


def test_block_write_out_of_range_is_refused_not_written(monkeypatch):
    """A block past the cache's last slot: the C++ copies decline it and torch's indexed write refuses it,
    as without the extension."""
    served = _count_cpp_block_writes(monkeypatch)
    cache = kv_slots(4, max_len=16, n_head=2, head_dim=4, like=torch.zeros(()))
    positions = torch.tensor([[3, 4], [15, 16], [0, 1], [7, 8]])
    with pytest.raises(IndexError):
        BlockWrite(torch.arange(4), positions).write(cache, torch.ones(4, 2, 2, 4))
    assert served == [False]


def test_gathered_rows_keep_the_values_and_the_head_major_layout():
    """gather_rows equals cache[rows] over a span of a kv_slots cache, and stays head-major."""
    cache = kv_slots(10, max_len=16, n_head=3, head_dim=4, like=torch.zeros(()))
    cache.copy_(torch.randn(10, 16, 3, 4, generator=torch.Generator().manual_seed(4)))
    rows = torch.tensor([7, 1, 4])
    span = cache[:, :8]
    gathered = gather_rows(span, rows)
    assert torch.equal(gathered, span[rows]) and gathered.transpose(1, 2).is_contiguous()


def test_host_positions_make_the_decisions_of_the_torch_reads(monkeypatch):
    """HostPositions (one tolist of a call's positions) against the torch reductions it replaces: the largest
    position, and cache_write_index's choice (slices, BlockWrite or the per-value write, and their slots) for level,
    ragged, repeated, gapped and negative positions, below and at BLOCK_WRITE_MIN_TOKENS; a model's calls give the
    same logits and K/V with and without it, and a position past the cache is refused with the same message."""
    rows = BLOCK_WRITE_MIN_TOKENS // 4
    g = torch.Generator().manual_seed(9)
    ragged = torch.randint(1, 20, (rows, 1), generator=g) + torch.arange(4)
    cases = [torch.arange(3, 7).expand(rows, -1), ragged, ragged[:5], torch.full((2, 1), 11)]
    for row in ([30, 31, 31, 31], [0, 2, 4, 6], [-1, 0, 1, 2]):  # repeated, gapped, negative
        odd = ragged.clone()
        odd[3] = torch.tensor(row)
        cases.append(odd)
    kinds = set()
    for positions in cases:
        host = discrete_ar.host_positions(positions)
        assert host.last == int(positions.max())
        by_host = cache_write_index(positions, None, head_major=True, host=host)
        by_torch = cache_write_index(positions, None, head_major=True)
        assert type(by_host[0]) is type(by_torch[0]) and type(by_host[1]) is type(by_torch[1])
        if isinstance(by_torch[0], BlockWrite):
            assert torch.equal(by_host[0].rows, by_torch[0].rows) and by_host[1] is by_torch[1]
        elif isinstance(by_torch[1], slice):
            assert by_host == by_torch
        else:
            assert torch.equal(by_host[0], by_torch[0]) and by_host[1] is by_torch[1]
        kinds.add(type(by_torch[0]).__name__)
    assert kinds == {"slice", "BlockWrite", "Tensor"}  # every choice met

    model = tiny_model()
    labels, tokens = random_tokens(rows, seed=6)

    def run() -> tuple[list[torch.Tensor], object]:
        cache = model.new_cache(rows)
        out = [model.prefill(labels, cache)]
        level = torch.arange(1, 20).expand(rows, -1)
        out.append(model.forward_step(sequence_tokens(labels, tokens, level), level, cache))
        cache.crop(ragged[:, 0])
        out.append(model.forward_step(sequence_tokens(labels, tokens, ragged), ragged, cache, prefix=False))
        return out, cache

    with torch.no_grad():
        host_out, host_cache = run()
        monkeypatch.setattr(discrete_ar, "HOST_POSITIONS", False)
        torch_out, torch_cache = run()
        host_all = host_out + host_cache.keys + host_cache.values
        for a, b in zip(host_all, torch_out + torch_cache.keys + torch_cache.values, strict=True):
            assert torch.equal(a, b)
        for on in (True, False):
            monkeypatch.setattr(discrete_ar, "HOST_POSITIONS", on)
            with pytest.raises(ValueError, match="position 40 exceeds cache max_len=32"):
                model.forward_step(torch.zeros(2, 1, dtype=torch.int64), torch.full((2, 1), 40),
                                   model.new_cache(2, 32), prefix=False)


def test_cfg_softmax_gives_the_default_samplers_probabilities():
    """CfgSoftmax, the probabilities a GPT call makes itself, against process_with at the default sampler's settings
    (32 cond and 32 uncond rows of 3 positions x 17 logits, seed 12, no tolerance), guided and not; model_softmax
    hands it out only where the processing is CFG and a softmax alone. Negative controls: the halves swapped, and
    the same mix written as s c + (1 - s) u, differ."""
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(64, 3, 17, generator=g) * 3
    cond, uncond = logits[:32], logits[32:]
    positions = torch.arange(5, 8).expand(32, -1)
    default = SamplingParams()
    guided = process_with(default, cond, uncond, positions)
    assert model_softmax(default) == CfgSoftmax(1.5)
    assert torch.equal(CfgSoftmax(1.5)(logits), guided)
    unguided = SamplingParams(cfg_scale=1.0)
    assert model_softmax(unguided) == CfgSoftmax()
    assert torch.equal(CfgSoftmax()(cond), process_with(unguided, cond, None))
    for other in ({"temperature": 0.7}, {"top_k": 5}, {"top_p": 0.9}, {"cfg_interval": 3}):
        assert model_softmax(SamplingParams(**other)) is None
    assert model_softmax(SamplingParams(cfg_scale=1.0, cfg_interval=3)) == CfgSoftmax()  # no uncond: no interval
    assert not torch.equal(CfgSoftmax(1.5)(torch.cat([uncond, cond])), guided)
    assert not torch.equal(torch.softmax(1.5 * cond + (1 - 1.5) * uncond, dim=-1), guided)


def test_block_writes_are_chosen_for_large_calls_of_consecutive_positions(monkeypatch):
    """cache_write_index picks BlockWrite from BLOCK_WRITE_MIN_TOKENS tokens on when every row's positions
    are consecutive (not for repeated, gapped or negative slots), and a model call through it
    gives the logits and caches of the per-value write."""
    rows = BLOCK_WRITE_MIN_TOKENS // 4
    ragged = torch.randint(1, 20, (rows, 1), generator=torch.Generator().manual_seed(2)) + torch.arange(4)
    assert isinstance(cache_write_index(ragged, None, head_major=True)[0], BlockWrite)
    assert isinstance(cache_write_index(ragged, None)[0], torch.Tensor)  # not head-major: per value
    assert isinstance(cache_write_index(ragged[:-1], None, head_major=True)[0], torch.Tensor)  # below the size
    for row in ([30, 31, 31, 31], [0, 2, 4, 6], [-1, 0, 1, 2]):  # repeated, gapped, negative
        odd = ragged.clone()
        odd[3] = torch.tensor(row)
        assert isinstance(cache_write_index(odd, None, head_major=True)[0], torch.Tensor)

    model = tiny_model()
    labels, tokens = random_tokens(rows, seed=6)

    def run() -> tuple[torch.Tensor, object]:
        cache = model.new_cache(rows)
        model.prefill(labels, cache)
        level = torch.arange(1, 20).expand(rows, -1)  # every row to position 19 (slices), then cropped
        model.forward_step(sequence_tokens(labels, tokens, level), level, cache)
        cache.crop(ragged[:, 0])
        return model.forward_step(sequence_tokens(labels, tokens, ragged), ragged, cache), cache

    assert_same_as_per_value_writes(run, monkeypatch)


def test_only_a_cache_past_the_size_bound_grows():
    """A CPU cache grows (KVCache.reserve) only where holding every slot would take more than
    GROWING_CACHE_MIN_BYTES: tiny_model's 2 layers of dim 32 over 80 slots, float32, take 40,960 bytes a row, so 102
    rows (4.18 MB) stay static and 103 rows (4.22 MB) grow."""
    model = tiny_model()
    per_row = 2 * 2 * 80 * 32 * 4
    assert discrete_ar.GROWING_CACHE_MIN_BYTES == 4 << 20 and 102 * per_row <= 4 << 20 < 103 * per_row
    static, growing = model.new_cache(102, 70), model.new_cache(103, 70)
    assert (static.slots, static.keys[0].shape[1]) == (None, 80)
    assert (growing.slots, growing.keys[0].shape[1]) == (80, 16)


@torch.inference_mode()
def test_an_eager_caches_keys_and_values_are_views_of_one_buffer_and_a_compiled_steps_are_not(monkeypatch):
    """An eager cache's layers' K and V, made in inference mode as the loops make them, are views of one zeroed buffer
    (one allocation a cache), each with the layout a buffer of its own has (the same shape and strides, head-major); a
    compiled step's are a buffer each (a graph's inputs, none a view of another's), and so are a cache's made where
    autograd records; all give the same logits. Growing, a view is replaced by a buffer of its own."""
    model = tiny_model()
    labels, tokens = random_tokens(3, seed=2)
    with torch.inference_mode(False), torch.enable_grad():
        recorded = model.new_cache(3, 70)
    assert len({t.untyped_storage().data_ptr() for t in (*recorded.keys, *recorded.values)}) == 4
    eager = model.new_cache(3, 70)
    storages = {t.untyped_storage().data_ptr() for t in (*eager.keys, *eager.values)}
    assert len(storages) == 1 and len({t.data_ptr() for t in (*eager.keys, *eager.values)}) == 4
    assert all(torch.equal(t, torch.zeros_like(t)) for t in (*eager.keys, *eager.values))
    monkeypatch.setattr(model, "compiled_decode", model.decode_all_rows)  # new_cache only asks whether there is one
    own = model.new_cache(3, 70)
    monkeypatch.setattr(model, "compiled_decode", None)
    assert len({t.untyped_storage().data_ptr() for t in (*own.keys, *own.values)}) == 4
    assert [(t.shape, t.stride()) for t in (*eager.keys, *eager.values)] == [
        (t.shape, t.stride()) for t in (*own.keys, *own.values)]
    positions = torch.arange(0, 6)[None].expand(3, -1)
    fed = torch.cat([labels[:, None], tokens[:, :5]], 1)
    assert torch.equal(model.forward_step(fed, positions, eager), model.forward_step(fed, positions, own))
    assert all(torch.equal(a, b) for a, b in zip((*eager.keys, *eager.values), (*own.keys, *own.values)))
    monkeypatch.setattr(discrete_ar, "GROWING_CACHE_MIN_BYTES", 0)
    growing = model.new_cache(3, 70)
    assert len({t.untyped_storage().data_ptr() for t in (*growing.keys, *growing.values)}) == 1
    model.forward_step(fed, positions, growing)
    positions = torch.full((3, 1), 20)
    model.forward_step(tokens[:, 19:20], positions, growing, prefix=False)  # past the first 16 slots: it grows
    assert growing.keys[0].shape[1] == 32
    assert len({t.untyped_storage().data_ptr() for t in (*growing.keys, *growing.values)}) == 4


def test_a_cache_of_few_reads_grows_only_past_the_last_level_cache(tmp_path, monkeypatch):
    """new_cache(few_reads=True) raises the size bound to the CPU's last-level cache, read from Linux's cache levels
    (here a fake one of 48 KB, 2 MB and 8 MB, and a level whose size is not one): tiny_model's caches of 204 rows
    (8.36 MB) hold every slot, of 205 rows (8.40 MB) grow, as they do without few_reads past 4 MB; with no levels
    known, or the rule off, past 4 MB as any other."""
    for name, level, size in (("index0", "1", "48K"), ("index2", "2", "2048K"), ("index3", "3", "8M"),
                              ("index4", "4", "unknown")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "level").write_text(level + "\n")
        (tmp_path / name / "size").write_text(size + "\n")
    assert discrete_ar.last_level_cache_bytes(tmp_path) == 8 << 20
    assert discrete_ar.last_level_cache_bytes(tmp_path / "none") is None
    model = tiny_model()
    per_row = 2 * 2 * 80 * 32 * 4
    assert 204 * per_row <= 8 << 20 < 205 * per_row

    def grows(rows: int, few_reads: bool) -> bool:
        return model.new_cache(rows, 70, few_reads=few_reads).slots is not None

    monkeypatch.setattr(discrete_ar, "last_level_cache_bytes", lambda: 8 << 20)
    assert (grows(204, True), grows(205, True), grows(103, False)) == (False, True, True)
    monkeypatch.setattr(discrete_ar, "FEW_READS_WHOLE_IN_LAST_LEVEL_CACHE", False)
    assert grows(103, True)
    monkeypatch.setattr(discrete_ar, "FEW_READS_WHOLE_IN_LAST_LEVEL_CACHE", True)
    monkeypatch.setattr(discrete_ar, "last_level_cache_bytes", lambda: None)
    assert (grows(102, True), grows(103, True)) == (False, True)


def test_a_growing_cache_gives_the_static_caches_results(monkeypatch):
    """A CPU cache that grows with its calls (KVCache.reserve) against one holding every slot from the start:
    the same logits at every call (level steps across the 16-slot boundaries, a ragged verify with a row
    parked at the cache's last slots, a tree call) and the same K/V in the held slots. It holds 16, 32,
    48 slots as the steps reach them, then all 80, and refuses a position past max_len as the static cache
    does. Negative control: a growth that does not copy the held slots gives other logits."""
    model = tiny_model()
    labels, tokens = random_tokens(4, seed=5)

    def fed(positions: torch.Tensor) -> torch.Tensor:  # image token p - 1 at position p (padding past the image)
        return tokens.gather(1, (positions - 1).clamp(0, 63))

    def calls(cache) -> tuple[list[torch.Tensor], list[int]]:
        out, held = [model.forward_step(labels[:, None], torch.zeros(4, 1, dtype=torch.int64), cache)], []
        held.append(cache.keys[0].shape[1])
        for t in range(1, 40):
            positions = torch.full((4, 1), t)
            out.append(model.forward_step(fed(positions), positions, cache, prefix=False))
            held.append(cache.keys[0].shape[1])
        cache.crop(torch.tensor([38, 30, 39, 20]))
        ragged = torch.tensor([[38], [30], [39], [20]]) + torch.arange(5)
        ragged[3] = torch.arange(cache.max_len - 5, cache.max_len)  # parked at the last slots
        out.append(model.forward_step(fed(ragged), ragged, cache, prefix=False))
        held.append(cache.keys[0].shape[1])
        slots = torch.tensor([[40], [41], [42], [43]]) + torch.arange(3)
        visible = torch.arange(48)[None, None, :] <= slots[:, :, None]
        out.append(model.forward_tree(fed(slots), slots, slots, visible, cache))
        return out, held

    def caches(growing: bool):
        monkeypatch.setattr(discrete_ar, "GROWING_CACHES", growing)
        monkeypatch.setattr(discrete_ar, "GROWING_CACHE_MIN_BYTES", 0)  # this small a cache too
        return model.new_cache(4, 70)

    with torch.no_grad():
        growing, static = caches(True), caches(False)
        assert (growing.slots, growing.max_len, growing.keys[0].shape[1]) == (80, 80, 16)
        assert (static.slots, static.max_len, static.keys[0].shape[1]) == (None, 80, 80)
        grown_out, held = calls(growing)
        static_out, _ = calls(static)
        assert held == [16] * 16 + [32] * 16 + [48] * 8 + [80]
        for a, b in zip(grown_out, static_out):
            assert torch.equal(a, b)
        for a, b in zip(growing.keys + growing.values, static.keys + static.values):
            assert a.shape == b.shape and torch.equal(a, b)
        for cache in (caches(True), static):
            with pytest.raises(ValueError, match="position 80 exceeds cache max_len=80"):
                model.forward_step(fed(torch.full((4, 1), 80)), torch.full((4, 1), 80), cache, prefix=False)

        def forgetful(old: torch.Tensor, slots: int) -> torch.Tensor:
            rows, _, heads, head_dim = old.shape
            return kv_slots(rows, max_len=slots, n_head=heads, head_dim=head_dim, like=old)

        monkeypatch.setattr(discrete_ar, "_grown", forgetful)
        forgot, _ = calls(caches(True))
        assert torch.equal(forgot[15], static_out[15]) and not torch.equal(forgot[16], static_out[16])


def test_additive_masks_give_the_logits_of_bool_masks(monkeypatch):
    """forward_step (ragged rows) and forward_tree with the 0 / -inf masks built once per call give the
    logits of the bool masks handed to every layer's SDPA call. Negative control: masks of zeros differ."""
    model = tiny_model()
    labels, tokens = random_tokens(6, seed=8)
    positions = torch.tensor([[1, 2, 3], [4, 5, 6], [2, 3, 4], [1, 2, 3], [7, 8, 9], [3, 4, 5]])
    slots = positions + 2
    visible = torch.arange(16)[None, None, :] <= slots[:, :, None]

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        cache = model.new_cache(6, 16)
        model.prefill(labels, cache)
        level = torch.arange(1, 10).expand(6, -1)
        model.forward_step(sequence_tokens(labels, tokens, level), level, cache)
        cache.crop(positions[:, 0])
        step = model.forward_step(sequence_tokens(labels, tokens, positions), positions, cache)
        tree = model.forward_tree(tokens[:, :3], positions, slots, visible, cache)
        return step, tree

    with torch.no_grad():
        additive = run()  # forward_step's masks: rows of a kept table (causal_mask)
        monkeypatch.setattr(discrete_ar, "MASK_TABLES", False)  # built each call, through additive_mask below
        built = run()
        monkeypatch.setattr(discrete_ar, "additive_mask", lambda mask, dtype: mask)
        boolean = run()
        monkeypatch.setattr(discrete_ar, "additive_mask", lambda mask, dtype: torch.zeros(mask.shape, dtype=dtype))
        unmasked = run()
    assert all(torch.equal(a, b) for a, b in zip(additive, built))
    assert all(torch.equal(a, b) for a, b in zip(additive, boolean))
    assert not any(torch.equal(a, b) for a, b in zip(additive, unmasked))


def test_a_causal_mask_is_a_lookup_of_the_mask_it_builds():
    # Queries at every position of a cache (those past the span too: a padded verify's tail) over spans of 16..80
    # slots: the kept table's rows are the mask built from the positions, bit for bit, in and out of inference mode
    # (a table first made inside one serves calls outside it); past MASK_TABLE_MAX_ELEMENTS nothing is kept.
    for span, slots in ((16, 16), (32, 80), (64, 80), (80, 80)):
        positions = torch.arange(slots).roll(5).view(-1, 8 if slots % 8 == 0 else 1)
        key_slots = torch.arange(span)
        built = discrete_ar.additive_mask((key_slots[None, None, :] <= positions[:, :, None])[:, None], torch.float32)
        with torch.inference_mode():
            inside = discrete_ar.causal_mask(positions, span, slots, torch.float32)
        outside = discrete_ar.causal_mask(positions, span, slots, torch.float32)
        assert inside.shape == outside.shape == built.shape == (positions.shape[0], 1, positions.shape[1], span)
        assert torch.equal(inside, built) and torch.equal(outside, built)
    big = 1 + discrete_ar.MASK_TABLE_MAX_ELEMENTS // 512
    kept = discrete_ar._mask_table.cache_info().currsize
    discrete_ar.causal_mask(torch.tensor([[3]]), 512, big, torch.float32)
    assert discrete_ar._mask_table.cache_info().currsize == kept


def test_feed_forward_in_place_gives_the_autograd_path_bits_and_leaves_its_input():
    ffn = tiny_model().layers[0].feed_forward
    x = torch.randn(6, 5, 32)
    kept = x.clone()
    with torch.inference_mode():
        in_place = ffn(x)
    with torch.no_grad():
        also_in_place = ffn(x)
    x_grad = x.clone().requires_grad_()
    reference = ffn(x_grad)
    reference.sum().backward()  # the autograd path keeps what its backward needs
    assert torch.equal(in_place, reference.detach()) and torch.equal(also_in_place, reference.detach())
    assert torch.equal(x, kept)
    assert x_grad.grad is not None and ffn.w1.weight.grad is not None
    # Negative control: the formula without the gate's silu gives other values.
    plain = torch.nn.functional.linear(ffn.w1(x) * ffn.w3(x), ffn.w2.weight)
    assert not torch.equal(plain, reference.detach())


def test_rms_norm_in_cpu_inference_gives_the_autograd_path_bits():
    """The CPU inference branch (sum, then division by the count, with 0-dim scalars) against the
    branch autograd takes (``torch.mean`` and Python scalars): 600 random inputs over the loops' shapes
    (1, 5 and 26 tokens, 2 to 256 rows, widths 48 and 64), seed 5, no tolerance."""
    g = torch.Generator().manual_seed(5)
    for dim in (64, 48):
        norm = discrete_ar.RMSNorm(dim, 1e-5)
        with torch.no_grad():
            norm.weight.copy_(torch.randn(dim, generator=g))
        for rows, n in ((2, 1), (10, 5), (256, 1), (80, 5), (4, 26)):
            for _ in range(60):
                x = torch.randn(rows, n, dim, generator=g) * torch.rand(1, generator=g) * 10
                with torch.inference_mode():
                    fast = norm(x)
                reference = norm(x.clone().requires_grad_())
                assert torch.equal(fast, reference.detach()), (dim, rows, n)
    # Negative control: scaling by the count's reciprocal instead of dividing by it rounds otherwise
    # (at width 48; 1/64 is a power of two, exact either way).
    x = torch.randn(256, 1, 48, generator=g)
    reference = norm(x.clone().requires_grad_()).detach()
    reciprocal = x * torch.rsqrt((x * x).sum(-1, keepdim=True) * (1 / 48) + 1e-5) * norm.weight
    assert not torch.equal(reciprocal.detach(), reference)


def test_temperature_one_skips_the_division_with_the_same_probabilities():
    """64 rows of 17 logits (seed 6), no tolerance: temperature 1 gives the probabilities of dividing by 1,
    another temperature still divides, and half-precision logits are still cast to float32."""
    g = torch.Generator().manual_seed(6)
    cond, uncond = torch.randn(64, 17, generator=g) * 3, torch.randn(64, 17, generator=g) * 3
    guided = uncond + 1.5 * (cond - uncond)
    assert torch.equal(process_logits(cond, uncond, 1.5, 1.0, 0, 1.0), torch.softmax(guided / 1.0, dim=-1))
    assert torch.equal(process_logits(cond, None, 1.0, 1.0, 0, 1.0), torch.softmax(cond / 1.0, dim=-1))
    assert torch.equal(process_logits(cond, uncond, 1.5, 0.7, 0, 1.0), torch.softmax(guided / 0.7, dim=-1))
    assert not torch.equal(process_logits(cond, uncond, 1.5, 0.7, 0, 1.0), torch.softmax(guided, dim=-1))
    cond16, uncond16 = cond.bfloat16(), uncond.bfloat16()
    half = process_logits(cond16, uncond16, 1.5, 1.0, 0, 1.0)
    assert half.dtype == torch.float32
    assert torch.equal(half, torch.softmax(uncond16.float() + 1.5 * (cond16.float() - uncond16.float()), dim=-1))


def test_layout_mirrors_llamagen_keys():
    keys = set(tiny_model().state_dict())
    for key in (
        "tok_embeddings.weight", "cls_embedding.embedding_table.weight", "layers.0.attention.wqkv.weight",
        "layers.0.attention.wo.weight", "layers.1.feed_forward.w1.weight", "layers.1.feed_forward.w2.weight",
        "layers.1.feed_forward.w3.weight", "layers.0.attention_norm.weight", "layers.0.ffn_norm.weight",
        "norm.weight", "output.weight",
    ):
        assert key in keys
    assert tiny_model().cls_embedding.embedding_table.weight.shape[0] == 11  # 10 classes + CFG null class


def test_ragged_rows_give_the_same_distributions_as_each_row_alone():
    model = tiny_model()
    labels, tokens = random_tokens(3, seed=2)
    sampling = SamplingParams(cfg_scale=2.0, temperature=0.9, top_k=12, top_p=0.95)
    lengths = [1, 9, 30]  # sequence positions already committed per row
    batched = GuidedModel(model, 3, sampling, 70)
    idx = torch.arange(3)
    # Fill each row's prefix in ragged pieces, with a stale draft written past the prefix.
    for b, length in enumerate(lengths):
        row = torch.tensor([b])
        positions = torch.arange(0, length)[None]
        batched.probs(row, sequence_tokens(labels[row], tokens[row], positions), positions)
        stale = torch.arange(length, length + 4)[None]
        batched.probs(row, torch.randint(0, 17, (1, 4)), stale)
        batched.crop(row, torch.tensor([length]))
    # One batched call: every row gets 4 tokens at its own positions.
    positions = torch.stack([torch.arange(n, n + 4) for n in lengths])
    together = batched.probs(idx, sequence_tokens(labels, tokens, positions), positions)
    for b, length in enumerate(lengths):
        alone = GuidedModel(model, 1, sampling, 70)
        row = torch.tensor([b])
        pos = torch.arange(0, length + 4)[None]
        ref = alone.probs(torch.tensor([0]), sequence_tokens(labels[row], tokens[row], pos), pos)[:, -4:]
        assert (together[b] - ref[0]).abs().max().item() < TOL


def test_parked_rows_take_consecutive_slots_inside_the_cache(monkeypatch):
    """A call on most of the batch runs on every row, the others parked (GuidedModel._park_other_rows).
    A parked row with room is fed at the slots from its length on; a finished row near the cache's end at
    its last n slots, so every row's slots are consecutive and the call writes K/V as blocks. The rows
    called get the outputs of a call on them alone, bit for bit. Negative control: parked slots clamped
    to the last one are not consecutive, and the call falls back to per-value writes."""
    model = tiny_model()
    batch, max_len, n = 5, 32, 5  # 32: a CPU cache keeps this length (kv_slots)
    labels, tokens = random_tokens(batch, seed=9)
    monkeypatch.setattr(discrete_ar, "BLOCK_WRITE_MIN_TOKENS", 1)  # blocks at this small size too
    monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", False)  # the Python layers' writes are counted (the fused
    # layers make the same BlockWrite from C++, tests/test_fused_layers.py)
    sampling = SamplingParams(cfg_scale=1.5, temperature=1.0, top_k=0, top_p=1.0)
    lengths = torch.tensor([6, 9, 29, 12, 10])  # row 2 is finished, 3 slots from the end; row 4 sits out
    idx, positions = torch.tensor([0, 1, 3]), torch.stack([torch.arange(k, k + n) for k in (6, 9, 12)])

    def stream() -> GuidedModel:
        s = GuidedModel(model, batch, sampling, max_len)
        filled = torch.arange(0, 29).expand(batch, -1)
        s.probs(torch.arange(batch), sequence_tokens(labels, tokens, filled), filled, all_rows=True)
        s.crop(torch.arange(batch), lengths, all_rows=True)
        return s

    parked = stream()
    _, all_positions = parked._park_other_rows(idx, tokens[idx, :n], positions)
    assert all_positions[2].tolist() == list(range(max_len - n, max_len))
    assert all_positions[4].tolist() == list(range(10, 10 + n))  # from its length on: slots it rewrites later
    assert torch.equal(all_positions[idx], positions)
    blocks, write = [], BlockWrite.write

    def counted_write(self: BlockWrite, cache: torch.Tensor, x: torch.Tensor) -> None:
        blocks.append(tuple(x.shape))
        write(self, cache, x)

    monkeypatch.setattr(BlockWrite, "write", counted_write)
    fed = sequence_tokens(labels[idx], tokens[idx], positions)
    with torch.inference_mode():
        together = parked.probs(idx, fed, positions, prefix=False)
        assert blocks == [(2 * batch, n, 2, 16)] * 2 * model.config.n_layer  # K and V, every row and layer
        alone = stream().forward(idx, fed, positions, all_rows=False, prefix=False)
    assert torch.equal(together, alone)

    clamped = (lengths[:, None] + torch.arange(n)).clamp(max=max_len - 1)
    clamped[idx] = positions
    assert isinstance(cache_write_index(torch.cat([clamped, clamped]), None, head_major=True)[0], torch.Tensor)


def test_verify_forward_equals_incremental_sampler_distributions():
    """Spec §9.14: P_i from one verify call on [t, d_1..d_g] equals the incremental sampler's P_i."""
    model = tiny_model()
    labels, tokens = random_tokens(2, seed=3)
    sampling = SamplingParams(cfg_scale=1.5, temperature=1.0, top_k=0, top_p=1.0)
    n, gamma = 20, 4  # 20 committed image tokens; verify positions n .. n+gamma
    idx = torch.arange(2)
    incremental = GuidedModel(model, 2, sampling, 70)
    verify_stream = GuidedModel(model, 2, sampling, 70)
    prefix = torch.arange(0, n).expand(2, -1)
    for stream in (incremental, verify_stream):
        stream.probs(idx, sequence_tokens(labels, tokens, prefix), prefix)
    steps = [incremental.probs(idx, sequence_tokens(labels, tokens, torch.full((2, 1), p)), torch.full((2, 1), p))
             for p in range(n, n + gamma + 1)]
    incremental_P = torch.cat(steps, dim=1)
    block = torch.arange(n, n + gamma + 1).expand(2, -1)
    verify_P = verify_stream.probs(idx, sequence_tokens(labels, tokens, block), block)
    assert verify_P.dtype == torch.float32
    assert (verify_P - incremental_P).abs().max().item() < TOL


# ---- processing ---------------------------------------------------------------------------------


def reference_processing(cond, uncond, s, temperature, top_k, top_p):
    """Row-by-row restatement of LlamaGen's sample(): CFG on logits, /T, top-k, top-p, softmax."""
    out = []
    for lc, lu in zip(cond.tolist(), uncond.tolist()):
        logits = [u + s * (c - u) for c, u in zip(lc, lu)]
        logits = [x / max(temperature, 1e-5) for x in logits]
        if 0 < top_k < len(logits):
            kth = sorted(logits, reverse=True)[top_k - 1]
            logits = [x if x >= kth else float("-inf") for x in logits]
        if top_p < 1.0:
            order = sorted(range(len(logits)), key=lambda i: -logits[i])
            probs = torch.softmax(torch.tensor([logits[i] for i in order]), 0).tolist()
            cum = 0.0
            for rank, i in enumerate(order):
                if cum > top_p and rank > 0:
                    logits[i] = float("-inf")
                cum += probs[rank]
        out.append(torch.softmax(torch.tensor(logits, dtype=torch.float32), 0))
    return torch.stack(out)


@pytest.mark.parametrize("s,temperature,top_k,top_p", [(1.0, 1.0, 0, 1.0), (1.5, 0.7, 5, 1.0), (3.0, 1.3, 0, 0.8),
                                                        (2.0, 1.0, 8, 0.6)])
def test_processing_matches_reference(s, temperature, top_k, top_p):
    g = torch.Generator().manual_seed(4)
    cond, uncond = torch.randn(6, 17, generator=g) * 2, torch.randn(6, 17, generator=g) * 2
    got = process_logits(cond, uncond, s, temperature, top_k, top_p)
    assert got.dtype == torch.float32
    assert (got - reference_processing(cond, uncond, s, temperature, top_k, top_p)).abs().max().item() < 1e-6
    assert torch.allclose(got.sum(-1), torch.ones(6))


def test_cfg_is_on_logits_not_log_probs():
    cond = torch.tensor([[0.0, 1.0, 2.0]])
    uncond = torch.tensor([[5.0, 1.0, 0.0]])
    expected = torch.softmax(uncond + 2.0 * (cond - uncond), -1)
    assert torch.allclose(process_logits(cond, uncond, 2.0, 1.0, 0, 1.0), expected)


def test_top_k_keeps_ties_and_top_p_keeps_first_crossing_token():
    logits = torch.tensor([[3.0, 1.0, 3.0, 2.0, 2.0, 0.0]])
    kept = torch.isfinite(top_k_mask(logits, 3))[0].tolist()
    assert kept == [True, False, True, True, True, False]  # the 3rd largest value (2.0) is tied
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept_p = torch.isfinite(top_p_mask(probs.log(), 0.6))[0].tolist()
    assert kept_p == [True, True, False, False]  # 0.5 < 0.6, 0.8 crosses and is kept
    near_zero = process_logits(torch.tensor([[1.0, 2.0, 0.5]]), None, 1.0, 0.0, 0, 1.0)
    assert near_zero.argmax().item() == 1 and near_zero.max().item() > 0.999999


def test_sampling_params_errors_name_the_field():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="uncond_logits"):
        process_logits(torch.zeros(1, 3), None, 2.0, 1.0, 0, 1.0)


# ---- training, storage, presets -----------------------------------------------------------------


def test_training_smoke_is_deterministic_and_learns(tmp_path):
    config = GPTConfig(dim=16, n_layer=1, n_head=2)
    train = TrainConfig(steps=12, batch_size=16, lr=1e-2, warmup_steps=2)
    model_a, record_a = train_model(config, train, seed=3)
    model_b, _ = train_model(config, train, seed=3)
    for (name, a), (_, b) in zip(model_a.state_dict().items(), model_b.state_dict().items()):
        assert torch.equal(a, b), name
    untrained_nll = heldout_nll(DiscreteGPT(config))
    assert heldout_nll(model_a) < untrained_nll - 0.1  # uniform over 17 levels is ln 17 = 2.83
    path = save_model(model_a, tmp_path / "tiny.safetensors", {"final_train_loss": str(record_a["final_train_loss"])})
    loaded = load_model(path)
    labels, tokens = random_tokens(2)
    with torch.no_grad():
        diff = (loaded(labels, tokens) - model_a(labels, tokens)).abs().max().item()
    assert diff < 5e-2  # stored in fp16


def test_presets_cost_ratio_and_stored_record():
    target = GPTConfig.from_dict(get_preset("digits-gpt-target").config)
    draft = GPTConfig.from_dict(get_preset("digits-gpt-draft").config)
    assert flops_per_token(target) >= 8 * flops_per_token(draft)
    from safetensors import safe_open

    for name in ("digits-gpt-target", "digits-gpt-draft"):
        path = get_preset(name).weights_path
        if not path.exists():
            pytest.skip(f"{path} not trained")
        assert path.stat().st_size < 4_000_000
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
        assert json.loads(meta["config"]) and float(meta["heldout_nll_nats_per_token"]) < 2.0
        assert float(meta["final_train_loss"]) < 2.0 and meta["seed"] == "0"


def test_load_pair_info():
    if not get_preset("digits-gpt-target").weights_path.exists():
        pytest.skip("preset weights not trained")
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    assert pair.family == "discrete_ar" and not pair.target.training
    assert pair.info["image_shape"] == (8, 8) and pair.info["vocab_size"] == 17 and pair.info["num_classes"] == 10
    assert torch.equal(pair.info["token_embeddings"], pair.target.tok_embeddings.weight)
    with pytest.raises(KeyError, match="unknown preset"):
        load_pair("no-such-preset", None, "cpu")


def test_a_models_text_conditioning_is_found_once_and_names_its_kind(monkeypatch):
    # bind_conditions asks every batch; walking the modules once per model is enough (they are fixed once built).
    from specray.methods import common
    from specray.models import captions

    def model(condition: str) -> discrete_ar.DiscreteGPT:
        prefix = 2 if condition == "caption" else 1
        return discrete_ar.DiscreteGPT(discrete_ar.GPTConfig(dim=32, n_layer=1, n_head=2, text_dim=8, caption_dim=8,
                                                             cls_token_num=prefix, condition=condition))

    kinds = {condition: common.text_conditioning(model(condition)) for condition in ("class", "text", "caption")}
    assert kinds == {"class": (False, False), "text": (False, True), "caption": (True, True)}

    caption_model = model("caption")
    assert common.text_conditioning(caption_model) == (True, True)
    monkeypatch.setattr(captions, "caption_embedders", lambda m: pytest.fail("walked the modules again"))
    assert common.text_conditioning(caption_model) == (True, True)
