"""Speculative decoding with dynamic draft trees: `eagle2` (fixed shape) and `adt_tree` (adaptive).

One step, per prompt with n committed tokens (the last one, the root, not yet in the target's cache;
its logical position P = L + n - 1):
  1. draft: the EAGLE drafter expands the tree level by level — frontier nodes are fed in one forward,
     each proposes its top-w children, cumulative log-prob scores pick the next frontier (global top-w);
  2. rerank all candidates to the node budget by score (ancestors always outrank descendants);
  3. verify: one target forward over [root, nodes] with a tree mask, then the trials of verify.py;
  4. commit: the accepted path's K/V move to contiguous slots, and the drafter catches up on the
     target's features of the root and accepted nodes (with the bonus token), which yields the first
     level of the next tree.
Rows of a batch keep their own n, so every tensor here is per row; padded nodes are masked out. The
step has no loop over rows and reads nothing back from the device but the loop bounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.engines.base import CachedModel, Engine, EngineConfig, visible
from decoding.engines.log import TokenLog
from decoding.engines.policy import AdjacencyAdaptive, FixedShape
from decoding.engines.verify import Draws, Lantern, Tree, codebook_neighbours, verify
from decoding.sampling import sample

NEG = float("-inf")


@dataclass
class TreeConfig(EngineConfig):
    # Node budget per tree (one target forward verifies them all). 16 measured best on this project's
    # 2-core CPU (README, "Measured on this machine"); EAGLE-2's reference on GPUs is 60.
    total_tokens: int = 16
    depth: int = 6                        # levels drafted (adt_tree: the initial depth)
    width: int = 4                        # per-level top-k (adt_tree: the initial width)
    acceptance: str = "exact"             # exact (lossless) | lantern (relaxed, TVD <= lantern_delta per token)
    lantern_k: int = 100                  # codebook neighbours per token (LANTERN's reference: 1000; ADT-Tree's: 100)
    lantern_delta: float = 0.1

    def validate(self) -> None:
        super().validate()
        if self.acceptance not in ("exact", "lantern"):
            raise ValueError(f"engine.acceptance={self.acceptance!r}: use 'exact' (lossless) or 'lantern' (relaxed)")
        if not 0 <= self.lantern_delta < 1:
            raise ValueError(f"engine.lantern_delta={self.lantern_delta}: must be in [0, 1)")
        for key in ("total_tokens", "depth", "width", "lantern_k"):
            if getattr(self, key) < 1:
                raise ValueError(f"engine.{key}={getattr(self, key)}: must be >= 1")


@dataclass
class Eagle2Config(TreeConfig):
    name: str = "eagle2"


@dataclass
class ADTTreeConfig(TreeConfig):
    name: str = "adt_tree"
    width: int = 6
    d_min: int = 2
    d_max: int = 12
    w_min: int = 1
    w_max: int = 8
    beta: float = 0.5                     # acceptance ratio above which a region counts as easy
    adjacency: str = "horizontal"         # horizontal | 2d (also reads the row above)

    def validate(self) -> None:
        super().validate()
        if not (1 <= self.d_min <= self.depth <= self.d_max and 1 <= self.w_min <= self.width <= self.w_max):
            raise ValueError(f"engine.d_min/depth/d_max={self.d_min}/{self.depth}/{self.d_max}, engine.w_min/width/"
                             f"w_max={self.w_min}/{self.width}/{self.w_max}: need 1 <= d_min <= depth <= d_max "
                             f"and 1 <= w_min <= width <= w_max")
        if self.adjacency not in ("horizontal", "2d"):
            raise ValueError(f"engine.adjacency={self.adjacency!r}: use 'horizontal' or '2d'")


class TreeEngine(Engine):
    uses_drafter = True

    def __init__(self, bundle, cfg: TreeConfig):
        super().__init__(bundle, cfg)
        self.drafter = bundle.drafter
        self.lantern = None
        if cfg.acceptance == "lantern":
            self.lantern = Lantern(codebook_neighbours(bundle.vq.quantize.codebook().detach(), cfg.lantern_k)
                                   .to(self.device), cfg.lantern_delta)

    @property
    def acceptance(self) -> str:
        return self.cfg.acceptance

    # -- shape policy (eagle2: fixed; adt_tree overrides) ---------------------------------------------
    def policy(self, batch: int):
        return FixedShape(batch, self.cfg.depth, self.cfg.width, self.device)

    def max_shape(self) -> tuple[int, int]:
        return self.cfg.depth, self.cfg.width

    # -- one engine run ---------------------------------------------------------------------------------
    def _generate(self, cond, streams):
        B, L, N, dev = len(streams), self.L, self.N, self.device
        R = 2 * B if self.sampling.use_cfg else B
        d_max, w_max = self.max_shape()
        budget = self.cfg.total_tokens
        target = CachedModel(self.gpt, R, L + N + budget + 1, self.bundle.dtype)
        draft = CachedModel(self.drafter, R, L + N + d_max * w_max + 1, self.bundle.dtype)
        log, policy = TokenLog(B, N, self.G, dev), self.policy(B)
        draws = Draws(streams, N, w_max)

        feats, cond_emb = self.prefill(target, cond)
        p0 = self.target_probs(feats[:, -1])
        x0 = sample(p0, draws.target[:, 0])
        log.commit(torch.ones(B, dtype=torch.long, device=dev), token_id=x0, accept_len=1,
                   p_target=p0.gather(1, x0[:, None])[:, 0])
        log.target_forwards += 1
        dfeat = self._draft_prefix(draft, feats, cond_emb, target.valid[:, :L], log)

        step = 0
        while True:
            active = log.n < N
            if not active.any():
                break
            step += 1
            n = log.n.clone()
            P = L + n - 1
            d, w = policy.plan(n, log.col("accepted")[:, :N])
            d = torch.where(active, torch.minimum(d, N - n - 1), 0)   # never past the last token
            with log.phase("draft"):
                tree = self._draft(draft, dfeat, P, d, w, budget, log, active)
            with log.phase("verify"):
                probs, tfeats = self._verify_forward(target, tree, P)
            with log.phase("accept"):
                v = verify(tree, probs, *draws.step(n, tree), self.lantern)
                path = self._record(log, tree, v, active, step, d, w)
                policy.update(d, w, v.accepted, active)
            with log.phase("commit"):  # KV compaction + drafter catch-up
                dfeat = self._commit(target, draft, tfeats, path, v.accepted, P, log, active)
        return log

    # -- drafting ---------------------------------------------------------------------------------------
    def _draft_prefix(self, draft, feats, cond_emb, cond_valid, log):
        """Drafter pass over the condition prefix: pairs (f_p, e_{p+1}) for p < L, e_L = emb(t_0)."""
        L, R = self.L, feats.shape[0]
        nxt = torch.cat([cond_emb[:, 1:], self.gpt.embed_tokens(self.rows(log.tokens[:, 0]))[:, None]], 1)
        pos = torch.arange(1, L + 1, device=self.device).expand(R, L)
        out = self.drafter(nxt, feats, pos, self._prefix_mask(draft, cond_valid, R), pos - 1)
        draft.valid[:, :L] = cond_valid
        log.draft_forwards += 1
        return out[:, -1]

    def draft_probs(self, features):
        return self.target_probs(features)  # same head, same CFG and filtering as the target

    def _draft(self, draft, dfeat, P, d, w, budget, log, active) -> Tree:
        """Build one tree per prompt, rooted at its last committed token."""
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
            front = offset + fi
            par_lane = self.rows(fi // w_max)
            front_feat = out.gather(1, par_lane[..., None].expand(-1, -1, out.shape[-1]))
            front_see = see.gather(1, par_lane[..., None].expand(-1, -1, see.shape[-1]))
            offset += w_max * w_max
        log.draft_forwards += (d - 1).clamp(min=0)                       # levels 2..d (inactive rows: d = 0)
        nodes = self._select(torch.cat(toks, 1), torch.cat(pars, 1), torch.cat(depths, 1),
                             torch.cat(scores, 1), torch.cat(qs, 1), budget)
        root = log.tokens.gather(1, (log.n - 1).clamp(min=0)[:, None])
        col = torch.zeros_like(root)
        return Tree(tok=torch.cat([root, nodes["tok"]], 1), parent=torch.cat([col - 1, nodes["parent"]], 1),
                    depth=torch.cat([col, nodes["depth"]], 1),
                    q=torch.cat([torch.full_like(nodes["q"][:, :1], float("nan")), nodes["q"]], 1))

    @staticmethod
    def _select(tok, par, depth, score, q, budget):
        """Top-`budget` candidates by score (ties: shallower first), ordered by (depth, -score). Returns
        [B, budget] tensors; parent is a block index (0 = root, j + 1 = node j), -1 for padding."""
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

    def _record(self, log: TokenLog, tree: Tree, v, active, step, d, w) -> torch.Tensor:
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
                  step=step, accept_len=count, tree_depth=d, tree_width=w)
        log.n += count
        log.target_forwards += active.long()
        idx = torch.arange(T, device=self.device)
        return torch.zeros(B, T + 1, dtype=torch.long, device=self.device).scatter_(
            1, torch.where(v.on_path, k + 1, T), idx.expand(B, T))

    # -- commit -----------------------------------------------------------------------------------------
    def _commit(self, target, draft, tfeats, path, m, P, log, active):
        """Compact the accepted path in the target cache; drafter catch-up on (f, next token) pairs."""
        dev = self.device
        m_max = int(m.max())
        lanes = torch.arange(m_max + 1, device=dev)
        idx = path[:, : m_max + 1]                                        # block indices: root, path
        keep = (lanes <= m[:, None]) & active[:, None]
        src, dst = P[:, None] + idx, P[:, None] + lanes
        src = torch.where(keep, src, dst)
        target.move(self.rows(src), self.rows(dst))
        target.commit(self.rows(dst), self.rows(keep))
        # drafter catch-up: features of root + accepted nodes, paired with the token that followed each
        start = log.n - keep.sum(1)                                      # token index of the first "next"
        nxt = log.tokens.gather(1, (start[:, None] + lanes).clamp(max=self.N - 1)).clamp(min=0)  # lanes past keep: any id
        feats = tfeats.gather(1, self.rows(idx)[..., None].expand(-1, -1, tfeats.shape[-1]))
        pos = (P[:, None] + 1 + lanes).clamp(max=self.L + self.N - 1)
        see = dst[:, None, :].expand(-1, m_max + 1, -1)
        see = torch.where(lanes[None, None, :] <= lanes[None, :, None], see, dst[:, :, None].expand_as(see))
        out = self.drafter(self.gpt.embed_tokens(self.rows(nxt)), feats, self.rows(pos),
                           visible(draft.valid, self.rows(see)), self.rows(dst))
        draft.commit(self.rows(dst), self.rows(keep))
        log.draft_forwards += (active & (log.n < self.N)).long()
        last = (keep.sum(1) - 1).clamp(min=0)
        return out.gather(1, self.rows(last)[:, None, None].expand(-1, 1, out.shape[-1]))[:, 0]


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
