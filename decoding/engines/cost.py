"""What a forward costs on this device: the target's and the drafter's milliseconds per forward as a
function of rows x tokens per row, measured once per (device, model, rows) and cached on disk
(docs/design.md, "Budgets"). An engine asks for the one row count it runs (2 x slots with CFG) when it
starts a batch: a fraction of a second, not the whole grid. The tree engines' budget controller reads
it to decide how many draft tokens a step should verify, if any.

A table, not a formula: on a CPU the cost of T tokens grows with T from the first token (compute
bound, more so in fp32), on a GPU it is flat until the device fills; either way the measured grid says
so, and a cost between grid points is interpolated linearly (extrapolated at the edges).

The grid is measured after a committed prefix of half an image. How the cost grows with that prefix is
measured too (`width_ms`: ms per slot of attention width, one token per row): attention reads every row
up to the longest row's position, so a row that speculation moves ahead of its batch-mates makes every
later step of the batch dearer, and the tree engines weigh that (tree.py, `_room`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("arspec.cost")

VERSION = 3     # of what a table holds and of the code it measures: a new version measures again
ROWS = (2, 4, 8, 16, 32)
TOKENS = (1, 2, 4, 8, 16, 32)


@dataclass(frozen=True)
class CostTable:
    rows: list                  # R: cache rows per forward (with CFG, 2 per prompt)
    tokens: list                # T: tokens per row
    target_ms: list             # [len(rows)][len(tokens)]
    drafter_ms: list
    key: str = ""
    width_ms: list = field(default_factory=list)   # [len(rows)]: target ms per slot of attention width

    def __post_init__(self):
        # (table, R, T) -> ms: a plain step asks the same few costs every step, and interpolating them
        # each time cost 1-2% of a step at batch 4 (a table is frozen, so an answer never goes stale)
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "_widths", [[w] * len(self.tokens) for w in self.width_ms])

    def _at(self, table, R: float, T: float) -> float:
        key = (id(table), R, T)
        if key not in self._memo:
            self._memo[key] = self._interpolate(table, R, T)
        return self._memo[key]

    def _interpolate(self, table, R: float, T: float) -> float:
        rows, tokens, t = np.array(self.rows, float), np.array(self.tokens, float), np.array(table, float)
        per_row = [np.interp(T, tokens, line) if T <= tokens[-1] else
                   line[-1] + (T - tokens[-1]) * (line[-1] - line[-2]) / (tokens[-1] - tokens[-2]) for line in t]
        if len(rows) == 1:                     # one row count measured: cost in proportion to the rows
            return float(per_row[0] * R / rows[0])
        if R <= rows[-1]:
            return float(np.interp(R, rows, per_row))
        return float(per_row[-1] + (R - rows[-1]) * (per_row[-1] - per_row[-2]) / (rows[-1] - rows[-2]))

    def target(self, R: float, T: float) -> float:
        """ms of one target forward over R rows x T tokens (past a committed prefix)."""
        return self._at(self.target_ms, R, T)

    def drafter(self, R: float, T: float) -> float:
        return self._at(self.drafter_ms, R, T)

    def width(self, R: float) -> float:
        """ms one more slot of attention width adds to a target forward over R rows (one token each)."""
        return max(self._at(self._widths, R, 1), 0.0)

    def summary(self) -> str:
        line = lambda name, t: f"{name} ms " + "; ".join(  # noqa: E731
            f"R={r}: " + " ".join(f"{v:.2f}" for v in row) for r, row in zip(self.rows, t))
        return (f"T={self.tokens} | " + line("target", self.target_ms) + " | " + line("drafter", self.drafter_ms)
                + " | target ms per width slot " + " ".join(f"R={r}: {w:.4f}" for r, w in zip(self.rows, self.width_ms)))


def cache_key(bundle) -> str:
    dev = bundle.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu{os.cpu_count()}-t{torch.get_num_threads()}"
    spec = json.dumps([VERSION, name, torch.__version__, str(bundle.dtype), bundle.gpt.args.to_dict(),
                       bundle.drafter.args.to_dict() if bundle.drafter is not None else None], sort_keys=True)
    return hashlib.blake2b(spec.encode(), digest_size=8).hexdigest()


@torch.inference_mode()
def measure(bundle, rows=ROWS, tokens=TOKENS, reps: int = 3) -> CostTable:
    """Median ms per forward over a grid of (rows, tokens), after a committed prefix as long as the
    condition and half an image (the average position of a step)."""
    from decoding.engines.base import caches_kept
    with caches_kept(bundle.gpt, bundle.drafter):
        return _measure(bundle, rows, tokens, reps)


def _measure(bundle, rows, tokens, reps: int) -> CostTable:
    from decoding.engines.base import CachedModel, visible
    out = {}
    a = bundle.gpt.args
    dim, dev, prefix = a.dim, bundle.device, a.cls_token_num + a.block_size // 2
    last = a.cls_token_num + a.block_size - 1                     # RoPE positions stay in the table
    for name, m in (("target", bundle.gpt), ("drafter", bundle.drafter)):
        if m is None:
            out[name] = [[0.0] * len(tokens) for _ in rows]
            continue
        grid = []
        for R in rows:
            cache = CachedModel(m, R, prefix + max(tokens) + 1, bundle.dtype)
            cache.valid[:, :prefix] = True
            line = []
            for T in tokens:
                slots = (prefix + torch.arange(T, device=dev)).expand(R, T)
                see = torch.where(torch.ones(T, T, dtype=torch.bool, device=dev).tril(), slots[:, None, :], slots[:, :, None])
                mask = visible(cache.valid, see)
                h = torch.randn(R, T, dim, device=dev).to(bundle.dtype)
                pos = slots.clamp(max=last)
                call = (lambda: m.logits(m.forward_embeds(h, pos, mask, slots))) if name == "target" else \
                    (lambda: bundle.gpt.logits(m(h, h, pos, mask, slots)))
                line.append(round(_median_ms(call, dev, reps), 4))
            grid.append(line)
        out[name] = grid
    return CostTable(list(rows), list(tokens), out["target"], out["drafter"],
                     width_ms=[_width_ms(bundle, R, reps) for R in rows])


def _width_ms(bundle, R: int, reps: int) -> float:
    """Target ms per slot of committed prefix, one token per row: the slope between a prefix of the
    condition alone and one of the condition and a whole image (attention grows with it, the rest not)."""
    from decoding.engines.base import CachedModel, visible
    m, dev = bundle.gpt, bundle.device
    a = m.args
    lo, hi = a.cls_token_num, a.cls_token_num + a.block_size - 1
    cache = CachedModel(m, R, hi + 1, bundle.dtype)
    cache.valid[:] = True
    h = torch.randn(R, 1, a.dim, device=dev).to(bundle.dtype)
    ms = []
    for prefix in (lo, hi):
        slots = torch.full((R, 1), prefix, device=dev)
        mask = visible(cache.valid, slots[..., None])
        ms.append(_median_ms(lambda: m.logits(m.forward_embeds(h, slots, mask, slots)), dev, reps))
    return round(max(ms[1] - ms[0], 0.0) / (hi - lo), 6)


def _median_ms(call, dev: torch.device, reps: int) -> float:
    """Median ms of `reps` calls after one warm-up (synchronised on a GPU)."""
    times = []
    for _ in range(reps + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        call()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * float(np.median(times[1:]))


def cost_table(bundle, rows=ROWS, cache_dir: str | None = None) -> CostTable:
    """The cost table of this bundle on its device for at least `rows` (R values): what the cache holds,
    plus the missing rows measured now (a fraction of a second each) and added to the cache. `cache_dir`
    (default $ARSPEC_CACHE or ~/.cache/arspec) holds one JSON file per key. rows=() only reads the cache."""
    key = cache_key(bundle)
    path = _cache_file(key, cache_dir)
    table = CostTable([], list(TOKENS), [], [], key)
    if path.exists():
        try:
            cached = CostTable(**json.loads(path.read_text()))
            if cached.tokens == table.tokens and len(cached.width_ms) == len(cached.rows):
                table = cached
        except (ValueError, TypeError):
            pass                                                      # a damaged cache file: measure again
    missing = sorted({int(r) for r in rows} - set(table.rows))
    if not missing:
        return table
    t0 = time.perf_counter()
    new = measure(bundle, rows=missing)
    lines = sorted([*zip(table.rows, table.target_ms, table.drafter_ms, table.width_ms),
                    *zip(new.rows, new.target_ms, new.drafter_ms, new.width_ms)])
    table = CostTable([x[0] for x in lines], list(TOKENS), [x[1] for x in lines], [x[2] for x in lines], key,
                      [x[3] for x in lines])
    log.info(f"[cost] measured R={missing} in {time.perf_counter() - t0:.1f}s: {table.summary()}")
    _write(path, asdict(table))
    return table


def _cache_file(key: str, cache_dir: str | None, kind: str = "") -> Path:
    """costs/KEY.json (the table) or costs/KEY.KIND.json under cache_dir, $ARSPEC_CACHE or ~/.cache/arspec."""
    folder = Path(cache_dir or os.environ.get("ARSPEC_CACHE") or Path.home() / ".cache" / "arspec") / "costs"
    return folder / f"{key}{'.' + kind if kind else ''}.json"


def _write(path: Path, data: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        tmp.replace(path)
    except OSError as e:                                              # a read-only home: keep it in memory
        log.warning(f"[cost] cannot cache {path.name} in {path.parent}: {e}")


def learnt(key: str, cache_dir: str | None = None) -> dict | None:
    """What the last engine on this device and model (CostTable.key) learnt (Budget.state), or None."""
    path = _cache_file(key, cache_dir, "budget")
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except ValueError:
        return None                                                   # damaged: learn again


def keep_learnt(key: str, state: dict, cache_dir: str | None = None) -> None:
    _write(_cache_file(key, cache_dir, "budget"), state)
