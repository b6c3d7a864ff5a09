"""What every engine shares: the config base, the result type, and a cached model whose rows each keep
their own visible slots (so speculative steps can run batched with per-row lengths).

Rows: with CFG a batch of B prompts runs as 2B rows, [cond; uncond]; per-prompt tensors are repeated
for the uncond half by `Engine.rows`. Logical positions: condition tokens 0..L-1, image token i at L+i.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from decoding.bundle import Conditions, ModelBundle
from decoding.engines.log import TokenLog
from decoding.models.gpt import causal_mask
from decoding.sampling import SamplingParams, Streams, cfg_combine, filtered_probs


@dataclass
class EngineConfig:
    """Settings every engine has. Each engine subclasses this with its own settings and defaults: the
    dataclass is the only place a default is written, and the job's Hydra `engine` schema."""
    name: str = "vanilla"
    sampling: SamplingParams = field(default_factory=SamplingParams)

    def validate(self) -> None:
        """Raise ValueError naming the bad setting (called before any model is loaded)."""
        SamplingParams(**vars(self.sampling))


@dataclass
class ImageResult:
    tokens: np.ndarray            # [N] code indices, raster order
    image: np.ndarray             # uint8 [H, W, 3]
    records: dict                 # column -> [N] array in generation order (log.TOKEN_COLUMNS)
    target_forwards: int
    draft_forwards: int
    wall_s: float                 # the batch's engine wall time / batch size
    phase_s: dict = field(default_factory=dict)  # the batch's seconds per step phase / batch size
    unknown_words: int = 0

    @property
    def mean_accept_len(self) -> float:
        """τ: tokens committed per target forward."""
        return len(self.tokens) / max(self.target_forwards, 1)


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
    """`generate(conditions, seeds) -> [ImageResult]`, one per prompt (docs/design.md, "Engines")."""
    name: ClassVar[str] = "base"
    Config: ClassVar[type] = EngineConfig
    uses_drafter: ClassVar[bool] = False

    @classmethod
    def check(cls, cfg: EngineConfig, has_drafter: bool) -> None:
        """Every refusal that needs no weights (the job's driver calls it on checkpoint headers alone)."""
        if type(cfg) is not cls.Config:
            raise ValueError(f"engine.name={cfg.name!r} does not match the {type(cfg).__name__} settings: "
                             f"choose the engine with engine={cfg.name}, not engine.name=")
        cfg.validate()
        if cls.uses_drafter and not has_drafter:
            raise ValueError(f"engine {cls.name!r} needs a drafter, and the model has none: "
                             f"train one (python -m workflows.train stages=[drafter]) or use engine=vanilla")

    def __init__(self, bundle: ModelBundle, cfg: EngineConfig):
        self.check(cfg, bundle.drafter is not None)
        self.bundle, self.cfg = bundle, cfg
        self.sampling = cfg.sampling.over(bundle.sampling)
        self.gpt = bundle.gpt
        a = self.gpt.args
        self.L, self.N, self.G = a.cls_token_num, a.block_size, a.grid_size
        self.device = self.gpt.rope.device

    @property
    def acceptance(self) -> str:
        """How drafts are accepted: 'exact' (the output distribution is vanilla's) or a relaxation."""
        return "exact"

    # -- helpers shared by engines --------------------------------------------------------------------
    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.sampling.use_cfg else x

    def target_probs(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [R, ..., dim] -> filtered distribution [B, ..., V] (CFG, temperature, top-k/p)."""
        return filtered_probs(cfg_combine(self.gpt.logits(features), self.sampling), self.sampling)

    def prefill(self, target: CachedModel, cond: Conditions):
        """Run the condition prefix. Returns (features [R, L, dim], condition embeddings [R, L, dim])."""
        B = len(cond.features)
        drop = torch.arange(len(self.rows(cond.features)), device=self.device) >= B
        emb = self.gpt.embed_condition(self.rows(cond.features), drop)
        mask = None if cond.mask is None else self.rows(cond.mask)
        R = emb.shape[0]
        pos = torch.arange(self.L, device=self.device).expand(R, self.L)
        feats = self.gpt.forward_embeds(emb, pos, self._prefix_mask(target, mask, R), pos)
        target.valid[:, : self.L] = True if mask is None else mask
        return feats, emb

    def _prefix_mask(self, target: CachedModel, mask, R: int) -> torch.Tensor:
        m = causal_mask(self.L, mask, self.device).expand(R, -1, -1)
        full = torch.zeros(R, self.L, target.valid.shape[1], dtype=torch.bool, device=self.device)
        full[:, :, : self.L] = m
        return full

    # -- the contract ---------------------------------------------------------------------------------
    def generate(self, cond: Conditions, seeds) -> list[ImageResult]:
        t0 = time.perf_counter()
        with torch.inference_mode():
            log = self._generate(cond, Streams(seeds, self.device))
            tokens = log.tokens.cpu()
            images = self.bundle.decode(tokens)
        records = log.records()
        wall = (time.perf_counter() - t0) / len(seeds)
        unknown = cond.unknown_words or [0] * len(seeds)
        phases = {k: v / len(seeds) for k, v in log.phase_s.items()}
        tf, df = log.target_forwards.tolist(), log.draft_forwards.tolist()
        return [ImageResult(tokens[b].numpy(), images[b], records[b], tf[b], df[b], wall, phases, int(unknown[b]))
                for b in range(len(seeds))]

    def _generate(self, cond: Conditions, streams: Streams) -> TokenLog:
        raise NotImplementedError
