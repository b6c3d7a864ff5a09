"""The generator actor: loads the model bundle and the engine once, then turns batches of prompts
into committed Parquet parts, decoding them with continuous batching. Plain Python (pool.py wraps it with ray.remote), so it also runs in
process for benchmarks and debugging."""
from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

import pyarrow as pa
import torch

from actors.store import at
from actors.output import IMAGE_SCHEMA, error_table, png_bytes, token_table, write_part
from decoding.engines import build_engine
from decoding.engines.requests import Outcome, Request, RequestQueue
from decoding.registry import NOTES, load_bundle

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
    invalid_tokens: int = 0                # ImageResult.invalid_tokens, summed over the part's images


def rows_bytes(bundle, rows: int) -> Optional[int]:
    """A lower bound of what `rows` decoding rows take: the target's KV cache for its whole sequence
    (conditioning + image tokens), doubled for the CFG row of each, and one step's logits; None for a
    model without GPT dims (a continuous MAR bundle has none: then no check)."""
    a = getattr(getattr(bundle, "gpt", None), "args", None)
    if a is None or not hasattr(a, "block_size"):
        return None
    seq, width = a.block_size + getattr(a, "cls_token_num", 1), torch.finfo(bundle.dtype).bits // 8
    return 2 * rows * (a.n_layer * 2 * seq * a.dim * width + a.vocab_size * 4)


def check_fits(bundle, rows: int, free: int) -> None:
    """Refuse, in one line, rows whose caches cannot fit `free` bytes (before any is allocated)."""
    need = rows_bytes(bundle, rows)
    if need is not None and need > free:
        fit = max(1, rows * free // need)
        raise MemoryError(f"cluster.batch_size={rows}: {rows} rows need at least {need / 2**20:.1f} MiB for the "
                          f"KV cache and logits of this model, the device has {free / 2**20:.1f} MiB free: lower "
                          f"cluster.batch_size (at most {fit} fit)")


@dataclass
class _Part:
    """A part waiting in the actor: its prompts' outcomes as the engine thread hands them over."""
    items: list[dict]
    outcomes: dict = field(default_factory=dict)          # index -> Outcome
    done: threading.Event = field(default_factory=threading.Event)

    def add(self, i: int, outcome: Outcome) -> None:
        self.outcomes[i] = outcome
        if len(self.outcomes) == len(self.items):
            self.done.set()


class Generator:
    """One engine and its model, kept loaded. `run(part, items)` puts its prompts on one queue, and a
    single engine thread decodes that queue in `cluster.batch_size` rows with continuous batching
    (docs/design.md, "Engines"). The pool calls it one part at a time, so that what the engine decides
    follows from the parts before, whoever is free first; called from several threads, the parts share
    the engine's rows. Each call returns when all its prompts are done and its part is committed."""

    def __init__(self, cfg, out_dir: str, token: Optional[str] = None, prompts: Optional[int] = None):
        c = cfg.cluster
        self.token = token                  # the job's lock: no part is written once it is another job's
        torch.set_num_threads(c.torch_threads or max(1, int(c.num_cpus_per_actor)))
        self.cfg, self.out_dir = cfg, at(out_dir)
        level = NOTES.level
        NOTES.setLevel(logging.ERROR)       # what loading assumes, the driver's check said once for the job
        try:
            self.bundle = load_bundle(cfg.model)
        finally:
            NOTES.setLevel(level)
        self.engine = build_engine(self.bundle, cfg.engine)
        self.slots = min(c.batch_size, prompts or c.batch_size)     # never more rows than prompts to decode
        check_fits(self.bundle, self.slots, self.free_memory())
        self._lock = threading.Lock()
        self._parts: dict[str, _Part] = {}
        self._queue: RequestQueue | None = None
        self._thread: threading.Thread | None = None

    def free_memory(self) -> int:
        """Bytes the caches may take: free GPU memory, or the machine's available memory on a CPU."""
        if self.bundle.device.type == "cuda":
            return torch.cuda.mem_get_info(self.bundle.device)[0]
        with open("/proc/meminfo") as f:
            return next(int(x.split()[1]) * 1024 for x in f if x.startswith("MemAvailable:"))

    def pid(self) -> int:
        return os.getpid()

    def resolved(self) -> dict:
        """What model.device and model.dtype resolved to here: the numbers an image's bytes come from."""
        return {"device": self.bundle.device.type, "dtype": str(self.bundle.dtype).removeprefix("torch.")}

    @staticmethod
    def node() -> str:
        import ray
        return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "local"

    def run(self, part: str, items: list[dict]) -> PartResult:
        """Generate one batch of prompts and commit it as part `part`. A failing prompt becomes an error row."""
        started = time.time()
        job = _Part(items)
        requests = []
        try:
            conds = self.bundle.conditions([it["prompt"] for it in items]).split()
        except Exception:                                # e.g. a prompt the text encoder cannot read: find it
            conds = [self._condition(it["prompt"]) for it in items]
        for i, (it, cond) in enumerate(zip(items, conds)):
            if isinstance(cond, str):
                job.add(i, Outcome((part, i), error=cond))
            else:
                requests.append(Request(cond, it["seed"], (part, i)))
        if requests:
            with self._lock:
                self._parts[part] = job
                self._engine_queue().put(requests)
        job.done.wait()
        with self._lock:
            self._parts.pop(part, None)
        done = [(it, job.outcomes[i].result) for i, it in enumerate(items) if job.outcomes[i].error is None]
        failed = [(it, job.outcomes[i].error) for i, it in enumerate(items) if job.outcomes[i].error is not None]
        for it, msg in failed:
            log.warning(f"prompt {it['prompt_id']!r} failed: {msg}")
        gen_s = sum(r.wall_s for _, r in done)           # engine time attributed to this part's images
        w0 = time.perf_counter()
        errors = error_table([it for it, _ in failed], [msg for _, msg in failed], self.engine.name, part)
        files = write_part(self.out_dir, part, self._images(done, part),
                   token_table([it["prompt_id"] for it, _ in done], [r.records for _, r in done], self.engine.name),
                   errors, self.token)
        return PartResult(part, [it["prompt_id"] for it in items], len(done), len(failed), self.engine.acceptance,
                          gen_s, time.perf_counter() - w0, [r.mean_accept_len for _, r in done],
                          [r.wall_s for _, r in done], [m for _, m in failed], self.node(), os.getpid(), started,
                          time.time(), files, sum(r.invalid_tokens for _, r in done))

    def _condition(self, prompt: str):
        try:
            return self.bundle.conditions([prompt])
        except Exception as e:
            return f"{type(e).__name__}: {e}"

    def _engine_queue(self) -> RequestQueue:
        """The queue the engine thread reads (called under the lock); a new thread if the last one died."""
        if self._thread is None or not self._thread.is_alive():
            self._queue = RequestQueue()
            self._thread = threading.Thread(target=self._decode, args=(self._queue,), daemon=True,
                                            name="arspec-engine")
            self._thread.start()
        return self._queue

    def _decode(self, queue: RequestQueue) -> None:
        try:
            for o in self.engine.stream(queue, self.slots):
                part, i = o.key
                with self._lock:
                    job = self._parts.get(part)
                if job is not None:
                    job.add(i, o)
        except BaseException as e:                        # the engine itself broke: fail what waits on it
            reason = f"{type(e).__name__}: {e}"
            log.error(f"engine thread failed: {traceback.format_exc(limit=5)}")
            with self._lock:
                queue.close()
                for job in self._parts.values():
                    for i in range(len(job.items)):
                        if i not in job.outcomes:
                            job.add(i, Outcome(None, error=reason))

    def _images(self, done, part: str) -> pa.Table:
        e, b = self.engine, self.bundle
        return pa.Table.from_pylist([{
            "prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"], "engine": e.name,
            "model": b.name, "image": {"bytes": png_bytes(r.image), "path": f"{it['prompt_id']}.png"},
            "width": r.image.shape[1], "height": r.image.shape[0], "num_tokens": len(r.tokens),
            "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards,
            "mean_accept_len": r.mean_accept_len, "wall_s": r.wall_s, "batch_size": round(r.batch) or self.slots,
            "acceptance": e.acceptance, "split": it.get("split"), "unknown_words": r.unknown_words,
            "invalid_tokens": r.invalid_tokens, "part": part}
            for it, r in done], schema=IMAGE_SCHEMA)
