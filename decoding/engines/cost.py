"""What a step costs on this device: the target's and the drafter's milliseconds per forward as a
function of rows x tokens per row, and each kind of step's work outside its forwards (`overhead_ms`),
measured once per (device, model, rows) and cached on disk, or given (`engine.costs=PATH`)
(docs/design.md, "Budgets"). An engine asks for the one row count it runs (2 x slots with CFG) when it
starts a batch: a second or two, not the whole grid. The tree engines' budgets price every step from
this table and never from the clock, so that the same table gives the same decisions, and the same
bytes, on every run.

A table, not a formula: on a CPU the cost of T tokens grows with T from the first token (compute
bound, more so in fp32), on a GPU it is flat until the device fills; either way the measured grid says
so, and a cost between grid points is interpolated linearly (extrapolated at the edges).

The grid is measured after a committed prefix of half an image, and how the cost grows with that prefix
(`width_ms`: ms per slot of attention width, one token per row): attention reads every row up to the
longest row's position, so a row that runs ahead makes every later step of its batch dearer (planner.py, `room`).
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from decoding.engines.busy import ATTEMPTS, BUSY, Load

log = logging.getLogger("arspec.cost")

VERSION = 5     # of what a table holds and of the code it measures: a new version measures again
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
    # step kind (plain, spec, chain) -> [len(rows)]: ms of a step's work outside its forwards (masks,
    # sampling, selection, the K/V move); measured by running real steps (the engine's `calibrate`)
    overhead_ms: dict = field(default_factory=dict)
    busy: list = field(default_factory=list)       # [len(rows)]: cores other processes used while measured

    def __post_init__(self):
        # (table, R, T) -> ms: a plain step asks the same few costs every step, and interpolating them
        # each time cost 1-2% of a step at batch 4 (a table is frozen, so an answer never goes stale)
        object.__setattr__(self, "_memo", {})
        object.__setattr__(self, "_widths", [[w] * len(self.tokens) for w in self.width_ms])
        object.__setattr__(self, "_overheads", {k: [[v] * len(self.tokens) for v in line]
                                                for k, line in self.overhead_ms.items() if len(line) == len(self.rows)})

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

    def overhead(self, kind: str, R: float) -> float:
        """ms of a `kind` step's work outside its forwards over R rows (0 where the table has none)."""
        table = self._overheads.get(kind)
        return max(self._at(table, R, 1), 0.0) if table else 0.0

    def summary(self) -> str:
        line = lambda name, t: f"{name} ms " + "; ".join(  # noqa: E731
            f"R={r}: " + " ".join(f"{v:.2f}" for v in row) for r, row in zip(self.rows, t))
        return (f"T={self.tokens} | " + line("target", self.target_ms) + " | " + line("drafter", self.drafter_ms)
                + " | target ms per width slot " + " ".join(f"R={r}: {w:.4f}" for r, w in zip(self.rows, self.width_ms))
                + "".join(f" | {k} overhead ms " + " ".join(f"R={r}: {v:.2f}" for r, v in zip(self.rows, line))
                          for k, line in sorted(self.overhead_ms.items()))
                + (" | others' cores while measured " + " ".join(f"R={r}: {b:.2f}" for r, b in zip(self.rows, self.busy))
                   if self.busy else ""))


def cache_key(bundle) -> str:
    dev = bundle.device
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu{os.cpu_count()}-t{torch.get_num_threads()}"
    spec = json.dumps([VERSION, name, torch.__version__, str(bundle.dtype), bundle.gpt.args.to_dict(),
                       bundle.drafter.args.to_dict() if bundle.drafter is not None else None], sort_keys=True)
    return hashlib.blake2b(spec.encode(), digest_size=8).hexdigest()


@torch.inference_mode()
def measure(bundle, rows=ROWS, tokens=TOKENS, reps: int = 5) -> CostTable:
    """Least ms per forward over a grid of (rows, tokens), after a committed prefix as long as the
    condition and half an image (the average position of a step). The grid runs once untimed first (a
    process's first pass over it ran slower: at R = 16, T = 16, 74-99 against 61-65 ms), then twice timed,
    and a table is kept for good (docs/measurements.md, "The cost table at a job's start")."""
    from decoding.engines.base import caches_kept
    with caches_kept(bundle.gpt, bundle.drafter):
        _measure(bundle, rows, tokens, reps, warm=True)
        return least(_measure(bundle, rows, tokens, reps), _measure(bundle, rows, tokens, reps))


def least(a: CostTable, b: CostTable) -> CostTable:
    """Cell by cell the lesser of two measurements of one grid, a pass apart: other work on the host
    (a job's start: the other actors, Ray's agents) only ever adds time, and a burst of it can cover
    every repeat of a cell within one pass."""
    pick = lambda x, y: [[min(u, v) for u, v in zip(r, s)] for r, s in zip(x, y)]  # noqa: E731
    return replace(a, target_ms=pick(a.target_ms, b.target_ms), drafter_ms=pick(a.drafter_ms, b.drafter_ms),
                   width_ms=[min(u, v) for u, v in zip(a.width_ms, b.width_ms)],
                   overhead_ms={k: [min(u, v) for u, v in zip(line, b.overhead_ms[k])]
                                for k, line in a.overhead_ms.items() if k in b.overhead_ms},
                   busy=[min(u, v) for u, v in zip(a.busy, b.busy)])


def _measure(bundle, rows, tokens, reps: int, warm: bool = False) -> CostTable | None:
    """The grid (`measure`); warm: each forward called once, untimed, and nothing returned."""
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
                line.append(call() if warm else _least_ms(call, dev, reps))
            grid.append([round(x, 4) for x in nondecreasing(line)] if not warm else None)
        out[name] = grid
    if warm:
        return None
    return CostTable(list(rows), list(tokens), out["target"], out["drafter"],
                     width_ms=[_width_ms(bundle, R, reps) for R in rows])


def nondecreasing(xs: list) -> list:
    """The closest non-decreasing sequence to xs (least squares: pooled adjacent violators). More tokens
    per row never cost less; a measured dip is another process's work on the host."""
    blocks: list = []                                  # [sum, count] of pooled runs
    for x in xs:
        blocks.append([float(x), 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] > blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(n)]


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
        ms.append(_least_ms(lambda: m.logits(m.forward_embeds(h, slots, mask, slots)), dev, reps))
    return round(max(ms[1] - ms[0], 0.0) / (hi - lo), 6)


def _least_ms(call, dev: torch.device, reps: int) -> float:
    """The least ms of `reps` calls after two warm-ups (synchronised on a GPU): other work on the host
    only ever adds time, and a table is kept for good, so one slow call must not decide it."""
    times = []
    for _ in range(reps + 2):
        t0 = now(dev)
        call()
        times.append(now(dev) - t0)
    return 1000 * float(min(times[2:]))


def now(dev: torch.device) -> float:
    """Seconds, once the device's queued work is done (a GPU runs asynchronously): the one clock that
    measuring reads; decisions never read it."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def cost_table(bundle, rows=ROWS, cache_dir: str | None = None, calibrate=None) -> CostTable:
    """The cost table of this bundle on its device for at least `rows` (R values): what the cache holds,
    plus the missing rows measured now and added to the cache. `calibrate(R, forwards)` -> {kind: ms}:
    the step overheads over R rows, given the forward costs just measured (the engine times real steps;
    None: no overheads). `cache_dir` (default $ARSPEC_CACHE or
    ~/.cache/arspec) holds one JSON file per key. rows=() only reads the cache.

    One engine measures at a time (a lock file beside the tables): actors of one machine that start
    together take turns, the later ones find the rows cached and measure nothing, so every engine on a
    device decides from the same numbers, measured without another measurement running beside them.
    Where other processes kept the host busy (BUSY), it measures again, up to ATTEMPTS times, and keeps
    the least of each cell; a table still timed beside other work is kept with a warning."""
    key = cache_key(bundle)
    path = _cache_file(key, cache_dir)
    table = _read(path, key)
    if not set(rows) - set(table.rows):
        return table
    with _locked(path):
        table = _read(path, key)                                      # what another engine measured meanwhile
        missing = sorted({int(r) for r in rows} - set(table.rows))
        if not missing:
            return table
        t0, new = time.perf_counter(), None
        for _ in range(ATTEMPTS):
            load = Load()
            got = measure(bundle, rows=missing)
            over = [calibrate(R, got) if calibrate else {} for R in got.rows]
            got = replace(got, key=key, overhead_ms={k: [o.get(k, 0.0) for o in over] for k in sorted({*over[0]})},
                          busy=[round(load.others(), 3)] * len(got.rows))
            new = got if new is None else least(new, got)
            if got.busy[0] <= BUSY:
                break
        else:
            log.warning(f"[cost] other processes used {got.busy[0]:.2f} cores while R={missing} was measured, "
                        f"{ATTEMPTS} times: the table may price speculation wrong; delete {path} to measure "
                        f"again on a quiet host, or give one (engine.costs=PATH)")
        table = _merged(table, new)
        _write(path, asdict(table))
    log.info(f"[cost] measured R={missing} in {time.perf_counter() - t0:.1f}s: {table.summary()}")
    return table


def given(path: str) -> CostTable:
    """A cost table from a file (`engine.costs=PATH`: a table this module wrote, or one written by hand
    in the same JSON): the engine then measures nothing, and two runs decide alike on any machine."""
    try:
        t = CostTable(**json.loads(Path(path).read_text()))
    except FileNotFoundError:
        raise ValueError(f"engine.costs={path}: no such file (give a cost table JSON, or leave it empty to "
                         f"measure one)") from None
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"engine.costs={path}: not a cost table ({e}); see decoding/engines/cost.py "
                         f"CostTable for its fields") from None
    shape = len(t.rows), len(t.tokens)
    if not t.rows or any(len(g) != shape[0] or any(len(x) != shape[1] for x in g) for g in (t.target_ms, t.drafter_ms)):
        raise ValueError(f"engine.costs={path}: target_ms and drafter_ms must be [rows][tokens] = "
                         f"[{shape[0]}][{shape[1]}]")
    for name, values, floor, dims in (("rows", t.rows, 1, 1), ("tokens", t.tokens, 1, 1),
                                      ("target_ms", t.target_ms, 1e-9, 2), ("drafter_ms", t.drafter_ms, 0, 2)):
        if not _finite(values, floor, dims):
            raise ValueError(f"engine.costs={path}: {name} must hold finite numbers >= {floor:g}")
    if sorted(set(t.rows)) != list(t.rows) or sorted(set(t.tokens)) != list(t.tokens):
        raise ValueError(f"engine.costs={path}: rows and tokens must be increasing, without repeats")
    per_row = {"width_ms": t.width_ms, "busy": t.busy, **{f"overhead_ms.{k}": v for k, v in t.overhead_ms.items()}}
    for name, line in per_row.items():                      # optional: empty, or one number >= 0 per row
        if not isinstance(line, list) or line and not (len(line) == shape[0] and _finite(line, 0, 1)):
            raise ValueError(f"engine.costs={path}: {name} must be [] or {shape[0]} finite numbers >= 0 (one per row)")
    return t


def _finite(values, floor: float, dims: int) -> bool:
    try:
        a = np.asarray(values, dtype=float)
    except (ValueError, TypeError):
        return False
    return bool(a.ndim == dims and np.isfinite(a).all() and (a >= floor).all())


def _read(path: Path, key: str) -> CostTable:
    """The cached table at `path`, or an empty one (none yet, damaged, or of another layout)."""
    try:
        t = CostTable(**json.loads(path.read_text()))
        if t.tokens == list(TOKENS) and len(t.width_ms) == len(t.rows) and len(t.busy) in (0, len(t.rows)):
            return t
    except (OSError, ValueError, TypeError, AttributeError):
        pass                                                          # none, or damaged: measure again
    return CostTable([], list(TOKENS), [], [], key)


def _merged(old: CostTable, new: CostTable) -> CostTable:
    """old's rows, and new's rows that old has not."""
    kinds = sorted({*old.overhead_ms, *new.overhead_ms})
    line = lambda t, i: (t.rows[i], t.target_ms[i], t.drafter_ms[i], t.width_ms[i],  # noqa: E731
                         [(t.overhead_ms.get(k) or [0.0] * len(t.rows))[i] for k in kinds],
                         (t.busy or [0.0] * len(t.rows))[i])
    lines = sorted([line(old, i) for i in range(len(old.rows))] +
                   [line(new, i) for i in range(len(new.rows)) if new.rows[i] not in old.rows])
    return CostTable([x[0] for x in lines], list(TOKENS), [x[1] for x in lines], [x[2] for x in lines], new.key,
                     [x[3] for x in lines], {k: [x[4][j] for x in lines] for j, k in enumerate(kinds)},
                     [x[5] for x in lines])


@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive lock on path's folder's lock file (actors of one machine that would measure at once)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.parent / ".lock", "a")
    except OSError:                                                   # a read-only home: no cache, no lock
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


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
