"""torch-fidelity's pass over an arm's images recalls the streamed pass's features: same report, bit for bit."""

from __future__ import annotations

import contextlib

import pytest
import torch

from specray.eval import forward_memo, reduce
from specray.eval.forward_memo import ForwardMemo
from specray.eval.reduce import reduce_run
from tests.eval_synthetic import SyntheticArm, write_run


def _reduce(root, monkeypatch, memo_factory):
    """reduce_run of ``root`` with the memo ``memo_factory`` makes (None: no memo); the report and the memos made."""
    memos = []

    def second_pass_memo(extractor, reference_images, options):
        if memo_factory is None:
            return contextlib.nullcontext()

        @contextlib.contextmanager
        def active():
            memo = memo_factory(options)
            memos.append(memo)
            monkeypatch.setattr(forward_memo, "_active", memo)
            try:
                yield memo
            finally:
                monkeypatch.setattr(forward_memo, "_active", None)

        return active()

    monkeypatch.setattr(reduce, "_second_pass_memo", second_pass_memo)
    return reduce_run(str(root), print_table=False), memos


def _fids(report):
    return {arm["arm"]: (arm["fid"]["value"], arm["fid"]["streaming"], arm["fid"]["source"]) for arm in report["arms"]}


@pytest.fixture(scope="module")
def run_root(tmp_path_factory):
    """2 arms of 520 digits, shards of 256 rows (batch 64 x 4): two of each arm's three shards fill whole batches of
    the extractor's 256, the last one (8 rows) does not."""
    root = tmp_path_factory.mktemp("memo") / "run"
    write_run(str(root), [SyntheticArm("target_only"), SyntheticArm("sd", method="sd", image_offset=300)],
              per_class=52, batch_size=64, shard_batches=4, eval_options={"plots": False})
    return root


def test_recalled_features_give_the_report_computing_them_gives(run_root, monkeypatch):
    plain, _ = _reduce(run_root, monkeypatch, None)
    memoised, memos = _reduce(run_root, monkeypatch, lambda options: ForwardMemo(["fc1"], options.image_budget_bytes))
    # at least each arm's two whole batches (the synthetic arms' digits also fill some of the reference's batches)
    assert len(memos) == 2 and all(memo.recalled >= 2 for memo in memos)
    assert all(source == "torch_fidelity.calculate_metrics" for _, _, source in _fids(plain).values())
    assert _fids(memoised) == _fids(plain)  # exact float equality: the same bits


def test_a_memo_that_recalls_the_wrong_batch_changes_the_fid(run_root, monkeypatch):
    """Negative control: keyed without the batch's bytes, every arm's second batch gets its first batch's
    features, and torch-fidelity's FID moves, so the equality above is a test of what was recalled."""

    class Careless(ForwardMemo):
        @staticmethod
        def key(batch, model):
            return (*model, tuple(batch.shape))

    plain, _ = _reduce(run_root, monkeypatch, None)
    careless, memos = _reduce(run_root, monkeypatch, lambda options: Careless(["fc1"], options.image_budget_bytes))
    assert all(memo.recalled >= 1 for memo in memos)
    assert all(careless_fid[0] != plain_fid[0] for careless_fid, plain_fid in zip(_fids(careless).values(),
                                                                               _fids(plain).values()))


def test_the_memo_keeps_only_its_layers_within_its_budget():
    batch = torch.zeros(4, 3, 8, 8, dtype=torch.uint8)
    memo = ForwardMemo(["fc1"], max_bytes=4 * 8 * 4)  # one batch of [4, 8] float32
    outputs = {"fc1": torch.ones(4, 8), "logits": torch.ones(4, 10)}
    memo.keep(memo.key(batch, ("m",)), outputs)
    assert memo.bytes == 128 and memo.recall(memo.key(batch, ("m",)), ["fc1"]) is not None
    assert memo.recall(memo.key(batch, ("m",)), ["fc1", "logits"]) is None  # logits were not kept
    assert memo.recall(memo.key(batch, ("other model",)), ["fc1"]) is None
    other = batch.clone()
    other[0, 0, 0, 0] = 1
    memo.keep(memo.key(other, ("m",)), outputs)  # over the budget: not kept
    assert memo.bytes == 128 and memo.recall(memo.key(other, ("m",)), ["fc1"]) is None
    assert ForwardMemo.key(batch.to("meta"), ("m",)) is None  # not on the CPU: computed again
    assert ForwardMemo.key(batch.float(), ("m",)) is None  # not uint8 images
