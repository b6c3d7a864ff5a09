"""What every engine shares: the config base, the result type, and a cached model whose rows each keep
their own visible slots (so speculative steps can run batched with per-row lengths).

Rows: with CFG a batch of B prompts runs as 2B rows, [cond; uncond]; per-prompt tensors are repeated
for the uncond half by `Engine.rows`. Logical positions: condition tokens 0..L-1, image token i at L+i.
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from decoding.bundle import Conditions, ModelBundle
from decoding.models.gpt import causal_mask
from decoding.sampling import SamplingParams, cfg_combine, filtered_probs


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
    image: np.ndarray | None      # uint8 [H, W, 3]; None where generate(images=False)
    records: dict                 # column -> [N] array in generation order (log.TOKEN_COLUMNS)
    target_forwards: int
    draft_forwards: int
    wall_s: float                 # engine seconds attributed to the image (each step's time / rows it advanced)
    phase_s: dict = field(default_factory=dict)  # the same, per step phase
    unknown_words: int = 0
    batch: float = 0.0            # prompts its batch decoded: the mean over its steps (a stream regroups)

    @property
    def mean_accept_len(self) -> float:
        """τ: tokens committed per target forward."""
        return len(self.tokens) / max(self.target_forwards, 1)

    @property
    def invalid_tokens(self) -> int:
        """Committed tokens that no correct sampler can produce (the job's invariant, docs/design.md,
        "Sampling"): a discrete token the target gives no mass after CFG, temperature, top-k and top-p
        (p_target not > 0, NaN included), or a continuous token with a non-finite value or a drafted one
        with a non-finite log acceptance ratio. Zero for an exact engine; LANTERN may commit a
        neighbour of zero mass by design."""
        r = self.records
        if self.tokens.ndim == 2:                                    # continuous: [N, C] token vectors
            drafted = r["window_pos"] >= 0
            return int((~np.isfinite(self.tokens).all(-1)).sum() + (drafted & ~np.isfinite(r["log_accept_ratio"])).sum())
        return int((~(r["p_target"] > 0)).sum())


def visible(valid: torch.Tensor, see: torch.Tensor) -> torch.Tensor:
    """Attention mask [R, T, S']: committed slots `valid` [R, S] plus, per query, the slots `see` [R, T, K]
    (its uncommitted ancestors and itself). Committed slots all lie below the slots being written, so
    the mask stops at S' = max(see) + 1 and attention reads only that prefix of the cache."""
    width = int(see.max()) + 1
    mask = valid[:, None, :width].repeat(1, see.shape[1], 1)
    return mask.scatter_(2, see, True)


def parked(slots: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """The cache slots a step writes, slots [B, T], with the rows that are not live (image done, or an
    empty slot) moved to slots 0..T-1. Attention reads every row up to the largest slot a step writes
    (`visible`), and a finished row left at its image's end made every step of its batch read the whole
    cache until the others finished. Slots 0..T-1 are the row's condition, which nothing reads before
    the next prompt's prefill writes it again; a parked row's outputs are never used."""
    return torch.where(live[:, None], slots, torch.arange(slots.shape[1], device=slots.device))


@contextmanager
def caches_kept(*models):
    """Leave the models' K/V buffers as they were after the block (cost.measure sets up its own: an
    engine that measures a new batch shape mid-stream keeps its rows' K/V)."""
    saved = [(m, [layer.attention.kv_cache for layer in m.layers], getattr(m, "_cache_key", None))
             for m in models if m is not None]
    try:
        yield
    finally:
        for m, caches, key in saved:
            for layer, cache in zip(m.layers, caches):
                layer.attention.kv_cache = cache
            m._cache_key = key


class CachedModel:
    """A model with a static KV cache over R rows and, per row, the set of committed (visible) slots."""

    def __init__(self, model, rows: int, seq_len: int, dtype):
        self.model = model
        if model.rope.device.type == "cpu":  # bf16 attention on a CPU is ~10x slower than fp32 at one
            dtype = torch.float32             # query per row (bench: forward_costs); K/V are tiny anyway
        have = getattr(model, "_cache_key", None)
        # reuse the buffers of as many rows or more (a forward uses the first rows): between batches of
        # one shape, and when a stream regroups its rows into fewer (scheduler.py), which keeps the
        # K/V in place
        if have is None or have[1:] != (seq_len, dtype) or have[0] < rows:
            model.setup_caches(rows, seq_len, dtype)
            model._cache_key = (rows, seq_len, dtype)
        self.valid = torch.zeros(rows, seq_len, dtype=torch.bool, device=model.rope.device)

    def copy_rows(self, old: "CachedModel", dst: torch.Tensor, src: torch.Tensor) -> None:
        """Cache rows dst continue old's rows src (old: a CachedModel of the same model, whose K/V buffers
        this one shares): the visible slots and, in every layer, the K/V up to the last visible one."""
        seen = old.valid[src]
        self.valid[dst] = seen
        width = int(seen.any(0).nonzero().max()) + 1 if bool(seen.any()) else 0
        for cache in self.model.caches():
            cache.k[dst, :, :width] = cache.k[src, :, :width]               # (the gather copies first)
            cache.v[dst, :, :width] = cache.v[src, :, :width]

    def commit(self, slots: torch.Tensor, keep: torch.Tensor | None = None):
        rows = torch.arange(slots.shape[0], device=slots.device)[:, None].expand_as(slots)
        self.valid[rows, slots] = True if keep is None else (keep | self.valid[rows, slots])

    def move(self, src: torch.Tensor, dst: torch.Tensor):
        """Copy each row's K/V at slots src [R, A] to dst [R, A] in every layer. Lanes before the first
        one where any row's entry is out of place are left out: a tree's block lists each level's best
        node first, so a path that took it starts in place (a chain never moves; at batch 8 on a CPU
        the copy of 8 layers was 0.65 ms of an 11.7 ms step of one draft token)."""
        out = (src != dst).any(0)
        if not bool(out.any()):
            return
        j = int(out.int().argmax())
        for cache in self.model.caches():
            cache.move(src[:, j:], dst[:, j:])


class Engine:
    """An engine decodes prompts in batches (docs/design.md, "Engines"): its settings, its checks, and the
    helpers engines share. The contract (`generate(conditions, seeds)` for one batch, `stream(requests,
    slots)` for a queue of prompts, refilling rows as images finish) is `scheduler.SlotEngine`'s."""
    name: ClassVar[str] = "base"
    Config: ClassVar[type] = EngineConfig
    uses_drafter: ClassVar[bool] = False   # drafts with the model's drafter (the help page's tag)

    @classmethod
    def check(cls, cfg: EngineConfig, has_drafter: bool) -> None:
        """Every refusal that needs no weights (the job's driver calls it on checkpoint headers alone)."""
        if type(cfg) is not cls.Config:
            raise ValueError(f"engine.name={cfg.name!r} does not match the {type(cfg).__name__} settings: "
                             f"choose the engine with engine={cfg.name}, not engine.name=")
        cfg.validate()

    @classmethod
    def fits(cls, cfg: EngineConfig, seq_len: int) -> None:
        """Refusals that need the model's token count, which the driver reads from the headers."""

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

    def cache_rows(self, rows: torch.Tensor, slots: int) -> torch.Tensor:
        """Prompt rows [k] -> their cache rows ([cond; uncond] with CFG)."""
        return torch.cat([rows, rows + slots]) if self.sampling.use_cfg else rows

    def target_probs(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [R, ..., dim] -> filtered distribution [B, ..., V] (CFG, temperature, top-k/p)."""
        return filtered_probs(cfg_combine(self.gpt.logits(features), self.sampling), self.sampling)

    def prefill(self, target: CachedModel, cond: Conditions, rows: torch.Tensor | None = None,
                slots: int | None = None):
        """Run the condition prefix of new prompts in prompt rows `rows` of `slots` (default: the whole
        cache is this batch). Returns (features [r, L, dim], condition embeddings [r, L, dim]) for their
        cache rows r = cache_rows(rows)."""
        B = len(cond)
        if rows is None:
            rows, slots = torch.arange(B, device=self.device), B
        drop = torch.arange(len(self.rows(cond.features)), device=self.device) >= B
        emb = self.gpt.embed_condition(self.rows(cond.features.to(self.device)), drop)
        mask = None if cond.mask is None else self.rows(cond.mask.to(self.device))
        r = self.cache_rows(rows, slots)
        pos = torch.arange(self.L, device=self.device).expand(len(r), self.L)
        feats = self.gpt.forward_embeds(emb, pos, self.prefix_mask(target, mask, len(r)), pos, rows=r)
        target.valid[r] = False
        target.valid[r, : self.L] = True if mask is None else mask
        return feats, emb

    def prefix_mask(self, target: CachedModel, mask, R: int) -> torch.Tensor:
        m = causal_mask(self.L, mask, self.device).expand(R, -1, -1)
        full = torch.zeros(R, self.L, target.valid.shape[1], dtype=torch.bool, device=self.device)
        full[:, :, : self.L] = m
        return full
