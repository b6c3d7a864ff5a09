"""Speculative decoding with draft trees: `eagle2` (fixed shape) and `adt_tree` (adaptive), and chains.

Each step of a continuous batch (scheduler.py) is plain, chain or tree, chosen for the whole batch by the
planner (planner.py) from the cost table and the budgets (budget.py):

    plain   one target forward over the roots; the target draws the next token (vanilla's step)
    chain   chains.ChainProposer: the target's own drafts of its last chain step; no drafter (`sjd` and
            `mc_sjd` are this engine with Jacobi couplings and no trees: jacobi.py)
    tree    proposers.TreeProposer: the EAGLE drafter's tree, K nodes per row chosen by the budget

A speculative step is `speculate`: propose -> verify (verify.Verifier) -> commit (commit.py) -> learn.
Rows keep their own n, so every tensor is per row (the state's fields say how: state.py); a finished row's
forwards are parked at its first slots (base.parked) so that it widens no one's attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from decoding.engines.base import CachedModel, EngineConfig, parked, visible
from decoding.engines.budget import Budget
from decoding.engines.calibrate import calibrate
from decoding.engines.commit import commit, put_rows
from decoding.engines.cost import cost_table, given
from decoding.engines.log import TokenLog
from decoding.engines.planner import CHAIN, PLAIN, TREE, StepPlanner
from decoding.engines.policy import AdjacencyAdaptive, FixedShape
from decoding.engines import proposers
from decoding.engines.chains import COUPLINGS, INITS, RACE, ChainProposer
from decoding.engines.proposers import TreeProposer
from decoding.engines.scheduler import SlotEngine
from decoding.engines.state import BatchState, carried, per_cache_row, per_slot
from decoding.engines.verify import Lantern, Verifier, codebook_neighbours, draws
from decoding.sampling import Streams, sample

@dataclass
class TreeConfig(EngineConfig):
    # Most nodes a tree may have (one target forward verifies them all); EAGLE-2's reference is 60.
    total_tokens: int = 16
    # Most tokens of a chain step (0: none): the target's own drafts of the step before, past its accepted
    # path, verified as a chain with the drafter resting (chains.py: drafter-free). Its own budget takes a
    # chain step ahead of the drafter's tree where the cost table says it pays (docs/design.md, "Chains and
    # Jacobi windows").
    chain: int = 16
    # How a chain step's forward becomes the next chain (chains.py): race (the target's draws, matched:
    # vanilla's tokens) | fresh (sjd) | maximal, gumbel (mc_sjd) (speculative sampling: lossless, other tokens)
    coupling: str = RACE
    # Chain positions the last step did not reach: above (copy the token one image row up) | repeat (copy the
    # left neighbour, SJD's spatial prior) | random (a uniformly random token)
    init: str = "above"
    # auto: each step verifies the number of nodes (0 = a plain step) that maximises expected tokens per
    # second for the batch, from the device's cost table (budget.py); fixed: total_tokens.
    budget: str = "auto"
    # A cost table to decide from (JSON, as cost.py caches them under ~/.cache/arspec/costs) instead of
    # the one measured once on this device: then nothing is measured, and runs on any machine decide alike.
    costs: str = ""
    depth: int = 6                        # levels drafted (adt_tree: the initial depth)
    width: int = 4                        # per-level top-k (adt_tree: the initial width)
    acceptance: str = "exact"             # exact (lossless) | lantern (relaxed, TVD <= lantern_delta per token)
    lantern_k: int = 100                  # codebook neighbours per token (LANTERN's reference: 1000; ADT-Tree's: 100)
    lantern_delta: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.budget not in ("auto", "fixed"):
            raise ValueError(f"engine.budget={self.budget!r}: use 'auto' (chosen per step) or 'fixed' (total_tokens)")
        if self.acceptance not in ("exact", "lantern"):
            raise ValueError(f"engine.acceptance={self.acceptance!r}: use 'exact' (lossless) or 'lantern' (relaxed)")
        if not 0 <= self.lantern_delta < 1:
            raise ValueError(f"engine.lantern_delta={self.lantern_delta}: must be in [0, 1)")
        for key in ("depth", "width", "lantern_k"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.{key}={getattr(self, key)}: must be >= 1")
        if self.chain < 0:
            raise ValueError(f"engine.chain={self.chain}: must be >= 0 (0: no chain steps)")
        if self.total_tokens < 0 or (self.total_tokens == 0 and self.chain == 0):
            raise ValueError(f"engine.chain={self.chain}, engine.total_tokens={self.total_tokens}: nothing to "
                             f"verify; set engine.chain >= 1 (drafts a chain step verifies) or engine.total_tokens >= 1")
        if self.coupling not in COUPLINGS:
            raise ValueError(f"engine.coupling={self.coupling!r}: use one of {', '.join(COUPLINGS)}")
        if self.init not in INITS:
            raise ValueError(f"engine.init={self.init!r}: use one of {', '.join(INITS)}")
        if self.costs:
            given(self.costs)                # a table that cannot be read fails here, before any actor loads
        if self.acceptance == "lantern" and self.coupling != RACE:
            raise ValueError(f"engine.acceptance=lantern relaxes matched drafts; engine.coupling={self.coupling} "
                             f"verifies by speculative sampling: use engine.coupling={RACE} or acceptance=exact")


@dataclass
class Eagle2Config(TreeConfig):
    name: str = "eagle2"


@dataclass
class ADTTreeConfig(TreeConfig):
    name: str = "adt_tree"
    width: int = 4
    d_min: int = 2
    # d_max, w_min, beta: chosen by τ at a fixed budget against eagle2's (docs/design.md, "ADT-Tree"); the
    # node budget, not d_max, caps what is drafted.
    d_max: int = 96
    w_min: int = 2
    w_max: int = 8
    beta: float = 0.6                     # acceptance ratio above which a region counts as easy
    adjacency: str = "horizontal"         # horizontal | 2d (also reads the row above)

    def validate(self) -> None:
        super().validate()
        if not (1 <= self.d_min <= self.depth <= self.d_max and 1 <= self.w_min <= self.width <= self.w_max):
            raise ValueError(f"engine.d_min/depth/d_max={self.d_min}/{self.depth}/{self.d_max}, engine.w_min/width/"
                             f"w_max={self.w_min}/{self.width}/{self.w_max}: need 1 <= d_min <= depth <= d_max "
                             f"and 1 <= w_min <= width <= w_max")
        if self.adjacency not in ("horizontal", "2d"):
            raise ValueError(f"engine.adjacency={self.adjacency!r}: use 'horizontal' or '2d'")


@dataclass
class TreeState(BatchState):
    R: int = 0                                                    # cache rows (2 slots with CFG)
    policy: object = per_slot(default=None)                       # each row's tree shape (policy.py)
    draft: CachedModel | None = per_cache_row(default=None)       # the drafter's cache (None: no trees)
    feats: torch.Tensor = per_cache_row(default=None)             # [R, N + 1, dim] target feature per token
    dfeat: torch.Tensor = per_cache_row(default=None)             # [R, dim] the drafter's last output
    dn: torch.Tensor = per_slot(default=None)                     # [slots] pairs the drafter has seen
    # the target's draws of the last chain step for tokens chain_at + j [slots, chain]: the draw, whether
    # there is one (a node that existed), and the probability it was drawn with
    chain: torch.Tensor = per_slot(default=None)
    chain_ok: torch.Tensor = per_slot(default=None)
    chain_q: torch.Tensor = per_slot(default=None)
    chain_at: torch.Tensor = per_slot(default=None)               # [slots]
    chain_law: torch.Tensor = per_slot(default=None)              # [slots, chain, V] their laws (Jacobi couplings)
    it: torch.Tensor = per_slot(default=None)                     # [slots] steps the row took (the log's step)
    pending: int = carried(default=0)                             # most pairs a row's drafter lags by
    quiet: int = 0                                                # plain steps left that need no plan
    budgets: list = field(default_factory=list)                   # the budgets that plan at this R


class TreeEngine(SlotEngine):
    uses_drafter = True                    # its trees; with total_tokens=0 it runs chains alone, without one
    # Tokens a row whose image is done waits for the batch's other rows before taking the next prompt:
    # rows that drift apart make every step dearer (docs/design.md, "Budgets"). 0: refill at once.
    refill = 32

    @classmethod
    def check(cls, cfg: TreeConfig, has_drafter: bool) -> None:
        super().check(cfg, has_drafter)
        if cfg.total_tokens > 0 and not has_drafter:
            raise ValueError(f"engine {cls.name!r} drafts trees with a drafter, and the model has none: set "
                             f"engine.total_tokens=0 (chains of the target's own draws, no drafter), or use "
                             f"engine=auto, or train one (python -m workflows.train stages=[drafter])")

    def __init__(self, bundle, cfg: TreeConfig):
        super().__init__(bundle, cfg)
        self.trees = cfg.total_tokens > 0       # drafter trees; else chain and plain steps only, no drafter
        self.drafter = bundle.drafter if self.trees else None
        lantern = None
        if cfg.acceptance == "lantern":
            lantern = Lantern(codebook_neighbours(bundle.vq.quantize.codebook().detach(), cfg.lantern_k)
                              .to(self.device), cfg.lantern_delta)
        self.costs = None if cfg.budget == "fixed" else given(cfg.costs) if cfg.costs else \
            cost_table(bundle, rows=())                                     # measured rows: on start
        self.budget = Budget(self.costs, cfg.total_tokens, self.max_shape()[1])
        # chain steps: chosen by their own budget (auto), or every step where the drafter is off (fixed)
        self.chain_budget = Budget(self.costs, 0, 1, chain=cfg.chain) \
            if cfg.chain and (cfg.budget == "auto" or cfg.total_tokens == 0) else None
        self.planner, self.verifier = StepPlanner(self), Verifier(self, lantern)
        self.proposers = {CHAIN: ChainProposer(self), TREE: TreeProposer(self)}

    def refill_wait(self) -> int:
        return self.refill

    @property
    def acceptance(self) -> str:
        return self.cfg.acceptance

    def policy(self, batch: int):
        """Each row's tree shape: eagle2's fixed one (adt_tree overrides)."""
        return FixedShape(batch, self.cfg.depth, self.cfg.width, self.device)

    def max_shape(self) -> tuple[int, int]:
        return self.cfg.depth, self.cfg.width

    def draft_probs(self, features):
        return self.target_probs(features)  # same head, same CFG and filtering as the target

    # -- a continuous batch (scheduler.py) ------------------------------------------------------------
    def start(self, slots: int) -> TreeState:
        R = 2 * slots if self.sampling.use_cfg else slots
        if self.costs is not None and not self.cfg.costs and R not in self.costs.rows:
            # measured once, with the rows of the batches a stream regroups to (halving: scheduler.py), so
            # that none is measured mid-stream beside other work
            rows = tuple(R // slots * (slots >> k) for k in range(slots.bit_length()))
            self.costs = cost_table(self.bundle, rows=rows, calibrate=lambda R, f: calibrate(self, R, f))
            for b in (self.budget, self.chain_budget):
                if b is not None:
                    b.costs = self.costs
        return self.fresh(slots)

    def fresh(self, slots: int) -> TreeState:
        """An empty batch of `slots` rows (every row finished: n = N)."""
        R, L, N, dev, dt = (2 * slots if self.sampling.use_cfg else slots), self.L, self.N, self.device, self.bundle.dtype
        d_max, w_max = self.max_shape()
        log = TokenLog(slots, N, self.G, dev)
        log.n[:] = N
        streams = Streams([0] * slots, dev)
        K, zeros = self.cfg.chain, lambda *s, **k: torch.zeros(*s, device=dev, **k)  # noqa: E731
        return TreeState(
            slots, log, streams, draws(streams, N), CachedModel(self.gpt, R, L + N + max(self.cfg.total_tokens, K) + 1, dt),
            R=R, policy=self.policy(slots),
            # scratch for a tree's levels: the budget caps a tree's depth at total_tokens, whatever d_max
            draft=CachedModel(self.drafter, R, L + N + min(d_max, self.cfg.total_tokens) * w_max + 1, dt)
            if self.trees else None,
            feats=zeros(R, N + 1, self.gpt.args.dim, dtype=dt), dfeat=zeros(R, self.gpt.args.dim, dtype=dt),
            dn=zeros(slots, dtype=torch.long), chain=zeros(slots, K, dtype=torch.long),
            chain_ok=zeros(slots, K, dtype=torch.bool), chain_q=zeros(slots, K), chain_at=zeros(slots, dtype=torch.long),
            chain_law=zeros(slots, K, self.gpt.args.vocab_size) if self.cfg.coupling != RACE else None,
            it=zeros(slots, dtype=torch.long),
            budgets=([self.budget] if self.trees else []) + ([self.chain_budget] if self.planner.chains_pay(R) else []))

    def admit(self, st, rows, cond, seeds):
        """Prefill new prompts, draw their first token, run the drafter over their condition prefix."""
        log = st.log
        log.reset(rows)
        st.streams.reseed(rows, seeds)
        st.keys[rows] = draws(st.streams, self.N)[rows]
        st.it[rows] = 0
        st.policy.reset(rows)
        for b in (self.budget, self.chain_budget):
            if b is not None:
                b.admit(st.R)
        feats, cond_emb = self.prefill(st.target, cond, rows, st.slots)
        p0 = self.target_probs(feats[:, -1])
        x0 = sample(p0, st.keys[rows, 0])
        new = torch.zeros(st.slots, dtype=torch.long, device=self.device).index_fill(0, rows, 1)
        full = lambda v: torch.zeros(st.slots, dtype=v.dtype, device=self.device).index_copy(0, rows, v)  # noqa: E731
        log.commit(new, token_id=full(x0), accept_len=1, p_target=full(p0.gather(1, x0[:, None])[:, 0]))
        log.target_forwards += new
        st.chain_ok[rows], st.chain_at[rows] = False, 0                    # nothing drawn for the new image yet
        if self.trees:
            self.proposers[TREE].prefix(st, rows, feats, cond_emb, x0)

    def step(self, st):
        """One step of every unfinished row, of the kind and size the planner chose."""
        active = st.log.n < self.N
        quiet = st.quiet > 0
        kind, size, room = self.planner.choose(st, active)
        st.it = st.it + active.long()
        if kind == PLAIN:
            self.plain(st, active)
            st.pending = min(st.pending + 1, proposers.CATCH_UP_MAX)
            seen = None
        else:
            seen = self.speculate(st, active, kind, size, room=room)
        self.planner.learn(st, kind, size, seen, quiet)

    def plain(self, st, active):
        """One target forward over the roots; the target draws the next token (vanilla's step). The drafter
        rests: the root's feature waits in st.feats for the next catch-up."""
        log, L, N = st.log, self.L, self.N
        with log.phase("forward"):
            last = (log.n.clamp(max=N) - 1)[:, None]                      # the root's token index
            pos, slot = self.rows(L + last), self.rows(parked(L + last, active))
            root = log.tokens.gather(1, last.clamp(min=0)).clamp(min=0)
            f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(root)), pos,
                                        visible(st.target.valid, slot[..., None]), slot)
            st.target.commit(slot, self.rows(active)[:, None])
            probs = self.target_probs(f[:, 0])
        with log.phase("accept"):
            x = sample(probs, st.keys.gather(1, log.n.clamp(max=N - 1)[:, None])[:, 0])
            count = active.long()
            if st.draft is not None:                    # a finished row writes its last slot, which no one reads
                put_rows(st.feats, self.rows(last), f)
            log.commit(count, token_id=x, p_target=probs.gather(1, x[:, None])[:, 0], step=st.it, accept_len=1)
            log.target_forwards += count

    def speculate(self, st, active, kind: str, plan: int, **propose):
        """One speculative step: propose -> verify -> commit, then the proposer learns from the verdict.
        Returns what the budget learns."""
        log, proposer = st.log, self.proposers[kind]
        n = log.n.clone()
        P = parked((self.L + n - 1)[:, None], active)[:, 0]              # the root's slot
        with log.phase("draft"):
            prop = proposer.propose(st, active, n, P, plan, **propose)
        with log.phase("verify"):
            probs, feats = self.verifier.forward(st.target, prop.tree, P)
        with log.phase("accept"):
            v, path = self.verifier.accept(st, prop, probs, n, active)
        with log.phase("commit"):
            m_max = commit(self, st, feats, path, v.accepted, P, n, active, in_place=prop.tree.chain)
        return proposer.learn(st, prop, v, probs, n, active, m_max)


class Eagle2(TreeEngine):
    name, Config = "eagle2", Eagle2Config


class ADTTree(TreeEngine):
    name, Config = "adt_tree", ADTTreeConfig

    def policy(self, batch: int):
        c = self.cfg
        return AdjacencyAdaptive(batch, self.G, c.depth, c.width, (c.d_min, c.d_max, c.w_min, c.w_max), c.beta,
                                 c.adjacency, self.device)

    def max_shape(self):
        return self.cfg.d_max, self.cfg.w_max
