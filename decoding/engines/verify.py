"""Tree verification: lossless sequential sibling trials, and LANTERN's relaxed acceptance.

At a node with target distribution p (already filtered exactly as vanilla filters it), children are
tried in draft-score order. A child x, drafted deterministically, is accepted with probability
r(x) / Σr, r being p with the rejected siblings removed; on acceptance the walk moves to x, else
r(x) ← 0. When no child is accepted, the bonus token is drawn from r. This samples exactly p.

LANTERN (relaxed): x also collects the mass of its nearest codebook neighbours, the longest prefix of
them (by latent distance) whose mass fits in the node's remaining budget δ; a rejection removes x and
those neighbours. The output moves at most δ of mass per token (total-variation distance ≤ δ).
"""
from __future__ import annotations

import numpy as np

from decoding.sampling import sample_from


class Lantern:
    def __init__(self, neighbours: np.ndarray, delta: float):
        if not 0 <= delta < 1:
            raise ValueError(f"engine.lantern_delta={delta}: must be in [0, 1)")
        self.neighbours, self.delta = neighbours, delta

    def relax(self, r: np.ndarray, x: int, budget: float) -> tuple[float, np.ndarray]:
        """(extra mass for x, the neighbours that gave it) within `budget`."""
        nb = self.neighbours[x]
        cum = np.cumsum(r[nb])
        j = int(np.searchsorted(cum, budget, side="right"))
        return (float(cum[j - 1]) if j else 0.0), nb[:j]


def codebook_neighbours(codebook: np.ndarray, k: int) -> np.ndarray:
    """[V, k] nearest codebook entries by L2 distance of the raw vectors, nearest first, self excluded."""
    d = ((codebook[:, None, :] - codebook[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    return np.argsort(d, axis=1, kind="stable")[:, : min(k, len(codebook) - 1)]


_NONE = np.empty(0, np.int64)


def verify_tree(probs: np.ndarray, tokens: np.ndarray, children: list[list[int]], rng: np.random.Generator,
                lantern: Lantern | None = None) -> tuple[list[int], int, list[float], float]:
    """probs [T, V]: target distribution at each block index (0 = root); tokens [T]; children[i] = block
    indices of i's children in trial order. Returns (accepted block indices, bonus token,
    p_target of each accepted token, p_target of the bonus)."""
    path, p_acc, node = [], [], 0
    while True:
        r = probs[node].copy()
        budget = lantern.delta if lantern else 0.0
        for child in children[node]:
            x = tokens[child]
            extra, used = lantern.relax(r, x, budget) if lantern else (0.0, _NONE)
            if rng.random() * r.sum() < r[x] + extra:
                path.append(child)
                p_acc.append(float(probs[node, x]))
                node = child
                break
            r[x] = 0.0
            r[used] = 0.0
            budget -= extra
        else:
            bonus = sample_from(r, rng.random())
            return path, bonus, p_acc, float(probs[node, bonus])
