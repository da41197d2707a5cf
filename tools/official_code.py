"""Importing the official LlamaGen and MAR code from a copy kept OUTSIDE this repository.

Shared by ``tools/make_reference_fixtures.py`` (reference fixtures) and ``bench/vs_official.py``
(throughput against the official samplers). The official code is never committed here; these
scripts import it at run time from ``<root>/LlamaGen`` (FoundationVision/LlamaGen) and
``<root>/mar`` (LTH14/mar). ``<root>`` is the scripts' ``--official`` option, by default
``$SPECRAY_OFFICIAL`` or ``/tmp/official``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

ENV_VAR = "SPECRAY_OFFICIAL"
DEFAULT_ROOT = Path("/tmp/official")
REPOSITORIES = {"LlamaGen": "FoundationVision/LlamaGen", "mar": "LTH14/mar"}
# The files the scripts import (a whole clone of each repository has them at these paths).
OFFICIAL_FILES = {
    "LlamaGen": ("autoregressive/models/gpt.py", "autoregressive/models/generate.py",
                 "tokenizer/tokenizer_image/vq_model.py", "utils/drop_path.py"),
    "mar": ("models/mar.py", "models/diffloss.py", "models/vae.py", "diffusion/__init__.py",
            "diffusion/diffusion_utils.py", "diffusion/gaussian_diffusion.py", "diffusion/respace.py"),
}


def default_root() -> Path:
    return Path(os.environ.get(ENV_VAR) or DEFAULT_ROOT)


def how_to_get(root: Path) -> str:
    """Instructions for putting the official code where the scripts look for it."""
    clones = "\n".join(f"  git clone https://github.com/{repo} {root / name}" for name, repo in REPOSITORIES.items())
    return (f"Put copies of the official code outside this repository (never commit them), e.g.\n{clones}\n"
            f"(or copy just the files listed in README.md, \"Reference fixtures\"), then pass --official {root} "
            f"or set {ENV_VAR}={root}. MAR's code also needs timm (pip install -e '.[test]').")


def missing_files(root: Path, name: str) -> list[str]:
    folder = root / name
    return [path for path in OFFICIAL_FILES[name] if not (folder / path).is_file()]


def import_official(root: Path, name: str) -> None:
    """Put ``<root>/<name>`` first on ``sys.path`` (its top-level packages: LlamaGen's ``autoregressive``,
    ``tokenizer``, ``utils``; MAR's ``models``, ``diffusion``); exits with :func:`how_to_get` if files lack."""
    missing = missing_files(root, name)
    if missing:
        raise SystemExit(f"official {name} code ({REPOSITORIES[name]}) not found at {root / name}: missing "
                         f"{', '.join(missing)}.\n{how_to_get(root)}")
    sys.path.insert(0, str(root / name))


def tensor_cuda_as_identity() -> None:
    """Make ``Tensor.cuda()`` the identity for the rest of the process: the official MAR sampler moves
    its tensors with ``.cuda()``, which a CPU-only run must skip."""
    torch.Tensor.cuda = lambda self, *args, **kwargs: self


def randomize(module: torch.nn.Module, seed: int, gain: float = 1.0) -> None:
    """Fan-in scaled normal weights everywhere (official inits zero some layers, which would hide bugs)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * gain / fan_in**0.5)
            elif name.endswith("weight") and "norm" in name.lower() or name.endswith("ln.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
