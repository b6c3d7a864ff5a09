"""Tree verification on the device, batched over rows: the target draws, the tree is matched against the
draws (docs/design.md, "Verification").

Exact acceptance. After each node the target draws its own next token, x = sample(p_node, key), with
the key of the position of the token being drawn: the same key vanilla decoding would use there. The walk starts at the root; while the target's draw at the current node equals one of its
children (drafted tokens are distinct siblings), the walk moves to that child; the first draw that
matches no child is the bonus token. Every committed token is therefore the target's own draw with
vanilla's uniform, so the output is vanilla's, token for token, whatever tree was drafted — up to the
floating-point rounding of the batched forward. A drafted child x_j is accepted with probability
p(x_j), exactly as sequential sibling trials accept deterministic drafts, so τ is unchanged. And the
bytes of an image do not depend on its tree, hence not on the batch it ran in or the budget chosen.

LANTERN (relaxed): each child x_j claims a set: itself and the longest prefix of its nearest codebook
neighbours (nearest first) whose remaining mass fits in the node's budget δ; siblings claim in trial
order, each from the mass the earlier ones left, and spend what they claim. The first child whose set
holds the target's draw is accepted (the draft replaces the draw), so x_j is output with probability
p(x_j) + its neighbours' mass: each token's distribution moves by at most δ (total variation).

Speculative sampling (`verify_chain`, chains whose drafts have a known law q: the Jacobi couplings of
proposers.py). Node j passes with probability min(1, p(x_j)/q(x_j)), the path is the leading passes, and
after it the token comes from norm(max(p - q, 0)) (a failed node) or from p (the chain's end). Every
committed token then has law p whatever q was (the drafts are not vanilla's draws, so the bytes are
not vanilla's), and each node's test and residual are computed whether or not the path reached it: a
maximal coupling reads them past the first rejection.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from decoding.engines.base import visible
from decoding.sampling import ACCEPT, SAMPLE, Streams, sample

RESIDUAL_FLOOR = 1e-6   # a residual max(p - q, 0) with less mass than this is rounding: draw from p


@dataclass
class Tree:
    """One draft tree per row in block form: index 0 is the root (the last committed token), 1..T-1
    the drafted nodes ordered by (depth, -score), so a parent always precedes its children and siblings
    stand in trial order. Padding nodes have parent -1 (as has the root)."""
    tok: torch.Tensor       # [B, T] token ids
    parent: torch.Tensor    # [B, T] block index of the parent; -1: root or padding
    depth: torch.Tensor     # [B, T] 0 for the root and padding
    q: torch.Tensor         # [B, T] draft probability of each node's token (root: NaN)
    score: torch.Tensor | None = None   # [B, T] cumulative draft log-probability of each node's path
    chain: bool = False     # node j's parent is j - 1 (drafted nodes a prefix): the accepted path stays in place

    @property
    def node(self) -> torch.Tensor:
        """[B, T] drafted nodes (not the root, not padding)."""
        return self.parent >= 0

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[B, T, T] bool: i is j's ancestor or j itself, drafted nodes only (the root is no one's)."""
        B, T = self.tok.shape
        if self.chain:                                # every earlier drafted node: one mask, no walk
            idx = torch.arange(T, device=self.tok.device)
            return (idx[None, :] <= idx[:, None]) & self.node[:, :, None] & self.node[:, None, :]
        eye = torch.eye(T, dtype=torch.bool, device=self.tok.device).expand(B, T, T) & self.node[:, :, None]
        anc = eye
        rows = self.parent.clamp(min=0)[..., None].expand(-1, -1, T)
        for _ in range(int(self.depth.max())):        # each pass adds one generation
            anc = eye | (anc.gather(1, rows) & self.node[:, :, None])
        return anc

    @cached_property
    def earlier_siblings(self) -> torch.Tensor:
        """[B, T, T] bool: i is a sibling of j tried before j."""
        T = self.tok.shape[1]
        idx = torch.arange(T, device=self.tok.device)
        same = self.parent[:, None, :] == self.parent[:, :, None]
        return same & self.node[:, None, :] & self.node[:, :, None] & (idx[None, :] < idx[:, None])


@dataclass
class Verdict:
    on_path: torch.Tensor   # [B, T] accepted nodes (in block order = depth order)
    accepted: torch.Tensor  # [B] number of accepted drafts m
    last: torch.Tensor      # [B] block index of the path's last node (0 = root)
    bonus: torch.Tensor     # [B] the target's draw after the path
    p_node: torch.Tensor    # [B, T] target probability of each node's token at its parent
    p_bonus: torch.Tensor   # [B] target probability of the bonus token
    drawn: torch.Tensor     # [B, T] the target's draw after each node (its next token, if the path ends there)
    passed: torch.Tensor | None = None   # [B, T] each node's own test (speculative sampling: verify_chain)


def draws(streams: Streams, N: int) -> torch.Tensor:
    """[B, N] the key (sampling.sample) of the target's draw of token i: the one vanilla uses for token i."""
    return streams.bits(SAMPLE, torch.arange(N, device=streams.device)[None])


def node_keys(keys: torch.Tensor, n: torch.Tensor, tree: Tree) -> torch.Tensor:
    """[B, T]: for rows with n committed tokens (the root is token n - 1), the key of the target's draw
    after each node: that token's index is n + depth."""
    return keys.gather(1, (n[:, None] + tree.depth).clamp(max=keys.shape[1] - 1))


def verify(tree: Tree, probs: torch.Tensor, keys: torch.Tensor, lantern=None) -> Verdict:
    """probs [B, T, V]: the target's filtered distribution at every block index; keys [B, T]: the key of
    the target's draw after each node (`node_keys`)."""
    B, T, V = probs.shape
    node, parent = tree.node, tree.parent.clamp(min=0)
    x = sample(probs, keys)                                               # the target's draw after each node
    x_at_parent = x.gather(1, parent)
    if lantern is None:
        won = node & (x_at_parent == tree.tok)                           # siblings are distinct tokens
    else:
        claims = node & lantern.claims(tree, probs, x_at_parent)
        earlier = torch.bmm(tree.earlier_siblings.float(), claims.float()[..., None])[..., 0]
        won = claims & (earlier == 0)                                     # the first claiming sibling wins
    on_path = node & (torch.bmm(tree.ancestors.float(), won.float()[..., None])[..., 0] == tree.depth)
    last = (on_path * torch.arange(T, device=probs.device)).amax(1)
    bonus = x.gather(1, last[:, None])[:, 0]
    p_node = probs.flatten(1).gather(1, parent * V + tree.tok)
    p_bonus = probs.flatten(1).gather(1, (last * V + bonus)[:, None])[:, 0]
    return Verdict(on_path, on_path.sum(1), last, bonus, p_node, p_bonus, x)


def residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) over [..., V] (unnormalised; `sample` normalises). Where it has (almost) no mass,
    p and q agree up to rounding and a rejection there is rounding too: draw from p."""
    r = (p - q).clamp(min=0)
    return torch.where(r.sum(-1, keepdim=True) > RESIDUAL_FLOOR, r, p)


def trial(p: torch.Tensor, q: torch.Tensor, x: torch.Tensor, u: torch.Tensor, key_res: torch.Tensor):
    """Speculative sampling at every lane at once: p, q [B, W, V], drafts x [B, W], uniforms u and the
    residual draws' keys key_res [B, W]. Returns (passed [B, W], with probability min(1, p(x)/q(x)); the
    residual draw [B, W] from norm(max(p - q, 0)), the token a lane gets when its draft does not pass).
    A draft with p(x) >= q(x) passes without reading u, and one with p(x) = 0 never does: no rounding of
    u q(x) can turn either around."""
    px, qx = p.gather(-1, x[..., None])[..., 0], q.gather(-1, x[..., None])[..., 0]
    return (px > 0) & ((px >= qx) | (u * qx < px)), sample(residual(p, q), key_res)


def verify_chain(tree: Tree, probs: torch.Tensor, law: torch.Tensor, u: torch.Tensor, keys: torch.Tensor) -> Verdict:
    """A chain (node j's parent is j - 1, drafted nodes a prefix) whose node j was drawn from law[:, j]
    [B, T, V] (index 0 unused), by speculative sampling (module docstring). u [B, T]: node j's uniform;
    keys [B, T]: the key of the token drawn after block j if the path ends there."""
    B, T, V = probs.shape
    node = tree.node
    passed, fix = trial(probs[:, :-1], law[:, 1:], tree.tok[:, 1:], u[:, 1:], keys[:, :-1])
    passed = torch.cat([torch.zeros_like(node[:, :1]), passed & node[:, 1:]], 1)
    nxt = torch.cat([node[:, 1:], torch.zeros_like(node[:, :1])], 1)       # block j has a drafted successor
    drawn = torch.where(nxt, torch.cat([fix, fix[:, :1]], 1), sample(probs, keys))
    on_path = torch.cat([passed[:, :1], passed[:, 1:].long().cummin(1).values.bool()], 1)
    m = on_path.sum(1)
    bonus = drawn.gather(1, m[:, None])[:, 0]
    p_node = probs.flatten(1).gather(1, tree.parent.clamp(min=0) * V + tree.tok)
    p_bonus = probs.flatten(1).gather(1, (m * V + bonus)[:, None])[:, 0]
    return Verdict(on_path, m, m, bonus, p_node, p_bonus, drawn, passed)


class Lantern:
    """LANTERN's relaxed acceptance: `neighbours` [V, k] codebook neighbours nearest first, δ per token."""

    def __init__(self, neighbours: torch.Tensor, delta: float):
        self.neighbours, self.delta = neighbours, delta

    def claims(self, tree: Tree, probs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """[B, T] bool: does node j's claimed set (its token and the neighbours it took, given its earlier
        siblings' claims) hold x [B, T], the target's draw at its parent."""
        B, T, V = probs.shape
        node = tree.node
        rank = tree.earlier_siblings.sum(-1)
        par = tree.parent.clamp(min=0)
        r = torch.cat([probs.flatten(1), probs.new_zeros(B, 1)], 1)     # residual of each parent; last = scratch
        budget = torch.cat([probs.new_full((B, T), self.delta), probs.new_zeros(B, 1)], 1)
        nb = self.neighbours[tree.tok]                                   # [B, T, k]
        took = torch.zeros_like(nb, dtype=torch.bool)
        base = par * V                                                   # parent's row in r
        for j in range(int(rank.max()) + 1 if node.any() else 0):      # trial j at every parent at once
            at = node & (rank == j)
            m_nb = r.gather(1, (base[..., None] + nb).flatten(1)).view(nb.shape)
            use = (m_nb.cumsum(-1) <= budget.gather(1, par)[..., None]) & at[..., None]   # a prefix
            took |= use
            gone = torch.where(use, base[..., None] + nb, T * V)
            r.scatter_(1, torch.cat([torch.where(at, base + tree.tok, T * V), gone.flatten(1)], 1), 0.0)
            spent = (m_nb * use).sum(-1)
            budget.scatter_(1, torch.where(at, par, T), (budget.gather(1, par) - spent).masked_fill(~at, 0.0))
            r[:, -1], budget[:, -1] = 0.0, 0.0
        return (x == tree.tok) | ((nb == x[..., None]) & took).any(-1)


def codebook_neighbours(codebook: torch.Tensor, k: int, chunk: int = 1024) -> torch.Tensor:
    """[V, k] nearest codebook entries by L2 distance, nearest first, self excluded. `codebook` is the
    space the decoder reads (l2-normalised codes for LlamaGen's VQ). Chunked: memory O(chunk * V + V * k)."""
    V = codebook.shape[0]
    k = min(k, V - 1)
    c = codebook.float()
    sq = c.pow(2).sum(-1)
    out = []
    for s in range(0, V, chunk):
        d = sq[s:s + chunk, None] + sq[None] - 2 * c[s:s + chunk] @ c.T
        d[torch.arange(d.shape[0]), torch.arange(s, s + d.shape[0])] = float("inf")
        out.append(d.topk(k, -1, largest=False).indices)
    return torch.cat(out)


class Verifier:
    """The target's side of a speculative step, for any proposer's tree: one forward over [root, nodes]
    under the tree mask, `verify`, and the token log's record of the accepted path and the bonus."""

    def __init__(self, engine, lantern: Lantern | None = None):
        self.e, self.lantern = engine, lantern

    def forward(self, target, tree: Tree, P):
        """Target forward over the block [root, nodes], each node seeing the committed prefix and its own
        path, the root at slot P [B]. Returns (filtered probs [B, T, V], features [R, T, dim])."""
        e, T = self.e, tree.tok.shape[1]
        slots = P[:, None] + torch.arange(T, device=e.device)
        anc = tree.ancestors.clone()
        anc[:, :, 0] = True                                               # everyone sees the root
        see = torch.where(anc, slots[:, None, :], slots[:, :, None])       # [B, T, T] slots seen (or self)
        pos = (P[:, None] + tree.depth).clamp(max=e.L + e.N - 1)
        f = e.gpt.forward_embeds(e.gpt.embed_tokens(e.rows(tree.tok)), e.rows(pos),
                                 visible(target.valid, e.rows(see)), e.rows(slots))
        return e.target_probs(f), f

    def accept(self, st, prop, probs, n, active) -> tuple[Verdict, torch.Tensor]:
        """The verdict on `prop`'s trees, written to the log at each token's position. Returns (verdict,
        the block indices of [root, path nodes in depth order] [B, T + 1], past a row's path 0)."""
        tree, log, N = prop.tree, st.log, self.e.N
        B, T = tree.tok.shape
        if prop.law is None:                                              # matched against the target's draws
            v = verify(tree, probs, node_keys(st.keys, n, tree), self.lantern)
        else:                                                             # speculative sampling, keyed per row step
            at = n[:, None] + torch.arange(T, device=probs.device)       # the token drawn after block j
            v = verify_chain(tree, probs, prop.law, st.streams.uniform(ACCEPT, at - 1, st.it[:, None]),
                             st.streams.bits(SAMPLE, at, st.it[:, None]))
        k = v.on_path.long().cumsum(1) - 1                                # place in the path
        pos = torch.cat([torch.where(v.on_path, n[:, None] + k, N), (n + v.accepted)[:, None]], 1)
        count = torch.where(active, v.accepted + 1, 0)
        nan = torch.full_like(v.p_bonus[:, None], float("nan"))
        log.write(torch.where(active[:, None], pos, N), token_id=torch.cat([tree.tok, v.bonus[:, None]], 1),
                  accepted=torch.cat([v.on_path, torch.zeros_like(v.on_path[:, :1])], 1),
                  p_target=torch.cat([v.p_node, v.p_bonus[:, None]], 1), q_draft=torch.cat([tree.q, nan], 1),
                  step=st.it, accept_len=count, tree_depth=prop.d, tree_width=prop.w, budget=prop.K,
                  proposer=prop.kind)
        log.n += count
        log.target_forwards += active.long()
        idx = torch.arange(T, device=probs.device)
        path = torch.zeros(B, T + 1, dtype=torch.long, device=probs.device).scatter_(
            1, torch.where(v.on_path, k + 1, T), idx.expand(B, T))
        return v, path
