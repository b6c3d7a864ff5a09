"""The Parquet output contract (docs/design.md, "Output contract") and the crash-safe way it is
written and resumed.

out_dir/images/part-X.parquet   one row per image (PNG bytes, HF `Image` feature in the schema metadata)
out_dir/tokens/part-X.parquet   one row per generated token (the acceptance log)
out_dir/errors/part-X.parquet   one row per prompt that failed, with the reason
out_dir/manifest.jsonl          one line per committed part: its prompt ids and counts
out_dir/job.json                the settings that decide the images; a rerun must match them

Every file is written under a temporary name and renamed. A part's images file is written last and
is its commit mark: tokens or errors files without one are leftovers of a crash and are removed on
resume, so each prompt ends up in exactly one committed part.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from decoding.engines.log import TOKEN_COLUMNS

TABLES = ("images", "tokens", "errors")


def _hf_metadata(schema: pa.Schema, image_column: str | None) -> dict:
    def feature(f: pa.Field):
        if f.name == image_column:
            return {"_type": "Image"}
        return {"dtype": {pa.string(): "string", pa.int64(): "int64", pa.int32(): "int32", pa.float32(): "float32",
                          pa.bool_(): "bool", pa.float64(): "float64"}[f.type], "_type": "Value"}
    return {b"huggingface": json.dumps({"info": {"features": {f.name: feature(f) for f in schema}}}).encode()}


def _schema(fields, image_column=None) -> pa.Schema:
    s = pa.schema(fields)
    return s.with_metadata(_hf_metadata(s, image_column))


IMAGE_SCHEMA = _schema([
    ("prompt_id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("engine", pa.string()),
    ("model", pa.string()), ("image", pa.struct([("bytes", pa.binary()), ("path", pa.string())])),
    ("width", pa.int32()), ("height", pa.int32()), ("num_tokens", pa.int32()), ("target_forwards", pa.int32()),
    ("draft_forwards", pa.int32()), ("mean_accept_len", pa.float32()), ("wall_s", pa.float32()),
    ("batch_size", pa.int32()), ("acceptance", pa.string()), ("split", pa.string()),
    ("unknown_words", pa.int32()), ("part", pa.string()),
], image_column="image")

# prompt_id, the engine's per-token columns (decoding/engines/log.py, their one definition), engine
TOKEN_SCHEMA = _schema([("prompt_id", pa.string()),
                        *((c.name, pa.from_numpy_dtype(np.dtype(c.dtype))) for c in TOKEN_COLUMNS),
                        ("engine", pa.string())])

ERROR_SCHEMA = _schema([
    ("prompt_id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("engine", pa.string()),
    ("error", pa.string()), ("part", pa.string()),
])


def _column(values: np.ndarray, c) -> pa.Array:
    """One tokens-table column; values equal to the column's `null` marker become nulls."""
    mask = None if c.null is None else values == c.null
    return pa.array(values, TOKEN_SCHEMA.field(c.name).type, mask=mask)


def token_table(prompt_ids: list[str], records: list[dict], engine: str) -> pa.Table:
    """One row per token of each image: its records (log.TOKEN_COLUMNS) with the prompt id and engine."""
    if not records:
        return TOKEN_SCHEMA.empty_table()
    n = [len(r["token_index"]) for r in records]
    cols = {"prompt_id": pa.array(np.repeat(prompt_ids, n), pa.string()),
            **{c.name: _column(np.concatenate([r[c.name] for r in records]), c) for c in TOKEN_COLUMNS},
            "engine": pa.array([engine] * sum(n), pa.string())}
    return pa.Table.from_pydict(cols, schema=TOKEN_SCHEMA)


def png_bytes(image: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG", compress_level=6)
    return buf.getvalue()


def write_atomic(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_part(out_dir: Path, part: str, images: pa.Table, tokens: pa.Table, errors: pa.Table) -> None:
    """Tokens, then errors, then images: the images file commits the part."""
    write_atomic(tokens, out_dir / "tokens" / f"{part}.parquet")
    write_atomic(errors, out_dir / "errors" / f"{part}.parquet")
    write_atomic(images, out_dir / "images" / f"{part}.parquet")


def committed(out_dir: Path) -> dict[str, list[str]]:
    """part name -> prompt ids (images and errors) of every committed part, after removing leftovers."""
    parts = {}
    for f in sorted((out_dir / "images").glob("*.parquet")):
        ids = pq.read_table(f, columns=["prompt_id"]).column(0).to_pylist()
        err = out_dir / "errors" / f.name
        if err.exists():
            ids += pq.read_table(err, columns=["prompt_id"]).column(0).to_pylist()
        parts[f.stem] = ids
    for table in TABLES:
        for f in (out_dir / table).glob("*"):
            if f.name.endswith(".tmp") or (table != "images" and f.stem not in parts):
                f.unlink()
    return parts


def append_manifest(out_dir: Path, part: str, prompt_ids: list[str], images: int, errors: int) -> None:
    line = json.dumps({"part": part, "images": images, "errors": errors, "prompt_ids": prompt_ids,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    with open(out_dir / "manifest.jsonl", "a") as f:
        f.write(line + "\n")


def reconcile_manifest(out_dir: Path, parts: dict[str, list[str]]) -> None:
    """Rewrite the manifest to list exactly the committed parts (a driver may have died between a
    part's commit and its manifest line)."""
    path = out_dir / "manifest.jsonl"
    listed = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                e = json.loads(line)
                listed[e["part"]] = e
            except (json.JSONDecodeError, KeyError):
                continue  # a torn last line
    lines = []
    for part, ids in parts.items():
        e = listed.get(part) or {"part": part, "images": None, "errors": None, "prompt_ids": ids, "time": None}
        lines.append(json.dumps(e))
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in lines))
    os.replace(tmp, path)
