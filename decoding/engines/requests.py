"""Prompts for an engine's `stream`: a request, its outcome, and a queue producers fill while it runs."""
from __future__ import annotations

import itertools
import threading
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from decoding.bundle import Conditions

if TYPE_CHECKING:
    from decoding.engines.base import ImageResult


@dataclass
class Request:
    """One prompt for `Engine.stream`: its conditions (a batch of one), its seed, the caller's key."""
    cond: Conditions
    seed: int
    key: Any = None


@dataclass
class Outcome:
    key: Any
    result: ImageResult | None = None
    error: str | None = None      # why the prompt failed (the engine goes on with the others)


class RequestQueue:
    """Requests that arrive while an engine runs (an actor's parts): producers `put` them and finally
    `close`; `Engine.stream` `take`s up to n at a time, blocking only when it has nothing else to do.
    Thread-safe. A plain iterable of requests works as a closed queue (`requests_of`)."""

    def __init__(self):
        self._items: deque = deque()
        self._closed = False
        self._cv = threading.Condition()

    def put(self, requests: Iterable[Request]) -> None:
        with self._cv:
            self._items.extend(requests)
            self._cv.notify_all()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def take(self, n: int, wait: bool) -> list[Request]:
        """Up to n requests; with `wait`, block until there is one or the queue is closed ([] = done)."""
        with self._cv:
            while wait and not self._items and not self._closed:
                self._cv.wait()
            return [self._items.popleft() for _ in range(min(n, len(self._items)))]

    def waiting(self) -> bool:
        """Whether a request is there to take now."""
        with self._cv:
            return bool(self._items)


class _Iterated:
    def __init__(self, requests: Iterable[Request]):
        self._it, self._next = iter(requests), []

    def take(self, n: int, wait: bool) -> list[Request]:
        got, self._next = self._next[:n], self._next[n:]
        return got + list(itertools.islice(self._it, n - len(got)))

    def waiting(self) -> bool:
        self._next = self._next or list(itertools.islice(self._it, 1))
        return bool(self._next)


def requests_of(requests) -> RequestQueue | _Iterated:
    return requests if hasattr(requests, "take") else _Iterated(requests)
