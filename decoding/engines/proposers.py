"""Proposers: what a speculative step verifies (docs/design.md, "Roles of a speculative step"). Each
proposes a Tree per row rooted at its last committed token, and learns from the verdict:

    TreeProposer   the EAGLE drafter's tree (eagle2: fixed shape; adt_tree: per-row depth and width)
    ChainProposer  (chains.py) the target's own drafts of its last chain step (drafter-free: chains, Jacobi)

`propose(st, active, n, P, plan) -> Proposal`; `learn(st, proposal, verdict, probs, n, active, m_max)`
returns what the budget learns. Every tensor is per row; nothing loops over rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from decoding.engines.base import parked, visible
from decoding.engines.log import Proposer
from decoding.engines.verify import Tree

NEG = float("-inf")
CATCH_UP_MAX = 32    # pairs a catch-up feeds the drafter at most (TreeProposer.catch_up)


@dataclass
class Proposal:
    """A step's trees and how the token log records them: levels d [B], width w [B], node budget K."""
    tree: Tree
    d: torch.Tensor
    w: torch.Tensor
    K: int
    kind: int
    extra: SimpleNamespace
    law: torch.Tensor | None = None   # [B, T, V] each node's draft law (chains.py): verified by speculative sampling


def root_tokens(log, N: int) -> torch.Tensor:
    """Each row's last committed token [B, 1] (an empty slot: any id)."""
    return log.tokens.gather(1, (log.n - 1).clamp(0, N - 1)[:, None]).clamp(min=0)


class TreeProposer:
    """The EAGLE drafter's tree: catch the drafter up on the committed (feature, token) pairs, draft level
    by level (each frontier node proposes its top-w children; cumulative log-prob scores pick the next
    frontier), then keep each row's K best candidates, K chosen by the budget (`choose`)."""

    def __init__(self, engine):
        self.e = engine

    def propose(self, st, active, n, P, plan, room=None, choose: bool = True) -> Proposal:
        e, log = self.e, st.log
        caught_up = self.catch_up(st, active)
        asked, w = st.policy.plan(n, log.col("accepted")[:, : e.N])
        d = torch.where(active, torch.minimum(torch.minimum(asked, e.N - n - 1), torch.full_like(asked, plan)), 0)
        if room is not None:
            d = torch.minimum(d, room)
        cand = self.draft(st.draft, st.dfeat, P, d, w, log, keep=plan)
        d = cand["levels"]
        catch_up_ms, drafting_ms = e.planner.drafting_ms(st.R, caught_up, int(d.max()), int(w.max()))
        top = cand["score"].topk(min(plan, cand["score"].shape[1]), -1).values.exp()
        values = torch.where(active[:, None], top, 0.0)
        K = e.budget.choose(st.R, values, plan, drafting_ms) if choose else min(plan, values.shape[1])
        return Proposal(self.tree(cand, K, log), d, w, K, Proposer.TREE,
                        SimpleNamespace(asked=asked, catch_up_ms=catch_up_ms, drafting_ms=drafting_ms))

    def learn(self, st, prop: Proposal, v, probs, n, active, m_max: int):
        """Adapt the rows' shapes (adt_tree) and return what the budget learns from the tree."""
        tree, N = prop.tree, self.e.N
        drafted = tree.depth.amax(1)                                      # the depth the budget left: α's base
        st.policy.update(prop.extra.asked, prop.w, v.accepted, active & (drafted > 0), drafted)
        st.pending = m_max + 1                                            # the path and the bonus
        by_rank, predicted, per_row = by_rank_of(tree, v, active)
        accepted, rows = float(v.accepted[active].sum()), max(int(active.sum()), 1)
        behind = active & (n == torch.where(active, n, N).min())          # the rows furthest from done
        return SimpleNamespace(K=prop.K, catch_up_ms=prop.extra.catch_up_ms, drafting_ms=prop.extra.drafting_ms,
                               tokens=1 + accepted / rows, by_rank=by_rank, predicted=predicted, accepted=accepted,
                               behind=float(per_row[behind].mean()) if per_row is not None else None)

    def prefix(self, st, rows, feats, cond_emb, x0) -> None:
        """The drafter over new prompts' condition prefix: pairs (f_p, e_{p+1}) for p < L, e_L = emb(t_0);
        its last output drafts t_1."""
        e, L = self.e, self.e.L
        new = torch.zeros(st.slots, dtype=torch.long, device=e.device).index_fill(0, rows, 1)
        r = e.cache_rows(rows, st.slots)
        nxt = torch.cat([cond_emb[:, 1:], e.gpt.embed_tokens(e.rows(x0))[:, None]], 1)
        pos = torch.arange(1, L + 1, device=e.device).expand(len(r), L)
        cond_valid = st.target.valid[r, :L]
        out = e.drafter(nxt, feats, pos, e.prefix_mask(st.draft, cond_valid, len(r)), pos - 1, rows=r)
        st.draft.valid[r] = False
        st.draft.valid[r, :L] = cond_valid
        st.dfeat[r] = out[:, -1]
        st.dn[rows] = 0
        st.log.draft_forwards += new

    def catch_up(self, st, active) -> int:
        """Feed the drafter the (feature, next token) pairs committed since it last ran: pair i is (the
        target's feature at token i, token i + 1), in drafter slot L + i; its last output per row becomes
        st.dfeat. At most the last CATCH_UP_MAX pairs (docs/design.md, "Budgets"). Returns the most pairs
        a row fed."""
        e, log, N = self.e, st.log, self.e.N
        todo = torch.where(active, log.n - 1 - st.dn, 0)                   # pairs per row
        skip = (todo - CATCH_UP_MAX).clamp(min=0)                          # older pairs stay unseen
        st.dn, todo = st.dn + skip, todo - skip
        C = int(todo.max())
        if C == 0:
            return 0
        lanes = torch.arange(C, device=e.device)
        keep = lanes < todo[:, None]
        i = (st.dn[:, None] + lanes).clamp(max=N - 1)                      # pair index = token index
        slots = parked(e.L + i, active)
        see = torch.where(lanes[None, None, :] <= lanes[None, :, None], slots[:, None, :], slots[:, :, None])
        nxt = log.tokens.gather(1, (i + 1).clamp(max=N - 1)).clamp(min=0)
        feats = st.feats.gather(1, e.rows(i)[..., None].expand(-1, -1, st.feats.shape[-1]))
        pos = (slots + 1).clamp(max=e.L + N - 1)                           # lanes past a row's pairs: any position
        out = e.drafter(e.gpt.embed_tokens(e.rows(nxt)), feats, e.rows(pos),
                        visible(st.draft.valid, e.rows(see)), e.rows(slots))
        st.draft.commit(e.rows(slots), e.rows(keep))
        last = (todo - 1).clamp(min=0)
        fresh = out.gather(1, e.rows(last)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]
        st.dfeat = torch.where(e.rows(todo > 0)[:, None], fresh, st.dfeat)
        st.dn = st.dn + todo
        log.draft_forwards += (todo > 0).long()
        return C

    def draft(self, draft, dfeat, P, d, w, log, keep: int | None = None) -> dict:
        """Every row's candidate nodes: tok, par (candidate index of the parent, -1 = root), depth, score
        (cumulative draft log-prob, -inf = none), q, each [B, C]; and `levels`, the levels drafted.
        `keep`: only each row's `keep` best candidates will be used, so drafting stops once no frontier
        node could enter them (`settled`): the tree is the same, the levels that would not change it are
        not drafted."""
        e, B, dev = self.e, len(P), P.device
        q = e.draft_probs(dfeat[:, None])[:, 0]                           # [B, V]
        d_max, w_max = int(d.max()), min(max(int(w.max()), 1), q.shape[-1])   # no wider than the vocabulary
        lanes = torch.arange(w_max, device=dev)
        top_q, top_tok = q.topk(w_max, -1)
        score = top_q.log().masked_fill((lanes >= w[:, None]) | (d[:, None] < 1), NEG)
        c = {"tok": [top_tok], "par": [torch.full_like(top_tok, -1)], "depth": [torch.ones_like(top_tok)],
             "score": [score], "q": [top_q]}
        front, front_score = lanes.expand(B, w_max), score                # candidate ids of the frontier
        front_feat = dfeat[:, None].expand(-1, w_max, -1)                 # feature paired with each node
        front_see = torch.zeros(dfeat.shape[0], w_max, 0, dtype=torch.long, device=dev)
        offset = w_max
        for k in range(2, d_max + 1):
            slots = P[:, None] + (k - 2) * w_max + lanes                   # drafter scratch slots
            pos = (P[:, None] + k - 1).clamp(max=e.L + e.N - 1).expand(B, w_max)
            see = torch.cat([front_see, e.rows(slots)[..., None]], -1)
            out = e.drafter(e.gpt.embed_tokens(e.rows(torch.cat(c["tok"], 1).gather(1, front))), front_feat,
                            e.rows(pos), visible(draft.valid, see), e.rows(slots))
            cq, ctok = e.draft_probs(out).topk(w_max, -1)                 # [B, w, w]
            cs = (front_score[:, :, None] + cq.log()).masked_fill(
                (lanes[None, None, :] >= w[:, None, None]) | (d[:, None, None] < k), NEG)
            for key, x in (("tok", ctok), ("par", front[:, :, None].expand(-1, -1, w_max)),
                           ("depth", torch.full_like(ctok, k)), ("score", cs), ("q", cq)):
                c[key].append(x.flatten(1))
            fs, fi = cs.flatten(1).topk(w_max, -1)
            front_score = fs.masked_fill(lanes >= w[:, None], NEG)
            if keep is not None and k < d_max and self.settled(torch.cat(c["score"], 1), front_score, d, k, keep):
                d = d.clamp(max=k)
                break
            front, par_lane = offset + fi, e.rows(fi // w_max)
            front_feat = out.gather(1, par_lane[..., None].expand(-1, -1, out.shape[-1]))
            front_see = see.gather(1, par_lane[..., None].expand(-1, -1, see.shape[-1]))
            offset += w_max * w_max
        log.draft_forwards += (d - 1).clamp(min=0)                        # levels 2..d (inactive rows: d = 0)
        return {**{key: torch.cat(x, 1) for key, x in c.items()}, "levels": d}

    @staticmethod
    def settled(scores, front_score, d, k: int, keep: int) -> bool:
        """After level k: True when every row either drafts no deeper (d <= k) or has `keep` candidates
        scoring at least its best frontier node (a deeper node that ties loses: `select`)."""
        if scores.shape[1] < keep:                                        # fewer candidates than it keeps
            return bool((d <= k).all())
        kth = scores.topk(keep, -1).values[:, -1]
        return bool(((d <= k) | (front_score.amax(-1) <= kth)).all())

    def tree(self, cand: dict, K: int, log) -> Tree:
        """The K best candidates of each row as a Tree rooted at its last committed token."""
        root = root_tokens(log, self.e.N)
        col = torch.zeros_like(root)
        if K == 0:
            return Tree(root, col - 1, col, torch.full_like(root, float("nan"), dtype=torch.float32))
        nodes = select(cand["tok"], cand["par"], cand["depth"], cand["score"], cand["q"], K)
        nan = torch.full_like(nodes["q"][:, :1], float("nan"))
        return Tree(tok=torch.cat([root, nodes["tok"]], 1), parent=torch.cat([col - 1, nodes["parent"]], 1),
                    depth=torch.cat([col, nodes["depth"]], 1), q=torch.cat([nan, nodes["q"]], 1),
                    score=torch.cat([nan, nodes["score"]], 1))


def select(tok, par, depth, score, q, budget):
    """Top-`budget` candidates by score, ordered by (depth, -score). Ties go to the earlier candidate
    (a stable sort; levels are appended in order, so the shallower), which makes the choice the same
    however many levels were drafted (TreeProposer.draft's stop). Returns [B, budget] tensors; parent
    is a block index (0 = root, j + 1 = node j), -1 for padding."""
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


def by_rank_of(tree: Tree, v, active):
    """What the budget learns from a tree: the mean acceptance of each row's k-th best node by draft score
    [K], the Σ of the verified nodes' path probabilities (to calibrate them), and that Σ per row [B]."""
    K = tree.tok.shape[1] - 1
    if K == 0 or not bool(active.any()):
        return None, 0.0, None
    score = torch.where(tree.node & active[:, None], tree.score, float("-inf"))
    order = score.argsort(1, descending=True)[:, :K]
    hit = v.on_path.gather(1, order)[active].float().mean(0)
    per_row = score.exp().sum(1)
    return hit.cpu().numpy(), float(per_row.sum()), per_row
