"""The drafter-free proposer: a chain of width 1 per row, drafted by the target itself in the step before
(docs/design.md, "Chains and Jacobi windows"). The tree engines' chain steps, `sjd` and `mc_sjd` are this
one proposer; they differ in the coupling, how one step's target forward becomes the next step's drafts:

    race      the target's draws with vanilla's keys, verified by matching (verify.verify): past a prefix
              the path took, a draw is vanilla's own next draw and passes for certain; tokens are vanilla's
    fresh     (sjd) a fresh draw from each p, verified by speculative sampling (verify.verify_chain)
    maximal   (mc_sjd) a draft past the first rejection is kept where its own test passed, else it becomes
              that test's residual draw: the maximal coupling of its old law and the new p
    gumbel    (mc_sjd) argmax(log p + g), g Gumbel noise fixed per (prompt, position)

Positions the last chain step did not reach get `init`: above (a copy of the token one image row up where
it is committed, else of the last committed token), repeat (SJD's spatial prior: a copy of the nearest
token to its left in the same image row, a random token at column 0) or random (a uniformly random token).

Why the speculative-sampling couplings are lossless. When token j is tested, every earlier token is
committed (causal attention: p_j, and whether j is reached, depend only on that history H_<j and on fresh
uniforms). The invariant: given H_<j and q_j, the draft at j has law q_j. A fresh draw, a maximal coupling
(its output has law p whenever its input has law q) and a Gumbel argmax (g_j is independent of H_<j and is
never used after j is committed) all keep it with q := p; a random token has law uniform, a copy is a
function of H_<j (a point mass). The test and residual then commit exactly p_j. So a coupled draft's
stored law is p, kept or redrawn, never its old q (tests/test_jacobi.py breaks each rule on purpose).

Random numbers are keyed by (token position, the row's own step count), so an image does not depend on
its batch or on when it joined it. Every tensor is per row; nothing loops over rows.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch

from decoding.engines.log import Proposer
from decoding.engines.proposers import CATCH_UP_MAX, Proposal, root_tokens
from decoding.engines.verify import Tree
from decoding.sampling import GUMBEL, JACOBI, sample

RACE = "race"
INITS = ("above", "repeat", "random")


def carry_race(st, tree, v, probs, at):
    return v.drawn


def carry_fresh(st, tree, v, probs, at):
    return sample(probs, st.streams.bits(JACOBI, at, st.it[:, None], 1))


def carry_maximal(st, tree, v, probs, at):
    # the verification's own test and residual, read past the first rejection (each uniform used once);
    # after the last block: its draw from p
    kept = torch.cat([v.passed[:, 1:], torch.zeros_like(v.passed[:, :1])], 1)
    return torch.where(kept, torch.cat([tree.tok[:, 1:], v.drawn[:, -1:]], 1), v.drawn)


def carry_gumbel(st, tree, v, probs, at):
    # the Gumbel-max draw is the exponential race (sampling.sample) with its position's key, every step
    return sample(probs, st.streams.bits(GUMBEL, at))


# coupling -> the next drafts [B, T]: the token after each block j, at token index at[:, j] = n + j
COUPLINGS = {RACE: carry_race, "fresh": carry_fresh, "maximal": carry_maximal, "gumbel": carry_gumbel}


def fill(init: str, e, st, n, drawn, old):
    """Drafts for chain lanes the last step did not reach (`drawn` False, a suffix): (tokens [B, K], copy
    [B, K]: the token is a copy of a committed one, law a point mass; else uniformly random). `old`: the
    drafts of the lanes that were reached."""
    log, (B, K) = st.log, drawn.shape
    t = n[:, None] + torch.arange(K, device=e.device)                      # each lane's token index
    if init == "above":
        src = torch.where((t >= e.G) & (t - e.G < n[:, None]), t - e.G, n[:, None] - 1).clamp(0, e.N - 1)
        return log.tokens.gather(1, src).clamp(min=0), torch.ones_like(drawn)
    rand = torch.remainder(st.streams.bits(JACOBI, t, st.it[:, None]), e.gpt.args.vocab_size)  # uniform for V = 2^k
    if init == "random":
        return rand, torch.zeros_like(drawn)
    # repeat: the nearest lane to the left in the same image row that is not new (the last reached draft
    # or the last committed token, lane -1), or the row's first new lane where that is at column 0
    first_new = K - (~drawn).sum(1, keepdim=True)
    lane = torch.arange(K, device=e.device).expand(B, K)
    src = torch.maximum(lane - t % e.G, first_new - 1)
    ext = torch.cat([root_tokens(log, e.N), torch.where(drawn, old, rand)], 1)
    copy = src < lane
    return torch.where(copy, ext.gather(1, src + 1), rand), copy


class ChainProposer:
    """Lane j drafts token n + j: the draft the last chain step left for it (st.chain, wherever plain or
    tree steps since moved n), else `init`'s."""

    def __init__(self, engine):
        self.e, cfg = engine, engine.cfg
        self.carry, self.init = COUPLINGS[cfg.coupling], cfg.init
        self.trial = cfg.coupling != RACE          # drafts with a law: verified by speculative sampling

    def propose(self, st, active, n, P, plan, room=None) -> Proposal:
        """Chains of `cfg.chain` tokens (`plan`, `room`: unused; a chain's width pays for itself)."""
        e, K = self.e, self.e.cfg.chain
        lanes = torch.arange(K, device=e.device)
        at = lanes + (n - st.chain_at)[:, None]                          # each lane's place in the last chain
        old = at.clamp(max=K - 1)
        drawn = (at < K) & st.chain_ok.gather(1, old)
        prev = st.chain.gather(1, old)
        new, copy = fill(self.init, e, st, n, drawn, prev)
        chain = torch.where(drawn, prev, new)
        k = lanes + 1
        exists = active[:, None] & (k < e.N - n[:, None])                # node k drafts token n - 1 + k < N - 1
        root = root_tokens(st.log, e.N)
        col = torch.zeros_like(root)
        law = None
        if self.trial:
            V = st.chain_law.shape[-1]
            fresh = torch.where(copy[..., None], torch.nn.functional.one_hot(chain, V).float(), 1.0 / V)
            law = torch.where(drawn[..., None], st.chain_law.gather(1, old[..., None].expand(-1, -1, V)), fresh)
            q = law.gather(2, chain[..., None])[..., 0]
            law = torch.cat([law[:, :1], law], 1)                           # block index 0 (the root): unused
        else:
            q = torch.where(drawn, st.chain_q.gather(1, old), float("nan"))
        tree = Tree(tok=torch.cat([root, chain], 1), parent=torch.cat([col - 1, torch.where(exists, k - 1, -1)], 1),
                    depth=torch.cat([col, torch.where(exists, k, 0)], 1),
                    q=torch.cat([torch.full_like(q[:, :1], float("nan")), q], 1), chain=True)
        depth = exists.sum(1)
        return Proposal(tree, depth, (depth > 0).long(), K, Proposer.JACOBI if self.trial else Proposer.CHAIN,
                        SimpleNamespace(exists=exists), law)

    def learn(self, st, prop: Proposal, v, probs, n, active, m_max: int):
        """The coupling's drafts past each row's accepted path become the next chain. Returns the mean
        drafts a busy row accepted (None: no row was busy)."""
        K, dev = prop.K, self.e.device
        st.pending = min(st.pending + m_max + 1, CATCH_UP_MAX)
        nxt = self.carry(st, prop.tree, v, probs, n[:, None] + torch.arange(K + 1, device=dev))
        block = v.accepted[:, None] + 1 + torch.arange(K, device=dev)   # the block before each next lane
        src = block.clamp(max=K)
        node = torch.cat([torch.zeros_like(prop.extra.exists[:, :1]), prop.extra.exists], 1)
        st.chain_ok = (block <= K) & node.gather(1, src)
        st.chain = nxt.gather(1, src)
        if self.trial:                                                   # q := p, kept or redrawn
            st.chain_law = probs.gather(1, src[..., None].expand(-1, -1, probs.shape[-1]))
        else:                                                            # (a law's q is read from the law)
            st.chain_q = probs.gather(2, nxt[..., None])[..., 0].gather(1, src)
        st.chain_at = st.log.n.clone()
        if not bool(active.any()):
            return None
        return SimpleNamespace(drafts=float(v.accepted[active].float().mean()))
