"""Tree-shape policies: how deep (d) and how wide (w = per-level top-k) each row's next draft tree is,
as [B] tensors on the device.

`FixedShape` is EAGLE-2's (same d, w everywhere). `AdjacencyAdaptive` is ADT-Tree (docs/design.md,
"ADT-Tree"):
  * horizontal adjacency initialisation: a tree starts from the adapted state of the tree before it in
    the same grid row; the first tree of a row starts from the state recorded at the start of the
    row above (the adapted state of that row's first tree), or the defaults on the first row;
  * bisectional adaptation: with α = accepted drafts / the depth actually drafted (the node budget may
    cut the tree below d), α ≥ β moves to
    (ceil((d + d_max) / 2), floor((w + w_min) / 2)), deeper and narrower; α < β moves to
    (floor((d + d_min) / 2), ceil((w + w_max) / 2)), shallower and wider;
  * `adjacency="2d"` (our extension): the initial state also takes one bisection step from the
    acceptance observed in the row above, over the columns the new tree will cover.
"""
from __future__ import annotations

import torch


class FixedShape:
    def __init__(self, batch: int, depth: int, width: int, device):
        self.d = torch.full((batch,), depth, dtype=torch.long, device=device)
        self.w = torch.full((batch,), width, dtype=torch.long, device=device)

    def plan(self, n: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.d, self.w

    def update(self, d, w, accepted_drafts, active, drafted=None) -> None:
        pass

    def reset(self, rows) -> None:
        pass

    def copy_rows(self, old: "FixedShape", dst, src) -> None:
        pass                                                               # every row plans the same


def bisect(d, w, alpha, beta: float, bounds):
    """One bisection step of (d, w) toward the bounds: deeper and narrower where α ≥ β."""
    d_min, d_max, w_min, w_max = bounds
    easy = alpha >= beta
    return (torch.where(easy, (d + d_max + 1) // 2, (d + d_min) // 2),
            torch.where(easy, (w + w_min) // 2, (w + w_max + 1) // 2))


class AdjacencyAdaptive:
    def __init__(self, batch: int, grid: int, depth: int, width: int, bounds: tuple, beta: float,
                 adjacency: str, device):
        self.grid, self.beta, self.bounds, self.adjacency = grid, beta, bounds, adjacency
        self.default = torch.tensor([depth, width], device=device)
        self.state = self.default.repeat(batch, 1)                         # [B, 2] after the last tree
        self.row = torch.full((batch,), -1, dtype=torch.long, device=device)  # grid row of the last tree
        self.row_start = self.default.repeat(batch, grid + 2, 1)          # [B, rows + 2, 2]: row r at r + 1 (finished rows plan row G)
        self.first = torch.zeros(batch, dtype=torch.bool, device=device)  # last tree opened its row

    def plan(self, n: torch.Tensor, accepted: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(d, w) [B] for the trees whose first drafted token is token n [B]; accepted [B, N] so far."""
        G = self.grid
        r, c = n // G, n % G
        self.first = r != self.row
        start = self.row_start.gather(1, r[:, None, None].expand(-1, 1, 2))[:, 0]   # row r-1's record
        self.state = torch.where(self.first[:, None], start, self.state)
        self.row = r
        d, w = self.state.unbind(1)
        if self.adjacency == "2d":
            cs = torch.nn.functional.pad(accepted.long().cumsum(1), (1, 0))
            lo = ((r - 1) * G + c).clamp(min=0)
            hi = ((r - 1) * G + torch.minimum(c + d, torch.full_like(c, G))).clamp(min=0)
            above = (cs.gather(1, hi[:, None]) - cs.gather(1, lo[:, None]))[:, 0] / (hi - lo).clamp(min=1)
            d2, w2 = bisect(d, w, above, self.beta, self.bounds)
            d, w = torch.where(r > 0, d2, d), torch.where(r > 0, w2, w)
        return d, w

    def reset(self, rows) -> None:
        """Rows [k] start new images."""
        self.state[rows] = self.default
        self.row[rows] = -1
        self.row_start[rows] = self.default
        self.first[rows] = False

    def copy_rows(self, old: "AdjacencyAdaptive", dst, src) -> None:
        """Rows dst continue old's rows src (the engine regrouped its batch: scheduler.py)."""
        for name in ("state", "row", "row_start", "first"):
            getattr(self, name)[dst] = getattr(old, name)[src]

    def update(self, d, w, accepted_drafts, active, drafted=None) -> None:
        """After verifying trees planned as (d, w): α = accepted drafts / the depth actually drafted
        (`drafted`, which the node budget may have cut below d; default d)."""
        base = d if drafted is None else drafted
        d2, w2 = bisect(d, w, accepted_drafts / base.clamp(min=1), self.beta, self.bounds)
        new = torch.stack([d2, w2], 1)
        self.state = torch.where(active[:, None], new, self.state)
        record = active & self.first                                       # the first tree of its row
        at = (self.row + 1)[:, None, None].expand(-1, 1, 2)
        self.row_start.scatter_(1, at, torch.where(record[:, None], new, self.row_start.gather(1, at)[:, 0])[:, None])
        self.first = self.first & ~active
