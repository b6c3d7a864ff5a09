"""Sampling shared by every engine: CFG, the filtered target distribution, per-prompt random streams.

Vanilla decoding and speculative verification call the same `filtered_probs`, so "lossless" means
exactly "the distribution vanilla samples from". Each prompt draws its uniforms from its own PCG64
stream seeded by `prompt_seed(global_seed, prompt_id)`: an image does not depend on batch size,
actor count or order, and can be regenerated alone.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class SamplingParams:
    cfg_scale: float = 1.0
    temperature: float = 1.0   # 0 = greedy
    top_k: int = 0             # 0 = off
    top_p: float = 1.0         # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"engine.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"engine.top_k={self.top_k}: must be >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"engine.top_p={self.top_p}: must be in (0, 1]")
        if self.cfg_scale < 0:
            raise ValueError(f"engine.cfg_scale={self.cfg_scale}: must be >= 0")

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0


def prompt_seed(global_seed: int, prompt_id: str) -> int:
    digest = hashlib.blake2b(f"{global_seed}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def rngs(seeds) -> list[np.random.Generator]:
    return [np.random.Generator(np.random.PCG64(int(s))) for s in seeds]


def cfg_combine(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Rows are [cond; uncond] when CFG is on: uncond + (cond - uncond) * scale."""
    if not p.use_cfg:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + (cond - uncond) * p.cfg_scale


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """CFG-combined logits [..., V] -> the distribution to sample from (temperature, top-k, top-p)."""
    logits = logits.float()
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cum - sorted_logits.softmax(-1) > p.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample_from(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from an (unnormalised) probability vector with a uniform u in [0, 1)."""
    c = np.cumsum(probs)
    return int(min(np.searchsorted(c, u * c[-1], side="right"), len(c) - 1))
