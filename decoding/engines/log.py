"""The per-token acceptance log every engine fills, and the one definition of its columns.

`TOKEN_COLUMNS` is the tokens table's schema (docs/design.md, "Output contract"): the job builds its
Arrow schema from it, so a column is added here and nowhere else. The log lives on the model's device
and is filled by batched scatters, one per step; it reaches the host once, when the batch is done.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from enum import IntEnum
from typing import Optional

import numpy as np
import torch


@dataclass(frozen=True)
class Column:
    name: str
    dtype: str       # numpy dtype name; the Arrow type follows from it
    fill: float      # value before anything is written (NaN: "not applicable", e.g. q_draft of a bonus)
    doc: str
    null: Optional[float] = None  # a value the tokens table writes as null (e.g. token_id of a continuous token)


STORED = (
    Column("token_id", "int32", -1, "code index (discrete models; null for continuous tokens)", null=-1),
    Column("cell", "int32", -1, "grid cell, raster index (row * grid + col); raster order unless committed"),
    Column("step", "int32", 0, "the image's own engine step (verification, Jacobi iteration, MAR step) that committed it"),
    Column("accepted", "bool", 0, "drafted and accepted by the target, vs produced by the target itself"),
    Column("accept_len", "int32", 0, "tokens committed by its step"),
    Column("p_target", "float32", np.nan, "target probability of the committed token"),
    Column("q_draft", "float32", np.nan, "draft probability of an accepted draft token"),
    Column("tree_depth", "int32", 0, "depth of the draft tree of its step"),
    Column("tree_width", "int32", 0, "per-level width of the draft tree of its step"),
    Column("budget", "int32", 0, "draft nodes per row its step verified (0: a plain step)"),
    Column("proposer", "int8", 0, "what drafted its step: 0 nothing (a plain step, the target alone), 1 a chain "
           "of the target's own draws, 2 the drafter's tree, 3 a Jacobi window, 4 a draft model (cspd)"),
    Column("log_accept_ratio", "float32", np.nan, "log r of the continuous acceptance test (cspd drafts)"),
    Column("window_pos", "int32", -1, "AR step of the token within its draft window (cspd; -1: target-made)"),
    Column("fallback", "bool", 0, "cspd: the residual sampler ran out of tries, the target's own sample was used"),
)
# What `records` emits: the position in generation order and the cell as (row, col), then the stored
# columns but `cell`. This is the tokens table (less prompt_id and engine, which the job adds).
TOKEN_COLUMNS = (
    Column("token_index", "int32", 0, "position in generation order"),
    Column("row", "int32", 0, "grid row of the token's cell"),
    Column("col", "int32", 0, "grid column of the token's cell"),
    *(c for c in STORED if c.name != "cell"),
)


class Proposer(IntEnum):
    """The proposer column's codes."""
    PLAIN, CHAIN, TREE, JACOBI, DRAFT_MODEL = range(5)


class TokenLog:
    """Committed tokens and their records for B prompts of N tokens each, in generation order.

    Writes go through `commit`, which takes a block of up to K tokens per row and writes the first
    `count[b]` of them at that row's next free positions (the rest go to a scratch column). The columns
    are stored by kind, integers (and flags) in one tensor and floats in another, so a commit is two
    scatters however many columns it writes: a decoding step's bookkeeping is a handful of ops.
    """

    def __init__(self, B: int, N: int, grid: int, device):
        self.B, self.N, self.grid, self.device = B, N, grid, device
        self.slot = {}                                    # column -> (group, index in the group)
        groups = {"int": [c for c in STORED if c.dtype != "float32"], "float": [c for c in STORED if c.dtype == "float32"]}
        self.groups, self.fills = {}, {}
        for g, cols in groups.items():
            dtype = torch.float32 if g == "float" else torch.long
            self.fills[g] = torch.tensor([c.fill for c in cols], dtype=dtype, device=device)[None, :, None]
            self.groups[g] = self.fills[g].repeat(B, 1, N + 1)
            self.slot.update({c.name: (g, i) for i, c in enumerate(cols)})
        self.col("cell")[:, :N] = torch.arange(N, device=device)       # raster order unless committed
        self.n = torch.zeros(B, dtype=torch.long, device=device)          # committed tokens per row
        self.target_forwards = torch.zeros(B, dtype=torch.long, device=device)
        self.draft_forwards = torch.zeros(B, dtype=torch.long, device=device)
        self.phase_s: dict[str, float] = {}
        self.latents: Optional[torch.Tensor] = None   # continuous engines: [B, N, C] token vectors, raster order
        self._at: dict[tuple, torch.Tensor] = {}

    def reset(self, rows: torch.Tensor) -> None:
        """Empty rows [k] for new prompts."""
        for g, store in self.groups.items():
            store[rows] = self.fills[g][0]
        self.col("cell")[rows, : self.N] = torch.arange(self.N, device=self.device)
        self.n[rows], self.target_forwards[rows], self.draft_forwards[rows] = 0, 0, 0

    def copy_rows(self, old: "TokenLog", dst: torch.Tensor, src: torch.Tensor) -> None:
        """Rows dst continue old's rows src, records and counts (an engine regrouped its batch); the phase
        times carry over."""
        for g, store in self.groups.items():
            store[dst] = old.groups[g][src]
        for name in ("n", "target_forwards", "draft_forwards"):
            getattr(self, name)[dst] = getattr(old, name)[src]
        self.phase_s = dict(old.phase_s)

    def col(self, name: str) -> torch.Tensor:
        """[B, N + 1] view of one column (the last position is scratch)."""
        g, i = self.slot[name]
        return self.groups[g][:, i]

    @property
    def tokens(self) -> torch.Tensor:
        """[B, N] int64 committed code indices (past a row's n: -1, not committed yet)."""
        return self.col("token_id")[:, : self.N]

    def commit(self, count: torch.Tensor, rows: Optional[torch.Tensor] = None, **values) -> None:
        """count [B] tokens per row (0 = none); values: column -> [B, K] per token, or [B] or a number
        (one value for the whole block). With rows [k] (distinct), count and tensor values are those
        rows' ([k], [k, K]) and the other rows commit nothing."""
        if rows is not None:
            count = torch.zeros(self.B, dtype=count.dtype, device=self.device).index_copy(0, rows, count)
            values = {k: v.new_zeros((self.B,) + v.shape[1:]).index_copy(0, rows, v)
                      if torch.is_tensor(v) and v.dim() else v for k, v in values.items()}
        K = max([v.shape[1] for v in values.values() if torch.is_tensor(v) and v.dim() == 2] or [1])
        lanes = torch.arange(K, device=self.device)
        self.write(torch.where(lanes < count[:, None], self.n[:, None] + lanes, self.N), **values)
        self.n += count

    def write(self, pos: torch.Tensor, **values) -> None:
        """Write values at positions pos [B, K] (N = scratch); values as for `commit`. Leaves n alone."""
        K = pos.shape[1]
        values = {k: torch.as_tensor(v, device=self.device) for k, v in values.items()}
        for g, store in self.groups.items():
            names = [k for k in values if self.slot[k][0] == g]
            if not names:
                continue
            block = torch.stack([values[k].reshape(-1, 1).expand(self.B, K) if values[k].dim() < 2 else values[k]
                                 for k in names], 1).to(store.dtype)                              # [B, k, K]
            key = tuple(names)
            if key not in self._at:                                  # offsets of these columns, made once
                self._at[key] = torch.tensor([self.slot[k][1] * (self.N + 1) for k in names], device=self.device)[None, :, None]
            at = self._at[key]
            store.view(self.B, -1).scatter_(1, (at + pos[:, None, :]).flatten(1), block.flatten(1))

    @contextmanager
    def phase(self, name: str):
        """Time one phase of a decoding step (draft, verify, ...): the bench reports ms per step."""
        t0 = time.perf_counter()
        yield
        self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    def records(self, b: int) -> dict:
        """Row b's {column: numpy [N]}, the columns of TOKEN_COLUMNS."""
        host = {c.name: self.col(c.name)[b, : self.N].cpu().numpy().astype(c.dtype) for c in STORED}
        cell = host.pop("cell")
        return {"token_index": np.arange(self.N, dtype=np.int32), "row": cell // self.grid, "col": cell % self.grid,
                **host}
