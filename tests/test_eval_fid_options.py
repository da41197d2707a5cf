"""FID options: reference statistics from an ADM .npz / torch-fidelity statistics / image folder / Parquet agree;
the Inception extractor never downloads; Inception Score and precision/recall."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specray.eval.extractors import (
    INCEPTION_NAME,
    ImageFeatureExtractor,
    InceptionWeightsMissing,
    inception_cache_path,
)
from specray.eval.fid import UInt8ImageDataset, digits_reference_images
from specray.eval.quality import InceptionScoreAccumulator
from specray.eval.reduce import ReduceOptions, reduce_run
from specray.eval.reference import (
    load_reference,
    read_adm_npz,
    read_fidelity_stats,
    write_adm_npz,
    write_fidelity_stats,
)
from specray.runtime.images import encode_png
from specray.runtime.store import RunStore
from tests.eval_synthetic import SyntheticArm, write_run

torch.set_num_threads(1)
OPTIONS = dict(bootstrap_replicates=20, speedup_replicates=50, isc=False, plots=False)


@pytest.fixture(scope="module")
def extractor() -> ImageFeatureExtractor:
    return ImageFeatureExtractor()


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> str:
    """100 samples x 2 arms (digits and uniform noise), seed 0."""
    root = str(tmp_path_factory.mktemp("run"))
    noise = np.random.default_rng(7).integers(0, 256, size=(100, 8, 8), dtype=np.uint8)
    write_run(root, [SyntheticArm("target_only", image_offset=500), SyntheticArm("noisy", method="lantern", images=noise)],
              per_class=10, batch_size=10, shard_batches=5)
    return root


def _fids(report) -> dict[str, float]:
    return {a["arm"]: a["fid"]["streaming"] for a in report["arms"]}


def test_adm_npz_equals_the_same_statistics_passed_other_ways(tmp_path, small_run, extractor):
    """Reference = the 1797 digits. Their statistics as (a) an ADM-format .npz, (b) a torch-fidelity statistics
    file written by torch-fidelity itself, (c) a folder of the PNGs, (d) a Parquet file of them, and (e) the
    built-in 'digits' reference all give the same arm FIDs: (a) == (b) exactly, others within 1e-6 relative.
    Negative control: the .npz with sigma scaled by 1.01 moves FID by far more than 1e-6."""
    import torch_fidelity

    images = digits_reference_images()
    ref = load_reference("digits", extractor)
    npz = tmp_path / "VIRTUAL_digits_ref.npz"
    np.savez(npz, arr_0=images.numpy()[..., None].repeat(3, -1), mu=ref.mu, sigma=ref.sigma)  # ADM layout

    # torch-fidelity writes its own statistics file into cache_root
    cache = tmp_path / "fidelity_cache"
    torch_fidelity.calculate_metrics(
        input1=UInt8ImageDataset(images[:50]), input2=UInt8ImageDataset(images), fid=True,
        feature_extractor="specray-digits", cuda=False, cache=True, cache_root=str(cache),
        input2_cache_name="digitsref", save_cpu_ram=True, verbose=False)
    (stats_file,) = cache.glob("digitsref-*-stat-fid-*.pt")
    mu_tf, sigma_tf = read_fidelity_stats(stats_file)
    np.testing.assert_allclose(mu_tf, ref.mu, rtol=0, atol=1e-9)
    np.testing.assert_allclose(sigma_tf, ref.sigma, rtol=0, atol=1e-9)
    ours = tmp_path / "ref-stats.pt"
    write_fidelity_stats(ours, *read_adm_npz(npz))

    folder = tmp_path / "folder"
    folder.mkdir()
    for i, image in enumerate(images.numpy()):
        (folder / f"{i:05d}.png").write_bytes(encode_png(image))
    parquet = tmp_path / "ref.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"image": [{"bytes": encode_png(im), "path": None} for im in images.numpy()]}), parquet)

    options = ReduceOptions(**OPTIONS, checks=False)
    fids = {name: _fids(reduce_run(small_run, print_table=False, options=options, reference=ref_arg))
            for name, ref_arg in [("npz", f"npz:{npz}"), ("tf_stats", str(stats_file)), ("ours_pt", str(ours)),
                                  ("folder", f"folder:{folder}"), ("parquet", str(parquet)), ("digits", "digits")]}
    for arm in ("target_only", "noisy"):
        base = fids["npz"][arm]
        assert fids["ours_pt"][arm] == base
        for other in ("tf_stats", "folder", "parquet", "digits"):
            assert abs(fids[other][arm] - base) <= 1e-6 * base, (other, arm, fids[other][arm], base)

    wrong = tmp_path / "wrong.npz"
    write_adm_npz(wrong, ref.mu, ref.sigma * 1.01)
    moved = _fids(reduce_run(small_run, print_table=False, options=options, reference=f"npz:{wrong}"))
    assert abs(moved["target_only"] - fids["npz"]["target_only"]) > 1e-4 * fids["npz"]["target_only"]  # measured 3.7e-4


def test_reference_with_wrong_dimension_is_refused(tmp_path, extractor):
    path = tmp_path / "inception.npz"
    write_adm_npz(path, np.zeros(2048), np.eye(2048))
    with pytest.raises(ValueError, match="2048"):
        load_reference(f"npz:{path}", extractor)
    with pytest.raises(ValueError, match="allowed"):
        load_reference("no-such-thing", extractor)


def test_inception_weights_missing_says_where_to_put_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch-home"))
    monkeypatch.delenv("SPECRAY_INCEPTION_WEIGHTS", raising=False)
    with pytest.raises(InceptionWeightsMissing) as info:
        ImageFeatureExtractor(INCEPTION_NAME)
    message = str(info.value)
    assert str(inception_cache_path()) in message and "inception_weights" in message
    assert "never downloads" in message
    with pytest.raises(InceptionWeightsMissing, match="does not exist"):
        ImageFeatureExtractor(INCEPTION_NAME, inception_weights=str(tmp_path / "missing.pth"))
    assert not (tmp_path / "torch-home").exists() or not any((tmp_path / "torch-home").rglob("*.pth"))


def test_inception_extractor_loads_local_weights_safely(tmp_path):
    """Random-init InceptionV3 weights saved as a plain state dict: loaded with weights_only=True, no network;
    8x8 digits go through torch-fidelity's own resize to 299. (The real weights are not on this machine.)"""
    from unittest import mock

    from torch_fidelity import feature_extractor_inceptionv3 as module

    with mock.patch.object(module.FeatureExtractorInceptionV3, "load_state_dict", lambda self, state: None), \
            mock.patch.object(module, "load_state_dict_from_url", lambda *a, **k: None):
        random_model = module.FeatureExtractorInceptionV3(INCEPTION_NAME, ["2048"])
    path = tmp_path / "inception-random.pth"
    torch.save({k: v.clone() for k, v in random_model.state_dict().items()}, path)
    extractor = ImageFeatureExtractor(INCEPTION_NAME, inception_weights=str(path), batch_size=4)
    features = extractor(digits_reference_images()[:4])
    assert features.fid.shape == (4, 2048) and features.isc.shape == (4, 1008)
    assert np.isfinite(features.fid).all() and features.fid.dtype == np.float64


def test_streamed_inception_score_matches_torch_fidelity(extractor):
    """500 digits, splits=1: streamed IS == torch-fidelity's isc_features_to_metric to 1e-6 relative.
    Digits IS is near the 10 classes (> 8); uniform noise (500 images, seed 3) is far lower (negative control)."""
    from torch_fidelity.metric_isc import isc_features_to_metric

    images = digits_reference_images()[:500]
    logits = extractor(images).isc
    acc = InceptionScoreAccumulator(10, splits=1)
    for start in range(0, 500, 70):
        acc.update(logits[start : start + 70], np.arange(start, min(start + 70, 500)))
    ours = acc.result()["mean"]
    theirs = isc_features_to_metric(torch.from_numpy(logits), splits=1, shuffle=False)["inception_score_mean"]
    assert abs(ours - theirs) <= 1e-6 * theirs
    assert ours > 8.0
    noise = torch.randint(0, 256, (500, 8, 8), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    acc_noise = InceptionScoreAccumulator(10, splits=1)
    acc_noise.update(extractor(noise).isc, np.arange(500))
    assert acc_noise.result()["mean"] < 0.5 * ours


def test_precision_recall_where_asked(small_run):
    """prc on 100 samples/arm vs the 1797 reference digits (k=3): measured precision 1.0 (digits arm) and
    0.23 (uniform noise, seed 7); must be > 0.9 and < 0.5."""
    options = ReduceOptions(**{**OPTIONS, "isc": True}, prc=True, prc_max_samples=2000)
    report = reduce_run(small_run, print_table=False, options=options)
    arms = {a["arm"]: a for a in report["arms"]}
    digits, noise = arms["target_only"]["precision_recall"], arms["noisy"]["precision_recall"]
    assert digits["available"] and digits["num_generated"] == 100 and digits["num_reference"] == 1797
    assert digits["precision"] > 0.9 and noise["precision"] < 0.5
    assert arms["target_only"]["inception_score"]["mean"] > arms["noisy"]["inception_score"]["mean"]
    md = (RunStore(small_run).read_bytes("report/report.md")).decode()
    assert "Precision / recall" in md
