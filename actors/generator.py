"""The generator actor: loads the model bundle and the engine once, then turns batches of prompts
into committed Parquet parts. Plain Python (pool.py wraps it with ray.remote), so it also runs in
process for benchmarks and debugging."""
from __future__ import annotations

import logging
import os
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pyarrow as pa
import torch

from actors.output import ERROR_SCHEMA, IMAGE_SCHEMA, png_bytes, token_table, write_part
from decoding.engines import build_engine
from decoding.registry import load_bundle

log = logging.getLogger("arspec.actor")


@dataclass
class PartResult:
    """What an actor (or the driver, for a batch that kept failing) reports for one committed part."""
    part: str
    prompt_ids: list[str]
    images: int
    errors: int
    acceptance: str
    gen_s: float = 0.0                     # engine seconds
    write_s: float = 0.0                   # PNG + Parquet seconds
    tau: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    error_messages: list[str] = field(default_factory=list)
    node: Optional[str] = None             # None: written by the driver
    pid: Optional[int] = None
    started: Optional[float] = None        # the actor's clock
    ended: Optional[float] = None
    files: dict = field(default_factory=dict)   # table -> size, rows, sha256 (output.write_part), for the manifest


class Generator:
    def __init__(self, cfg, out_dir: str):
        c = cfg.cluster
        torch.set_num_threads(c.torch_threads or max(1, int(c.num_cpus_per_actor)))
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.bundle = load_bundle(cfg.model)
        self.engine = build_engine(self.bundle, cfg.engine)

    def pid(self) -> int:
        return os.getpid()

    @staticmethod
    def node() -> str:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"

    def generate(self, items: list[dict]):
        """items: [{prompt_id, prompt, seed, ...}] -> engine results, raising if any prompt fails."""
        cond = self.bundle.conditions([it["prompt"] for it in items])
        return self.engine.generate(cond, [it["seed"] for it in items])

    def run(self, part: str, items: list[dict]) -> PartResult:
        """Generate one batch and commit it as part `part`. A failing prompt becomes an error row."""
        t0, started = time.perf_counter(), time.time()
        done, failed = [], []
        try:
            done = list(zip(items, self.generate(items)))
        except Exception:  # isolate the failing prompt(s): one by one
            for it in items:
                try:
                    done.append((it, self.generate([it])[0]))
                except Exception as e:
                    failed.append((it, f"{type(e).__name__}: {e}"))
                    log.warning(f"prompt {it['prompt_id']!r} failed: {traceback.format_exc(limit=3)}")
        gen_s = time.perf_counter() - t0
        errors = pa.Table.from_pylist([{"prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"],
                                        "engine": self.engine.name, "error": msg, "part": part}
                                       for it, msg in failed], schema=ERROR_SCHEMA)
        files = write_part(self.out_dir, part, self._images(done, part),
                   token_table([it["prompt_id"] for it, _ in done], [r.records for _, r in done], self.engine.name),
                   errors)
        return PartResult(part, [it["prompt_id"] for it in items], len(done), len(failed), self.engine.acceptance,
                          gen_s, time.perf_counter() - t0 - gen_s, [r.mean_accept_len for _, r in done],
                          [r.wall_s for _, r in done], [m for _, m in failed], self.node(), os.getpid(), started,
                          time.time(), files)

    def _images(self, done, part: str) -> pa.Table:
        e, b = self.engine, self.bundle
        return pa.Table.from_pylist([{
            "prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"], "engine": e.name,
            "model": b.name, "image": {"bytes": png_bytes(r.image), "path": f"{it['prompt_id']}.png"},
            "width": r.image.shape[1], "height": r.image.shape[0], "num_tokens": len(r.tokens),
            "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards,
            "mean_accept_len": r.mean_accept_len, "wall_s": r.wall_s, "batch_size": len(done),
            "acceptance": e.acceptance, "split": it.get("split"), "unknown_words": r.unknown_words, "part": part}
            for it, r in done], schema=IMAGE_SCHEMA)
