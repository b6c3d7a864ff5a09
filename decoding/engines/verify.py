"""Tree verification on the device, batched over rows: lossless sequential sibling trials, and
LANTERN's relaxed acceptance (docs/design.md, "Verification").

Sequential trials. At a node with target distribution p (filtered exactly as vanilla filters it), its
children x_1, x_2, ... (distinct, drafted deterministically) are tried in order: x_j is accepted with
probability r(x_j) / Σr, where r is p with the earlier siblings removed; on acceptance the walk moves to
x_j, else r(x_j) <- 0. When no child is accepted the bonus token is drawn from r. This samples p exactly.

The trials need no loop. Every trial gets its own uniform u, keyed by the token position it decides and
the sibling's rank, so the outcome of each trial, *had it been reached*, is known at once:
accept_j = u_j * Σr_j < r_j(x_j). The sibling that wins at a node is the first accepted one; the path is
the chain of winners from the root; the bonus is drawn at the path's last node from r after all of its
children were rejected. Uniforms of nodes off the path are drawn and ignored, and nodes on different
branches at one depth may share a key: only one of them is ever reached, so each decision uses a fresh,
independent uniform, as the sequential walk does.

LANTERN (relaxed): x_j also collects the mass of its nearest codebook neighbours, the longest prefix of
them (nearest first) whose mass in r fits in the node's remaining budget δ; a rejection removes x_j and
those neighbours and spends their mass from the budget. The output moves at most δ of mass per token.
The rejected state before trial j does not depend on random outcomes, so the masses are computed rank by
rank for all nodes at once, and the same winner/path/bonus logic follows.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from decoding.sampling import ACCEPT, SAMPLE, Streams, sample


@dataclass
class Tree:
    """One draft tree per row in block form: index 0 is the root (the last committed token), 1..T-1
    the drafted nodes ordered by (depth, -score), so a parent always precedes its children and siblings
    stand in trial order. Padding nodes have parent -1 (as has the root)."""
    tok: torch.Tensor       # [B, T] token ids
    parent: torch.Tensor    # [B, T] block index of the parent; -1: root or padding
    depth: torch.Tensor     # [B, T] 0 for the root and padding
    q: torch.Tensor         # [B, T] draft probability of each node's token (root: NaN)

    @property
    def node(self) -> torch.Tensor:
        """[B, T] drafted nodes (not the root, not padding)."""
        return self.parent >= 0

    @cached_property
    def ancestors(self) -> torch.Tensor:
        """[B, T, T] bool: i is j's ancestor or j itself, drafted nodes only (the root is no one's)."""
        B, T = self.tok.shape
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

    @cached_property
    def rank(self) -> torch.Tensor:
        """[B, T] trial order among siblings (0 = first)."""
        return self.earlier_siblings.sum(-1)

    @cached_property
    def _earlier_f(self) -> torch.Tensor:
        return self.earlier_siblings.float()

    @cached_property
    def _ancestors_f(self) -> torch.Tensor:
        return self.ancestors.float()


@dataclass
class Verdict:
    on_path: torch.Tensor   # [B, T] accepted nodes (in block order = depth order)
    accepted: torch.Tensor  # [B] number of accepted drafts m
    last: torch.Tensor      # [B] block index of the path's last node (0 = root)
    bonus: torch.Tensor     # [B] the token drawn after the path
    p_node: torch.Tensor    # [B, T] target probability of each node's token at its parent
    p_bonus: torch.Tensor   # [B] target probability of the bonus token


class Draws:
    """The uniforms of tree decoding, per prompt, as tables made once per batch (docs/design.md,
    "Random streams"): `trial` [B, N, W] keyed by (token index a trial decides, sibling rank), `target`
    [B, N] keyed by the token index of a token the target draws itself (the first one, each bonus)."""

    def __init__(self, streams: Streams, N: int, W: int):
        pos = torch.arange(N, device=streams.device)
        self.trial = streams.uniform(ACCEPT, pos[None, :, None], torch.arange(W, device=streams.device)[None, None])
        self.trial = self.trial.flatten(1)                                   # [B, N * W]: index i * W + rank
        self.target = streams.uniform(SAMPLE, pos[None])
        self.N, self.W, self.lanes = N, W, pos

    def step(self, n: torch.Tensor, tree: Tree) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows with n committed tokens (the root is token n - 1): (u [B, T], the uniform of each
        node's trial; u_bonus [B, T], the bonus uniform when k drafts are accepted)."""
        T = tree.tok.shape[1]
        at = (n[:, None] - 1 + tree.depth).clamp(0, self.N - 1)            # token index a node decides
        u = self.trial.gather(1, at * self.W + tree.rank.clamp(max=self.W - 1))
        return u, self.target.gather(1, (n[:, None] + self.lanes[:T]).clamp(max=self.N - 1))


def _sum_over(mask: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """mask [B, T, T] float 0/1, x [B, T] -> [B, T]: Σ_i mask[:, j, i] x[:, i]."""
    return torch.bmm(mask, x[..., None])[..., 0]


def verify(tree: Tree, probs: torch.Tensor, u: torch.Tensor, u_bonus: torch.Tensor, lantern=None) -> Verdict:
    """probs [B, T, V]: the target's filtered distribution at every block index; u [B, T]: the uniform of
    each node's trial; u_bonus [B, T]: the uniform of the bonus draw when k drafts are accepted."""
    B, T, V = probs.shape
    node, before = tree.node, tree._earlier_f
    p_node = probs.flatten(1).gather(1, tree.parent.clamp(min=0) * V + tree.tok)   # p(x_j) at j's parent
    if lantern is None:
        num, den, residual = p_node, 1.0 - _sum_over(before, p_node), None
    else:
        num, den, residual = lantern.masses(tree, probs)
    acc = (node & (u * den < num)).float()
    first = acc * (_sum_over(before, acc) == 0)                          # the first accepted sibling wins
    on_path = node & (_sum_over(tree._ancestors_f, first) == tree.depth)   # every ancestor-or-self won
    m = on_path.sum(1)
    last = (on_path * torch.arange(T, device=probs.device)).amax(1)
    p_last = probs.gather(1, last[:, None, None].expand(-1, 1, V))[:, 0]
    if residual is None:                                # remove the last node's children (all rejected)
        child = node & (tree.parent == last[:, None])
        r = torch.cat([p_last, p_last[:, :1]], 1).scatter_(1, torch.where(child, tree.tok, V), 0.0)[:, :V]
    else:
        r = residual.gather(1, last[:, None, None].expand(-1, 1, V))[:, 0]
    bonus = sample(r, u_bonus.gather(1, m[:, None])[:, 0])
    return Verdict(on_path, m, last, bonus, p_node, p_last.gather(1, bonus[:, None])[:, 0])


class Lantern:
    """LANTERN's relaxed acceptance: `neighbours` [V, k] codebook neighbours nearest first, δ per token."""

    def __init__(self, neighbours: torch.Tensor, delta: float):
        self.neighbours, self.delta = neighbours, delta

    def masses(self, tree: Tree, probs: torch.Tensor):
        """-> (relaxed mass r(x_j) + extra_j [B, T], Σr before trial j [B, T], residual of every node
        after all its children were rejected [B, T, V])."""
        B, T, V = probs.shape
        node, rank = tree.node, tree.rank
        par = tree.parent.clamp(min=0)
        r = torch.cat([probs.flatten(1), probs.new_zeros(B, 1)], 1)     # [B, T*V + 1], last = scratch
        budget = torch.cat([probs.new_full((B, T), self.delta), probs.new_zeros(B, 1)], 1)
        num, den = torch.zeros_like(probs[..., 0]), torch.zeros_like(probs[..., 0])
        nb = self.neighbours[tree.tok]                                   # [B, T, k]
        for j in range(int(rank.max()) + 1 if node.any() else 0):      # trial j at every parent at once
            at = node & (rank == j)
            base = par * V                                               # parent's row in r
            m_nb = r.gather(1, (base[..., None] + nb).flatten(1)).view(nb.shape)
            use = m_nb.cumsum(-1) <= budget.gather(1, par)[..., None]    # a prefix: the cumsum only grows
            extra = (m_nb * use).sum(-1)
            own = r.gather(1, base + tree.tok)
            total = r[:, : T * V].view(B, T, V).sum(-1).gather(1, par)
            num, den = torch.where(at, own + extra, num), torch.where(at, total, den)
            gone = torch.where(at[..., None], base[..., None] + torch.where(use, nb, tree.tok[..., None]), T * V)
            r.scatter_(1, torch.cat([torch.where(at, base + tree.tok, T * V), gone.flatten(1)], 1), 0.0)
            budget.scatter_(1, torch.where(at, par, T), (budget.gather(1, par) - extra).masked_fill(~at, 0.0))
            r[:, -1], budget[:, -1] = 0.0, 0.0
        return num, den, r[:, : T * V].view(B, T, V)


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
