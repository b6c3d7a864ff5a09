"""Draft-tree machinery: LANTERN's TVD bound, ADT-Tree's (d, w) moves, tree construction and masks."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding.engines import build_engine
from decoding.engines.policy import AdjacencyAdaptive, bisect
from decoding.engines.verify import Lantern, codebook_neighbours, verify_tree
from tests.conftest import labels


# -- LANTERN ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delta", [0.1, 0.5])
def test_lantern_moves_at_most_delta_of_mass_per_token(delta):
    rng = np.random.default_rng(0)
    V = 12
    codebook = rng.normal(size=(V, 3))
    lantern = Lantern(codebook_neighbours(codebook, 4), delta)
    n = 100_000
    worst = 0.0
    for trial in range(2):
        p = rng.dirichlet(np.full(V, 0.7))
        drafts = list(rng.choice(V, size=3, replace=False))
        probs = np.tile(p, (4, 1))
        tokens = np.array([0, *drafts])
        children = [[1, 2, 3], [], [], []]  # three siblings tried in order at the root
        out = np.zeros(V)
        for _ in range(n):
            path, bonus, _, _ = verify_tree(probs, tokens, children, rng, lantern)
            out[tokens[path[0]] if path else bonus] += 1
        tvd = 0.5 * np.abs(out / n - p).sum()
        worst = max(worst, tvd)
        assert tvd <= delta + 0.008  # the TVD estimate from 100k draws carries ~0.004 of noise
    # with delta > 0 the relaxation really moves mass (so the bound is not met trivially)
    assert worst > min(delta, 0.05) * 0.2


def test_lantern_with_zero_delta_is_exact():
    rng = np.random.default_rng(1)
    V = 8
    lantern = Lantern(codebook_neighbours(rng.normal(size=(V, 2)), 3), 0.0)
    p = rng.dirichlet(np.ones(V))
    probs, tokens, children = np.tile(p, (3, 1)), np.array([0, 2, 5]), [[1, 2], [], []]
    out = np.zeros(V)
    for _ in range(100_000):
        path, bonus, _, _ = verify_tree(probs, tokens, children, rng, lantern)
        out[tokens[path[0]] if path else bonus] += 1
    assert 0.5 * np.abs(out / 1e5 - p).sum() < 0.01


def test_codebook_neighbours_are_nearest_first_without_self():
    cb = np.array([[0.0], [1.0], [3.0], [10.0]])
    nb = codebook_neighbours(cb, 2)
    assert nb.tolist() == [[1, 2], [0, 2], [1, 0], [2, 1]]


# -- ADT-Tree policy ----------------------------------------------------------------------------------
BOUNDS = (2, 10, 1, 8)  # d_min, d_max, w_min, w_max


def test_bisection_goes_deeper_and_narrower_when_easy():
    assert bisect(4, 6, alpha=0.75, beta=0.5, bounds=BOUNDS) == (7, 3)   # ceil((4+10)/2), floor((6+1)/2)
    assert bisect(4, 6, alpha=0.5, beta=0.5, bounds=BOUNDS) == (7, 3)    # alpha == beta counts as easy


def test_bisection_goes_shallower_and_wider_when_hard():
    assert bisect(7, 3, alpha=0.25, beta=0.5, bounds=BOUNDS) == (4, 6)   # floor((7+2)/2), ceil((3+8)/2)


@pytest.mark.parametrize("seed", range(5))
def test_bisection_stays_within_bounds(seed):
    rng = np.random.default_rng(seed)
    d, w = 4, 4
    for _ in range(200):
        d, w = bisect(d, w, rng.random(), 0.5, BOUNDS)
        assert 2 <= d <= 10 and 1 <= w <= 8
    for _ in range(10):
        d, w = bisect(d, w, 1.0, 0.5, BOUNDS)
    assert (d, w) == (10, 1)
    for _ in range(10):
        d, w = bisect(d, w, 0.0, 0.5, BOUNDS)
    assert (d, w) == (2, 8)


def test_horizontal_adjacency_initialisation():
    grid = 4
    pol = AdjacencyAdaptive(1, grid, depth=4, width=4, d_min=2, d_max=10, w_min=1, w_max=8, beta=0.5)
    acc = np.zeros(16, bool)
    assert pol.plan(0, 1, acc) == (4, 4)            # first row: defaults
    pol.update(0, 4, 4, accepted_drafts=4)            # easy -> (7, 2)
    assert pol.plan(0, 3, acc) == (7, 2)            # same row: the left neighbour's adapted state
    pol.update(0, 7, 2, accepted_drafts=0)            # hard -> (4, 5)
    assert pol.plan(0, 5, acc) == (7, 2)            # new row: state recorded at the previous row's start
    pol.update(0, 7, 2, accepted_drafts=0)            # first tree of row 1 -> (4, 5) recorded for row 1
    assert pol.plan(0, 6, acc) == (4, 5)
    assert pol.plan(0, 8, acc) == (4, 5)            # row 2 starts from row 1's record


def test_2d_adjacency_reads_the_row_above():
    grid = 4
    kw = dict(depth=4, width=4, d_min=2, d_max=10, w_min=1, w_max=8, beta=0.5)
    acc = np.zeros(16, bool)
    acc[0:4] = True                                   # row 0 was all accepted
    h = AdjacencyAdaptive(1, grid, **kw)
    two = AdjacencyAdaptive(1, grid, adjacency="2d", **kw)
    assert h.plan(0, 4, acc) == (4, 4)
    assert two.plan(0, 4, acc) == (7, 2)              # one easy bisection step from the row above
    acc[0:4] = False
    assert AdjacencyAdaptive(1, grid, adjacency="2d", **kw).plan(0, 4, acc) == (3, 6)


def test_bad_bounds_fail_at_construction(tiny):
    with pytest.raises(ValueError, match="d_min"):
        build_engine(tiny, {"name": "adt_tree", "depth": 20, "d_max": 10})


def test_adt_engine_logs_adapting_tree_shapes(tiny):
    engine = build_engine(tiny, {"name": "adt_tree", "cfg_scale": 2.0, "total_tokens": 6, "depth": 2, "width": 2,
                                 "d_min": 1, "d_max": 3, "w_min": 1, "w_max": 3})
    r = engine.generate(labels(30), list(range(30)))
    depths = np.concatenate([x.records["tree_depth"][1:] for x in r])
    widths = np.concatenate([x.records["tree_width"][1:] for x in r])
    assert depths.min() >= 0 and depths.max() <= 3 and widths.min() >= 1 and widths.max() <= 3
    assert len(set(zip(depths.tolist(), widths.tolist()))) > 1  # the shape really changes


# -- tree construction --------------------------------------------------------------------------------
def test_tree_selection_keeps_ancestors_and_budget(tiny):
    engine = build_engine(tiny, {"name": "eagle2", "cfg_scale": 2.0, "total_tokens": 5, "depth": 3, "width": 3})
    tok = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]])
    par = torch.tensor([[-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2]])
    depth = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2]])
    score = torch.tensor([[-0.1, -1.0, -3.0, -0.3, -2.0, -4.0, -1.5, -1.2, -5.0, -6.0, -7.0, float("-inf")]])
    t = engine._select(tok, par, depth, score, score.exp(), 5)
    # best five by score: -0.1, -0.3, -1.0, -1.2, -1.5 -> nodes 0, 3, 1, 7, 6; ordered by (depth, -score)
    assert t["depth"].tolist() == [[1, 1, 2, 2, 2]]
    assert t["score"][0].tolist() == pytest.approx([-0.1, -1.0, -0.3, -1.2, -1.5])
    assert t["parent"].tolist() == [[0, 0, 1, 2, 2]]  # block indices: 0 = root, j+1 = node j
