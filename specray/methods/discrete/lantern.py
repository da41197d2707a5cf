"""LANTERN / LANTERN++ latent neighbourhoods and relaxed target mass (spec discrete_sd.md §3).

Two jobs, both model-agnostic:

* :func:`neighbours_from_embeddings` builds, once per tokenizer, the table of each token's
  nearest codebook neighbours (Euclidean distance, the token itself excluded, nearest first).
  By default the codebook rows are L2-normalised first, because that is what LlamaGen's
  quantizer looks up and its decoder sees (spec §3.1 "spec choice"); ``normalize=False`` gives
  LANTERN's raw-weight behaviour.
* :func:`relaxed_target_mass` computes ``P̃(x) = P(x) + S_{m*}(x)`` (spec §3.2): the target mass
  of ``x`` plus the mass of its ``m*`` nearest neighbours, where ``m*`` is the largest prefix of
  the neighbour list whose summed mass stays within the budget (δ in δ-mode, ``(λ−1)·P(x)`` in
  λ-mode).
"""

from __future__ import annotations

import torch

LANTERN_MODES = ("lambda", "delta")

# Bound on the number of float64 elements one neighbour gather may materialise (~128 MiB).
_GATHER_BUDGET = 1 << 24


def neighbours_from_embeddings(
    E: torch.Tensor, k: int, normalize: bool = True, chunk_rows: int = 1024
) -> torch.Tensor:
    """Indices of the ``k`` nearest other codebook entries of every token, nearest first.

    Args:
        E: codebook ``[V, d]``.
        k: neighbours per token, ``0 <= k <= V - 1``.
        normalize: L2-normalise the rows of ``E`` before measuring distances (spec §3.1 default).
        chunk_rows: rows of the distance matrix held at once (memory is ``chunk_rows * V``).

    Returns:
        int64 ``[V, k]`` on ``E``'s device. Ties are broken by the smaller token index, so the
        table is deterministic.
    """
    if E.dim() != 2:
        raise ValueError(f"E must be a codebook of shape [V, d], got shape {tuple(E.shape)}")
    vocab = E.shape[0]
    if not 0 <= k <= vocab - 1:
        raise ValueError(f"k must satisfy 0 <= k <= V - 1 = {vocab - 1}, got {k}")
    codebook = E.to(torch.float64)
    if normalize:
        codebook = torch.nn.functional.normalize(codebook, p=2.0, dim=1)
    out = torch.empty(vocab, k, dtype=torch.int64, device=E.device)
    if k == 0:
        return out
    for start in range(0, vocab, chunk_rows):
        rows = codebook[start : start + chunk_rows]
        dist = torch.cdist(rows, codebook)  # [chunk, V]
        own = torch.arange(start, start + rows.shape[0], device=E.device)
        dist[torch.arange(rows.shape[0], device=E.device), own] = float("inf")
        order = torch.sort(dist, dim=1, stable=True).indices
        out[start : start + rows.shape[0]] = order[:, :k]
    return out


def _check_neighbours(neighbours: torch.Tensor | None, k: int, vocab: int) -> torch.Tensor:
    if k == 0:
        return torch.empty(vocab, 0, dtype=torch.int64)
    if neighbours is None:
        raise ValueError("params.neighbours is required for rule 'lantern' when k > 0")
    if neighbours.dim() != 2 or neighbours.shape[0] != vocab or neighbours.shape[1] < k:
        raise ValueError(
            f"params.neighbours must have shape [V={vocab}, >= k={k}], got {tuple(neighbours.shape)}"
        )
    return neighbours


def _on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``x.to(device)`` without the dispatch when it is already there (called every round)."""
    return x if x.device == device else x.to(device)


def _budget(p_token: torch.Tensor, mode: str, lam: float | None, delta: float | None) -> torch.Tensor:
    if mode == "lambda":
        return (float(lam) - 1.0) * p_token
    return torch.full_like(p_token, float(delta))


def _mass_from_neighbour_values(
    p_token: torch.Tensor, nb_values: torch.Tensor, mode: str, lam: float | None,
    delta: float | None, forbid_zero_target_mass: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """P̃ and m* from the token's own mass ``[...]`` and its neighbours' masses ``[..., k]``."""
    if nb_values.shape[-1] == 0:
        return p_token.clone(), torch.zeros_like(p_token, dtype=torch.int64)
    cumulative = torch.cumsum(nb_values, dim=-1)  # non-decreasing: masses are >= 0
    budget = _budget(p_token, mode, lam, delta)
    m_star = (cumulative <= budget.unsqueeze(-1)).sum(dim=-1)
    taken = torch.gather(cumulative, -1, (m_star - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)
    relaxed = p_token + torch.where(m_star > 0, taken, torch.zeros_like(taken))
    if forbid_zero_target_mass:
        relaxed = torch.where(p_token > 0, relaxed, torch.zeros_like(relaxed))
    return relaxed, m_star


def relaxed_target_mass(
    P: torch.Tensor,
    tokens: torch.Tensor,
    neighbours: torch.Tensor | None,
    k: int,
    mode: str,
    lam: float | None = None,
    delta: float | None = None,
    forbid_zero_target_mass: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P̃(tokens), m*(tokens))`` for tokens ``[...]`` under target distributions ``P[..., V]``.

    ``P`` must already be float64 and normalised; ``tokens`` has ``P``'s batch shape.
    """
    vocab = P.shape[-1]
    nbrs = _check_neighbours(neighbours, k, vocab)
    p_token = torch.gather(P, -1, tokens.unsqueeze(-1)).squeeze(-1)
    nb_ids = _on(nbrs[:, :k], P.device)[tokens]  # [..., k]
    nb_values = torch.gather(P, -1, nb_ids)
    return _mass_from_neighbour_values(p_token, nb_values, mode, lam, delta, forbid_zero_target_mass)


def relaxed_target_mass_all_tokens(
    P: torch.Tensor,
    neighbours: torch.Tensor | None,
    k: int,
    mode: str,
    lam: float | None = None,
    delta: float | None = None,
    forbid_zero_target_mass: bool = False,
) -> torch.Tensor:
    """``P̃(x)`` for every vocabulary entry ``x``: ``[B, V]`` from ``P[B, V]`` (float64, normalised).

    Needed by the G* residual (spec §3.3), which evaluates the acceptance of every possible
    draft token. The ``[B, V, k]`` gather is done in vocabulary chunks to bound memory.
    """
    batch, vocab = P.shape
    nbrs = _on(_check_neighbours(neighbours, k, vocab)[:, :k], P.device)
    if k == 0:
        return P.clone()
    chunk = max(1, _GATHER_BUDGET // max(1, batch * k))
    if chunk >= vocab:  # one chunk (the usual case): no output buffer to copy into
        nb_values = P[:, nbrs.reshape(-1)].reshape(batch, vocab, k)
        return _mass_from_neighbour_values(P, nb_values, mode, lam, delta, forbid_zero_target_mass)[0]
    out = torch.empty_like(P)
    for start in range(0, vocab, chunk):
        ids = nbrs[start : start + chunk]  # [c, k]
        nb_values = P[:, ids.reshape(-1)].reshape(batch, ids.shape[0], k)
        relaxed, _ = _mass_from_neighbour_values(
            P[:, start : start + chunk], nb_values, mode, lam, delta, forbid_zero_target_mass
        )
        out[:, start : start + chunk] = relaxed
    return out
