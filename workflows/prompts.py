"""Prompt readers: built-in shapes, Parquet, CSV, TSV (PartiPrompts), JSONL, a JSON list of strings (the
COCO caption list) or of objects, and class ids for class-conditional models (a `class_id` column, or
`data=imagenet_classes`). Text is kept exactly as written (an integer prompt becomes its digits, which
a c2i model reads back as the class id); every problem with the file or its columns is a ConfigError
naming the setting to change."""
from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import pyarrow.parquet as pq

from decoding.shapes.world import builtin_prompts
from workflows.config import ConfigError, DataConfig

PROMPT_COLUMNS = ("prompt", "Prompt", "caption", "text", "class_id")
IMAGENET_CLASSES = 1000
FORMATS = (".parquet", ".csv", ".tsv", ".jsonl", ".json")


def derived_id(position: int, text) -> str:
    """Stable id from position + content, for files without an id column."""
    digest = hashlib.blake2b(str(text).encode(), digest_size=5).hexdigest()
    return f"{position:06d}-{digest}"


def _read_rows(path: Path) -> list[dict]:
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        return pq.read_table(path).to_pylist()
    if suffix in (".csv", ".tsv"):
        with open(path, newline="", encoding="utf-8") as f:
            if suffix == ".tsv":
                return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
            return list(csv.DictReader(f))
    if suffix == ".jsonl":
        with open(path, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError("a .json prompt file must hold a list of strings or of objects")
    return [x if isinstance(x, dict) else {"prompt": x} for x in data]


def read_prompts(cfg: DataConfig) -> list[dict]:
    """-> [{"prompt_id": str, "prompt": str | None, "split": str | None}] in file order, at most cfg.limit
    of them. `split` (e.g. flat / textured shapes backgrounds) comes from the built-in set or from a
    `split` column of the file, so the job can report figures per split without knowing the prompts."""
    if cfg.limit is not None and cfg.limit < 0:
        raise ConfigError(f"data.limit={cfg.limit}: must be >= 0, or null for all prompts")
    if cfg.name == "shapes":
        rows = builtin_prompts(cfg.builtin_count)
    elif cfg.name == "file":
        rows = _read_file(cfg)
    elif cfg.name == "imagenet_classes":
        rows = class_prompts(cfg)
    else:
        raise ConfigError(f"data.name={cfg.name!r}: use 'shapes' (built-in), 'file' with data.path=..., "
                          f"or 'imagenet_classes' (class ids)")
    return rows[: cfg.limit] if cfg.limit is not None else rows


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


def _read_file(cfg: DataConfig) -> list[dict]:
    if not cfg.path:
        raise ConfigError("data.path is not set: point it at a prompt file (Parquet, CSV, TSV, JSONL or JSON)")
    path = Path(cfg.path).expanduser()
    if not path.is_file():
        raise ConfigError(f"data.path={cfg.path}: no such file")
    if path.suffix.lower() not in FORMATS:
        raise ConfigError(f"data.path={cfg.path}: unknown format {path.suffix!r}; use one of {', '.join(FORMATS)}")
    try:
        rows = _read_rows(path)
    except Exception as e:  # any parse failure is a bad input file
        raise ConfigError(f"data.path={cfg.path}: cannot read it as {path.suffix}: {type(e).__name__}: "
                          f"{str(e).splitlines()[0] if str(e) else ''}") from None
    if not rows:
        return []
    columns = list(rows[0].keys())
    prompt_col = cfg.prompt_column or next((c for c in PROMPT_COLUMNS if c in columns), None)
    if prompt_col is None or prompt_col not in columns:
        raise ConfigError(f"data.prompt_column={prompt_col!r}: no such column in {cfg.path}; "
                          f"columns are {columns}")
    if cfg.id_column is not None and cfg.id_column not in columns:
        raise ConfigError(f"data.id_column={cfg.id_column!r}: no such column in {cfg.path}; columns are {columns}")
    out = []
    for i, r in enumerate(rows):
        text = _prompt(r.get(prompt_col))
        pid = str(r[cfg.id_column]) if cfg.id_column else derived_id(i, text)
        split = r.get("split")
        out.append({"prompt_id": pid, "prompt": text, "split": None if split is None else str(split)})
    seen, dups = set(), []
    for r in out:
        if r["prompt_id"] in seen:
            dups.append(r["prompt_id"])
        seen.add(r["prompt_id"])
    if dups:
        raise ConfigError(f"data.id_column={cfg.id_column!r}: {len(dups)} duplicate ids in {cfg.path} "
                          f"(first: {dups[0]!r}); ids must be unique, or leave data.id_column unset")
    return out
