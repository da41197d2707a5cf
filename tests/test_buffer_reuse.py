"""Reused cache buffers (specray.models.buffer_reuse): zeroed, never shared, bounded, and the samples unchanged."""

import torch

from specray.methods.discrete.loop import generate_tokens
from specray.models import buffer_reuse
from specray.models.discrete_ar import _grown, kv_slots, load_pair

CPU = torch.device("cpu")


def _zeros(*shape):
    return buffer_reuse.zeros(*shape, dtype=torch.float32, device=CPU)


def test_outside_a_run_every_buffer_is_fresh():
    first = _zeros(3, 4)
    first.fill_(1.0)
    del first
    assert torch.equal(_zeros(3, 4), torch.zeros(3, 4))


def test_a_run_reuses_the_last_runs_buffers_zeroed_again():
    with buffer_reuse.reusing():
        a, b = _zeros(3, 4), _zeros(3, 4)
        a.fill_(1.0), b.fill_(2.0)
        pointers = {a.data_ptr(), b.data_ptr()}
        assert len(pointers) == 2  # two live buffers of one shape are two buffers
        del a, b
    with buffer_reuse.reusing():
        c, d = _zeros(3, 4), _zeros(3, 4)
        assert {c.data_ptr(), d.data_ptr()} == pointers
        assert torch.equal(c, torch.zeros(3, 4)) and torch.equal(d, torch.zeros(3, 4))
        assert c.is_contiguous() and c.dtype == torch.float32


def test_a_run_takes_a_shapes_buffers_in_the_order_the_last_run_took_them():
    """The same requests in the same order get the same addresses in the same places (a CUDA graph's static inputs:
    a cache per layer, all of one shape). Handed out last-taken first, the second run's would come reversed."""
    def run():
        with buffer_reuse.reusing():
            return [_zeros(3, 4).data_ptr() for _ in range(4)]

    first = run()
    assert len(set(first)) == 4
    assert run() == first
    assert run() == first


def test_off_the_cpu_only_static_buffers_are_pooled():
    """On another device (meta here: no GPU in CI) a static buffer comes back in the next run; others never enter
    the pool, whose memory the device's own allocator reuses."""
    meta = torch.device("meta")
    buffer_reuse._pool.free = {}
    with buffer_reuse.reusing():
        static = buffer_reuse.zeros(4, dtype=torch.float32, device=meta, static=True)
        buffer_reuse.zeros(5, dtype=torch.float32, device=meta)
        storage = static.untyped_storage()._cdata
        del static
    assert [key[0] for key in buffer_reuse._pool.free] == [(4,)]
    with buffer_reuse.reusing():
        again = buffer_reuse.zeros(4, dtype=torch.float32, device=meta, static=True)
        assert again.untyped_storage()._cdata == storage and again.device == meta


def test_a_compiled_steps_caches_keep_their_addresses_from_batch_to_batch(monkeypatch):
    """A compiled model's caches (keys, values and lengths: a CUDA graph's static inputs) are the previous batch's
    buffers in the same places, batch after batch of a job's arms in turn; the samples are unchanged. The compiled
    step stands in as the eager one (new_cache only asks whether the model has one); seed 5, batches of 2."""
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    labels, ids = torch.tensor([3, 8]), torch.tensor([0, 1])
    eager = [generate_tokens(method, {"gamma": 3}, pair, labels, ids, seed=5)[0] for method in ("sd", "cool_sd")]
    addresses: list[list[int]] = []
    new_cache = type(pair.target).new_cache

    def recorded(model, *args, **kwargs):
        cache = new_cache(model, *args, **kwargs)
        addresses.append([t.data_ptr() for t in (*cache.keys, *cache.values, cache.lengths)])
        return cache

    for model in (pair.target, pair.draft):
        monkeypatch.setattr(model, "compiled_decode", model.decode_all_rows)
    monkeypatch.setattr(type(pair.target), "new_cache", recorded)
    runs = [generate_tokens(method, {"gamma": 3}, pair, labels, ids, seed=5)[0] for method in ("sd", "cool_sd", "sd")]
    assert [torch.equal(tokens, eager[i % 2]) for i, tokens in enumerate(runs)] == [True] * 3
    target, draft = addresses[0::2], addresses[1::2]  # each run makes the target's cache, then the draft's
    assert len(target) == len(draft) == 3
    assert target[1:] == [target[0]] * 2 and draft[1:] == [draft[0]] * 2
    assert len(set(target[0] + draft[0])) == len(target[0]) + len(draft[0])  # no two caches share a buffer


def test_a_buffer_whose_view_outlived_its_run_is_not_handed_out():
    with buffer_reuse.reusing():
        kept = kv_slots(2, max_len=16, n_head=2, head_dim=4, like=torch.zeros(1))[0]  # a view of the buffer
        kept.fill_(5.0)
    with buffer_reuse.reusing():
        fresh = kv_slots(2, max_len=16, n_head=2, head_dim=4, like=torch.zeros(1))
        assert fresh.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
        assert torch.equal(kept, torch.full_like(kept, 5.0))  # the kept view is left alone


def test_empty_hands_out_an_earlier_runs_buffer_as_it_is():
    with buffer_reuse.reusing():
        dirty = buffer_reuse.empty(3, 4, dtype=torch.float32, device=CPU)
        dirty.fill_(7.0)
        pointer = dirty.data_ptr()
        del dirty
    with buffer_reuse.reusing():
        again = buffer_reuse.empty(3, 4, dtype=torch.float32, device=CPU)
        assert again.data_ptr() == pointer and torch.equal(again, torch.full((3, 4), 7.0))
        del again
    with buffer_reuse.reusing():
        zeroed = _zeros(3, 4)
        assert zeroed.data_ptr() == pointer and torch.equal(zeroed, torch.zeros(3, 4))  # zeros zeroes it again


def test_a_grown_cache_in_an_earlier_runs_buffer_holds_its_slots_and_zeros():
    """A growing cache's new slots are zeroed by _grown itself (its buffer is not zeroed first): the held slots are the
    old ones, the rest zero, in a buffer an earlier run left full of NaN. Negative control (run by hand): a _grown that
    does not zero the new slots leaves the NaN and fails."""
    shape = {"n_head": 2, "head_dim": 4, "like": torch.zeros(1)}
    with buffer_reuse.reusing():
        left = kv_slots(3, max_len=32, **shape)
        left.fill_(float("nan"))
        pointer = left.untyped_storage().data_ptr()
        del left
    with buffer_reuse.reusing():
        old = kv_slots(3, max_len=16, **shape)
        old.copy_(torch.randn(old.shape, generator=torch.Generator().manual_seed(0)))
        new = _grown(old, 32)
        assert new.untyped_storage().data_ptr() == pointer  # the NaN buffer came back
        assert new.shape == (3, 32, 2, 4) and new.stride() == kv_slots(3, max_len=32, **shape).stride()
        assert torch.equal(new[:, :16], old)
        assert torch.equal(new[:, 16:], torch.zeros(3, 16, 2, 4))


def test_a_buffer_no_run_takes_is_dropped_after_keep_idle_runs():
    with buffer_reuse.reusing():
        kept = _zeros(5)
        pointer = kept.data_ptr()
        del kept
    for _ in range(buffer_reuse.KEEP_IDLE_RUNS):  # other shapes: the (5,) buffer waits
        with buffer_reuse.reusing():
            _zeros(7)
    assert {key[0] for key in buffer_reuse._pool.free} == {(5,), (7,)}
    with buffer_reuse.reusing():
        assert _zeros(5).data_ptr() == pointer  # still there after KEEP_IDLE_RUNS idle runs
    for _ in range(buffer_reuse.KEEP_IDLE_RUNS + 1):
        with buffer_reuse.reusing():
            _zeros(7)
    assert [key[0] for key in buffer_reuse._pool.free] == [(7,)]  # one more idle run: dropped


def test_nested_runs_belong_to_the_outer_one():
    with buffer_reuse.reusing():
        with buffer_reuse.reusing():
            inner = _zeros(6)
        assert buffer_reuse._pool.active  # the inner exit did not end the run
        inner_pointer = inner.data_ptr()
        del inner
    with buffer_reuse.reusing():
        assert _zeros(6).data_ptr() == inner_pointer


def _pooled_pointers(idle_runs: int | None = None) -> set[int]:
    """Buffers in the pool (only those ``idle_runs`` runs untaken, if given)."""
    return {buffer.data_ptr() for buffers in buffer_reuse._pool.free.values() for buffer, idle in buffers
            if idle_runs is None or idle == idle_runs}


def test_samples_are_the_same_with_reused_caches():
    """Runs of several arms and batch sizes, one after another, reuse each other's caches; every sample
    equals a run on fresh caches (batches of 3 and 2, seed 11, compared bit for bit)."""
    pair = load_pair("digits-gpt-target", "digits-gpt-draft", "cpu")
    # Batch-major as an actor runs them. The caches grow by 16 slots (discrete_ar.KVCache.reserve), so
    # target_only's (up to 64 slots) and sd's and cool_sd's (up to 80) share their first sizes.
    runs = [("target_only", {}, 3), ("sd", {"gamma": 3}, 3), ("cool_sd", {"gamma": 3}, 3)] * 2 + [("sd", {"gamma": 3}, 2)]

    def generate(method, params, batch):
        labels = torch.arange(batch) % 10
        return generate_tokens(method, params, pair, labels, torch.arange(batch) + 40, seed=11)

    fresh = []
    for method, params, batch in runs:
        buffer_reuse._pool.free = {}  # no buffer to reuse
        fresh.append(generate(method, params, batch))
    buffer_reuse._pool.free = {}
    reused_runs = 0
    for (method, params, batch), (tokens, stats) in zip(runs, fresh):
        before = _pooled_pointers()
        reused_tokens, reused_stats = generate(method, params, batch)
        reused_runs += bool(before & _pooled_pointers(idle_runs=0))  # this run took an earlier run's buffer
        assert torch.equal(reused_tokens, tokens), (method, batch)
        assert repr(reused_stats) == repr(stats)
    assert reused_runs == 5  # the runs of 3 rows after the first; not the run of 2 rows
