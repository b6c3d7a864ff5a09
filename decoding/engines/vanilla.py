"""Vanilla AR decoding: one target forward per token, batched over prompts. The baseline every
speedup is measured against, and the distribution the lossless engines must reproduce."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from decoding.engines.base import CachedModel, EngineConfig, parked, visible
from decoding.engines.log import TokenLog
from decoding.engines.scheduler import SlotEngine
from decoding.engines.state import BatchState, per_slot
from decoding.engines.verify import draws
from decoding.sampling import Streams, sample


@dataclass
class VanillaConfig(EngineConfig):
    name: str = "vanilla"


@dataclass
class VanillaState(BatchState):
    probs: torch.Tensor | None = per_slot(default=None)   # [slots, V] each row's next-token distribution


class Vanilla(SlotEngine):
    name, Config = "vanilla", VanillaConfig

    def start(self, slots: int):
        R = 2 * slots if self.sampling.use_cfg else slots
        log = TokenLog(slots, self.N, self.G, self.device)
        log.n[:] = self.N                                             # empty slots are finished rows
        streams = Streams([0] * slots, self.device)
        return VanillaState(slots, log, streams, draws(streams, self.N),
                            CachedModel(self.gpt, R, self.L + self.N, self.bundle.dtype))

    def admit(self, st, rows, cond, seeds):
        st.log.reset(rows)
        st.streams.reseed(rows, seeds)
        st.keys[rows] = draws(st.streams, self.N)[rows]
        feats, _ = self.prefill(st.target, cond, rows, st.slots)
        p = self.target_probs(feats[:, -1])                           # [k, V]
        if st.probs is None:
            st.probs = torch.zeros(st.slots, p.shape[-1], device=self.device)
        st.probs[rows] = p
        self._sample(st, rows)

    def _sample(self, st, rows=None):
        """Draw and commit the next token of rows (default: every unfinished row) from st.probs."""
        log = st.log
        active = log.n < self.N if rows is None else torch.zeros_like(log.n, dtype=torch.bool).index_fill(0, rows, True)
        x = sample(st.probs, st.keys.gather(1, log.n.clamp(max=self.N - 1)[:, None])[:, 0])
        count = active.long()
        log.commit(count, token_id=x, p_target=st.probs.gather(1, x[:, None])[:, 0], step=log.n, accept_len=1)
        log.target_forwards += count

    def step(self, st):
        log, L = st.log, self.L
        with log.phase("forward"):
            last = L + log.n.clamp(max=self.N)[:, None] - 1                     # the last token's position
            live = log.n < self.N
            pos, slot = self.rows(last), self.rows(parked(last, live))
            x = log.tokens.gather(1, (log.n - 1).clamp(0, self.N - 1)[:, None]).clamp(min=0)
            f = self.gpt.forward_embeds(self.gpt.embed_tokens(self.rows(x)), pos, visible(st.target.valid, slot[..., None]), slot)
            st.target.commit(slot, self.rows(live)[:, None])
            st.probs = self.target_probs(f[:, 0])
        self._sample(st)
