"""Distribution distances between two sets of image features (rows are images).

`frechet`: the Fréchet distance of the Gaussians fitted to each set (FID's formula, on the features the
report uses; report.images says which), ||mu_a - mu_b||^2 + Tr(S_a + S_b - 2 (S_a S_b)^(1/2)).
`precision_recall`: Kynkäänniemi et al. 2019 (k-nearest-neighbour manifolds): precision is the share of
generated samples inside the reference set's manifold (the union of balls reaching each reference
sample's k-th nearest reference neighbour), recall the share of reference samples inside the generated
set's manifold. Both are in [0, 1]; 1 / 1 means each set covers the other.
"""
from __future__ import annotations

import numpy as np


def _eig_psd(m: np.ndarray):
    """Eigen-decomposition of a symmetric PSD matrix, eigenvalues within rounding of 0 set to 0 (a
    singular covariance has many; their square roots would turn 1e-16 noise into 1e-8 each)."""
    w, v = np.linalg.eigh(m)
    w[w < max(w.max(), 0) * len(w) * np.finfo(w.dtype).eps] = 0
    return w, v


def _sqrt_psd(m: np.ndarray) -> np.ndarray:
    w, v = _eig_psd(m)
    return (v * np.sqrt(w)) @ v.T


def frechet(a: np.ndarray, b: np.ndarray) -> float:
    """a [n, F], b [m, F] (n, m >= 2). Tr((S_a S_b)^(1/2)) is taken as the trace of
    (S_a^(1/2) S_b S_a^(1/2))^(1/2), a symmetric PSD matrix with the same eigenvalues, so the result is
    real and stable when the covariances are singular (fewer images than features)."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if len(a) < 2 or len(b) < 2:
        raise ValueError(f"frechet: need at least 2 samples per set, got {len(a)} and {len(b)}")
    mu = a.mean(0) - b.mean(0)
    sa, sb = np.atleast_2d(np.cov(a, rowvar=False)), np.atleast_2d(np.cov(b, rowvar=False))
    ra = _sqrt_psd(sa)
    m = ra @ sb @ ra
    cross = np.sqrt(_eig_psd((m + m.T) / 2)[0]).sum()
    return float(mu @ mu + np.trace(sa) + np.trace(sb) - 2 * cross)


def _sqdist(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    return np.clip((x * x).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2 * x @ y.T, 0, None)


def _radii(x: np.ndarray, k: int, chunk: int) -> np.ndarray:
    """Squared distance from each sample to its k-th nearest other sample of the same set."""
    out = np.empty(len(x))
    for i in range(0, len(x), chunk):
        d = _sqdist(x[i:i + chunk], x)
        out[i:i + chunk] = np.partition(d, k, axis=1)[:, k]        # index 0 is the sample itself
    return out


def _covered(x: np.ndarray, ref: np.ndarray, radii: np.ndarray, chunk: int) -> np.ndarray:
    """Whether each sample of x lies within some reference sample's ball."""
    out = np.empty(len(x), bool)
    for i in range(0, len(x), chunk):
        out[i:i + chunk] = (_sqdist(x[i:i + chunk], ref) <= radii[None, :]).any(1)
    return out


def precision_recall(reference: np.ndarray, generated: np.ndarray, k: int = 3, chunk: int = 1024) -> tuple[float, float]:
    """reference [n, F], generated [m, F], n and m > k. Memory O(chunk * max(n, m))."""
    r, g = np.asarray(reference, np.float64), np.asarray(generated, np.float64)
    if len(r) <= k or len(g) <= k:
        raise ValueError(f"precision_recall: need more than k={k} samples per set, got {len(r)} and {len(g)}")
    precision = _covered(g, r, _radii(r, k, chunk), chunk).mean()
    recall = _covered(r, g, _radii(g, k, chunk), chunk).mean()
    return float(precision), float(recall)
