"""Which kind of step a tree engine takes next: plain, chain or tree, and how large. A pure function of
the cost table and the budgets' acceptance statistics (budget.py), never of the clock: the budgets learn
what a step cost from `priced`, the cost table's price of what ran, so the same table and prompts give
the same steps and the same bytes (docs/design.md, "Roles of a speculative step")."""
from __future__ import annotations

import numpy as np
import torch

from decoding.engines import proposers

PLAIN, CHAIN, TREE = "plain", "chain", "spec"    # step kinds, as the cost table's overheads name them


class StepPlanner:
    def __init__(self, engine):
        self.e = engine

    def choose(self, st, active) -> tuple[str, int, torch.Tensor | None]:
        """(kind, size, room) for this step: size is the chain's or the tree's node budget; room [slots]
        the most draft tokens each row may verify (None: no limit). Where the budgets know the next steps
        are plain (Budget.quiet), nothing is planned."""
        e = self.e
        if st.quiet > 0:
            st.quiet -= 1
            for b in st.budgets:
                b.hold(st.R)
            return PLAIN, 0, None
        confidence = lambda: self.confidence(st, active)              # noqa: E731
        chain = e.chain_budget.plan(st.R, 0, confidence) if e.chain_budget in st.budgets else 0
        if chain:
            e.budget.hold(st.R)
            return CHAIN, chain, None
        if not e.trees:
            e.budget.hold(st.R)
            return PLAIN, 0, None
        room, may = self.room(st)
        plan = min(e.budget.plan(st.R, st.pending, confidence), e.N) if may else e.budget.hold(st.R)
        return (TREE, plan, room) if plan else (PLAIN, 0, None)

    def learn(self, st, kind: str, size: int, seen, quiet: bool) -> None:
        """Tell the budgets what the step committed and what it cost by the cost table."""
        e = self.e
        if e.costs is None:
            return
        if kind == CHAIN:
            if seen is not None:
                e.chain_budget.observe(st.R, size, self.priced(st.R, CHAIN, seen), 1 + seen.drafts,
                                       np.array([seen.drafts]))
        elif kind == TREE:
            e.budget.observe(st.R, size, self.priced(st.R, TREE, seen), seen.tokens, seen.by_rank, seen.predicted,
                             seen.accepted, catch_up_ms=seen.catch_up_ms, behind=seen.behind)
        elif not quiet:
            step_ms = self.priced(st.R, PLAIN, None)
            for b in st.budgets:
                b.observe(st.R, 0, step_ms)
            if st.pending == proposers.CATCH_UP_MAX:         # (until then the catch-up's cost, and the plan, change)
                st.quiet = min((b.quiet(st.R, st.pending) for b in st.budgets), default=e.N)

    def priced(self, R: int, kind: str, seen) -> float:
        """ms of a step of `kind` over R rows by the cost table: its forwards, and the work outside them
        (CostTable.overhead). What the budgets learn a step cost, in place of the clock."""
        c = self.e.costs
        if kind == PLAIN:
            forward = c.target(R, 1)
        elif kind == CHAIN:
            forward = c.target(R, 1 + self.e.cfg.chain)
        else:
            forward = seen.drafting_ms + c.target(R, 1 + seen.K)
        return forward + c.overhead(kind, R)

    def drafting_ms(self, R: int, catch_up: int, levels: int, width: int) -> tuple[float, float]:
        """(catch-up ms, drafting ms including it) by the cost table: one drafter forward over the catch-up's
        pairs, then one per tree level past the first, `width` nodes per row."""
        c = self.e.costs
        if c is None:
            return 0.0, 0.0
        cu = c.drafter(R, catch_up) if catch_up else 0.0
        return cu, cu + max(levels - 1, 0) * c.drafter(R, width)

    def chains_pay(self, R: int) -> bool:
        """Whether chain steps may run over R cache rows: where one costs at most CHAIN_COST plain steps by
        the cost table, or always where the drafter is off (budget=fixed, total_tokens=0)."""
        e = self.e
        if e.chain_budget is None or e.costs is None:
            return e.chain_budget is not None
        return e.costs.target(R, 1 + e.cfg.chain) <= CHAIN_COST * e.costs.target(R, 1)

    def confidence(self, st, active, last: int = 8) -> float:
        """The least confident busy row's mean target probability of its last `last` tokens (the budget's
        cue that a flat stretch began: Budget.plan). One read-back, made only when it could start a probe."""
        log = st.log
        idx = (log.n[:, None] - 1 - torch.arange(last, device=self.e.device)).clamp(min=0)
        p = log.col("p_target").gather(1, idx).mean(1)
        return float(torch.where(active, p, 1.0).min())

    def room(self, st) -> tuple[torch.Tensor | None, bool]:
        """Per row, the most draft tokens it may verify this step [slots] (None: no limit), and whether any
        row may verify one. Attention reads every row up to the longest row's position, so a row running
        ahead makes every later step dearer for all (cost.py, `width_ms`): where one slot past the longest
        row costs more over the steps left than a committed token saves, rows are held to the slots behind
        it (docs/design.md, "Budgets"). Finished rows are parked and count for nothing."""
        e, c = self.e, self.e.costs
        if c is None or not c.width_ms:
            return None, True
        R, per = st.R, (2 if e.sampling.use_cfg else 1)
        slot = c.width(R) * (R - per) / R
        if slot * e.N <= c.target(R, 1) / st.slots:                  # no position makes a difference
            return None, True
        n = st.log.n
        ns = [x for x in n.tolist() if x < e.N]                       # one read-back; done rows are parked
        if not ns:
            return None, True
        n_min, n_max = min(ns), max(ns)
        if slot * (e.N - n_max) <= c.target(R, 1) / st.slots:
            return None, True
        return n_max - n, n_min < n_max


# A chain step runs only where it costs at most this many plain steps by the cost table: it commits 4.8
# tokens per row on average on the shapes model, so a dearer one cannot pay (docs/design.md, "Chains and Jacobi windows").
CHAIN_COST = 4.0
