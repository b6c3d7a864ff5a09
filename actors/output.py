"""The Parquet output contract (docs/design.md, "Output contract") and the crash-safe way it is
written, verified and resumed.

out_dir/images/part-X.parquet   one row per image (PNG bytes, HF `Image` feature in the schema metadata)
out_dir/tokens/part-X.parquet   one row per generated token (the acceptance log)
out_dir/errors/part-X.parquet   one row per prompt that failed, with the reason (only for a part that has one)
out_dir/manifest.jsonl          one line per committed part: its prompt ids, counts, and each file's
                                size, row count and sha256
out_dir/job.json                the settings that decide the images; a rerun must match them
out_dir/quarantine/             damaged parts found on start, moved aside (their prompts are generated again)

Commit protocol (docs/design.md, "Commit protocol"): every file is written under a temporary name,
fsynced and renamed; a part's tokens, then errors, then images file, and the images file is its
commit mark. A part with no failed prompt has no errors file: its errors step removes one an earlier
attempt at the same part may have left, and its manifest line lists no errors file (a part checked from
its files alone is whole when its images rows and errors rows are the prompts its name spans). On start,
`recover` removes what a crash can leave (temporary files; tokens or errors files without an images
file), checks every committed part against its manifest line (sizes and Parquet footers; `verify=full`
also the checksums), and quarantines damaged ones, so that each prompt ends up in exactly one sound
committed part. `FAULT` is the fault-injection hook the tests use to stop
a writer at each of these boundaries.

out_dir may be a prefix on an object store (actors/store.py; docs/design.md, "Commit protocol on an object
store"): the same functions, with each file one PUT at its final key (no temporary names, no rename) and a
part's manifest line its own object, manifest/PART.json, until `rewrite_manifest` folds it in.
"""
from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import re
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from actors.store import JobExit, ObjPath, OutDirError, Where, at, entries, move, put, source  # noqa: F401
from decoding.engines.log import TOKEN_COLUMNS

TABLES = ("images", "tokens", "errors")
WRITE_ORDER = ("tokens", "errors", "images")   # the images file commits the part
VERIFY_MODES = ("quick", "full")
log = logging.getLogger("arspec.job")

# Every name a job creates in out_dir (docs/design.md, "Output contract"). Nothing else there is ever
# read as a part, removed or moved; an out_dir holding anything else and no job.json is refused.
PART = r"part-\d{10}-\d{10}-[0-9a-f]{16}"


def _names(*names: str) -> re.Pattern:
    """The names, and the temporary names write_chunks_atomic writes them under (.NAME.PID.RANDOM.tmp)."""
    alts = "|".join(names)
    return re.compile(rf"(?:{alts})|\.(?:{alts})\.\d+\.[0-9a-f]{{8}}\.tmp")


START_NAMES = _names(r"job\.json", r"job\.lock", r"job\.lock\.(?:stale|probe)-[0-9a-f]+")   # a job's first files
TOP_NAMES = _names(r"job\.json", r"manifest\.jsonl", r"summary\.json")
TABLE_NAMES = _names(rf"{PART}\.parquet")
LINE_NAMES = re.compile(rf"{PART}\.json")    # manifest/PART.json: a part's manifest line on an object store
QUARANTINE_NAMES = re.compile(rf"{PART}(?:\.\d{{8}}T\d{{6}}\.[0-9a-f]{{4}})?\.parquet")

# Fault injection (tests/test_reliability.py): called with "before:LABEL", "mid:LABEL" (half of the
# file's bytes are written) and "after:LABEL" around every file this module writes; LABEL is a table
# name, "job.json", "manifest" (its rewrite) or "manifest-line" (an appended line). None in a real job.
FAULT: Optional[Callable[[str], None]] = None


def _boundary(point: str) -> None:
    if FAULT is not None:
        FAULT(point)


class LockLost(JobExit):
    """Another job took over out_dir's lock (workflows/lock.py): this one commits nothing more (exit 143,
    as a stop)."""
    code, prefix = 143, ""


def lock_token(out_dir: Where) -> Optional[str]:
    """The token of the job that holds out_dir/job.lock now, or None."""
    try:
        return json.loads((at(out_dir) / "job.lock").read_bytes()).get("token")
    except (OSError, ValueError, AttributeError):
        return None


def check_lock(out_dir: Where, token: Optional[str]) -> None:
    """Before every commit (each file of a part, a manifest line, the end of the job): the job whose
    lock was taken over (it was silent, e.g. suspended) stops writing. token None: no lock to check."""
    if token is not None and lock_token(out_dir) != token:
        raise LockLost(f"[generate] stopped: another job took over out_dir={out_dir} (its lock {at(out_dir) / 'job.lock'} "
                       f"is no longer this job's); nothing more is written by this one")


_STORAGE = {errno.ENOSPC: "free space on it", errno.EDQUOT: "free space or raise the quota",
            errno.EFBIG: "free space or raise the file size limit", errno.EACCES: "give this user write access",
            errno.EPERM: "give this user write access", errno.EROFS: "mount it read-write or use another out_dir"}


@contextmanager
def storage(path: Path):
    """Turn an OSError that no retry can fix (disk full, permission denied, read-only mount) into an
    OutDirError naming the path and the cause. Other errors pass unchanged."""
    try:
        yield
    except OSError as e:
        if e.errno not in _STORAGE:
            raise
        raise OutDirError(f"cannot write {path}: {e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)}); "
                          f"committed parts are intact: {_STORAGE[e.errno]}, then rerun the same command") from None


def _hf_metadata(schema: pa.Schema, image_column: str | None) -> dict:
    def feature(f: pa.Field):
        if f.name == image_column:
            return {"_type": "Image"}
        return {"dtype": {pa.string(): "string", pa.int64(): "int64", pa.int32(): "int32", pa.int8(): "int8",
                          pa.float32(): "float32", pa.bool_(): "bool", pa.float64(): "float64"}[f.type], "_type": "Value"}
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
    ("unknown_words", pa.int32()), ("invalid_tokens", pa.int32()), ("part", pa.string()),
], image_column="image")

# prompt_id, the engine's per-token columns (decoding/engines/log.py, their one definition), engine
TOKEN_SCHEMA = _schema([("prompt_id", pa.string()),
                        *((c.name, pa.from_numpy_dtype(np.dtype(c.dtype))) for c in TOKEN_COLUMNS),
                        ("engine", pa.string())])

ERROR_SCHEMA = _schema([
    ("prompt_id", pa.string()), ("prompt", pa.string()), ("seed", pa.int64()), ("engine", pa.string()),
    ("error", pa.string()), ("part", pa.string()),
])


def error_table(items: list[dict], errors: list[str], engine: str, part: str) -> pa.Table:
    """A part's error rows, one per failed prompt (`items` and their `errors`). A prompt that is not text
    (a number, list or object in a JSON prompt file, which fails as "not text") is written as its JSON
    text: the `prompt` column is a string, and the row must be written whatever the input held."""
    def text(p):
        return p if p is None or isinstance(p, str) else json.dumps(p, default=str)
    return pa.Table.from_pylist([{"prompt_id": it["prompt_id"], "prompt": text(it["prompt"]), "seed": it["seed"],
                                  "engine": engine, "error": msg, "part": part} for it, msg in zip(items, errors)],
                                schema=ERROR_SCHEMA)


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


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return  # not every filesystem lets a directory be opened
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_chunks_atomic(chunks, path: Where, label: str) -> None:
    """Write the byte chunks (any iterable, so a large file streams) to a temporary name beside `path`,
    fsync, rename over `path`, fsync the directory. A crash at any moment leaves either the old file
    (or none) or the whole new one under `path`. On an object store: the chunks joined, one PUT at
    `path` (actors/store.py `put`), which is visible only complete."""
    _boundary(f"before:{label}")
    if isinstance(path, ObjPath):
        data = bytearray()
        for i, chunk in enumerate(chunks):
            if i == 1:
                _boundary(f"mid:{label}")     # nothing of it is visible yet
            data += chunk
        put(bytes(data), path)
        _boundary(f"after:{label}")
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    with storage(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for i, chunk in enumerate(chunks):
                    if i == 1:
                        _boundary(f"mid:{label}")    # the first chunk is written, the rest not yet
                    f.write(chunk)
                    f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_dir(path.parent)
    _boundary(f"after:{label}")


def write_bytes_atomic(data, path: Where, label: str) -> None:
    """`data` written atomically (write_chunks_atomic), in two halves so a crash can tear it midway."""
    view = memoryview(data)
    write_chunks_atomic((view[:len(view) // 2], view[len(view) // 2:]), path, label)


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


def parquet_bytes(table: pa.Table) -> pa.Buffer:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, write_page_checksum=True)      # a flipped byte in a page fails its CRC32
    return sink.getvalue()


def file_info(data, rows: int) -> dict:
    """What the manifest records of a part's file: its size, row count and sha256."""
    return {"bytes": len(memoryview(data)), "rows": rows, "sha256": hashlib.sha256(data).hexdigest()}


def remove_atomic(path: Where, label: str) -> None:
    """Remove `path` if it is there, durably (the directory fsynced) before what follows is written; on
    a disk its directory is left in place, so a reader of the table finds it (empty) rather than nothing."""
    _boundary(f"before:{label}")
    with storage(path):
        if isinstance(path, ObjPath):
            path.unlink(missing_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            else:
                _fsync_dir(path.parent)
    _boundary(f"after:{label}")


def write_part(out_dir: Where, part: str, images: pa.Table, tokens: pa.Table, errors: pa.Table,
               token: Optional[str] = None) -> dict:
    """Tokens, then errors, then images: the images file commits the part; each only while the job
    holds the lock `token` (check_lock). No errors file when no prompt failed: that step removes one an
    earlier attempt at this part left (its prompts now have images). Returns each written file's
    file_info for the manifest."""
    tables, files = {"images": images, "tokens": tokens, "errors": errors}, {}
    for table in WRITE_ORDER:
        path = out_dir / table / f"{part}.parquet"
        check_lock(out_dir, token)
        if table == "errors" and not errors.num_rows:
            remove_atomic(path, table)
            continue
        data = parquet_bytes(tables[table])
        write_bytes_atomic(data, path, table)
        files[table] = file_info(data, tables[table].num_rows)
    return files


def _lines(path: Where):
    """The lines of a file, streamed from a disk or a store."""
    if isinstance(path, ObjPath):
        with io.BufferedReader(path.stream()) as f:
            yield from f
        return
    with open(path, "rb") as f:
        yield from f


def read_manifest(out_dir: Where) -> dict[str, int | str]:
    """part -> the byte offset of its last manifest line (lines a crash tore, or damage garbled, are
    skipped). Offsets, not entries: a resume of a large job holds a few bytes per part, never every
    prompt id (docs/design.md, "Prompt streaming"); `manifest_line` reads one entry back. On an object
    store (no appends) a part's line may also be its own object manifest/PART.json (`append_manifest`):
    then its value is that name, and it wins over manifest.jsonl."""
    out_dir = at(out_dir)
    listed = {}
    path = out_dir / "manifest.jsonl"
    if path.exists():
        offset = 0
        for line in _lines(path):
            try:
                listed[json.loads(line)["part"]] = offset
            except (ValueError, KeyError, TypeError):
                pass
            offset += len(line)
    if isinstance(out_dir, ObjPath):
        listed.update({n[:-len(".json")]: n for n, kind in entries(out_dir / "manifest").items()
                       if kind == "file" and LINE_NAMES.fullmatch(n)})
    return listed


def manifest_line(out_dir: Where, offset: int | str | None) -> Optional[dict]:
    if offset is None:
        return None
    out_dir = at(out_dir)
    if isinstance(offset, str):      # its own object (object stores)
        try:
            return json.loads((out_dir / "manifest" / offset).read_bytes())
        except (FileNotFoundError, ValueError):
            return None
    if isinstance(out_dir, ObjPath):
        with (out_dir / "manifest.jsonl").open_input() as f:
            f.seek(offset)
            line = b""
            while not line.endswith(b"\n"):
                chunk = f.read(1 << 16)
                if not chunk:
                    break
                line += chunk.split(b"\n", 1)[0] + (b"\n" if b"\n" in chunk else b"")
            return json.loads(line)
    with open(out_dir / "manifest.jsonl", "rb") as f:
        f.seek(offset)
        return json.loads(f.readline())


def manifest_entry(part: str, prompt_ids: list[str], images: int, errors: int, files: dict) -> dict:
    return {"part": part, "images": images, "errors": errors, "prompt_ids": prompt_ids, "files": files,
            "time": time.strftime("%Y-%m-%dT%H:%M:%S")}


def append_manifest(out_dir: Where, entry: dict) -> None:
    """Append one committed part's line. A crash mid-line leaves a torn last line, which `recover`
    drops (the part is then checked from its files and its line rewritten). An object store has no
    append: the line is its own object, manifest/PART.json, folded into manifest.jsonl by
    `rewrite_manifest` (on start and at the end of the job)."""
    out_dir = at(out_dir)
    path = out_dir / "manifest.jsonl"
    line = (json.dumps(entry) + "\n").encode()
    if isinstance(out_dir, ObjPath):
        write_bytes_atomic(line, out_dir / "manifest" / f"{entry['part']}.json", "manifest-line")
        return
    _boundary("before:manifest-line")
    with storage(path), open(path, "ab") as f:
        f.write(line[:len(line) // 2])
        f.flush()
        _boundary("mid:manifest-line")
        f.write(line[len(line) // 2:])
        f.flush()
        os.fsync(f.fileno())
    _boundary("after:manifest-line")


def _check_file(path: Where, info: Optional[dict], full: bool) -> tuple[Optional[str], Optional[dict]]:
    """(reason it is damaged or None, its file_info). With a recorded `info`: size and footer row count,
    then `full`: the sha256, else (quick) the Parquet page checksums (CRC32 of every data page, which a
    same-size flip inside the data fails). Without one (the driver died before the manifest line, or the
    manifest was lost): the page checksums, and its info computed from the file."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "missing", None
    if info is not None and size != info.get("bytes"):
        return f"{size} bytes, the manifest recorded {info.get('bytes')}", None
    data = path.read_bytes()
    try:
        rows = pq.read_metadata(pa.BufferReader(data)).num_rows
    except Exception as e:
        return f"unreadable Parquet footer ({str(e).splitlines()[0][:120]})", None
    if info is not None and rows != info.get("rows"):
        return f"{rows} rows, the manifest recorded {info.get('rows')}", None
    if info is not None and full:
        ok = hashlib.sha256(data).hexdigest() == info.get("sha256")
        return (None, info) if ok else ("sha256 differs from the manifest", None)
    try:
        read_checked(pa.BufferReader(data))
    except Exception as e:
        return f"unreadable Parquet data or a page checksum failed ({str(e).splitlines()[0][:120]})", None
    return None, info or file_info(data, rows)


def read_checked(source, columns=None) -> pa.Table:
    """A Parquet file read with its page checksums verified (files written before they were: unchecked). One
    thread: a corrupt page read on pyarrow's thread pool left a thread that aborted the process at exit."""
    return pq.read_table(source, columns=columns, page_checksum_verification=True, use_threads=False)


def check_part(out_dir: Where, part: str, entry: Optional[dict], full: bool) -> tuple[Optional[str], Optional[dict]]:
    """(reason the part is damaged or None, its manifest entry, rebuilt from its files if it had none).
    A part without a sound entry is trusted only as far as its files can be checked alone: page
    checksums, every PNG decoded, and one row per prompt its name spans (images and errors rows: so an
    errors file that is missing is told from one never written)."""
    out_dir = at(out_dir)
    recorded = (entry or {}).get("files") or {}
    files = {}
    for table in WRITE_ORDER:
        path = out_dir / table / f"{part}.parquet"
        if table == "errors" and "errors" not in recorded:     # none written (no failed prompt), or unknown
            if recorded and path.exists():
                return f"errors/{part}.parquet: the manifest recorded no errors file for this part", None
            if not path.exists():
                continue
        reason, info = _check_file(path, recorded.get(table), full)
        if reason:
            return f"{table}/{part}.parquet: {reason}", None
        files[table] = info
    rows = files["images"]["rows"] + files.get("errors", {"rows": 0})["rows"]
    if recorded and len(entry.get("prompt_ids") or []) == rows:
        return None, entry
    span = part_span(part)
    if span is not None and span[1] - span[0] != rows:
        missing = "" if "errors" in files else " (and no errors file)"
        return (f"holds rows for {rows} prompts{missing}, its name spans {span[1] - span[0]}: a file of it is "
                f"missing or from another attempt"), None
    images = read_checked(source(out_dir / "images" / f"{part}.parquet"), columns=["prompt_id", "image"])
    for pid, image in zip(images.column("prompt_id").to_pylist(), images.column("image").to_pylist()):
        try:
            Image.open(io.BytesIO(image["bytes"])).load()
        except Exception as e:
            return f"images/{part}.parquet: the PNG of {pid!r} does not decode ({str(e).splitlines()[0][:80]})", None
    ids = [images.column("prompt_id").to_pylist(), [] if "errors" not in files else
           read_checked(source(out_dir / "errors" / f"{part}.parquet"), columns=["prompt_id"]).column(0).to_pylist()]
    return None, {**manifest_entry(part, ids[0] + ids[1], len(ids[0]), len(ids[1]), files), "time": None}


def quarantine(out_dir: Where, part: str, reason: str) -> Where:
    """Move every file of `part` to out_dir/quarantine/TABLE/ (kept for inspection, out of the dataset),
    its images file (the commit mark) first."""
    out_dir = at(out_dir)
    q = out_dir / "quarantine"
    for table in TABLES:
        src = out_dir / table / f"{part}.parquet"
        if src.exists():
            dst = q / table / src.name
            if dst.exists():
                dst = dst.with_name(f"{part}.{time.strftime('%Y%m%dT%H%M%S')}.{secrets.token_hex(2)}.parquet")
            with storage(dst):
                move(src, dst)
    log.warning(f"[generate] quarantined {part}: {reason}; moved to {q}; prompts no sound part holds will be generated again")
    return q


def survey(out_dir: Where) -> tuple[list[str], list[str]]:
    """What out_dir holds, by the names above: (a job's files beyond its first ones: parts, manifest,
    summary, quarantine; entries no job writes), as paths relative to out_dir, sorted."""
    out_dir = at(out_dir)
    written, foreign = [], []
    subdirs = {**{t: TABLE_NAMES for t in TABLES}, "manifest": LINE_NAMES} if isinstance(out_dir, ObjPath) \
        else {t: TABLE_NAMES for t in TABLES}
    for name, kind in sorted(entries(out_dir).items()):
        if kind == "file" and START_NAMES.fullmatch(name):
            continue
        if kind == "file" and TOP_NAMES.fullmatch(name):
            written.append(name)
        elif kind == "dir" and name in subdirs:
            inner = {n: k == "file" for n, k in entries(out_dir / name).items()}
            written += [f"{name}/{n}" for n, f in sorted(inner.items()) if f and subdirs[name].fullmatch(n)]
            foreign += [f"{name}/{n}" for n, f in sorted(inner.items()) if not (f and subdirs[name].fullmatch(n))]
        elif kind == "dir" and name == "quarantine":
            for t, tkind in sorted(entries(out_dir / name).items()):
                ok = t in TABLES and tkind == "dir"
                names = sorted(entries(out_dir / name / t)) if ok else []
                written += [f"quarantine/{t}/{n}" for n in names if QUARANTINE_NAMES.fullmatch(n)]
                foreign += [f"quarantine/{t}/{n}" for n in names if not QUARANTINE_NAMES.fullmatch(n)]
                if not ok:
                    foreign.append(f"quarantine/{t}")
        else:
            foreign.append(name + ("/" if kind == "dir" else ""))
    return written, foreign


def remove_leftovers(out_dir: Where, parts=None) -> None:
    """Remove the temporary files of interrupted writes, and the tokens/errors files of parts never
    committed (no images file; `parts`: the committed parts, by default those with an images file).
    Only names a job writes (above) are touched. Run on start (`recover`) and when a job ends, its
    actors gone: a writer killed mid-part (a lost node, SIGTERM with no grace left) leaves these, and
    no one else will. Never while writers run. (On an object store nothing is ever written under a
    temporary name; the uncommitted parts' tokens/errors objects are all there is to remove.)"""
    out_dir = at(out_dir)
    if parts is None:
        parts = {f.stem for f in _part_files(out_dir / "images")}
    leftovers = [out_dir / n for n in entries(out_dir) if n.endswith(".tmp") and TOP_NAMES.fullmatch(n)]
    for table in TABLES:
        d = out_dir / table
        leftovers += [d / n for n in entries(d) if TABLE_NAMES.fullmatch(n)
                      and (n.endswith(".tmp") or (table != "images" and n[:-len(".parquet")] not in parts))]
    for f in leftovers:
        with storage(f):
            f.unlink(missing_ok=True)


def _part_files(d: Where) -> list[Where]:
    """The part files in d (sorted by name, i.e. by START), never another file someone put there."""
    return [d / n for n in sorted(entries(d)) if n.endswith(".parquet") and TABLE_NAMES.fullmatch(n)]


def inspect(out_dir: Where, verify: str = "quick") -> tuple[dict[str, int], dict[str, str]]:
    """Check every committed part (an images file) without changing anything: (sound parts -> their
    number of prompts, damaged parts -> the reason). Damaged: a file missing, of the wrong size or row
    count, an unreadable footer, with `verify=full` a checksum differing; or a part whose positions
    overlap an earlier one's (two jobs that once wrote the same out_dir)."""
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: choose one of {', '.join(VERIFY_MODES)}")
    out_dir = at(out_dir)
    return _inspect(out_dir, verify == "full", read_manifest(out_dir))[:2]


def _inspect(out_dir: Path, full: bool, listed: dict[str, int]):
    """-> (sound parts -> prompts, damaged parts -> reason, parts with no sound manifest line -> their
    entry rebuilt from the files)."""
    parts, damaged, rebuilt = {}, {}, {}
    covered, owner = -1, None                  # the furthest position a sound part reaches, and that part
    for f in _part_files(out_dir / "images"):   # sorted by START
        entry = manifest_line(out_dir, listed.get(f.stem))
        reason, checked = check_part(out_dir, f.stem, entry, full)
        span = part_span(f.stem)
        if reason is None and span is not None and span[0] < covered:
            reason = f"its prompts (positions {span[0]}..{span[1] - 1}) are already in {owner}"
        if reason:
            damaged[f.stem] = reason
            continue
        parts[f.stem] = len(checked["prompt_ids"])
        if checked is not entry:
            rebuilt[f.stem] = checked
        if span is not None and span[1] > covered:
            covered, owner = span[1], f.stem
    return parts, damaged, rebuilt


def recover(out_dir: Where, verify: str = "quick") -> dict[str, int]:
    """On start: quarantine the damaged parts (one line each), remove crash leftovers, rewrite the
    manifest to list exactly the sound committed parts, and return them (part -> number of prompts)."""
    out_dir = at(out_dir)
    if verify not in VERIFY_MODES:
        raise ValueError(f"verify={verify!r}: choose one of {', '.join(VERIFY_MODES)}")
    lines = read_manifest(out_dir)
    parts, damaged, rebuilt = _inspect(out_dir, verify == "full", lines)
    if rebuilt:
        log.warning(f"[generate] {len(rebuilt)} committed part(s) had no manifest line (e.g. {next(iter(rebuilt))}: "
                    f"the driver stopped before writing it, or manifest.jsonl lost lines): checked from their files "
                    f"alone (Parquet page checksums, every PNG decoded), their lines written again")
    for part, reason in damaged.items():
        quarantine(out_dir, part, reason)
    remove_leftovers(out_dir, parts)
    rewrite_manifest(out_dir, parts, lines, rebuilt)
    return parts


def rewrite_manifest(out_dir: Where, parts, lines: dict[str, int | str], rebuilt: dict[str, dict]) -> None:
    """The manifest listing exactly `parts`, written atomically and streamed: each part's last line is
    copied from the old manifest (`lines`: offsets, or on an object store manifest/PART.json names), or
    written from `rebuilt` when it had none. Then the folded manifest/PART.json objects are deleted."""
    out_dir = at(out_dir)
    path = out_dir / "manifest.jsonl"
    keep = {off for part, off in lines.items() if part in parts and part not in rebuilt and isinstance(off, int)}
    objects = {part: n for part, n in lines.items() if isinstance(n, str)}

    def chunks():
        if keep:
            offset = 0
            for line in _lines(path):
                if offset in keep:
                    yield line if line.endswith(b"\n") else line + b"\n"
                offset += len(line)
        for part, n in objects.items():
            e = manifest_line(out_dir, n) if part in parts and part not in rebuilt else None
            if e is not None:
                yield (json.dumps(e) + "\n").encode()
        for part, e in rebuilt.items():
            if part in parts:
                yield (json.dumps(e) + "\n").encode()
        yield b""      # at least two chunks, so the fault hook's "mid" point exists
        yield b""
    write_chunks_atomic(chunks(), path, "manifest")
    for n in objects.values():     # folded into manifest.jsonl (or their parts are gone)
        (out_dir / "manifest" / n).unlink(missing_ok=True)


def fold_manifest(out_dir: Where) -> None:
    """On an object store, at the end of a job: the parts' manifest/PART.json lines folded into
    manifest.jsonl (one PUT), so a reader finds one manifest as on a disk. Nothing to do on a disk."""
    out_dir = at(out_dir)
    if isinstance(out_dir, ObjPath):
        lines = read_manifest(out_dir)
        if any(isinstance(v, str) for v in lines.values()):
            rewrite_manifest(out_dir, set(lines), lines, {})


def committed(out_dir: Where) -> dict[str, list[str]]:
    """part name -> prompt ids (images and errors) of every sound committed part, read from the
    manifest after `recover` (for tests and small jobs: it holds every id)."""
    parts = recover(out_dir)
    return {p: manifest_line(out_dir, off)["prompt_ids"] for p, off in read_manifest(out_dir).items() if p in parts}
