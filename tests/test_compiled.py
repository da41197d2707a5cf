"""The compiled decode path (job field ``compile: true``): validation, wiring, and the same tokens
as the eager path. Speed is measured in ``bench/compiled.py``, not here."""

from __future__ import annotations

import pytest
import torch

from specray.methods.discrete.loop import generate_tokens
from specray.models.compiled import compile_pair
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
                                        r"compiled decode path; families with one: discrete_ar"):
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


def test_a_step_that_fails_to_compile_runs_eager_with_a_warning(tmp_path, monkeypatch, caplog):
    import specray.models.compiled as compiled_module

    def failing_compile(fn, **options):
        def compiled(*args):
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
