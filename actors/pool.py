"""Runs a job's batches on a pool of Ray generator actors.

Ray Core actors rather than Ray Data `map_batches`: the job owns its resume (committed parts, see
output.py) because Ray Data's checkpoint filter hung on small CPU counts and its Parquet writer is
not atomic (docs/design.md, "Output contract"), and a batch must be retried as a unit, under the same
part name, so that a retry replaces rather than duplicates. Each actor loads the model once and keeps
two batches in flight, decoded together by continuous batching (generator.py). A killed actor is
restarted by Ray and its in-flight batches retried (max_restarts /
max_task_retries); a batch that keeps killing its actor is written as error rows after
`max_actor_restarts + 1` attempts, and the job goes on.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import deque
from pathlib import Path

import pyarrow as pa
import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.generator import Generator, PartResult
from actors.output import ERROR_SCHEMA, IMAGE_SCHEMA, TOKEN_SCHEMA, append_manifest, write_part

log = logging.getLogger("arspec.job")
IN_FLIGHT_PER_ACTOR = 2


def part_name(items: list[dict]) -> str:
    """Deterministic in the batch's prompt ids, so a retried batch rewrites the same part."""
    digest = hashlib.blake2b("\n".join(it["prompt_id"] for it in items).encode(), digest_size=8).hexdigest()
    return f"part-{digest}"


class Progress:
    def __init__(self, total: int, already: int, every_s: float = 2.0):
        self.total, self.already, self.every_s = total, already, every_s
        self.images = self.errors = 0
        self.t0 = self.last = time.time()

    def update(self, res: PartResult) -> None:
        self.images += res.images
        self.errors += res.errors
        now = time.time()
        if now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            rate = (self.images + self.errors) / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            log.info(f"[generate] {self.done}/{self.total} prompts ({self.errors} errors) "
                     f"{rate:.2f} img/s ETA {eta:.0f}s")

    @property
    def done(self) -> int:
        return self.already + self.images + self.errors


def _error_part(out_dir: Path, part: str, items: list[dict], engine: str, reason: str) -> PartResult:
    rows = [{"prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"], "engine": engine,
             "error": reason, "part": part} for it in items]
    write_part(out_dir, part, IMAGE_SCHEMA.empty_table(), TOKEN_SCHEMA.empty_table(),
               pa.Table.from_pylist(rows, schema=ERROR_SCHEMA))
    return PartResult(part, [it["prompt_id"] for it in items], 0, len(items), acceptance="",
                      error_messages=[reason] * len(items))


def run_batches(cfg, out_dir: Path, batches: list[list[dict]], progress: Progress) -> list[PartResult]:
    c = cfg.cluster
    actor_cls = ray.remote(Generator).options(
        num_cpus=c.num_cpus_per_actor, num_gpus=c.num_gpus_per_actor,
        max_restarts=c.max_actor_restarts, max_task_retries=c.max_actor_restarts,
        max_concurrency=IN_FLIGHT_PER_ACTOR + 1)          # its parts share the engine's rows (generator.py)
    n = max(1, min(c.num_actors, len(batches)))
    actors = [actor_cls.remote(cfg, str(out_dir)) for _ in range(n)]
    queue, attempts, inflight, results = deque(enumerate(batches)), {}, {}, []

    def submit(a: int) -> None:
        if queue:
            i, items = queue.popleft()
            inflight[actors[a].run.remote(part_name(items), items)] = (a, i, actors[a])

    for a in range(n):
        for _ in range(IN_FLIGHT_PER_ACTOR):
            submit(a)
    while inflight:
        (ref,), _ = ray.wait(list(inflight), num_returns=1)
        a, i, actor = inflight.pop(ref)
        try:
            res = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            attempts[i] = attempts.get(i, 0) + 1
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            log.warning(f"batch {part_name(batches[i])} failed (attempt {attempts[i]}): {reason}")
            if isinstance(e, RayActorError) and actors[a] is actor:  # restarts used up: replace it
                ray.kill(actor, no_restart=True)
                actors[a] = actor_cls.remote(cfg, str(out_dir))
            if attempts[i] <= c.max_actor_restarts:
                queue.appendleft((i, batches[i]))
                submit(a)
                continue
            res = _error_part(out_dir, part_name(batches[i]), batches[i], cfg.engine.name, reason)
        append_manifest(out_dir, res.part, res.prompt_ids, res.images, res.errors)
        results.append(res)
        progress.update(res)
        submit(a)
    return results
