"""One job per out_dir, and a clean stop on SIGTERM (docs/design.md, "One job per out_dir" and
"Preemption").

`OutDirLock`: out_dir/job.lock is created with O_EXCL (atomic on local disks and on NFS) and holds
its owner's host, pid, the pid's start time, the boot id and a random token; the owner touches it
every `timeout_s / 4` seconds (its mtime is the heartbeat). A second job finds it and:
- refuses in one line naming the owner while the owner lives: on the same host (and boot), its pid is
  running with the same start time; on another host, its heartbeat is younger than `timeout_s`;
- takes it over, with a line saying so, when the owner is dead (same host) or silent past `timeout_s`
  (any host, this one included: a suspended owner is taken over too). The stale lock is renamed aside
  first, and only the job whose rename moved exactly the lock it judged stale goes on; a job that
  finds its token gone from the lock (it was silent, e.g. suspended, and was taken over) stops, and
  commits nothing more (actors/output.py `check_lock`, before every file of a part and every line).
A lock that cannot be written (disk full) is removed again, and one that cannot be removed (out_dir
became read-only) is a dead owner's, taken over at once by the next job on this host.

`ObjectLock`: the same lock on an S3 prefix (actors/store.py), with the store's conditional requests in
place of O_EXCL and rename: created with If-None-Match: * (a second create fails), the heartbeat and a
takeover are PUTs with If-Match: the ETag read (the one that loses the race fails), the age is the
server's Date minus the lock's Last-Modified (no clock of this host is compared with the store's), and
the release is a DELETE with If-Match. A store that ignores If-None-Match (checked with a probe key
before the lock is written) or a scheme without conditional writes here (gs://, other fsspec stores)
is refused in one line: two jobs could not be kept apart.

`Stop`: the reason the job must stop (SIGTERM, or the lock lost) and the deadline of its grace period;
actors/pool.py reads it between results.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import secrets
import signal
import socket
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from actors.output import JobExit, OutDirError, lock_token, storage
from actors.store import ObjPath, first_line

log = logging.getLogger("arspec.job")
_HELD: set[str] = set()   # tokens of the locks this process holds now


class LockHeld(JobExit):
    """Another live job owns the out_dir (exit 4)."""
    code = 4


class Preempted(JobExit):
    """The job stopped on SIGTERM (or lost its lock) after its grace period; rerun to finish (exit 143,
    128 + SIGTERM, as schedulers expect of a job that honours the signal; 130 after Ctrl-C)."""
    code, prefix = 143, ""

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason == "SIGINT":
            self.code = 130


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def pid_start(pid: int) -> Optional[str]:
    """The pid's start time (clock ticks since boot), which a reused pid does not share; None if no such pid."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return ""      # running, start time unknown (no /proc)
        except ProcessLookupError:
            return None
        except PermissionError:
            return ""


STOP_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@functools.cache
def _unblock_in_children() -> None:
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS))


class Stop:
    """Set by SIGTERM, Ctrl-C (SIGINT) or a lost lock: no new batches; in-flight ones may finish until
    `deadline`. A second Ctrl-C stops at once (KeyboardInterrupt: committed parts are kept)."""

    def __init__(self, grace_s: float):
        self.grace_s, self.reason, self.deadline = grace_s, None, float("inf")
        self._previous = None

    def catch_sigterm(self) -> None:
        """SIGTERM and SIGINT request a stop instead of killing the process (main thread only). Called
        again after ray.init, whose core worker installs its own SIGTERM handler (it aborts the process)."""
        if threading.current_thread() is threading.main_thread():
            previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, lambda *_: self.request("SIGTERM")),
                        signal.SIGINT: signal.signal(signal.SIGINT, lambda *_: self._interrupt())}
            if self._previous is None:
                self._previous = previous

    def _interrupt(self) -> None:
        if self.reason == "SIGINT":
            raise KeyboardInterrupt
        self.request("SIGINT")
        log.warning("[generate] Ctrl-C again stops at once (parts in flight are then redone by the rerun)")

    @contextmanager
    def held(self):
        """SIGTERM held pending (blocked in the main thread; the lock's heartbeat thread always blocks it)
        while third-party code installs handlers of its own (ray.init: one that exits, then the core
        worker's stack dump and abort); then the job's handler is put back and gets it. Processes forked
        meanwhile unblock it again (os.register_at_fork), so they still stop on SIGTERM."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        _unblock_in_children()
        signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            yield
        finally:
            self.catch_sigterm()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)

    def restore(self) -> None:
        if self._previous is not None:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason, self.deadline = reason, time.time() + self.grace_s
            log.warning(f"[generate] {reason}: no new batches; in-flight ones may finish within "
                        f"cluster.grace_s={self.grace_s:g}s, then the job stops (rerun the same command to finish)")

    def __bool__(self) -> bool:
        return self.reason is not None


def _describe(owner: dict) -> str:
    """A lock's owner in words (owner: the lock file's JSON)."""
    if not owner:
        return "a job whose lock file is still being written"
    return f"the job of pid {owner.get('pid')} on host {owner.get('host')} started {owner.get('started')}"


class OutDirLock:
    def __init__(self, out_dir: Path, timeout_s: float = 60.0, stop: Optional[Stop] = None):
        self.out_dir, self.path, self.timeout_s, self.stop = Path(out_dir), Path(out_dir) / "job.lock", timeout_s, stop
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": pid_start(os.getpid()),
                   "boot_id": _boot_id(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "token": secrets.token_hex(8)}
        self._done = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def read(self) -> tuple[bytes, dict, float]:
        raw = self.path.read_bytes()
        age = time.time() - self.path.stat().st_mtime
        try:
            owner = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            owner = {}     # torn: its creator died between create and write
        return raw, owner if isinstance(owner, dict) else {}, age

    def _stale_or_refuse(self, owner: dict, age: float) -> str:
        """Why the lock's owner is gone, or LockHeld (one line) while it lives."""
        why = self._why_stale(owner, age)
        if why is None:
            raise LockHeld(f"out_dir={self.out_dir} is in use by {_describe(owner)} (heartbeat "
                           f"{age:.0f}s ago; lock {self.path}): wait for it to finish, stop it, or use "
                           f"another out_dir") from None
        return why

    def _taking_over(self, owner: dict, why: str) -> None:
        log.warning(f"[generate] taking over out_dir={self.out_dir}: its lock's owner, {_describe(owner)}, {why}")

    def _why_stale(self, owner: dict, age: float) -> Optional[str]:
        """Why the owner no longer holds the lock, or None while it does."""
        same_machine = owner.get("host") == self.me["host"] and owner.get("boot_id") == self.me["boot_id"]
        if same_machine and isinstance(owner.get("pid"), int):
            if owner["pid"] == os.getpid() and owner.get("token") not in _HELD:
                return "was an earlier run in this process"
            start = pid_start(owner["pid"])
            if start is None or (start and owner.get("pid_start") and start != owner["pid_start"]):
                return "is no longer running"
        if age > self.timeout_s:
            return f"has been silent for {age:.0f}s (cluster.lock_timeout_s={self.timeout_s:g})"
        return None

    def acquire(self) -> "OutDirLock":
        with storage(self.out_dir):
            self.out_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                with storage(self.path):
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    raw, owner, age = self.read()
                except FileNotFoundError:
                    continue         # released meanwhile
                why = self._stale_or_refuse(owner, age)
                if self.take_over(raw):
                    self._taking_over(owner, why)
                continue
            try:
                with storage(self.path), os.fdopen(fd, "w") as f:
                    json.dump(self.me, f)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                self.path.unlink(missing_ok=True)     # ours, and empty or torn: it would block the next job
                raise
            return self._held()
        raise LockHeld(f"out_dir={self.out_dir}: other jobs keep taking its lock ({self.path}); start one job at a time")

    def take_over(self, judged: bytes) -> bool:
        """Move the stale lock aside; True if what moved is the lock judged stale (not a fresh one that
        another job wrote meanwhile, which is put back)."""
        aside = self.path.with_name(f"job.lock.stale-{self.me['token']}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False
        moved = aside.read_bytes()
        if moved != judged:
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink(missing_ok=True)
        return moved == judged

    def _owned(self) -> bool:
        return lock_token(self.out_dir) == self.me["token"]

    def _heartbeat(self) -> None:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})     # SIGTERM is the main thread's (Stop)
        every = max(0.2, self.timeout_s / 4)
        while not self._done.wait(every):
            try:
                owned = self._owned()
            except OutDirError as e:       # a store out of reach: the job's own writes will say so
                log.warning(f"[generate] cannot read the lock {self.path}: {e}")
                continue
            if not owned:
                if self.stop is not None:
                    self.stop.request(f"another job took over out_dir={self.out_dir}")
                return
            self._touch()

    def _touch(self) -> None:
        try:
            os.utime(self.path)
        except OSError as e:
            log.warning(f"[generate] cannot touch the lock {self.path}: {e}")

    def _held(self):
        """The lock is this job's: heartbeat it."""
        _HELD.add(self.me["token"])
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="out_dir-lock")
        self._beat.start()
        return self

    def _stop_heartbeat(self) -> None:
        self._done.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        _HELD.discard(self.me["token"])

    def release(self) -> None:
        self._stop_heartbeat()
        if self._owned():
            try:
                self.path.unlink(missing_ok=True)
            except OSError:      # out_dir became read-only: the lock stays, a dead pid's (see the module doc)
                pass

    def __enter__(self) -> "OutDirLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


class on_sigterm:
    """While active (in the main thread): SIGTERM requests `stop` instead of killing the process."""

    def __init__(self, stop: Stop):
        self.stop = stop

    def __enter__(self) -> Stop:
        self.stop.catch_sigterm()
        return self.stop

    def __exit__(self, *exc) -> None:
        self.stop.restore()


class LockUnsafe(JobExit):
    """out_dir is on a store where two jobs cannot be kept apart (exit 4)."""
    code = 4


def out_dir_lock(out_dir, timeout_s: float = 60.0, stop: Optional[Stop] = None) -> "OutDirLock":
    """The lock for out_dir: a file on a disk, conditional requests on an S3 store."""
    return ObjectLock(out_dir, timeout_s, stop) if isinstance(out_dir, ObjPath) else OutDirLock(out_dir, timeout_s, stop)


def s3_client(out_dir: ObjPath):
    """A boto3 S3 client for out_dir's store: the same environment (AWS_* variables, profile) pyarrow reads,
    and its endpoint (the URI's endpoint_override, else AWS_ENDPOINT_URL, which boto3 reads itself)."""
    from urllib.parse import parse_qs
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise LockUnsafe(f"out_dir={out_dir}: locking an s3:// out_dir needs boto3 (pip install 'arspec[s3]')") from None
    q = {k: v[-1] for k, v in parse_qs(out_dir.query.lstrip("?")).items()}
    endpoint = q.get("endpoint_override")
    if endpoint and "://" not in endpoint:
        endpoint = f"{q.get('scheme', 'https')}://{endpoint}"
    return boto3.client("s3", endpoint_url=endpoint, region_name=q.get("region") or os.environ.get("AWS_REGION")
                        or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
                        config=Config(retries={"max_attempts": 2}, connect_timeout=5, read_timeout=20))


class ObjectLock(OutDirLock):
    """OutDirLock's rules on an S3 prefix: conditional PUT / DELETE instead of O_EXCL and rename (module doc)."""

    def __init__(self, out_dir: ObjPath, timeout_s: float = 60.0, stop: Optional[Stop] = None):
        super().__init__(Path("."), timeout_s, stop)
        self.out_dir, self.path = out_dir, out_dir / "job.lock"
        if out_dir.scheme != "s3":
            raise LockUnsafe(f"out_dir={out_dir}: a {out_dir.scheme}:// prefix cannot be locked against a second job "
                             f"here (no conditional create): use an s3:// URI (an S3-compatible endpoint of the "
                             f"store, AWS_ENDPOINT_URL) or a local out_dir")
        self.client, self.bucket = s3_client(out_dir), out_dir.bucket
        self.key = self.path.key.split("/", 1)[1]
        self.etag: Optional[str] = None

    # -- one request each; a store error other than a failed condition ends the job in one line
    def _call(self, op: str, **kw):
        from botocore.exceptions import BotoCoreError, ClientError
        try:
            return getattr(self.client, op)(Bucket=self.bucket, **kw)
        except ClientError as e:
            code = e.response.get("Error", {}).get("Code", "")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey", "404"):
                raise
            raise OutDirError(f"cannot write the lock {self.path}: {code or first_line(e)}; check the store "
                              f"(credentials, endpoint), then rerun the same command") from None
        except BotoCoreError as e:
            raise OutDirError(f"cannot reach {self.path}: {first_line(e)}; check the store (endpoint, network), "
                              f"then rerun the same command") from None

    @staticmethod
    def _failed(e) -> Optional[str]:
        from botocore.exceptions import ClientError
        return e.response.get("Error", {}).get("Code", "") if isinstance(e, ClientError) else None

    def _put(self, body: dict, **cond) -> str:
        return self._call("put_object", Key=self.key, Body=json.dumps(body).encode(), **cond)["ETag"]

    def _check_conditional_create(self) -> None:
        """A probe key created twice with If-None-Match: *: a store that lets the second through cannot
        keep two jobs apart."""
        from botocore.exceptions import ClientError
        probe = self.key.rsplit("/", 1)[0] + f"/job.lock.probe-{self.me['token']}"
        self._call("put_object", Key=probe, Body=b"", IfNoneMatch="*")
        try:
            self._call("put_object", Key=probe, Body=b"", IfNoneMatch="*")
            honoured = False
        except ClientError:
            honoured = True
        self._call("delete_object", Key=probe)
        if not honoured:
            raise LockUnsafe(f"out_dir={self.out_dir}: this store ignores conditional creates (If-None-Match: *), so "
                             f"a second job could not be refused: use a store that honours them, or a local out_dir")

    def read(self) -> tuple[str, dict, float]:
        from email.utils import parsedate_to_datetime
        r = self._call("get_object", Key=self.key)
        raw = r["Body"].read()
        now = parsedate_to_datetime(r["ResponseMetadata"]["HTTPHeaders"]["date"])
        try:
            owner = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            owner = {}
        return r["ETag"], owner if isinstance(owner, dict) else {}, (now - r["LastModified"]).total_seconds()

    def acquire(self) -> "ObjectLock":
        from botocore.exceptions import ClientError
        self._check_conditional_create()
        for _ in range(5):
            try:
                self.etag = self._put(self.me, IfNoneMatch="*")
            except ClientError as e:
                if self._failed(e) not in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409"):
                    raise
                try:
                    etag, owner, age = self.read()
                except ClientError:
                    continue                      # released meanwhile
                why = self._stale_or_refuse(owner, age)
                if not self.take_over(etag):
                    continue
                self._taking_over(owner, why)
            return self._held()
        raise LockHeld(f"out_dir={self.out_dir}: other jobs keep taking its lock ({self.path}); start one job at a time")

    def take_over(self, judged: str) -> bool:
        """Replace exactly the lock judged stale (its ETag `judged`): of two jobs that judged it, one wins;
        a fresher lock (another ETag) is left alone. True if this job now holds it."""
        from botocore.exceptions import ClientError
        try:
            self.etag = self._put(self.me, IfMatch=judged)
            return True
        except ClientError:
            return False

    def _touch(self) -> None:
        """The heartbeat: rewrite the lock only while it is still the one this job wrote (If-Match)."""
        from botocore.exceptions import ClientError
        try:
            self.etag = self._put({**self.me, "beat": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, IfMatch=self.etag)
        except (ClientError, OutDirError) as e:
            log.warning(f"[generate] cannot touch the lock {self.path}: {first_line(e)}")

    def release(self) -> None:
        from botocore.exceptions import ClientError
        self._stop_heartbeat()
        if self.etag is None:
            return
        try:
            self._call("delete_object", Key=self.key, IfMatch=self.etag)
        except (ClientError, OutDirError):     # taken over (not ours), or the store is gone: the lock stays
            pass
