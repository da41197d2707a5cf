"""Few-step smoke tests of the continuous and diffusion trainers (the discrete one is in test_discrete_model),
and of every family's trainer on a text-conditioned preset (captions in the place of labels).

Each trains a copy of a draft preset for 3 steps, twice with the same seed, and checks that the
fp16 safetensors file is written with its training record and that training is deterministic.
The text presets read their captions' features from a bank whose encoder hashes each caption
(MiniLM over all 7,000 captions takes about a minute on one core; its features are checked
against the official encoder in test_prompts).
"""

import hashlib
from dataclasses import replace
from functools import lru_cache

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specray.models import presets, text_training
from specray.models.text import TextFeatures


class _HashEncoder:
    """Unit-norm 384-d features seeded by each caption's SHA-256: deterministic, distinct per caption."""

    def encode(self, texts):
        seeds = [int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") for text in texts]
        pooled = torch.stack([torch.randn(384, generator=torch.Generator().manual_seed(s)) for s in seeds])
        pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return TextFeatures(pooled[:, None], torch.ones(len(texts), 1, dtype=torch.bool), pooled)


@lru_cache(maxsize=2)
def _hashed_bank(split):
    """A split's caption bank with hashed features, built when a text preset first asks (once per split)."""
    return text_training.CaptionBank(split, encoder=_HashEncoder())


@pytest.mark.parametrize(
    "name, module",
    [("digits-mar-draft", "specray.models.continuous_train"), ("digits-ddpm-draft", "specray.models.diffusion_train"),
     pytest.param("digits-gpt-text-draft", "specray.models.discrete_train", marks=pytest.mark.slow),
     pytest.param("digits-mar-text-draft", "specray.models.continuous_train", marks=pytest.mark.slow),
     pytest.param("digits-ddpm-text", "specray.models.diffusion_train", marks=pytest.mark.slow)],
)
def test_trainer_writes_deterministic_fp16_weights(name, module, tmp_path, monkeypatch):
    import importlib

    base = presets.get_preset(name)
    short = {"steps": 3, "batch_size": 8, **{k: 1 for k in ("warmup", "warmup_steps") if k in base.train}}
    tiny = replace(base, name=f"{name}-smoke", train={**base.train, **short})
    monkeypatch.setitem(presets.PRESETS, tiny.name, tiny)
    monkeypatch.setattr(text_training, "caption_bank", _hashed_bank)
    train_preset = importlib.import_module(module).train_preset
    torch.set_num_threads(1)
    first = train_preset(tiny.name, tmp_path / "a", seed=0)
    second = train_preset(tiny.name, tmp_path / "b", seed=0)
    assert first.name == f"{tiny.name}.safetensors" and first.exists()
    a, b = load_file(str(first)), load_file(str(second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float16 for t in a.values())
    with safe_open(str(first), "pt") as f:
        meta = f.metadata()
    assert meta["steps"] == "3" and any("heldout" in key for key in meta)


def test_head_trainer_is_deterministic_and_records_its_training(tmp_path, monkeypatch):
    """`specray train` on the EAGLE head preset, shrunk to 8 generations and 3 steps, twice with one seed."""
    from specray.models.discrete_ar import load_pair
    from specray.models.eagle_head import EagleHead
    from specray.models.presets.train import train

    base = presets.get_preset("digits-gpt-eagle")
    if not presets.get_preset(base.train["target"]).weights_path.exists():
        pytest.skip("the head's target is not trained")
    tiny = replace(base, name="digits-gpt-eagle-smoke", train={**base.train, "samples": 8, "heldout_samples": 4,
                                                               "generation_batch": 8, "steps": 3, "batch_size": 4,
                                                               "warmup_steps": 1})
    monkeypatch.setitem(presets.PRESETS, tiny.name, tiny)
    torch.set_num_threads(1)
    first = train(tiny.name, tmp_path / "a", seed=0)
    second = train(tiny.name, tmp_path / "b", seed=0)
    a, b = load_file(str(first)), load_file(str(second))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(t.dtype == torch.float16 for t in a.values())
    with safe_open(str(first), "pt") as f:
        meta = f.metadata()
    assert meta["steps"] == "3" and meta["target"] == "digits-gpt-target"
    assert 0.0 < float(meta["heldout_first_draft_alpha"]) <= 1.0
    assert '"kind": "eagle_head"' in meta["config"]
    pair = load_pair("digits-gpt-target", str(first), "cpu")
    assert isinstance(pair.draft, EagleHead) and pair.info["draft_kind"] == "eagle_head"
