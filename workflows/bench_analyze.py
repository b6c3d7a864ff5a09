"""Analyze at scale: `python -m workflows.bench_analyze [images=100000] [engines=[adt_tree]] [dir=...]`.

Writes synthetic runs in the job's output layout (docs/design.md, "Output contract"; the schemas of
actors/output.py), without running any engine: `images` images per run in parts of `images_per_part`
(the job writes one part per batch, 8 by default) and 256 token rows per image (2.56·10^7 rows at 10^5
images). Images are shapes scenes rendered by the world (a pool of `pool` distinct scenes, reused), so
the scorer, flat cells and distances do their real work; token rows follow each engine's structure
(vanilla: one token per step; tree engines: steps of accepted drafts + a bonus, with depths, widths and
probabilities; `cspd_like`: no token ids, window positions and a log acceptance ratio, the columns a
continuous family adds). Then it runs `python -m workflows.analyze` on them in a child process and
reports its wall time and peak resident memory (the child's ru_maxrss), beside the memory of a child
that only imports what analyze imports.

The data are generated once per setting and reused (`fresh=true` to regenerate). Run it on a quiet
machine: the time is a measurement.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from workflows.config import ConfigError, cli, one_line_errors, to_object

GRID = 16                              # shapes: 16 x 16 tokens per 64 x 64 image
TREE_ENGINES = {"adt_tree": ("exact", (2, 12), (1, 8)), "eagle2": ("exact", (6, 6), (4, 4)),
                "lantern": ("lantern", (2, 12), (1, 8))}      # acceptance, depth range, width range


@dataclass
class BenchAnalyzeConfig:
    images: int = 100_000                # per run
    images_per_part: int = 8             # the job's default batch size: one part per batch
    engines: list = field(default_factory=lambda: ["adt_tree"])   # vanilla | adt_tree | eagle2 | lantern | cspd_like
    pool: int = 512                      # distinct rendered scenes the images cycle through
    dir: str = "runs/bench_analyze"
    fresh: bool = False                  # regenerate even if the data exist
    seed: int = 0
    analyze: list = field(default_factory=list)   # extra analyze overrides, e.g. [memory_limit=2GB]


ConfigStore.instance().store(name="bench_analyze_schema", node=BenchAnalyzeConfig)


def scene_pool(n: int, seed: int) -> list[dict]:
    """n rendered shapes scenes as (PNG bytes, caption, split)."""
    from actors.output import png_bytes
    from decoding.shapes.world import TEXTURES, Scene, render
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        s = Scene.sample(rng, texture=TEXTURES[i % 2])
        out.append({"png": png_bytes(render(s)), "prompt": s.caption, "split": s.split})
    return out


def _tree_tokens(rng, n: int, depth: tuple, width: tuple, relaxed: bool) -> tuple[dict, int, int]:
    """One image's token columns: token 0 from the prefill (step 0), then steps that each commit a
    accepted drafts (0 <= a <= d) and a bonus token. Returns (columns, target forwards, draft forwards)."""
    steps = n                                                   # enough steps for any draw
    d = rng.integers(depth[0], depth[1] + 1, steps)
    w = rng.integers(width[0], width[1] + 1, steps)
    a = np.minimum(rng.geometric(0.3 if relaxed else 0.35, steps) - 1, d)
    length = np.cumsum(a + 1)
    last = int(np.searchsorted(length, n - 1))                   # the step that reaches token n - 1
    a, d, w = a[: last + 1], d[: last + 1], w[: last + 1]
    length = np.minimum(a + 1, (n - 1) - np.concatenate([[0], np.cumsum(a + 1)[:-1]]))
    step = np.concatenate([[0], np.repeat(np.arange(1, last + 2), length)])
    within = np.arange(n - 1) - np.repeat(np.cumsum(length) - length, length)      # place in its step
    acc = np.concatenate([[False], np.repeat(a, length) > within])
    within = np.concatenate([[0], within])
    p = np.where(acc, rng.beta(5, 1.5, n), rng.beta(1.2, 3, n)).astype(np.float32)
    q = np.where(acc, np.clip(p * rng.uniform(0.7, 1.1, n), 0, 1), np.nan).astype(np.float32)
    cols = {"_within": within, "step": step, "accepted": acc, "accept_len": np.concatenate([[1], np.repeat(length, length)]),
            "p_target": p, "q_draft": q, "tree_depth": np.concatenate([[0], np.repeat(d, length)]),
            "tree_width": np.concatenate([[0], np.repeat(w, length)])}
    return cols, last + 2, int(d.sum()) + 1


def _vanilla_tokens(rng, n: int) -> tuple[dict, int, int]:
    z = np.zeros(n, np.int32)
    return ({"step": np.arange(n), "accepted": np.zeros(n, bool), "accept_len": np.ones(n, np.int32),
             "p_target": rng.beta(1.5, 2, n).astype(np.float32), "q_draft": np.full(n, np.nan, np.float32),
             "tree_depth": z, "tree_width": z}, n, 0)


def _cspd_tokens(rng, n: int) -> tuple[dict, int, int]:
    """A continuous family's log: windows of 4 drafts, each accepted in order while log u < log ratio."""
    cols, fwd, _ = _tree_tokens(rng, n, (4, 4), (1, 1), False)
    cols["tree_depth"][:] = 0
    cols["tree_width"][:] = 0
    cols["p_target"][:] = np.nan
    cols["q_draft"][:] = np.nan
    cols["window_pos"] = cols["_within"].astype(np.int32)
    cols["log_accept_ratio"] = np.where(cols["accepted"], -rng.exponential(0.3, n), -rng.exponential(2.0, n)).astype(np.float32)
    return cols, fwd, fwd


CSPD_COLUMNS = (("window_pos", pa.int32()), ("log_accept_ratio", pa.float32()))


def token_schema(engine: str) -> pa.Schema:
    """The job's tokens schema, plus the continuous family's columns for cspd_like where the job's schema
    does not have them yet."""
    from actors.output import TOKEN_SCHEMA
    extra = [pa.field(c, ty) for c, ty in CSPD_COLUMNS if engine == "cspd_like" and c not in TOKEN_SCHEMA.names]
    return pa.schema([*TOKEN_SCHEMA, *extra])


def _fill(n: int, field: pa.Field) -> np.ndarray:
    """A column the synthetic engine does not write (a later engine's, e.g. a budget): its log fill value
    (decoding/engines/log.py), else null."""
    from decoding.engines.log import TOKEN_COLUMNS
    fill = {c.name: c.fill for c in TOKEN_COLUMNS}.get(field.name)
    return np.full(n, None, object) if fill is None else np.full(n, fill, field.type.to_pandas_dtype())


def make_run(out: Path, engine: str, images: int, per_part: int, pool: list[dict], seed: int) -> None:
    """One synthetic run folder: job.json, images/ and tokens/ parts (see the module doc)."""
    from actors.output import IMAGE_SCHEMA
    from decoding.sampling import prompt_seed
    n, rng = GRID * GRID, np.random.default_rng([seed, sum(map(ord, engine))])
    acceptance, depth, width = TREE_ENGINES.get(engine, ("cspd(lam=42)" if engine == "cspd_like" else "exact", None, None))
    name = {"lantern": "adt_tree", "cspd_like": "cspd"}.get(engine, engine)
    settings = {"name": name, "acceptance": acceptance} if engine in TREE_ENGINES else {"name": name}
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "tokens").mkdir(parents=True, exist_ok=True)
    (out / "job.json").write_text(json.dumps({"bytes_version": 0, "model": {"name": "shapes", "weights_dir": None},
                                              "engine": settings, "data": {"name": "synthetic"}, "seed": seed}))
    schema = token_schema(engine)
    rows, cells = np.arange(n, dtype=np.int32) // GRID, np.arange(n, dtype=np.int32) % GRID
    for part, start in enumerate(range(0, images, per_part)):
        ids = list(range(start, min(start + per_part, images)))
        tok, img = {c: [] for c in schema.names}, {c: [] for c in IMAGE_SCHEMA.names}
        for i in ids:
            pid = f"synthetic-{i:07d}"
            if engine == "vanilla":
                cols, fwd, dfwd = _vanilla_tokens(rng, n)
            elif engine == "cspd_like":
                cols, fwd, dfwd = _cspd_tokens(rng, n)
            else:
                cols, fwd, dfwd = _tree_tokens(rng, n, depth, width, acceptance != "exact")
            cols.pop("_within", None)
            cols = {"prompt_id": np.full(n, pid, object), "token_index": np.arange(n, dtype=np.int32), "row": rows,
                    "col": cells, "token_id": (np.full(n, None, object) if engine == "cspd_like"
                                               else rng.integers(0, 1024, n).astype(np.int32)),
                    "engine": np.full(n, name, object), **cols}
            for f in schema:
                tok[f.name].append(cols[f.name] if f.name in cols else _fill(n, f))
            scene = pool[i % len(pool)]
            for c, v in {"prompt_id": pid, "prompt": scene["prompt"], "seed": prompt_seed(seed, pid), "engine": name,
                         "model": "shapes", "image": {"bytes": scene["png"], "path": None}, "width": 64, "height": 64,
                         "num_tokens": n, "target_forwards": fwd, "draft_forwards": dfwd, "mean_accept_len": n / fwd,
                         "wall_s": fwd * 0.004 + dfwd * 0.0005, "batch_size": per_part, "acceptance": acceptance,
                         "split": scene["split"], "unknown_words": 0, "invalid_tokens": 0,
                         "part": f"part-{part:06d}"}.items():
                img[c].append(v)
        tokens = pa.Table.from_arrays([pa.array(np.concatenate(tok[c]), schema.field(c).type) for c in schema.names],
                                      schema=schema)
        pq.write_table(tokens, out / "tokens" / f"part-{part:06d}.parquet")
        pq.write_table(pa.Table.from_pydict(img, schema=IMAGE_SCHEMA), out / "images" / f"part-{part:06d}.parquet")


def ensure_runs(c: BenchAnalyzeConfig) -> tuple[list[Path], float]:
    """The synthetic runs for these settings (generated unless already there). Returns (runs, seconds)."""
    root = Path(c.dir)
    stamp = {"images": c.images, "images_per_part": c.images_per_part, "pool": c.pool, "seed": c.seed, "grid": GRID}
    runs, t0 = [], time.perf_counter()
    pool = None
    for engine in c.engines:
        if engine not in (*TREE_ENGINES, "vanilla", "cspd_like"):
            raise ConfigError(f"engines: {engine!r} is not one the bench can synthesise; choose from "
                              f"vanilla, {', '.join(TREE_ENGINES)}, cspd_like")
        out = root / engine
        done = out / "bench_stamp.json"
        if c.fresh or not done.exists() or json.loads(done.read_text()) != stamp:
            import shutil
            shutil.rmtree(out, ignore_errors=True)
            pool = pool or scene_pool(c.pool, c.seed)
            make_run(out, engine, c.images, c.images_per_part, pool, c.seed)
            done.write_text(json.dumps(stamp))
        runs.append(out)
    return runs, time.perf_counter() - t0


def measure(argv: list[str]) -> dict:
    """Run a child python with argv; its wall time and peak RSS (ru_maxrss of the child, in MB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    wall = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed:\n{proc.stderr[-3000:]}")
    return {"seconds": round(wall, 2), "peak_rss_mb": round(peak / 1024, 1), "grew": peak > before,
            "stdout": proc.stdout, "stderr": proc.stderr}


def check(c: BenchAnalyzeConfig) -> None:
    """Settings refused in one line (ConfigError) before any run is written."""
    for key in ("images", "images_per_part", "pool"):
        if getattr(c, key) < 1:
            raise ConfigError(f"{key}={getattr(c, key)}: must be >= 1")
    if not c.engines:
        raise ConfigError("engines=[]: give at least one of vanilla, adt_tree, eagle2, lantern, cspd_like")


def run(c: BenchAnalyzeConfig) -> dict:
    check(c)
    runs, gen_s = ensure_runs(c)
    out = Path(c.dir) / "report"
    # the import baseline first: ru_maxrss of children is a maximum, so the smaller child goes first
    base = measure(["-c", "import workflows.analyze, workflows.report.build, decoding.shapes.family"])
    res = measure(["-m", "workflows.analyze", f"run_dirs=[{','.join(str(r) for r in runs)}]", f"out={out}", *c.analyze])
    tokens = sum(pq.ParquetFile(f).metadata.num_rows for r in runs for f in sorted((r / "tokens").glob("*.parquet")))
    stages = [line for line in res["stderr"].splitlines() if line.startswith("[analyze]")]
    html = out / "index.html"
    return {"runs": [str(r) for r in runs], "images_per_run": c.images, "token_rows": tokens,
            "parts_per_run": -(-c.images // c.images_per_part), "generate_seconds": round(gen_s, 1),
            "analyze_seconds": res["seconds"], "analyze_peak_rss_mb": res["peak_rss_mb"],
            "import_only_peak_rss_mb": base["peak_rss_mb"], "stages": stages,
            "page_mb": round(html.stat().st_size / 1e6, 2), "report": str(html),
            "command": f"python -m workflows.analyze run_dirs=[{','.join(str(r) for r in runs)}] out={out} {' '.join(c.analyze)}".strip()}


@hydra.main(version_base="1.3", config_path=None, config_name="bench_analyze_schema")
@one_line_errors
def main(cfg: DictConfig) -> None:
    c: BenchAnalyzeConfig = to_object(cfg)
    result = run(c)
    path = Path(c.dir) / "bench_analyze.json"
    path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    cli(main)
