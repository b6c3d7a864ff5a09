"""Vanilla AR decoding: one target forward per token, batched over prompts. The baseline every
speedup is measured against, and the distribution the lossless engines must reproduce."""
from __future__ import annotations

import torch

from decoding.engines.base import CachedModel, Engine, TokenLog, visible
from decoding.sampling import sample_from


class Vanilla(Engine):
    name = "vanilla"

    def _generate(self, cond, gens):
        B, L, N = len(gens), self.L, self.N
        R = 2 * B if self.sampling.use_cfg else B
        target = CachedModel(self.gpt, R, L + N, self.bundle.dtype)
        log = TokenLog(B, N)
        feats, _ = self.prefill(target, cond)
        probs = self.target_probs(feats[:, -1])
        see = torch.zeros(R, 1, 1, dtype=torch.long, device=feats.device)
        for i in range(N):
            p = probs.double().cpu().numpy()
            for b in range(B):
                x = sample_from(p[b], gens[b].random())
                log.commit(b, [x], step=i, accepted=False, p_target=p[b, x])
            log.target_forwards += 1
            if i == N - 1:
                break
            with log.phase("forward"):
                x = torch.from_numpy(log.tokens[:, i]).to(feats.device)
                slots = see[:, :, 0] + L + i
                f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(x))[:, None], slots,
                                            visible(target.valid, see + L + i), slots)
                target.commit(slots)
                probs = self.target_probs(f[:, 0])
        return log

