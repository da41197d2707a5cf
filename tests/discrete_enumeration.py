"""Exact law of one speculative round on toy categorical chains (spec discrete_sd.md §9).

A toy chain has vocabulary V and γ draft positions; the target and the draft are tables of
distributions indexed by the full prefix (``P_tab[L]`` has shape ``[V]*L + [V]``). The law of a
round is the law of the emitted tokens padded with target sampling to length γ+1.

The enumerator computes the law of the *kernel itself*, not of a re-implementation:

1. every draft sequence d ∈ V^γ becomes one row (weight Π Q_i(d_i));
2. one kernel call returns the pass probabilities a[b, i] it compares ``u_accept`` against;
3. every row is expanded into the 2^γ cells of the acceptance uniforms (cell c: u_i ∈ [0, a_i)
   or [a_i, 1), weight Π a_i or 1 − a_i), represented by the cell's midpoint, and the kernel is
   called again on this batch: its own decision logic gives n_accepted, and it returns the
   exact vector it fed to the categorical sampler for the next token;
4. the next-token law is continued with the target tables.

So a wrong threshold, a wrong decision rule or a wrong residual inside the kernel changes the
enumerated law. The remaining step (sampling from that vector with ``u_residual``) is covered by
the Monte-Carlo test.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from specray.methods.discrete.rules import RuleParams, _verify_impl


@dataclass
class ToyChain:
    vocab: int
    gamma: int
    P_tab: list[np.ndarray]  # L = 0..gamma: shape [V]*L + [V]
    Q_tab: list[np.ndarray]  # L = 0..gamma-1


@dataclass
class RoundLaw:
    law: np.ndarray  # [V]*(gamma+1)
    expected_tokens: float  # E[n_accepted + 1]
    bound: float  # B*(f) of spec §4.4 (chain rules; 0 for block)
    positive_weight_fallback: bool  # some reachable rejection hit an empty residual
    rows: int  # kernel rows in the enumeration batch


def _random_dist(rng: np.random.Generator, vocab: int, zero_prob: float) -> np.ndarray:
    p = rng.dirichlet(np.full(vocab, 0.8))
    if rng.random() < zero_prob:  # top-k emulation: zero a random subset, keep >= 1 entry
        keep = rng.random(vocab) < 0.5
        keep[rng.integers(vocab)] = True
        p = np.where(keep, p, 0.0)
    return p / p.sum()


def random_chain(rng: np.random.Generator, vocab: int, gamma: int, zero_prob: float = 0.3) -> ToyChain:
    def table(length: int) -> np.ndarray:
        shape = (vocab,) * length
        out = np.empty(shape + (vocab,))
        for prefix in itertools.product(range(vocab), repeat=length):
            out[prefix] = _random_dist(rng, vocab, zero_prob)
        return out

    return ToyChain(vocab, gamma, [table(L) for L in range(gamma + 1)], [table(L) for L in range(gamma)])


def _position_factor(chain: ToyChain, position: int) -> np.ndarray:
    """P(x_i | x_{<i}) for 1-based position i, broadcast to [V]*(γ+1)."""
    tab = chain.P_tab[position - 1]
    return tab.reshape(tab.shape + (1,) * (chain.gamma + 1 - position))


def suffix_target_probs(chain: ToyChain) -> list[np.ndarray]:
    """CT[m][x] = Π_{i > m} P(x_i | x_{<i}), m = 0..γ+1; CT[0] is the target law."""
    full = (chain.vocab,) * (chain.gamma + 1)
    out = [np.ones(full)]
    for position in range(chain.gamma + 1, 0, -1):
        out.append(out[-1] * _position_factor(chain, position))
    return out[::-1]


def target_law(chain: ToyChain) -> np.ndarray:
    return suffix_target_probs(chain)[0]


def draft_rows(chain: ToyChain) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, np.ndarray]:
    """All V^γ draft sequences (lexicographic) with their P, Q rows and draft probabilities."""
    seqs = np.array(list(itertools.product(range(chain.vocab), repeat=chain.gamma)), dtype=np.int64)
    P, Q = rows_for_sequences(chain, seqs)
    q_weight = np.prod(np.take_along_axis(Q.numpy(), seqs[:, :, None], axis=2)[:, :, 0], axis=1)
    return torch.from_numpy(seqs), P, Q, q_weight


def rows_for_sequences(chain: ToyChain, seqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """P [N, γ+1, V] and Q [N, γ, V] looked up along given draft sequences [N, γ]."""
    P = np.stack([lookup(chain.P_tab[i], seqs[:, :i]) for i in range(chain.gamma + 1)], axis=1)
    Q = np.stack([lookup(chain.Q_tab[i], seqs[:, :i]) for i in range(chain.gamma)], axis=1)
    return torch.from_numpy(P), torch.from_numpy(Q)


def lookup(table: np.ndarray, prefixes: np.ndarray) -> np.ndarray:
    """Rows ``table[prefix]`` for prefixes [N, L] -> [N, V] (L = 0 broadcasts the root row)."""
    if prefixes.shape[1] == 0:
        return np.broadcast_to(table, (prefixes.shape[0], table.shape[-1])).copy()
    return table[tuple(prefixes.T)]


def _coupling_bound(chain: ToyChain, pass_probs: np.ndarray, q_weight: np.ndarray) -> float:
    """B*(f) = Σ_i E_{d~Q}[A_i Σ_x [Q_i(x) f_i(x) − P_i(x)]_+] (spec §4.4) from the kernel's f."""
    V, gamma = chain.vocab, chain.gamma
    f = pass_probs.reshape((V,) * gamma + (gamma,))
    seq_shape = (V,) * gamma
    reach = np.ones(seq_shape)
    total = 0.0
    for i in range(gamma):
        # f_i(prefix, x) does not depend on the tokens after position i: take index 0 there.
        f_i = f[tuple([slice(None)] * (i + 1) + [0] * (gamma - i - 1)) + (i,)]
        excess = np.clip(chain.Q_tab[i] * f_i - chain.P_tab[i], 0.0, None).sum(-1)  # [V]*i
        excess = excess.reshape(excess.shape + (1,) * (gamma - i))
        total += float((q_weight.reshape(seq_shape) * reach * excess).sum())
        reach = reach * f[..., i]
    return total


def enumerate_round(
    chain: ToyChain,
    rule: str,
    params: RuleParams | None = None,
    correction_fn: Callable | None = None,
) -> RoundLaw:
    """Exact law of one round of ``rule`` (see module docstring)."""
    params = params or RuleParams()
    impl_kwargs = {} if correction_fn is None else {"correction_fn": correction_fn}
    drafts, P, Q, q_weight = draft_rows(chain)
    R, gamma, V = drafts.shape[0], chain.gamma, chain.vocab

    zeros = torch.zeros(R, gamma, dtype=torch.float64)
    _, details = _verify_impl(rule, P, Q, drafts, zeros, torch.zeros(R, dtype=torch.float64), params, **impl_kwargs)
    a = details.pass_probs.numpy()

    cells = np.array(list(itertools.product((True, False), repeat=gamma)))  # [C, γ], True = pass
    C = cells.shape[0]
    u = np.where(cells[None], a[:, None] / 2, (a[:, None] + 1) / 2)  # [R, C, γ] cell midpoints
    cell_weight = np.prod(np.where(cells[None], a[:, None], 1 - a[:, None]), axis=2)  # [R, C]
    weight = (q_weight[:, None] * cell_weight).reshape(-1)
    rep = lambda t: t.repeat_interleave(C, dim=0)  # noqa: E731
    out, cell_details = _verify_impl(
        rule, rep(P), rep(Q), rep(drafts), torch.from_numpy(u.reshape(R * C, gamma)),
        torch.zeros(R * C, dtype=torch.float64), params, **impl_kwargs,
    )
    n_acc = out.n_accepted.numpy()
    next_probs = cell_details.next_token_probs.numpy()
    seqs = rep(drafts).numpy()

    # Group reachable rows by the emitted prefix, then continue with target sampling.
    grouped: dict[tuple[int, ...], np.ndarray] = {}
    for r in np.nonzero(weight > 0)[0]:
        key = tuple(seqs[r, : n_acc[r]])
        grouped[key] = grouped.get(key, 0.0) + weight[r] * next_probs[r]
    suffix = suffix_target_probs(chain)
    law = np.zeros((V,) * (gamma + 1))
    for prefix, y_law in grouped.items():
        n = len(prefix)
        block = suffix[n + 1][prefix]  # [V]*(γ+1−n), first axis = the next token
        law[prefix] += y_law.reshape((V,) + (1,) * (gamma - n)) * block

    reachable = weight > 0
    bound = 0.0 if rule == "block" else _coupling_bound(chain, a, q_weight)
    return RoundLaw(
        law=law,
        expected_tokens=float((weight * (n_acc + 1)).sum()),
        bound=bound,
        positive_weight_fallback=bool(cell_details.residual_fallback.numpy()[reachable].any()),
        rows=R * C,
    )


def total_variation(a: np.ndarray, b: np.ndarray) -> float:
    return 0.5 * float(np.abs(a - b).sum())


def wrong_residual_target(rule, P, Q, drafts, n_accepted, params):  # noqa: ANN001
    """Negative control: on rejection sample from P_j itself instead of the residual."""
    rows = torch.arange(P.shape[0])
    return P[rows, n_accepted], torch.zeros(P.shape[0], dtype=torch.bool)


def vanilla_residual(rule, P, Q, drafts, n_accepted, params):  # noqa: ANN001
    """Norm([P_j − Q_j]_+) whatever the acceptance (the residual G* replaces in COOL-SD/LANTERN)."""
    gamma = drafts.shape[1]
    rows = torch.arange(P.shape[0])
    p_j = P[rows, n_accepted]
    q_j = Q[rows, n_accepted.clamp(max=gamma - 1)]
    residual = (p_j - q_j).clamp(min=0)
    empty = residual.sum(-1) <= 0
    residual = torch.where(empty.unsqueeze(-1), p_j, residual)
    return torch.where((n_accepted == gamma).unsqueeze(-1), p_j, residual), empty & (n_accepted < gamma)


__all__ = [
    "RoundLaw", "ToyChain", "draft_rows", "lookup", "enumerate_round", "random_chain",
    "rows_for_sequences", "suffix_target_probs", "target_law", "total_variation",
    "vanilla_residual", "wrong_residual_target",
]
