"""What every discrete engine shares: the result type, the per-token log, and a cached model whose
rows each keep their own visible slots (so speculative steps can run batched with per-row lengths).

Rows: with CFG a batch of B prompts runs as 2B rows, [cond; uncond]; per-prompt tensors are repeated
for the uncond half by `Engine.rows`. Logical positions: condition tokens 0..L-1, image token i at L+i.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from decoding.bundle import Conditions, ModelBundle
from decoding.models.gpt import causal_mask
from decoding.sampling import SamplingParams, cfg_combine, filtered_probs, rngs

RECORD_COLUMNS = ("token_id", "step", "accepted", "accept_len", "p_target", "q_draft", "tree_depth", "tree_width")


@dataclass
class ImageResult:
    tokens: np.ndarray            # [N] code indices, raster order
    image: np.ndarray             # uint8 [H, W, 3]
    records: dict                 # column -> [N] array, in generation order (= raster order)
    target_forwards: int
    draft_forwards: int
    wall_s: float                 # the batch's engine wall time / batch size
    unknown_words: int = 0
    phase_s: dict = field(default_factory=dict)  # the batch's seconds per step phase / batch size

    @property
    def mean_accept_len(self) -> float:
        """τ: tokens committed per target forward."""
        return len(self.tokens) / max(self.target_forwards, 1)


class TokenLog:
    """Per-prompt token records, filled as tokens are committed, and the batch's time per step phase."""

    def __init__(self, B: int, N: int):
        self.phase_s: dict[str, float] = {}
        self.tokens = np.zeros((B, N), np.int64)
        self.cols = {c: np.zeros((B, N), np.int64) for c in ("step", "accept_len", "tree_depth", "tree_width")}
        self.cols["accepted"] = np.zeros((B, N), bool)
        self.cols["p_target"] = np.full((B, N), np.nan, np.float32)
        self.cols["q_draft"] = np.full((B, N), np.nan, np.float32)
        self.n = np.zeros(B, np.int64)          # committed tokens per prompt
        self.target_forwards = np.zeros(B, np.int64)
        self.draft_forwards = np.zeros(B, np.int64)

    def commit(self, b: int, tokens, step: int, accepted, p_target, q_draft=None, depth: int = 0, width: int = 0):
        i, k = self.n[b], len(tokens)
        s = slice(i, i + k)
        self.tokens[b, s] = tokens
        self.cols["step"][b, s], self.cols["accept_len"][b, s] = step, k
        self.cols["tree_depth"][b, s], self.cols["tree_width"][b, s] = depth, width
        self.cols["accepted"][b, s] = accepted
        self.cols["p_target"][b, s] = p_target
        if q_draft is not None:
            self.cols["q_draft"][b, s] = q_draft
        self.n[b] += k

    @contextmanager
    def phase(self, name: str):
        """Time one phase of a decoding step (draft, verify, ...): the bench reports ms per step."""
        t0 = time.perf_counter()
        yield
        self.phase_s[name] = self.phase_s.get(name, 0.0) + time.perf_counter() - t0

    def records(self, b: int) -> dict:
        return {"token_id": self.tokens[b].copy(), **{c: v[b].copy() for c, v in self.cols.items()}}


def visible(valid: torch.Tensor, see: torch.Tensor) -> torch.Tensor:
    """Attention mask [R, T, S']: committed slots `valid` [R, S] plus, per query, the slots `see` [R, T, K]
    (its uncommitted ancestors and itself). Committed slots all lie below the slots being written, so
    the mask stops at S' = max(see) + 1 and attention reads only that prefix of the cache."""
    width = int(see.max()) + 1
    mask = valid[:, None, :width].repeat(1, see.shape[1], 1)
    return mask.scatter_(2, see, True)


class CachedModel:
    """A model with a static KV cache over R rows and, per row, the set of committed (visible) slots."""

    def __init__(self, model, rows: int, seq_len: int, dtype):
        self.model = model
        if model.rope.device.type == "cpu":  # bf16 attention on a CPU is ~10x slower than fp32 at one
            dtype = torch.float32             # query per row (bench: forward_costs); K/V are tiny anyway
        key = (rows, seq_len, dtype)
        if getattr(model, "_cache_key", None) != key:  # reuse buffers between batches of one shape
            model.setup_caches(rows, seq_len, dtype)
            model._cache_key = key
        self.valid = torch.zeros(rows, seq_len, dtype=torch.bool, device=model.rope.device)

    def commit(self, slots: torch.Tensor, keep: torch.Tensor | None = None):
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
        self.valid[rows, slots] = True if keep is None else (keep | self.valid[rows, slots])

    def move(self, src: torch.Tensor, dst: torch.Tensor):
        for cache in self.model.caches():
            cache.move(src, dst)


class Engine:
    """`generate(conditions, seeds) -> [ImageResult]`, one per prompt, for a bundle and sampling params."""
    name = "base"
    uses_drafter = False

    def __init__(self, bundle: ModelBundle, sampling: SamplingParams):
        self.bundle, self.sampling = bundle, sampling
        self.gpt = bundle.gpt
        a = self.gpt.args
        self.L, self.N, self.G = a.cls_token_num, a.block_size, a.grid_size
        if self.uses_drafter and bundle.drafter is None:
            raise ValueError(f"engine {self.name!r} needs a drafter, and model {bundle.name!r} has none: "
                             f"train one (python -m workflows.train stages=[drafter]) or use engine=vanilla")

    # -- helpers shared by engines --------------------------------------------------------------------
    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.sampling.use_cfg else x

    def target_probs(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [R, ..., dim] -> filtered distribution [B, ..., V] (CFG, temperature, top-k/p)."""
        return filtered_probs(cfg_combine(self.gpt.logits(features), self.sampling), self.sampling)

    def prefill(self, target: CachedModel, cond: Conditions):
        """Run the condition prefix. Returns (features [R, L, dim], condition embeddings [R, L, dim])."""
        B = len(cond.features)
        drop = torch.arange(len(self.rows(cond.features)), device=target.valid.device) >= B
        emb = self.gpt.embed_condition(self.rows(cond.features), drop)
        mask = None if cond.mask is None else self.rows(cond.mask)
        R = emb.shape[0]
        pos = torch.arange(self.L, device=emb.device).expand(R, self.L)
        feats = self.gpt.forward_embeds(emb, pos, self._prefix_mask(target, mask, R), pos)
        target.valid[:, : self.L] = True if mask is None else mask
        return feats, emb

    def _prefix_mask(self, target: CachedModel, mask, R: int) -> torch.Tensor:
        m = causal_mask(self.L, mask, target.valid.device).expand(R, -1, -1)
        full = torch.zeros(R, self.L, target.valid.shape[1], dtype=torch.bool, device=m.device)
        full[:, :, : self.L] = m
        return full

    # -- the contract ---------------------------------------------------------------------------------
    def generate(self, cond: Conditions, seeds) -> list[ImageResult]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            log = self._generate(cond, rngs(seeds))
            images = self.bundle.decode(torch.from_numpy(log.tokens))
        wall = (time.perf_counter() - t0) / len(seeds)
        unknown = cond.unknown_words or [0] * len(seeds)
        phases = {k: v / len(seeds) for k, v in log.phase_s.items()}
        return [ImageResult(log.tokens[b].copy(), images[b], log.records(b), int(log.target_forwards[b]),
                            int(log.draft_forwards[b]), wall, int(unknown[b]), phases) for b in range(len(seeds))]

    def _generate(self, cond: Conditions, gens: list[np.random.Generator]) -> TokenLog:
        raise NotImplementedError
