"""A MAR release (EMA weights, DiffLoss head, KL-16 VAE) reproduces the official LTH14/mar code, and
the continuous family's loop is MAR's sampler at num_iter = L.

Reference: tests/fixtures/checkpoints/mar (tools/make_reference_fixtures.py ran the official code on a
tiny configuration with random weights; the official noise draws were recorded). Tolerance
|x - ref| <= atol + 1e-5 |ref| with atol 1e-5 (network outputs), 5e-5 (a DiffLoss sample: 100 chained steps) and 2e-6 of the
largest value for the whole sampler (16 x 100 chained steps on random weights).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specray.families import format_options
from specray.methods.continuous.head import guided_eps_fn, run_chain
from specray.methods.continuous.loop import ChainNoise, _run_target_only, _Setup, cfg_scales
from specray.methods.continuous.params import TargetOnly
from specray.models.checkpoints.mar import load
from specray.models.continuous_ar import load_pair
from specray.models.continuous_schedule import DiffusionSchedule
from tests.checkpoint_fixtures import assert_close as close  # noqa: F401
from tests.checkpoint_fixtures import mar_draft, mar_target, reference

pytestmark = pytest.mark.usefixtures("single_thread")

REF = reference("mar")




@pytest.fixture(scope="module")
def loaded():
    return load(format_options("continuous_ar", mar_target()), "cpu")


def test_encoder_decoder_z_for_a_fixed_mask(loaded):
    """EMA weights, the class embedding in every buffer slot, fake_latent for the null class."""
    net = loaded[0].net
    tokens, mask = torch.tensor(REF["tokens"]), torch.tensor(REF["mask"]).bool()
    labels = torch.tensor(REF["labels"])
    close(net(tokens, mask, net.class_embedding(labels)), REF["z_cond"])
    close(net(tokens, mask, net.class_embedding(torch.full_like(labels, 10))), REF["z_uncond"])
    # Rows with different visible counts take the attention-mask path: the same z.
    ragged = mask.clone()
    ragged[1, torch.nonzero(~mask[1])[0]] = True
    expected = net(tokens[:1], mask[:1], net.class_embedding(labels[:1]))
    close(net(tokens, ragged, net.class_embedding(labels))[:1], expected.detach().double().numpy())


@pytest.mark.parametrize("name,cfg", [("cfg", 3.0), ("nocfg", 1.0)])
def test_diffloss_sample_for_fixed_noise(loaded, name, cfg):
    """100 respaced cosine steps, learned-range variance, CFG on eps only, temperature 0.95 on the step noise."""
    model = loaded[0]
    z = torch.tensor(REF[f"diffloss_{name}_z"])
    z_cond, z_uncond = (z[:2], z[2:]) if cfg != 1.0 else (z, None)
    schedule = DiffusionSchedule.cosine(1000, 100)
    noise = torch.tensor(REF[f"diffloss_{name}_noise"]).flip(1)  # recorded from step T-1 down to 0
    out = run_chain(guided_eps_fn(model, schedule, z_cond, z_uncond, cfg), schedule, torch.tensor(REF[f"diffloss_{name}_xT"]),
                    noise, tau=0.95, final_step_noise=False, clip_x0=None)
    close(out.x0, REF[f"diffloss_{name}_sample"], 5e-5)


def test_target_only_loop_is_the_official_sampler(loaded):
    """sample_tokens(num_iter=16, cfg 3 linear, T 1) with the recorded order and noise == the loop's target_only."""
    pair = load_pair(mar_target(), None, "cpu")
    params = TargetOnly.parse(format_options("continuous_ar", mar_target()).sampling_defaults() | {"cfg": 3.0})
    mar_order = torch.tensor(REF["sample_order"])
    order = mar_order.flip(1)  # MAR generates the tail of its order first
    L = 16
    x_T = torch.zeros(2, L, 4)
    eps = torch.zeros(2, L, 100, 4)
    rows = torch.arange(2)[:, None]
    x_T[rows, order] = torch.tensor(REF["sample_xT"])
    eps[rows, order] = torch.tensor(REF["sample_noise"]).flip(2)
    s = _Setup(params, DiffusionSchedule.cosine(1000, 100), order, cfg_scales(3.0, "linear", L, torch.device("cpu")),
               ChainNoise(x_T, eps), ChainNoise(x_T, eps), L, 4)
    seq, _ = _run_target_only(s, pair, torch.tensor(REF["labels"]))
    spatial = torch.empty_like(seq).scatter_(1, order[..., None].expand_as(seq), seq)
    # Random weights drive the chains far from data (|tokens| up to ~1e5) and 16 x 100 chained float32
    # steps amplify rounding: atol scales with the largest value (2e-6 of it).
    close(spatial, REF["sample_tokens"], 2e-6 * float(np.abs(REF["sample_tokens"]).max()))


def test_last_linear_cfg_step_is_not_the_full_scale():
    w = cfg_scales(3.0, "linear", 256, torch.device("cpu"))
    assert w[-1].item() == pytest.approx(2.9921875) and w[0].item() == pytest.approx(1 + 2 / 256)


def test_vae_decode_and_images(loaded):
    decoder = loaded[1]["image_decoder"]
    latents = torch.tensor(REF["sample_tokens"]).reshape(2, 4, 4, 4).permute(0, 3, 1, 2)
    close(decoder.vae.decode(latents / 0.2325), REF["vae_decoded"])
    pixels = decoder(torch.tensor(REF["sample_tokens"]))
    diff = np.abs(pixels.numpy().astype(int) - REF["vae_uint8"].astype(int))
    assert pixels.shape == (2, 8, 8, 3) and diff.max() <= 1 and (diff > 0).mean() < 0.01


def test_ema_weights_are_the_ones_loaded(loaded):
    raw = torch.load(mar_target()["path"], weights_only=False)  # the fixture this project wrote: trusted
    assert torch.equal(loaded[0].net.class_emb.weight, raw["model_ema"]["class_emb.weight"].float())
    assert not torch.equal(loaded[0].net.class_emb.weight, raw["model"]["class_emb.weight"].float())


@pytest.fixture(scope="module")
def mar_pairs():
    return load_pair(mar_target(), mar_target(), "cpu"), load_pair(mar_target(), mar_draft(), "cpu")


def test_cspd_with_the_target_as_its_own_draft_at_gamma_1_is_target_only(mar_pairs):
    """Spec cspd.md T8 on the release format: Mq := Mp and gamma 1 give log r == 0, acceptance 1 and the
    target-only images bit for bit (official defaults: CFG 3 linear, T 1; 20 DiffLoss steps for speed)."""
    from specray.methods.continuous.loop import run_batch

    same, _ = mar_pairs
    params = format_options("continuous_ar", mar_target()).sampling_defaults() | {"sample_steps": 20}
    labels, sids = torch.tensor([3, 7]), torch.tensor([10, 11])
    base = run_batch("target_only", params, same, labels, sids, seed=5)
    out = run_batch("cspd", params | {"mode": "paper", "gamma": 1}, same, labels, sids, seed=5)
    assert torch.equal(out.images, base.images)
    assert all(s.draft_acceptance_rate == 1.0 and s.extra["mean_log_ratio"] == 0.0 for s in out.stats)


@pytest.mark.parametrize("window", ["mar", "sequential"])
def test_cspd_mar_drafts_for_mar_call_counts(mar_pairs, window):
    from specray.methods.continuous.loop import run_batch

    _, pair = mar_pairs
    params = format_options("continuous_ar", mar_target()).sampling_defaults() | {"sample_steps": 10, "gamma": 4,
                                                                                  "window": window}
    out = run_batch("cspd", params, pair, torch.tensor([1, 2]), torch.arange(2), 0)
    assert out.images.shape == (2, 8, 8, 3)
    for s in out.stats:
        assert s.num_tokens == 16
        if window == "mar":  # (floor(rho L) + 1) pre-fill steps + one verify call per window (spec 7.7)
            assert s.target_calls == 1 + len([k for k in range(1, 16) if k % 4 == 0 or k == 15])
