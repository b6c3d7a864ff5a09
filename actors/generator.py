"""The generator actor: loads the model bundle and the engine once, then turns batches of prompts
into committed Parquet parts. Plain Python (pool.py wraps it with ray.remote), so it also runs in
process for benchmarks and debugging."""
from __future__ import annotations

import logging
import os
import time
import traceback
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from actors.output import ERROR_SCHEMA, IMAGE_SCHEMA, TOKEN_SCHEMA, png_bytes, write_part
from decoding.bundle import load_shapes_bundle
from decoding.engines import build_engine
from decoding.shapes import parse_caption

log = logging.getLogger("arspec.actor")


def load_model(model: dict, device: str):
    if model["name"] != "shapes":
        raise ValueError(f"model.name={model['name']!r}: only the built-in 'shapes' bundle is available")
    return load_shapes_bundle(model.get("weights_dir"), device=device, dtype=model.get("dtype", "auto"))


def pick_device(model: dict, gpus: float) -> str:
    if model.get("device", "auto") != "auto":
        return model["device"]
    return "cuda" if gpus > 0 and torch.cuda.is_available() else "cpu"


class Generator:
    def __init__(self, cfg: dict, out_dir: str):
        c = cfg["cluster"]
        threads = c.get("torch_threads") or max(1, int(c.get("num_cpus_per_actor", 1)))
        torch.set_num_threads(threads)
        self.cfg, self.out_dir = cfg, Path(out_dir)
        self.bundle = load_model(cfg["model"], pick_device(cfg["model"], c.get("num_gpus_per_actor", 0)))
        e = cfg["engine"]
        self.engine = build_engine(self.bundle, e)
        self.acceptance = e.get("acceptance", "exact") if e["name"] != "vanilla" else "exact"

    def pid(self) -> int:
        return os.getpid()

    @staticmethod
    def node() -> str:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"

    def generate(self, items: list[dict]):
        """items: [{prompt_id, prompt, seed}] -> engine results, raising if any prompt fails."""
        cond = self.bundle.conditions([it["prompt"] for it in items])
        return self.engine.generate(cond, [it["seed"] for it in items])

    def run(self, part: str, items: list[dict]) -> dict:
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
        images, tokens = self._tables(done, part)
        errors = pa.Table.from_pylist([{"prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"],
                                        "engine": self.engine.name, "error": msg, "part": part}
                                       for it, msg in failed], schema=ERROR_SCHEMA)
        write_part(self.out_dir, part, images, tokens, errors)
        return {"part": part, "prompt_ids": [it["prompt_id"] for it in items], "images": len(done),
                "errors": len(failed), "gen_s": gen_s, "write_s": time.perf_counter() - t0 - gen_s,
                "tau": [r.mean_accept_len for _, r in done], "wall_s": [r.wall_s for _, r in done],
                "error_messages": [m for _, m in failed], "node": self.node(), "pid": os.getpid(),
                "started": started, "ended": time.time()}

    def _tables(self, done, part: str) -> tuple[pa.Table, pa.Table]:
        e, b = self.engine, self.bundle
        rows = []
        for it, r in done:
            scene = parse_caption(it["prompt"]) if isinstance(it["prompt"], str) else None
            rows.append({
                "prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"], "engine": e.name,
                "model": b.name, "image": {"bytes": png_bytes(r.image), "path": f"{it['prompt_id']}.png"},
                "width": r.image.shape[1], "height": r.image.shape[0], "num_tokens": len(r.tokens),
                "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards,
                "mean_accept_len": r.mean_accept_len, "wall_s": r.wall_s, "batch_size": len(done),
                "acceptance": self.acceptance, "split": scene.split if scene else None,
                "unknown_words": r.unknown_words, "part": part})
        images = pa.Table.from_pylist(rows, schema=IMAGE_SCHEMA)
        return images, self._token_table(done)

    def _token_table(self, done) -> pa.Table:
        if not done:
            return TOKEN_SCHEMA.empty_table()
        G = self.bundle.grid
        cols = {k: np.concatenate([r.records[k] for _, r in done]) for k in done[0][1].records}
        n = len(done[0][1].tokens)
        index = np.tile(np.arange(n), len(done))
        data = {
            "prompt_id": np.repeat([it["prompt_id"] for it, _ in done], n),
            "token_index": index, "row": index // G, "col": index % G,
            "step": cols["step"], "token_id": cols["token_id"], "accepted": cols["accepted"],
            "accept_len": cols["accept_len"], "p_target": cols["p_target"], "q_draft": cols["q_draft"],
            "tree_depth": cols["tree_depth"], "tree_width": cols["tree_width"],
            "engine": np.repeat(self.engine.name, len(index)),
        }
        return pa.Table.from_pydict({f.name: pa.array(data[f.name], f.type, from_pandas=True) for f in TOKEN_SCHEMA},
                                    schema=TOKEN_SCHEMA)
