"""Speculative decoding with dynamic draft trees: `eagle2` (fixed shape) and `adt_tree` (adaptive).

The engine decodes a continuous batch (base.Engine.stream): each slot holds one prompt with n
committed tokens; the last one, the root, is not yet in the target's cache (its logical position
P = L + n - 1). Each step is one of three kinds, chosen by the budgets (budget.py) for the whole batch:

plain (K = 0): one target forward over the roots, the target draws the next token. No drafter.
chain (`chain` tokens): the drafter rests; the target verifies a chain of the tokens it drew itself in
  the last chain step, at the positions past that step's accepted path (a Jacobi window, drafter-free).
  Exact acceptance matches draws keyed by position, so a draw made after a prefix that turned out
  right is accepted for certain, and one made after a wrong prefix still often is (`_chain_step`);
speculative (K > 0):
  1. catch up: the drafter consumes the (target feature, next token) pairs committed since it last ran,
     in one forward; its last output gives the first level of the tree;
  2. draft: the EAGLE drafter expands the tree level by level (each frontier node proposes its top-w
     children; cumulative log-prob scores pick the next frontier, global top-w); ADT-Tree's (d, w) per
     row, capped by the budget's plan;
  3. rerank all candidates to K nodes per row by score (ancestors always outrank descendants), K chosen
     by the budget from the rows' actual candidates;
  4. verify: one target forward over [root, nodes] with a tree mask; the target's own draws are matched
     against the tree (verify.py);
  5. commit: the accepted path's K/V move to contiguous slots; the path's features wait for the next
     catch-up.
Rows keep their own n, so every tensor here is per row; padded nodes are masked out, and a finished
row's forwards are parked at its first slots (base.parked) so that it widens no one's attention.
A step has no loop over rows and reads back from the device only loop bounds and the budget's inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import torch

from decoding.bundle import Conditions
from decoding.engines.base import CachedModel, EngineConfig, SlotEngine, caches_kept, parked, visible
from decoding.engines.budget import Budget
from decoding.engines.cost import CostTable, cost_table, given, now
from decoding.engines.log import Proposer, TokenLog
from decoding.engines.policy import AdjacencyAdaptive, FixedShape
from decoding.engines.verify import Lantern, Tree, codebook_neighbours, draws, node_keys, verify
from decoding.sampling import Streams, sample

NEG = float("-inf")
CATCH_UP_MAX = 32    # pairs a catch-up feeds the drafter at most (see _catch_up)


def put_rows(buf: torch.Tensor, idx: torch.Tensor, values: torch.Tensor) -> None:
    """buf[r, idx[r, k]] = values[r, k] for buf [R, S, D], idx [R, K], values [R, K, D]. Not scatter_: on a
    CPU, scatter_ into a bf16 buffer copies the whole buffer twice (the profiler: 2 x [32, 257, 256] per
    step, 6% of a plain step at batch 16); indexed assignment writes only the K rows."""
    buf[torch.arange(buf.shape[0], device=buf.device)[:, None], idx] = values


@dataclass
class TreeConfig(EngineConfig):
    # Most nodes a tree may have (one target forward verifies them all); EAGLE-2's reference is 60.
    total_tokens: int = 16
    # Tokens a row whose image is done waits for the batch's other rows before taking the next prompt
    # (0: at once). Rows speculate at different speeds and drift apart, and attention reads every row up
    # to the longest row's position: on a CPU at batch 8 a step at position 272 costs 2x one at 40 (the
    # shapes model), so a batch out of step pays for it on every later step. Rows that drift further
    # than this still refill at once (continuous batching).
    refill_wait: int = 32
    # Most tokens of a chain step (0: none): the target's own draws of the step before, past its accepted
    # path, verified as a chain with the drafter resting (the drafter-free draft of the Jacobi engines,
    # matched like any tree, so the images stay vanilla's). Its own budget (budget.py) takes a chain step,
    # ahead of the drafter's tree, where it beats a plain step and costs at most `chain_cost` plain steps;
    # on this CPU: at batch 1-16 (docs/design.md, "Chains").
    chain: int = 16
    # Chain steps run only where one costs at most this many plain steps by the cost table: a chain step
    # commits 4.8 tokens per row on average on the shapes model, so at a higher cost it cannot pay, and its
    # probes only lose. On this CPU a chain step costs 2.3-2.6 plain steps (2 threads, batch 8-16) and
    # 2.4-2.8 (1 thread, batch 8). The gate sat at 2.45 while fixed batches lost at batch 16 on their last
    # rows (0.875x with chains); regrouping the last rows into a smaller batch (base.SlotEngine.stream)
    # made chains win there (1.08x), so it no longer has to keep chains from a batch size.
    chain_cost: float = 4.0
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
        if self.refill_wait < 0:
            raise ValueError(f"engine.refill_wait={self.refill_wait}: must be >= 0 (0: a free row refills at once)")
        for key in ("depth", "width", "lantern_k"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.{key}={getattr(self, key)}: must be >= 1")
        if self.chain < 0:
            raise ValueError(f"engine.chain={self.chain}: must be >= 0 (0: no chain steps)")
        if self.chain_cost <= 0:
            raise ValueError(f"engine.chain_cost={self.chain_cost}: must be > 0 (plain steps a chain step may cost)")
        if self.total_tokens < (0 if self.chain else 1):
            raise ValueError(f"engine.total_tokens={self.total_tokens}: must be >= 1 (0, no drafter trees, only with "
                             f"engine.chain >= 1)")


@dataclass
class Eagle2Config(TreeConfig):
    name: str = "eagle2"


@dataclass
class ADTTreeConfig(TreeConfig):
    name: str = "adt_tree"
    width: int = 4
    d_min: int = 2
    # d_max, w_min, beta: chosen by τ at a fixed budget against eagle2's (docs/design.md, "ADT-Tree": 1.081x
    # -> 1.100x on the bench's prompts at batch 8, 1.084x -> 1.115x at batch 1). d_max well past the node
    # budget: one easy tree takes the bisection halfway to it, so a flat stretch drafts a chain as deep as
    # the budget at once (the budget, not d_max, caps what is drafted); w_min 2 keeps a second branch per
    # level for the budget's selection.
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


class TreeEngine(SlotEngine):
    uses_drafter = True                    # its trees; with total_tokens=0 it runs chains alone, without one
    carried = ("step", "pending")          # the step clock (the log's step column) and the drafter's lag

    @classmethod
    def check(cls, cfg: TreeConfig, has_drafter: bool) -> None:
        super().check(cfg, has_drafter)
        if cfg.total_tokens > 0 and not has_drafter:
            raise ValueError(f"engine {cls.name!r} drafts trees with a drafter, and the model has none: train one "
                             f"(python -m workflows.train stages=[drafter]), or set engine.total_tokens=0 (chains "
                             f"of the target's own draws, no drafter), or use engine=auto")

    def __init__(self, bundle, cfg: TreeConfig):
        super().__init__(bundle, cfg)
        self.trees = cfg.total_tokens > 0       # drafter trees; else chain and plain steps only, no drafter
        self.drafter = bundle.drafter if self.trees else None
        self.lantern = None
        if cfg.acceptance == "lantern":
            self.lantern = Lantern(codebook_neighbours(bundle.vq.quantize.codebook().detach(), cfg.lantern_k)
                                   .to(self.device), cfg.lantern_delta)
        self.costs = None if cfg.budget == "fixed" else given(cfg.costs) if cfg.costs else \
            cost_table(bundle, rows=())                                     # measured rows: on _start
        self.budget = Budget(self.costs, cfg.total_tokens, self.max_shape()[1])
        # chain steps: chosen by their own budget (auto), or every step where the drafter is off (fixed)
        self.chain_budget = Budget(self.costs, 0, 1, chain=cfg.chain) \
            if cfg.chain and (cfg.budget == "auto" or cfg.total_tokens == 0) else None

    def refill_wait(self) -> int:
        return self.cfg.refill_wait

    @property
    def acceptance(self) -> str:
        return self.cfg.acceptance

    # -- shape policy (eagle2: fixed; adt_tree overrides) ---------------------------------------------
    def policy(self, batch: int):
        return FixedShape(batch, self.cfg.depth, self.cfg.width, self.device)

    def max_shape(self) -> tuple[int, int]:
        return self.cfg.depth, self.cfg.width

    # -- a continuous batch -----------------------------------------------------------------------------
    def _start(self, slots: int):
        R = 2 * slots if self.sampling.use_cfg else slots
        if self.costs is not None and not self.cfg.costs and R not in self.costs.rows:   # measure this R once
            self.costs = cost_table(self.bundle, rows=(R,), calibrate=self.calibrate)
            for b in (self.budget, self.chain_budget):
                if b is not None:
                    b.costs = self.costs
        return self._state(slots)

    def _state(self, slots: int):
        R, L, N, dev = (2 * slots if self.sampling.use_cfg else slots), self.L, self.N, self.device
        d_max, w_max = self.max_shape()
        log = TokenLog(slots, N, self.G, dev)
        log.n[:] = N                                                       # empty slots are finished rows
        streams = Streams([0] * slots, dev)
        return SimpleNamespace(
            slots=slots, R=R, log=log, streams=streams, keys=draws(streams, N), policy=self.policy(slots), step=0,
            target=CachedModel(self.gpt, R, L + N + max(self.cfg.total_tokens, self.cfg.chain) + 1, self.bundle.dtype),
            # scratch for a tree's levels: the budget caps a tree's depth at total_tokens, whatever d_max
            draft=CachedModel(self.drafter, R, L + N + min(d_max, self.cfg.total_tokens) * w_max + 1, self.bundle.dtype)
            if self.trees else None,
            feats=torch.zeros(R, N + 1, self.gpt.args.dim, dtype=self.bundle.dtype, device=dev),  # per token
            dfeat=torch.zeros(R, self.gpt.args.dim, dtype=self.bundle.dtype, device=dev),
            dn=torch.zeros(slots, dtype=torch.long, device=dev),          # (feature, next token) pairs drafted on
            # the target's draws of the last chain step, for tokens chain_at + j: the draw, whether there
            # is one (a node that existed), and the target probability it was drawn with
            chain=torch.zeros(slots, self.cfg.chain, dtype=torch.long, device=dev),
            chain_ok=torch.zeros(slots, self.cfg.chain, dtype=torch.bool, device=dev),
            chain_q=torch.zeros(slots, self.cfg.chain, device=dev),
            chain_at=torch.zeros(slots, dtype=torch.long, device=dev),
            pending=0,                                                     # most pairs a row's drafter lags by
            quiet=0,                                                       # plain steps left that need no budget
            budgets=([self.budget] if self.trees else []) + ([self.chain_budget] if self._chains_pay(R) else []))

    def _admit(self, st, rows, cond, seeds):
        """Prefill new prompts, draw their first token, run the drafter over their condition prefix."""
        log = st.log
        log.reset(rows)
        st.streams.reseed(rows, seeds)
        st.keys[rows] = draws(st.streams, self.N)[rows]
        st.policy.reset(rows)
        self.budget.admit(st.R)
        if self.chain_budget is not None:
            self.chain_budget.admit(st.R)
        feats, cond_emb = self.prefill(st.target, cond, rows, st.slots)
        p0 = self.target_probs(feats[:, -1])
        x0 = sample(p0, st.keys[rows, 0])
        new = torch.zeros(st.slots, dtype=torch.long, device=self.device).index_fill(0, rows, 1)
        full = lambda v: torch.zeros(st.slots, dtype=v.dtype, device=self.device).index_copy(0, rows, v)  # noqa: E731
        log.commit(new, token_id=full(x0), accept_len=1, p_target=full(p0.gather(1, x0[:, None])[:, 0]))
        log.target_forwards += new
        st.chain_ok[rows], st.chain_at[rows] = False, 0                    # nothing drawn for the new image yet
        if self.trees:
            self._draft_prefix(st, rows, feats, cond_emb, x0)

    def _draft_prefix(self, st, rows, feats, cond_emb, x0) -> None:
        """The drafter over new prompts' condition prefix."""
        L, log = self.L, st.log
        new = torch.zeros(st.slots, dtype=torch.long, device=self.device).index_fill(0, rows, 1)
        # drafter over the prefix: pairs (f_p, e_{p+1}) for p < L, e_L = emb(t_0); its last output drafts t_1
        r = self.cache_rows(rows, st.slots)
        nxt = torch.cat([cond_emb[:, 1:], self.gpt.embed_tokens(self.rows(x0))[:, None]], 1)
        pos = torch.arange(1, L + 1, device=self.device).expand(len(r), L)
        cond_valid = st.target.valid[r, :L]
        out = self.drafter(nxt, feats, pos, self._prefix_mask(st.draft, cond_valid, len(r)), pos - 1, rows=r)
        st.draft.valid[r] = False
        st.draft.valid[r, :L] = cond_valid
        st.dfeat[r] = out[:, -1]
        st.dn[rows] = 0
        log.draft_forwards += new

    def _step(self, st):
        """One step of every unfinished row, plain, chain or speculative as the budgets plan: the chain's
        first (it costs no drafter), then the tree's. A plain step reads nothing back from the device
        beyond what vanilla's step does: the catch-up the drafter would need (`st.pending`, an upper bound
        over rows) is kept on the host. The one exception is `_room` on a device where attention width
        costs more than a token saves (a CPU at batch 8 and up): it reads the longest and the shortest
        row, two scalars; it holds tree steps only, not chains (a chain step commits several tokens for the
        width it adds). Where the budgets know the next steps are plain (Budget.quiet: speculation has
        only lost here, and the next probe is not due), they skip it all.

        No decision reads the clock: the budgets learn what each step committed, priced by the cost table
        (`_priced`), so the same table and the same prompts give the same steps and the same bytes."""
        active = st.log.n < self.N
        quiet, room, chain, plan = st.quiet > 0, None, 0, 0
        if quiet:                                  # certain to be plain (Budget.quiet): nothing to plan or learn
            st.quiet -= 1
            self._hold(st)
        else:
            confidence = lambda: self._confidence(st, active)          # noqa: E731
            chain = self.chain_budget.plan(st.R, 0, confidence) if self.chain_budget in st.budgets else 0
            if chain or not self.trees:
                self.budget.hold(st.R)
            else:
                room, may = self._room(st)
                plan = min(self.budget.plan(st.R, st.pending, confidence), self.N) if may else self.budget.hold(st.R)
        st.step += 1
        if chain:
            seen = self._chain_step(st, active, chain)
            if self.costs is not None and seen is not None:
                step_ms = self._priced(st.R, "chain", seen)
                self.chain_budget.observe(st.R, chain, step_ms, 1 + seen.drafts, np.array([seen.drafts]))
        elif plan == 0:
            self._plain_step(st, active)
            st.pending = min(st.pending + 1, CATCH_UP_MAX)
            if self.costs is not None and not quiet:
                step_ms = self._priced(st.R, "plain", None)
                for b in st.budgets:
                    b.observe(st.R, 0, step_ms)
                if st.pending == CATCH_UP_MAX:         # (until then the catch-up's cost, and the plan, change)
                    st.quiet = min((b.quiet(st.R, st.pending) for b in st.budgets), default=self.N)
        else:
            seen = self._spec_step(st, active, plan, room)
            if self.costs is not None:
                self.budget.observe(st.R, plan, self._priced(st.R, "spec", seen), seen.tokens, seen.by_rank,
                                    seen.predicted, seen.accepted, catch_up_ms=seen.catch_up_ms, behind=seen.behind)

    def _priced(self, R: int, kind: str, seen) -> float:
        """ms of a step of `kind` over R rows by the cost table: its forwards, and the work outside them
        (CostTable.overhead). What the budgets learn a step cost, in place of the clock."""
        c = self.costs
        if kind == "plain":
            forward = c.target(R, 1)
        elif kind == "chain":
            forward = c.target(R, 1 + self.cfg.chain)
        else:
            forward = seen.drafting_ms + c.target(R, 1 + seen.K)
        return forward + c.overhead(kind, R)

    def _drafting_ms(self, R: int, catch_up: int, levels: int, width: int) -> tuple[float, float]:
        """(catch-up ms, drafting ms including it) by the cost table: one drafter forward over the catch-up's
        pairs, then one per tree level past the first, `width` nodes per row."""
        if self.costs is None:
            return 0.0, 0.0
        c = self.costs
        cu = c.drafter(R, catch_up) if catch_up else 0.0
        return cu, cu + max(levels - 1, 0) * c.drafter(R, width)

    @torch.inference_mode()
    def calibrate(self, R: int, forwards: CostTable) -> dict:
        """Step overheads over R rows (CostTable.overhead_ms): per kind, the least ms of four real steps on
        a fresh throwaway batch (after one warm-up), less what `forwards` prices their forwards at.
        Measured once per device, model and R and cached with the table (cost.cost_table): it is the one
        place the engine reads a clock, and no decision reads one after it."""
        slots = max(R // (2 if self.sampling.use_cfg else 1), 1)
        kinds = {"plain": lambda st, on: self._plain_step(st, on)}
        if self.trees:
            kinds["spec"] = lambda st, on: self._spec_step(st, on, self.cfg.total_tokens, choose=False)
        if self.chain_budget is not None:
            kinds["chain"] = lambda st, on: self._chain_step(st, on, self.cfg.chain)
        kept, self.costs = self.costs, forwards
        try:
            with caches_kept(self.gpt, self.drafter):
                return self._time_steps(kinds, slots)
        finally:
            self.costs = kept

    def _time_steps(self, kinds: dict, slots: int) -> dict:
        """calibrate's timing, in K/V buffers of its own: the live batch's (a stream that regroups measures
        its new row count mid-stream) would otherwise take the throwaway batch's K/V."""
        for m in (self.gpt, self.drafter):
            if m is not None:
                m._cache_key = None
        out = {}
        for kind, step in kinds.items():
            st = self._state(slots)
            self._admit(st, torch.arange(slots, device=self.device), self._blank_conditions(slots), list(range(slots)))
            self._midway(st)
            ms = []
            for _ in range(5):
                t0 = now(self.device)
                seen = step(st, st.log.n < self.N)
                ms.append(1000 * (now(self.device) - t0) - self._priced(st.R, kind, seen))
            out[kind] = round(max(min(ms[1:]), 0.0), 4)
        return out

    def _midway(self, st) -> None:
        """Move a calibration batch to the middle of its images, where the cost table's forwards were
        measured (attention reads every committed slot): half the tokens committed, the drafter caught up."""
        h = self.N // 2
        st.log.n[:] = h
        st.target.valid[:, : self.L + h - 1] = True
        if st.draft is not None:
            st.draft.valid[:, : self.L + h - 1] = True
        st.dn[:] = h - 1

    def _blank_conditions(self, B: int) -> Conditions:
        """Conditions of B prompts for calibration: class 0, or an all-zero caption of full length."""
        a = self.gpt.args
        if a.model_type == "c2i":
            return Conditions(torch.zeros(B, dtype=torch.long, device=self.device), None, [0] * B)
        return Conditions(torch.zeros(B, self.L, a.caption_dim, dtype=self.bundle.dtype, device=self.device),
                          torch.ones(B, self.L, dtype=torch.bool, device=self.device), [0] * B)

    def _hold(self, st) -> None:
        for b in st.budgets:
            b.hold(st.R)

    def _chains_pay(self, R: int) -> bool:
        """Whether chain steps may run over R cache rows: where one costs at most `chain_cost` plain steps
        (the cost table), or always where the drafter is off (budget=fixed, total_tokens=0)."""
        if self.chain_budget is None or self.costs is None:
            return self.chain_budget is not None
        return self.costs.target(R, 1 + self.cfg.chain) <= self.cfg.chain_cost * self.costs.target(R, 1)

    def _confidence(self, st, active, last: int = 8) -> float:
        """The least confident busy row's mean target probability of its last `last` tokens (the budget's
        cue that a flat stretch began: Budget.plan). One read-back, made only when it could start a probe."""
        log = st.log
        idx = (log.n[:, None] - 1 - torch.arange(last, device=self.device)).clamp(min=0)
        p = log.col("p_target").gather(1, idx).mean(1)
        return float(torch.where(active, p, 1.0).min())

    def _room(self, st) -> tuple[torch.Tensor | None, bool]:
        """Per row, the most draft tokens it may verify this step [slots] (None: no limit), and whether
        any row may verify one.

        Attention reads every row up to the longest row's position, so a row that runs ahead of the batch
        makes every later step dearer for all the others, until it finishes (cost.py, `width_ms`). One
        slot past the batch's longest row costs width(R) x (R - own rows) / R ms in each of the N - n_max
        steps left to it; one more committed token saves the row a plain step's share, target(R, 1) / B.
        Where the first is larger, rows are held to the slots behind the longest row (a plain step moves
        that one forward by one): rows behind it catch up by speculation, and rows in step take plain
        steps, as vanilla's do. A finished or empty row (n = N) is parked at its first slots
        (base.parked) and counts for nothing here."""
        c = self.costs
        if c is None or not c.width_ms:
            return None, True
        R, per = st.R, (2 if self.sampling.use_cfg else 1)
        slot = c.width(R) * (R - per) / R
        if slot * self.N <= c.target(R, 1) / st.slots:                # no position makes a difference
            return None, True
        n = st.log.n
        ns = [x for x in n.tolist() if x < self.N]                    # one read-back; done rows are parked
        if not ns:
            return None, True
        n_min, n_max = min(ns), max(ns)
        if slot * (self.N - n_max) <= c.target(R, 1) / st.slots:
            return None, True
        return n_max - n, n_min < n_max

    def _plain_step(self, st, active):
        """One target forward over the roots; the target draws the next token. The drafter rests: the
        root's feature waits in st.feats for the next catch-up."""
        log, L, N = st.log, self.L, self.N
        with log.phase("forward"):
            last = (log.n.clamp(max=N) - 1)[:, None]                      # the root's token index
            pos = self.rows(L + last)
            slot = self.rows(parked(L + last, active))
            root = log.tokens.gather(1, last.clamp(min=0)).clamp(min=0)
            f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(root)), pos,
                                        visible(st.target.valid, slot[..., None]), slot)
            st.target.commit(slot, self.rows(active)[:, None])
            probs = self.target_probs(f[:, 0])
        with log.phase("accept"):
            x = sample(probs, st.keys.gather(1, log.n.clamp(max=N - 1)[:, None])[:, 0])
            count = active.long()
            # the pending buffer: a finished row writes its last slot, which no catch-up reads
            put_rows(st.feats, self.rows(last), f)
            log.commit(count, token_id=x, p_target=probs.gather(1, x[:, None])[:, 0], step=st.step, accept_len=1)
            log.target_forwards += count

    def _chain_step(self, st, active, plan):
        """Verify each row's chain (st.chain: drafts for tokens n, n + 1, ...) as a tree of width 1, the
        drafter resting; the target's draws at the chain's nodes past the accepted path become the next
        chain. A draw at node k was made after the chain's first k tokens: where the path took them all,
        it is the draw vanilla makes there and is accepted next step for certain; where the path left
        the chain earlier, it was made after a prefix that is now wrong, and is a draft like any other
        (the target's draw is what gets committed, so the images stay vanilla's). Returns what the budget
        learns (`drafts`: the mean drafts a busy row accepted), None where no row was busy."""
        log, N = st.log, self.N
        n = log.n.clone()
        P = parked((self.L + n - 1)[:, None], active)[:, 0]              # the root's slot
        K, G = self.cfg.chain, self.G
        lanes = torch.arange(K, device=self.device)
        # lane j drafts token n + j: the last chain step's draw for it, wherever plain or tree steps since
        # moved n, else a copy of the token one image row above where it is committed, or of the last one
        old = (lanes + (n - st.chain_at)[:, None]).clamp(max=K - 1)
        drawn = (lanes + (n - st.chain_at)[:, None] < K) & st.chain_ok.gather(1, old)
        t = n[:, None] + lanes
        above = torch.where((t >= G) & (t - G < n[:, None]), t - G, n[:, None] - 1).clamp(0, N - 1)
        chain = torch.where(drawn, st.chain.gather(1, old), log.tokens.gather(1, above).clamp(min=0))
        k = lanes + 1
        exists = active[:, None] & (k < N - n[:, None])                   # node k drafts token n - 1 + k < N - 1
        root = log.tokens.gather(1, (n - 1).clamp(0, N - 1)[:, None]).clamp(min=0)
        col = torch.zeros_like(root)
        nan = torch.full_like(root, float("nan"), dtype=torch.float32)
        tree = Tree(tok=torch.cat([root, chain], 1),
                    parent=torch.cat([col - 1, torch.where(exists, k - 1, -1)], 1),
                    depth=torch.cat([col, torch.where(exists, k, 0)], 1),
                    q=torch.cat([nan, torch.where(drawn, st.chain_q.gather(1, old), float("nan"))], 1))
        with log.phase("verify"):
            probs, tfeats = self._verify_forward(st.target, tree, P)
        with log.phase("accept"):
            v = verify(tree, probs, node_keys(st.keys, n, tree), self.lantern)
            depth = exists.sum(1)
            path = self._record(log, tree, v, active, st.step, depth, (depth > 0).long(), K, Proposer.CHAIN)
        with log.phase("commit"):
            m_max = self._commit(st, tfeats, path, v.accepted, P, n, active)
            st.pending = min(st.pending + m_max + 1, CATCH_UP_MAX)
            src = v.accepted[:, None] + 1 + lanes                             # the node of each draw
            node = torch.cat([torch.zeros_like(exists[:, :1]), exists], 1)
            st.chain_ok = (src <= K) & node.gather(1, src.clamp(max=K))
            st.chain = v.drawn.gather(1, src.clamp(max=K))
            st.chain_q = probs.gather(2, v.drawn[..., None])[..., 0].gather(1, src.clamp(max=K))
            st.chain_at = log.n.clone()
        if not bool(active.any()):
            return None
        return SimpleNamespace(drafts=float(v.accepted[active].float().mean()))

    def _spec_step(self, st, active, plan, room=None, choose: bool = True):
        """Draft, verify and commit one tree per row, of up to `plan` nodes (the budget chooses K <= plan
        from the drafted candidates; choose=False: K = plan). Returns what the budget learns."""
        log, N = st.log, self.N
        n = log.n.clone()
        P = parked((self.L + n - 1)[:, None], active)[:, 0]              # the root's slot
        with log.phase("draft"):
            caught_up = self._catch_up(st, active)
            asked, w = st.policy.plan(n, log.col("accepted")[:, :N])
            d = torch.where(active, torch.minimum(torch.minimum(asked, N - n - 1), torch.full_like(asked, plan)), 0)
            if room is not None:
                d = torch.minimum(d, room)
            cand = self._draft(st.draft, st.dfeat, P, d, w, log, keep=plan)
            d = cand["levels"]
            catch_up_ms, drafting_ms = self._drafting_ms(st.R, caught_up, int(d.max()), int(w.max()))
            values = torch.where(active[:, None], cand["score"].topk(min(plan, cand["score"].shape[1]), -1).values.exp(), 0.0)
            K = self.budget.choose(st.R, values, plan, drafting_ms) if choose else min(plan, values.shape[1])
            tree = self._tree(cand, K, log)
        with log.phase("verify"):
            probs, tfeats = self._verify_forward(st.target, tree, P)
        with log.phase("accept"):
            v = verify(tree, probs, node_keys(st.keys, n, tree), self.lantern)
            path = self._record(log, tree, v, active, st.step, d, w, K)
            drafted = tree.depth.amax(1)                                  # the depth the budget left: α's base
            st.policy.update(asked, w, v.accepted, active & (drafted > 0), drafted)
        with log.phase("commit"):
            st.pending = self._commit(st, tfeats, path, v.accepted, P, n, active) + 1   # the path and the bonus
        by_rank, predicted, per_row = self._by_rank(tree, v, active)
        accepted, rows = float(v.accepted[active].sum()), max(int(active.sum()), 1)
        behind = active & (n == torch.where(active, n, N).min())              # the rows furthest from done
        return SimpleNamespace(K=K, catch_up_ms=catch_up_ms, drafting_ms=drafting_ms, tokens=1 + accepted / rows,
                               by_rank=by_rank, predicted=predicted, accepted=accepted,
                               behind=float(per_row[behind].mean()) if per_row is not None else None)

    # -- drafting ---------------------------------------------------------------------------------------
    def draft_probs(self, features):
        return self.target_probs(features)  # same head, same CFG and filtering as the target

    def _catch_up(self, st, active) -> int:
        """Feed the drafter the (feature, next token) pairs committed since it last ran: pair i is (the
        target's feature at token i, token i + 1), in drafter slot L + i. Its last output per row becomes
        st.dfeat, the feature the tree's first level is drafted from. Returns the most pairs a row fed.

        At most the last CATCH_UP_MAX pairs: after a long plain stretch the drafter sees the condition
        and the recent tokens (two image rows of the shapes model) and the older slots stay masked. A
        whole backlog cost the return to speculation 361 ms at batch 16 after 227 plain steps, 14 plain
        steps' worth, at the end of an image that could not repay it. Drafts only propose: the tokens
        stay the target's whatever the drafter saw."""
        log, N = st.log, self.N
        todo = torch.where(active, log.n - 1 - st.dn, 0)                   # pairs per row
        skip = (todo - CATCH_UP_MAX).clamp(min=0)                          # older pairs stay unseen
        st.dn, todo = st.dn + skip, todo - skip
        C = int(todo.max())
        if C == 0:
            return 0
        lanes = torch.arange(C, device=self.device)
        keep = lanes < todo[:, None]
        i = (st.dn[:, None] + lanes).clamp(max=N - 1)                       # pair index = token index
        slots = parked(self.L + i, active)
        see = torch.where(lanes[None, None, :] <= lanes[None, :, None], slots[:, None, :], slots[:, :, None])
        nxt = log.tokens.gather(1, (i + 1).clamp(max=N - 1)).clamp(min=0)
        feats = st.feats.gather(1, self.rows(i)[..., None].expand(-1, -1, st.feats.shape[-1]))
        pos = (slots + 1).clamp(max=self.L + N - 1)                        # lanes past a row's pairs: any position
        out = self.drafter(self.gpt.embed_tokens(self.rows(nxt)), feats, self.rows(pos),
                           visible(st.draft.valid, self.rows(see)), self.rows(slots))
        st.draft.commit(self.rows(slots), self.rows(keep))
        last = (todo - 1).clamp(min=0)
        fresh = out.gather(1, self.rows(last)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        st.dfeat = torch.where(self.rows(todo > 0)[:, None], fresh, st.dfeat)
        st.dn = st.dn + todo
        log.draft_forwards += (todo > 0).long()
        return C

    def _draft(self, draft, dfeat, P, d, w, log, keep: int | None = None) -> dict:
        """Every row's candidate nodes: tok, par (candidate index of the parent, -1 = root), depth, score
        (cumulative draft log-prob, -inf = none), q, each [B, C]; and `levels`, the levels drafted.

        `keep`: only each row's `keep` best candidates will be used (the budget's plan). A level stops
        the drafting once no row's frontier scores above its keep-th best candidate: a node's score is
        its parent's plus a log-probability, so nothing deeper could enter the selection. The tree is
        the same; the levels it would not change are not drafted (ADT-Tree asks for up to d_max)."""
        B, dev = len(P), P.device
        q = self.draft_probs(dfeat[:, None])[:, 0]                      # [B, V]
        d_max, w_max = int(d.max()), min(max(int(w.max()), 1), q.shape[-1])  # no wider than the vocabulary
        lanes = torch.arange(w_max, device=dev)
        top_q, top_tok = q.topk(w_max, -1)
        score = top_q.log().masked_fill((lanes >= w[:, None]) | (d[:, None] < 1), NEG)
        toks, pars, depths, scores, qs = [top_tok], [torch.full_like(top_tok, -1)], [torch.ones_like(top_tok)], [score], [top_q]
        front, front_score = lanes.expand(B, w_max), score                # candidate ids of the frontier
        front_feat = dfeat[:, None].expand(-1, w_max, -1)               # feature paired with each node
        front_see = torch.zeros(dfeat.shape[0], w_max, 0, dtype=torch.long, device=dev)
        offset, used = w_max, 0
        for k in range(2, d_max + 1):
            ftok = torch.cat(toks, 1).gather(1, front)
            slots = P[:, None] + used + lanes                             # drafter scratch slots
            pos = (P[:, None] + k - 1).clamp(max=self.L + self.N - 1).expand(B, w_max)
            see = torch.cat([front_see, self.rows(slots)[..., None]], -1)
            out = self.drafter(self.gpt.embed_tokens(self.rows(ftok)), front_feat, self.rows(pos),
                               visible(draft.valid, see), self.rows(slots))
            used += w_max
            cq, ctok = self.draft_probs(out).topk(w_max, -1)                # [B, w, w]
            cs = front_score[:, :, None] + cq.log()
            cs = cs.masked_fill((lanes[None, None, :] >= w[:, None, None]) | (d[:, None, None] < k), NEG)
            toks.append(ctok.flatten(1))
            pars.append(front[:, :, None].expand(-1, -1, w_max).flatten(1))
            depths.append(torch.full_like(ctok.flatten(1), k))
            scores.append(cs.flatten(1))
            qs.append(cq.flatten(1))
            fs, fi = cs.flatten(1).topk(w_max, -1)
            front_score = fs.masked_fill(lanes >= w[:, None], NEG)
            if keep is not None and k < d_max and self._settled(torch.cat(scores, 1), front_score, d, k, keep):
                d = d.clamp(max=k)
                break
            front = offset + fi
            par_lane = self.rows(fi // w_max)
            front_feat = out.gather(1, par_lane[..., None].expand(-1, -1, out.shape[-1]))
            front_see = see.gather(1, par_lane[..., None].expand(-1, -1, see.shape[-1]))
            offset += w_max * w_max
        log.draft_forwards += (d - 1).clamp(min=0)                       # levels 2..d (inactive rows: d = 0)
        return {"tok": torch.cat(toks, 1), "par": torch.cat(pars, 1), "depth": torch.cat(depths, 1),
                "score": torch.cat(scores, 1), "q": torch.cat(qs, 1), "levels": d}

    @staticmethod
    def _settled(scores, front_score, d, k: int, keep: int) -> bool:
        """After level k: True when every row either drafts no deeper (d <= k) or has `keep` candidates
        scoring at least its best frontier node (a deeper node that ties loses: `_select`)."""
        if scores.shape[1] < keep:                                       # fewer candidates than it keeps
            return bool((d <= k).all())
        kth = scores.topk(keep, -1).values[:, -1]
        return bool(((d <= k) | (front_score.amax(-1) <= kth)).all())

    def _tree(self, cand: dict, K: int, log) -> Tree:
        """The K best candidates of each row as a Tree rooted at its last committed token."""
        root = log.tokens.gather(1, (log.n - 1).clamp(0, self.N - 1)[:, None]).clamp(min=0)  # empty slot: any id
        col = torch.zeros_like(root)
        if K == 0:
            return Tree(root, col - 1, col, torch.full_like(root, float("nan"), dtype=torch.float32))
        nodes = self._select(cand["tok"], cand["par"], cand["depth"], cand["score"], cand["q"], K)
        nan = torch.full_like(nodes["q"][:, :1], float("nan"))
        return Tree(tok=torch.cat([root, nodes["tok"]], 1), parent=torch.cat([col - 1, nodes["parent"]], 1),
                    depth=torch.cat([col, nodes["depth"]], 1), q=torch.cat([nan, nodes["q"]], 1),
                    score=torch.cat([nan, nodes["score"]], 1))

    @staticmethod
    def _select(tok, par, depth, score, q, budget):
        """Top-`budget` candidates by score, ordered by (depth, -score). Ties go to the earlier candidate
        (a stable sort; levels are appended in order, so the shallower), which makes the choice the same
        however many levels were drafted (`_draft`'s stop). Returns [B, budget] tensors; parent is a
        block index (0 = root, j + 1 = node j), -1 for padding."""
        B, C = tok.shape
        budget = min(budget, C)
        key = torch.where(torch.isinf(score), torch.full_like(score, -1e9), score)
        sel = key.sort(dim=-1, descending=True, stable=True).indices[:, :budget]
        sd, ss = depth.gather(1, sel), score.gather(1, sel)
        valid = ~torch.isinf(ss)
        order = torch.where(valid, sd * 1e4 - ss.clamp(min=-1e3), torch.full_like(ss, 1e9)).argsort(-1)
        sel, valid, sd, ss = (t.gather(1, order) for t in (sel, valid, sd, ss))
        inv = torch.full((B, C), -1, dtype=torch.long, device=tok.device)
        inv.scatter_(1, sel, torch.arange(1, budget + 1, device=tok.device).expand(B, budget))
        cpar = par.gather(1, sel)
        parent = torch.where(cpar >= 0, inv.gather(1, cpar.clamp(min=0)), torch.zeros_like(cpar))
        parent = torch.where(valid & (parent >= 0), parent, torch.full_like(parent, -1))
        return {"tok": tok.gather(1, sel), "parent": parent, "depth": torch.where(parent >= 0, sd, 0),
                "q": q.gather(1, sel), "score": ss}

    # -- verification -----------------------------------------------------------------------------------
    def _verify_forward(self, target, tree: Tree, P):
        """Target forward over the block [root, nodes] under the tree mask (each node sees the committed
        prefix and its own path). Returns (filtered probs [B, T, V], features [R, T, dim])."""
        T = tree.tok.shape[1]
        slots = P[:, None] + torch.arange(T, device=self.device)
        anc = tree.ancestors.clone()
        anc[:, :, 0] = True                                               # everyone sees the root
        see = torch.where(anc, slots[:, None, :], slots[:, :, None])       # [B, T, T] slots seen (or self)
        pos = (P[:, None] + tree.depth).clamp(max=self.L + self.N - 1)
        f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(tree.tok)), self.rows(pos),
                                    visible(target.valid, self.rows(see)), self.rows(slots))
        return self.target_probs(f), f

    def _record(self, log: TokenLog, tree: Tree, v, active, step, d, w, K, proposer: int = Proposer.TREE) -> torch.Tensor:
        """Write the accepted drafts and the bonus to the log, each at its token position. Returns the
        block indices of [root, path nodes in depth order] [B, T + 1] (past a row's path: 0)."""
        B, T = tree.tok.shape
        k = v.on_path.long().cumsum(1) - 1                                # place in the path
        n, N = log.n, self.N
        pos = torch.cat([torch.where(v.on_path, n[:, None] + k, N), (n + v.accepted)[:, None]], 1)
        count = torch.where(active, v.accepted + 1, 0)
        nan = torch.full_like(v.p_bonus[:, None], float("nan"))
        log.write(torch.where(active[:, None], pos, N), token_id=torch.cat([tree.tok, v.bonus[:, None]], 1),
                  accepted=torch.cat([v.on_path, torch.zeros_like(v.on_path[:, :1])], 1),
                  p_target=torch.cat([v.p_node, v.p_bonus[:, None]], 1), q_draft=torch.cat([tree.q, nan], 1),
                  step=step, accept_len=count, tree_depth=d, tree_width=w, budget=K, proposer=proposer)
        log.n += count
        log.target_forwards += active.long()
        idx = torch.arange(T, device=self.device)
        return torch.zeros(B, T + 1, dtype=torch.long, device=self.device).scatter_(
            1, torch.where(v.on_path, k + 1, T), idx.expand(B, T))

    @staticmethod
    def _by_rank(tree: Tree, v, active):
        """What the budget learns from a step: the mean acceptance of each row's k-th best node by draft
        score [K], the Σ of the verified nodes' path probabilities (to calibrate them), and that Σ per
        row [B]."""
        K = tree.tok.shape[1] - 1
        if K == 0 or not bool(active.any()):
            return None, 0.0, None
        score = torch.where(tree.node & active[:, None], tree.score, float("-inf"))
        order = score.argsort(1, descending=True)[:, :K]
        hit = v.on_path.gather(1, order)[active].float().mean(0)
        per_row = score.exp().sum(1)
        return hit.cpu().numpy(), float(per_row.sum()), per_row

    # -- commit -----------------------------------------------------------------------------------------
    def _commit(self, st, tfeats, path, m, P, n, active):
        """Move the accepted path's K/V to contiguous slots; keep the features of root and path (pairs for
        the drafter's next catch-up). Returns the longest accepted path."""
        dev, N = self.device, self.N
        m_max = int(m.max())
        lanes = torch.arange(m_max + 1, device=dev)
        idx = path[:, : m_max + 1]                                        # block indices: root, path
        keep = (lanes <= m[:, None]) & active[:, None]
        src, dst = P[:, None] + idx, P[:, None] + lanes
        src = torch.where(keep, src, dst)
        st.target.move(self.rows(src), self.rows(dst))
        st.target.commit(self.rows(dst), self.rows(keep))
        at = torch.where(keep, n[:, None] - 1 + lanes, N)                  # token index of each kept feature
        f = tfeats.gather(1, self.rows(idx)[..., None].expand(-1, -1, tfeats.shape[-1]))
        put_rows(st.feats, self.rows(at), f)
        return m_max


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
