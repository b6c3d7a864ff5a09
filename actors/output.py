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


def token_table(prompt_ids: list[str], records: list[dict], engine: str) -> pa.Table:
    """One row per token of each image: its records (log.TOKEN_COLUMNS) with the prompt id and engine."""
    if not records:
        return TOKEN_SCHEMA.empty_table()
    n = [len(r["token_index"]) for r in records]
    cols = {"prompt_id": pa.array(np.repeat(prompt_ids, n), pa.string()),
            **{c.name: pa.array(np.concatenate([r[c.name] for r in records]), TOKEN_SCHEMA.field(c.name).type)
               for c in TOKEN_COLUMNS},
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


def committed_parts(out_dir: Path) -> list[str]:
    """Names of the committed parts (an images file is the commit mark), after removing leftovers;
    reads no file, so a resume costs a directory listing, not every prompt id."""
    parts = sorted(f.stem for f in (out_dir / "images").glob("*.parquet"))
    names = set(parts)
    for table in TABLES:
        for f in (out_dir / table).glob("*"):
            if f.name.endswith(".tmp") or (table != "images" and f.stem not in names):
                f.unlink()
    return parts


def part_prompt_ids(out_dir: Path, part: str) -> list[str]:
    """The prompt ids of a committed part (images and errors)."""
    ids = pq.read_table(out_dir / "images" / f"{part}.parquet", columns=["prompt_id"]).column(0).to_pylist()
    err = out_dir / "errors" / f"{part}.parquet"
    if err.exists():
        ids += pq.read_table(err, columns=["prompt_id"]).column(0).to_pylist()
    return ids


def committed(out_dir: Path) -> dict[str, list[str]]:
    """part name -> prompt ids (images and errors) of every committed part, after removing leftovers."""
    return {part: part_prompt_ids(out_dir, part) for part in committed_parts(out_dir)}


def append_manifest(out_dir: Path, part: str, prompt_ids: list[str], images: int, errors: int) -> None:
    line = json.dumps({"part": part, "images": images, "errors": errors, "prompt_ids": prompt_ids,
                       "time": time.strftime("%Y-%m-%dT%H:%M:%S")})
    with open(out_dir / "manifest.jsonl", "a") as f:
        f.write(line + "\n")


def reconcile_manifest(out_dir: Path, parts) -> None:
    """Rewrite the manifest to list exactly the committed parts `parts` (names; a driver may have died
    between a part's commit and its manifest line). Streams the old manifest line by line; only a part
    with no line has its ids read."""
    path = out_dir / "manifest.jsonl"
    want, listed = set(parts), set()
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w") as out:
        if path.exists():
            with open(path) as f:
                for line in f:
                    try:
                        part = json.loads(line)["part"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue  # a torn last line
                    if part in want and part not in listed:
                        listed.add(part)
                        out.write(line if line.endswith("\n") else line + "\n")
        for part in sorted(want - listed):
            out.write(json.dumps({"part": part, "images": None, "errors": None,
                                  "prompt_ids": part_prompt_ids(out_dir, part), "time": None}) + "\n")
    os.replace(tmp, path)
