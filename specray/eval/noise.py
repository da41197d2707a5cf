"""Is an arm's FID "within noise" of target_only's? Seed-to-seed spread from replica arms.

Replicas: arms that differ from a ``target_only`` arm only in ``seed_offset``
(same family/target/draft/method/params otherwise; ``checks.replica_key``).
Together with the base arm they give ``k >= 2`` FIDs of the same sampler at
independent seeds; their mean and sample standard deviation (ddof=1) measure
seed-to-seed spread at this sample count.

Criterion (documented in report.md): a lossless arm is within the seed spread
when ``|FID_arm - mean| <= 2 * sd``. With few seeds the sd is itself noisy (at
k=2 it is |a-b|/sqrt(2)), so the report states k next to the verdict; the
paired-bootstrap difference interval (``fid.diff_vs_baseline``) is the second,
seed-free statement of the same question.

Lossless methods (their samples follow the target's distribution exactly) are the ones whose
parameter class says so (``lossless`` in the family table's ``methods/<family>/params.py``): for
example ``sd`` and ``block``, ``cspd`` with ``mode: exact``, the diffusion family's speculative
methods, and the relaxed rules at settings that relax nothing.
"""

from __future__ import annotations

import math
from typing import Any

from specray.eval.checks import replica_key, seed_offset

WITHIN_SD = 2.0


def is_lossless(family: str | None, method: str | None, params: dict[str, Any] | None) -> bool:
    """Whether an arm (other than a target_only baseline) claims to sample the target's law.

    Read from the method's parameter class; an arm the family table no longer knows, or whose
    stored parameters it refuses (a run written by an older specray), claims nothing.
    """
    from specray.families import FAMILIES
    from specray.methods.params import ParamError

    if method in (None, "target_only") or family not in FAMILIES or method not in FAMILIES[family].methods:
        return False
    try:
        return FAMILIES[family].parse_params(method, params or {}).lossless
    except ParamError:
        return False


def claimed_law(family: str | None, method: str | None, params: dict[str, Any] | None) -> dict[str, Any] | None:
    """The ``target_only`` parameters whose law an arm claims (the family table says; None: no claim)."""
    from specray.families import FAMILIES
    from specray.methods.params import ParamError

    if family not in FAMILIES or method not in FAMILIES[family].methods:
        return None
    try:
        return FAMILIES[family].target_law(method, _without_seed_offset(params))
    except ParamError:
        return None


def law_note(family: str | None, method: str | None, params: dict[str, Any] | None) -> str | None:
    """What an arm's claimed law means when it is not plainly target_only's (the parameter class says)."""
    from specray.families import FAMILIES
    from specray.methods.params import ParamError

    if family not in FAMILIES or method not in FAMILIES[family].methods:
        return None
    try:
        return FAMILIES[family].parse_params(method, _without_seed_offset(params)).law_note
    except ParamError:
        return None


def target_only_params(family: str | None, params: dict[str, Any] | None) -> dict[str, Any] | None:
    """A target_only arm's parameters with the family's defaults filled in (comparable with a claimed law)."""
    from specray.families import FAMILIES
    from specray.methods.params import ParamError

    if family not in FAMILIES or "target_only" not in FAMILIES[family].methods:
        return None
    try:
        return FAMILIES[family].parse_params("target_only", _without_seed_offset(params)).to_dict()
    except ParamError:
        return None


def _without_seed_offset(params: dict[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (params or {}).items() if k != "seed_offset"}


def seed_spread(arm_entries: list[dict[str, Any]], arm_infos: dict[str, dict[str, Any]],
                within_sd: float = WITHIN_SD) -> list[dict[str, Any]]:
    """One record per target_only replica group with >= 2 seeds; marks each arm entry's ``fid.seed_spread``.

    A lossless arm is judged against the group of the target_only arm it claims the law of (its
    entry's ``law_baseline``), never against a target_only of another law.
    """
    fid_of = {e["arm"]: (e.get("fid") or {}).get("value") for e in arm_entries}
    groups: dict[str, list[str]] = {}
    for entry in arm_entries:
        info = arm_infos.get(entry["arm"], {})
        if info.get("method") == "target_only":
            groups.setdefault(replica_key(info), []).append(entry["arm"])
    records = []
    for arms in groups.values():
        values = [fid_of[a] for a in arms if fid_of[a] is not None and math.isfinite(fid_of[a])]
        if len(values) < 2:
            continue
        mean = sum(values) / len(values)
        sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
        info = arm_infos[arms[0]]
        record = {"family": info.get("family"), "target": info.get("target"), "arms": arms,
                  "seed_offsets": [seed_offset(arm_infos[a]) for a in arms], "fids": values,
                  "mean": mean, "sd": sd, "num_seeds": len(values), "min": min(values), "max": max(values),
                  "criterion": f"|FID - mean| <= {within_sd:g} * sd", "lossless_arms": {}}
        for entry in arm_entries:
            if entry.get("law_baseline") not in arms:
                continue
            value = fid_of[entry["arm"]]
            within = value is not None and abs(value - mean) <= within_sd * sd
            verdict = {"group": arms[0], "mean": mean, "sd": sd, "num_seeds": len(values),
                       "z": (value - mean) / sd if value is not None and sd > 0 else None, "within": bool(within)}
            record["lossless_arms"][entry["arm"]] = verdict
            entry["fid"]["seed_spread"] = verdict
        records.append(record)
    return records
