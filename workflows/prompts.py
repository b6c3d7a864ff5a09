"""Prompt readers: built-in shapes, Parquet, CSV, TSV (PartiPrompts), JSONL, a JSON list of strings (the
COCO caption list) or of objects, and class ids for class-conditional models (a `class_id` column, or
`data=imagenet_classes`). Text is kept exactly as written (an integer prompt becomes its digits, which
a c2i model reads back as the class id); every problem with the file or its columns is a ConfigError
naming the setting to change.

The job streams its prompts (docs/design.md, "Prompt streaming"): `PromptSource(cfg).chunks()` yields them
in file order, a chunk at a time — a Parquet file by record batches of the columns it uses (at most one
row group in memory), CSV/TSV and JSONL line by line — so the driver's memory does not grow with the
prompt set. A JSON list is one document and is read whole (use JSONL for large sets).
"""
from __future__ import annotations

import csv
import hashlib
import io
import json
from itertools import islice
from typing import Iterator, Optional

import numpy as np
import pyarrow.parquet as pq

from decoding.shapes.world import builtin_prompts
from workflows.config import ConfigError, DataConfig

PROMPT_COLUMNS = ("prompt", "Prompt", "caption", "text", "class_id")
IMAGENET_CLASSES = 1000
FORMATS = (".parquet", ".csv", ".tsv", ".jsonl", ".json")
CHUNK = 8192          # rows per chunk handed to the planner


def derived_id(position: int, text) -> str:
    """Stable id from position + content, for files without an id column."""
    digest = hashlib.blake2b(str(text).encode(), digest_size=5).hexdigest()
    return f"{position:06d}-{digest}"


def _chunked(rows, n: int = CHUNK) -> Iterator[list[dict]]:
    it = iter(rows)
    while chunk := list(islice(it, n)):
        yield chunk


def class_prompts(cfg: DataConfig) -> list[dict]:
    """`per_class` prompts for each class id (null: the 1000 ImageNet classes), class by class."""
    classes = list(range(IMAGENET_CLASSES)) if cfg.classes is None else list(cfg.classes)
    if cfg.per_class < 1:
        raise ConfigError(f"data.per_class={cfg.per_class}: must be >= 1")
    bad = [c for c in classes if isinstance(c, bool) or not isinstance(c, int) or c < 0]
    if bad or len(set(classes)) != len(classes):
        raise ConfigError(f"data.classes: must be distinct class ids >= 0 (got {bad[0] if bad else 'duplicates'})")
    return [{"prompt_id": f"class{c:04d}-{k:03d}", "prompt": str(c), "split": None}
            for c in classes for k in range(cfg.per_class)]


def _prompt(value):
    """A prompt as the job carries it: text as written, an integer (a class id) as its digits."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


def text(path, newline=None):
    """A text file opened for streaming, from a disk or an object store (actors/store.py)."""
    from actors.store import ObjPath
    if isinstance(path, ObjPath):
        return io.TextIOWrapper(io.BufferedReader(path.stream()), encoding="utf-8-sig", newline=newline)
    return open(path, encoding="utf-8-sig", newline=newline)


def source(path):
    from actors.store import source as src
    return src(path)


class PromptSource:
    """A prompt set, read a chunk at a time. Opening it checks the file and its columns (ConfigError);
    `chunks()` yields lists of {"prompt_id", "prompt", "split"} in file order, at most cfg.limit rows in
    all. `total` is the row count when the format tells it without a pass (Parquet, JSON, built-in),
    else None."""

    def __init__(self, cfg: DataConfig):
        if cfg.limit is not None and cfg.limit < 0:
            raise ConfigError(f"data.limit={cfg.limit}: must be >= 0, or null for all prompts")
        self.cfg, self.total, self._rows = cfg, None, None
        if cfg.name == "shapes":
            self._rows = builtin_prompts(cfg.builtin_count)
            self.total = len(self._rows)
        elif cfg.name == "file":
            self._open_file()
        elif cfg.name == "imagenet_classes":
            self._rows = class_prompts(cfg)
            self.total = len(self._rows)
        else:
            raise ConfigError(f"data.name={cfg.name!r}: use 'shapes' (built-in), 'file' with data.path=..., "
                              f"or 'imagenet_classes' (class ids)")
        if self.total is not None and cfg.limit is not None:
            self.total = min(self.total, cfg.limit)

    def _open_file(self) -> None:
        cfg = self.cfg
        if not cfg.path:
            raise ConfigError("data.path is not set: point it at a prompt file (Parquet, CSV, TSV, JSONL or JSON)")
        from actors.store import StoreConfigError, at
        try:       # a local path, or a URI: s3://bucket/prompts.parquet (streamed from the store as from a disk)
            self.path = path = at(cfg.path)
        except StoreConfigError as e:
            raise ConfigError(f"data.path={e}") from None
        if path.is_dir():
            raise ConfigError(f"data.path={cfg.path}: is a directory; point it at a prompt file in it "
                              f"({', '.join(FORMATS)})")
        if not path.is_file():
            raise ConfigError(f"data.path={cfg.path}: no such file")
        self.suffix = path.suffix.lower()
        if self.suffix not in FORMATS:
            raise ConfigError(f"data.path={cfg.path}: unknown format {path.suffix!r}; use one of {', '.join(FORMATS)}")
        columns = self._guard(self._columns)
        if columns is None:  # an empty file: no prompts
            self.prompt_col = None
            self.total = 0
            return
        prompt_col = cfg.prompt_column or next((c for c in PROMPT_COLUMNS if c in columns), None)
        if prompt_col is None or prompt_col not in columns:
            raise ConfigError(f"data.prompt_column={prompt_col!r}: no such column in {cfg.path}; "
                              f"columns are {columns}")
        if cfg.id_column is not None and cfg.id_column not in columns:
            raise ConfigError(f"data.id_column={cfg.id_column!r}: no such column in {cfg.path}; columns are {columns}")
        self.prompt_col, self.has_split = prompt_col, "split" in columns

    def _guard(self, fn, *args):
        """Any parse failure is a bad input file: one line naming data.path."""
        try:
            return fn(*args)
        except ConfigError:
            raise
        except UnicodeDecodeError as e:
            raise ConfigError(f"data.path={self.cfg.path}: not UTF-8 text (it holds byte "
                              f"{e.object[e.start]:#x}, e.g. Latin-1): save it as UTF-8") from None
        except Exception as e:
            raise ConfigError(f"data.path={self.cfg.path}: cannot read it as {self.path.suffix}: {type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}") from None

    def _columns(self) -> Optional[list[str]]:
        """The file's column names (None: it holds no rows), from its schema or first row only."""
        if self.suffix == ".parquet":
            meta = pq.ParquetFile(source(self.path)).metadata
            self.total = meta.num_rows
            return meta.schema.to_arrow_schema().names if meta.num_rows else None
        first = next(iter(self._raw_rows()), None)
        if self.suffix == ".json":
            self.total = len(self._json)
        return None if first is None else list(first.keys())

    def _raw_rows(self) -> Iterator[dict]:
        """Rows as dicts, streamed (Parquet by record batches of the columns used; text line by line)."""
        if self.suffix == ".parquet":
            f = pq.ParquetFile(source(self.path))
            cols = [c for c in (self.prompt_col, self.cfg.id_column, "split" if self.has_split else None) if c]
            for batch in f.iter_batches(batch_size=CHUNK, columns=list(dict.fromkeys(cols))):
                yield from batch.to_pylist()
        elif self.suffix in (".csv", ".tsv"):
            with text(self.path, newline="") as fh:
                if self.suffix == ".tsv":
                    yield from csv.DictReader(fh, delimiter="\t", quoting=csv.QUOTE_NONE)
                else:
                    yield from csv.DictReader(fh)
        elif self.suffix == ".jsonl":
            with text(self.path) as fh:
                for n, line in enumerate(fh, 1):
                    if line.strip():
                        try:
                            row = json.loads(line)
                        except ValueError as e:
                            raise ConfigError(f"data.path={self.cfg.path}: line {n} is not valid JSON "
                                              f"({str(e).split(':')[0]}): fix or remove that line") from None
                        if not isinstance(row, dict):
                            raise ConfigError(f"data.path={self.cfg.path}: line {n} is not a JSON object: each "
                                              f"line of a .jsonl prompt file must be one, e.g. {{\"prompt\": \"...\"}}")
                        yield row
        else:  # .json: one document, read whole
            if getattr(self, "_json", None) is None:
                data = json.loads(self.path.read_text(encoding="utf-8-sig"))
                if not isinstance(data, list):
                    raise ValueError("a .json prompt file must hold a list of strings or of objects")
                self._json = data
            yield from (x if isinstance(x, dict) else {"prompt": x} for x in self._json)

    def _rows_checked(self) -> Iterator[dict]:
        if self._rows is not None:
            yield from self._rows
            return
        if self.prompt_col is None:
            return
        id_col, pcol = self.cfg.id_column, self.prompt_col
        it = self._raw_rows()
        for i in range(self.cfg.limit if self.cfg.limit is not None else np.iinfo(np.int64).max):
            r = self._guard(next, it, None)
            if r is None:
                return
            text, split = _prompt(r.get(pcol)), r.get("split")
            if id_col and id_col not in r:
                raise ConfigError(f"data.id_column={id_col!r}: row {i} of {self.cfg.path} has no such field")
            if id_col and (r[id_col] is None or str(r[id_col]).strip() == ""):
                raise ConfigError(f"data.id_column={id_col!r}: row {i} of {self.cfg.path} has an empty id "
                                  f"({r[id_col]!r}); give every row an id, or leave data.id_column unset")
            yield {"prompt_id": str(r[id_col]) if id_col else derived_id(i, text), "prompt": text,
                   "split": None if split is None else str(split)}

    def chunks(self) -> Iterator[list[dict]]:
        rows = self._rows_checked()
        if self._rows is not None and self.cfg.limit is not None:
            rows = islice(rows, self.cfg.limit)
        return _chunked(rows)

    def check_unique_ids(self) -> None:
        """With data.id_column, ids must be unique (a pass over the prompts; the job's planner makes the
        same check in its own pass with UniqueIds)."""
        ids = UniqueIds(self)
        for c in self.chunks():
            ids.add(c)
        ids.finish()


class UniqueIds:
    """The duplicate-id check of data.id_column over a stream of chunks: an 8-byte hash per id (the one
    per-prompt cost of planning, 80 MB per 10^7 prompts; without an id column, ids are derived from
    positions and unique by construction). A hash seen twice is confirmed on the ids in a second pass
    over the source, so a hash collision never refuses a good file."""

    def __init__(self, source: PromptSource):
        self.source = source
        self.on = source.cfg.name == "file" and source.cfg.id_column is not None
        # one array when the row count is known (Parquet, JSON), else chunks joined at the end
        self.buf = np.empty(source.total, np.int64) if self.on and source.total is not None else None
        self.n, self.hashes = 0, []

    def add(self, chunk: list[dict]) -> None:
        if self.on:
            h = np.fromiter((hash(r["prompt_id"]) for r in chunk), np.int64, len(chunk))
            if self.buf is not None:
                self.buf[self.n:self.n + len(h)] = h
                self.n += len(h)
            else:
                self.hashes.append(h)

    def finish(self) -> None:
        if not self.on:
            return
        h = self.buf[:self.n] if self.buf is not None else np.concatenate(self.hashes or [np.zeros(0, np.int64)])
        self.buf, self.hashes = None, []
        h.sort()
        twice = set(h[1:][h[1:] == h[:-1]].tolist())
        del h
        if not twice:
            return
        seen, dups = set(), []
        for c in self.source.chunks():
            for r in c:
                if hash(r["prompt_id"]) in twice:
                    if r["prompt_id"] in seen:
                        dups.append(r["prompt_id"])
                    seen.add(r["prompt_id"])
        if dups:
            cfg = self.source.cfg
            raise ConfigError(f"data.id_column={cfg.id_column!r}: {len(dups)} duplicate ids in {cfg.path} "
                              f"(first: {dups[0]!r}); ids must be unique, or leave data.id_column unset")


def read_prompts(cfg: DataConfig) -> list[dict]:
    """-> [{"prompt_id": str, "prompt": str | None, "split": str | None}] in file order, at most cfg.limit
    of them, all in memory (bench, tests). `split` (e.g. flat / textured shapes backgrounds) comes from
    the built-in set or from a `split` column of the file, so the job can report figures per split
    without knowing the prompts. The job itself streams them (PromptSource)."""
    src = PromptSource(cfg)
    src.check_unique_ids()
    return [r for c in src.chunks() for r in c]
