"""The family table as the one extension contract: torch-free validation, typed parameters, one
place per parameter, every lazily imported part resolvable, the row schema enforced."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specray.families import FAMILIES, family
from specray.methods.params import GAMMA_MAX, Gamma, MethodParams, ParamError
from specray.spec import SpecError, builtin_demo_dict, load_job

REPO_ROOT = Path(__file__).resolve().parents[1]

# Python run in a subprocess in which `import torch` (and anything that needs it) fails.
_NO_TORCH = textwrap.dedent("""
    import sys

    class NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is not installed here ({name})")
            return None

    sys.meta_path.insert(0, NoTorch())
""")


def _without_torch(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH + textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)


def test_validation_runs_without_torch():
    jobs = [str(REPO_ROOT / "specray" / "demo.yaml"), *map(str, sorted((REPO_ROOT / "jobs").glob("*.yaml")))]
    proc = _without_torch("""
        import sys
        from specray.cli import main
        for path in sys.argv[1:]:
            try:
                main(["validate", path])
            except SystemExit as exit:
                assert exit.code in (0, None), (path, exit.code)
        assert "torch" not in sys.modules
        print("modules:", sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "torchvision")))
    """, *jobs)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ok: ") == len(jobs), proc.stdout
    assert "modules: []" in proc.stdout


def test_bad_parameter_is_refused_without_torch():
    proc = _without_torch("""
        from specray.spec import SpecError, builtin_demo_dict, load_job
        job = builtin_demo_dict()
        job["arms"][3]["params"] = {"gamma": 0}
        try:
            load_job(job)
        except SpecError as exc:
            print(exc)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("arms[3].params.gamma: must be an integer in [1, 64], got 0")


# ---- gamma (and every parameter) has one definition ---------------------------------------------


def _speculative_arms() -> list[tuple[int, str, str]]:
    """(index in the demo, family, method) of one speculative arm per family."""
    seen: dict[str, tuple[int, str, str]] = {}
    for i, arm in enumerate(builtin_demo_dict()["arms"]):
        if arm["method"] != "target_only" and arm["family"] not in seen:
            seen[arm["family"]] = (i, arm["family"], arm["method"])
    return list(seen.values())


@pytest.mark.parametrize("index,family_name,method", _speculative_arms(), ids=lambda v: str(v))
@pytest.mark.parametrize("bad", [0, GAMMA_MAX + 1, 2.0, "4", True, None])
def test_each_familys_bad_gamma_is_refused_at_spec_time(index, family_name, method, bad, tmp_path):
    job = builtin_demo_dict()
    job["output"] = str(tmp_path / "run")
    job["arms"][index] = {**job["arms"][index], "params": {**job["arms"][index].get("params", {}), "gamma": bad}}
    with pytest.raises(SpecError) as info:
        load_job(job)
    assert info.value.field_path == f"arms[{index}].params.gamma"
    assert str(info.value) == f"arms[{index}].params.gamma: must be an integer in [1, {GAMMA_MAX}], got {bad!r}"
    assert not (tmp_path / "run").exists()


# Other test modules register test families in this process; these checks are about the built-in ones.
BUILTIN = ("discrete_ar", "continuous_ar", "diffusion")


def _builtin_families():
    return [FAMILIES[name] for name in BUILTIN]


def test_every_gamma_is_the_one_shared_definition():
    gamma_fields = [(f.name, m.name, m.params.model_fields["gamma"]) for f in _builtin_families()
                    for m in f.methods.values() if "gamma" in m.params.model_fields]
    assert {f for f, _, _ in gamma_fields} == set(BUILTIN)
    reference = Gamma.__metadata__[0]
    for family_name, method, field in gamma_fields:
        assert field.annotation is int, (family_name, method)
        assert field.metadata == reference.metadata, (family_name, method, field.metadata)


def test_parameters_are_strict_and_name_the_field():
    lantern = family("discrete_ar").method("lantern").params
    assert lantern.parse({"lam": 3}).lam == 3.0  # an integer is a number
    for raw, field, words in [
        ({"top_k": 2.0}, "top_k", "an integer >= 0"),
        ({"lam": "3"}, "lam", "a number or null"),
        ({"forbid_zero_target_mass": 1}, "forbid_zero_target_mass", "true or false"),
        ({"mode": "kappa"}, "mode", "one of 'lambda', 'delta'"),
        ({"temperature": float("nan")}, "temperature", "a number >= 0"),
        ({"mode": "delta"}, "delta", "in mode 'delta'"),
        ({"gama": 3}, "gama", "unknown parameter; allowed: ["),
    ]:
        with pytest.raises(ParamError) as info:
            lantern.parse(raw)
        assert info.value.field == field and words in info.value.message, (raw, str(info.value))


def test_lossless_flags_come_from_the_parameter_classes():
    def lossless(family_name: str, method: str, **params) -> bool:
        return family(family_name).parse_params(method, params).lossless

    assert lossless("discrete_ar", "sd") and lossless("discrete_ar", "block")
    assert not lossless("discrete_ar", "lantern") and lossless("discrete_ar", "lantern", lam=1.0)
    assert not lossless("discrete_ar", "cool_sd", delta=2.0) and lossless("discrete_ar", "cool_sd", delta=0.2)
    assert not lossless("discrete_ar", "uniform_rsd") and lossless("discrete_ar", "uniform_rsd", delta=1.0)
    assert lossless("continuous_ar", "cspd") and not lossless("continuous_ar", "cspd", mode="paper")
    assert lossless("diffusion", "spec_block") and lossless("diffusion", "spec_token", rejection="residual")


def test_every_lazy_part_of_the_table_resolves():
    for entry in _builtin_families():
        assert callable(entry.loop()) and callable(entry.load_pair()) and callable(entry.trainer())
        for method in entry.methods.values():
            assert issubclass(method.params, MethodParams)
            method.params.parse({})  # every default is valid
            if method.rule is not None:
                assert callable(method.rule())


def test_a_method_that_needs_a_draft_without_one_is_refused(tmp_path):
    job = builtin_demo_dict()
    job["output"] = str(tmp_path / "run")
    index = next(i for i, a in enumerate(job["arms"]) if a["method"] == "spec_block" and a["params"]["drafter"] == "model")
    job["arms"][index] = {k: v for k, v in job["arms"][index].items() if k != "draft"}
    with pytest.raises(SpecError, match=rf"^arms\[{index}\]\.draft: method 'spec_block' with these params needs"):
        load_job(job)


def test_eval_options_are_checked_with_the_job(tmp_path):
    job = {**builtin_demo_dict(), "output": str(tmp_path / "run")}
    for options, field, words in [({"feature_extractr": "x"}, "feature_extractr", "unknown reducer option"),
                                  ({"feature_extractor": "clip"}, "feature_extractor", "one of 'specray-digits'"),
                                  ({"confidence": 1.2}, "confidence", "a number in (0, 1)")]:
        with pytest.raises(SpecError) as info:
            load_job({**job, "eval": {**job["eval"], "options": options}})
        assert info.value.field_path == f"eval.options.{field}" and words in str(info.value)


# ---- the row schema ----------------------------------------------------------------------------


def test_a_row_with_a_missing_or_extra_column_is_an_error():
    from specray.runtime.store import SAMPLE_SCHEMA, RowSchemaError, rows_to_table

    row = {name: None for name in SAMPLE_SCHEMA.names}
    row.update(arm="sd", sample_id=3)
    assert rows_to_table([row]).num_rows == 1
    missing = {k: v for k, v in row.items() if k != "target_calls"}
    with pytest.raises(RowSchemaError, match=r"missing columns \['target_calls'\], unexpected columns \[\]"):
        rows_to_table([row, missing])
    with pytest.raises(RowSchemaError, match=r"row 0 \(arm 'sd', sample_id 3\).*unexpected columns \['colour'\]"):
        rows_to_table([{**row, "colour": "red"}])
