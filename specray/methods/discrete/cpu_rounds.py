"""The discrete loops' draws and their rounds' decisions on a CPU: torch's operations, or one call of specray's
kernels with their values.

At batch 1 a round's work outside the model calls is mostly dispatch: the decision of
:func:`~specray.methods.discrete.rules.verify` (normalising P and Q in float64, the pass probabilities, the
accepted prefix, the residual, its draw) is ~35 torch operations of a few microseconds each, and every draw
(:func:`specray.rng.sample_categorical`: running sums, a scaled uniform, a search, a clamp) five more.
``csrc/rounds.cpp`` does a round of ``sd``, ``cool_sd``, ``uniform_rsd``, ``block`` or ``lantern`` (its G*
residual) in one call, and a draw in one.

Only the float64 sums that normalise a distribution depend on an order: torch's (its CPU sum kernel), which may
change with a torch build. So each kernel serves a width only after it has matched torch's operations value for
value on it (:func:`_draws_match`, :func:`_rounds_match`), in this process at this thread count; else, and where
the extension is off or not built (:mod:`~specray.models.cpu_kernels`), torch's operations run. The kernels also
leave to torch every law with a NaN, infinite or negative entry or a row without mass (torch gives tokens for
those in its own ways), and uniforms of other shapes than torch's own for the call. The choice never changes a
value. ``ENABLED`` switches the kernels for an A/B comparison, and the rounds' bookkeeping kernels too
(:func:`bookkeeping`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import ModuleType

import torch

from specray import rng
from specray.models import cpu_kernels

ENABLED = cpu_kernels.ENABLED
# Each rule's round kernel (LANTERN with its G* residual only; the official residual runs torch's operations).
ROUND_KERNELS = {"sd": "chain_round", "cool_sd": "chain_round", "uniform_rsd": "chain_round", "block": "block_round",
                 "lantern": "lantern_round"}
_NO_NEIGHBOURS = torch.empty(0, 0, dtype=torch.int64)


def _test_laws(generator: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Unnormalised laws as the samplers see them: softmax-like rows over 9 orders of magnitude, about a quarter of
    the entries zero (top-k, top-p), never a row without mass."""
    laws = torch.exp(torch.randn(shape, generator=generator, dtype=torch.float64) * 5.0)
    laws = laws * (torch.rand(shape, generator=generator, dtype=torch.float64) > 0.25)
    laws[..., 0] += 1e-3
    return laws.to(dtype)


def _boundary_uniforms(laws: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A uniform per row of ``laws [rows, V]`` that scales onto one of its running sums (``cdf[k] / cdf[-1]``, k
    drawn): a draw from there changes with the last bit of the sums, so a kernel whose law or sums differ from
    torch's in a bit gives other tokens there."""
    cdf = torch.cumsum(laws, dim=-1, dtype=torch.float64)
    k = torch.randint(laws.shape[-1], (laws.shape[0], 1), generator=generator)
    return (cdf.gather(1, k) / cdf[:, -1:]).clamp_(max=1.0 - 2.0**-53).squeeze(1)


def _draws_match(draw: Callable, width: int) -> bool:
    """Whether ``draw`` gives :func:`specray.rng.sample_categorical`'s tokens for laws of ``width`` entries: float32
    and float64 rows, 1, 2, 33 and 130 of them, contiguous and strided, with their uniforms flat and as a column,
    random and on the running sums; seed 0, at the calling thread count."""
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64):
        for rows in (1, 2, 33, 130):
            laws = _test_laws(generator, (rows, 2, width), dtype)
            for probs in (laws[:, 0], laws.reshape(2 * rows, width)[:rows]):  # strided and contiguous rows
                u = torch.stack([torch.rand(rows, generator=generator, dtype=torch.float64),
                                 _boundary_uniforms(probs, generator)], dim=1)
                u[0, 0] = 0.0  # the first token with mass
                for uniforms in (u[:, 0], u[:, 1:]):
                    got = draw(probs, uniforms)
                    want = (rng.sample_categorical(probs, uniforms) if uniforms.dim() == 1 else
                            rng.sample_categorical_keepdim(probs, uniforms))
                    if got is None or not torch.equal(got, want):
                        return False
    return True


# The cases each round kernel is checked on: (rule, its RuleParams' fields), LANTERN's with a neighbour table.
_ROUND_CASES = {
    "chain_round": (("sd", {}), ("cool_sd", {"delta": 0.5, "mu": -0.3}), ("cool_sd", {"delta": 2.0}),
                    ("uniform_rsd", {"delta": 1.1})),
    "block_round": (("block", {}),),
    "lantern_round": (("lantern", {"k": 0, "lam": 2.0}), ("lantern", {"k": 1, "lam": 1.0}),
                      ("lantern", {"k": 3, "lam": 5.0}), ("lantern", {"k": 3, "lam": 2.0, "forbid_zero_target_mass": True}),
                      ("lantern", {"k": 3, "mode": "delta", "delta": 0.3})),
}


def _rounds_match(name: str, decide: Callable, width: int) -> bool:
    """Whether the round kernel ``decide`` (``name`` in :data:`ROUND_KERNELS`) gives the torch rules' decisions for
    laws of ``width`` entries: each case of its rules, gamma 1 and 4, 1, 2, 33 and 130 rows, drafts drawn from Q (the
    last also drafting tokens without Q mass), rows whose P and Q agree (an empty residual); uniforms at random, and
    on the boundaries: acceptance uniforms equal to torch's pass probabilities (all rows stop at once) and one below
    them (rows pass as far as they can), the next token's uniform on its law's running sums
    (:func:`_boundary_uniforms`), so that a pass probability or a law that differs in a bit changes tokens; seed 0,
    at the calling thread count."""
    from specray.methods.discrete import lantern, rules  # rules imports this module

    generator = torch.Generator().manual_seed(0)
    table = lantern.neighbours_from_embeddings(torch.randn(width, 8, generator=generator), min(4, width - 1))
    for rule, fields in _ROUND_CASES[name]:
        params = rules.RuleParams(**fields, neighbours=table if rule == "lantern" else None)
        for gamma in (1, 4):
            extra = round_arguments(rule, params, gamma)
            for rows in (1, 2, 33, 130):
                P = _test_laws(generator, (rows, gamma + 1, width))
                Q = _test_laws(generator, (rows, gamma, width))
                Q[: rows // 3] = P[: rows // 3, :gamma]  # the residual has no mass: the guard's law
                drafts = (rng.sample_categorical(Q, torch.rand(rows, gamma, generator=generator, dtype=torch.float64))
                          if rows < 99 else torch.randint(width, (rows, gamma), generator=generator))
                u_accept = torch.rand(rows, gamma, generator=generator, dtype=torch.float64) ** 3
                u_residual = torch.rand(rows, generator=generator, dtype=torch.float64)
                pass_probs = rules._verify_impl(rule, P, Q, drafts, u_accept, u_residual, params)[1].pass_probs
                for u_acc in (u_accept, pass_probs, torch.nextafter(pass_probs, torch.zeros_like(pass_probs))):
                    if u_acc is not u_accept:
                        law = rules._verify_impl(rule, P, Q, drafts, u_acc, u_residual, params)[1].next_token_probs
                        u_residual = _boundary_uniforms(law, generator)
                    got = decide(P, Q, drafts, u_acc, u_residual, *extra)
                    want = rules._verify_impl(rule, P, Q, drafts, u_acc, u_residual, params)[0]
                    if got[0] is None or any(not torch.equal(g, w) for g, w in
                                             zip(got, (want.n_accepted, want.next_token, want.accepted_mask))):
                        return False
    return True


_CHECKS = {"sample_categorical": _draws_match, **{name: functools.partial(_rounds_match, name) for name in _ROUND_CASES}}


def kernel(name: str, width: int, checks: dict[str, Callable] | None = None) -> Callable | None:
    """The kernel ``name`` (``sample_categorical`` or one of :data:`ROUND_KERNELS`; another module's, with its
    ``checks``) if it gives torch's values at ``width`` at this thread count, else None (checked once per kernel,
    thread count and width, :func:`~specray.models.cpu_kernels.checked`)."""
    return cpu_kernels.checked(name, width, (checks or _CHECKS)[name]) if ENABLED else None


def bookkeeping(device: torch.device) -> ModuleType | None:
    """specray's kernels for a round's bookkeeping where the round's tensors are on ``device``, a CPU, and the round
    kernels are on, else None. Those kernels index, add, compare and copy integers and copy values, so they give
    torch's values by construction and are not checked; each refuses, writing nothing, a call it does not serve."""
    return cpu_kernels.extension() if ENABLED and device.type == "cpu" else None


def _fast(name: str, probs: torch.Tensor, checks: dict[str, Callable] | None = None) -> Callable | None:
    """:func:`kernel` for laws ``probs`` (their width), on a CPU only."""
    return kernel(name, probs.shape[-1], checks) if ENABLED and probs.device.type == "cpu" else None


def sample_categorical(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`specray.rng.sample_categorical`'s tokens: by the kernel where it serves (rows of a 2-D law on a CPU,
    float64 uniforms), else by torch's operations."""
    fast = _fast("sample_categorical", probs) if u.dim() == 1 else None  # torch's shapes differ for others
    out = None if fast is None else fast(probs, u)
    return rng.sample_categorical(probs, u) if out is None else out


def sample_categorical_keepdim(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """:func:`specray.rng.sample_categorical_keepdim`'s tokens ``[r, 1]`` for uniforms ``[r, 1]``, as
    :func:`sample_categorical` chooses."""
    fast = _fast("sample_categorical", probs) if u.dim() == 2 and u.shape[1] == 1 else None
    out = None if fast is None else fast(probs, u)
    return rng.sample_categorical_keepdim(probs, u) if out is None else out


def bound_draw(width: int, device: torch.device, keepdim: bool = False) -> Callable[[torch.Tensor, torch.Tensor],
                                                                                   torch.Tensor]:
    """:func:`sample_categorical` (``keepdim``: :func:`sample_categorical_keepdim`) with the kernel looked up once, for
    a loop whose laws have ``width`` entries on ``device`` (a run keeps its thread count): the same tokens, fewer steps
    a draw. Laws of another width, and uniforms of other shapes, take the unbound path."""
    unbound = sample_categorical_keepdim if keepdim else sample_categorical
    fast = kernel("sample_categorical", width) if ENABLED and device.type == "cpu" else None
    if fast is None:
        return unbound

    def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        served = probs.shape[-1] == width and (u.dim() == 2 and u.shape[1] == 1 if keepdim else u.dim() == 1)
        out = fast(probs, u) if served else None
        return unbound(probs, u) if out is None else out

    return draw


def round_arguments(rule: str, params, gamma: int) -> tuple | None:
    """What the round kernel of ``rule`` takes after the round's tensors, for a round of ``gamma`` drafts under the
    rule's :class:`~specray.methods.discrete.rules.RuleParams`; None where it does not serve them."""
    from specray.methods.discrete import rules  # rules imports this module

    if rule == "sd":
        return (None,)
    if rule in ("cool_sd", "uniform_rsd"):
        return (rules._omegas_on(rule, gamma, params, torch.device("cpu")),)
    if rule == "block":
        return ()
    if rule == "lantern" and params.residual == "gstar" and (params.k == 0 or params.neighbours is not None):
        neighbours = params.neighbours if params.k > 0 else _NO_NEIGHBOURS
        return (neighbours, params.k, params.mode == "lambda", float(params.lam or 0.0), float(params.delta or 0.0),
                params.forbid_zero_target_mass)
    return None


def decide(rule: str, params, P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
           u_residual: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
    """``(n_accepted, next_token, accepted_mask)`` of the rules' :func:`verify` by the rule's round kernel, or None
    where it does not serve the round (then the caller runs torch's operations)."""
    decide_round = round_kernel(rule, params, P.shape[-1], drafts.shape[1], P.device)
    return None if decide_round is None else decide_round(P, Q, drafts, u_accept, u_residual)


def round_kernel(rule: str, params, width: int, gamma: int, device: torch.device) -> Callable | None:
    """:func:`decide` for rounds of ``gamma`` drafts over laws of ``width`` entries on ``device`` (a CPU), the kernel
    and the rule's arguments looked up once (a run keeps its thread count): ``(P, Q, drafts, u_accept, u_residual)
    ->`` decide's value; None where no kernel serves such rounds."""
    name = ROUND_KERNELS.get(rule)
    fast = kernel(name, width) if name is not None and device.type == "cpu" else None
    extra = round_arguments(rule, params, gamma) if fast is not None else None
    if extra is None:
        return None

    def decide_round(P: torch.Tensor, Q: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor,
                     u_residual: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        out = fast(P, Q, drafts, u_accept, u_residual, *extra)
        return None if out is None or out[0] is None else out

    return decide_round
