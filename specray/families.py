"""The family table: the one extension contract of specray.

A *family* is a kind of generator (discrete-token AR, continuous-token AR, diffusion) with one
decoding loop, one way to load a target/draft pair and one trainer for its built-in presets. A
*method* is an entry of its family: a typed parameter class (``methods/<family>/params.py``,
validated once when the job is loaded) and, where the family's loop asks for one, the
verification rule it plugs in.

Everything here is importable without torch: the spec validates jobs from this table on a
machine that has no torch. The torch-side parts (loop, loader, trainer, rules) are reached
through small functions that import them on first use, inside the actor or the trainer.

To add a method, a family or a checkpoint format, read ``docs/extending.md``: it is an entry
here plus the files the entry names. Out-of-tree code (tests, plugins) adds entries with
:func:`register_family` and :func:`register_method`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from specray.methods.continuous import params as continuous_params
from specray.methods.diffusion import params as diffusion_params
from specray.methods.discrete import params as discrete_params
from specray.methods.params import MethodParams, StrictParams
from specray.models import draft_formats as _draft_formats
from specray.models.checkpoints import options as checkpoint_options

# A zero-argument function that imports and returns a torch-side object (a loop, a loader...).
Lazy = Callable[[], Any]


@dataclass(frozen=True)
class Method:
    """One decoding method of a family.

    ``params``: its parameter class. ``rule``: for families whose loop plugs in a verification
    rule (the discrete family), a function returning the rule factory
    ``factory(params, pair) -> verify(P, Q, drafts, u_accept, u_residual) -> VerifyOutput``.
    """

    name: str
    params: type[MethodParams]
    rule: Lazy | None = None
    summary: str = ""


@dataclass(frozen=True)
class ModelFormat:
    """A checkpoint format a family loads, named in a job as ``{format: NAME, ...options}``.

    ``options``: the typed options class (torch-free); the spec validates a reference with it
    before Ray starts, so it should check what it can without reading tensors (the file exists,
    its header is sound, the size is known). ``load()`` returns ``load(options, device)``, which
    returns what the family's ``load_pair`` needs for one model.
    """

    name: str
    options: type[StrictParams]
    load: Lazy
    summary: str = ""
    conditions: str = "class_labels"  # the job conditions its models take: "class_labels" or "prompts"


@dataclass(frozen=True)
class Family:
    """A model family: its methods, the checkpoint formats it loads, and where its loop, model
    loader and trainer live.

    ``loop()`` returns ``run_batch(method, params, pair, labels, sample_ids, seed) ->
    GenerationResult``; ``load_pair()`` returns ``load_pair(target, draft, device) -> ModelPair``
    (``target``/``draft``: a preset name, a ``.safetensors`` path, or a ``{format: ...}`` mapping
    already validated by the spec); ``trainer()`` returns ``train_preset(name, out_dir, seed) -> Path``.
    """

    name: str
    summary: str
    methods: Mapping[str, Method]
    loop: Lazy
    load_pair: Lazy
    trainer: Lazy
    formats: Mapping[str, ModelFormat] = field(default_factory=dict)
    # Free-form facts about the family; "preset_weights": its presets read weights/<name>.safetensors
    # (the spec refuses a preset whose file is missing).
    metadata: Mapping[str, Any] = field(default_factory=dict)
    # Cross-checks of an arm that need its models and its parameters together, torch-free:
    # check_arm(params, target, draft) -> (field under the arm, message) or None.
    check_arm: Callable[[MethodParams, Any, Any], tuple[str, str] | None] | None = None
    # The job field ``compile: true``: compile() returns compile_pair(pair) -> None, which switches the
    # loaded pair to its compiled path (the same law as eager, up to the kernels' last bits). None: the
    # family has no compiled path.
    compile: Lazy | None = None

    def method(self, name: str) -> Method:
        try:
            return self.methods[name]
        except KeyError:
            raise KeyError(f"unknown method {name!r} for family {self.name!r}; "
                           f"allowed: {', '.join(self.methods)}") from None

    def parse_params(self, method: str, raw: Mapping[str, Any] | None) -> MethodParams:
        """``method``'s validated parameters (raises ParamError naming the bad field)."""
        return self.method(method).params.parse(raw)

    def target_law(self, method: str, params: Mapping[str, Any] | MethodParams | None) -> dict[str, Any] | None:
        """The ``target_only`` parameters whose law ``method`` with ``params`` claims (None: no claim, or the
        family has no ``target_only``)."""
        if "target_only" not in self.methods:
            return None
        typed = params if isinstance(params, MethodParams) else self.parse_params(method, params)
        return typed.target_law(self.methods["target_only"].params)

    def model_format(self, name: str) -> ModelFormat:
        try:
            return self.formats[name]
        except KeyError:
            allowed = ", ".join(self.formats) or "none (use a preset name or a .safetensors path)"
            raise KeyError(f"unknown model format {name!r} for family {self.name!r}; allowed: {allowed}") from None


def _methods(*entries: Method) -> dict[str, Method]:
    return {entry.name: entry for entry in entries}


# ---- the torch-side parts, each imported on first use ---------------------------------------


def _discrete_loop():
    from specray.methods.discrete.loop import run_batch
    return run_batch


def _discrete_rule():
    from specray.methods.discrete.rules import verifier_for
    return verifier_for


def _discrete_models():
    from specray.models.discrete_ar import load_pair
    return load_pair


def _discrete_compile():
    from specray.models.compiled import compile_pair
    return compile_pair


def _continuous_compile():
    from specray.models.compiled import compile_continuous_pair
    return compile_continuous_pair


def _discrete_trainer():
    from specray.models.discrete_train import train_preset
    return train_preset


def _head_file_loader():
    from specray.models.eagle_head import load_head_file
    return load_head_file


def _lantern_drafter_loader():
    from specray.models.lantern_drafter import load_lantern_drafter
    return load_lantern_drafter


def _discrete_arm_check(params: MethodParams, target: Any, draft: Any) -> tuple[str, str] | None:
    """An EAGLE head is only a draft, and a static tree drafts only with a head."""
    from specray.models.draft_formats import is_head_reference

    if is_head_reference(target):
        return "target", "is an EAGLE draft head; a head can only be a draft (name a GPT target)"
    if getattr(params, "tree", None) is not None and not is_head_reference(draft):
        return "params.tree", ("static-tree drafting needs an EAGLE head as the draft: digits-gpt-eagle, a head "
                               ".safetensors, or {format: eagle-head | lantern-llamagen}; "
                               f"{draft!r} is a separate draft model")
    return None


def _continuous_loop():
    from specray.methods.continuous.loop import run_batch
    return run_batch


def _continuous_models():
    from specray.models.continuous_ar import load_pair
    return load_pair


def _continuous_trainer():
    from specray.models.continuous_train import train_preset
    return train_preset


def _diffusion_loop():
    from specray.methods.diffusion.loop import run_batch
    return run_batch


def _diffusion_models():
    from specray.models.diffusion import load_pair
    return load_pair


def _diffusion_trainer():
    from specray.models.diffusion_train import train_preset
    return train_preset


def _llamagen_loader():
    from specray.models.checkpoints.llamagen import load
    return load


def _llamagen_t2i_loader():
    from specray.models.checkpoints.llamagen_t2i import load
    return load


def _mar_loader():
    from specray.models.checkpoints.mar import load
    return load


def _ddpm_loader():
    from specray.models.checkpoints.diffusers_models import load_ddpm
    return load_ddpm


def _dit_loader():
    from specray.models.checkpoints.diffusers_models import load_dit
    return load_dit


# ---- the table -------------------------------------------------------------------------------

_opts = checkpoint_options

_dp, _cp, _fp = discrete_params, continuous_params, diffusion_params

FAMILIES: dict[str, Family] = {
    "discrete_ar": Family(
        name="discrete_ar",
        summary="LlamaGen-style GPT over discrete image tokens (spec discrete_sd.md)",
        methods=_methods(
            Method("target_only", _dp.TargetOnly, summary="plain sampling from the target"),
            Method("sd", _dp.SD, _discrete_rule, "speculative sampling (exact)"),
            Method("block", _dp.Block, _discrete_rule, "block verification (exact)"),
            Method("lantern", _dp.Lantern, _discrete_rule, "LANTERN / LANTERN++ relaxed acceptance"),
            Method("cool_sd", _dp.CoolSD, _discrete_rule, "COOL-SD annealed relaxation, G* residual"),
            Method("uniform_rsd", _dp.UniformRSD, _discrete_rule, "COOL-SD with a constant multiplier"),
        ),
        loop=_discrete_loop, load_pair=_discrete_models, trainer=_discrete_trainer,
        metadata={"preset_weights": True},  # its presets load weights/<name>.safetensors
        formats={
            "llamagen-c2i": ModelFormat("llamagen-c2i", _opts.LlamaGenOptions, _llamagen_loader,
                                        "LlamaGen class-conditional GPT (c2i_*.pt) + VQ-16 tokenizer"),
            "llamagen-t2i": ModelFormat("llamagen-t2i", _opts.LlamaGenT2IOptions, _llamagen_t2i_loader,
                                        "LlamaGen text-to-image GPT-XL (t2i_XL_stage*.pt, T5 caption prefix) "
                                        "+ VQ-16 tokenizer", conditions="prompts"),
            "eagle-head": ModelFormat("eagle-head", _draft_formats.EagleHeadFile, _head_file_loader,
                                      "an EAGLE draft head written by `specray train` (draft only)"),
            "lantern-llamagen": ModelFormat("lantern-llamagen", _draft_formats.LanternDrafter,
                                            _lantern_drafter_loader,
                                            "a drafter released by LANTERN for LlamaGen, as an EAGLE head"),
        },
        check_arm=_discrete_arm_check,
        compile=_discrete_compile,
    ),
    "continuous_ar": Family(
        name="continuous_ar",
        summary="MAR-style AR transformer over continuous tokens with a diffusion head (spec cspd.md)",
        methods=_methods(
            Method("target_only", _cp.TargetOnly, summary="one token per step from the target's head"),
            Method("cspd", _cp.CSpD, summary="continuous speculative decoding"),
        ),
        loop=_continuous_loop, load_pair=_continuous_models, trainer=_continuous_trainer,
        metadata={"preset_weights": True},
        formats={"mar": ModelFormat("mar", _opts.MAROptions, _mar_loader,
                                    "MAR-B/L/H release (checkpoint-last.pth, EMA weights) + KL-16 VAE")},
        compile=_continuous_compile,
    ),
    "diffusion": Family(
        name="diffusion",
        summary="DDPM denoisers (diffusers UNet2DModel) (spec spec_diffusion.md)",
        methods=_methods(
            Method("target_only", _fp.TargetOnly, summary="ancestral sampling, one target call per step"),
            Method("spec_token", _fp.SpecToken, summary="speculative sampling, token verification"),
            Method("spec_block", _fp.SpecBlock, summary="speculative sampling, block verification"),
        ),
        loop=_diffusion_loop, load_pair=_diffusion_models, trainer=_diffusion_trainer,
        metadata={"preset_weights": True},
        formats={
            "diffusers-ddpm": ModelFormat("diffusers-ddpm", _opts.DDPMOptions, _ddpm_loader,
                                          "diffusers UNet2DModel + DDPMScheduler folder (google/ddpm-*)"),
            "diffusers-dit": ModelFormat("diffusers-dit", _opts.DiTOptions, _dit_loader,
                                         "diffusers DiT pipeline folder (facebook/DiT-XL-2-256) + AutoencoderKL"),
        },
    ),
}


def family(name: str) -> Family:
    """The family called ``name`` (KeyError naming the allowed families)."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown family {name!r}; allowed: {', '.join(sorted(FAMILIES))}") from None


def load_pair(family_name: str, target: str, draft: str | None, device: Any):
    """``family_name``'s target/draft pair on ``device`` (a :class:`~specray.models.pair.ModelPair`)."""
    return family(family_name).load_pair()(target, draft, device)


def load_formatted_model(family_name: str, ref: Mapping[str, Any], device: Any) -> Any:
    """One model from a ``{format: NAME, ...}`` reference, by the family's loader for that format."""
    entry = family(family_name).model_format(str(ref.get("format")))
    options = entry.options.parse({k: v for k, v in ref.items() if k != "format"})
    return entry.load()(options, device)


def format_options(family_name: str, ref: Any) -> StrictParams | None:
    """The typed options of a ``{format: ...}`` reference (None for a preset name or a path)."""
    if not isinstance(ref, Mapping):
        return None
    entry = family(family_name).model_format(str(ref.get("format")))
    return entry.options.parse({k: v for k, v in ref.items() if k != "format"})


def resolve(family_name: str, method: str | Method,
            params: MethodParams | Mapping[str, Any] | None) -> tuple[Method, MethodParams]:
    """A method entry and typed parameters from names and a mapping (already-typed values pass through)."""
    entry = family(family_name).method(method) if isinstance(method, str) else method
    if not isinstance(params, MethodParams):
        params = entry.params.parse(params)
    elif not isinstance(params, entry.params):
        raise TypeError(f"method {entry.name!r} takes {entry.params.__name__}, got {type(params).__name__}")
    return entry, params


def register_family(entry: Family) -> Family:
    """Add (or replace) a family. Ray workers need the same call: see ``docs/extending.md``."""
    FAMILIES[entry.name] = entry
    return entry


def unregister_family(name: str) -> None:
    FAMILIES.pop(name, None)


def register_method(family_name: str, method: Method) -> Method:
    """Add (or replace) a method of an existing family."""
    current = family(family_name)
    FAMILIES[family_name] = replace(current, methods={**current.methods, method.name: method})
    return method


def register_format(family_name: str, model_format: ModelFormat) -> ModelFormat:
    """Add (or replace) a checkpoint format of an existing family."""
    current = family(family_name)
    FAMILIES[family_name] = replace(current, formats={**current.formats, model_format.name: model_format})
    return model_format


def unregister_format(family_name: str, name: str) -> None:
    current = family(family_name)
    FAMILIES[family_name] = replace(current, formats={k: v for k, v in current.formats.items() if k != name})


def unregister_method(family_name: str, name: str) -> None:
    current = family(family_name)
    FAMILIES[family_name] = replace(current, methods={k: v for k, v in current.methods.items() if k != name})
