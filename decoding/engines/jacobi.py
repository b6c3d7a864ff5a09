"""Drafter-free speculative Jacobi decoding: `sjd` (Teng et al., arXiv 2410.01699) and `mc_sjd`
(So et al., arXiv 2510.24211, "MC-SJD", renamed SCD: consecutive drafts coupled). Lossless, no drafter:
they run on every model family (docs/design.md, "Jacobi step").

State per prompt: n committed tokens (the last, c, not yet in the target's cache) and a window of W
drafts x_0..x_{W-1} for token positions n..n+W-1, each with the distribution q_i it was drawn from.
One iteration:
  1. verify: one target forward over [c, x_0, ..., x_{W-1}] (causal; slot = logical position L + index,
     so the 2D RoPE row of the cell each stands for; the committed prefix in the cache) gives p_i for
     position n + i, i = 0..W (p_W: the first position past the window);
  2. accept: x_i passes if u_i q_i(x_i) < p_i(x_i) (probability min(1, p_i/q_i)); m = leading passes.
     Commit x_0..x_{m-1} and one token at n + m: from norm(max(p_m - q_m, 0)) (m < W) or p_W (m = W);
     the K/V of c and of the accepted drafts are already in their slots and become visible;
  3. draft the next window, positions n+m+1 .. n+m+W. Those this iteration's p covers get a draft with
     q := p_i, made by the engine's `carry`:
       sjd:              a fresh draw from p_i (the old draft is thrown away);
       mc_sjd maximal:   the old x_i kept if u_i q_i(x_i) < p_i(x_i), else the residual draw: the same
                         test and residual as step 2, run past the first rejection (maximal coupling of
                         q_i and p_i: the draft survives with probability 1 - TV(q_i, p_i));
       mc_sjd gumbel:    argmax(log p_i + g), g Gumbel noise fixed per (prompt, position);
     the m positions past them are new (`init`): a uniformly random token, or (`repeat`) a copy of its
     left neighbour in the image row.

Why it is lossless. When position j is tested, every earlier position has been committed in this
iteration or before (causal attention: p_j, and whether j is reached, depend only on that history H_<j
and on fresh uniforms). The invariant: given H_<j and q_j, the draft at j has law q_j. A fresh draw, a
maximal coupling (its output has law p_i whenever its input has law q_i) and a Gumbel argmax (g_j is
independent of H_<j and is never used after j is committed) all keep it with q := p_i; a uniformly
random token has law uniform, a copy of the left neighbour is a function of H_<j (a point mass). The
test and residual of step 2 then commit exactly p_j. So the stored q of a coupled draft is p_i, whether
it was kept or redrawn, never q_old (docs/design.md; tests/test_jacobi.py breaks each rule on purpose).

Random numbers are keyed by (token position, the row's own iteration), so an image does not depend on its
batch or on when it joined it: the engines run in continuous batching (scheduler.py) like the others.
The step has no loop over rows and reads nothing back from the device.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.engines.base import CachedModel, EngineConfig, parked, visible
from decoding.engines.log import Proposer, TokenLog
from decoding.engines.scheduler import SlotEngine
from decoding.engines.state import BatchState, per_slot
from decoding.sampling import ACCEPT, GUMBEL, JACOBI, SAMPLE, Streams, sample

RESIDUAL_FLOOR = 1e-6   # a residual max(p - q, 0) with less mass than this is rounding: draw from p


@dataclass
class JacobiConfig(EngineConfig):
    # Drafts per iteration; one target forward covers window + 1 tokens (the papers' L counts the
    # committed token too: L = window + 1). 16 drafts: the same 17-token forward as the tree engines'
    # node budget; SJD's reference is L = 16, MC-SJD's Lumina scripts use L = 32.
    window: int = 16
    # New positions: random (a uniformly random token: SJD's default) | repeat (a copy of the left
    # neighbour in the same image row, the first column random: SJD's "spatial prior")
    init: str = "random"

    def validate(self) -> None:
        super().validate()
        if self.window < 1:
            raise ValueError(f"engine.window={self.window}: must be >= 1 (drafts per iteration)")
        if self.init not in ("random", "repeat"):
            raise ValueError(f"engine.init={self.init!r}: use 'random' or 'repeat' (copy the left neighbour)")


@dataclass
class SJDConfig(JacobiConfig):
    name: str = "sjd"


@dataclass
class MCSJDConfig(JacobiConfig):
    name: str = "mc_sjd"
    coupling: str = "maximal"             # maximal (keep with min(1, p/q_old), else residual) | gumbel

    def validate(self) -> None:
        super().validate()
        if self.coupling not in ("maximal", "gumbel"):
            raise ValueError(f"engine.coupling={self.coupling!r}: use 'maximal' or 'gumbel'")


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


@dataclass
class JacobiState(BatchState):
    tok: torch.Tensor = per_slot(default=None)     # [slots, W] each row's window
    q: torch.Tensor = per_slot(default=None)       # [slots, W, V] the law each draft is scored with
    it: torch.Tensor = per_slot(default=None)      # [slots] iterations the row ran: a counter of its draws


class Jacobi(SlotEngine):
    """The Jacobi loop over a continuous batch (scheduler.py); subclasses choose how drafts are carried into
    the next window (`carry`). A row's random draws are keyed by its own iteration count, so an image does
    not depend on when it joined the batch."""

    def start(self, slots: int) -> JacobiState:
        L, N, W, V, dev = self.L, self.N, self.cfg.window, self.gpt.args.vocab_size, self.device
        R = 2 * slots if self.sampling.use_cfg else slots
        log = TokenLog(slots, N, self.G, dev)
        log.n[:] = N                                                       # empty slots are finished rows
        return JacobiState(slots, log, Streams([0] * slots, dev), None,
                           CachedModel(self.gpt, R, L + N + W + 1, self.bundle.dtype),
                           tok=torch.zeros(slots, W, dtype=torch.long, device=dev),
                           q=torch.zeros(slots, W, V, device=dev), it=torch.zeros(slots, dtype=torch.long, device=dev))

    def admit(self, st, rows, cond, seeds):
        """Prefill new prompts into rows, draw their first token, and initialise their windows."""
        log, dev = st.log, self.device
        log.reset(rows)
        st.streams.reseed(rows, seeds)
        st.it[rows] = 0
        feats, _ = self.prefill(st.target, cond, rows, st.slots)
        p0 = self.target_probs(feats[:, -1])
        x0 = sample(p0, st.streams.bits(SAMPLE, 0, 0, rows=rows))
        new = torch.zeros(st.slots, dtype=torch.long, device=dev).index_fill(0, rows, 1)
        full = lambda v: torch.zeros(st.slots, dtype=v.dtype, device=dev).index_copy(0, rows, v)  # noqa: E731
        log.commit(new, token_id=full(x0), accept_len=1, p_target=full(p0.gather(1, x0[:, None])[:, 0]))
        log.target_forwards += new
        tok, q = self.next_window(st.streams, log, torch.zeros_like(st.tok, dtype=torch.bool), st.tok, st.q, st.it[:, None])
        st.tok[rows], st.q[rows] = tok[rows], q[rows]

    def step(self, st):
        """One iteration of every unfinished row (module docstring: verify, accept, draft the next window)."""
        log, L, N, W, V = st.log, self.L, self.N, self.cfg.window, self.gpt.args.vocab_size
        lanes = torch.arange(W + 1, device=self.device)
        active, n = log.n < N, log.n.clone()
        st.it = st.it + active.long()
        it, tok, q, streams = st.it[:, None], st.tok, st.q, st.streams
        with log.phase("verify"):
            p = self.window_forward(st.target, log, n, tok)                           # [B, W + 1, V]
        with log.phase("accept"):
            pos = n[:, None] + lanes                                              # token position of each lane
            passed, fix = trial(p[:, :W], q, tok, streams.uniform(ACCEPT, pos[:, :W], it),
                                streams.bits(SAMPLE, pos[:, :W], it))
            bonus = sample(p[:, W], streams.bits(SAMPLE, pos[:, W], it[:, 0]))
            fix = torch.cat([fix, bonus[:, None]], 1)                             # [B, W + 1]
            m = (passed & (pos[:, :W] < N)).long().cummin(1).values.sum(1)        # accepted drafts
            count = torch.where(active, torch.minimum(m + 1, N - n), 0)
            is_draft = lanes < m[:, None]
            out = torch.where(is_draft, torch.cat([tok, fix[:, W:]], 1), fix)      # lanes <= m: committed
            nan = torch.full_like(p[:, :1, 0], float("nan"))
            log.commit(count, token_id=out, accepted=is_draft, step=st.it, accept_len=count, proposer=Proposer.JACOBI,
                       p_target=p.gather(2, out[..., None])[..., 0],
                       q_draft=torch.where(is_draft, torch.cat([q.gather(2, tok[..., None])[..., 0], nan], 1), nan))
            log.target_forwards += active.long()
            slots = L + n[:, None] - 1 + lanes                                    # c and the accepted drafts
            st.target.commit(self.rows(slots), self.rows((lanes <= m[:, None]) & active[:, None]))
        with log.phase("draft"):
            next_tok, next_q = self.carry(streams, p, q, tok, passed, fix, pos, it)   # [B, W + 1(, V)]
            src = m[:, None] + 1 + lanes[:W]                                      # old lane of next lane k
            at = src.clamp(max=W)
            st.tok, st.q = self.next_window(streams, log, src <= W, next_tok.gather(1, at),
                                      next_q.gather(1, at[..., None].expand(-1, -1, V)), it)

    # -- one target forward over [c, drafts] ------------------------------------------------------------
    def window_forward(self, target: CachedModel, log: TokenLog, n: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Causal forward over the last committed token and the window; returns p [B, W + 1, V]."""
        T = tok.shape[1] + 1
        lanes = torch.arange(T, device=self.device)
        c = log.tokens.gather(1, (n - 1).clamp(min=0)[:, None])
        pos = self.L + n[:, None] - 1 + lanes                                    # logical position = slot
        slots = parked(pos, n < self.N)
        see = torch.where(lanes[None, None, :] <= lanes[None, :, None], slots[:, None, :], slots[:, :, None])
        f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(torch.cat([c, tok], 1).clamp(min=0))),  # empty slot: any id
                                    self.rows(pos.clamp(max=self.L + self.N - 1)),
                                    visible(target.valid, self.rows(see)), self.rows(slots))
        return self.target_probs(f)

    # -- the next window ----------------------------------------------------------------------------------
    def carry(self, streams: Streams, p, q, tok, passed, fix, pos, step) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [B, W + 1] for positions pos (this window's and the one past it) and the law each has
        given the history before it, [B, W + 1, V]: p, in every engine here (only lanes past the first
        rejection are used)."""
        raise NotImplementedError

    def next_window(self, streams: Streams, log: TokenLog, carried, tok, q, step):
        """The next window [B, W] (and its q [B, W, V]): lanes `carried` keep (tok, q); the others (a
        suffix) are new positions, initialised by `cfg.init` and scored by their true law: uniform for a
        random token (accepted with min(1, V p(x)), where SJD's code scores it as a point mass: min(1, p(x))),
        a point mass for a copy."""
        B, W = carried.shape
        V = q.shape[-1]
        pos = log.n[:, None] + torch.arange(W, device=self.device)
        new = torch.remainder(streams.bits(JACOBI, pos, step), V)                # exactly uniform for V = 2^k
        point = torch.zeros_like(carried)
        if self.cfg.init == "repeat":
            # a new lane copies the nearest lane to its left in the same image row that is not new
            # (the last carried draft, or the last committed token), or the first new lane of its row
            # if that is at column 0 (a random token); lane -1 is the last committed token
            first_new = W - (~carried).sum(1, keepdim=True)
            lane = torch.arange(W, device=self.device).expand(B, W)
            src = torch.maximum(lane - pos % self.G, first_new - 1)
            last = log.tokens.gather(1, (log.n - 1).clamp(min=0)[:, None])
            ext = torch.cat([last, torch.where(carried, tok, new)], 1)
            copy = src < lane
            new = torch.where(copy, ext.gather(1, src + 1), new)
            point = point | copy
        tok = torch.where(carried, tok, new)
        fresh = torch.where(point[..., None], torch.nn.functional.one_hot(tok, V).float(), 1.0 / V)
        return tok, torch.where(carried[..., None], q, fresh)


class SJD(Jacobi):
    """Speculative Jacobi decoding: past the first rejection every draft is redrawn from the new p."""
    name, Config = "sjd", SJDConfig

    def carry(self, streams, p, q, tok, passed, fix, pos, step):
        return sample(p, streams.bits(JACOBI, pos, step, 1)), p


class MCSJD(Jacobi):
    """MC-SJD: each draft past the first rejection is coupled with the previous one (maximal or Gumbel)."""
    name, Config = "mc_sjd", MCSJDConfig

    def carry(self, streams, p, q, tok, passed, fix, pos, step):
        if self.cfg.coupling == "gumbel":
            # the Gumbel-max draw is the exponential race (sampling.sample) with the key of its position,
            # the same at every iteration
            return sample(p, streams.bits(GUMBEL, pos)), p
        # maximal coupling: the verification's own test and residual, read past the first rejection
        # (their uniforms were drawn for every lane; each is used once); the lane past the window: fix = p_W
        kept = torch.cat([passed, torch.zeros_like(passed[:, :1])], 1)
        return torch.where(kept, torch.cat([tok, fix[:, -1:]], 1), fix), p      # q := p, kept or not
