"""Typed options of the release formats, as a job names them; torch-free (``specray validate``).

A job names a real checkpoint as a mapping, for example::

    target: {format: llamagen-c2i, path: ckpt/c2i_XL_384.pt, size: GPT-XL, image_size: 384,
             tokenizer: ckpt/vq_ds16_c2i.pt}

Each class below validates such a mapping when the job is loaded: every field typed, unknown fields
refused, and the files checked as far as that is possible without reading tensors (they exist; a
safetensors header covers its file; a zip pickle's member list is sound). Each also carries the
model's **official sampling settings** (:meth:`FormatOptions.sampling_defaults`): the spec fills
an arm's unset parameters from them, so ``target_only`` on a release is the official sampler.
The README's table of defaults names the source of every value.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from specray.methods.params import ParamError, StrictParams

Dtype = Literal["float32", "bfloat16", "float16"]
WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".ckpt", ".bin")

# Release sizes (spec checkpoints.md): the architecture each name stands for.
LLAMAGEN_SIZES: dict[str, dict[str, int]] = {
    "GPT-B": {"n_layer": 12, "n_head": 12, "dim": 768},
    "GPT-L": {"n_layer": 24, "n_head": 16, "dim": 1024},
    "GPT-XL": {"n_layer": 36, "n_head": 20, "dim": 1280},
    "GPT-XXL": {"n_layer": 48, "n_head": 24, "dim": 1536},
    "GPT-3B": {"n_layer": 24, "n_head": 32, "dim": 3200},
}
# GETTING_STARTED.md of LlamaGen: --cfg-scale of the FID-50K commands.
LLAMAGEN_FID_CFG = {"GPT-B": 2.0, "GPT-L": 2.0, "GPT-XL": 1.75, "GPT-XXL": 1.75, "GPT-3B": 1.65}
LLAMAGEN_ARCH_FIELDS = ("n_layer", "n_head", "dim", "vocab_size", "num_classes", "multiple_of")
# Text-to-image releases (t2i_XL_stage1_256.pt, t2i_XL_stage2_512.pt) are GPT-XL.
LLAMAGEN_T2I_ARCH_FIELDS = ("n_layer", "n_head", "dim", "vocab_size", "multiple_of", "caption_dim", "cls_token_num")
VQ_ARCH_FIELDS = ("codebook_size", "codebook_embed_dim", "z_channels", "ch", "ch_mult", "num_res_blocks")

MAR_SIZES: dict[str, dict[str, int]] = {
    "MAR-B": {"width": 768, "depth": 12, "heads": 12, "diffloss_depth": 6, "diffloss_width": 1024},
    "MAR-L": {"width": 1024, "depth": 16, "heads": 16, "diffloss_depth": 8, "diffloss_width": 1280},
    "MAR-H": {"width": 1280, "depth": 20, "heads": 16, "diffloss_depth": 12, "diffloss_width": 1536},
}
# LTH14/mar README evaluation commands: --cfg per size with --cfg_schedule linear.
MAR_FID_CFG = {"MAR-B": 2.9, "MAR-L": 3.0, "MAR-H": 3.2}
MAR_ARCH_FIELDS = ("width", "depth", "heads", "diffloss_depth", "diffloss_width", "seq_len", "token_dim",
                   "buffer_size", "num_classes")
KL_ARCH_FIELDS = ("embed_dim", "ch", "ch_mult", "num_res_blocks")


def file_problem(path: Path) -> str | None:
    """Why a weights file cannot be loaded, found without reading any tensor (None: looks sound)."""
    if not path.exists():
        return "does not exist"
    if not path.is_file():
        return "is not a file"
    if path.suffix not in WEIGHT_SUFFIXES:
        return f"has suffix {path.suffix!r}; allowed: {', '.join(WEIGHT_SUFFIXES)}"
    if path.suffix == ".safetensors":
        from specray.spec import safetensors_header_problem

        problem = safetensors_header_problem(path)
        return f"is not a valid safetensors file: {problem}" if problem else None
    return zip_pickle_problem(path)


def zip_pickle_problem(path: Path) -> str | None:
    """Why a zip-format torch pickle is unreadable (None if sound or not a zip); reads no pickle."""
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != b"PK\x03\x04":
        return None  # a legacy (non-zip) pickle: only the loader can tell
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except zipfile.BadZipFile as exc:
        return f"is a damaged zip archive ({exc}): truncated or corrupt"
    if not any(name.endswith("data.pkl") for name in names):
        return "is a zip archive without data.pkl: not a torch checkpoint"
    return None


def check_file(field: str, value: str) -> str:
    problem = file_problem(Path(value).expanduser())
    if problem:
        raise ParamError(field, f"checkpoint {value!r} {problem}")
    return value


def check_arch(field: str, arch: dict[str, Any] | None, allowed: tuple[str, ...]) -> None:
    if arch is None:
        return
    unknown = sorted(set(arch) - set(allowed))
    if unknown:
        raise ParamError(field, f"unknown architecture field(s) {unknown}; allowed: {list(allowed)}")
    for key, value in arch.items():
        ok = (isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)) \
            or (isinstance(value, int) and not isinstance(value, bool) and value > 0)
        if not ok:
            raise ParamError(field, f"{key} must be a positive integer (or a list of integers), got {value!r}")


class FormatOptions(StrictParams):
    """Fields every format has: where the weights are and the dtype they are run in."""

    kind: ClassVar[str] = "option"
    path: str
    dtype: Dtype = "float32"  # bfloat16 / float16: half-precision weights (faithfulness holds in float32)

    def sampling_defaults(self) -> dict[str, Any]:
        """The official sampler's settings, as method parameters of the format's family."""
        return {}

    @property
    def num_classes(self) -> int | None:
        return None


class LlamaGenOptions(FormatOptions):
    """A LlamaGen class-conditional GPT (``c2i_*.pt``: ``{"model": ...}``; XXL / 3B: bare FSDP state
    dicts; or a ``.safetensors`` of the same keys) with the VQ-16 tokenizer that decodes its tokens."""

    size: Literal["GPT-B", "GPT-L", "GPT-XL", "GPT-XXL", "GPT-3B", "custom"]
    image_size: Annotated[int, Field(ge=8)]  # 256 (16x16 tokens) or 384 (24x24) for the releases
    tokenizer: str | None = None  # vq_ds16_c2i.pt; without it images are the raw token grid
    output_size: Annotated[int, Field(ge=8)] | None = 256  # bicubic resize for FID (official: 384 -> 256)
    arch: dict[str, Any] | None = None  # size "custom" only: n_layer, n_head, dim, vocab_size, ...
    # A VQ other than VQ-16 (codebook_size, ch, ch_mult, ...); it also sets the token grid
    # (image_size / downsampling) when no tokenizer file is named, as for a draft.
    tokenizer_arch: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _files(self) -> "LlamaGenOptions":
        check_file("path", self.path)
        if self.tokenizer is not None:
            check_file("tokenizer", self.tokenizer)
        if (self.size == "custom") != (self.arch is not None):
            raise ParamError("arch", "is required with size 'custom' and allowed only there")
        check_arch("arch", self.arch, LLAMAGEN_ARCH_FIELDS)
        check_arch("tokenizer_arch", self.tokenizer_arch, VQ_ARCH_FIELDS)
        return self

    def sampling_defaults(self) -> dict[str, Any]:
        # sample_c2i_ddp.py FID settings; the cfg scale per size from GETTING_STARTED.md.
        return {"cfg_scale": LLAMAGEN_FID_CFG.get(self.size, 1.75), "temperature": 1.0, "top_k": 0,
                "top_p": 1.0, "cfg_interval": -1}

    @property
    def num_classes(self) -> int | None:
        return int((self.arch or {}).get("num_classes", 1000))


class LlamaGenT2IOptions(LlamaGenOptions):
    """A LlamaGen text-to-image GPT (``t2i_XL_stage1_256.pt`` / ``t2i_XL_stage2_512.pt``:
    ``{"model": ...}``) with the VQ-16 tokenizer of the t2i release (``vq_ds16_t2i.pt``). Its prefix
    is 120 flan-t5-xl token features (2048 wide) projected by the caption MLP; prompts only.
    GPT-XL is the released size; the other sizes are what the official ``train_t2i.py`` trains
    (``--gpt-model``), e.g. a smaller draft."""

    size: Literal["GPT-B", "GPT-L", "GPT-XL", "GPT-XXL", "GPT-3B", "custom"]
    image_size: Annotated[int, Field(ge=8)]  # 256 (stage 1, 16x16 tokens) or 512 (stage 2, 32x32)
    tokenizer: str | None = None  # vq_ds16_t2i.pt
    # COCO FID is computed at 256 px (the official evaluations/t2i script); None keeps the native size.
    output_size: Annotated[int, Field(ge=8)] | None = 256
    arch: dict[str, Any] | None = None  # size "custom" only: n_layer, n_head, dim, caption_dim, cls_token_num...
    # Where a caption's padding goes in the 120-token prefix: "left" as in LlamaGen's t2i training data
    # and samplers (their default), "right" as the samplers' --no-left-padding.
    caption_padding: Literal["left", "right"] = "left"

    @model_validator(mode="after")
    def _files(self) -> "LlamaGenT2IOptions":
        check_file("path", self.path)
        if self.tokenizer is not None:
            check_file("tokenizer", self.tokenizer)
        if (self.size == "custom") != (self.arch is not None):
            raise ParamError("arch", "is required with size 'custom' and allowed only there")
        check_arch("arch", self.arch, LLAMAGEN_T2I_ARCH_FIELDS)
        check_arch("tokenizer_arch", self.tokenizer_arch, VQ_ARCH_FIELDS)
        return self

    def sampling_defaults(self) -> dict[str, Any]:
        # sample_t2i.py / sample_t2i_ddp.py: --cfg-scale 7.5 --top-k 1000 --top-p 1.0 --temperature 1.0;
        # generate() is called without cfg_interval (-1: guidance at every token).
        return {"cfg_scale": 7.5, "temperature": 1.0, "top_k": 1000, "top_p": 1.0, "cfg_interval": -1}

    @property
    def num_classes(self) -> int | None:
        return None  # conditioned on prompts, not classes

    @property
    def caption_dim(self) -> int:
        return int((self.arch or {}).get("caption_dim", 2048))


class MAROptions(FormatOptions):
    """A MAR release (``checkpoint-last.pth``: ``{"model", "model_ema", ...}``) with its KL-16 VAE."""

    size: Literal["MAR-B", "MAR-L", "MAR-H", "custom"]
    vae: str | None = None  # kl16.ckpt; without it images are the latent's first three channels
    weights: Literal["model_ema", "model"] = "model_ema"  # evaluation uses the EMA weights
    arch: dict[str, Any] | None = None  # size "custom" only
    vae_arch: dict[str, Any] | None = None  # a KL VAE other than KL-16
    num_sampling_steps: Annotated[int, Field(ge=2, le=1000)] = 100  # DiffLoss respacing of the release

    @model_validator(mode="after")
    def _files(self) -> "MAROptions":
        check_file("path", self.path)
        if self.vae is not None:
            check_file("vae", self.vae)
        if (self.size == "custom") != (self.arch is not None):
            raise ParamError("arch", "is required with size 'custom' and allowed only there")
        check_arch("arch", self.arch, MAR_ARCH_FIELDS)
        check_arch("vae_arch", self.vae_arch, KL_ARCH_FIELDS)
        return self

    def sampling_defaults(self) -> dict[str, Any]:
        # README evaluation: --num_iter 256 --num_sampling_steps 100 --cfg_schedule linear --temperature 1.0.
        return {"cfg": MAR_FID_CFG.get(self.size, 3.0), "cfg_schedule": "linear", "temperature": 1.0,
                "order": "random", "clip_denoised": False, "sample_steps": self.num_sampling_steps}

    @property
    def num_classes(self) -> int | None:
        return int((self.arch or {}).get("num_classes", 1000))


def check_folder(field: str, value: str, required: tuple[str, ...]) -> Path:
    folder = Path(value).expanduser()
    if not folder.is_dir():
        raise ParamError(field, f"{value!r} does not exist or is not a directory (a diffusers model folder)")
    for name in required:
        if not (folder / name).is_file():
            raise ParamError(field, f"{value!r} has no {name}")
    return folder


def weights_in(folder: Path, stem: str) -> Path | None:
    """A diffusers weights file in ``folder``: safetensors preferred, else the pickled .bin."""
    for suffix in (".safetensors", ".bin"):
        candidate = folder / f"{stem}{suffix}"
        if candidate.is_file():
            return candidate
    return None


def check_diffusers_weights(field: str, folder: Path, stem: str) -> None:
    weights = weights_in(folder, stem)
    if weights is None:
        raise ParamError(field, f"{str(folder)!r} has no {stem}.safetensors or {stem}.bin")
    problem = file_problem(weights)
    if problem:
        raise ParamError(field, f"{str(weights)!r} {problem}")


class DDPMOptions(FormatOptions):
    """A diffusers pixel DDPM folder (``config.json``, ``diffusion_pytorch_model.{safetensors,bin}``,
    ``scheduler_config.json``), as google/ddpm-cifar10-32."""

    @model_validator(mode="after")
    def _files(self) -> "DDPMOptions":
        folder = check_folder("path", self.path, ("config.json", "scheduler_config.json"))
        check_diffusers_weights("path", folder, "diffusion_pytorch_model")
        return self

    def sampling_defaults(self) -> dict[str, Any]:
        # DDPMPipeline: num_inference_steps = 1000 (ancestral sampling at every training step).
        import json

        config = json.loads((Path(self.path).expanduser() / "scheduler_config.json").read_text())
        steps = config.get("num_train_timesteps", config.get("timesteps", 1000))
        return {"num_steps": int(steps), "guidance_scale": 1.0}

    @property
    def num_classes(self) -> int | None:
        import json

        config = json.loads((Path(self.path).expanduser() / "config.json").read_text())
        return int(config.get("num_class_embeds") or 1)


class DiTOptions(FormatOptions):
    """A diffusers DiT pipeline folder (``transformer/``, ``vae/``, ``scheduler/``), as
    facebook/DiT-XL-2-256: class-conditional latent diffusion decoded by its ``AutoencoderKL``."""

    @model_validator(mode="after")
    def _files(self) -> "DiTOptions":
        folder = check_folder("path", self.path, ("transformer/config.json", "vae/config.json",
                                                  "scheduler/scheduler_config.json"))
        check_diffusers_weights("path", folder / "transformer", "diffusion_pytorch_model")
        check_diffusers_weights("path", folder / "vae", "diffusion_pytorch_model")
        return self

    def sampling_defaults(self) -> dict[str, Any]:
        # DiT sample_ddp.py FID-50K settings: 250 sampling steps, cfg-scale 1.5.
        return {"num_steps": 250, "guidance_scale": 1.5}

    @property
    def num_classes(self) -> int | None:
        import json

        config = json.loads((Path(self.path).expanduser() / "transformer" / "config.json").read_text())
        return int(config.get("num_embeds_ada_norm") or 1000)
