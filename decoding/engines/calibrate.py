"""A tree engine's step overheads (CostTable.overhead_ms): the work of a step outside its forwards, per
step kind, measured once per device, model and row count and cached with the cost table (cost.py). The
one place a tree engine reads a clock; no decision reads one after it."""
from __future__ import annotations

import torch

from decoding.bundle import Conditions
from decoding.engines.base import caches_kept
from decoding.engines.cost import CostTable, now
from decoding.engines.planner import CHAIN, PLAIN, TREE

REPEATS = 9          # steps timed per kind, in turns; the least of the last eight counts (the first warms up)


@torch.inference_mode()
def calibrate(engine, R: int, forwards: CostTable) -> dict:
    """{kind: ms} over R cache rows: the least of real steps on a throwaway batch at mid-image, less what
    `forwards` prices their forwards at. The kinds take turns, one step each per round, so that other
    work on the host weighs on each alike: their prices against one another decide. In K/V buffers of
    its own (caches_kept): a stream that regroups measures its new row count mid-stream, beside the live
    batch."""
    e = engine
    slots = max(R // (2 if e.sampling.use_cfg else 1), 1)
    kinds = {PLAIN: lambda st, on: e.plain(st, on)}
    if e.trees:
        kinds[TREE] = lambda st, on: e.speculate(st, on, TREE, e.cfg.total_tokens, choose=False)
    if e.chain_budget is not None:
        kinds[CHAIN] = lambda st, on: e.speculate(st, on, CHAIN, e.cfg.chain)
    kept, e.costs = e.costs, forwards
    try:
        with caches_kept(e.gpt, e.drafter):
            for m in (e.gpt, e.drafter):
                if m is not None:
                    m._cache_key = None
            # one batch per kind; they share the K/V buffers, so the values are junk, the costs are not
            states = {kind: _midway_batch(e, slots) for kind in kinds}
            ms = {kind: [] for kind in kinds}
            for _ in range(REPEATS):
                for kind, step in kinds.items():
                    st = states[kind]
                    t0 = now(e.device)
                    seen = step(st, st.log.n < e.N)
                    ms[kind].append(1000 * (now(e.device) - t0) - e.planner.priced(st.R, kind, seen))
            return {kind: round(max(min(t[1:]), 0.0), 4) for kind, t in ms.items()}
    finally:
        e.costs = kept


def _midway_batch(e, slots: int):
    """A throwaway batch of `slots` blank prompts, moved to mid-image."""
    st = e.fresh(slots)
    e.admit(st, torch.arange(slots, device=e.device), blank_conditions(e, slots), list(range(slots)))
    _midway(e, st)
    return st


def _midway(e, st) -> None:
    """Move a calibration batch to the middle of its images, where the cost table's forwards were measured
    (attention reads every committed slot): half the tokens committed, the drafter caught up."""
    h = e.N // 2
    st.log.n[:] = h
    st.target.valid[:, : e.L + h - 1] = True
    if st.draft is not None:
        st.draft.valid[:, : e.L + h - 1] = True
    st.dn[:] = h - 1


def blank_conditions(e, B: int) -> Conditions:
    """Conditions of B prompts for calibration: class 0, or an all-zero caption of full length."""
    a = e.gpt.args
    if a.model_type == "c2i":
        return Conditions(torch.zeros(B, dtype=torch.long, device=e.device), None, [0] * B)
    return Conditions(torch.zeros(B, e.L, a.caption_dim, dtype=e.bundle.dtype, device=e.device),
                      torch.ones(B, e.L, dtype=torch.bool, device=e.device), [0] * B)
