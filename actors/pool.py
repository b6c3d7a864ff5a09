"""Runs a job's batches on a pool of Ray generator actors.

Ray Core actors rather than Ray Data `map_batches`: the job owns its resume (committed parts, see
output.py) because Ray Data's checkpoint filter hung on small CPU counts and its Parquet writer is
not atomic (docs/design.md, "Output contract"), and a batch must be retried as a unit, under the same
part name, so that a retry replaces rather than duplicates. Each actor loads the model once and decodes
one batch at a time, and batch k of the plan goes to actor k mod n: an image's batch-mates, and what its
engine learnt from the batches before it, are then the same on every run of the command, so bytes that
depend on them (bf16) repeat (docs/design.md, "The job on a cluster"). A killed actor is restarted by
Ray and its batch retried (max_restarts / max_task_retries); a batch that keeps killing its actor is
written as error rows after `max_actor_restarts + 1` attempts, and the job goes on. A lost node's
actors are dropped from the pool and their batches go to the others without counting as attempts (Ray
would restart them only where there is room, and may wait forever). An OutDirError (disk full,
read-only, permission) stops the job at once: no retry can fix it; so does a lock another job took
over (output.check_lock). A `stop` (SIGTERM, workflows/lock.py) ends the queue; in-flight batches may
finish until its deadline, then the actors are killed (their parts stay uncommitted).
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path

import ray
from ray.exceptions import RayActorError, RayTaskError

from actors.generator import Generator, PartResult
from actors.store import is_remote
from actors.output import (IMAGE_SCHEMA, TOKEN_SCHEMA, JobExit, append_manifest, check_lock, error_table,
                           check_part, manifest_entry, part_name, write_part)

log = logging.getLogger("arspec.job")
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
    files = write_part(out_dir, part, IMAGE_SCHEMA.empty_table(), TOKEN_SCHEMA.empty_table(),
                       error_table(items, [reason] * len(items), engine, part), token)
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


class _Pool:
    """One job's actors, each running one batch at a time, and the batches each is to run next:
    `queues[a]`, filled from the plan in turn (batch k to actor k mod n; a dropped actor's turn goes to
    the next live one) and, first, with retried batches. Only the batches in flight and those pulled
    ahead for an actor slower than another are held."""

    def __init__(self, cfg, out_dir: Path, batches, placements: list, stop, token, prompts):
        self.cfg, self.out_dir, self.placements, self.stop = cfg, out_dir, placements, stop
        self.token, self.prompts = token, prompts
        self.actor_cls = ray.remote(Generator)
        # an object-store out_dir: the actors write with the driver's store settings (credentials, endpoint)
        self.env = {k: v for k, v in os.environ.items() if k.startswith("AWS_")} if is_remote(out_dir) else {}
        self.batches, self.pulled = iter(batches), 0
        self.queues = [deque() for _ in placements]
        self.attempts, self.inflight, self.lost = {}, {}, set()
        self.nodes = NodeWatch()
        self.actors: list = [None] * len(placements)

    def spawn(self, a: int) -> None:
        c = self.cfg.cluster
        self.actors[a] = self.actor_cls.options(
            num_cpus=c.num_cpus_per_actor, num_gpus=c.num_gpus_per_actor, max_restarts=c.max_actor_restarts,
            max_task_retries=c.max_actor_restarts,
            max_concurrency=2,                        # its batch, and the driver's questions beside it
            runtime_env={"env_vars": self.env} if self.env else None,
            scheduling_strategy=self.placements[a]).remote(self.cfg, str(self.out_dir), self.token, self.prompts)
        self.nodes.track(a, self.actors[a])

    def start(self) -> list:
        """Every actor started; what each resolved (Generator.resolved). An actor that cannot even start
        (its model does not load) fails the job in one line."""
        for a in range(len(self.actors)):
            self.spawn(a)
        try:
            ray.get([x.pid.remote() for x in self.actors])
            return ray.get([x.resolved.remote() for x in self.actors])
        except RayActorError as e:
            raise _start_error(e) from None

    def live(self) -> list[int]:
        return [a for a, actor in enumerate(self.actors) if actor is not None]

    def more(self, a: int | None = None) -> bool:
        """Whether actor a (None: any actor) has a batch to run, pulling the plan's batches in turn."""
        while not (self.queues[a] if a is not None else any(self.queues)):
            items = next(self.batches, None)
            if items is None:
                return False
            turn, self.pulled = self.pulled % len(self.actors), self.pulled + 1
            live = self.live() or [turn]
            self.queues[min(live, key=lambda b: (b - turn) % len(self.actors))].append(items)
        return True

    def submit(self, a: int) -> None:
        """Start actor a's next batch, unless it runs one."""
        actor = self.actors[a]
        if actor is None or self.stop or any(x is actor for _, _, x in self.inflight.values()) or not self.more(a):
            return
        items = self.queues[a].popleft()
        self.inflight[actor.run.remote(part_name(items), items)] = (a, items, actor)

    def drop_lost_nodes(self) -> None:
        for a in self.nodes.lost(self.actors):
            log.warning(f"[generate] actor {a} was on a lost node: its batches go to the other actors")
            self.lost.add(self.actors[a])
            ray.kill(self.actors[a], no_restart=True)
            self.actors[a] = None
            live = self.live()
            if live:                          # (none live: run_batches spawns new actors, which take the queue)
                for i, items in enumerate(self.queues[a]):
                    self.queues[live[i % len(live)]].append(items)
                self.queues[a].clear()
                for b in live:
                    self.submit(b)

    def next_done(self):
        """Wait up to a second for an in-flight batch: (its actor's index, the part to commit), or None
        where none finished or the batch went back to the queue."""
        ready, _ = ray.wait(list(self.inflight), num_returns=1, timeout=1.0)
        if not ready:
            return None
        a, items, actor = self.inflight.pop(ready[0])
        try:
            res = ray.get(ready[0])
        except (RayActorError, RayTaskError) as e:
            res = self._failed(a, items, actor, e)
            if res is None:
                return None
        self.attempts.pop(part_name(items), None)
        return a, res

    def _failed(self, a: int, items: list, actor, e: Exception):
        """A batch whose task raised: back to the queue (None), or its error rows once its attempts are
        used up."""
        part = part_name(items)
        if isinstance(getattr(e, "cause", None), JobExit):
            raise e.cause from None             # disk full, read-only, permission, lock lost: no retry can help
        if actor in self.lost:                  # its node died: not the batch's fault
            return self._retry(next(iter(self.live()), a), items)
        reason = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
        if isinstance(e, RayActorError) and self.actors[a] is actor:  # restarts used up: replace it
            ray.kill(actor, no_restart=True)
            self.spawn(a)
        self.attempts[part] = self.attempts.get(part, 0) + 1
        log.warning(f"batch {part} failed (attempt {self.attempts[part]}): {reason}")
        if self.attempts[part] <= self.cfg.cluster.max_actor_restarts:
            return self._retry(a, items)
        return _error_part(self.out_dir, part, items, self.cfg.engine.name, reason, self.token)

    def _retry(self, a: int, items: list) -> None:
        self.queues[a].appendleft(items)
        self.submit(a)

    def kill_all(self) -> None:
        for actor in self.actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)


def run_batches(cfg, out_dir: Path, batches, progress, placements: list, stop=None, token=None,
                prompts=None, resolved=None) -> None:
    """Run `batches` (an iterator: only the batches in flight are held, workflows/plan.py) on one actor
    per entry of `placements` (a Ray scheduling strategy, e.g. a placement group bundle, or None),
    reporting each committed part to `progress.update`. `token`: the job's lock, checked before every
    commit (actors and driver). `prompts`: how many are pending, the most rows an actor needs.
    `resolved(list of Generator.resolved)`: called once every actor has started, before any part; it
    may refuse the run (raise)."""
    pool = _Pool(cfg, out_dir, batches, placements, stop, token, prompts)
    seen = pool.start()
    if resolved is not None:
        resolved(seen)
    n = len(placements)
    for a in range(n):
        pool.submit(a)
    while pool.inflight or (not stop and pool.more()):
        if not pool.inflight:   # every actor was lost with its node: start new ones where Ray finds room
            for a in range(n):
                if pool.actors[a] is None:
                    pool.spawn(a)
                pool.submit(a)
        if stop and time.time() >= stop.deadline:
            log.warning(f"[generate] grace period over: dropping {len(pool.inflight)} in-flight batch(es), "
                        "uncommitted")
            break
        pool.drop_lost_nodes()
        done = pool.next_done()
        if done is not None:
            a, res = done
            record_part(out_dir, res, token)
            progress.update(res)
            pool.submit(a)
    if stop:
        pool.kill_all()
