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

import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from specray import rng
from specray.families import Method, resolve
from specray.methods.common import GenerationResult, RoundTally, SampleStats, bind_conditions
from specray.methods.diffusion import cpu_commit, cpu_draft, cpu_draws, cpu_ratios, cpu_slots
from specray.methods.diffusion.params import Common, Speculative
from specray.methods.diffusion.residual import DELTA_MIN, KERNEL_CONSTANTS, reflect, sample_residual
from specray.methods.diffusion.rules import Verdict, block_verify, log_ratio, token_verify
from specray.models import cpu_kernels

FAMILY = "diffusion"
DRAFTERS = ("frozen", "free", "model")
VERIFICATIONS = ("token", "block")
REJECTIONS = ("reflection", "residual")
RESIDUAL_ALPHAS = ("w_tau", "one")  # "one" is the wrong rule, kept only as a negative control
# A round draws psi_alpha's noise for all its slots with its other draws while that is at most this many
# elements (small states: the draw calls cost more than the elements); past it, for its cut rows alone.
RESIDUAL_NOISE_WITH_ROUND = 1 << 16
# Plain ancestral sampling draws its noise for as many steps at once as keep a block at most this many elements.
ANCESTRAL_BLOCK_ELEMENTS = 1 << 18

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
        # The target calls of the rounds in which every row drafted a full block, the same for every row: counted
        # on the host and added once, after the last round.
        self.full_round_target_calls = 0


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
    """Plain ancestral sampling: K_s sequential target calls, noise from stream ``eps``.

    The noise is drawn, and the steps' coefficients gathered, for a block of steps at once (draws are elementwise
    in their keys, so the values are each step's own), and an affine step is :func:`cpu_draft.affine_states` with one
    slot (``_step``'s operations in its order): the base every speculative arm is measured against pays for its
    calls and no more loop work than it needs."""
    n, shape, device = x.shape[0], tuple(x.shape[1:]), x.device
    rows = torch.arange(n, device=device)
    h = rng.stream_hash(seed, sample_ids, "eps")
    affine = chain.clipped_mean is None
    tables = torch.stack([chain.A, chain.B, chain.sigma]).to(device)  # [3, K_s]
    block = max(1, ANCESTRAL_BLOCK_ELEMENTS // max(1, n * math.prod(shape)))
    for start in range(0, chain.num_steps, block):
        ks = torch.arange(start, min(start + block, chain.num_steps), device=device)
        xis = rng.normal_at(rng.extend_hash(h, 0, ks[:, None]), shape, dtype=torch.float64)  # [steps, n, ...]
        kks = ks[:, None].expand(-1, n).contiguous()  # [steps, n]: each step's k for every row
        if affine:  # (A, B, sigma) of each step for every row, [steps, 3, n, 1, 1...] as affine_states takes them
            coefs = tables[:, ks].T[:, :, None].expand(-1, -1, n).reshape(ks.numel(), 3, n, 1, *([1] * len(shape)))
            coefs = coefs.contiguous()
        for j in range(ks.numel()):
            eps, xi = chain.target_eps(x, kks[j], rows), xis[j]
            if affine:
                x = cpu_draft.affine_states(x, coefs[j], eps.to(torch.float64), xi[:, None])[:, 1]
            else:
                x = _step(chain, x, eps, kks[j], xi)
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

    Every row takes part in every round until it is done, so a row's round counter is the loop's.
    The host keeps its own copy of every row's step, updated from the round's one read of the
    device (the accepted counts ``tau``, which the commit needs): the active rows, block lengths and
    call shapes of the next round follow from it without waiting for the device again. On a CPU the
    steps are on the host already, and a round of every row with gamma steps left is one kernel call.
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
    batch, K = x.shape[0], chain.num_steps
    x = x.clone()
    k = torch.zeros(batch, dtype=torch.int64, device=device)
    # the free drafter's eps: each row's target eps of the state preceding its current one
    stale = torch.zeros_like(x) if drafter == "free" else None
    stats = ChainStats(batch, gamma, K, device)
    keys = _StreamKeys(seed, sample_ids, residual=rejection == "residual")
    tables = torch.stack([chain.A, chain.B, chain.sigma])  # [3, K], gathered once per round
    all_rows = torch.arange(batch, device=device)
    k_host = np.zeros(batch, dtype=np.int64)  # a GPU's steps on the host; a CPU's are k's own memory
    active, act = np.arange(0), None
    for index in itertools.count():
        frozen = drafter == "frozen" or (drafter == "free" and index == 0)  # every row is new in round 0
        # every row active with gamma steps left, the common round: on a CPU its slots in one call
        rnd = _full_round(index, all_rows, k, gamma, frozen, tables) if act is None and k.is_cpu else None
        if rnd is None:
            if k.is_cpu:
                k_host = k.numpy()
            was_active, active = active, np.flatnonzero(k_host < K)
            if active.size == 0:
                break
            if active.size != was_active.size:  # rows only finish: the round's batch rows, rebuilt when some did
                act = None if active.size == batch else _on(device, active)
            rnd = _new_round(index, act, all_rows, k, k_host[active], gamma, frozen, tables, stats)
        row_stale = stale if stale is None else _rows(stale, act)
        x_new, stale_new, k_new, tau_host = _round(chain, rnd, _rows(x, act), row_stale, keys, stats, drafter,
                                                   verification, residual_alpha)
        if act is None:
            x, stale, k = x_new, stale_new, k_new
        else:
            x[act], k[act] = x_new, k_new
            if stale is not None:
                stale[act] = stale_new
        if not k.is_cpu:
            k_host[active] += np.where(tau_host < rnd.g_host, tau_host + 1, rnd.g_host)
    stats.add_calls(None, target=stats.full_round_target_calls)
    stats.flush()
    # A round evaluates every drafted state with the target (the Frozen call the first, the verify call
    # the rest), and the model drafter makes one call per drafted state.
    stats.states_evaluated += stats.drafted
    if drafter == "model":
        stats.draft_calls += stats.drafted
    return x, stats


class _StreamKeys:
    """The per-row hashes of (seed, sample id, stream) of the speculative streams, made once per run
    (``rng.stream_hash``); a round mixes in its position and steps (``rng.extend_hash``).

    Streams "draft", "accept" and, with ``residual`` (the residual sampler ψ_α), "residual" and
    "residual_noise". A cut row's ψ_α draw is keyed by the round and the step it resamples, a slot's step,
    so a round keys it for every slot with the others (:class:`_ResidualDraws`)."""

    def __init__(self, seed: int, sample_ids: torch.Tensor, residual: bool) -> None:
        self.residual = residual
        streams = ("draft", "accept", "residual", "residual_noise") if residual else ("draft", "accept")
        self.hashes = torch.stack([rng.stream_hash(seed, sample_ids, s) for s in streams])  # [streams, batch]


@dataclass
class _ResidualDraws:
    """ψ_α's draws at every slot of a round: the uniforms ``u [n, G]``, and the normals ``zeta [n, G, ...]``
    where the round drew them, else their keys ``noise [n, G]`` (draws are elementwise in their keys: the
    same values either way, and as drawing for the cut rows alone)."""

    u: torch.Tensor
    noise: torch.Tensor
    zeta: torch.Tensor | None

    def at(self, rows: torch.Tensor, slots: torch.Tensor, shape: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """``u [r]`` and ``zeta [r, *shape]`` of slot ``slots[i]`` of row ``rows[i]``."""
        if self.zeta is not None:
            return self.u[rows, slots], self.zeta[rows, slots]
        return self.u[rows, slots], rng.normal_at(self.noise[rows, slots], shape, dtype=torch.float64)


@dataclass
class _Round:
    """One round of batch rows ``act`` (None: every row, in order; ``label_rows``: the rows either way;
    ``row_index``: ``arange(n)``, the rows' places in the round).

    Row i sits at step ``kk[i]`` and drafts ``g[i]`` steps (``g_host`` on the host, ``G`` the
    longest); slot j is step ``steps[:, j] = kk + j`` and is drafted where ``valid[:, j]``.
    ``coef``: ``(A, B, sigma)`` at each slot's step, ``[3, n, G, 1...]``, broadcast against the states.
    ``frozen``: the round starts with a target call on the rows' states (Frozen rounds).
    """

    index: int
    act: torch.Tensor | None
    label_rows: torch.Tensor
    row_index: torch.Tensor
    kk: torch.Tensor
    g: torch.Tensor
    g_host: np.ndarray
    G: int
    ragged: bool  # some rows draft fewer than G steps (the last rounds)
    steps: torch.Tensor
    valid: torch.Tensor
    coef: torch.Tensor
    frozen: bool


def _new_round(index: int, act: torch.Tensor | None, all_rows: torch.Tensor, k: torch.Tensor, kk_host: np.ndarray,
               gamma: int, frozen: bool, tables: torch.Tensor, stats: ChainStats) -> _Round:
    """Round ``index`` of the rows ``act`` at steps ``k[act]``, whose host copy is ``kk_host``."""
    K = tables.shape[1]
    kk, g_host = _rows(k, act), np.minimum(gamma, K - kk_host)
    G = int(g_host.max())
    if k.is_cpu:  # the host's copies are the tensors' values: numpy's few operations, not torch's dispatch
        g, steps, valid, coef = _slots_from_host(kk_host, g_host, G, tables)
    else:  # from the device's own steps: no copy to the device a round
        g, steps, valid, coef = _slots_on_device(kk, G, gamma, tables, stats)
    return _Round(index=index, act=act, label_rows=all_rows if act is None else act, row_index=all_rows[:g_host.size],
                  kk=kk, g=g, g_host=g_host, G=G, ragged=int(g_host.min()) < G, steps=steps, valid=valid, coef=coef,
                  frozen=frozen)


def _full_round(index: int, all_rows: torch.Tensor, k: torch.Tensor, gamma: int, frozen: bool,
                tables: torch.Tensor) -> _Round | None:
    """Round ``index`` of every batch row, at steps ``k``, where each has gamma steps or more left, by one kernel call
    (:func:`cpu_slots.full_round_slots`, :func:`_new_round`'s values); None where it is not such a round, or the
    kernel does not serve it."""
    slots = cpu_slots.full_round_slots(k, gamma, tables)
    if slots is None:
        return None
    g_host, g, valid = _full_blocks(k.shape[0], gamma)
    return _Round(index=index, act=None, label_rows=all_rows, row_index=all_rows, kk=k, g=g, g_host=g_host, G=gamma,
                  ragged=False, steps=slots[0], valid=valid, coef=slots[1], frozen=frozen)


@functools.lru_cache(maxsize=64)
def _full_blocks(n: int, gamma: int) -> tuple[np.ndarray, torch.Tensor, torch.Tensor]:
    """A CPU round's block lengths (host and tensor) and drafted slots where each of its ``n`` rows drafts ``gamma``
    steps: the same in every such round of every run, so made once and only read."""
    g_host = np.full(n, gamma, dtype=np.int64)
    with torch.inference_mode(False):  # plain tensors, usable in and out of inference mode
        g, valid = torch.from_numpy(g_host), torch.ones(n, gamma, dtype=torch.bool)
    g_host.setflags(write=False)
    return g_host, g, valid


def _slots_from_host(kk_host: np.ndarray, g_host: np.ndarray, G: int, tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """A CPU round's block lengths ``g [n]``, slot steps ``steps [n, G]``, drafted slots ``valid [n, G]`` and
    coefficients ``coef [3, n, G]`` from the rows' steps and block lengths on the host."""
    positions = np.arange(G)
    steps = kk_host[:, None] + positions
    coef = np.take(tables.numpy(), np.minimum(steps, tables.shape[1] - 1), axis=1)  # contiguous, as the kernels take it
    return (torch.from_numpy(g_host), torch.from_numpy(steps), torch.from_numpy(positions < g_host[:, None]),
            torch.from_numpy(coef))


def _slots_on_device(kk: torch.Tensor, G: int, gamma: int, tables: torch.Tensor,
                     stats: ChainStats) -> tuple[torch.Tensor, ...]:
    """:func:`_slots_from_host`'s tensors from the rows' steps ``kk`` on their device."""
    K = tables.shape[1]
    positions = stats.slots(G)[None, :]
    g = torch.clamp(K - kk, max=gamma)  # = g_host, on the device
    steps = kk[:, None] + positions
    return g, steps, positions < g[:, None], tables[:, steps.clamp(max=K - 1)]


def _rows(t: torch.Tensor, act: torch.Tensor | None) -> torch.Tensor:
    return t if act is None else t[act]


def _round(chain: GaussianChain, rnd: _Round, y0: torch.Tensor, stale: torch.Tensor | None, keys: _StreamKeys,
           stats: ChainStats, drafter: str, verification: str, residual_alpha: str):
    """Draft, verify and commit one round; returns the rows' new states, stale eps (``stale`` given: the free
    drafter), steps, and tau (host)."""
    n, G, shape = y0.shape[0], rnd.G, tuple(y0.shape[1:])
    coef = rnd.coef.reshape(3, n, G, *([1] * len(shape)))
    # draft, accept[, residual, residual_noise]: their keys [streams, n, G], normals and uniforms, all at once
    noise_with_round = keys.residual and n * G * math.prod(shape) <= RESIDUAL_NOISE_WITH_ROUND
    draws, normals, uniforms = cpu_draws.round_draws(keys.hashes, rnd.label_rows, rnd.index, rnd.steps, shape,
                                                     noise_with_round)
    xi, eta = normals[0], uniforms[0]
    residual_draws = (_ResidualDraws(uniforms[1], draws[3], normals[1] if noise_with_round else None)
                      if keys.residual else None)

    E = torch.zeros((n, G) + shape, dtype=y0.dtype, device=y0.device)  # target eps of each drafted state
    if rnd.frozen:  # the Frozen round's sequential call at the round start
        E[:, 0] = chain.target_eps(y0, rnd.kk, rnd.label_rows)
    Y, eps_draft64 = _draft(chain, rnd, coef, y0, E[:, 0] if rnd.frozen else stale, xi, drafter)
    _verify_states(chain, rnd, Y, E)

    done = _commit(chain, rnd, coef, Y, E, eps_draft64, xi, eta, residual_draws, stale is not None, verification,
                   residual_alpha)

    # block slot j is step kk + j; tau <= g, so the accepted slots lie within the drafted ones
    stats.observe_prefix(rnd.act, rnd.steps, rnd.g, done.tau)
    # the Frozen call, then verify where the block has more than one slot
    if rnd.act is None and not rnd.ragged:  # every row's count alike: a host integer, added after the last round
        stats.full_round_target_calls += 2 if rnd.frozen and rnd.G > 1 else 1
    else:
        stats.add_calls(rnd.act, target=(rnd.g > 1).to(torch.int64) + 1 if rnd.frozen else 1)
    _add(stats.expected_advance, rnd.act, done.expected_advance)
    return done.x, done.stale, done.k, done.tau_host


class _Commit(NamedTuple):
    """A round's outcome: the rows' new states, the Free drafter's eps (None for the others), the rows' next steps,
    the accepted counts ``tau`` (on the device and the host) and the expected advance."""

    x: torch.Tensor
    stale: torch.Tensor | None
    k: torch.Tensor
    tau: torch.Tensor
    tau_host: np.ndarray
    expected_advance: torch.Tensor


def _commit(chain: GaussianChain, rnd: _Round, coef: torch.Tensor, Y: torch.Tensor, E: torch.Tensor,
            eps_draft64: torch.Tensor, xi: torch.Tensor, eta: torch.Tensor, residual_draws: _ResidualDraws | None,
            with_stale: bool, verification: str, residual_alpha: str) -> _Commit:
    """What follows the verify call: the log ratios, the verdict, the cut rows' new states, the Free drafter's eps
    (``with_stale``) and the next steps. A full round of an affine chain is one kernel call on a CPU
    (:func:`cpu_commit.round_commit`, the same values), any other round :func:`_commit_tensors`."""
    if chain.clipped_mean is None and not rnd.ragged:
        u, zeta = (None, None) if residual_draws is None else (residual_draws.u, residual_draws.zeta)
        if residual_draws is None or zeta is not None:
            done = cpu_commit.round_commit(coef, eps_draft64, E, xi, eta, Y, rnd.kk, rnd.g,
                                           block=verification == "block", u=u, zeta=zeta,
                                           alpha_one=residual_alpha == "one", with_stale=with_stale)
            if done is not None:
                x, stale, k, tau, expected = done
                return _Commit(x, stale, k, tau, tau.numpy(), expected)
    return _commit_tensors(chain, rnd, coef, Y, E, eps_draft64, xi, eta, residual_draws, with_stale, verification,
                           residual_alpha)


def _commit_tensors(chain: GaussianChain, rnd: _Round, coef: torch.Tensor, Y: torch.Tensor, E: torch.Tensor,
                    eps_draft64: torch.Tensor, xi: torch.Tensor, eta: torch.Tensor,
                    residual_draws: _ResidualDraws | None, with_stale: bool, verification: str,
                    residual_alpha: str) -> _Commit:
    """:func:`_commit` by torch's operations and the round's smaller kernels."""
    n, G, shape = Y.shape[0], rnd.G, tuple(Y.shape[2:])
    if chain.clipped_mean is None:  # Delta = B (eps_draft - eps) / sigma and the log ratios: one kernel call on a CPU
        Delta, log_rho, delta = cpu_ratios.affine_ratios(coef, eps_draft64, E, xi, rnd.valid if rnd.ragged else None)
    else:  # not affine in eps: the difference of the two means (spec_diffusion 1.2)
        flat_k, drafted = rnd.steps.flatten(), Y[:, :G].flatten(0, 1)
        eps_flat = eps_draft64.expand((n, G) + shape).flatten(0, 1)
        gap = _mean(chain, drafted, eps_flat, flat_k) - _mean(chain, drafted, E.flatten(0, 1), flat_k)
        Delta = gap.reshape((n, G) + gap.shape[1:]) / coef[2]
        if rnd.ragged:
            Delta = torch.where(_bcast(rnd.valid, Delta), Delta, torch.zeros_like(Delta))
        log_rho, delta = log_ratio(Delta, xi)
    verdict = (token_verify if verification == "token" else block_verify)(log_rho, delta, rnd.g, eta)
    tau = verdict.tau
    tau_host = tau.cpu().numpy()  # the round's one wait for the device: the commit needs it

    x_new = Y[rnd.row_index, rnd.g].clone() if rnd.ragged else Y[:, G].clone()
    cut = np.flatnonzero(tau_host < rnd.g_host)
    if cut.size:
        cut_rows = _on(Y.device, cut)
        x_new[cut_rows] = _resample(chain, rnd, cut_rows, Y, E, Delta, xi, verdict, residual_draws,
                                    residual_alpha).to(Y.dtype)
    rejected = tau < rnd.g
    # eps of the state preceding the new one (spec 2.3)
    stale = E[rnd.row_index, torch.where(rejected, tau, rnd.g - 1)] if with_stale else None
    k_new = rnd.kk + torch.where(rejected, tau + 1, rnd.g)
    return _Commit(x_new, stale, k_new, tau, tau_host, verdict.expected_advance)


def _on(device: torch.device, index: np.ndarray) -> torch.Tensor:
    """A host index array as an int64 tensor on ``device``."""
    return torch.from_numpy(index).to(device=device, dtype=torch.int64)


def _add(counter: torch.Tensor, rows: torch.Tensor | None, value: torch.Tensor) -> None:
    if rows is None:
        counter += value
    else:
        counter[rows] += value


def _draft(chain: GaussianChain, rnd: _Round, coef: torch.Tensor, y0: torch.Tensor, fixed_eps: torch.Tensor,
           xi: torch.Tensor, drafter: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The drafted states ``Y [n, G+1, ...]`` (``Y[:, 0] = y0``) and the draft eps of each slot in float64
    (``[n, 1, ...]``, the same at every slot, unless the drafter is ``model``).

    Each step is ``_step``'s arithmetic, in its order; what does not depend on the previous state
    (``sigma xi``, and ``B eps`` for a fixed eps) is computed for all slots at once.
    """
    model, affine = drafter == "model", chain.clipped_mean is None
    if not model:
        eps64 = fixed_eps.to(torch.float64)
        if affine:  # every step affine in the state with a fixed eps: one kernel call on a CPU
            return cpu_draft.affine_states(y0, coef, eps64, xi), eps64[:, None]
    if model:
        eps_draft = torch.zeros((y0.shape[0], rnd.G) + tuple(y0.shape[1:]), dtype=y0.dtype, device=y0.device)
    step = cpu_draft.step_kernel(y0, xi) if model and affine else None
    if step is not None:  # a step a kernel call, between the model's calls
        S = torch.empty((rnd.G + 1,) + tuple(y0.shape), dtype=y0.dtype)  # slot-major: each slot the model's input
        S[0] = y0
        for j in range(rnd.G):
            cpu_draft.model_step(step, S, j, coef, _draft_call(chain, rnd, j, S[j], eps_draft), xi)
        return S.transpose(0, 1).contiguous(), eps_draft.to(torch.float64)
    A, B, noise = coef[0].unbind(1), coef[1].unbind(1), (coef[2] * xi).unbind(1)
    ys, y64 = [y0], y0.to(torch.float64)
    for j in range(rnd.G):
        if model:
            eps64 = _draft_call(chain, rnd, j, ys[j], eps_draft).to(torch.float64)
        mean = A[j] * y64 + B[j] * eps64 if affine else _mean(chain, y64, eps64, rnd.steps[:, j])
        ys.append((mean + noise[j]).to(y0.dtype))
        y64 = ys[-1].to(torch.float64)
    return torch.stack(ys, dim=1), eps_draft.to(torch.float64) if model else eps64[:, None]


def _draft_call(chain: GaussianChain, rnd: _Round, j: int, y: torch.Tensor, eps_draft: torch.Tensor) -> torch.Tensor:
    """The draft model's eps at slot j on the rows that draft it (stored in ``eps_draft``), for every row (zero on the
    rows that do not)."""
    live = np.flatnonzero(rnd.g_host > j)
    if live.size == y.shape[0]:
        eps = chain.draft_eps(y, rnd.kk + j, rnd.label_rows)
        eps_draft[:, j] = eps
        return eps
    live_rows = _on(y.device, live)
    eps_draft[live_rows, j] = chain.draft_eps(y[live_rows], rnd.kk[live_rows] + j, rnd.label_rows[live_rows])
    return eps_draft[:, j]


def _verify_states(chain: GaussianChain, rnd: _Round, Y: torch.Tensor, E: torch.Tensor) -> None:
    """The parallel verification pass: one target call on every drafted state whose eps is not known
    yet (all but a Frozen round's first), row by row; fills ``E``."""
    first = 1 if rnd.frozen else 0
    n, G = E.shape[:2]
    if first >= G:
        return
    if not rnd.ragged:  # the states form a block: no index lists
        per_row = G - first
        eps = chain.target_eps(Y[:, first:G].reshape((n * per_row,) + tuple(Y.shape[2:])),
                               rnd.steps[:, first:].reshape(-1), rnd.label_rows.repeat_interleave(per_row))
        E[:, first:] = eps.view(E[:, first:].shape)
        return
    need = rnd.valid.clone()
    need[:, :first] = False
    ri, ji = torch.nonzero(need, as_tuple=True)
    if ri.numel():
        E[ri, ji] = chain.target_eps(Y[ri, ji], rnd.kk[ri] + ji, rnd.label_rows[ri])


def _resample(chain: GaussianChain, rnd: _Round, cut: torch.Tensor, Y: torch.Tensor, E: torch.Tensor,
              Delta: torch.Tensor, xi: torch.Tensor, verdict: Verdict,
              residual_draws: _ResidualDraws | None, residual_alpha: str) -> torch.Tensor:
    """The new state of the rows ``cut`` whose block was cut at slot tau: a draw from the residual of the
    target and draft kernels out of ``y_tau`` with the slot's ``residual_draws``, or without them the
    reflection of the rejected draft; in float64."""
    t_c = verdict.tau[cut]
    x, eps, D = Y[cut, t_c], E[cut, t_c], Delta[cut, t_c]
    if residual_draws is not None:
        log_alpha = verdict.log_alpha[cut] if residual_alpha == "w_tau" else torch.zeros_like(verdict.log_alpha[cut])
        u, zeta = residual_draws.at(cut, t_c, tuple(Y.shape[2:]))
        name, draws = "residual_states", (log_alpha, u, zeta, KERNEL_CONSTANTS)
    else:
        name, draws = "reflected_states", (xi[cut, t_c],)
    kernel = _states_kernel(chain, Y, name)  # the affine chain's mean and the new state in one call
    y = kernel(x, eps, rnd.coef[:, cut, t_c], D, *draws, DELTA_MIN) if kernel is not None else None
    if y is not None:
        return y
    k_c = rnd.kk[cut] + t_c
    m_q = _mean(chain, x, eps, k_c)
    sigma_c = chain.sigma[k_c]
    if residual_draws is None:
        return reflect(m_q, D, sigma_c, draws[0])
    return sample_residual(m_q, D, sigma_c, log_alpha, u, zeta)


def _states_kernel(chain: GaussianChain, Y: torch.Tensor, name: str) -> Callable | None:
    """The C++ new states of a round's cut rows (``residual_states`` or ``reflected_states``) for an affine chain's
    CPU states, where the process has loaded specray's kernels and the kernel gave :func:`_mean` and
    :func:`sample_residual`'s or :func:`reflect`'s values in this process."""
    if chain.clipped_mean is not None or not Y.is_cpu or cpu_kernels.loaded() is None or not cpu_kernels.ENABLED:
        return None
    return cpu_kernels.checked(name, 0, _STATES_CHECKS[name])


def _states_kernel_matches(kernel: Callable, _size: int, reflected: bool) -> bool:
    """Whether ``kernel`` gives :func:`_mean` then :func:`sample_residual`'s (or :func:`reflect`'s) values, bit for bit
    but NaN for NaN: float32 and float64 states of 1, 3 and 8 rows of 1, 5 and 64 elements (seed 9), identical kernels
    (a tiny Delta) and alpha = 1 among them."""
    gen = torch.Generator().manual_seed(9)
    for dtype, r, shape in itertools.product((torch.float32, torch.float64), (1, 3, 8), ((1,), (5,), (1, 8, 8))):
        x, eps = (torch.randn((r,) + shape, dtype=torch.float64, generator=gen).to(dtype) for _ in range(2))
        A, B, sigma = (torch.rand(r, dtype=torch.float64, generator=gen) + 0.5,
                       torch.randn(r, dtype=torch.float64, generator=gen),
                       torch.rand(r, dtype=torch.float64, generator=gen) + 0.01)
        Delta = torch.randn((r,) + shape, dtype=torch.float64, generator=gen) * torch.exp(
            2 * torch.randn(r, dtype=torch.float64, generator=gen)).reshape((r,) + (1,) * len(shape))
        Delta[0] *= 1e-12 if r == 3 else 1.0
        log_alpha = -torch.rand(r, dtype=torch.float64, generator=gen) * 3
        log_alpha[-1] = 0.0
        u = 1 - torch.rand(r, dtype=torch.float64, generator=gen)
        noise = torch.randn((r,) + shape, dtype=torch.float64, generator=gen)
        chain, k = GaussianChain(A=A, B=B, sigma=sigma, target_eps=None), torch.arange(r)
        m_q, coef = _mean(chain, x, eps, k), torch.stack([A, B, sigma])
        if reflected:
            want = reflect(m_q, Delta, sigma, noise)
            got = kernel(x, eps, coef, Delta, noise, DELTA_MIN)
        else:
            want = sample_residual(m_q, Delta, sigma, log_alpha, u, noise)
            got = kernel(x, eps, coef, Delta, log_alpha, u, noise, KERNEL_CONSTANTS, DELTA_MIN)
        if got is None or got.shape != want.shape or not cpu_kernels.same_values(got, want):
            return False
    return True


# Each kernel's check, made once (a round asks for its kernel every time).
_STATES_CHECKS = {name: functools.partial(_states_kernel_matches, reflected=name == "reflected_states")
                  for name in ("residual_states", "reflected_states")}


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
    if device.type == "cpu":  # specray's kernels (the drafts', and the draws' hash, which never loads them itself)
        cpu_kernels.extension()
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
