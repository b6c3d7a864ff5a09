"""Vanilla AR decoding: one target forward per token, batched over prompts. The baseline every
speedup is measured against, and the distribution the lossless engines must reproduce."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.engines.base import CachedModel, Engine, EngineConfig, visible
from decoding.engines.log import TokenLog
from decoding.sampling import SAMPLE, sample


@dataclass
class VanillaConfig(EngineConfig):
    name: str = "vanilla"


class Vanilla(Engine):
    name, Config = "vanilla", VanillaConfig

    def _generate(self, cond, streams):
        B, L, N, dev = len(streams), self.L, self.N, self.device
        R = 2 * B if self.sampling.use_cfg else B
        target = CachedModel(self.gpt, R, L + N, self.bundle.dtype)
        log = TokenLog(B, N, self.G, dev)
        u = streams.uniform(SAMPLE, torch.arange(N, device=dev)[None])      # [B, N]: token i draws u[:, i]
        tokens, p_target = log.col("token_id"), log.col("p_target")   # every row writes column i at step i
        log.col("step")[:, :N] = torch.arange(N, device=dev)
        log.col("accept_len")[:, :N] = 1
        feats, _ = self.prefill(target, cond)
        probs = self.target_probs(feats[:, -1])
        see = torch.zeros(R, 1, 1, dtype=torch.long, device=dev)
        for i in range(N):
            x = sample(probs, u[:, i])
            tokens[:, i], p_target[:, i] = x, probs.gather(1, x[:, None])[:, 0]
            if i == N - 1:
                break
            with log.phase("forward"):
                slots = see[:, :, 0] + L + i
                f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(x))[:, None], slots,
                                            visible(target.valid, see + L + i), slots)
                target.commit(slots)
                probs = self.target_probs(f[:, 0])
        log.n[:], log.target_forwards[:] = N, N
        return log
