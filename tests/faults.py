"""Faults at a fixed point of a job: right after the driver records its n-th committed part
(actors/pool.py `_record`). A watcher thread that polls the out_dir for parts raced the job: on a fast
machine all 15 parts of a test job were written between two looks, and "killed mid-job" was not.

`python -m tests.faults N ARGS...` runs `python -m workflows.generate ARGS...` and SIGKILLs that driver
right after its N-th part is recorded, as a crash or an OOM kill would end it."""
from __future__ import annotations

import os
import signal
import sys


def after_parts(n: int, action) -> None:
    """Call `action()` in the driver right after its n-th part is recorded (the real `_record` runs first)."""
    import actors.pool
    record, seen = actors.pool._record, []

    def _record(*args, **kwargs):
        record(*args, **kwargs)
        seen.append(1)
        if len(seen) == n:
            action()
    actors.pool._record = _record


if __name__ == "__main__":
    after_parts(int(sys.argv[1]), lambda: os.kill(os.getpid(), signal.SIGKILL))
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    from workflows.generate import main
    main()
