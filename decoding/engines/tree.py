"""Speculative decoding with dynamic draft trees: `eagle2` (fixed shape) and `adt_tree` (adaptive).

One step, per prompt with n committed tokens (the last one, the root, not yet in the target's cache;
its logical position P = L + n - 1):
  1. draft: the EAGLE drafter expands the tree level by level — frontier nodes are fed in one forward,
     each proposes its top-w children, cumulative log-prob scores pick the next frontier (global top-w);
  2. rerank all candidates to the node budget by score (ancestors always outrank descendants);
  3. verify: one target forward over [root, nodes] with a tree mask, then sequential sibling trials;
  4. commit: the accepted path's K/V move to contiguous slots, and the drafter catches up on the
     target's features of the root and accepted nodes (with the bonus token), which yields the first
     level of the next tree.
Rows of a batch keep their own n, so every tensor here is per row; padded nodes are masked out.
"""
from __future__ import annotations

import numpy as np
import torch

from decoding.engines.base import CachedModel, Engine, TokenLog, visible
from decoding.engines.policy import AdjacencyAdaptive, FixedShape
from decoding.engines.verify import Lantern, codebook_neighbours, verify_tree
from decoding.sampling import sample_from

NEG = float("-inf")


class TreeEngine(Engine):
    uses_drafter = True

    def __init__(self, bundle, sampling, total_tokens: int = 60, depth: int = 6, width: int = 10,
                 acceptance: str = "exact", lantern_k: int = 1000, lantern_delta: float = 0.1):
        super().__init__(bundle, sampling)
        self.drafter = bundle.drafter
        self.total_tokens, self.depth, self.width = total_tokens, depth, width
        if acceptance not in ("exact", "lantern"):
            raise ValueError(f"engine.acceptance={acceptance!r}: use 'exact' (lossless) or 'lantern' (relaxed)")
        self.lantern = None
        if acceptance == "lantern":
            codebook = bundle.vq.quantize.embedding.weight.detach().float().cpu().numpy()
            self.lantern = Lantern(codebook_neighbours(codebook, lantern_k), lantern_delta)

    # -- shape policy (eagle2: fixed; adt_tree overrides) ---------------------------------------------
    def policy(self, batch: int):
        return FixedShape(self.depth, self.width)

    def max_shape(self) -> tuple[int, int]:
        return self.depth, self.width

    # -- one engine run ---------------------------------------------------------------------------------
    def _generate(self, cond, gens):
        B, L, N, dev = len(gens), self.L, self.N, self.gpt.rope.device
        R = 2 * B if self.sampling.use_cfg else B
        d_max, w_max = self.max_shape()
        budget = self.total_tokens
        target = CachedModel(self.gpt, R, L + N + budget + 1, self.bundle.dtype)
        draft = CachedModel(self.drafter, R, L + N + d_max * w_max + 1, self.bundle.dtype)
        log, policy = TokenLog(B, N), self.policy(B)

        feats, cond_emb = self.prefill(target, cond)
        p0 = self.target_probs(feats[:, -1]).double().cpu().numpy()
        for b in range(B):
            x = sample_from(p0[b], gens[b].random())
            log.commit(b, [x], step=0, accepted=False, p_target=p0[b, x])
        log.target_forwards += 1
        dfeat = self._draft_prefix(draft, feats, cond_emb, target.valid[:, :L], log)

        step = 0
        while (log.n < N).any():
            step += 1
            active = log.n < N
            n = torch.from_numpy(log.n.copy()).to(dev)
            P = L + n - 1
            shapes = [policy.plan(b, int(log.n[b]), log.cols["accepted"][b]) if active[b] else (0, 1)
                      for b in range(B)]
            d = torch.tensor([min(s[0], max(N - int(log.n[b]) - 1, 0)) for b, s in enumerate(shapes)], device=dev)
            w = torch.tensor([s[1] for s in shapes], device=dev)
            with log.phase("draft"):
                tree = self._draft(draft, dfeat, P, d, w, budget, log, active)
            with log.phase("verify"):
                probs, tfeats = self._verify_forward(target, tree, P, log)
            with log.phase("accept"):
                accepted = self._accept(tree, probs, gens, log, step, d, w, active, policy)
            with log.phase("commit"):  # KV compaction + drafter catch-up
                dfeat = self._commit(target, draft, tree, tfeats, accepted, P, log, active)
        return log

    # -- drafting ---------------------------------------------------------------------------------------
    def _draft_prefix(self, draft, feats, cond_emb, cond_valid, log):
        """Drafter pass over the condition prefix: pairs (f_p, e_{p+1}) for p < L, e_L = emb(t_0)."""
        L, R = self.L, feats.shape[0]
        t0 = torch.from_numpy(log.tokens[:, 0]).to(feats.device)
        nxt = torch.cat([cond_emb[:, 1:], self.gpt.embed_tokens(self.rows(t0))[:, None]], 1)
        pos = torch.arange(1, L + 1, device=feats.device).expand(R, L)
        out = self.drafter(nxt, feats, pos, self._prefix_mask(draft, cond_valid, R), pos - 1)
        draft.valid[:, :L] = cond_valid
        log.draft_forwards += 1
        return out[:, -1]

    def draft_probs(self, features):
        return self.target_probs(features)  # same head, same CFG and filtering as the target

    def _draft(self, draft, dfeat, P, d, w, budget, log, active):
        """Build one tree per prompt. Returns dict of [B, budget] tensors: tok, parent (block index of
        the parent, 0 = root, -1 = padding), depth, q, score."""
        B, dev = len(P), P.device
        d_max, w_max = int(d.max()), int(w.max())
        w_max = max(w_max, 1)
        lanes = torch.arange(w_max, device=dev)
        q = self.draft_probs(dfeat[:, None])[:, 0]                      # [B, V]
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
            log.draft_forwards += (active & (d.cpu().numpy() >= k)).astype(np.int64)
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
            front = offset + fi
            par_lane = self.rows(fi // w_max)
            front_feat = out.gather(1, par_lane[..., None].expand(-1, -1, out.shape[-1]))
            front_see = see.gather(1, par_lane[..., None].expand(-1, -1, see.shape[-1]))
            offset += w_max * w_max
        return self._select(torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(depths, 1),
                            torch.cat(scores, 1), torch.cat(qs, 1), budget)

    @staticmethod
    def _select(tok, par, depth, score, q, budget):
        """Top-`budget` candidates by score (ties: shallower first), ordered by (depth, -score)."""
        B, C = tok.shape
        budget = min(budget, C)
        key = torch.where(torch.isinf(score), torch.full_like(score, -1e9), score) - depth * 1e-7
        sel = key.topk(budget, -1).indices
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
    def _verify_forward(self, target, tree, P, log):
        """Target forward over [root, nodes]. Returns (probs [B, T, V] as numpy, features [R, T, dim])."""
        B, dev = len(P), P.device
        root = torch.from_numpy(log.tokens[np.arange(B), np.maximum(log.n - 1, 0)]).to(dev)
        tok = torch.cat([root[:, None], tree["tok"]], 1)
        T = tok.shape[1]
        parent = torch.cat([torch.full((B, 1), -1, device=dev), tree["parent"]], 1)
        depth = torch.cat([torch.zeros(B, 1, dtype=torch.long, device=dev), tree["depth"]], 1)
        slots = P[:, None] + torch.arange(T, device=dev)
        see, cur = [slots], parent                               # path slots: self, parent, grandparent...
        for _ in range(int(depth.max())):
            see.append(torch.where(cur >= 0, slots.gather(1, cur.clamp(min=0)), slots))
            cur = torch.where(cur >= 0, parent.gather(1, cur.clamp(min=0)), cur)
        pos = (P[:, None] + depth).clamp(max=self.L + self.N - 1)
        f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(tok)), self.rows(pos),
                                    visible(target.valid, self.rows(torch.stack(see, -1))), self.rows(slots))
        tree["block_tok"], tree["block_parent"] = tok, parent
        return self.target_probs(f).double().cpu().numpy(), f

    def _accept(self, tree, probs, gens, log, step, d, w, active, policy):
        toks = tree["block_tok"].cpu().numpy()
        parents = tree["block_parent"].cpu().numpy()
        qs = tree["q"].float().cpu().numpy()
        d, w = d.cpu().numpy(), w.cpu().numpy()
        accepted = []
        for b in range(len(gens)):
            if not active[b]:
                accepted.append([])
                continue
            children = [[] for _ in range(toks.shape[1])]
            for j in range(1, toks.shape[1]):
                if parents[b, j] >= 0:
                    children[parents[b, j]].append(j)
            path, bonus, p_acc, p_bonus = verify_tree(probs[b], toks[b], children, gens[b], self.lantern)
            m = len(path)
            log.commit(b, [*toks[b, path], bonus], step=step, accepted=[True] * m + [False],
                       p_target=[*p_acc, p_bonus], q_draft=[*qs[b, np.array(path, int) - 1], np.nan],
                       depth=int(d[b]), width=int(w[b]))
            log.target_forwards[b] += 1
            policy.update(b, int(d[b]), int(w[b]), m)
            accepted.append(path)
        return accepted

    # -- commit -----------------------------------------------------------------------------------------
    def _commit(self, target, draft, tree, tfeats, accepted, P, log, active):
        """Compact the accepted path in the target cache; drafter catch-up on (f, next token) pairs."""
        B, dev = len(P), P.device
        m_max = max(len(a) for a in accepted)
        idx = torch.zeros(B, m_max + 1, dtype=torch.long, device=dev)   # block indices: root, path
        keep = torch.zeros(B, m_max + 1, dtype=torch.bool, device=dev)
        for b, a in enumerate(accepted):
            idx[b, 1:len(a) + 1] = torch.tensor(a, dtype=torch.long)
            keep[b, : len(a) + 1] = bool(active[b])
        lanes = torch.arange(m_max + 1, device=dev)
        src, dst = P[:, None] + idx, P[:, None] + lanes
        src = torch.where(keep, src, dst)
        target.move(self.rows(src), self.rows(dst))
        target.commit(self.rows(dst), self.rows(keep))
        # drafter catch-up: features of root + accepted nodes, paired with the token that followed each
        n_after = torch.from_numpy(log.n.copy()).to(dev)
        start = n_after - 1 - keep.sum(1) + 1                            # token index of the first "next"
        nxt_idx = (start[:, None] + lanes).clamp(max=self.N - 1)
        nxt = torch.from_numpy(log.tokens).to(dev).gather(1, nxt_idx)
        feats = tfeats.gather(1, self.rows(idx)[..., None].expand(-1, -1, tfeats.shape[-1]))
        pos = (P[:, None] + 1 + lanes).clamp(max=self.L + self.N - 1)
        see = (dst[:, None, :].expand(-1, m_max + 1, -1)).clone()
        see = torch.where(lanes[None, None, :] <= lanes[None, :, None], see, dst[:, :, None].expand_as(see))
        out = self.drafter(self.gpt.embed_tokens(self.rows(nxt)), feats, self.rows(pos),
                           visible(draft.valid, self.rows(see)), self.rows(dst))
        draft.commit(self.rows(dst), self.rows(keep))
        log.draft_forwards += active.astype(np.int64) & (log.n < self.N)
        last = (keep.sum(1) - 1).clamp(min=0)
        return out.gather(1, self.rows(last)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]


class Eagle2(TreeEngine):
    name = "eagle2"


class ADTTree(TreeEngine):
    name = "adt_tree"

    def __init__(self, bundle, sampling, d_min: int = 2, d_max: int = 10, w_min: int = 1, w_max: int = 10,
                 beta: float = 0.5, adjacency: str = "horizontal", **kw):
        super().__init__(bundle, sampling, **kw)
        self.bounds = (d_min, d_max, w_min, w_max)
        self.beta, self.adjacency = beta, adjacency
        self.policy(1)  # validates the bounds now, not mid-job

    def policy(self, batch: int):
        d_min, d_max, w_min, w_max = self.bounds
        return AdjacencyAdaptive(batch, self.G, self.depth, self.width, d_min, d_max, w_min, w_max,
                                 self.beta, self.adjacency)

    def max_shape(self):
        return self.bounds[1], self.bounds[3]
