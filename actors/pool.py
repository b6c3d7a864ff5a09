"""Runs a job's batches on a pool of Ray generator actors.

Ray Core actors rather than Ray Data `map_batches`: the job owns its resume (committed parts, see
output.py) because Ray Data's checkpoint filter hung on small CPU counts and its Parquet writer is
not atomic (docs/design.md, "Output contract"), and a batch must be retried as a unit, under the same part name, so that a
retry replaces rather than duplicates. Each actor loads the model once and keeps two batches in
flight. A killed actor is restarted by Ray and its in-flight batches retried (max_restarts /
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


def ids_digest(prompt_ids) -> str:
    return hashlib.blake2b("\n".join(prompt_ids).encode(), digest_size=8).hexdigest()


def part_name(items: list[dict]) -> str:
    """`part-START-STOP-DIGEST`: the batch's positions [START, STOP) in the prompt set (its items are
    consecutive) and a digest of its prompt ids. Deterministic, so a retried batch rewrites the same
    part; the names alone are the committed-part index a resume reads (docs/design.md, "Prompt streaming")."""
    start = items[0]["position"]
    return f"part-{start:010d}-{start + len(items):010d}-{ids_digest(it['prompt_id'] for it in items)}"


def part_span(name: str):
    """-> (start, stop, digest) of a part name, or None for a name without positions."""
    bits = name.split("-")
    if len(bits) != 4 or bits[0] != "part" or not (bits[1].isdigit() and bits[2].isdigit()):
        return None
    return int(bits[1]), int(bits[2]), bits[3]


class ActorStartError(RuntimeError):
    """The actors could not start (e.g. the model failed to load in them)."""


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


def run_batches(cfg, out_dir: Path, batches, progress: Progress, placements: list) -> None:
    """Run `batches` (an iterator: only the batches in flight are held) on one actor per entry of
    `placements` (a Ray scheduling strategy, e.g. a placement group bundle, or None), reporting each
    committed part to `progress.update`."""
    c = cfg.cluster
    actor_cls = ray.remote(Generator)

    def spawn(a: int):
        return actor_cls.options(num_cpus=c.num_cpus_per_actor, num_gpus=c.num_gpus_per_actor,
                                 max_restarts=c.max_actor_restarts, max_task_retries=c.max_actor_restarts,
                                 scheduling_strategy=placements[a]).remote(cfg, str(out_dir))

    n = len(placements)
    actors = [spawn(a) for a in range(n)]
    try:  # an actor that cannot even start (its model does not load) fails the job in one line
        ray.get([x.pid.remote() for x in actors])
    except RayActorError as e:
        lines = [x.strip() for x in str(e).splitlines() if x.strip()]
        at = max((i for i, x in enumerate(lines) if "Error" in x.split(":")[0]), default=len(lines) - 1)
        cause = " ".join(lines[at:at + 2])        # the exception raised in the actor's __init__, and its detail
        raise ActorStartError(f"the generator actors could not start: {cause[:300]}") from None
    batches = iter(batches)
    retry, attempts, inflight = deque(), {}, {}

    def submit(a: int) -> None:
        items = retry.popleft() if retry else next(batches, None)
        if items is not None:
            inflight[actors[a].run.remote(part_name(items), items)] = (a, items, actors[a])

    for a in range(n):
        for _ in range(IN_FLIGHT_PER_ACTOR):
            submit(a)
    while inflight:
        (ref,), _ = ray.wait(list(inflight), num_returns=1)
        a, items, actor = inflight.pop(ref)
        part = part_name(items)
        try:
            res = ray.get(ref)
        except (RayActorError, RayTaskError) as e:
            attempts[part] = attempts.get(part, 0) + 1
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            log.warning(f"batch {part} failed (attempt {attempts[part]}): {reason}")
            if isinstance(e, RayActorError) and actors[a] is actor:  # restarts used up: replace it
                ray.kill(actor, no_restart=True)
                actors[a] = spawn(a)
            if attempts[part] <= c.max_actor_restarts:
                retry.appendleft(items)
                submit(a)
                continue
            res = _error_part(out_dir, part, items, cfg.engine.name, reason)
        attempts.pop(part, None)
        append_manifest(out_dir, res.part, res.prompt_ids, res.images, res.errors)
        progress.update(res)
        submit(a)
