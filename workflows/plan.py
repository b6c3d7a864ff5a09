"""The job's batches, planned from a streamed prompt set and out_dir's committed-part index
(docs/design.md, "Prompt streaming").

A batch is a run of consecutive positions of the prompt set, and its part is named by them
(`part-START-STOP-DIGEST`, actors/pool.py), so the names of the committed parts — a directory listing —
say which positions are done: a resume holds three integers per committed part, never every prompt id.
Walking the stream past a committed part recomputes the digest of the ids now at its positions, so a
prompt file that changed under an out_dir is refused instead of silently mixed in.

`Plan` makes two passes over the stream with bounded memory: `check()` (counts, committed-part
digests, duplicate ids; before Ray starts, so a bad file or out_dir fails at once) and `batches()` (what
the pool consumes, lazily: only the batches in flight exist).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from actors.output import ids_digest, part_span
from decoding.sampling import prompt_seed
from workflows.config import ConfigError
from workflows.prompts import PromptSource, UniqueIds


class CommittedIndex:
    """Committed parts as positions [start, stop) and id digests, sorted by start: 24 bytes a part."""

    def __init__(self, out_dir: Path, names: Iterable[str]):
        starts, stops, digests, self.names = array("q"), array("q"), [], []
        for name in names:
            span = part_span(name)
            if span is None:
                raise ConfigError(f"out_dir={out_dir} holds part {name}, named before parts recorded their "
                                  f"positions: finish it with the arspec that wrote it, or use a new out_dir")
            starts.append(span[0])
            stops.append(span[1])
            digests.append(int(span[2], 16))
        order = np.argsort(np.frombuffer(starts, np.int64), kind="stable")
        self.starts = np.frombuffer(starts, np.int64)[order]
        self.stops = np.frombuffer(stops, np.int64)[order]
        self.digests = np.array(digests, np.uint64)[order]
        self.out_dir = out_dir

    def __len__(self) -> int:
        return len(self.starts)

    def name(self, k: int) -> str:
        return f"part-{self.starts[k]:010d}-{self.stops[k]:010d}-{int(self.digests[k]):016x}"


@dataclass
class PlanStats:
    prompts: int = 0      # in the prompt set (after data.limit)
    already: int = 0      # of them in a committed part
    pending: int = 0
    batches: int = 0


def _walk(source: PromptSource, index: CommittedIndex, batch_size: int, seed, stats: PlanStats,
          on_chunk=None) -> Iterator[list[dict]]:
    """Batches of consecutive pending positions (a committed part ends a batch), each item
    {prompt_id, prompt, split, position, seed} (seed=None: the rows as read, for counting); verifies every
    committed part it walks through."""
    starts, stops = index.starts, index.stops
    k, covered_to, pos, batch = 0, 0, 0, []
    active: list[tuple[int, list[str]]] = []       # committed parts being walked through: (k, ids so far)
    for chunk in source.chunks():
        if on_chunk:
            on_chunk(chunk)
        for row in chunk:
            while k < len(starts) and starts[k] <= pos:
                active.append((k, []))
                covered_to = max(covered_to, int(stops[k]))
                k += 1
            if active:
                for j, ids in active:
                    ids.append(row["prompt_id"])
                done = [(j, ids) for j, ids in active if pos + 1 == stops[j]]
                for j, ids in done:
                    if int(ids_digest(ids), 16) != int(index.digests[j]):
                        raise ConfigError(f"out_dir={index.out_dir}: part {index.name(j)} holds other prompts than "
                                          f"positions {starts[j]}..{stops[j] - 1} of the prompt set now (the prompt "
                                          f"file changed?): use a new out_dir, or the prompts it was made from")
                    active.remove((j, ids))
            if pos < covered_to:
                stats.already += 1
                if batch:
                    yield batch
                    batch = []
            else:
                batch.append(row if seed is None else {**row, "position": pos, "seed": prompt_seed(seed, row["prompt_id"])})
                stats.pending += 1
                if len(batch) == batch_size:
                    yield batch
                    batch = []
            pos += 1
    stats.prompts = pos
    if batch:
        yield batch


class Plan:
    def __init__(self, source: PromptSource, index: CommittedIndex, batch_size: int, seed: int, check=None):
        """check(chunk): raises on prompts the model cannot take (decoding.registry.prompt_check)."""
        self.source, self.index, self.batch_size, self.seed = source, index, batch_size, seed
        self.stats, self._check = PlanStats(), check

    def check(self) -> PlanStats:
        """The counting and checking pass (no batch is kept)."""
        stats, ids = PlanStats(), UniqueIds(self.source)

        def on_chunk(chunk):
            ids.add(chunk)
            if self._check is not None:
                self._check(chunk)
        for _ in _walk(self.source, self.index, self.batch_size, None, stats, on_chunk):
            stats.batches += 1
        ids.finish()
        self.stats = stats
        return stats

    def batches(self) -> Iterator[list[dict]]:
        return _walk(self.source, self.index, self.batch_size, self.seed, PlanStats())
