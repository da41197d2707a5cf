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

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from specray import rng
from specray.methods.diffusion_verify import block_verify, log_ratio, token_verify
from specray.methods.gaussian_residual import reflect, sample_residual
from specray.methods.result import GenerationResult
from specray.methods.stats import SampleStats

DRAFTERS = ("frozen", "free", "model")
VERIFICATIONS = ("token", "block")
REJECTIONS = ("reflection", "residual")
RESIDUAL_ALPHAS = ("w_tau", "one")  # "one" is the wrong rule, kept only as a negative control
SAMPLERS = ("ddpm", "euler_maruyama")

_COMMON = {"num_steps": 100, "sampler": "ddpm", "churn": 1.0, "guidance_scale": 1.0}
METHODS: dict[str, dict[str, Any]] = {
    "target_only": dict(_COMMON),
    "spec_token": {**_COMMON, "drafter": "free", "gamma": 7, "rejection": "reflection"},
    "spec_block": {**_COMMON, "drafter": "free", "gamma": 7, "rejection": "residual"},
}

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

    @property
    def num_steps(self) -> int:
        return int(self.A.numel())


@dataclass
class ChainStats:
    """Per-row counters of a speculative run (int64 / float64 tensors of shape [B])."""

    rounds: torch.Tensor
    drafted: torch.Tensor
    accepted: torch.Tensor
    per_position: torch.Tensor  # [B, gamma]
    target_calls: torch.Tensor
    draft_calls: torch.Tensor
    states_evaluated: torch.Tensor
    expected_advance: torch.Tensor
    # Steps drafted / accepted per denoising step index k [B, K_s], on the chain's device
    # (moved to the host once by the caller): extra["acceptance_timeline"].
    timeline_drafted: torch.Tensor | None = None
    timeline_accepted: torch.Tensor | None = None

    @classmethod
    def zeros(cls, batch: int, gamma: int, num_steps: int = 0, device: torch.device | None = None) -> "ChainStats":
        z = lambda: torch.zeros(batch, dtype=torch.int64)  # noqa: E731
        timeline = lambda: torch.zeros(batch, num_steps, dtype=torch.int64, device=device)  # noqa: E731
        return cls(z(), z(), z(), torch.zeros(batch, gamma, dtype=torch.int64), z(), z(), z(), torch.zeros(batch, dtype=torch.float64),
                   timeline(), timeline())

    def add_timeline(self, rows: torch.Tensor, first_step: torch.Tensor, drafted: torch.Tensor, accepted: torch.Tensor) -> None:
        """Count one round of batch ``rows``: block slot j is step ``first_step + j``; ``drafted`` /
        ``accepted`` are ``[n, G]`` masks (two index_adds, no host sync)."""
        width = self.timeline_drafted.shape[1]
        slot = torch.arange(drafted.shape[1], device=rows.device)[None, :]
        flat = (rows[:, None] * width + (first_step[:, None] + slot).clamp(max=width - 1)).flatten()
        self.timeline_drafted.view(-1).index_add_(0, flat, drafted.flatten().to(torch.int64))
        self.timeline_accepted.view(-1).index_add_(0, flat, accepted.flatten().to(torch.int64))


def _coef(table: torch.Tensor, k: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Per-row coefficient broadcast against ``like`` [n, ...] (indices clamped for padding rows)."""
    v = table[k.clamp(max=table.numel() - 1)]
    return v.reshape(-1, *([1] * (like.dim() - 1)))


def _mean(chain: GaussianChain, x: torch.Tensor, eps: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``A x + B eps`` in float64."""
    x64 = x.to(torch.float64)
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
    stats = ChainStats.zeros(batch, gamma, num_steps=K, device=device)

    while True:
        act = torch.nonzero(k < K).flatten()
        if act.numel() == 0:
            break
        n = act.numel()
        kk, sid = k[act], sample_ids[act]
        r = stats.rounds.to(device)[act]
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
        Delta = Bk * (eps_draft.to(torch.float64) - E.to(torch.float64)) / Sk
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

        a = act.cpu()
        stats.rounds[a] += 1
        stats.drafted[a] += g.cpu()
        stats.accepted[a] += tau.cpu()
        stats.per_position[a, :G] += (positions[None, :] < tau[:, None]).cpu().to(torch.int64)
        stats.add_timeline(act, kk, valid, positions[None, :] < tau[:, None])  # tau <= g: accepted within valid
        stats.target_calls[a] += calls.cpu()
        stats.draft_calls[a] += draft_calls.cpu()
        stats.states_evaluated[a] += states.cpu()
        stats.expected_advance[a] += verdict.expected_advance.cpu()
    return x, stats


def _bcast(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return mask.reshape(mask.shape + (1,) * (like.dim() - mask.dim()))


def _check(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {list(allowed)}, got {value!r}")


def resolve_params(method: str, params: dict[str, Any] | None) -> dict[str, Any]:
    """Defaults merged with ``params``, every value validated."""
    if method not in METHODS:
        raise ValueError(f"unknown diffusion method {method!r}; allowed: {sorted(METHODS)}")
    params = dict(params or {})
    unknown = set(params) - set(METHODS[method])
    if unknown:
        raise ValueError(f"unknown params {sorted(unknown)} for diffusion method {method!r}; allowed: {sorted(METHODS[method])}")
    out = {**METHODS[method], **params}
    if not isinstance(out["num_steps"], int) or out["num_steps"] < 2:
        raise ValueError(f"num_steps must be an int >= 2, got {out['num_steps']!r}")
    _check("sampler", out["sampler"], SAMPLERS)
    if not float(out["churn"]) > 0:
        raise ValueError(f"churn must be > 0 (deterministic steps cannot be speculated), got {out['churn']!r}")
    if not float(out["guidance_scale"]) >= 0:
        raise ValueError(f"guidance_scale must be >= 0, got {out['guidance_scale']!r}")
    out["churn"], out["guidance_scale"] = float(out["churn"]), float(out["guidance_scale"])
    if method != "target_only":
        _check("drafter", out["drafter"], DRAFTERS)
        if not isinstance(out["gamma"], int) or out["gamma"] < 1:
            raise ValueError(f"gamma must be an int >= 1, got {out['gamma']!r}")
        allowed_rejection = REJECTIONS if method == "spec_token" else ("residual",)  # reflection is not exact in block mode
        _check("rejection", out["rejection"], allowed_rejection)
    return out


def model_chain(pair, params: dict[str, Any], labels: torch.Tensor):
    """The GaussianChain of a loaded diffusion pair, plus its step table."""
    from specray.models.diffusion import gaussian_steps

    steps = gaussian_steps(pair.info["scheduler"], params["num_steps"], params["sampler"], params["churn"])
    device = pair.device
    timesteps = steps.timesteps.to(device)
    scale = params["guidance_scale"]
    labels = labels.to(device)

    def network(model) -> EpsFn:
        def eps(x: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
            return model(x, timesteps[k], labels[rows], scale)

        return eps

    chain = GaussianChain(
        A=steps.A.to(device), B=steps.B.to(device), sigma=steps.sigma.to(device),
        target_eps=network(pair.target), draft_eps=network(pair.draft) if pair.draft is not None else None,
    )
    return chain, steps


def run_batch(method: str, params: dict[str, Any], pair, labels: torch.Tensor, sample_ids: torch.Tensor, seed: int) -> GenerationResult:
    """Generate one image per (label, sample_id); images uint8 [B, H, W]."""
    from specray.models.diffusion import final_step, to_uint8_image

    params = resolve_params(method, params)
    if method != "target_only" and params["drafter"] == "model" and pair.draft is None:
        raise ValueError("drafter='model' needs a draft model: set the arm's draft (e.g. digits-ddpm-draft)")
    start = time.perf_counter()
    device = pair.device
    sample_ids = sample_ids.to(device)
    chain, steps = model_chain(pair, params, labels)
    x = rng.normal(seed, sample_ids, "x_T", shape=pair.info["image_shape"], device=device, dtype=torch.float32)
    batch, K = x.shape[0], steps.num_steps
    if method == "target_only":
        x = ancestral_chain(chain, x, sample_ids, seed)
        gamma = 0
        cs = None
    else:
        gamma = params["gamma"]
        verification = "token" if method == "spec_token" else "block"
        x, cs = speculative_chain(chain, x, sample_ids, seed, drafter=params["drafter"], verification=verification,
                                  rejection=params["rejection"], gamma=gamma)
    last = torch.full((batch,), K - 1, dtype=torch.int64, device=device)
    eps = pair.target(x, steps.timesteps.to(device)[last], labels.to(device), params["guidance_scale"])
    images = to_uint8_image(final_step(x, eps, steps.final_alpha_bar))
    stats = []
    if cs is not None:  # one transfer each
        timeline_drafted, timeline_accepted = cs.timeline_drafted.tolist(), cs.timeline_accepted.tolist()
    for b in range(batch):
        if cs is None:
            extra = {"states_evaluated": K, "block_efficiency": 1.0, "guidance_scale": params["guidance_scale"]}
            stats.append(SampleStats(num_tokens=K, target_calls=K, extra=extra))
            continue
        rounds = int(cs.rounds[b])
        extra = {
            "states_evaluated": int(cs.states_evaluated[b]) + 1,
            "block_efficiency": (K - 1) / max(rounds, 1),
            "expected_advance_per_round": float(cs.expected_advance[b]) / max(rounds, 1),
            "speculated_steps": K - 1,
            "guidance_scale": params["guidance_scale"],
            "acceptance_timeline": {"accepted": timeline_accepted[b], "drafted": timeline_drafted[b]},
        }
        stats.append(SampleStats(
            num_tokens=K, num_spec_steps=rounds, num_draft_tokens=int(cs.drafted[b]),
            num_accepted_draft_tokens=int(cs.accepted[b]), accepted_per_position=cs.per_position[b].tolist(),
            target_calls=int(cs.target_calls[b]) + 1, draft_calls=int(cs.draft_calls[b]), extra=extra,
        ))
    return GenerationResult(images=images, stats=stats, batch_wall_time_s=time.perf_counter() - start)
