"""Runs a job's batches on a pool of Ray generator actors.

Ray Core actors rather than Ray Data `map_batches`: the job owns its resume (committed parts, see
output.py) because Ray Data's checkpoint filter hung on small CPU counts and its Parquet writer is
not atomic (docs/design.md, "Output contract"), and a batch must be retried as a unit, under the same
part name, so that a retry replaces rather than duplicates. Each actor loads the model once and keeps
two batches in flight, decoded together by continuous batching (generator.py). A killed actor is
restarted by Ray and its in-flight batches retried (max_restarts /
max_task_retries); a batch that keeps killing its actor is written as error rows after
`max_actor_restarts + 1` attempts, and the job goes on. An actor's death fails every batch it held, so
a batch that died beside another one is not charged: it is retried alone on an actor (`solo`), and
only deaths alone count as its attempts (else the batch beside a poisoned one became error rows too).
A lost node's actors are dropped from the pool and their batches go to the others without counting as
attempts (Ray would restart them only where there is room, and may wait forever). An OutDirError (disk full, read-only, permission) stops
the job at once: no retry can fix it; so does a lock another job took over (output.check_lock). A `stop` (SIGTERM, workflows/lock.py) ends the queue; in-flight
batches may finish until its deadline, then the actors are killed (their parts stay uncommitted).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

import pyarrow as pa
import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.generator import Generator, PartResult
from actors.store import is_remote
from actors.output import (ERROR_SCHEMA, IMAGE_SCHEMA, TOKEN_SCHEMA, JobExit, append_manifest, check_lock,
                           check_part, manifest_entry, part_name, write_part)

log = logging.getLogger("arspec.job")
IN_FLIGHT_PER_ACTOR = 2
NODE_CHECK_S = 2.0          # how often the driver looks for lost nodes


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


def _error_part(out_dir: Path, part: str, items: list[dict], engine: str, reason: str, token=None) -> PartResult:
    rows = [{"prompt_id": it["prompt_id"], "prompt": it["prompt"], "seed": it["seed"], "engine": engine,
             "error": reason, "part": part} for it in items]
    files = write_part(out_dir, part, IMAGE_SCHEMA.empty_table(), TOKEN_SCHEMA.empty_table(),
                       pa.Table.from_pylist(rows, schema=ERROR_SCHEMA), token)
    return PartResult(part, [it["prompt_id"] for it in items], 0, len(items), acceptance="",
                      error_messages=[reason] * len(items), files=files)


def record_part(out_dir: Path, res: PartResult, token=None) -> None:
    """The part's manifest line, with its files' sizes, rows and checksums (read back if not reported),
    while the job holds its lock (`token`, output.check_lock)."""
    check_lock(out_dir, token)
    files = res.files or check_part(out_dir, res.part, None, full=True)[1]["files"]
    append_manifest(out_dir, manifest_entry(res.part, res.prompt_ids, res.images, res.errors, files))


class NodeWatch:
    """Which actor runs on which node (each actor's first call answers it), and which nodes died."""

    def __init__(self):
        self.where, self.node, self.checked = {}, {}, time.time()

    def track(self, a: int, actor) -> None:
        self.where[a] = actor.node.remote()
        self.node.pop(a, None)

    def lost(self, actors: list) -> list[int]:
        """Indices of live actors whose node is dead (looked up every NODE_CHECK_S)."""
        if time.time() - self.checked < NODE_CHECK_S:
            return []
        self.checked = time.time()
        for a, ref in list(self.where.items()):
            if ray.wait([ref], timeout=0)[0]:
                try:
                    self.node[a] = ray.get(ref)
                except (RayActorError, RayTaskError):
                    pass
                del self.where[a]
        dead = {n["NodeID"] for n in ray.nodes() if not n["Alive"]}
        return [a for a, n in self.node.items() if n in dead and actors[a] is not None]


def _start_error(e: RayActorError) -> ActorStartError:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    at = max((i for i, x in enumerate(lines) if "Error" in x.split(":")[0]), default=len(lines) - 1)
    cause = " ".join(lines[at:at + 2])        # the exception raised in the actor's __init__, and its detail
    return ActorStartError(f"the generator actors could not start: {cause[:300]}")


def run_batches(cfg, out_dir: Path, batches, progress, placements: list, stop=None, token=None,
                prompts=None, resolved=None) -> None:
    """Run `batches` (an iterator: only the batches in flight are held, workflows/plan.py) on one actor
    per entry of `placements` (a Ray scheduling strategy, e.g. a placement group bundle, or None),
    reporting each committed part to `progress.update`. `token`: the job's lock, checked before every
    commit (actors and driver). `prompts`: how many are pending, the most rows an actor needs.
    `resolved(list of Generator.resolved)`: called once every actor has started, before any part; it
    may refuse the run (raise)."""
    c = cfg.cluster
    actor_cls = ray.remote(Generator)

    # an object-store out_dir: the actors write with the driver's store settings (credentials, endpoint)
    env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")} if is_remote(out_dir) else {}

    def spawn(a: int):
        return actor_cls.options(num_cpus=c.num_cpus_per_actor, num_gpus=c.num_gpus_per_actor,
                                 max_restarts=c.max_actor_restarts, max_task_retries=c.max_actor_restarts,
                                 max_concurrency=IN_FLIGHT_PER_ACTOR + 1,   # its parts share the engine's rows
                                 runtime_env={"env_vars": env} if env else None,
                                 scheduling_strategy=placements[a]).remote(cfg, str(out_dir), token, prompts)

    n = len(placements)
    actors = [spawn(a) for a in range(n)]
    try:  # an actor that cannot even start (its model does not load) fails the job in one line
        ray.get([x.pid.remote() for x in actors])
        seen = ray.get([x.resolved.remote() for x in actors])
    except RayActorError as e:
        raise _start_error(e) from None
    if resolved is not None:
        resolved(seen)
    batches = iter(batches)
    queue, attempts, inflight, lost = deque(), {}, {}, set()   # queue: retried or peeked batches, first
    solo, shared = set(), set()       # parts to run alone on an actor; in-flight refs that had company
    nodes = NodeWatch()
    for a in range(n):
        nodes.track(a, actors[a])

    def submit(a: int) -> None:
        """Fill actor a's slots (IN_FLIGHT_PER_ACTOR) from the queue; a `solo` batch runs alone."""
        while actors[a] is not None and not stop:
            mine = [ref for ref, (_, items, actor) in inflight.items() if actor is actors[a]]
            if len(mine) >= IN_FLIGHT_PER_ACTOR or any(part_name(inflight[r][1]) in solo for r in mine):
                return
            if not more() or (mine and part_name(queue[0]) in solo):
                return                        # (a solo batch waits for this actor to drain)
            items = queue.popleft()
            ref = actors[a].run.remote(part_name(items), items)
            inflight[ref] = (a, items, actors[a])
            if mine:
                shared.update([ref, *mine])

    def more() -> bool:   # batches left to submit (peeks the iterator into `queue`)
        if queue:
            return True
        nxt = next(batches, None)
        if nxt is None:
            return False
        queue.append(nxt)
        return True

    for a in range(n):
        submit(a)
    while inflight or (not stop and more()):
        if not inflight:   # every actor was lost with its node: start new ones where Ray finds room
            for a in range(n):
                actors[a] = spawn(a)
                nodes.track(a, actors[a])
                submit(a)
        if stop and time.time() >= stop.deadline:
            log.warning(f"[generate] grace period over: dropping {len(inflight)} in-flight batch(es), uncommitted")
            break
        for a in nodes.lost(actors):
            log.warning(f"[generate] actor {a} was on a lost node: its batches go to the other actors")
            lost.add(actors[a])
            ray.kill(actors[a], no_restart=True)
            actors[a] = None
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
        if not ready:
            continue
        a, items, actor = inflight.pop(ready[0])
        part, had_company = part_name(items), ready[0] in shared
        shared.discard(ready[0])
        try:
            res = ray.get(ready[0])
        except (RayActorError, RayTaskError) as e:
            if isinstance(getattr(e, "cause", None), JobExit):
                raise e.cause from None         # disk full, read-only, permission, lock lost: no retry can help
            if actor in lost:                   # its node died: not the batch's fault
                queue.appendleft(items)
                submit(next((b for b in range(n) if actors[b] is not None), a))
                continue
            reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
            if isinstance(e, RayActorError) and actors[a] is actor:  # restarts used up: replace it
                ray.kill(actor, no_restart=True)
                actors[a] = spawn(a)
                nodes.track(a, actors[a])
            if isinstance(e, RayActorError) and had_company:   # which batch killed it is unknown
                log.warning(f"batch {part} failed beside another batch on its actor ({reason}): retrying it alone")
                solo.add(part)
                queue.appendleft(items)
                submit(a)
                continue
            attempts[part] = attempts.get(part, 0) + 1
            log.warning(f"batch {part} failed (attempt {attempts[part]}): {reason}")
            if attempts[part] <= c.max_actor_restarts:
                queue.appendleft(items)
                submit(a)
                continue
            res = _error_part(out_dir, part, items, cfg.engine.name, reason, token)
        attempts.pop(part, None)
        solo.discard(part)
        record_part(out_dir, res, token)
        progress.update(res)
        submit(a)
    if stop:
        for actor in actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)
