"""MAR sampling (`mar`, the continuous baseline): `num_iter` AR steps over a random order, each revealing the
next tokens of MAR's cosine schedule; a step is one target transformer forward over the known tokens and
one run of the diffusion head for the tokens it reveals (docs/design.md, "Continuous engines").

What every continuous engine shares lives here too: the schedule, the per-image random order, and the
noise, drawn by absolute token position (x_T, and ε for each diffusion step), so that any two models, or
any two engines, sampling a token at the same position follow aligned trajectories.

Continuous batching (scheduler.py): a row takes a new prompt as soon as its image is done. Rows admitted
together stay in step (every image takes the same steps), so a step runs one group per distinct number
of revealed tokens, each group exactly as a batch of those rows alone would; free rows are not computed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from decoding.engines.base import EngineConfig
from decoding.engines.log import TokenLog
from decoding.engines.scheduler import SlotEngine
from decoding.models.diffloss import HeadSample
from decoding.models.mar import MAR
from decoding.sampling import NOISE, Streams

# Second counters of the NOISE purpose: what a normal or uniform is for (decoding/sampling.py, "Purposes").
X_T, EPS, RESAMPLE, ORDER = range(4)
CFG_SCHEDULES = ("linear", "constant")


@dataclass
class MarEngineConfig(EngineConfig):
    name: str = "mar"
    num_iter: int = 64            # AR steps (MAR's demo 64, its evaluation 256 = one token per step on 16x16)
    cfg_schedule: str = "linear"  # linear: 1 + (cfg - 1) * revealed / N (MAR's evaluation, after Muse) | constant

    def validate(self) -> None:
        super().validate()
        if self.num_iter < 1:
            raise ValueError(f"engine.num_iter={self.num_iter}: must be >= 1")
        if self.cfg_schedule not in CFG_SCHEDULES:
            raise ValueError(f"engine.cfg_schedule={self.cfg_schedule!r}: choose one of {', '.join(CFG_SCHEDULES)}")
        for k, off in (("top_k", 0), ("top_p", 1.0)):
            v = getattr(self.sampling, k)
            if v is not None and v != off:
                raise ValueError(f"engine.sampling.{k}={v}: continuous tokens have no {k} (only cfg_scale and "
                                 f"temperature apply): leave it unset")


def mar_schedule(N: int, num_iter: int, cfg: float, cfg_schedule: str) -> list[tuple[int, float]]:
    """(tokens revealed, guidance scale) for each of the `num_iter` steps, as MAR's sample_tokens computes
    them: mask_len = floor(N cos(π/2 (k+1)/K)), at least 1 and at most (still masked - 1); the last step
    reveals what is left. The linear CFG scale uses that clamped mask_len."""
    out, masked = [], N
    for k in range(num_iter):
        mask_len = max(1, min(masked - 1, math.floor(N * math.cos(math.pi / 2 * (k + 1) / num_iter))))
        n = masked if k == num_iter - 1 else masked - mask_len
        scale = 1 + (cfg - 1) * (N - mask_len) / N if cfg_schedule == "linear" else cfg
        out.append((n, scale))
        masked -= n
    return out


@dataclass
class ContinuousState:
    """A continuous batch (never regrouped: free rows are not computed): the log (its `latents` [slots,
    N, C] hold the token vectors), the per-prompt streams, each row's random order [slots, N], and the
    condition slots of each model that runs, {name: [R, buffer_size, D]} (R = 2 slots with CFG)."""
    slots: int
    log: TokenLog
    streams: Streams
    order: torch.Tensor
    buffers: dict


class ContinuousEngine(SlotEngine):
    """Base of the engines over a MarBundle: settings, schedule, noise, one target step of a group of
    rows, the slot calls. Subclasses implement `step_group(state, rows, done)`: advance rows [g], which
    have revealed `done` tokens each, by one of their steps."""
    Config: ClassVar[type] = MarEngineConfig
    regroups: ClassVar[bool] = False       # free rows cost nothing: only busy rows are computed

    @classmethod
    def fits(cls, cfg: MarEngineConfig, seq_len: int) -> None:
        if cfg.num_iter > seq_len:
            raise ValueError(f"engine.num_iter={cfg.num_iter}: more AR steps than the model's {seq_len} tokens; "
                             f"set engine.num_iter to at most {seq_len}")

    def __init__(self, bundle, cfg: MarEngineConfig):
        self.check(cfg, getattr(bundle, "draft", None) is not None)
        if getattr(bundle, "tokens", "discrete") != "continuous":   # (build_engine says it first: check_tokens)
            raise ValueError(f"engine {self.name!r} samples continuous tokens and model {bundle.name!r} is discrete: "
                             f"use model=mar (the continuous shapes models, or MAR checkpoints)")
        self.bundle, self.cfg = bundle, cfg
        self.sampling = cfg.sampling.over(bundle.sampling)
        self.mar: MAR = bundle.mar
        a = self.mar.args
        self.N, self.C, self.G = a.seq_len, a.token_dim, a.seq_h
        self.fits(cfg, self.N)
        self.device = self.mar.fake_latent.device
        self.plan = mar_schedule(self.N, cfg.num_iter, self.sampling.cfg_scale, cfg.cfg_schedule)
        self.step_at = {}                                  # tokens revealed before step k -> k
        for k, (n, _) in enumerate(self.plan):
            self.step_at[sum(m for m, _ in self.plan[:k])] = k
        self.models = {"target": self.mar}                 # the models whose condition slots a row keeps

    # -- randomness, by absolute token position ----------------------------------------------------------
    def order(self, streams: Streams) -> torch.Tensor:
        """[B, N]: each image's random generation order (tokens order[:, :k] are known after k reveals)."""
        u = streams.uniform(NOISE, ORDER, torch.arange(self.N, device=self.device)[None])
        return u.argsort(dim=1, stable=True)

    def noise(self, streams: Streams, pos: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """pos [B, n] -> x_T [B, n, C] and ε [B, n, S, C] of those positions."""
        d = torch.arange(self.C, device=self.device)
        x_T = streams.normal(NOISE, X_T, pos[..., None], d)
        eps = streams.normal(NOISE, EPS, pos[..., None, None], torch.arange(steps, device=self.device)[:, None], d)
        return x_T, eps

    def final_noise(self, streams: Streams, pos: torch.Tensor) -> torch.Tensor:
        """pos [B, n] -> ε_0 [B, n, C]: the noise of diffusion step 0 at those positions (= `noise`'s ε[:, :, 0]),
        which the sampler does not use (its last step adds none); cspd's draft proposes μ_q0 + σ_q0 ε_0."""
        return streams.normal(NOISE, EPS, pos[..., None], 0, torch.arange(self.C, device=self.device))

    # -- one model step ----------------------------------------------------------------------------------
    def buffer(self, model: MAR, cond) -> torch.Tensor:
        """Condition slots for the rows: [cond; uncond] under CFG."""
        B = len(cond)
        rows = lambda x: None if x is None else self.rows(x)  # noqa: E731
        drop = torch.arange(2 * B if self.sampling.use_cfg else B, device=self.device) >= B
        return model.buffer(labels=rows(cond.labels), features=rows(cond.features), mask=rows(cond.mask), drop=drop)

    def features(self, model: MAR, tokens: torch.Tensor, known: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """The decoder's conditions z [R, N, Dd] given tokens [B, N, C] and known positions [B, k]."""
        return model.forward_z(self.rows(tokens), self.rows(known.sort(1).values), buffer)

    def head(self, model: MAR, z: torch.Tensor, pos: torch.Tensor, scale: torch.Tensor, streams: Streams) -> HeadSample:
        """Sample the tokens at pos [B, n] from z [R, N, Dd] with the aligned noise; scale [B, n] is the
        guidance scale per token. Returns a HeadSample of [B, n, C] tensors."""
        B, n = pos.shape
        S = model.diffloss.num_sampling_steps
        x_T, eps = self.noise(streams, pos, S)
        idx = self.rows(pos)[..., None].expand(-1, -1, z.shape[-1])
        zs = z.gather(1, idx)
        zs = torch.cat([zs[:B].flatten(0, 1), zs[B:].flatten(0, 1)]) if self.sampling.use_cfg else zs.flatten(0, 1)
        s = model.diffloss.sample(zs, x_T.flatten(0, 1), eps.flatten(0, 1), self.sampling.temperature,
                                  scale.flatten() if self.sampling.use_cfg else None)
        return HeadSample(*(t.reshape(B, n, self.C) for t in (s.x, s.sigma0, s.log_sigma_sum)))

    def scales(self, steps, B: int) -> torch.Tensor:
        """[B, n]: each token's guidance scale, from the step that reveals it."""
        return torch.tensor([s for k in steps for s in [self.plan[k][1]] * self.plan[k][0]],
                            device=self.device).expand(B, -1)

    def target_step(self, st: ContinuousState, g: torch.Tensor, done: int) -> None:
        """The target alone reveals the tokens of rows g's next step (`done` revealed before it)."""
        log, C, k = st.log, self.C, self.step_at[done]
        n = self.plan[k][0]
        order, tokens = st.order[g], log.latents[g]
        pos = order[:, done:done + n]
        with log.phase("target_transformer"):
            z = self.features(self.mar, tokens, order[:, :done], st.buffers["target"][self.cache_rows(g, st.slots)])
        with log.phase("target_diffusion"):
            s = self.head(self.mar, z, pos, self.scales([k], len(g)), st.streams.select(g))
        log.latents[g] = tokens.scatter_(1, pos[..., None].expand(-1, -1, C), s.x)
        log.commit(torch.full((len(g),), n, device=self.device), rows=g, cell=pos, step=k, accept_len=n)
        log.target_forwards[g] += 1

    # -- the slot calls (scheduler.py) ---------------------------------------------------------------------
    def start(self, slots: int) -> ContinuousState:
        log = TokenLog(slots, self.N, self.G, self.device)
        log.n[:] = self.N                                             # empty slots are finished rows
        log.latents = torch.zeros(slots, self.N, self.C, device=self.device)
        return ContinuousState(slots, log, Streams([0] * slots, self.device),
                               torch.zeros(slots, self.N, dtype=torch.long, device=self.device), {})

    def admit(self, st: ContinuousState, rows: torch.Tensor, cond, seeds: list) -> None:
        for name, model in self.models.items():      # first: a prompt the model cannot take fails here
            b = self.buffer(model, cond)
            if name not in st.buffers:
                R = 2 * st.slots if self.sampling.use_cfg else st.slots
                st.buffers[name] = b.new_zeros((R,) + b.shape[1:])
            st.buffers[name][self.cache_rows(rows, st.slots)] = b
        st.log.reset(rows)
        st.log.latents[rows] = 0
        st.streams.reseed(rows, seeds)
        st.order[rows] = self.order(st.streams.select(rows))

    def step(self, st: ContinuousState) -> None:
        """One step of every busy row: a group per number of tokens revealed."""
        groups: dict[int, list] = {}
        for b, n in enumerate(st.log.n.tolist()):
            if n < self.N:
                groups.setdefault(n, []).append(b)
        for done, g in groups.items():
            self.step_group(st, torch.tensor(g, device=self.device), done)

    def step_group(self, st: ContinuousState, g: torch.Tensor, done: int) -> None:
        raise NotImplementedError

    def row_tokens(self, st: ContinuousState, b: int) -> torch.Tensor:
        return st.log.latents[b].float().cpu().clone()


class Mar(ContinuousEngine):
    name, Config = "mar", MarEngineConfig

    def step_group(self, st, g, done):
        self.target_step(st, g, done)
