"""The CPU decode-attention kernel (specray/models/decode_attention.py): torch's values bit for bit where it
serves a call, torch's kernel everywhere else, and the samples of the discrete loops unchanged (with the
verify calls' K/V row copies of the same extension)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specray.methods.discrete import cpu_rounds
from specray.methods.discrete.loop import generate_tokens
from specray.models import cpu_kernels, cpu_norm, decode_attention, discrete_ar
from specray.models.discrete_ar import load_pair


@pytest.fixture(scope="module")
def kernel():
    """The kernel as checked for a verify call of 5 queries at one thread (the actors' setting), or a skip saying
    why it is absent."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        fast = decode_attention.kernel(5)
        if fast is None:
            pytest.skip("the decode-attention kernel did not build or did not match torch's here (see the log)")
        yield fast
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("queries", [1, 4, 5, 9])
def test_kernel_gives_torchs_values_on_every_span(kernel, one_thread, queries):
    # 12 spans x 4 draws x 24 rows x 4 heads x queries x 16 values, seed 7 (not the self-check's seed 0).
    if decode_attention.kernel(queries) is None:  # e.g. one query where the BLAS sums in orders not written out
        pytest.skip(f"the kernel does not give torch's values at {queries} queries here (see the log)")
    assert decode_attention.kernel(queries) is kernel
    generator = torch.Generator().manual_seed(7)
    for span in decode_attention.SPANS:
        for _ in range(4):
            q, k, v, mask = decode_attention._cases(queries, span, generator)
            want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            got = kernel(q, k, v, mask, 0.25)
            assert got.stride() == want.stride()
            assert torch.equal(got, want), (queries, span)


def test_a_row_with_every_slot_masked_gives_torchs_zeros(kernel, one_thread):
    q, k, v, mask = decode_attention._cases(5, 32, torch.Generator().manual_seed(3))
    mask[2] = float("-inf")
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.equal(kernel(q, k, v, mask, 0.25), want)
    assert not want[2].any()


def test_blocks_off_the_64_byte_alignment_are_handed_back_to_torch(kernel, one_thread):
    q, k, v, mask = decode_attention._cases(5, 32, torch.Generator().manual_seed(4))
    shifted = torch.empty(q.numel() + 1)[1:].view_as(q.contiguous())  # 4 bytes off
    shifted.copy_(q)
    assert kernel(shifted, k, v, mask, 0.25) is None
    attend = decode_attention.attention_for(q, 16, 5, 32)
    assert torch.equal(attend(shifted, k, v, attn_mask=mask), F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def test_a_bool_mask_is_handed_back_to_torch(kernel, one_thread):
    """The kernel takes discrete_ar.additive_mask's 0 / -inf; a bool mask (which the fused layers may pass it) goes
    to torch's kernel as given, by the Python wrapper and by the kernel itself."""
    q, k, v, mask = decode_attention._cases(5, 32, torch.Generator().manual_seed(5))
    allowed = mask == 0
    assert kernel(q, k, v, allowed, 0.25) is None
    attend = decode_attention.attention_for(q, 16, 5, 32)
    assert attend is not F.scaled_dot_product_attention
    assert torch.equal(attend(q, k, v, attn_mask=allowed), F.scaled_dot_product_attention(q, k, v, attn_mask=allowed))


def test_the_check_refuses_a_kernel_off_by_one_bit(one_thread):
    """Negative control for the guard: a kernel whose sums differ from torch's in the last bit anywhere
    (what another BLAS order gives) is refused."""
    def off_by_one_bit(q, k, v, mask, scale):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).contiguous()
        flat = out.view(-1)
        flat[len(flat) // 2] = torch.nextafter(flat[len(flat) // 2], torch.tensor(float("inf")))
        return out

    def torchs(q, k, v, mask, scale):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    assert not decode_attention._matches_torch(off_by_one_bit, 5)
    assert decode_attention._matches_torch(torchs, 5)


def test_one_query_follows_the_orders_that_matched(kernel, one_thread):
    """Negative control for the one-query orders (MKL's AVX2 and AVX-512 paths sum otherwise): where the kernel
    serves one query, the other path's orders give other values on the check's draws, so one-query orders that are
    not this BLAS's are refused; the orders kept are set back, and no third kind is taken."""
    if decode_attention.kernel(1) is None:
        pytest.skip("the kernel does not give torch's values at one query here (see the log)")
    module = cpu_kernels.extension()
    kept = module.get_one_query_orders()
    try:
        for other in set(decode_attention.ONE_QUERY_ORDERS) - {kept}:
            module.set_one_query_orders(other)
            assert not decode_attention._matches_torch(kernel, 1)
    finally:
        module.set_one_query_orders(kept)
    assert module.get_one_query_orders() == kept
    assert decode_attention._matches_torch(kernel, 1)
    with pytest.raises(RuntimeError, match="set_one_query_orders"):
        module.set_one_query_orders(2)


@pytest.mark.parametrize("why", ["queries", "head_dim", "span", "dtype", "disabled"])
def test_calls_the_kernel_does_not_serve_go_to_torch(kernel, one_thread, monkeypatch, why):
    x = torch.zeros(2, 1, 64, dtype=torch.float64 if why == "dtype" else torch.float32)
    queries = 2 if why == "queries" else 5
    head_dim = 24 if why == "head_dim" else 16
    span = 208 if why == "span" else 32
    if why == "disabled":
        monkeypatch.setattr(decode_attention, "ENABLED", False)
    assert decode_attention.attention_for(x, head_dim, queries, span) is F.scaled_dot_product_attention
    assert decode_attention.attention_for(torch.zeros(2, 1, 64), 16, 5, 32) is not F.scaled_dot_product_attention \
        or why == "disabled"


def test_each_thread_count_is_checked_on_its_own(kernel, one_thread):
    decode_attention.kernel(5)
    assert decode_attention._checked[(1, 5)] is True
    torch.set_num_threads(2)
    decode_attention.kernel(5)  # torch's BLAS sums otherwise with two threads: checked again, whatever it finds
    assert (2, 5) in decode_attention._checked


@pytest.mark.parametrize("method,params", [
    ("target_only", {"cfg_scale": 1.5}),
    ("sd", {"cfg_scale": 1.5, "gamma": 4}),
    ("cool_sd", {"cfg_scale": 1.5, "gamma": 4}),
    ("block", {"cfg_scale": 1.5, "gamma": 4}),
    ("lantern", {"cfg_scale": 1.5, "gamma": 4}),
])
def test_the_loops_give_the_same_samples_with_and_without_the_kernels(kernel, one_thread, monkeypatch, method, params):
    """The attention kernel, the K/V row copies, the RMSNorm kernel and the rounds' draws and decisions against
    torch's operations: 64 samples (128 rows, so the speculative arms' ragged verify calls write by blocks), seed 3;
    the kernels must serve calls. The Python layers, whose kernel calls are counted here; then the fused layers,
    which call the same kernels from C++ (discrete_ar.FusedLayers), with the same samples."""
    monkeypatch.setattr(discrete_ar, "FUSED_LAYERS", False)
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    ids = torch.arange(64) + 40
    served, copied, normed, drawn, decided = [], [], [], [], []
    real = decode_attention.attention_for
    extension = cpu_kernels.extension()
    real_write, real_norm = extension.write_blocks, extension.rms_norm
    real_draw = extension.sample_categorical
    round_kernel = cpu_rounds.ROUND_KERNELS.get(method, "chain_round")
    real_round = getattr(extension, round_kernel)
    vocab = pair.target.config.vocab_size  # checked before the counting starts (a check calls the kernels too)
    assert all(cpu_rounds.kernel(name, vocab) for name in ("sample_categorical", *cpu_rounds.ROUND_KERNELS.values()))

    def counting(*args):
        attend = real(*args)
        served.append(attend is not F.scaled_dot_product_attention)
        return attend

    def counting_write(*args):
        copied.append(real_write(*args))
        return copied[-1]

    monkeypatch.setattr(decode_attention, "attention_for", counting)
    monkeypatch.setattr(extension, "write_blocks", counting_write)
    monkeypatch.setattr(extension, "rms_norm", lambda *args: normed.append(1) or real_norm(*args))
    monkeypatch.setattr(extension, "sample_categorical", lambda *args: drawn.append(1) or real_draw(*args))
    monkeypatch.setattr(extension, round_kernel, lambda *args: decided.append(1) or real_round(*args))
    with_kernels = generate_tokens(method, params, pair, ids % 10, ids, 3)
    # the attention kernel did serve calls of this run (target_only's are all of one query)
    assert any(served) or (method == "target_only" and decode_attention.kernel(1) is None)
    assert (method == "target_only") != any(copied)  # verify calls wrote by row copies; target_only by slices
    assert normed and drawn  # the norms and the draws ran in the kernels
    assert (method == "target_only") != bool(decided)  # the speculative rounds were decided in the kernel
    monkeypatch.setattr(decode_attention, "ENABLED", False)
    monkeypatch.setattr(discrete_ar, "BLOCK_WRITE_KERNEL", False)
    monkeypatch.setattr(cpu_norm, "ENABLED", False)
    monkeypatch.setattr(cpu_rounds, "ENABLED", False)
    copied.clear(), normed.clear(), drawn.clear(), decided.clear()
    without = generate_tokens(method, params, pair, ids % 10, ids, 3)
    assert not copied and not normed and not drawn and not decided
    assert torch.equal(with_kernels[0], without[0])
    assert [vars(s) for s in with_kernels[1]] == [vars(s) for s in without[1]]
    for module, switch in ((decode_attention, "ENABLED"), (discrete_ar, "BLOCK_WRITE_KERNEL"), (cpu_norm, "ENABLED"),
                           (cpu_rounds, "ENABLED"), (discrete_ar, "FUSED_LAYERS")):
        monkeypatch.setattr(module, switch, True)
    fused = generate_tokens(method, params, pair, ids % 10, ids, 3)
    assert torch.equal(fused[0], without[0])
    assert [vars(s) for s in fused[1]] == [vars(s) for s in without[1]]


def test_each_environment_builds_in_its_own_folder(monkeypatch, tmp_path):
    """Under TORCH_EXTENSIONS_DIR when set; named by this environment's torch, so that another environment
    (a CI virtualenv, a Ray runtime environment) does not rebuild the same folder in turn."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    folder = cpu_kernels._build_directory()
    assert folder.parent == tmp_path and folder.is_dir()
    assert folder.name.startswith(f"{cpu_kernels.NAME}-") and len(folder.name) == len(cpu_kernels.NAME) + 13
    assert cpu_kernels._build_directory() == folder  # the same environment: the same folder
