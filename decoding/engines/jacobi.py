"""Drafter-free speculative Jacobi decoding: `sjd` (Teng et al., arXiv 2410.01699) and `mc_sjd` (So et
al., arXiv 2510.24211, "MC-SJD", renamed SCD: consecutive drafts coupled). Lossless, no drafter: they run
on every model family (docs/design.md, "Chains and Jacobi windows").

Both are the tree engine's chain steps (chains.py) with a Jacobi coupling and no drafter trees: each step
verifies the window of `chain` drafts the step before left, by speculative sampling, commits the accepted
drafts and one more token, and the coupling turns the same forward's distributions into the next window.
With the default `budget=fixed` every step is a Jacobi step, as in the papers; `budget=auto` takes a
plain step (vanilla's) wherever the cost table says a window does not pay.
"""
from __future__ import annotations

from dataclasses import dataclass

from decoding.engines.tree import TreeConfig, TreeEngine


@dataclass
class SJDConfig(TreeConfig):
    name: str = "sjd"
    # 16 drafts per window: one target forward covers 17 tokens (the papers' L counts the committed token
    # too); SJD's reference is L = 16, MC-SJD's Lumina scripts use L = 32.
    chain: int = 16
    total_tokens: int = 0        # no drafter trees
    budget: str = "fixed"        # every step a Jacobi step (auto: plain steps where windows do not pay)
    coupling: str = "fresh"      # past the first rejection every draft is redrawn from the new p
    init: str = "random"         # new positions: a uniformly random token (SJD's default)


@dataclass
class MCSJDConfig(SJDConfig):
    name: str = "mc_sjd"
    coupling: str = "maximal"    # keep a draft with min(1, p/q_old), else its residual draw | gumbel


class SJD(TreeEngine):
    name, Config, uses_drafter = "sjd", SJDConfig, False


class MCSJD(TreeEngine):
    name, Config, uses_drafter = "mc_sjd", MCSJDConfig, False
