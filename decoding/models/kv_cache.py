"""Static KV cache addressed by (row, slot).

Every row keeps its own length: a speculative step writes a block of draft tokens at per-row slots
(under a tree mask), and `move` then copies the accepted path's K/V into contiguous slots. Layout is
[B, H, S, D]: attention reads a prefix of S per (row, head) as one contiguous block, which on a CPU took
0.85 ms against 1.34 ms for [B, S, H, D] per layer at 16 rows x 270 slots (docs/design.md, "Budgets");
a per-row scatter is still one index_put (k[rows, :, slots] is [B, T, H, D]).
"""
from __future__ import annotations

import torch
import torch.nn as nn


class KVCache(nn.Module):
    def __init__(self, batch: int, seq_len: int, n_head: int, head_dim: int, dtype, device=None):
        super().__init__()
        shape = (batch, n_head, seq_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("rows", torch.arange(batch, device=device)[:, None], persistent=False)

    @property
    def seq_len(self) -> int:
        return self.k.shape[2]

    def update(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor | None = None):
        """slots [B, T]; k, v [B, T, H, D], written to cache rows `rows` [B] (default: the first B).
        Returns those rows' whole cache (k, v) [B, H, S, D]."""
        if rows is None:
            r = self.rows[: slots.shape[0]]
            self.k[r, :, slots] = k.to(self.k.dtype)
            self.v[r, :, slots] = v.to(self.v.dtype)
            return self.k[: slots.shape[0]], self.v[: slots.shape[0]]
        self.k[rows[:, None], :, slots] = k.to(self.k.dtype)
        self.v[rows[:, None], :, slots] = v.to(self.v.dtype)
        return self.k[rows], self.v[rows]

    def move(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy entries at slots src [B, A] to slots dst [B, A], per row (gather first: ranges may overlap)."""
        rows = self.rows[: src.shape[0]]
        self.k[rows, :, dst] = self.k[rows, :, src].clone()
        self.v[rows, :, dst] = self.v[rows, :, src].clone()
