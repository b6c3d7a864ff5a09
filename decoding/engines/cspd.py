"""Continuous speculative decoding (`cspd`, CSpD: MarkXCloud/CSpD; docs/design.md "Continuous engines").

After `prefill_ratio * num_iter` target steps (the first tokens, where a draft is weakest), a smaller MAR
drafts windows of `num_draft` AR steps on the same schedule and order; the target then runs once on the
tokens committed before the window (the pre-window mask) and samples every token of the window with the
same noise the draft used at that position (trajectory alignment), which gives its μ_p0, σ_p0 and L_p.
The draft proposes x = μ_q0 + σ_q0 ε_0, a draw of its final Gaussian. Each draft token is accepted or not
on its own (decoding/engines/continuous.py): accepted tokens keep the draft's value, rejected ones are redrawn from the residual, later tokens of the window are not discarded
(they stay conditioned on the draft's value, as in the reference). When the residual sampler fails
`max_tries` times the token takes the target's own aligned sample μ_p0: counted in the `fallback` column
of the tokens table and logged.

A window costs `num_draft` draft steps and one target step over all its tokens, against `num_draft`
target steps for `mar` at the same `num_iter`; with draft == target every token is accepted and the image
is `mar`'s up to the proposals' σ_0 ε_0 (σ_0 ≈ 0.006).

Exactness: with `lam=1` and `trajectory_terms=false` every token is an exact draw of the target's final
Gaussian N(μ_p0, σ_p0²) on its aligned trajectory, i.e. `mar`'s token plus σ_p0 ε (MAR's distribution,
blurred by its own last-step σ), with the target conditioned on the tokens before the window (each
window's steps merged into one target step). The defaults (λ = 42, trajectory terms on, as the reference)
are relaxed: `acceptance` says which.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from decoding.engines.continuous import log_accept_ratio, residual_sample
from decoding.engines.log import Proposer
from decoding.engines.mar import RESAMPLE, ContinuousEngine, MarEngineConfig
from decoding.sampling import ACCEPT, NOISE

log_ = logging.getLogger("arspec.cspd")
TRIAL = 0  # second counter of ACCEPT draws: the acceptance test (RESAMPLE: the residual sampler's tries)


@dataclass
class CSpDConfig(MarEngineConfig):
    name: str = "cspd"
    num_draft: int = 16           # draft AR steps per window (reference 8): the best measured, docs/design.md
    prefill_ratio: float = 0.05   # the first ceil(ratio * num_iter) steps are the target's (reference 0.15; demo 0.05)
    lam: float = 42.0             # λ: widens both Gaussians of the acceptance test (reference 42); 1 = no widening
    max_tries: int = 100          # residual acceptance-rejection tries per rejected token (reference 100)
    trajectory_terms: bool = True  # the reference's Σ(L_p − L_q) in the test (and c in the residual): relaxed

    def validate(self) -> None:
        super().validate()
        if self.num_draft < 1:
            raise ValueError(f"engine.num_draft={self.num_draft}: must be >= 1")
        if not 0 <= self.prefill_ratio <= 1:
            raise ValueError(f"engine.prefill_ratio={self.prefill_ratio}: must be in [0, 1]")
        if not self.lam > 0:
            raise ValueError(f"engine.lam={self.lam}: must be > 0 (1 = the plain density ratio)")
        if self.max_tries < 1:
            raise ValueError(f"engine.max_tries={self.max_tries}: must be >= 1")


NO_DRAFT = ("engine cspd needs a draft MAR and the model has none: train one (python -m workflows.train "
            "stages=[mar_draft]), set model.draft_mar_ckpt, or use engine=mar")


class CSpD(ContinuousEngine):
    name, Config = "cspd", CSpDConfig

    @classmethod
    def check(cls, cfg: CSpDConfig, has_drafter: bool) -> None:
        super().check(cfg, True)
        if not has_drafter:
            raise ValueError(NO_DRAFT)

    def __init__(self, bundle, cfg: CSpDConfig):
        super().__init__(bundle, cfg)                      # (check: a draft MAR, or NO_DRAFT)
        self.draft = bundle.draft
        self.models["draft"] = self.draft
        K = cfg.num_iter
        self.prefill = min(K, math.ceil(cfg.prefill_ratio * K - 1e-9))
        self.windows = [list(range(s, min(s + cfg.num_draft, K))) for s in range(self.prefill, K, cfg.num_draft)]

    @property
    def acceptance(self) -> str:
        """'exact' at λ = 1 without the trajectory terms (the density ratio of the final Gaussians), else the
        relaxation: cspd(lam=…) (with the reference's trajectory terms) or cspd(lam=…, no trajectory terms)."""
        if self.cfg.lam == 1 and not self.cfg.trajectory_terms:
            return "exact"
        return f"cspd(lam={self.cfg.lam:g}{'' if self.cfg.trajectory_terms else ', no trajectory terms'})"

    def step_group(self, st, g, done):
        """A target step for rows g in the prefill, else their window: num_draft draft steps, one target
        step over the window's tokens with the pre-window mask, and the acceptance test of each token."""
        k = self.step_at[done]
        if k < self.prefill:
            return self.target_step(st, g, done)
        window = self.windows[(k - self.prefill) // self.cfg.num_draft]
        log, C, streams, B = st.log, self.C, st.streams.select(g), len(g)
        order, tokens, counts = st.order[g], log.latents[g], [n for n, _ in self.plan]
        buf_p, buf_q = (st.buffers[m][self.cache_rows(g, st.slots)] for m in ("target", "draft"))
        q, xs, end = self._draft_window(tokens, order, done, window, buf_q, streams, log)
        pos = order[:, done:end]                                         # [B, m]: the window's tokens
        with log.phase("target_transformer"):                           # one target step, pre-window mask
            z = self.features(self.mar, tokens, order[:, :done], buf_p)
        with log.phase("target_diffusion"):
            p = self.head(self.mar, z, pos, self.scales(window, B), streams)
        with log.phase("accept"):
            x, log_r, accepted, fell_back = self.verify(q, torch.cat(xs, 1), p, pos, streams)
            log.latents[g] = tokens.scatter_(1, pos[..., None].expand(-1, -1, C), x)
            m = end - done
            step = torch.tensor([k for k in window for _ in range(counts[k])], device=self.device).expand(B, -1)
            log.commit(torch.full((B,), m, device=self.device), rows=g, cell=pos, step=step, accepted=accepted,
                       accept_len=m, proposer=Proposer.DRAFT_MODEL, log_accept_ratio=log_r,
                       window_pos=step - window[0], fallback=fell_back)
        log.target_forwards[g] += 1
        log.draft_forwards[g] += len(window)

    def result(self, st, b, row, images=True):
        res = super().result(st, b, row, images)
        fell = int(res.records["fallback"].sum())
        if fell:
            log_.warning(f"cspd: the residual sampler failed {self.cfg.max_tries} tries for {fell} of {self.N} "
                         f"tokens of an image (seed {row.req.seed}); they took the target's own aligned sample "
                         f"(tokens table: fallback)")
        return res

    def _draft_window(self, tokens, order, done: int, window: list, buf_q, streams, log):
        """The draft's num_draft AR steps of a window from `done` committed tokens: (its HeadSamples, the
        proposals drawn from their final Gaussians [B, n_k, C] each, the window's end)."""
        B, C, counts = len(streams), self.C, [n for n, _ in self.plan]
        drafted, q, xs, end = tokens.clone(), [], [], done
        for k in window:
            pos = order[:, end:end + counts[k]]
            with log.phase("draft_transformer"):
                z = self.features(self.draft, drafted, order[:, :end], buf_q)
            with log.phase("draft_diffusion"):
                q.append(self.head(self.draft, z, pos, self.scales([k], B), streams))
                xs.append(q[-1].x + q[-1].sigma0 * self.final_noise(streams, pos))   # a draw of q's final Gaussian
            drafted.scatter_(1, pos[..., None].expand(-1, -1, C), xs[-1])
            end += counts[k]
        return q, xs, end

    def verify(self, q: list, x: torch.Tensor, p, pos: torch.Tensor, streams):
        """q: the window's draft HeadSamples (one per step, [B, n_k, C]), x [B, m, C] its proposals, p: the
        target's [B, m, C] over the same positions pos [B, m].
        -> (tokens [B, m, C], log r [B, m], accepted [B, m], fallback [B, m])."""
        mu_q, sig_q, L_q = (torch.cat(t, 1) for t in zip(*((s.x, s.sigma0, s.log_sigma_sum) for s in q)))
        tau = float(self.cfg.trajectory_terms)
        log_r = log_accept_ratio(x, mu_q, sig_q, L_q, p.x, p.sigma0, p.log_sigma_sum, self.cfg.lam, tau)
        accepted = torch.log(streams.uniform(ACCEPT, TRIAL, pos)) < log_r
        T, d = self.cfg.max_tries, torch.arange(self.C, device=self.device)
        tries = torch.arange(T, device=self.device)
        normals = streams.normal(NOISE, RESAMPLE, pos[..., None, None], tries[:, None], d)     # [B, m, T, C]
        uniforms = streams.uniform(ACCEPT, RESAMPLE, pos[..., None], tries)                   # [B, m, T]
        log_c = tau * (L_q - p.log_sigma_sum).sum(-1)
        redraw, ok = residual_sample(p.x, p.sigma0, mu_q, sig_q, log_c, normals, uniforms)
        out = torch.where(accepted[..., None], x, redraw)
        return out, log_r, accepted, ~accepted & ~ok
