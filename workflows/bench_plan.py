"""Driver memory and time of the job's planning, on synthetic prompt sets (no Ray, no model):
`python -m workflows.bench_plan sizes=[100000,1000000,10000000] [id_column=true] [dir=/tmp/arspec-bench-plan]`.

For each size: writes (once) a Parquet file of that many prompts (row groups of 100k, as a large prompt
set would be written), then in a fresh process runs what the job's driver does before and while it
dispatches — `plan_job` (open, check out_dir, committed-part index, the checking pass) and then the
whole stream of batches the pool would consume — and reports that process's peak RSS and the seconds of
each phase. Times depend on the host; peak RSS does not.
"""
from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import hydra
from omegaconf import DictConfig

from workflows.config import ConfigError, cli, one_line_errors

ROW_GROUP = 100_000


def synthetic(path: Path, n: int) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    if path.exists():
        return path
    tmp = path.with_suffix(".tmp")
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string())])
    with pq.ParquetWriter(tmp, schema) as w:
        for s in range(0, n, ROW_GROUP):
            k = range(s, min(n, s + ROW_GROUP))
            w.write_table(pa.table({"id": [f"p{i:010d}" for i in k],
                                    "prompt": [f"a red circle above a blue square, variant {i}" for i in k]},
                                   schema=schema))
    tmp.rename(path)
    return path


def measure(path: Path, out_dir: Path, id_column: bool) -> dict:
    """In this process: the driver's planning, then the stream of batches. -> seconds and peak RSS."""
    from hydra import compose, initialize_config_dir
    from workflows.config import to_object
    from workflows.generate import plan_job
    import actors.output, workflows.plan  # noqa: F401,E401  (imports are not planning)
    overrides = ["data=file", f"data.path={path}", f"out_dir={out_dir}"] + (["data.id_column=id"] if id_column else [])
    with initialize_config_dir(config_dir=str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        c = to_object(compose("generate", overrides=overrides))
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    plan = plan_job(c)
    t1 = time.perf_counter()
    n = sum(len(b) for b in plan.batches())
    t2 = time.perf_counter()
    assert n == plan.stats.pending
    return {"prompts": plan.stats.prompts, "batches": plan.stats.batches, "plan_s": round(t1 - t0, 2),
            "stream_s": round(t2 - t1, 2), "rss_before_mb": round(rss0),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_plan")
@one_line_errors
def main(cfg: DictConfig) -> None:
    if not cfg.sizes or min(cfg.sizes) < 1:
        raise ConfigError(f"sizes={list(cfg.sizes or [])}: give prompt counts >= 1, e.g. sizes=[100000]")
    d = Path(cfg.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in cfg.sizes:
        path = synthetic(d / f"prompts-{n}.parquet", int(n))
        out = d / f"out-{n}-{'id' if cfg.id_column else 'derived'}"
        code = (f"import json; from pathlib import Path; from workflows.bench_plan import measure; "
                f"print(json.dumps(measure(Path({str(path)!r}), Path({str(out)!r}), {bool(cfg.id_column)})))")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print("| prompts | id column | plan s (checking pass) | stream s (all batches) | peak RSS MB (before planning) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['prompts']:,} | {'yes' if cfg.id_column else 'no (derived)'} | {r['plan_s']} | {r['stream_s']} | "
              f"{r['peak_rss_mb']} ({r['rss_before_mb']}) |")


if __name__ == "__main__":
    cli(main)
