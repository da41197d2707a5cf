"""A diffusers pixel DDPM folder (google/ddpm-cifar10-32 layout: legacy attention key names in a
pickled .bin, an early scheduler_config.json) reproduces diffusers' UNet and DDPMScheduler.step.

Reference: tests/fixtures/checkpoints/ddpm (tools/make_reference_fixtures.py, diffusers' own
classes on a tiny UNet with random weights). Tolerance |x - ref| <= 1e-5 + 1e-5 |ref| (float32).
"""

from __future__ import annotations

import pytest
import torch

from specray.methods.diffusion.loop import _step, model_chain
from specray.methods.diffusion.params import TargetOnly
from specray.models.diffusion import load_pair
from tests.checkpoint_fixtures import assert_close as close  # noqa: F401
from tests.checkpoint_fixtures import ddpm_draft, ddpm_target, dit_target, reference

pytestmark = pytest.mark.usefixtures("single_thread")

REF = reference("ddpm")




@pytest.fixture(scope="module")
def pair():
    return load_pair(ddpm_target(), ddpm_draft(), "cpu")


def test_unet_output_from_legacy_keys(pair):
    x, t = torch.tensor(REF["x"]), torch.tensor(REF["unet_t"])
    close(pair.target(x, t, torch.zeros(2, dtype=torch.int64)), REF["unet_out"])
    assert pair.info["image_shape"] == (3, 8, 8)
    assert pair.info["scheduler"].config.variance_type == "fixed_large" and pair.info["scheduler"].config.clip_sample


@pytest.mark.parametrize("case,variance,steps", [("large1000", "fixed_large", 1000), ("large10", "fixed_large", 10),
                                                 ("small1000", "fixed_small", 1000)])
def test_one_scheduler_step(pair, case, variance, steps):
    """The loop's step (mean with x0 clipping, the scheduler's variance) equals DDPMScheduler.step for the same noise."""
    pair.info["scheduler"].register_to_config(variance_type=variance)
    try:
        chain, table = model_chain(pair, TargetOnly.parse({"num_steps": steps}), torch.zeros(2, dtype=torch.int64))
    finally:
        pair.info["scheduler"].register_to_config(variance_type="fixed_large")
    t = int(REF[f"step_{case}_t"])
    k = torch.full((2,), int((table.timesteps == t).nonzero()[0, 0]))
    x = torch.tensor(REF["x"])
    eps = chain.target_eps(x, k, torch.arange(2))
    close(_step(chain, x, eps, k, torch.tensor(REF[f"step_{case}_noise"])), REF[f"step_{case}"])


def test_official_sampler_defaults_and_rgb_images(pair):
    from specray.families import format_options
    from specray.methods.diffusion.loop import run_batch

    defaults = format_options("diffusion", ddpm_target()).sampling_defaults()
    assert defaults == {"num_steps": 1000, "guidance_scale": 1.0}
    out = run_batch("target_only", {"num_steps": 10}, pair, torch.zeros(2, dtype=torch.int64), torch.arange(2), 0)
    assert out.images.shape == (2, 8, 8, 3) and out.images.dtype == torch.uint8


# ---- latent DiT (diffusers pipeline folder) --------------------------------------------------------

DIT = reference("dit")


@pytest.fixture(scope="module")
def dit_pair():
    return load_pair(dit_target(), None, "cpu")


def test_dit_transformer_output_and_guidance(dit_pair):
    """The transformer's eps channels for labels incl. the null class (10); CFG guides all latent channels."""
    x, t = torch.tensor(DIT["x"]), torch.tensor(DIT["t"])
    close(dit_pair.target(x, t, torch.tensor(DIT["labels"])), DIT["transformer_out"][:, :4])
    guided = dit_pair.target(x[:1], t[:1], torch.tensor([3]), 1.5)
    cond, null = DIT["transformer_out"][0, :4], None
    null = dit_pair.target(x[:1], t[:1], torch.tensor([10]))[0].double().numpy()
    close(guided[0], null + 1.5 * (cond - null))


def test_dit_vae_decode_and_sampler_defaults(dit_pair):
    from specray.families import format_options
    from specray.methods.diffusion.loop import run_batch

    decode = dit_pair.info["image_decoder"]
    x = torch.tensor(DIT["x"])
    close(decode.vae.decode(x / decode.vae.config.scaling_factor).sample, DIT["vae_decoded"])
    assert format_options("diffusion", dit_target()).sampling_defaults() == {"num_steps": 250, "guidance_scale": 1.5}
    out = run_batch("spec_block", {"num_steps": 20, "guidance_scale": 1.5}, dit_pair, torch.tensor([1, 2]),
                    torch.arange(2), 0)
    assert out.images.shape == (2, 8, 8, 3) and out.images.dtype == torch.uint8


def test_model_drafter_with_a_release_draft(pair):
    from specray.methods.diffusion.loop import run_batch

    out = run_batch("spec_block", {"num_steps": 20, "drafter": "model"}, pair, torch.zeros(2, dtype=torch.int64),
                    torch.arange(2), 0)
    assert out.images.shape == (2, 8, 8, 3)
    assert all(s.draft_calls > 0 and s.num_tokens == 20 for s in out.stats)
