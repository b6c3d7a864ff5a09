"""MAR sampling (`mar`, the continuous baseline): `num_iter` AR steps over a random order, each revealing the
next tokens of MAR's cosine schedule; a step is one target transformer forward over the known tokens and
one run of the diffusion head for the tokens it reveals (docs/design.md, "Continuous engines").

What every continuous engine shares lives here too: the schedule, the per-image random order, and the
noise, drawn by absolute token position (x_T, and ε for each diffusion step), so that any two models, or
any two engines, sampling a token at the same position follow aligned trajectories.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import ClassVar

import torch

from decoding.engines.base import Engine, EngineConfig, ImageResult
from decoding.engines.log import TokenLog
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


class ContinuousEngine(Engine):
    """Base of the engines over a MarBundle: settings, schedule, noise, one target/draft step, the result.
    Subclasses implement `_generate(cond, streams) -> TokenLog` (the Engine contract) and leave the
    token vectors [B, N, C] in `log.latents`; `generate` decodes them with the bundle's VAE."""
    Config: ClassVar[type] = MarEngineConfig

    def __init__(self, bundle, cfg: MarEngineConfig):
        if type(cfg) is not self.Config:
            raise ValueError(f"engine.name={cfg.name!r} does not match the {type(cfg).__name__} settings: "
                             f"choose the engine with engine={cfg.name}, not engine.name=")
        cfg.validate()
        if getattr(bundle, "tokens", "discrete") != "continuous":   # (build_engine says it first: check_tokens)
            raise ValueError(f"engine {self.name!r} samples continuous tokens and model {bundle.name!r} is discrete: "
                             f"use model=mar (the continuous shapes models, or MAR checkpoints)")
        self.bundle, self.cfg = bundle, cfg
        self.sampling = cfg.sampling.over(bundle.sampling)
        self.mar: MAR = bundle.mar
        a = self.mar.args
        self.N, self.C, self.G = a.seq_len, a.token_dim, a.seq_h
        if cfg.num_iter > self.N:
            raise ValueError(f"engine.num_iter={cfg.num_iter}: more AR steps than the model's {self.N} tokens")
        self.device = self.mar.fake_latent.device
        self.plan = mar_schedule(self.N, cfg.num_iter, self.sampling.cfg_scale, cfg.cfg_schedule)

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

    # -- the contract ------------------------------------------------------------------------------------
    def generate(self, cond, seeds, images: bool = True) -> list[ImageResult]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            log = self._generate(cond, Streams(seeds, self.device))
            pixels = self.bundle.decode(log.latents) if images else [None] * len(seeds)
        tokens = log.latents.float().cpu().numpy()
        B = len(seeds)
        wall = (time.perf_counter() - t0) / B
        unknown = cond.unknown_words or [0] * B
        phases = {k: v / B for k, v in log.phase_s.items()}
        tf, df = log.target_forwards.tolist(), log.draft_forwards.tolist()
        return [ImageResult(tokens[b], pixels[b], log.records(b), tf[b], df[b], wall, phases, int(unknown[b]), B)
                for b in range(B)]


class Mar(ContinuousEngine):
    name, Config = "mar", MarEngineConfig

    def _generate(self, cond, streams):
        B, N, dev = len(streams), self.N, self.device
        log = TokenLog(B, N, self.G, dev)
        order = self.order(streams)
        tokens = torch.zeros(B, N, self.C, device=dev)
        buffer = self.buffer(self.mar, cond)
        done = 0
        for k, (n, _) in enumerate(self.plan):
            pos = order[:, done:done + n]
            with log.phase("target_transformer"):
                z = self.features(self.mar, tokens, order[:, :done], buffer)
            with log.phase("target_diffusion"):
                s = self.head(self.mar, z, pos, self.scales([k], B), streams)
            tokens.scatter_(1, pos[..., None].expand(-1, -1, self.C), s.x)
            log.commit(torch.full((B,), n, device=dev), cell=pos, step=k, accept_len=n)
            done += n
        log.target_forwards[:] = len(self.plan)
        log.latents = tokens
        return log
