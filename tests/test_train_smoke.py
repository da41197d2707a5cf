"""Few-step smoke tests of the continuous and diffusion trainers (the discrete one is in test_discrete_model),
and of every family's trainer on a text-conditioned preset (captions in the place of labels).

Each trains a copy of a draft preset for 3 steps, twice with the same seed, and checks that the
fp16 safetensors file is written with its training record and that training is deterministic.
"""

from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from specray.models import presets


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
