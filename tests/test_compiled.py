"""The compiled paths (job field ``compile: true``): validation, wiring, and the same tokens (discrete)
or images and acceptance counts (continuous) as the eager path. Speed is measured in
``bench/compiled.py``, not here."""

from __future__ import annotations

import pytest
import torch

from specray.methods.discrete.loop import generate_tokens
from specray.models.compiled import compile_continuous_pair, compile_pair
from specray.models.discrete_ar import DiscreteGPT, GPTConfig, load_pair
from specray.models.discrete_train import save_model
from specray.spec import SpecError, load_job


def job(tmp_path, **fields) -> dict:
    arm = {"family": "discrete_ar", "target": "digits-gpt-target", "draft": "digits-gpt-draft"}
    return {"job_id": "compiled", "seed": 0, "output": str(tmp_path / "out"), "conditions": {"per_class": 1},
            "batch_size": 2, "arms": [{"name": "target_only", "method": "target_only", **arm}],
            "eval": {"fid": False}, **fields}


def test_compile_is_validated_and_part_of_the_fingerprint(tmp_path):
    with pytest.raises(SpecError, match=r"^compile: must be true or false, got 'yes'"):
        load_job(job(tmp_path, compile="yes"))
    diffusion = {"name": "ddpm", "family": "diffusion", "method": "target_only", "target": "digits-ddpm",
                 "draft": None}
    with pytest.raises(SpecError, match=r"^compile: arms\[1\] \('ddpm'\) is family 'diffusion', which has no "
                                        r"compiled path; families with one: discrete_ar, continuous_ar"):
        load_job({**job(tmp_path, compile=True), "arms": job(tmp_path)["arms"] + [diffusion]})
    eager, explicit, compiled = (load_job(job(tmp_path, **f)) for f in ({}, {"compile": False}, {"compile": True}))
    assert compiled.compile and not eager.compile
    # compile: false leaves the fingerprint of existing runs alone; true makes it another run
    assert eager.fingerprint() == explicit.fingerprint() != compiled.fingerprint()
    assert load_job(compiled.to_dict()).fingerprint() == compiled.fingerprint()


def test_the_actor_compiles_the_pair_of_a_compile_job(tmp_path):
    from specray.runtime.actor import ShardWorker

    spec = load_job(job(tmp_path, compile=True))
    pair = ShardWorker(spec)._pair(spec.arms[0].group_key)
    assert pair.target.compiled_decode is not None and pair.draft.compiled_decode is not None
    eager = ShardWorker(load_job(job(tmp_path)))._pair(spec.arms[0].group_key)
    assert eager.target.compiled_decode is None
    mar = {"name": "cspd", "family": "continuous_ar", "method": "cspd", "target": "digits-mar-target",
           "draft": "digits-mar-draft"}
    spec = load_job({**job(tmp_path, compile=True), "arms": [mar]})
    pair = ShardWorker(spec)._pair(spec.arms[0].group_key)
    assert pair.target.compiled_head is not None and pair.draft.compiled_head is not None


def tiny_pair(tmp_path, device="cpu"):
    paths = []
    for name, layers, seed in (("target", 2, 0), ("draft", 1, 1)):
        torch.manual_seed(seed)
        model = DiscreteGPT(GPTConfig(dim=32, n_layer=layers, n_head=2, grid_size=4))
        paths.append(save_model(model, tmp_path / f"{name}.safetensors", {}))
    return load_pair(str(paths[0]), str(paths[1]), device)


@pytest.mark.slow
def test_compiled_decode_gives_the_eager_tokens(tmp_path):
    """target_only and sd (CFG 1.5, gamma 3), batch 3 with one row finishing early, 2 seeds: the same
    tokens and statistics from the compiled path as from the eager one (random-weight 2-layer target,
    1-layer draft; about a minute, most of it compiling the 4 call shapes)."""
    eager, compiled = tiny_pair(tmp_path), tiny_pair(tmp_path)
    compile_pair(compiled)
    labels, ids = torch.tensor([0, 3, 7]), torch.tensor([5, 6, 7])
    for method, params in (("target_only", {}), ("sd", {"gamma": 3})):
        for seed in (0, 1):
            tokens_e, stats_e = generate_tokens(method, params, eager, labels, ids, seed)
            tokens_c, stats_c = generate_tokens(method, params, compiled, labels, ids, seed)
            assert torch.equal(tokens_e, tokens_c), (method, seed)
            assert stats_e == stats_c
    # the compiled step really ran (a graph per call shape), not the eager fallback
    assert compiled.target.compiled_decode is not None
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2


@pytest.mark.slow
def test_the_compiled_step_makes_the_probabilities_in_its_graph(tmp_path, monkeypatch):
    """A decode step asked for CfgSoftmax(1.5) (CFG rows 4, 1 and 3 tokens): the compiled function is called with
    it and returns its probabilities, equal to the eager step's within float32 rounding (the kernels differ); with
    COMPILED_SOFTMAX off the graph returns logits and Python makes the same probabilities. Negative control: the
    unguided softmax of the same call is far from them."""
    from specray.models import discrete_ar
    from specray.models.discrete_ar import CfgSoftmax

    eager, compiled = tiny_pair(tmp_path), tiny_pair(tmp_path)
    compile_pair(compiled)
    target = compiled.target
    asked = []
    graph = target.compiled_decode
    target.compiled_decode = lambda *args, **kwargs: asked.append(kwargs.get("softmax")) or graph(*args, **kwargs)
    softmax = CfgSoftmax(1.5)
    for n in (1, 3):
        tokens = torch.randint(0, target.config.vocab_size, (4, n), generator=torch.Generator().manual_seed(n))
        positions = (5 + torch.arange(n)).expand(4, n).contiguous()
        calls = {}
        for name, model in (("eager", eager.target), ("compiled", target)):
            cache = model.new_cache(4)
            cache.lengths.fill_(5)
            with torch.inference_mode():
                calls[name] = model.forward_step(tokens, positions, cache, prefix=False, softmax=softmax)
                calls[name + " logits"] = model.forward_step(tokens, positions, cache, prefix=False)
        with monkeypatch.context() as patch, torch.inference_mode():
            patch.setattr(discrete_ar, "COMPILED_SOFTMAX", False)
            cache = target.new_cache(4)
            cache.lengths.fill_(5)
            calls["after the graph"] = target.forward_step(tokens, positions, cache, prefix=False, softmax=softmax)
        # the guards kept tell the call shapes and the softmax argument apart (none on the model's own attributes)
        assert calls["compiled"].shape == (2, n, target.config.vocab_size)
        assert calls["compiled logits"].shape == (4, n, target.config.vocab_size)
        torch.testing.assert_close(calls["compiled logits"], calls["eager logits"], rtol=0, atol=1e-5)
        torch.testing.assert_close(calls["compiled"], calls["eager"], rtol=0, atol=1e-6)
        torch.testing.assert_close(calls["after the graph"], calls["compiled"], rtol=0, atol=1e-6)
        torch.testing.assert_close(calls["compiled"].sum(-1), torch.ones(2, n), rtol=0, atol=1e-6)
        unguided = CfgSoftmax(None)(calls["compiled logits"])[:2]
        assert (unguided - calls["compiled"]).abs().max() > 1e-3
    # per call shape: the graph asked for the probabilities, for the logits, and for the logits with the switch off
    assert asked == [softmax, None, None] * 2


def test_a_step_that_fails_to_compile_runs_eager_with_a_warning(tmp_path, monkeypatch, caplog):
    import specray.models.compiled as compiled_module

    def failing_compile(fn, **options):
        def compiled(*args, **kwargs):
            raise torch._dynamo.exc.Unsupported("no C++ compiler on this node")
        return compiled

    monkeypatch.setattr(compiled_module.torch, "compile", failing_compile)
    eager, broken = tiny_pair(tmp_path), tiny_pair(tmp_path)
    compile_pair(broken)
    labels, ids = torch.tensor([1, 2]), torch.tensor([0, 1])
    with caplog.at_level("WARNING", logger="specray.models.compiled"):
        tokens, _ = generate_tokens("sd", {"gamma": 3}, broken, labels, ids, 0)
    assert torch.equal(tokens, generate_tokens("sd", {"gamma": 3}, eager, labels, ids, 0)[0])
    assert "torch.compile failed for the decode step (Unsupported: no C++ compiler on this node)" in caplog.text
    assert broken.target.compiled_decode == broken.target.decode_all_rows


@pytest.mark.slow
def test_a_call_shape_past_the_recompile_limit_runs_eager_and_says_so_once(tmp_path, caplog):
    """Compiling raises torch's recompile limit (never lowers it); with the limit at 1 graph, the first call shape
    compiles, the next ones run eager with one warning (the eager values exactly), and the model stays compiled."""
    from specray.models.compiled import RECOMPILE_LIMIT

    config = torch._dynamo.config  # set and restored by hand: monkeypatch's undo deletes a config attribute
    saved = config.recompile_limit
    torch._dynamo.reset()  # the decode step's graphs counted from none
    try:
        eager, compiled = tiny_pair(tmp_path), tiny_pair(tmp_path)
        config.recompile_limit = 8
        compile_pair(compiled)
        assert config.recompile_limit == RECOMPILE_LIMIT
        config.recompile_limit = RECOMPILE_LIMIT + 36
        compile_pair(tiny_pair(tmp_path))
        assert config.recompile_limit == RECOMPILE_LIMIT + 36  # a higher limit stays
        config.recompile_limit = 1

        def step(model, n):
            cache = model.new_cache(4)
            cache.lengths.fill_(5)
            tokens = torch.randint(0, model.config.vocab_size, (4, n), generator=torch.Generator().manual_seed(n))
            with torch.inference_mode():
                return model.forward_step(tokens, (5 + torch.arange(n)).expand(4, n).contiguous(), cache,
                                          prefix=False)

        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        with caplog.at_level("WARNING", logger="specray.models.compiled"):
            first = step(compiled.target, 1)
            past = [step(compiled.target, n) for n in (3, 5)]
        torch.testing.assert_close(first, step(eager.target, 1), rtol=0, atol=1e-5)
        for n, logits in zip((3, 5), past):
            assert torch.equal(logits, step(eager.target, n))  # the eager call itself
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs + 1
        assert caplog.text.count("torch.compile reached its recompile limit") == 1
        assert "(torch._dynamo.config.recompile_limit = 1) for the decode step" in caplog.text
        assert compiled.target.compiled_decode != compiled.target.decode_all_rows  # not given up
    finally:
        config.recompile_limit = saved
        torch._dynamo.reset()  # later tests compile under the restored limit


def _counts(stats) -> dict:
    """A sample's statistics without the float means in ``extra`` (last-bit differences of the head)."""
    extra = {k: v for k, v in stats.extra.items() if not isinstance(v, float)}
    return {**vars(stats), "extra": extra}


@pytest.mark.slow
def test_compiled_head_gives_the_eager_images_and_acceptance_counts():
    """target_only and cspd (gamma 4) on the digits-mar presets, batch 3 and batch 1, 2 seeds: the same
    uint8 images and acceptance counts from the compiled heads as from the eager ones, and the float
    means within 1e-4 (about half a minute, most of it compiling 4 graphs: 2 heads x one row / more)."""
    from specray.methods.continuous.loop import run_batch
    from specray.models.continuous_ar import load_pair as load_continuous_pair

    eager = load_continuous_pair("digits-mar-target", "digits-mar-draft", "cpu")
    compiled = load_continuous_pair("digits-mar-target", "digits-mar-draft", "cpu")
    compile_continuous_pair(compiled)
    torch._dynamo.utils.counters.clear()
    for labels, ids in ((torch.tensor([0, 3, 7]), torch.tensor([5, 6, 7])), (torch.tensor([4]), torch.tensor([9]))):
        for method, params in (("target_only", {}), ("cspd", {"gamma": 4})):
            for seed in (0, 1):
                out_e = run_batch(method, params, eager, labels, ids, seed)
                out_c = run_batch(method, params, compiled, labels, ids, seed)
                assert torch.equal(out_e.images, out_c.images), (method, seed, labels)
                assert [_counts(s) for s in out_e.stats] == [_counts(s) for s in out_c.stats]
                for s_e, s_c in zip(out_e.stats, out_c.stats):
                    floats = [k for k, v in s_e.extra.items() if isinstance(v, float)]
                    assert all(s_c.extra[k] == pytest.approx(s_e.extra[k], rel=1e-4) for k in floats)
    # the compiled heads really ran (one graph for one row, one for more, per model), not the fallback
    assert compiled.target.compiled_head is not compiled.target.head
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2


@pytest.mark.slow
def test_a_mar_release_compiles_its_diffloss_net_with_the_eager_images():
    """The official-layout MAR fixture (random weights, KL decoder): target_only and cspd, 3 samples."""
    from specray.families import format_options
    from specray.methods.continuous.loop import run_batch
    from specray.models.continuous_ar import load_pair as load_continuous_pair
    from tests.checkpoint_fixtures import mar_draft, mar_target

    eager, compiled = (load_continuous_pair(mar_target(), mar_draft(), "cpu") for _ in range(2))
    compile_continuous_pair(compiled)
    params = format_options("continuous_ar", mar_target()).sampling_defaults() | {"sample_steps": 10}
    labels, ids = torch.tensor([1, 2, 5]), torch.arange(3)
    for method in ("target_only", "cspd"):
        out_e, out_c = (run_batch(method, params, pair, labels, ids, 0) for pair in (eager, compiled))
        assert torch.equal(out_e.images, out_c.images), method
        assert [_counts(s) for s in out_e.stats] == [_counts(s) for s in out_c.stats]
    assert compiled.target.compiled_head is not compiled.target.head_net


def test_a_head_that_fails_to_compile_runs_eager_with_a_warning(monkeypatch, caplog):
    import specray.models.compiled as compiled_module
    from specray.methods.continuous.loop import run_batch
    from specray.models.continuous_ar import load_pair as load_continuous_pair

    def failing_compile(fn, **options):
        def compiled(*args):
            raise torch._dynamo.exc.Unsupported("no C++ compiler on this node")
        return compiled

    monkeypatch.setattr(compiled_module.torch, "compile", failing_compile)
    eager = load_continuous_pair("digits-mar-target", "digits-mar-draft", "cpu")
    broken = load_continuous_pair("digits-mar-target", "digits-mar-draft", "cpu")
    compile_continuous_pair(broken)
    labels, ids = torch.tensor([1, 2]), torch.tensor([0, 1])
    with caplog.at_level("WARNING", logger="specray.models.compiled"):
        images = run_batch("cspd", {"gamma": 4}, broken, labels, ids, 0).images
    assert torch.equal(images, run_batch("cspd", {"gamma": 4}, eager, labels, ids, 0).images)
    assert "torch.compile failed for the diffusion head (Unsupported: no C++ compiler on this node)" in caplog.text
    assert broken.target.compiled_head is broken.target.head and broken.draft.compiled_head is broken.draft.head
