"""Where a job's files live: a local directory (pathlib.Path) or a prefix on an object store (ObjPath).

`at(out_dir)` -> a Path for a local path (or file://), an ObjPath for any other URI: s3://, gs://, and
whatever pyarrow.fs.FileSystem.from_uri knows, or fsspec where pyarrow has no filesystem for the scheme.
Credentials and the endpoint come from the standard environment (AWS_ACCESS_KEY_ID / _SECRET_ACCESS_KEY /
_SESSION_TOKEN, AWS_PROFILE, AWS_REGION, AWS_ENDPOINT_URL for an S3-compatible store) or the URI's query
(`s3://bucket/prefix?endpoint_override=host:port&scheme=http`).

ObjPath has the small part of pathlib's interface that actors/output.py uses (/, name, exists, read_bytes,
stat, unlink, ...), so the commit protocol reads the same on both. What differs is in three functions:
`put` (the whole file at its final key in one request: an object is visible only complete), `entries`
(a listing) and `move` (copy, then delete). docs/design.md, "Commit protocol on an object store".
"""
from __future__ import annotations

import functools
import os
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple, Union

URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$")


class JobExit(RuntimeError):
    """Ends the job with one line (`prefix` + the message) and exit status `code` (workflows.generate)."""
    code, prefix = 1, "error: "


class OutDirError(JobExit):
    """out_dir cannot be written: disk full, permission denied, read-only mount, store unreachable (exit 3)."""
    code = 3


class StoreConfigError(ValueError):
    """A URI that names no usable store (unknown scheme, missing bucket, refused credentials): one line."""


class Stat(NamedTuple):
    st_size: int
    st_mtime: float


def first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


@functools.lru_cache(maxsize=16)
def _filesystem(scheme: str, netloc_query: str, env: tuple = ()):
    """(pyarrow FileSystem, key of the URI's path) for a URI, made once per process and store environment
    (`env`: the AWS_* variables it was made with)."""
    import pyarrow as pa
    import pyarrow.fs as pfs
    uri = f"{scheme}://{netloc_query}"
    try:
        return pfs.FileSystem.from_uri(uri)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as e:
        if "nrecognized filesystem" not in str(e) and "not supported" not in str(e):
            raise StoreConfigError(f"{uri}: {first_line(e)}") from None
    try:
        import fsspec
        fs, key = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as e:
        raise StoreConfigError(f"{uri}: unknown scheme {scheme}:// ({first_line(e)}); use a local path, s3://, gs:// "
                               f"or another scheme pyarrow.fs or fsspec knows") from None
    return pfs.PyFileSystem(pfs.FSSpecHandler(fs)), key.rstrip("/")


class _ObjectIO:
    """What pathlib's reads, writes and listings do, for an `ObjPath` (fs, key)."""
    fs: object
    key: str

    def _info(self):
        with reach(self):
            return self.fs.get_file_info(self.key)

    def exists(self) -> bool:
        import pyarrow.fs as pfs
        return self._info().type != pfs.FileType.NotFound

    def is_file(self) -> bool:
        import pyarrow.fs as pfs
        return self._info().type == pfs.FileType.File

    def is_dir(self) -> bool:
        import pyarrow.fs as pfs
        return self._info().type == pfs.FileType.Directory

    def stat(self) -> Stat:
        import pyarrow.fs as pfs
        info = self._info()
        if info.type != pfs.FileType.File:
            raise FileNotFoundError(str(self))
        return Stat(info.size, info.mtime.timestamp() if info.mtime else time.time())

    def read_bytes(self) -> bytes:
        with reach(self), self.fs.open_input_stream(self.key) as f:
            return f.read()

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def stream(self):
        """A sequential binary stream (prompt files are read line by line)."""
        with reach(self):
            return self.fs.open_input_stream(self.key)

    def open_input(self):
        """A random-access file (Parquet readers seek to the footer)."""
        with reach(self):
            return self.fs.open_input_file(self.key)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            with reach(self):
                self.fs.delete_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Prefixes need no creating."""

    def iterdir(self):
        return (self / n for n in entries(self))


class ObjPath(_ObjectIO):
    """A key on an object store, pathlib-style: its names here, its reads and writes in `_ObjectIO`.
    `str()` is its URI (with the root's query), so it round-trips through at(): actors get the out_dir as
    that string."""

    def __init__(self, fs, key: str, scheme: str, query: str = ""):
        self.fs, self.key, self.scheme, self.query = fs, key.rstrip("/"), scheme, query

    def __str__(self) -> str:
        return f"{self.scheme}://{self.key}{self.query}"

    def __repr__(self) -> str:
        return f"ObjPath({str(self)!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, ObjPath) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, rel: str) -> "ObjPath":
        return ObjPath(self.fs, f"{self.key}/{str(rel).strip('/')}", self.scheme, self.query)

    @property
    def name(self) -> str:
        return self.key.rsplit("/", 1)[-1]

    @property
    def stem(self) -> str:
        n = self.name
        return n.rsplit(".", 1)[0] if "." in n[1:] else n

    @property
    def suffix(self) -> str:
        n = self.name
        return "." + n.rsplit(".", 1)[1] if "." in n[1:] else ""

    @property
    def parent(self) -> "ObjPath":
        return ObjPath(self.fs, self.key.rsplit("/", 1)[0], self.scheme, self.query)

    @property
    def bucket(self) -> str:
        return self.key.split("/", 1)[0]

    def with_name(self, name: str) -> "ObjPath":
        return self.parent / name

Where = Union[Path, ObjPath]


class reach:
    """Turn an object store's I/O error (unreachable, refused, throttled) into an OutDirError naming the
    URI, in one line; a missing key stays FileNotFoundError. (Local paths: actors/output.py `storage`.)"""

    def __init__(self, where: ObjPath):
        self.where = where

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb):
        if e is None or isinstance(e, (FileNotFoundError, JobExit)) or not isinstance(e, OSError):
            return False
        raise OutDirError(f"cannot reach {self.where}: {first_line(e)}; committed parts are intact: check the "
                          f"store (endpoint, credentials, network), then rerun the same command") from None


def at(where) -> Where:
    """A local path or URI -> Path or ObjPath. A URI whose scheme no filesystem knows: StoreConfigError."""
    if isinstance(where, (Path, ObjPath)):
        return where
    s = str(where)
    m = URI.match(s)
    if m is None:
        return Path(s).expanduser()
    scheme, rest = m.group(1).lower(), m.group(2)
    if scheme == "file":
        return Path("/" + rest.lstrip("/"))
    fs, key = _filesystem(scheme, rest, tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
    query = rest[rest.index("?"):] if "?" in rest else ""
    if not key.strip("/"):
        raise StoreConfigError(f"{s}: name a bucket and a prefix ({scheme}://BUCKET/PREFIX)")
    return ObjPath(fs, key, scheme, query)


def is_remote(where) -> bool:
    return isinstance(where, ObjPath)


def put(data, path: ObjPath) -> None:
    """The whole of `data` at `path` in one request: the object appears complete or not at all (an S3 PUT,
    or a multipart upload that is completed only once every part is sent)."""
    with reach(path):
        out = path.fs.open_output_stream(path.key)
        try:
            out.write(data)
        except BaseException:
            if hasattr(out, "abort"):
                out.abort()           # never complete a partial upload
            raise
        out.close()


def entries(d: Where) -> dict[str, str]:
    """Direct children of a directory or prefix: name -> "file", "dir" or "other"; {} if there is none."""
    if isinstance(d, Path):
        if not d.is_dir():
            return {}
        return {e.name: "dir" if e.is_dir(follow_symlinks=False) else "file" if e.is_file(follow_symlinks=False)
                else "other" for e in os.scandir(d)}
    import pyarrow.fs as pfs
    with reach(d):
        infos = d.fs.get_file_info(pfs.FileSelector(d.key, allow_not_found=True, recursive=False))
    kinds = {pfs.FileType.File: "file", pfs.FileType.Directory: "dir"}
    return {i.path.rsplit("/", 1)[-1]: kinds.get(i.type, "other") for i in infos}


def move(src: Where, dst: Where) -> None:
    """Rename on a disk; copy then delete on an object store (a crash between leaves both: the source is
    found and moved again)."""
    if isinstance(src, Path):
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.move(src, dst)
        return
    with reach(src):
        src.fs.copy_file(src.key, dst.key)
        src.fs.delete_file(src.key)


def source(path: Where):
    """What pyarrow.parquet reads: the path itself, or an open random-access file on a store."""
    return path if isinstance(path, Path) else path.open_input()


def _has_aws_credentials() -> bool:
    """Whether the standard AWS chain finds any credentials (variables, profile, shared files)."""
    try:
        import boto3
    except ImportError:
        return bool(os.environ.get("AWS_ACCESS_KEY_ID") or os.environ.get("AWS_PROFILE"))
    return boto3.Session().get_credentials() is not None


def check_reachable(out: ObjPath, field: str = "out_dir") -> None:
    """Before anything starts: the bucket exists and these credentials may list it. One line otherwise."""
    import pyarrow.fs as pfs
    try:
        info = out.fs.get_file_info(out.bucket)
        if info.type != pfs.FileType.NotFound:
            out.fs.get_file_info(pfs.FileSelector(out.key, allow_not_found=True, recursive=False))
    except OSError as e:
        msg = first_line(e)
        if out.scheme == "s3" and not _has_aws_credentials():
            raise StoreConfigError(f"{field}={out}: no credentials found: set AWS_ACCESS_KEY_ID and "
                                   f"AWS_SECRET_ACCESS_KEY, or AWS_PROFILE ({msg})") from None
        hint = ("the credentials were refused: set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or AWS_PROFILE) to "
                "keys this store accepts" if re.search(r"ACCESS_DENIED|SignatureDoesNotMatch|InvalidAccessKeyId|"
                                                       r"403|Forbidden|credentials", msg, re.I)
                else "check the endpoint (AWS_ENDPOINT_URL) and the network")
        raise StoreConfigError(f"{field}={out}: {hint} ({msg})") from None
    if info.type == pfs.FileType.NotFound:
        raise StoreConfigError(f"{field}={out}: bucket {out.bucket!r} does not exist (or these credentials "
                               f"cannot see it): create it, or name an existing one")
