"""How many draft tokens a tree step verifies: the choice that maximises expected committed tokens per
second for this batch on this device (docs/design.md, "Budgets").

A step either speculates with K nodes per row (K <= total_tokens) or is a plain step (K = 0: one target
forward over the last token, no drafter at all). For a step over R cache rows serving P prompts:

    tokens(K) = P * (1 + v_1 + ... + v_K)          v_k: how often a row's k-th best node is accepted
    time(K)   = draft(K) + target(R, 1 + K) + overhead_spec          time(0) = target(R, 1) + overhead_plain

with target() and drafter() from the measured cost table (cost.py), draft(K) the drafter forwards of a
tree of depth <= K (plus the catch-up on what was committed since the drafter last ran), and the
overheads (the step's work outside the forwards: sampling, bookkeeping, Python) learnt from the measured
step times. Before drafting, `plan` picks the K with the best tokens/time from the learnt v_k (0 = plain).
After drafting, `choose` takes each row's actual nodes, valued by the drafter's own path probabilities
(as EAGLE-2 ranks them) times a learnt calibration, and picks K <= plan for the verify forward. `observe`
learns v_k, the calibration and the overheads from what the step accepted and how long it took.
"""
from __future__ import annotations

import numpy as np
import torch

from decoding.engines.cost import CostTable

EMA = 0.9


class Budget:
    def __init__(self, costs: CostTable | None, max_nodes: int, width: int):
        self.costs, self.max, self.width = costs, max_nodes, width
        self.prior = 0.8 ** np.arange(1, max_nodes + 1)     # v_k before anything was observed
        self.value = self.prior.copy()
        self.calibration = 1.0                               # accepted / drafter's path probability
        self.overhead = {"spec": 0.0, "plain": 0.0}          # ms per step outside the forwards

    @property
    def fixed(self) -> bool:
        return self.costs is None

    def _spec_ms(self, R: int, K: int, pending: int) -> float:
        c = self.costs
        levels = max(min(K, self.max) - 1, 0)               # level 1 comes from the catch-up
        return (c.drafter(R, max(pending, 1)) + levels * c.drafter(R, self.width) + c.target(R, 1 + K)
                + self.overhead["spec"])

    def _plain_ms(self, R: int) -> float:
        return self.costs.target(R, 1) + self.overhead["plain"]

    def plan(self, R: int, prompts: int, pending: int) -> int:
        """The largest K worth drafting for (0: a plain step). R cache rows, `prompts` unfinished rows,
        `pending` the longest catch-up the drafter would need first."""
        if self.fixed:
            return self.max
        gain = prompts * (1 + np.concatenate([[0.0], np.cumsum(self.value)]))
        rate = [prompts / self._plain_ms(R)] + [gain[K] / self._spec_ms(R, K, pending) for K in range(1, self.max + 1)]
        return int(np.argmax(rate))

    def choose(self, R: int, values: torch.Tensor, plan: int, drafted_ms: float) -> int:
        """K <= plan for the verify forward. values [B, C]: each unfinished row's candidate nodes valued by
        path probability, best first (0 for finished rows and padding); drafted_ms: drafting already spent."""
        plan = min(plan, values.shape[1])                   # a shallow or narrow tree has fewer nodes
        if self.fixed:
            return plan
        v = values[:, :plan].float().sum(0).cpu().numpy() * self.calibration     # Σ over rows of the k-th best
        prompts = int((values[:, 0] > 0).sum())
        gain = prompts + np.concatenate([[0.0], np.cumsum(v)])
        c = self.costs
        rate = [gain[K] / (drafted_ms + c.target(R, 1 + K) + self.overhead["spec"]) for K in range(plan + 1)]
        return int(np.argmax(rate))

    def observe(self, kind: str, step_ms: float, forward_ms: float, accepted_by_rank: np.ndarray | None = None,
                predicted: float = 0.0, accepted: float = 0.0) -> None:
        """A step of `kind` ('spec' or 'plain') took step_ms, of which the model says forward_ms were
        forwards. accepted_by_rank [K]: the mean acceptance of each rank's node over the rows."""
        if self.fixed:
            return
        self.overhead[kind] = EMA * self.overhead[kind] + (1 - EMA) * max(step_ms - forward_ms, 0.0)
        if kind == "plain":   # a plain step observes no acceptance: drift back to the prior, so that a batch
            # that left a hard region tries speculation again (else one bad stretch ends it for good)
            self.value = EMA * self.value + (1 - EMA) * self.prior
        if accepted_by_rank is not None and len(accepted_by_rank):
            k = len(accepted_by_rank)
            self.value[:k] = EMA * self.value[:k] + (1 - EMA) * accepted_by_rank
            self.value[k:] = np.minimum(self.value[k:], self.value[k - 1])  # a rank never beats the one above
        if predicted > 0:
            self.calibration = EMA * self.calibration + (1 - EMA) * min(accepted / predicted, 2.0)

    def ceiling(self, R: int) -> float:
        """What this device allows: the best speedup over a plain step any tree of <= max nodes could give
        with the acceptance learnt so far (v_k) and the measured forward costs, counting no overhead
        beyond the forwards (an ideal implementation; catch-up of one pair)."""
        if self.fixed:
            return float("nan")
        gain = 1 + np.concatenate([[0.0], np.cumsum(self.value)])
        c = self.costs
        best = max(gain[K] / (c.drafter(R, 1) + max(K - 1, 0) * c.drafter(R, self.width) + c.target(R, 1 + K))
                   for K in range(1, self.max + 1))
        return best * c.target(R, 1)

