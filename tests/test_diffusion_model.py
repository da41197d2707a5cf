"""The DDPM model side and the batched loop on a real diffusers UNet.

Loop tests use a small randomly initialised UNet (no weights needed); the preset test
runs only where the trained weights are present (``specray train digits-ddpm``).
"""

from __future__ import annotations

import pytest
import torch

from specray.families import family
from specray.methods.diffusion import loop as diffusion_loop
from specray.methods.params import ParamError
from specray.models.diffusion import Denoiser, build_unet, gaussian_steps, make_scheduler
from specray.models.pair import ModelPair

CONFIG = {"sample_size": 8, "num_classes": 10, "num_train_timesteps": 1000, "beta_schedule": "linear",
          "block_out_channels": [16, 32], "layers_per_block": 1, "norm_num_groups": 8}


@pytest.mark.parametrize("num_steps", [10, 100, 1000])
def test_ddpm_coefficients_match_diffusers_step(num_steps: int) -> None:
    """A, B, sigma reproduce DDPMScheduler.step (fixed_small, no clipping) with the same noise."""
    scheduler = make_scheduler(CONFIG)
    steps = gaussian_steps(scheduler, num_steps, "ddpm", 1.0)
    reference = make_scheduler(CONFIG)
    reference.set_timesteps(num_steps)
    gen = torch.Generator().manual_seed(0)
    for k in [0, num_steps // 2, num_steps - 2]:
        x = torch.randn(4, 1, 8, 8, generator=gen, dtype=torch.float64)
        eps = torch.randn(4, 1, 8, 8, generator=gen, dtype=torch.float64)
        t = int(steps.timesteps[k])
        out = reference.step(eps, t, x, generator=torch.Generator().manual_seed(1)).prev_sample
        noise = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ours = steps.A[k] * x + steps.B[k] * eps + steps.sigma[k] * noise
        torch.testing.assert_close(ours, out, rtol=1e-4, atol=1e-4)  # diffusers steps in float32
    assert torch.all(steps.sigma > 0)


def test_euler_maruyama_churn_and_errors() -> None:
    scheduler = make_scheduler(CONFIG)
    one, two = gaussian_steps(scheduler, 100, "euler_maruyama", 1.0), gaussian_steps(scheduler, 100, "euler_maruyama", 2.0)
    assert torch.all(one.sigma > 0) and torch.allclose(two.sigma, 2 * one.sigma)
    with pytest.raises(ValueError, match="sampler"):
        gaussian_steps(scheduler, 100, "ode", 1.0)
    with pytest.raises(ValueError, match="churn"):
        gaussian_steps(scheduler, 100, "ddpm", 0.0)


def random_pair(with_draft: bool = True) -> ModelPair:
    torch.manual_seed(0)
    target = Denoiser(build_unet(CONFIG), 10).eval()
    draft = Denoiser(build_unet(CONFIG), 10).eval() if with_draft else None
    # make the draft a close perturbation of the target so some drafts are accepted
    if draft is not None:
        draft.load_state_dict(target.state_dict())
        with torch.no_grad():
            for p in draft.parameters():
                p.add_(0.01 * torch.randn_like(p))
    info = {"image_shape": (1, 8, 8), "num_classes": 10, "scheduler": make_scheduler(CONFIG)}
    return ModelPair("diffusion", "random", "random-draft" if with_draft else None, target, draft, torch.device("cpu"), info)


@pytest.mark.parametrize("method,params", [
    ("target_only", {"num_steps": 20}),
    ("spec_token", {"num_steps": 20, "drafter": "frozen", "rejection": "reflection", "gamma": 3}),
    ("spec_token", {"num_steps": 20, "drafter": "model", "rejection": "residual"}),
    ("spec_block", {"num_steps": 20, "drafter": "free", "gamma": 7}),
    ("spec_block", {"num_steps": 20, "drafter": "model", "gamma": 4, "guidance_scale": 2.0}),
])
def test_run_batch_shapes_and_stats(method: str, params: dict) -> None:
    pair = random_pair()
    labels, ids = torch.tensor([0, 3, 7, 9]), torch.tensor([10, 11, 12, 13])
    result = diffusion_loop.run_batch(method, params, pair, labels, ids, seed=5)
    assert result.images.dtype == torch.uint8 and result.images.shape == (4, 8, 8)
    full = family("diffusion").parse_params(method, params).to_dict()
    for st in result.stats:
        assert st.num_tokens == 20
        if method == "target_only":
            assert st.target_calls == 20 and st.mean_acceptance_length == 1.0
            continue
        assert len(st.accepted_per_position) == full["gamma"]
        assert sum(st.accepted_per_position) == st.num_accepted_draft_tokens <= st.num_draft_tokens
        assert 1 <= st.target_calls <= 20 and st.num_spec_steps >= 1
        calls_per_round = 2 if full["drafter"] == "frozen" else 1
        assert st.target_calls <= calls_per_round * st.num_spec_steps + 2  # + bootstrap + final step
        assert st.extra["states_evaluated"] >= st.target_calls
        if full["drafter"] == "model":
            assert st.draft_calls == st.num_draft_tokens


def test_batch_composition_does_not_change_samples() -> None:
    """T11 on the UNet: rows run alone give the same images (up to float noise of batch size)."""
    pair = random_pair()
    labels, ids = torch.tensor([1, 2, 5]), torch.tensor([0, 1, 2])
    params = {"num_steps": 30, "drafter": "free", "gamma": 5}
    batch = diffusion_loop.run_batch("spec_block", params, pair, labels, ids, seed=3)
    for r in range(3):
        single = diffusion_loop.run_batch("spec_block", params, pair, labels[r : r + 1], ids[r : r + 1], seed=3)
        diff = (single.images[0].int() - batch.images[r].int()).abs().max().item()
        assert diff <= 1
        assert single.stats[0].num_spec_steps == batch.stats[r].num_spec_steps


@pytest.mark.parametrize("method,drafter", [("spec_block", "frozen"), ("spec_block", "free"), ("spec_token", "model")])
def test_one_row_residual_draws_on_the_host_change_no_bit(method: str, drafter: str, monkeypatch) -> None:
    """At batch 1 the residual's Newton solve runs on the host (``ONE_ROW_ON_HOST``; on Python floats here, not the
    C++ draws and states of tests/test_residual_draw_kernel.py): the images and statistics are those of the solve on 1-element
    tensors (2 samples, K = 30, seed 4). The commit kernel, which draws in C++ too, is off."""
    from specray.methods.diffusion import cpu_commit, residual

    monkeypatch.setattr(cpu_commit, "ENABLED", False)
    monkeypatch.setattr(residual, "_draws_kernel", lambda delta: None)
    monkeypatch.setattr(diffusion_loop, "_states_kernel", lambda chain, Y, name: None)
    pair = random_pair()
    params = {"num_steps": 30, "drafter": drafter, "gamma": 5, "rejection": "residual"}
    solves = []
    real = residual._sample_psi_one_row
    monkeypatch.setattr(residual, "_sample_psi_one_row", lambda *args: solves.append(args) or real(*args))
    runs = {}
    for on_host in (True, False):
        monkeypatch.setattr(residual, "ONE_ROW_ON_HOST", on_host)
        runs[on_host] = [diffusion_loop.run_batch(method, params, pair, torch.tensor([label]), torch.tensor([label]), seed=4)
                         for label in (2, 7)]
    assert solves  # rows were cut and redrawn on the host
    for host, tensors in zip(runs[True], runs[False]):
        assert torch.equal(host.images, tensors.images)
        assert host.stats == tensors.stats


def test_resolve_params_errors() -> None:
    resolve = family("diffusion").parse_params
    with pytest.raises(ParamError, match="^rejection: must be one of 'residual'"):
        resolve("spec_block", {"rejection": "reflection"})
    with pytest.raises(ParamError, match="^drafter: "):
        resolve("spec_token", {"drafter": "oracle"})
    with pytest.raises(ParamError, match="^gamma: unknown parameter"):
        resolve("target_only", {"gamma": 3})
    with pytest.raises(KeyError, match="unknown method 'spec_tree' for family 'diffusion'"):
        resolve("spec_tree", {})
    assert resolve("spec_block", {}).gamma == 7
    with pytest.raises(ValueError, match="draft model"):
        diffusion_loop.run_batch("spec_block", {"drafter": "model", "num_steps": 5}, random_pair(False), torch.tensor([0]), torch.tensor([0]), 0)


def test_presets_load_and_sample() -> None:
    from specray.models.diffusion import load_pair
    from specray.models.presets import get_preset

    target, draft = get_preset("digits-ddpm"), get_preset("digits-ddpm-draft")
    if not (target.weights_path.exists() and draft.weights_path.exists()):
        pytest.skip("preset weights not trained yet (specray train digits-ddpm digits-ddpm-draft)")
    from safetensors import safe_open

    with safe_open(str(target.weights_path), framework="pt") as f:
        meta = f.metadata()
    assert float(meta["heldout_loss"]) < 0.2 and int(meta["steps"]) == target.train["steps"]
    pair = load_pair("digits-ddpm", "digits-ddpm-draft", "cpu")
    result = diffusion_loop.run_batch("spec_block", {"num_steps": 50, "drafter": "model"}, pair, torch.arange(4), torch.arange(4), seed=0)
    assert result.images.shape == (4, 8, 8)
    assert result.images.float().std() > 20  # digits, not a constant image
