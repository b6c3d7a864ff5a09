"""A continuous batch's state, typed: each field declares how it follows its row when the batch regroups
(scheduler.py), so nothing is found by reflection and nothing per row can be forgotten.

    per_slot()       [slots, ...] tensors, or objects with `copy_rows(old, dst, src)` (log, streams, policy)
    per_cache_row()  [R, ...] tensors (R = 2 slots with CFG: [cond; uncond]), or a CachedModel
    carried()        counters the new batch keeps as they are
    (no marker)      rebuilt by the engine's `start` for the new size: never a tensor
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from decoding.engines.log import TokenLog
from decoding.sampling import Streams

SLOT, CACHE, CARRY = "slot", "cache", "carry"


def per_slot(**kw):
    return field(metadata={"rows": SLOT}, **kw)


def per_cache_row(**kw):
    return field(metadata={"rows": CACHE}, **kw)


def carried(**kw):
    return field(metadata={"rows": CARRY}, **kw)


@dataclass
class BatchState:
    """What every slot engine's batch has: its size, the token log, the per-prompt random streams and the
    keys drawn from them [slots, N], and the target's cache."""
    slots: int
    log: TokenLog = per_slot()
    streams: Streams = per_slot()
    keys: torch.Tensor = per_slot()
    target: object = per_cache_row()       # CachedModel

    def continue_rows(self, old: "BatchState", src: torch.Tensor, dst: torch.Tensor, csrc: torch.Tensor,
                      cdst: torch.Tensor) -> None:
        """Rows dst of this (fresh) state continue old's rows src; cache rows cdst continue csrc."""
        for f in fields(self):
            kind, value, mine = f.metadata.get("rows"), getattr(old, f.name), getattr(self, f.name)
            if kind is None:
                if torch.is_tensor(value):
                    raise TypeError(f"{type(self).__name__}.{f.name} is a tensor with no row marker (state.py)")
                continue
            if kind == CARRY:
                setattr(self, f.name, value)
            elif value is None:
                continue
            elif hasattr(value, "copy_rows"):
                mine.copy_rows(value, *((cdst, csrc) if kind == CACHE else (dst, src)))
            else:
                at, by = (cdst, csrc) if kind == CACHE else (dst, src)
                if mine is None:                          # (a buffer made at the first admit: vanilla's probs)
                    rows = (len(cdst) // max(len(dst), 1) if kind == CACHE else 1) * self.slots
                    mine = value.new_zeros((rows,) + value.shape[1:])
                    setattr(self, f.name, mine)
                mine[at] = value[by]
