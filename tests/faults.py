"""Faults at a fixed point of a job: right after the driver records its n-th committed part
(actors/pool.py `record_part`), so that a test's fault lands mid-job on any machine (a thread polling the
out_dir for parts can look only after a fast machine wrote them all).

`python -m tests.faults N ARGS...` runs `python -m workflows.generate ARGS...` and SIGKILLs that driver
right after its N-th part is recorded, as a crash or an OOM kill would end it."""
from __future__ import annotations

import os
import signal
import sys


def after_parts(n: int, action) -> None:
    """Call `action()` in the driver right after its n-th part is recorded (the real one runs first)."""
    import actors.pool
    record, seen = actors.pool.record_part, []

    def recorded(*args, **kwargs):
        record(*args, **kwargs)
        seen.append(1)
        if len(seen) == n:
            action()
    actors.pool.record_part = recorded


if __name__ == "__main__":
    after_parts(int(sys.argv[1]), lambda: os.kill(os.getpid(), signal.SIGKILL))
    sys.argv = [sys.argv[0], *sys.argv[2:]]
    from workflows.generate import main
    main()
