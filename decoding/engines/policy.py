"""Tree-shape policies: how deep (d) and how wide (w = per-level top-k) the next draft tree is.

`FixedShape` is EAGLE-2's (same d, w everywhere). `AdjacencyAdaptive` is ADT-Tree (DESIGN §3):
  * horizontal adjacency initialisation: a tree starts from the adapted state of the tree before it in
    the same grid row; the first tree of a row starts from the state recorded at the start of the
    row above (the adapted state of that row's first tree), or the defaults on the first row;
  * bisectional adaptation: with α = accepted drafts / d, α ≥ β moves to
    (ceil((d + d_max) / 2), floor((w + w_min) / 2)), deeper and narrower; α < β moves to
    (floor((d + d_min) / 2), ceil((w + w_max) / 2)), shallower and wider;
  * `adjacency="2d"` (our extension): the initial state also takes one bisection step from the
    acceptance observed in the row above, over the columns the new tree will cover.
"""
from __future__ import annotations

import math

import numpy as np


class FixedShape:
    def __init__(self, depth: int, width: int):
        self.depth, self.width = depth, width

    def plan(self, b: int, n: int, accepted: np.ndarray) -> tuple[int, int]:
        return self.depth, self.width

    def update(self, b: int, d: int, w: int, accepted_drafts: int) -> None:
        pass


def bisect(d: int, w: int, alpha: float, beta: float, bounds) -> tuple[int, int]:
    d_min, d_max, w_min, w_max = bounds
    if alpha >= beta:
        return math.ceil((d + d_max) / 2), math.floor((w + w_min) / 2)
    return math.floor((d + d_min) / 2), math.ceil((w + w_max) / 2)


class AdjacencyAdaptive:
    def __init__(self, batch: int, grid: int, depth: int, width: int, d_min: int, d_max: int,
                 w_min: int, w_max: int, beta: float, adjacency: str = "horizontal"):
        if not (1 <= d_min <= depth <= d_max and 1 <= w_min <= width <= w_max):
            raise ValueError(f"engine.d_min/depth/d_max={d_min}/{depth}/{d_max}, engine.w_min/width/w_max={w_min}/{width}/"
                             f"{w_max}: need 1 <= d_min <= depth <= d_max and 1 <= w_min <= width <= w_max")
        if adjacency not in ("horizontal", "2d"):
            raise ValueError(f"engine.adjacency={adjacency!r}: use 'horizontal' or '2d'")
        self.grid, self.beta, self.adjacency = grid, beta, adjacency
        self.bounds = (d_min, d_max, w_min, w_max)
        self.default = (depth, width)
        self.state = [self.default] * batch            # adapted state after the last tree
        self.row = [-1] * batch                         # grid row of the last tree
        self.row_start = [dict() for _ in range(batch)]  # grid row -> adapted state of its first tree
        self.first_in_row = [False] * batch

    def plan(self, b: int, n: int, accepted: np.ndarray) -> tuple[int, int]:
        """(d, w) for the tree whose first drafted token is token n; `accepted` = per-token flags so far."""
        r, c = divmod(n, self.grid)
        self.first_in_row[b] = r != self.row[b]
        if self.first_in_row[b]:
            self.state[b] = self.row_start[b].get(r - 1, self.default)
            self.row[b] = r
        d, w = self.state[b]
        if self.adjacency == "2d" and r > 0:
            above = accepted[(r - 1) * self.grid + c: (r - 1) * self.grid + min(c + d, self.grid)]
            d, w = bisect(d, w, float(above.mean()), self.beta, self.bounds)
        return d, w

    def update(self, b: int, d: int, w: int, accepted_drafts: int) -> None:
        self.state[b] = bisect(d, w, accepted_drafts / max(d, 1), self.beta, self.bounds)
        if self.first_in_row[b]:
            self.row_start[b][self.row[b]] = self.state[b]
            self.first_in_row[b] = False
