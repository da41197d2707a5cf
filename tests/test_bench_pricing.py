"""The arithmetic the family benches share (bench/pricing.py): no timing is asserted here, only how
costs, turns and splits are put together."""

from __future__ import annotations

import contextlib
import functools
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import pricing  # noqa: E402
from bench.pricing import (  # noqa: E402
    TimeInCalls,
    batches_of,
    efficiency_interval,
    interval_text,
    median_interval,
    per_repetition,
    ratio_interval,
    run_in_turns,
    shape_cost,
    shape_key,
    split_efficiency,
)


def test_partial_rows_are_priced_linearly_between_the_timed_row_counts():
    # batch 32: rows timed at 1, 2, 4, 8, 16, 31; a call on 12 rows lies between 8 and 16
    costs = {shape_key("verify", 5, 8): 8.0, shape_key("verify", 5, 16): 16.0, shape_key("verify", 5, 32): 40.0}
    assert shape_cost(shape_key("verify", 5, 12), costs, batch=32) == pytest.approx(12.0)
    assert shape_cost(shape_key("verify", 5, 32), costs, batch=32) == 40.0  # timed: taken as is


def test_arms_take_turns_batch_by_batch_in_a_rotating_order():
    order: list[tuple[str, int]] = []

    def run(name: str, unit: int) -> dict[str, float]:
        order.append((name, unit))
        return {"wall": 1.0, "cpu": 2.0}

    elapsed, outside = run_in_turns(["a", "b", "c"], work=[0, 1], reps=2, run=run, between=lambda: None)
    assert order == [("a", 0), ("b", 0), ("c", 0), ("b", 1), ("c", 1), ("a", 1),
                     ("c", 0), ("a", 0), ("b", 0), ("a", 1), ("b", 1), ("c", 1)]
    assert len(elapsed["a"]) == 4 and outside["a"] == elapsed["a"]  # no model calls given: nothing split off
    assert per_repetition(elapsed["a"], batches=2) == [{"wall": 2.0, "cpu": 4.0}] * 2


def test_a_timer_warms_and_times_each_part_back_to_back_and_prices_the_key_at_their_sum(monkeypatch):
    now = [0.0]  # a clock that moves only when a call runs: each call costs exactly its own seconds
    monkeypatch.setattr(pricing, "stamp", lambda: (now[0], now[0]))
    made: list[str] = []

    def call(name: str, seconds: float):
        def run() -> None:
            made.append(name)
            now[0] += seconds
        return run

    timer = pricing.InterleavedTimer({"parts": [call("a", 0.001), call("b", 0.004)], "whole": call("c", 0.002)},
                                     torch.device("cpu"), seconds=0.008, warm_seconds=0.004,
                                     grad_mode=contextlib.nullcontext)
    made.clear()  # the calibration's calls
    timer.step(2)
    # each part: untimed calls filling warm_seconds, then timed calls filling seconds, one part after the other
    assert made == ["a"] * (4 + 8) + ["b"] * (1 + 2) + ["c"] * (2 + 4)
    assert timer.costs()["cpu"] == {"parts": pytest.approx(0.005), "whole": pytest.approx(0.002)}
    # without warm_seconds a single untimed call goes before each timing, as the benches that do not ask for one had
    made.clear()
    pricing.InterleavedTimer({"whole": call("c", 0.002)}, torch.device("cpu"), seconds=0.008,
                             grad_mode=contextlib.nullcontext).step()
    assert made == ["c"] * 2 + ["c"] * (1 + 4)  # calibration (a warm-up call and one timed), then the timing


def test_a_timer_spreads_its_timings_evenly_over_the_turns(monkeypatch):
    timer = pricing.InterleavedTimer({"a": lambda: None}, torch.device("cpu"), grad_mode=contextlib.nullcontext)
    steps: list[int] = []
    monkeypatch.setattr(timer, "step", steps.append)
    for timings, turns, expected in ((5, 4, [1, 1, 1, 2]), (2, 4, [0, 1, 0, 1]), (8, 2, [4, 4])):
        steps.clear()
        between = timer.spread(timings, turns)
        for _ in range(turns):
            between()
        assert steps == expected and sum(steps) == timings


class _Head:
    def call(self) -> int:
        return 1


class _Model:
    def call(self) -> int:
        return _Head().call() + 1  # a counted call inside a counted call


def test_time_in_calls_counts_a_nested_call_once_and_restores_the_methods(monkeypatch):
    ticks = iter(range(100))
    monkeypatch.setattr(pricing, "stamp", lambda: (t := next(ticks), t))  # each reading one tick later
    originals = _Model.call, _Head.call
    with TimeInCalls({_Model: "call", _Head: "call"}) as inside:
        assert _Model().call() == 2
    # the outer call reads the clock at ticks 0 and 2 (the inner one only at 1): 2 ticks, not 2 + 1
    assert inside == {"wall": 2, "cpu": 2}
    assert (_Model.call, _Head.call) == originals


def test_split_efficiency_is_the_share_of_time_in_calls_relative_to_the_base():
    # base: 10 s of which 1 s loop (90 % in calls); arm: 5 s of which 1 s loop (80 % in calls)
    assert split_efficiency([1.0, 1.0], [5.0, 5.0], [1.0, 1.0], [10.0, 10.0]) == pytest.approx(0.8 / 0.9)
    assert split_efficiency([0.5], [5.0], [1.0], [10.0]) == pytest.approx(1.0)  # the same loop share: 1


def test_the_median_interval_takes_the_widest_order_statistics_the_binomial_coverage_allows():
    from scipy.stats import binom

    for n in range(1, 41):
        lo, hi = median_interval(range(n))  # the values are their own ranks - 1
        k = int(lo) + 1
        assert hi == n - k  # symmetric: x_(k) and x_(n+1-k)
        coverage = 1 - 2 * binom.cdf(k - 1, n, 0.5)  # P(x_(k) <= median <= x_(n+1-k))
        if n >= 5:  # at 0.9, four values or fewer give their whole range, short of the level
            assert coverage >= 0.9
        tighter = k + 1 <= (n + 1) / 2 and 1 - 2 * binom.cdf(k, n, 0.5) >= 0.9
        assert not tighter, n
    assert median_interval([5.0, 1.0, 3.0, 2.0, 4.0, 7.0, 6.0]) == (1.0, 7.0)  # 7 values: the range, 98 %
    assert median_interval(range(15)) == (3, 11)  # the 4th and 12th of 15, 96 %
    with pytest.raises(ValueError, match="at least one value"):
        median_interval([])


def test_the_median_interval_covers_a_skewed_laws_median_at_its_level_and_one_step_tighter_does_not():
    # 20,000 samples of 15 exponential draws (seed 0), median ln 2. The interval's exact coverage is 0.965, one
    # order statistic tighter 0.882; each tolerance (0.005, 0.01 under 0.9) is about 4 standard errors of a
    # 20,000-trial rate.
    import numpy as np

    draws = np.sort(np.random.default_rng(0).exponential(size=(20_000, 15)), axis=1)
    lo, hi = (int(i) for i in median_interval(range(15)))  # the 4th and 12th draws: indexes 3 and 11
    median = np.log(2)
    covered = np.mean((draws[:, lo] <= median) & (median <= draws[:, hi]))
    assert covered >= 0.965 - 0.005
    tighter = np.mean((draws[:, lo + 1] <= median) & (median <= draws[:, hi - 1]))
    assert tighter < 0.9 - 0.01  # the negative control: a k one larger misses the level (0.882 exactly)


def test_the_efficiency_interval_is_the_paired_speedups_interval_over_the_prediction():
    base = [10.0] * 7
    mine = [10.0, 8.0, 5.0, 9.0, 6.0, 7.0, 4.0]  # paired speedups 1.0 .. 2.5
    assert efficiency_interval(base, mine, 2.0) == pytest.approx((0.5, 1.25))
    assert interval_text((0.8149, 0.9251)) == "0.81-0.93"


def test_the_ratio_interval_pairs_each_repetitions_two_times():
    # The machine's state moves both runs of a repetition alike: paired, the ratios are exactly 1; pooled or sorted
    # apart, the times would spread the interval from 0.5 to 2.
    base = [10.0, 20.0, 10.0, 20.0, 10.0, 20.0, 10.0]
    assert ratio_interval(base, base) == (1.0, 1.0)
    mine = [5.0, 10.0, 4.0, 8.0, 5.0, 12.5, 8.0]  # paired ratios 2.0, 2.0, 2.5, 2.5, 2.0, 1.6, 1.25
    assert ratio_interval(base, mine) == pytest.approx((1.25, 2.5))  # seven pairs: their whole range (98 %)
    assert ratio_interval(base[:5], mine[:5]) == pytest.approx((2.0, 2.5))  # five: the whole range, short of 90 %


def test_each_arm_and_its_replay_are_neighbours_and_eff_seq_is_the_ratio_of_their_shares():
    names = pricing.with_replays(["base", "arm"])
    assert names == ["base", "base replay", "arm", "arm replay"]
    order: list[str] = []
    run_in_turns(names, work=[0], reps=3, run=lambda name, unit: order.append(name) or {"wall": 1.0, "cpu": 1.0},
                 between=lambda: None)
    for turn in range(3):  # the rotation keeps an arm next to its replay but at the wrap
        got = order[4 * turn : 4 * turn + 4]
        assert any(got[i : i + 2] == [a, f"{a} replay"] for a in ("base", "arm") for i in range(3))
    # base: replays take 0.9 of its runs; arm: 0.6, 0.8 and 0.7 (median 0.7); a slow third repetition
    # (everything twice as long) moves neither share
    runs = {"base": [10.0, 10.0, 20.0], "base replay": [9.0, 9.0, 18.0],
            "arm": [5.0, 5.0, 10.0], "arm replay": [3.0, 4.0, 7.0]}
    times = {name: [{"cpu": t} for t in ts] for name, ts in runs.items()}
    assert pricing.sequence_efficiency(times, "base", "arm", "cpu") == pytest.approx(0.7 / 0.9)
    assert pricing.sequence_speedup(times, "base", "arm", "cpu") == pytest.approx(18 / 7)  # median of 3, 2.25, 18/7


class _Lengths:
    def __init__(self, rows: int) -> None:
        self.lengths = torch.zeros(rows, dtype=torch.int64)


class _Base:
    def __init__(self, name: str, rows: int) -> None:
        self.name, self.cache = name, _Lengths(rows)


class _Stream(_Base):  # inherits its constructor: CallRecording must put back exactly what was there
    log: list = []

    def call(self, x: torch.Tensor, *, scale: int) -> torch.Tensor:
        _Stream.log.append((self.name, x.tolist(), scale, self.cache.lengths.tolist()))
        self.cache.lengths += x.shape[-1]  # a call moves its own state on, as a model call its cache
        return x * scale


def _lengths(stream: _Stream) -> torch.Tensor:
    return stream.cache.lengths


def test_a_recording_replays_the_calls_in_order_on_their_inputs_and_states():
    _Stream.log = []
    call = vars(_Stream)["call"]
    with pricing.CallRecording({_Stream: "call"}, _lengths) as recording:
        a, b = _Stream("a", 2), _Stream("b", 2)
        x = torch.tensor([[1, 2], [3, 4]])
        a.call(x, scale=2)
        x += 10  # the loop writes to an input after the call: the replay must see what the call saw
        b.call(x[:, :1], scale=3)
        a.cache.lengths[0] = 1  # a commit's crop between two calls of a: set back before a's next call
        a.call(x, scale=1)
        b.call(x, scale=1)  # b's state is as b's last call left it: nothing to set back
    run = _Stream.log
    assert "__init__" not in vars(_Stream) and vars(_Stream)["call"] is call  # the class as it was
    assert [bool(c[4]) for c in recording.calls] == [False, False, True, False]

    _Stream.log = []
    recording.replay()
    assert _Stream.log == run == [
        ("a", [[1, 2], [3, 4]], 2, [0, 0]), ("b", [[11], [13]], 3, [0, 0]),
        ("a", [[11, 12], [13, 14]], 1, [1, 2]), ("b", [[11, 12], [13, 14]], 1, [1, 1]),
    ]
    _Stream.log = []
    recording.replay()  # fresh objects each time: the same calls again
    assert _Stream.log == run


class _Box:  # a cache a model call makes and returns
    def __init__(self, rows: int) -> None:
        self.lengths = torch.zeros(rows, dtype=torch.int64)


class _Maker:
    log: list = []

    def make(self, rows: int) -> _Box:
        return _Box(rows)

    def fill(self, box: _Box, x: torch.Tensor) -> None:
        _Maker.log.append(("fill", x.tolist(), box.lengths.tolist()))
        box.lengths += 1


def _read(pair: tuple[_Box, torch.Tensor], scale: int) -> None:  # a module function taking a box inside a tuple
    box, x = pair
    _Maker.log.append(("read", (x * scale).tolist(), box.lengths.tolist()))


def test_a_recording_remakes_the_objects_calls_return_and_replays_module_functions():
    module = types.ModuleType("loop")
    module.read = _read
    maker = _Maker()  # made before the block: called as it is
    _Maker.log = []
    with pricing.CallRecording({_Maker: ("make", "fill"), module: "read"},
                               lambda o: o.lengths if isinstance(o, _Box) else None, results=(_Box,)) as recording:
        box = maker.make(2)
        x = torch.tensor([1, 2])
        maker.fill(box, x)
        box.lengths = torch.tensor([0, 1])  # the loop truncates: a new tensor, set back before the next call
        module.read((box, x), scale=3)
        x += 5
        maker.fill(box, x)
    run = _Maker.log
    assert module.read is _read and vars(_Maker)["make"] is _Maker.make and "__init__" not in vars(_Maker)
    assert [bool(c[4]) for c in recording.calls] == [False, False, True, False]

    _Maker.log = []
    recording.replay()
    assert _Maker.log == run == [("fill", [1, 2], [0, 0]), ("read", [3, 6], [0, 1]), ("fill", [6, 7], [0, 1])]
    assert box.lengths.tolist() == [1, 2]  # the replay filled a box of its own, not the run's
    _Maker.log = []
    recording.replay()
    assert _Maker.log == run

    # A bench's hook makes each call (bench/in_place.py times it and makes it again): it sees the object called,
    # in order, and the value it returns stands for the call's (the box the later calls fill).
    _Maker.log, seen = [], []

    def make(obj, call):
        seen.append(type(obj).__name__)
        return call()

    recording.replay(make)
    assert _Maker.log == run and seen == ["_Maker", "_Maker", "module", "_Maker"]


@contextlib.contextmanager
def _outputs_of(cls: type) -> Iterator[list[torch.Tensor]]:
    """Every output of ``cls.forward`` within the block, in order."""
    outputs: list[torch.Tensor] = []
    forward = cls.forward

    def logged(self, *args, **kwargs):
        outputs.append(out := forward(self, *args, **kwargs))
        return out

    cls.forward = logged
    try:
        yield outputs
    finally:
        cls.forward = forward


def test_replaying_a_speculative_batch_remakes_its_model_calls_bit_for_bit():
    # The digits pair's sd chain at batch 2: every GuidedModel.forward of the replay gives the very
    # distributions of the run's call (same inputs, same caches), so the replay makes the run's calls.
    from bench import discrete as discrete_bench
    from specray.methods.discrete.loop import GuidedModel
    from specray.models.discrete_ar import load_pair

    pair = load_pair(discrete_bench.TARGET, discrete_bench.DRAFT, "cpu")
    with _outputs_of(GuidedModel) as outputs:
        counts, _, recordings = discrete_bench.count_calls("sd", {"gamma": 4}, pair, batches_of(2, 2), seed=3)
        run = outputs[:]
        outputs.clear()
        discrete_bench.replay_batch(recordings[0], pair.device)
    assert sum(counts.shapes.values()) == len(run) == len(outputs) > 2 * 64 / 5
    assert all(torch.equal(r, o) for r, o in zip(run, outputs))
    assert sum(bool(c[4]) for c in recordings[0].calls) > 0  # the commits' crops were set back


def test_replaying_a_diffusion_batch_remakes_its_denoiser_calls():
    # spec_block with the Frozen drafter, K = 12, batch 2: the UNet keeps no state, so the replay calls
    # the pair's own Denoisers on the recorded inputs and gets the run's outputs.
    from bench import diffusion as diffusion_bench
    from specray.models.diffusion import Denoiser, load_pair

    pair = load_pair(diffusion_bench.TARGET, diffusion_bench.DRAFT, "cpu")
    params = diffusion_bench.arm_params("spec_block", "frozen", num_steps=12, gamma=3)
    with _outputs_of(Denoiser) as outputs:
        counts, _, recordings = diffusion_bench.count_calls("spec_block", params, pair, batches_of(2, 2), seed=5)
        run = outputs[:]
        outputs.clear()
        pricing.replay_time(recordings[0], pair.device)
    assert sum(counts.shapes.values()) == len(run) == len(outputs) >= 12 / 4
    assert all(torch.equal(r, o) for r, o in zip(run, outputs))
    assert recordings[0].objects == [pair.target]  # made before the recording: called as it is


def test_replaying_a_continuous_batch_remakes_its_calls_on_caches_of_its_own():
    # CSpD in paper mode at batch 2: the replay makes its own content caches by its new_cache calls, sets their
    # lengths back where the loop truncated them after a rejection, and gets every query and head chain of the run.
    from bench import continuous as continuous_bench
    from specray.methods.continuous import loop
    from specray.models.continuous_ar import ContentCache, ContinuousAR, load_pair

    pair = load_pair(continuous_bench.TARGET, continuous_bench.DRAFT, "cpu")
    outputs: list[torch.Tensor] = []
    query, head_chain = ContinuousAR.query, loop.head_chain

    def logged_query(self, *args):
        outputs.append(out := query(self, *args))
        return out

    def logged_chain(*args):
        outputs.append((out := head_chain(*args)).x0)
        return out

    ContinuousAR.query, loop.head_chain = logged_query, logged_chain
    try:
        recordings = continuous_bench.record_calls("cspd", {"mode": "paper", "gamma": 4}, pair, batches_of(2, 2), 1)
        run = outputs[:]
        outputs.clear()
        pricing.replay_time(recordings[0], pair.device, torch.no_grad)
    finally:
        ContinuousAR.query, loop.head_chain = query, head_chain
    assert len(run) == len(outputs) > 16 / 4
    assert all(torch.equal(r, o) for r, o in zip(run, outputs))
    calls = recordings[0].calls
    assert any(c[4] for c in calls)  # a truncation was set back
    assert sum(isinstance(o, pricing._Returned) for o in recordings[0].objects) == 2  # target's and draft's cache
    assert {c[1] for c in calls} == {"new_cache", "append_tokens", "query", "head_chain"}
    assert not any(isinstance(o, ContentCache) for o in recordings[0].objects)


@pytest.mark.parametrize("growing", [True, False])
def test_the_discrete_bench_prices_every_call_shape_at_the_tokens_rows_and_slots_its_key_names(growing, monkeypatch):
    # A GPT call's cost grows with the cache slots it attends over, which in a speculative batch follow its
    # furthest row; every shape the counting pass finds (sd on the draft GPT, the head's chain and the eagle25
    # tree, batch 3 with its tail rounds on fewer rows) is timed on a call that feeds that many tokens on that
    # many rows and attends over exactly that many slots: with growing caches (every cache, however small) one
    # holding no more, with the default size bound (at batch 3 every cache under it) a static one, all its slots;
    # the verify calls' on a static one either way, as the loop's fits the last-level cache (few_reads).
    from bench import discrete as discrete_bench
    from bench.pricing import parse_shape
    from specray.methods.discrete.loop import GuidedModel
    from specray.models import discrete_ar
    from specray.models.discrete_ar import load_pair

    if growing:
        monkeypatch.setattr(discrete_ar, "GROWING_CACHE_MIN_BYTES", 0)
    monkeypatch.setattr(discrete_ar, "last_level_cache_bytes", lambda: 64 << 20)

    pairs = {name: load_pair(discrete_bench.TARGET, name, "cpu")
             for name in (discrete_bench.DRAFT, discrete_bench.HEAD)}
    arms = [("sd", {"gamma": 4}, discrete_bench.DRAFT), ("sd", {"gamma": 4}, discrete_bench.HEAD),
            ("sd", {"tree": "eagle25"}, discrete_bench.HEAD)]
    counts = [discrete_bench.count_calls(method, params, pairs[draft], batches_of(3, 3), seed=1)[0]
              for method, params, draft in arms]
    shapes = discrete_bench.shapes_to_time(counts, batch=3)
    assert {parse_shape(key)[2] for key in shapes} >= {16, 32, 48, 64, 80, 96}  # the trees' spans pass the image
    assert any(parse_shape(key)[-1] < 3 for key in shapes)  # tail rounds on fewer rows
    gen = torch.Generator().manual_seed(0)
    with discrete_bench.generation_context():
        for key in shapes:
            role, tokens, slots, rows = parse_shape(key)
            call = discrete_bench._call_of_shape(role, tokens, slots, rows, 3, pairs, 4, gen)
            stream = call.func.__self__
            assert discrete_bench.call_size(stream, *call.args, **call.keywords) == (tokens, slots), key
            assert call.args[0].shape[0] == rows, key
            call()
            if isinstance(stream, GuidedModel):
                cache = stream.cache
                # the speculative loop's target cache (its verify calls) stays whole, as that loop keeps it
                grows = growing and (role == "draft" or tokens == 1)
                assert (cache.slots is not None) == grows, key
                assert cache.keys[0].shape[1] == (slots if grows else cache.max_len), key


def test_making_each_call_again_in_place_leaves_the_replay_the_runs_calls():
    # bench/in_place.py makes each recorded call again right after itself, its cache lengths set back first: the
    # repeats give the call's own distributions and the calls after them still get the run's (sd, batch 2).
    from bench import discrete as discrete_bench
    from bench import in_place
    from specray.methods.discrete.loop import GuidedModel
    from specray.models.discrete_ar import load_pair

    pair = load_pair(discrete_bench.TARGET, discrete_bench.DRAFT, "cpu")
    _, _, recordings = discrete_bench.count_calls("sd", {"gamma": 4}, pair, batches_of(2, 2), seed=3)
    with _outputs_of(GuidedModel) as outputs:
        discrete_bench.replay_batch(recordings[0], pair.device)
        replayed = outputs[:]
        outputs.clear()
        lengths = []  # each call's cache lengths as it starts
        forward = GuidedModel.forward

        def noted(self, *args, **kwargs):
            lengths.append(self.cache.lengths.tolist())
            return forward(self, *args, **kwargs)

        GuidedModel.forward = noted
        try:
            role_of = functools.partial(discrete_bench.model_role, pair=pair)
            in_order, again = in_place.time_in_place(recordings[0], role_of, again=2)
        finally:
            GuidedModel.forward = forward
    assert len(outputs) == 3 * len(replayed)
    assert all(torch.equal(r, o) for r, o in zip(replayed, outputs[::3]))
    assert all(torch.equal(o, a) for o, a in zip(outputs[::3], outputs[1::3]))
    assert lengths[::3] == lengths[1::3] == lengths[2::3]  # each repeat on the state its call started from
    assert set(in_order) == set(again) == {"target", "draft"} and min(again.values()) > 0
