"""Check an out_dir's committed parts alone: `python -m workflows.verify out_dir=PATH [verify=full]`.

The same check the job makes on start (actors/output.py `inspect`: every file of every committed part
present, its size and Parquet footer row count as the manifest recorded them, and its Parquet page
checksums; `verify=full` compares every file's sha256 instead; a part with no manifest line is checked
from its files alone: page checksums, every PNG decoded). It changes nothing (the job moves damaged parts to
out_dir/quarantine/ when it resumes). One line per damaged part, a last line with the counts; exits
0 when every part is sound, 1 when some are damaged, 2 on a bad argument. out_dir may be a URI
(s3://bucket/prefix: actors/store.py), checked over the store's keys the same way.
"""
from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    from actors.output import JobExit
    from actors.store import ObjPath, StoreConfigError, at, check_reachable
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    unknown = sorted(set(args) - {"out_dir", "verify"}) + [a for a in argv if "=" not in a]
    if unknown or "out_dir" not in args:
        print(f"error: usage: python -m workflows.verify out_dir=PATH [verify=quick|full] (got {' '.join(argv)})",
              file=sys.stderr)
        return 2
    mode = args.get("verify", "quick")
    try:
        out_dir = at(args["out_dir"])
        if isinstance(out_dir, ObjPath):
            check_reachable(out_dir)
    except StoreConfigError as e:
        print(f"error: {e}" if str(e).startswith('out_dir=') else f"error: out_dir={e}", file=sys.stderr)
        return 2
    try:
        return _verify(out_dir, mode)
    except JobExit as e:          # the store went away meanwhile
        print(f"{e.prefix}{e}", file=sys.stderr)
        return 2


def _verify(out_dir, mode: str) -> int:
    from actors.output import inspect, read_manifest
    if not (out_dir / "job.json").exists():
        print(f"error: out_dir={out_dir}: no job.json, not a job's out_dir", file=sys.stderr)
        return 2
    try:
        parts, damaged = inspect(out_dir, mode)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for part, reason in damaged.items():
        print(f"damaged {part}: {reason}")
    prompts, listed = sum(parts.values()), read_manifest(out_dir)
    unlisted = sum(p not in listed for p in [*parts, *damaged])
    print(f"[verify] out_dir={out_dir} verify={mode}: {len(parts)} sound parts ({prompts} prompts), "
          f"{len(damaged)} damaged" + (" (the job quarantines and regenerates them on its next run)" if damaged else "")
          + (f"; {unlisted} part(s) have no manifest line: checked from their files alone" if unlisted else ""))
    return 1 if damaged else 0


if __name__ == "__main__":
    from workflows.config import exit_now
    exit_now(main(sys.argv[1:]))
