"""The sampler's logits processing (spec discrete_sd §0.1), shared by baseline, drafting and verification.

Order (LlamaGen's): CFG on logits -> temperature -> top-k -> top-p -> softmax in float32.
Verification is exact only if it uses the very vector the sampler draws from, so
every caller goes through :func:`process_logits`.
"""

from __future__ import annotations

import torch

from specray.methods.discrete.params import Sampling
from specray.models.discrete_ar import CfgSoftmax

MIN_TEMPERATURE = 1e-5


# The sampler's settings are the discrete methods' typed parameters (validated there, once).
SamplingParams = Sampling


def cfg_combine(cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None, cfg_scale: float) -> torch.Tensor:
    """``l_u + s (l_c - l_u)`` in float32; the cond logits alone when there is no uncond stream."""
    cond = _float32(cond_logits)
    if uncond_logits is None:
        if cfg_scale != 1.0:
            raise ValueError(f"cfg_scale={cfg_scale} needs uncond_logits")
        return cond
    uncond = _float32(uncond_logits)
    return uncond + cfg_scale * (cond - uncond)


def _float32(x: torch.Tensor) -> torch.Tensor:
    """``x.float()`` without its dispatch when ``x`` already is float32 (once per model call)."""
    return x if x.dtype == torch.float32 else x.float()


def top_k_mask(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """Set every logit strictly below the k-th largest to -inf (ties at the k-th value survive)."""
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, float("-inf"))


def top_p_mask(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Drop tokens whose sorted cumulative softmax exceeds ``top_p``, keeping the first crossing one."""
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True, stable=True)
    cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative > top_p
    # Shift right: a token is removed only if the mass *before* it already exceeds top_p.
    remove_sorted[..., 1:] = remove_sorted[..., :-1].clone()
    remove_sorted[..., 0] = False
    remove = torch.zeros_like(remove_sorted).scatter(-1, sorted_idx, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


def process_logits(
    cond_logits: torch.Tensor,
    uncond_logits: torch.Tensor | None,
    cfg_scale: float,
    temperature: float,
    top_k: int,
    top_p: float,
) -> torch.Tensor:
    """Processed sampling distribution ``[..., V]`` float32 from raw logits ``[..., V]``."""
    logits = cfg_combine(cond_logits, uncond_logits, cfg_scale)
    if temperature != 1.0:  # dividing by 1 is exact: skip the op
        logits = logits / max(float(temperature), MIN_TEMPERATURE)
    logits = top_k_mask(logits, int(top_k))
    logits = top_p_mask(logits, float(top_p))
    return torch.softmax(logits, dim=-1, dtype=torch.float32)


def process_with(params: SamplingParams, cond_logits: torch.Tensor, uncond_logits: torch.Tensor | None,
                 token_index: torch.Tensor | None = None) -> torch.Tensor:
    """``token_index [..]`` (the image token each logits row predicts) applies ``cfg_interval``."""
    if uncond_logits is not None and params.cfg_interval >= 0 and token_index is not None:
        guided = cfg_combine(cond_logits, uncond_logits, params.cfg_scale)
        unguided = token_index > params.cfg_interval + 1  # LlamaGen: decode step i makes token i + 1
        mixed = torch.where(unguided[..., None], cond_logits.float(), guided)
        return process_logits(mixed, None, 1.0, params.temperature, params.top_k, params.top_p)
    return process_logits(cond_logits, uncond_logits, params.cfg_scale, params.temperature, params.top_k, params.top_p)


def model_softmax(params: SamplingParams) -> CfgSoftmax | None:
    """The processing as a GPT call can make it itself (:class:`~specray.models.discrete_ar.CfgSoftmax`, the same
    values as :func:`process_with`) where it is CFG and a softmax alone: no temperature, top-k, top-p or CFG
    interval; else None (the caller processes the call's logits)."""
    if params.temperature != 1.0 or params.top_k != 0 or params.top_p < 1.0:
        return None
    if not params.uses_uncond:
        return CfgSoftmax()
    return CfgSoftmax(params.cfg_scale) if params.cfg_interval < 0 else None
