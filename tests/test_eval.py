"""The reducer: the digits feature extractor in torch-fidelity, FID cross-checks, speedup, reduce_run."""

from __future__ import annotations

import io
import json
import math

import numpy as np
import pyarrow as pa
import pytest
import scipy.linalg
import torch
from PIL import Image

from specray.eval.bootstrap import BootstrapMoments, poisson_weights
from specray.eval.digits_features import FEATURE_EXTRACTOR_NAME, weights_metadata
from specray.eval.fid import (
    DigitsFeatureExtractor,
    FeatureMoments,
    digits_reference_images,
    fid_torch_fidelity,
    frechet_distance,
)
from specray.eval.reduce import reduce_run
from specray.eval.speedup import BatchTimes, speedup_over_baseline
from specray.runtime.images import encode_png
from specray.runtime.store import SAMPLE_SCHEMA, RunStore, ShardIdentity
from tests.eval_synthetic import SYNTHETIC_FINGERPRINT

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return digits_reference_images()


@pytest.fixture(scope="module")
def halves(reference) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(len(reference), generator=torch.Generator().manual_seed(0))
    return reference[perm[:898]], reference[perm[898:]]


@pytest.fixture(scope="module")
def noise() -> torch.Tensor:
    return torch.randint(0, 256, (1000, 8, 8), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)


def independent_frechet(features_a: np.ndarray, features_b: np.ndarray, ddof: int = 1) -> float:
    """Fréchet distance by the symmetric form tr sqrt(S_a^1/2 S_b S_a^1/2), via scipy eigh (not torch-fidelity's eigvals)."""
    mu_a, mu_b = features_a.mean(0), features_b.mean(0)
    sigma_a = np.cov(features_a, rowvar=False, ddof=ddof)
    sigma_b = np.cov(features_b, rowvar=False, ddof=ddof)
    w, v = scipy.linalg.eigh(sigma_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    inner = scipy.linalg.eigvalsh(root_a @ sigma_b @ root_a)
    tr_covmean = np.sqrt(np.clip(inner, 0, None)).sum()
    diff = mu_a - mu_b
    return float(diff @ diff + np.trace(sigma_a) + np.trace(sigma_b) - 2.0 * tr_covmean)


# ------------------------------------------------------------------ extractor


def test_extractor_is_registered_and_trained():
    from torch_fidelity.registry import FEATURE_EXTRACTORS_REGISTRY

    assert FEATURE_EXTRACTOR_NAME in FEATURE_EXTRACTORS_REGISTRY
    meta = weights_metadata()
    # held-out accuracy on the 180-image held-out split; the trained weights reach 0.983
    assert float(meta["heldout_accuracy"]) >= 0.95
    assert meta["seed"] == "0"


def test_torch_fidelity_fid_sanity(halves, noise, reference):
    """Digits vs digits (two random halves, 898/899 images, split seed 0): measured 8.06, must be < 15.
    Uniform noise (1000 images, seed 1) vs all 1797 digits: measured 632, must be > 300."""
    import torch_fidelity

    from specray.eval.fid import UInt8ImageDataset

    metrics = torch_fidelity.calculate_metrics(
        input1=UInt8ImageDataset(halves[0]), input2=UInt8ImageDataset(halves[1]), fid=True,
        feature_extractor="specray-digits", cuda=False, cache=False, save_cpu_ram=True, verbose=False,
    )
    fid_halves = metrics["frechet_inception_distance"]
    fid_noise = fid_torch_fidelity(noise, reference)
    assert 0.0 < fid_halves < 15.0
    assert fid_noise > 300.0
    assert fid_noise > 20 * fid_halves


@pytest.mark.parametrize("case", ["halves", "noise"])
def test_fid_matches_independent_frechet_distance(case, halves, noise, reference):
    """torch-fidelity's FID == an independent scipy computation from the same features, to 1e-6 relative.
    Negative control: the biased covariance (ddof=0) is off by far more than 1e-6."""
    images_a, images_b = halves if case == "halves" else (noise, reference)
    fid_tf = fid_torch_fidelity(images_a, images_b)
    extractor = DigitsFeatureExtractor()
    features_a, features_b = extractor(images_a), extractor(images_b)
    fid_independent = independent_frechet(features_a, features_b)
    assert abs(fid_tf - fid_independent) <= 1e-6 * abs(fid_independent)

    # streamed moments (chunks of 100, merged) -> torch-fidelity's formula: same number
    moments_a, moments_b = FeatureMoments(extractor.dim), FeatureMoments(extractor.dim)
    for start in range(0, len(features_a), 100):
        chunk = FeatureMoments(extractor.dim)
        chunk.update(features_a[start : start + 100])
        moments_a.merge(chunk)
    moments_b.update(features_b)
    fid_streamed = frechet_distance(moments_a.statistics(), moments_b.statistics())
    assert abs(fid_streamed - fid_independent) <= 1e-6 * abs(fid_independent)

    wrong = independent_frechet(features_a, features_b, ddof=0)
    assert abs(wrong - fid_independent) > 1e-4 * abs(fid_independent)


def test_moments_match_numpy_cov():
    x = np.random.default_rng(0).normal(3.0, 2.0, size=(1000, 16))
    moments = FeatureMoments(16)
    for start in range(0, 1000, 37):
        moments.update(x[start : start + 37])
    mu, sigma = moments.statistics()
    np.testing.assert_allclose(mu, x.mean(0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(sigma, np.cov(x, rowvar=False), rtol=0, atol=1e-11)


def test_poisson_bootstrap_weights_and_moments():
    """Weights: keyed by sample_id only (batch-independent), mean 1 and variance 1
    (200k draws, seed 3; tolerance 0.02 ~ 6 standard errors)."""
    ids = np.arange(2000)
    w = poisson_weights(3, ids, 100)
    np.testing.assert_array_equal(w[500:700], poisson_weights(3, ids[500:700], 100))
    assert abs(w.mean() - 1.0) < 0.02 and abs(w.var() - 1.0) < 0.02
    # a replicate equals FeatureMoments with the same weights, however rows are batched
    x = np.random.default_rng(1).normal(size=(2000, 8))
    boot = BootstrapMoments(8, 100, seed=3)
    for start in range(0, 2000, 300):
        boot.update(x[start : start + 300], ids[start : start + 300])
    direct = FeatureMoments(8)
    direct.update(x, w[:, 7])
    np.testing.assert_allclose(boot.statistics(7)[0], direct.statistics()[0], atol=1e-12)
    np.testing.assert_allclose(boot.statistics(7)[1], direct.statistics()[1], atol=1e-11)


# ------------------------------------------------------------------ speedup


def _times(walls: dict[tuple[str, int, int], float]) -> BatchTimes:
    times = BatchTimes()
    for key, wall in walls.items():
        times.add(key, wall, 4)
    return times


def test_speedup_on_crafted_wall_times():
    base = _times({("a", 0, 0): 9.0, ("a", 0, 1): 2.0, ("a", 0, 2): 3.0, ("a", 0, 3): 8.0, ("b", 1, 4): 4.0})
    arm = _times({("a", 0, 0): 1.0, ("a", 0, 1): 1.0, ("a", 0, 2): 1.0, ("a", 0, 3): 2.0, ("b", 1, 4): 1.0,
                  ("c", 1, 5): 1.0})  # ("c",1,5) has no baseline partner: unpaired
    # warm-up dropped: batch 0 of (a, shard 0); shard 1 has one batch so it stays.
    # ratios 2, 3, 4, 4 -> median 3.5; throughput (2+3+8+4)/(1+1+2+1) = 17/5
    result = speedup_over_baseline(arm, base, drop_warmup=True)
    assert result.num_pairs == 4 and result.warmup_dropped
    assert result.speedup == pytest.approx(3.5, abs=1e-12)
    assert result.throughput_speedup == pytest.approx(17 / 5, abs=1e-12)
    assert result.speedup_ci[0] <= 3.5 <= result.speedup_ci[1]
    # without the warm-up drop batch 0 (ratio 9) counts: ratios 9, 2, 3, 4, 4 -> median 4
    kept = speedup_over_baseline(arm, base, drop_warmup=False)
    assert kept.num_pairs == 5 and kept.speedup == pytest.approx(4.0, abs=1e-12)
    # a different actor on the same shard/batch is not a pair
    other = _times({("z", 0, 1): 1.0})
    assert speedup_over_baseline(other, base).num_pairs == 0


def test_batch_times_reject_inconsistent_rows():
    times = BatchTimes()
    times.add(("a", 0, 0), 1.0, 1)
    with pytest.raises(ValueError, match="batch_wall_time_s"):
        times.add(("a", 0, 0), 2.0, 1)


# ------------------------------------------------------------------ reduce_run on a synthetic run

N_SAMPLES, BATCH, SHARD_BATCHES = 200, 20, 5  # 10 batches, 2 shards per arm
SPEEDUP = 2.5


def _rows(arm: str, method: str, images: np.ndarray, ids: range, walls: dict[int, float], spec_stats: bool):
    rows = []
    for sid in ids:
        batch = sid // BATCH
        rows.append({
            "job_id": "synthetic", "arm": arm, "method": method, "family": "discrete_ar", "target": "t",
            "draft": "d", "sample_id": sid, "seed": 0, "class_label": sid % 10,
            "image": {"bytes": encode_png(images[sid]), "path": None}, "height": 8, "width": 8,
            "num_tokens": 64,
            # sd: 16 rounds of 3 drafted, 36 accepted -> acceptance 0.75, 64 tokens / 16 target calls = 4.0
            "num_spec_steps": 16 if spec_stats else 0, "num_draft_tokens": 48 if spec_stats else 0,
            "num_accepted_draft_tokens": 36 if spec_stats else 0,
            "draft_acceptance_rate": 0.75 if spec_stats else float("nan"),
            "mean_acceptance_length": 4.0 if spec_stats else 1.0,
            "accepted_per_position": [14, 12, 10] if spec_stats else [],
            "target_calls": 16 if spec_stats else 64, "draft_calls": 48 if spec_stats else 0,
            "batch_size": BATCH, "batch_wall_time_s": walls[batch], "sample_wall_time_s": walls[batch] / BATCH,
            "params": "{}", "specray_version": "0", "torch_version": torch.__version__, "device": "cpu",
            "extra_stats": "{}",
        })
    return rows


def write_synthetic_run(root: str) -> None:
    """Three arms on real digits: target_only and sd get two disjoint sets of digits images
    (sd's batches are crafted SPEEDUP x faster; each shard's first sd batch is a 50 s warm-up);
    "noisy" gets uniform noise. A stray unlisted shard must be ignored."""
    digits = digits_reference_images().numpy()
    noise = np.random.default_rng(5).integers(0, 256, size=(N_SAMPLES, 8, 8), dtype=np.uint8)
    base_walls = {b: 1.0 + 0.1 * b for b in range(N_SAMPLES // BATCH)}
    sd_walls = {b: w / SPEEDUP for b, w in base_walls.items()}
    for b in (0, SHARD_BATCHES):
        sd_walls[b] = 50.0  # first batch of each shard: warm-up, must be dropped from throughput
    arms = {
        "target_only": ("target_only", digits[:N_SAMPLES], base_walls, False),
        "sd": ("sd", digits[N_SAMPLES : 2 * N_SAMPLES], sd_walls, True),
        "noisy": ("sd", noise, sd_walls, True),
    }
    store = RunStore(root)
    shards = []
    shard_size = BATCH * SHARD_BATCHES
    for arm, (method, images, walls, spec_stats) in arms.items():
        for k in range(N_SAMPLES // shard_size):
            ids = range(k * shard_size, (k + 1) * shard_size)
            path = f"samples/{arm}/shard-{k:05d}-of-00002.parquet"
            # Shards as written before rows named their actor (no actor column): pairs by (shard, batch).
            rows = _rows(arm, method, images, ids, walls, spec_stats)
            table = pa.Table.from_pylist(rows, schema=SAMPLE_SCHEMA.remove(SAMPLE_SCHEMA.get_field_index("actor")))
            committed = store.write_shard(path, table, ShardIdentity(SYNTHETIC_FINGERPRINT, arm, k, 2))
            shards.append({"arm": arm, "shard": k, "num_shards": 2, "first_sample_id": ids[0], **committed.to_dict()})
    store.commit_bytes("samples/sd/shard-00009-of-00002.parquet", b"not listed, not parquet")
    manifest = {
        "format": 1, "job_id": "synthetic", "fingerprint": SYNTHETIC_FINGERPRINT,
        "spec": {"batch_size": BATCH, "eval": {"fid": True, "reference": "digits", "baseline": None,
                                               "options": {"bootstrap_replicates": 100}}},
        "layout": {"num_samples": N_SAMPLES, "batch_size": BATCH, "shard_batches": SHARD_BATCHES, "num_shards": 2},
        # "noisy" differs in params: two arms with one configuration and one seed would be duplicates (refused)
        "arms": [{"name": a, "family": "discrete_ar", "method": m, "target": "t", "draft": "d",
                  "params": {"gamma": 3} if a == "noisy" else {}}
                 for a, (m, *_rest) in arms.items()],
        "num_rows": sum(s["rows"] for s in shards),
        "shards": shards,
    }
    store.write_json("_manifest.json", manifest)


def test_reduce_run_on_synthetic_run(tmp_path, capsys):
    root = str(tmp_path / "run")
    write_synthetic_run(root)
    report = reduce_run(root)
    printed = capsys.readouterr().out
    assert "FID" in printed and "target_only" in printed and "noisy" in printed

    on_disk = json.loads((tmp_path / "run" / "report" / "report.json").read_text())
    assert on_disk["format"] == "specray-report/1"
    for key in ("run", "job_id", "num_rows", "fid_setup", "options", "arms", "table", "grid"):
        assert key in on_disk, key
    assert on_disk["num_rows"] == 3 * N_SAMPLES
    arms = {a["arm"]: a for a in on_disk["arms"]}
    assert list(arms) == ["target_only", "sd", "noisy"]
    for entry in arms.values():
        for key in ("method", "family", "baseline", "num_samples", "fid", "acceptance", "nfe_ratio", "speedup"):
            assert key in entry, key
        assert entry["num_samples"] == N_SAMPLES
        assert entry["baseline"] == "target_only"
        fid = entry["fid"]
        assert fid["source"] == "torch_fidelity.calculate_metrics"
        assert abs(fid["value"] - fid["streaming"]) <= 1e-6 * fid["value"]
        assert fid["ci"][0] <= fid["value"] <= fid["ci"][1]

    sd, base, noisy = arms["sd"], arms["target_only"], arms["noisy"]
    assert sd["acceptance"]["mean_acceptance_length"] == pytest.approx(4.0)
    assert sd["acceptance"]["draft_acceptance_rate"] == pytest.approx(0.75)
    assert sd["acceptance"]["acceptance_by_position"] == pytest.approx([14 / 16, 12 / 16, 10 / 16])
    assert base["acceptance"]["mean_acceptance_length"] == pytest.approx(1.0)
    assert sd["nfe_ratio"] == pytest.approx(4.0)
    # crafted walls: every non-warm-up sd batch is exactly 2.5x faster; warm-up (50 s) dropped
    assert sd["speedup"]["speedup"] == pytest.approx(SPEEDUP, rel=1e-12)
    assert sd["speedup"]["throughput_speedup"] == pytest.approx(SPEEDUP, rel=1e-12)
    assert sd["speedup"]["num_pairs"] == N_SAMPLES // BATCH - 2
    assert base["speedup"]["speedup"] == pytest.approx(1.0)

    # FID: real digits small, noise large; the noise arm is outside target_only's noise, sd inside it
    assert base["fid"]["value"] < 40 and sd["fid"]["value"] < 40
    assert noisy["fid"]["value"] > 300
    assert noisy["fid"]["diff_vs_baseline"]["within_noise"] is False
    assert sd["fid"]["diff_vs_baseline"]["within_noise"] is True

    grid = Image.open(io.BytesIO((tmp_path / "run" / "report" / "grid.png").read_bytes()))
    assert grid.size[0] > 100 and grid.size[1] > 50
    assert on_disk["grid"]["sample_ids"] == sorted(range(20), key=lambda s: (s % 10, s))
    assert report["arms"][1]["arm"] == "sd" and math.isfinite(report["arms"][1]["fid"]["value"])
