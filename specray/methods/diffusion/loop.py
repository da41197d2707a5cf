"""Decoding loops of the diffusion family: plain ancestral sampling and speculative sampling
over denoising steps (spec_diffusion.md sections 2, 3, 5, 6).

The speculative core, :func:`speculative_chain`, works on any chain of affine-Gaussian
steps ``x_{k+1} = A_k x + B_k eps(x, k) + sigma_k xi`` (a :class:`GaussianChain`), so the
exactness tests run the very same code on linear-Gaussian chains with a known law.
It is batched over ragged rows: every row has its own step index ``k``, block length
``g = min(gamma, K_s - k)``, round counter and stale epsilon; finished rows leave the batch.

Randomness (``specray.rng``), keyed by (seed, sample_id, stream, position, step):
``x_T`` (initial noise), ``eps`` (target_only step noise, position 0, step k),
``draft`` (draft noise xi), ``accept`` (coins), ``residual`` / ``residual_noise`` (psi_alpha
uniform and orthogonal noise). For the speculative streams ``position`` is the row's round
index and ``step`` the denoising step: draws at the same step in different rounds must be
independent, otherwise a rejected round's noise would leak into the next round's draft.

Statistics per row (SampleStats): ``num_tokens`` = K denoising steps; ``num_spec_steps`` =
rounds; ``num_draft_tokens`` = steps drafted; ``num_accepted_draft_tokens``; ``accepted_per_position``
(length gamma); ``target_calls`` = sequential target calls the row took part in (a batched call
on gamma states counts once; the deterministic final step counts one); ``draft_calls`` = draft
network calls; ``extra``: ``states_evaluated`` (target states, CFG not doubled),
``block_efficiency`` (speculated steps per round), ``expected_advance_per_round``
(Rao-Blackwellised, sum of w_i), ``guidance_scale``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specray import rng
from specray.families import Method, resolve
from specray.methods.common import GenerationResult, RoundTally, SampleStats, bind_conditions
from specray.methods.diffusion.params import Common, Speculative
from specray.methods.diffusion.residual import reflect, sample_residual
from specray.methods.diffusion.rules import block_verify, log_ratio, token_verify

FAMILY = "diffusion"
DRAFTERS = ("frozen", "free", "model")
VERIFICATIONS = ("token", "block")
REJECTIONS = ("reflection", "residual")
RESIDUAL_ALPHAS = ("w_tau", "one")  # "one" is the wrong rule, kept only as a negative control

EpsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class GaussianChain:
    """What speculative sampling needs from a sampler: per-step coefficients and the networks.

    ``target_eps(x [n, ...], k [n], rows [n]) -> eps [n, ...]``: one batched call at per-row steps
    ``k`` for batch rows ``rows`` (used to look up class labels). ``draft_eps`` likewise (optional).
    """

    A: torch.Tensor  # float64 [K_s]
    B: torch.Tensor  # float64 [K_s]
    sigma: torch.Tensor  # float64 [K_s], all > 0
    target_eps: EpsFn
    draft_eps: EpsFn | None = None
    # x0-clipped mean tables (c1, c2, r, r1) [K_s]: mean = c1 clip(r x - r1 eps, -1, 1) + c2 x (diffusers'
    # clip_sample); None: the mean is affine, A x + B eps.
    clipped_mean: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def num_steps(self) -> int:
        return int(self.A.numel())


class ChainStats(RoundTally):
    """The shared round tally plus the diffusion family's own per-row counters:
    ``states_evaluated`` (target states, CFG not doubled) and ``expected_advance``
    (Rao-Blackwellised steps per round, summed over rounds)."""

    def __init__(self, batch: int, gamma: int, num_steps: int, device: torch.device | str = "cpu") -> None:
        super().__init__(batch, gamma, num_steps, device)
        self.states_evaluated = torch.zeros(batch, dtype=torch.int64, device=device)
        self.expected_advance = torch.zeros(batch, dtype=torch.float64, device=device)


def _coef(table: torch.Tensor, k: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row coefficient broadcast against ``like`` [n, ...] (indices clamped for padding rows)."""
    v = table[k.clamp(max=table.numel() - 1)]
    return v.reshape(-1, *([1] * (like.dim() - 1)))


def _mean(chain: GaussianChain, x: torch.Tensor, eps: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``A x + B eps`` in float64 (with x0 clipping: ``c1 clip(r x - r1 eps) + c2 x``)."""
    x64 = x.to(torch.float64)
    if chain.clipped_mean is not None:
        c1, c2, r, r1 = (_coef(t, k, x64) for t in chain.clipped_mean)
        return c1 * (r * x64 - r1 * eps.to(torch.float64)).clamp(-1.0, 1.0) + c2 * x64
    return _coef(chain.A, k, x64) * x64 + _coef(chain.B, k, x64) * eps.to(torch.float64)


def _step(chain: GaussianChain, x: torch.Tensor, eps: torch.Tensor, k: torch.Tensor, xi: torch.Tensor) -> torch.Tensor:
    """``A x + B eps + sigma xi`` in float64, returned in the state's dtype."""
    out = _mean(chain, x, eps, k) + _coef(chain.sigma, k, xi) * xi.to(torch.float64)
    return out.to(x.dtype)


def ancestral_chain(chain: GaussianChain, x: torch.Tensor, sample_ids: torch.Tensor, seed: int) -> torch.Tensor:
    """Plain ancestral sampling: K_s sequential target calls, noise from stream ``eps``."""
    rows = torch.arange(x.shape[0], device=x.device)
    for k in range(chain.num_steps):
        kk = torch.full_like(rows, k)
        xi = rng.normal(seed, sample_ids, "eps", 0, k, shape=x.shape[1:], device=x.device, dtype=torch.float64)
        x = _step(chain, x, chain.target_eps(x, kk, rows), kk, xi)
    return x


def speculative_chain(
    chain: GaussianChain,
    x: torch.Tensor,
    sample_ids: torch.Tensor,
    seed: int,
    *,
    drafter: str,
    verification: str,
    rejection: str,
    gamma: int,
    residual_alpha: str = "w_tau",
) -> tuple[torch.Tensor, ChainStats]:
    """Run all rows from step 0 to ``chain.num_steps`` by draft / verify / resample rounds.

    ``drafter``: ``frozen`` (one target call at the round start, its eps reused for all
    drafts), ``free`` (reuse the target eps of the state preceding the current one on the
    accepted chain; a row's first round is a Frozen round), ``model`` (``chain.draft_eps``).
    ``verification``: ``token`` or ``block``. ``rejection``: ``reflection`` (P25; exact for
    token verification only) or ``residual`` (psi_alpha). ``residual_alpha="one"`` is the
    wrong rule for block verification, kept for the negative-control test.
    """
    _check("drafter", drafter, DRAFTERS)
    _check("verification", verification, VERIFICATIONS)
    _check("rejection", rejection, REJECTIONS)
    _check("residual_alpha", residual_alpha, RESIDUAL_ALPHAS)
    if drafter == "model" and chain.draft_eps is None:
        raise ValueError("drafter='model' needs a draft model (pair.draft is None)")
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    device = x.device
    batch, shape = x.shape[0], x.shape[1:]
    K = chain.num_steps
    x = x.clone()
    k = torch.zeros(batch, dtype=torch.int64, device=device)
    stale = torch.zeros_like(x)
    has_stale = torch.zeros(batch, dtype=torch.bool, device=device)
    stats = ChainStats(batch, gamma, K, device)

    while True:
        act = torch.nonzero(k < K).flatten()
        if act.numel() == 0:
            break
        n = act.numel()
        kk, sid = k[act], sample_ids[act]
        r = stats.rounds[act]
        g = torch.clamp(K - kk, max=gamma)
        G = int(g.max())
        positions = torch.arange(G, device=device)
        valid = positions[None, :] < g[:, None]
        calls = torch.zeros(n, dtype=torch.int64, device=device)
        states = torch.zeros(n, dtype=torch.int64, device=device)
        draft_calls = torch.zeros(n, dtype=torch.int64, device=device)

        y0 = x[act]
        E = torch.zeros((n, G) + tuple(shape), dtype=x.dtype, device=device)
        known = torch.zeros(n, G, dtype=torch.bool, device=device)
        frozen = torch.full((n,), drafter == "frozen", device=device) | ((drafter == "free") & ~has_stale[act])
        if frozen.any():  # the Frozen round's sequential call at the round start
            f = torch.nonzero(frozen).flatten()
            E[f, 0] = chain.target_eps(y0[f], kk[f], act[f])
            known[f, 0] = True
            calls[f] += 1
            states[f] += 1
        fixed_eps = torch.where(_bcast(frozen, y0), E[:, 0], stale[act])

        xi = rng.normal(seed, sid[:, None], "draft", r[:, None], kk[:, None] + positions[None, :], shape=shape, device=device, dtype=torch.float64)
        ys = [y0]
        eps_draft = torch.zeros_like(E)
        for j in range(G):
            if drafter == "model":
                live = torch.nonzero(valid[:, j]).flatten()
                eps_draft[live, j] = chain.draft_eps(ys[j][live], kk[live] + j, act[live])
                draft_calls[live] += 1
            else:
                eps_draft[:, j] = fixed_eps
            ys.append(_step(chain, ys[j], eps_draft[:, j], kk + j, xi[:, j]))
        Y = torch.stack(ys, dim=1)  # [n, G+1, ...]

        need = valid & ~known  # the parallel verification pass
        ri, ji = torch.nonzero(need, as_tuple=True)
        if ri.numel():
            E[ri, ji] = chain.target_eps(Y[ri, ji], kk[ri] + ji, act[ri])
            calls += need.any(dim=1).to(torch.int64)
            states += need.sum(dim=1)

        Bk = _coef(chain.B, (kk[:, None] + positions[None, :]).flatten(), E.flatten(0, 1)).reshape((n, G) + (1,) * len(shape))
        Sk = _coef(chain.sigma, (kk[:, None] + positions[None, :]).flatten(), E.flatten(0, 1)).reshape((n, G) + (1,) * len(shape))
        if chain.clipped_mean is None:
            Delta = Bk * (eps_draft.to(torch.float64) - E.to(torch.float64)) / Sk
        else:  # not affine in eps: the difference of the two means (spec_diffusion 1.2)
            flat_k = (kk[:, None] + positions[None, :]).flatten()
            drafted = Y[:, :G].flatten(0, 1)
            gap = _mean(chain, drafted, eps_draft.flatten(0, 1), flat_k) - _mean(chain, drafted, E.flatten(0, 1), flat_k)
            Delta = gap.reshape(Sk.shape[:2] + gap.shape[1:]) / Sk
        Delta = torch.where(_bcast(valid, Delta), Delta, torch.zeros_like(Delta))
        log_rho, delta = log_ratio(Delta, xi)
        eta = 1.0 - rng.uniform(seed, sid[:, None], "accept", r[:, None], kk[:, None] + positions[None, :], device=device)
        verdict = (token_verify if verification == "token" else block_verify)(log_rho, delta, g, eta)
        tau = verdict.tau

        rows = torch.arange(n, device=device)
        x_new = Y[rows, g].clone()
        cut = torch.nonzero(tau < g).flatten()
        if cut.numel():
            t_c, k_c = tau[cut], kk[cut] + tau[cut]
            m_q = _mean(chain, Y[cut, t_c], E[cut, t_c], k_c)
            sigma_c = chain.sigma[k_c]
            if rejection == "reflection":
                x_new[cut] = reflect(m_q, Delta[cut, t_c], sigma_c, xi[cut, t_c]).to(x.dtype)
            else:
                log_alpha = verdict.log_alpha[cut] if residual_alpha == "w_tau" else torch.zeros_like(verdict.log_alpha[cut])
                u = 1.0 - rng.uniform(seed, sid[cut], "residual", r[cut], k_c, device=device)
                zeta = rng.normal(seed, sid[cut], "residual_noise", r[cut], k_c, shape=shape, device=device, dtype=torch.float64)
                x_new[cut] = sample_residual(m_q, Delta[cut, t_c], sigma_c, log_alpha, u, zeta).to(x.dtype)

        rejected = tau < g
        src = torch.where(rejected, tau, g - 1)  # eps of the state preceding the new one (spec 2.3)
        stale[act] = E[rows, src]
        has_stale[act] = True
        x[act] = x_new
        k[act] = kk + torch.where(rejected, tau + 1, g)

        # block slot j is step kk + j; tau <= g, so the accepted slots lie within the drafted ones
        stats.observe(act, kk[:, None] + positions[None, :], valid, positions[None, :] < tau[:, None])
        stats.add_calls(act, target=calls, draft=draft_calls)
        stats.states_evaluated[act] += states
        stats.expected_advance[act] += verdict.expected_advance.to(stats.expected_advance.device)
    return x, stats


def _bcast(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape + (1,) * (like.dim() - mask.dim()))


def _check(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def model_chain(pair, params: Common, labels: torch.Tensor):
    """The GaussianChain of a loaded diffusion pair, plus its step table."""
    from specray.models.diffusion import gaussian_steps

    steps = gaussian_steps(pair.info["scheduler"], params.num_steps, params.sampler, params.churn)
    device = pair.device
    timesteps = steps.timesteps.to(device)
    scale = params.guidance_scale
    labels = labels.to(device)

    def network(model) -> EpsFn:
        def eps(x: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return model(x, timesteps[k], labels[rows], scale)

        return eps

    chain = GaussianChain(
        A=steps.A.to(device), B=steps.B.to(device), sigma=steps.sigma.to(device),
        target_eps=network(pair.target), draft_eps=network(pair.draft) if pair.draft is not None else None,
        clipped_mean=None if steps.clipped_mean is None else tuple(t.to(device) for t in steps.clipped_mean),
    )
    return chain, steps


def run_batch(method: str | Method, params: Any, pair, labels: torch.Tensor, sample_ids: torch.Tensor,
              seed: int) -> GenerationResult:
    """Generate one image per (label, sample_id); images uint8 [B, H, W]. ``method``/``params`` as
    names and a mapping, or as the family table's entry and typed parameters."""
    from specray.models.diffusion import final_step, to_uint8_image

    method, params = resolve(FAMILY, method, params)
    if params.needs_draft and pair.draft is None:
        raise ValueError("drafter='model' needs a draft model: set the arm's draft (e.g. digits-ddpm-draft)")
    device = pair.device
    sample_ids = sample_ids.to(device)
    labels = bind_conditions(labels, pair)
    chain, steps = model_chain(pair, params, labels)
    x = rng.normal(seed, sample_ids, "x_T", shape=pair.info["image_shape"], device=device, dtype=torch.float32)
    batch, K = x.shape[0], steps.num_steps
    if isinstance(params, Speculative):
        x, cs = speculative_chain(chain, x, sample_ids, seed, drafter=params.drafter,
                                  verification=params.verification, rejection=params.rejection, gamma=params.gamma)
    else:
        x, cs = ancestral_chain(chain, x, sample_ids, seed), None
    last = torch.full((batch,), K - 1, dtype=torch.int64, device=device)
    eps = pair.target(x, steps.timesteps.to(device)[last], labels.to(device), params.guidance_scale)
    decode = pair.info.get("image_decoder")  # a latent model's VAE; pixel models are their own images
    x0 = final_step(x, eps, steps.final_alpha_bar, clip=decode is None)
    images = decode(x0) if decode is not None else to_uint8_image(x0)
    if cs is None:
        extra = {"states_evaluated": K, "block_efficiency": 1.0, "guidance_scale": params.guidance_scale}
        return GenerationResult(images, [SampleStats(num_tokens=K, target_calls=K, extra=dict(extra)) for _ in range(batch)])
    cs.add_calls(None, target=1)  # the deterministic final step
    rounds = cs.rounds.tolist()
    states, advance = cs.states_evaluated.tolist(), cs.expected_advance.tolist()
    extra = [{
        "states_evaluated": states[b] + 1,
        "block_efficiency": (K - 1) / max(rounds[b], 1),
        "expected_advance_per_round": advance[b] / max(rounds[b], 1),
        "speculated_steps": K - 1,
        "guidance_scale": params.guidance_scale,
    } for b in range(batch)]
    return GenerationResult(images, cs.to_stats(K, extra=extra))
