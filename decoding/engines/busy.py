"""How much CPU other processes used while a cost table was measured (cost.py): a table timed beside
other work prices the larger forwards dearer than they are (beside one CPU-bound process, a 16-token
chain step cost 3.7 plain steps against 3.1 on the quiet host) and, kept for good, would mislead
every later run (docs/measurements.md, "A cost table timed on a busy host"). Linux's /proc counts
every process's CPU time; elsewhere the load is unknown and counts as none."""
from __future__ import annotations

import os
import time
from pathlib import Path

# A table is measured again, up to ATTEMPTS times in all, while other processes use more than BUSY
# cores' worth of the host's CPU beside it; the attempts' least costs are kept, cell by cell.
BUSY, ATTEMPTS = 0.25, 3


def cpu_seconds() -> tuple[float, float] | None:
    """(CPU seconds every process on the host has used since boot, this process's share of them), or
    None where /proc cannot tell."""
    try:
        cpu = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]   # user .. steal
        mine = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()  # fields 3.. (state first)
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None
    busy = sum(int(x) for x in cpu) - int(cpu[3]) - int(cpu[4])             # less idle and iowait
    return busy / hz, (int(mine[11]) + int(mine[12])) / hz                  # utime + stime, all threads


class Load:
    """Cores' worth of CPU that other processes use from now on: `Load()` then `.others()`."""

    def __init__(self):
        self.t0, self.cpu0 = time.perf_counter(), cpu_seconds()

    def others(self) -> float:
        cpu = cpu_seconds()
        if cpu is None or self.cpu0 is None:
            return 0.0
        seconds = max(time.perf_counter() - self.t0, 1e-6)
        return max((cpu[0] - self.cpu0[0]) - (cpu[1] - self.cpu0[1]), 0.0) / seconds
