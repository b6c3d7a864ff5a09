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

from actors.output import JobExit, lock_token, storage

log = logging.getLogger("arspec.job")
_HELD: set[str] = set()   # tokens of the locks this process holds now


class LockHeld(JobExit):
    """Another live job owns the out_dir (exit 4)."""
    code = 4


class Preempted(JobExit):
    """The job stopped on SIGTERM (or lost its lock) after its grace period; rerun to finish (exit 143,
    128 + SIGTERM, as schedulers expect of a job that honours the signal)."""
    code, prefix = 143, ""


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_start(pid: int) -> Optional[str]:
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


@functools.cache
def _unblock_in_children() -> None:
    os.register_at_fork(after_in_child=lambda: signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM}))


class Stop:
    """Set by SIGTERM or a lost lock: no new batches; in-flight ones may finish until `deadline`."""

    def __init__(self, grace_s: float):
        self.grace_s, self.reason, self.deadline = grace_s, None, float("inf")
        self._previous = None

    def catch_sigterm(self) -> None:
        """SIGTERM requests a stop instead of killing the process (main thread only). Called again
        after ray.init, whose core worker installs its own SIGTERM handler (it aborts the process)."""
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, lambda *_: self.request("SIGTERM"))
            if self._previous is None:
                self._previous = previous

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
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            yield
        finally:
            self.catch_sigterm()
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def request(self, reason: str) -> None:
        if self.reason is None:
            self.reason, self.deadline = reason, time.time() + self.grace_s
            log.warning(f"[generate] {reason}: no new batches; in-flight ones may finish within "
                        f"cluster.grace_s={self.grace_s:g}s, then the job stops (rerun the same command to finish)")

    def __bool__(self) -> bool:
        return self.reason is not None


class OutDirLock:
    def __init__(self, out_dir: Path, timeout_s: float = 60.0, stop: Optional[Stop] = None):
        self.out_dir, self.path, self.timeout_s, self.stop = Path(out_dir), Path(out_dir) / "job.lock", timeout_s, stop
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _pid_start(os.getpid()),
                   "boot_id": _boot_id(), "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                   "token": secrets.token_hex(8)}
        self._done = threading.Event()
        self._beat: Optional[threading.Thread] = None

    def _read(self) -> tuple[bytes, dict, float]:
        raw = self.path.read_bytes()
        age = time.time() - self.path.stat().st_mtime
        try:
            owner = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            owner = {}     # torn: its creator died between create and write
        return raw, owner if isinstance(owner, dict) else {}, age

    def _why_stale(self, owner: dict, age: float) -> Optional[str]:
        """Why the owner no longer holds the lock, or None while it does."""
        same_machine = owner.get("host") == self.me["host"] and owner.get("boot_id") == self.me["boot_id"]
        if same_machine and isinstance(owner.get("pid"), int):
            if owner["pid"] == os.getpid() and owner.get("token") not in _HELD:
                return "was an earlier run in this process"
            start = _pid_start(owner["pid"])
            if start is None or (start and owner.get("pid_start") and start != owner["pid_start"]):
                return "is no longer running"
        if age > self.timeout_s:
            return f"has been silent for {age:.0f}s (cluster.lock_timeout_s={self.timeout_s:g})"
        return None

    @staticmethod
    def describe(owner: dict) -> str:
        if not owner:
            return "a job whose lock file is still being written"
        return f"the job of pid {owner.get('pid')} on host {owner.get('host')} started {owner.get('started')}"

    def acquire(self) -> "OutDirLock":
        with storage(self.out_dir):
            self.out_dir.mkdir(parents=True, exist_ok=True)
        for _ in range(5):
            try:
                with storage(self.path):
                    fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                try:
                    raw, owner, age = self._read()
                except FileNotFoundError:
                    continue         # released meanwhile
                why = self._why_stale(owner, age)
                if why is None:
                    raise LockHeld(f"out_dir={self.out_dir} is in use by {self.describe(owner)} (heartbeat "
                                   f"{age:.0f}s ago; lock {self.path}): wait for it to finish, stop it, or use "
                                   f"another out_dir") from None
                if self._take_over(raw):
                    log.warning(f"[generate] taking over out_dir={self.out_dir}: its lock's owner, "
                                f"{self.describe(owner)}, {why}")
                continue
            try:
                with storage(self.path), os.fdopen(fd, "w") as f:
                    json.dump(self.me, f)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                self.path.unlink(missing_ok=True)     # ours, and empty or torn: it would block the next job
                raise
            _HELD.add(self.me["token"])
            self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="out_dir-lock")
            self._beat.start()
            return self
        raise LockHeld(f"out_dir={self.out_dir}: other jobs keep taking its lock ({self.path}); start one job at a time")

    def _take_over(self, judged: bytes) -> bool:
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
            if not self._owned():
                if self.stop is not None:
                    self.stop.request(f"another job took over out_dir={self.out_dir}")
                return
            try:
                os.utime(self.path)
            except OSError as e:
                log.warning(f"[generate] cannot touch the lock {self.path}: {e}")

    def release(self) -> None:
        self._done.set()
        if self._beat is not None:
            self._beat.join(timeout=5)
        _HELD.discard(self.me["token"])
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
