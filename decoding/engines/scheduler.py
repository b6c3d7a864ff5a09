"""Continuous batching: a `SlotEngine` decodes a stream of prompts in a batch of rows and refills each row
as soon as its image is done; the `Scheduler` runs that loop over the engine's three calls:

    start(slots) -> state          a fresh batch (state.py: every field says how it follows its row)
    admit(state, rows, cond, seeds) prefill new prompts into `rows`, commit their first token
    step(state)                    one decoding step of every unfinished row (rows differ in state.log.n)

Rows regroup: when no request waits and at most half the rows are busy, the busy rows continue in a
batch of half as many rows (or a quarter, ...), and grow back to `slots` when requests come again. Every
row of a batch is computed, busy or not, so the last rows of a stream would otherwise pay for all of them.
"""
from __future__ import annotations

import time
from typing import ClassVar, Iterator

import torch

from decoding.bundle import Conditions
from decoding.engines.base import Engine, ImageResult
from decoding.engines.log import TokenLog
from decoding.engines.requests import Outcome, Request, requests_of


class _Row:
    """What a stream knows of the image a row decodes: its request, and its share of the engine's time."""
    def __init__(self, req: Request, wall: float):
        self.req, self.wall, self.phases = req, wall, {}
        self.steps, self.slots = 0, 0                 # steps it took part in, and their batches' slots in all


class SlotEngine(Engine):
    """An engine over the Scheduler: subclasses implement `start`, `admit` and `step` (module docstring)."""
    regroups: ClassVar[bool] = True    # rows regroup into smaller batches at the end of a stream

    @torch.inference_mode()
    def tokens(self, cond: Conditions, seeds) -> TokenLog:
        seeds = list(seeds)
        state = self.start(len(seeds))
        self.admit(state, torch.arange(len(seeds), device=self.device), cond, seeds)
        while bool((state.log.n < self.N).any()):
            self.step(state)
        return state.log

    def generate(self, cond: Conditions, seeds, images: bool = True) -> list[ImageResult]:
        """One batch: every prompt in its own row; raises if a prompt fails. images=False: tokens and
        records only (ImageResult.image None), for callers that never look at the pixels."""
        outcomes = {o.key: o for o in self.stream(
            [Request(c, s, b) for b, (c, s) in enumerate(zip(cond.split(), seeds))], slots=len(seeds),
            images=images)}
        failed = [o.error for o in outcomes.values() if o.error]
        if failed:
            raise RuntimeError(failed[0])
        return [outcomes[b].result for b in range(len(seeds))]

    def stream(self, requests, slots: int, images: bool = True) -> Iterator[Outcome]:
        """Decode requests (an iterable or a RequestQueue) in `slots` rows. Yields one Outcome per request,
        in the order they finish; an image's wall_s is its share of every step it took part in."""
        return Scheduler(self, requests, slots, images).run()

    def resize(self, old, keep: list, slots: int):
        """A fresh state of `slots` rows whose rows 0..k-1 continue old's rows `keep` (state.py)."""
        new = self.start(slots)
        src = torch.tensor(keep, dtype=torch.long, device=self.device)
        dst = torch.arange(len(keep), device=self.device)
        new.continue_rows(old, src, dst, self.cache_rows(src, old.slots), self.cache_rows(dst, slots))
        return new

    def refill_wait(self) -> int:
        """Tokens a free row waits for the batch's busy rows to finish before it takes a new prompt (0:
        never waits). Engines whose rows drift apart override it (tree.py)."""
        return 0

    def result(self, state, b: int, row: _Row, images: bool = True) -> ImageResult:
        """Row b's finished image (its pixels only if `images`)."""
        log = state.log
        t0 = time.perf_counter()
        tokens = self.row_tokens(state, b)
        image = self.bundle.decode(tokens[None])[0] if images else None
        wall = row.wall + time.perf_counter() - t0
        return ImageResult(tokens.numpy(), image, log.records(b), int(log.target_forwards[b]),
                           int(log.draft_forwards[b]), wall, row.phases, int(row.req.cond.unknown_words[0]),
                           row.slots / max(row.steps, 1))

    def row_tokens(self, state, b: int) -> torch.Tensor:
        """Row b's tokens on the host, a copy (the row is reused by the next prompt)."""
        return state.log.tokens[b].cpu().clone()

    def start(self, slots: int):
        raise NotImplementedError

    def admit(self, state, rows: torch.Tensor, cond: Conditions, seeds: list) -> None:
        raise NotImplementedError

    def step(self, state) -> None:
        raise NotImplementedError


class Scheduler:
    """One stream: which rows decode which requests, when rows refill, regroup, finish or fail."""

    def __init__(self, engine: SlotEngine, requests, slots: int, images: bool = True):
        self.engine, self.source, self.slots, self.images = engine, requests_of(requests), slots, images
        self.state, self.rows = None, []              # rows[b]: the image row b decodes (None: free)

    def run(self) -> Iterator[Outcome]:
        while True:
            if self.state is None:
                self.state, self.rows = self.engine.start(self.slots), [None] * self.slots
            taken = self._take()
            if taken is None:
                return
            yield from self._admit(taken)
            if not self._busy():
                continue                                     # every new prompt failed: take more
            yield from self._step()
            if self.state is not None:
                yield from self._finish()

    def _busy(self) -> list:
        return [b for b, row in enumerate(self.rows) if row is not None]

    def _take(self) -> list | None:
        """The requests to admit now ([] : none; None: the stream is done), regrouping up if needed."""
        busy = self._busy()
        room = self.slots - len(busy)                    # prompts it can take, regrouping to `slots` rows
        if room and busy and self._stays_in_step():
            room = 0                                     # the free rows wait: the batch restarts together
        taken = self.source.take(room, wait=not busy) if room else []
        if not busy and not taken:
            return None
        if len(taken) > self.state.slots - len(busy):   # more than a regrouped batch has rows: regroup up
            self._regroup(busy, self.slots)
        return taken

    def _stays_in_step(self) -> bool:
        """True when every busy row finishes within refill_wait() tokens: refilling now would start a new
        prompt that many steps behind the others, and then every step of the batch pays for it."""
        wait = self.engine.refill_wait()
        if wait <= 0:
            return False
        n = self.state.log.n.tolist()
        return max(self.engine.N - n[b] for b in self._busy()) <= wait

    def _admit(self, taken: list) -> Iterator[Outcome]:
        new = list(zip([b for b, row in enumerate(self.rows) if row is None], taken))
        if not new:
            return
        t0 = time.perf_counter()
        failed = self._admit_all(new)
        for b, r in new:
            if r.key in failed:                           # this prompt fails; its row stays free
                yield Outcome(r.key, error=failed[r.key])
            else:
                self.rows[b] = _Row(r, (time.perf_counter() - t0) / len(new))

    def _admit_all(self, new: list) -> dict:
        """Admit [(row, request)] together; if that fails, one by one, so that only the prompts that fail
        alone fail. Returns {key: reason} of the failed ones."""
        try:
            self._admit_group(new)
            return {}
        except Exception as e:
            if len(new) == 1:
                return {new[0][1].key: f"{type(e).__name__}: {e}"}
        failed = {}
        for x in new:
            try:
                self._admit_group([x])
            except Exception as e:
                failed[x[1].key] = f"{type(e).__name__}: {e}"
        return failed

    def _admit_group(self, group: list) -> None:
        e, state = self.engine, self.state
        rows = torch.tensor([b for b, _ in group], device=e.device)
        try:
            with torch.inference_mode():
                e.admit(state, rows, type(group[0][1].cond).cat([r.cond for _, r in group]), [r.seed for _, r in group])
        except Exception:
            state.log.n[rows] = e.N                               # the rows are free again
            raise

    def _step(self) -> Iterator[Outcome]:
        """One step of the batch; each stepping row's image is charged its share of the time. A failing
        step fails every prompt in it and the batch starts afresh."""
        e, log, busy = self.engine, self.state.log, self._busy()
        done = (log.n >= e.N).tolist()
        if any(done[b] for b in busy):
            return
        before, t0 = dict(log.phase_s), time.perf_counter()
        try:
            with torch.inference_mode():
                e.step(self.state)
        except Exception as ex:
            for b in busy:
                yield Outcome(self.rows[b].req.key, error=f"{type(ex).__name__}: {ex}")
            self.state = None
            return
        share = (time.perf_counter() - t0) / len(busy)
        for b in busy:
            row = self.rows[b]
            row.wall, row.steps, row.slots = row.wall + share, row.steps + 1, row.slots + self.state.slots
            for k, v in log.phase_s.items():
                row.phases[k] = row.phases.get(k, 0.0) + (v - before.get(k, 0.0)) / len(busy)

    def _finish(self) -> Iterator[Outcome]:
        """Yield the finished images, free their rows, and regroup down where at most half are busy."""
        done = (self.state.log.n >= self.engine.N).tolist()
        for b in self._busy():
            if done[b]:
                yield Outcome(self.rows[b].req.key, self.engine.result(self.state, b, self.rows[b], self.images))
                self.rows[b] = None
        busy = self._busy()
        if busy and len(busy) <= self.state.slots // 2 and not self.source.waiting():
            size = self.state.slots
            while len(busy) <= size // 2:
                size //= 2
            self._regroup(busy, size)

    def _regroup(self, keep: list, slots: int) -> None:
        """Continue rows `keep` in a batch of `slots` rows, first rows first; the time is the kept images'."""
        if not self.engine.regroups:
            return
        t0 = time.perf_counter()
        self.state = self.engine.resize(self.state, keep, slots)
        share = (time.perf_counter() - t0) / max(len(keep), 1)
        for b in keep:
            self.rows[b].wall += share
        self.rows = [self.rows[b] for b in keep] + [None] * (slots - len(keep))
