"""What every engine shares: the config base, the result type, and a cached model whose rows each keep
their own visible slots (so speculative steps can run batched with per-row lengths).

Rows: with CFG a batch of B prompts runs as 2B rows, [cond; uncond]; per-prompt tensors are repeated
for the uncond half by `Engine.rows`. Logical positions: condition tokens 0..L-1, image token i at L+i.
"""
from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Iterator

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
        # one shape, and when a stream regroups its rows into fewer (SlotEngine._regroup), which keeps the
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


@dataclass
class Request:
    """One prompt for `Engine.stream`: its conditions (a batch of one), its seed, the caller's key."""
    cond: Conditions
    seed: int
    key: Any = None


class _Row:
    """What a stream knows of the image a row decodes: its request, and its share of the engine's time."""
    def __init__(self, req: Request, wall: float):
        self.req, self.wall, self.phases = req, wall, {}
        self.steps, self.slots = 0, 0                 # steps it took part in, and their batches' slots in all


@dataclass
class Outcome:
    key: Any
    result: ImageResult | None = None
    error: str | None = None      # why the prompt failed (the engine goes on with the others)


class RequestQueue:
    """Requests that arrive while an engine runs (an actor's parts): producers `put` them and finally
    `close`; `Engine.stream` `take`s up to n at a time, blocking only when it has nothing else to do.
    Thread-safe. A plain iterable of requests works as a closed queue (`requests_of`)."""

    def __init__(self):
        self._items: deque = deque()
        self._closed = False
        self._cv = threading.Condition()

    def put(self, requests: Iterable[Request]) -> None:
        with self._cv:
            self._items.extend(requests)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def take(self, n: int, wait: bool) -> list[Request]:
        """Up to n requests; with `wait`, block until there is one or the queue is closed ([] = done)."""
        with self._cv:
            while wait and not self._items and not self._closed:
                self._cv.wait()
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def waiting(self) -> bool:
        """Whether a request is there to take now."""
        with self._cv:
            return bool(self._items)


class _Iterated:
    def __init__(self, requests: Iterable[Request]):
        self._it, self._next = iter(requests), []

    def take(self, n: int, wait: bool) -> list[Request]:
        got, self._next = self._next[:n], self._next[n:]
        return got + list(itertools.islice(self._it, n - len(got)))

    def waiting(self) -> bool:
        self._next = self._next or list(itertools.islice(self._it, 1))
        return bool(self._next)


def requests_of(requests) -> RequestQueue | _Iterated:
    return requests if hasattr(requests, "take") else _Iterated(requests)


class Engine:
    """An engine decodes prompts in batches (docs/design.md, "Engines"). `generate(conditions, seeds)` runs
    one batch; `stream(requests, slots)` runs a queue of prompts `slots` at a time, yielding each outcome.

    This base decodes fixed batches: a subclass implements `_generate(cond, streams) -> TokenLog` and
    `stream` cuts the queue into batches of `slots`. `SlotEngine` below refills rows as they finish.
    """
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
        feats = self.gpt.forward_embeds(emb, pos, self._prefix_mask(target, mask, len(r)), pos, rows=r)
        target.valid[r] = False
        target.valid[r, : self.L] = True if mask is None else mask
        return feats, emb

    def _prefix_mask(self, target: CachedModel, mask, R: int) -> torch.Tensor:
        m = causal_mask(self.L, mask, self.device).expand(R, -1, -1)
        full = torch.zeros(R, self.L, target.valid.shape[1], dtype=torch.bool, device=self.device)
        full[:, :, : self.L] = m
        return full

    # -- the contract ---------------------------------------------------------------------------------
    def generate(self, cond: Conditions, seeds) -> list[ImageResult]:
        """One batch, every prompt in its own row; raises if the batch fails."""
        t0 = time.perf_counter()
        with torch.inference_mode():
            log = self._generate(cond, Streams(seeds, self.device))
            tokens = log.tokens.cpu()
            images = self.bundle.decode(tokens)
        wall = (time.perf_counter() - t0) / len(seeds)
        phases = {k: v / len(seeds) for k, v in log.phase_s.items()}
        tf, df = log.target_forwards.tolist(), log.draft_forwards.tolist()
        unknown = cond.unknown_words or [0] * len(seeds)
        return [ImageResult(tokens[b].numpy(), images[b], log.records(b), tf[b], df[b], wall, phases,
                            int(unknown[b]), len(seeds)) for b in range(len(seeds))]

    def stream(self, requests, slots: int) -> Iterator[Outcome]:
        """Decode requests (an iterable or a RequestQueue) in batches of up to `slots`; a failing batch is
        retried prompt by prompt, so that only the prompts that fail alone fail. Yields one Outcome per
        request."""
        source = requests_of(requests)
        while batch := source.take(slots, wait=True):
            try:
                results = self.generate(Conditions.cat([r.cond for r in batch]), [r.seed for r in batch])
                yield from (Outcome(r.key, res) for r, res in zip(batch, results))
            except Exception:
                for r in batch:
                    try:
                        yield Outcome(r.key, self.generate(r.cond, [r.seed])[0])
                    except Exception as e:
                        yield Outcome(r.key, error=f"{type(e).__name__}: {e}")

    @torch.inference_mode()
    def tokens(self, cond: Conditions, seeds) -> TokenLog:
        """One batch decoded to tokens only, no images (tests, device benchmarks): the TokenLog."""
        return self._generate(cond, Streams(list(seeds), self.device))

    def _generate(self, cond: Conditions, streams: Streams) -> TokenLog:
        raise NotImplementedError


class SlotEngine(Engine):
    """Continuous batching: `stream(requests, slots)` keeps `slots` rows busy, and a row whose image is
    done takes the next request at once, so the batch never waits for its slowest row.

    Subclasses implement `_start(slots) -> state` (caches, token log, streams for that many rows),
    `_admit(state, rows, cond, seeds)` (prefill new prompts into rows, commit their first token) and
    `_step(state)` (one decoding step of every unfinished row; rows are told apart by state.log.n).
    """

    @torch.inference_mode()
    def tokens(self, cond: Conditions, seeds) -> TokenLog:
        seeds = list(seeds)
        state = self._start(len(seeds))
        self._admit(state, torch.arange(len(seeds), device=self.device), cond, seeds)
        while bool((state.log.n < self.N).any()):
            self._step(state)
        return state.log

    def generate(self, cond: Conditions, seeds) -> list[ImageResult]:
        """One batch: every prompt in its own row; raises if a prompt fails."""
        outcomes = {o.key: o for o in self.stream(
            [Request(c, s, b) for b, (c, s) in enumerate(zip(cond.split(), seeds))], slots=len(seeds))}
        failed = [o.error for o in outcomes.values() if o.error]
        if failed:
            raise RuntimeError(failed[0])
        return [outcomes[b].result for b in range(len(seeds))]

    def stream(self, requests, slots: int) -> Iterator[Outcome]:
        """Decode requests (an iterable or a RequestQueue) in `slots` rows, refilling each row as soon as
        its image is done. Yields one Outcome per request, in the order they finish. Each image's wall_s
        is its share of the engine's time: every step's time split among the rows it advanced.

        When no request waits and at most half the rows are busy, the busy rows regroup into a batch of
        half as many rows (or a quarter, ...: `_regroup`), and back to `slots` when requests come again.
        Every row of a batch is computed, busy or not: at the end of a stream the rows still decoding
        would otherwise pay for all of them (a speculative engine's rows finish at different steps, and
        a fixed batch of 16 on a CPU spent its last third on a few rows at the cost of 16)."""
        source = requests_of(requests)
        state, rows = None, []                        # rows[b]: the image row b decodes (None: free)
        while True:
            if state is None:
                state, rows = self._start(slots), [None] * slots
            busy = [b for b, row in enumerate(rows) if row is not None]
            idle = not busy
            room = slots - len(busy)                         # prompts it can take, regrouping to `slots` rows
            if room and not idle and self._stays_in_step(state, rows):
                room = 0                                     # the free rows wait: the batch restarts together
            taken = source.take(room, wait=idle) if room else []
            if idle and not taken:
                return
            if len(taken) > state.slots - len(busy):         # more than a regrouped batch has rows: regroup up
                state, rows = self._regroup(state, rows, busy, slots)
            new = list(zip([b for b, row in enumerate(rows) if row is None], taken))
            if new:
                t0 = time.perf_counter()
                failed = self._admit_all(state, new)
                for b, r in new:
                    if r.key in failed:                       # this prompt fails; its row stays free
                        yield Outcome(r.key, error=failed[r.key])
                    else:
                        rows[b] = _Row(r, (time.perf_counter() - t0) / len(new))
            busy = [b for b, row in enumerate(rows) if row is not None]
            if not busy:
                continue                                     # every new prompt failed: take more
            log = state.log
            done = (log.n >= self.N).tolist()
            if not any(done[b] for b in busy):
                stepping = [b for b in busy if not done[b]]
                before, t0 = dict(log.phase_s), time.perf_counter()
                try:
                    with torch.inference_mode():
                        self._step(state)
                except Exception as e:                       # the step failed: every prompt in it fails
                    for b in busy:
                        yield Outcome(rows[b].req.key, error=f"{type(e).__name__}: {e}")
                    state = None
                    continue
                share = (time.perf_counter() - t0) / len(stepping)
                for b in stepping:
                    rows[b].wall += share
                    rows[b].steps += 1
                    rows[b].slots += state.slots
                    for k, v in log.phase_s.items():
                        rows[b].phases[k] = rows[b].phases.get(k, 0.0) + (v - before.get(k, 0.0)) / len(stepping)
                done = (log.n >= self.N).tolist()
            for b in busy:
                if done[b]:
                    yield Outcome(rows[b].req.key, self._result(state, b, rows[b]))
                    rows[b] = None
            busy = [b for b in busy if rows[b] is not None]
            if busy and len(busy) <= state.slots // 2 and not source.waiting():
                size = state.slots
                while len(busy) <= size // 2:
                    size //= 2
                state, rows = self._regroup(state, rows, busy, size)

    def _regroup(self, state, rows: list, keep: list, slots: int):
        """A batch of `slots` rows whose first rows continue the rows `keep` of `state`, and the stream's
        rows likewise; the rest are free. The time it takes is the kept images' share."""
        t0 = time.perf_counter()
        new = self._resize(state, keep, slots)
        share = (time.perf_counter() - t0) / max(len(keep), 1)
        for b in keep:
            rows[b].wall += share
        return new, [rows[b] for b in keep] + [None] * (slots - len(keep))

    # What an engine's state carries over a regroup besides its rows (`_resize`): counters, not rows.
    carried: ClassVar[tuple] = ()

    def _resize(self, old, keep: list, slots: int):
        """A fresh state of `slots` rows (`_start`) whose rows 0..k-1 continue old's rows `keep`. Every
        tensor of a state is per row, [old.slots, ...] or per cache row, [R, ...] (with CFG the cache rows
        are [cond; uncond], base.Engine.cache_rows); objects with rows (the token log, the streams, the
        caches, a tree policy) copy theirs with `copy_rows`. Names in `carried` carry over as they are."""
        new = self._start(slots)
        src = torch.tensor(keep, dtype=torch.long, device=self.device)
        dst = torch.arange(len(keep), device=self.device)
        csrc, cdst = self.cache_rows(src, old.slots), self.cache_rows(dst, slots)
        per = 2 if self.sampling.use_cfg else 1                           # cache rows per prompt row
        for name, value in vars(old).items():
            mine = getattr(new, name, None)
            if isinstance(value, CachedModel):
                mine.copy_rows(value, cdst, csrc)
            elif hasattr(value, "copy_rows"):
                mine.copy_rows(value, dst, src)
            elif torch.is_tensor(value) and value.dim() and value.shape[0] in (old.slots, per * old.slots):
                by_slot = value.shape[0] == old.slots
                if mine is None:                                             # (vanilla's probs before a step)
                    mine = value.new_zeros(((1 if by_slot else per) * slots,) + value.shape[1:])
                    setattr(new, name, mine)
                mine[dst if by_slot else cdst] = value[src if by_slot else csrc]
            elif torch.is_tensor(value) and value.dim():
                raise ValueError(f"{type(self).__name__} state.{name} {tuple(value.shape)}: not per row")
            elif name in self.carried:
                setattr(new, name, value)
        return new

    def refill_wait(self) -> int:
        """Tokens a free row waits for the batch's busy rows to finish before it takes a new prompt (0:
        never waits). Engines whose rows drift apart override it (tree.py)."""
        return 0

    def _stays_in_step(self, state, rows) -> bool:
        """True when every busy row finishes within refill_wait() tokens: refilling now would start a new
        prompt that many steps behind the others, and then every step of the batch pays for it."""
        wait = self.refill_wait()
        if wait <= 0:
            return False
        n = state.log.n.tolist()
        return max(self.N - n[b] for b, row in enumerate(rows) if row is not None) <= wait

    def _admit_all(self, state, new: list) -> dict:
        """Admit [(row, request)] together; if that fails, one by one, so that only the prompts that fail
        alone fail. Returns {key: reason} of the failed ones."""
        try:
            self._admit_group(state, new)
            return {}
        except Exception as e:
            if len(new) == 1:
                return {new[0][1].key: f"{type(e).__name__}: {e}"}
        failed = {}
        for x in new:
            try:
                self._admit_group(state, [x])
            except Exception as e:
                failed[x[1].key] = f"{type(e).__name__}: {e}"
        return failed

    def _admit_group(self, state, group: list) -> None:
        rows = torch.tensor([b for b, _ in group], device=self.device)
        try:
            with torch.inference_mode():
                self._admit(state, rows, Conditions.cat([r.cond for _, r in group]), [r.seed for _, r in group])
        except Exception:
            state.log.n[rows] = self.N                            # the rows are free again
            raise

    def _result(self, state, b: int, row: _Row) -> ImageResult:
        log = state.log
        t0 = time.perf_counter()
        tokens = log.tokens[b].cpu().clone()                         # the row is reused by the next prompt
        image = self.bundle.decode(tokens[None])[0]
        wall = row.wall + time.perf_counter() - t0
        return ImageResult(tokens.numpy(), image, log.records(b), int(log.target_forwards[b]),
                           int(log.draft_forwards[b]), wall, row.phases, int(row.req.cond.unknown_words[0]),
                           row.slots / max(row.steps, 1))

    def _start(self, slots: int):
        raise NotImplementedError

    def _admit(self, state, rows: torch.Tensor, cond: Conditions, seeds: list) -> None:
        raise NotImplementedError

    def _step(self, state) -> None:
        raise NotImplementedError
