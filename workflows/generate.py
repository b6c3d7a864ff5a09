"""The batch job: `python -m workflows.generate [engine=...] [data=...] [out_dir=...] [seed=...]`.

Reads the prompts, skips those already committed in out_dir, shards the rest into batches and runs
them on Ray generator actors (a local Ray unless cluster.address is set). Every bad setting fails here,
before Ray starts, with one line naming the field.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from decoding import BYTES_VERSION  # noqa: E402
from workflows.config import ConfigError, GenerateConfig, cli, one_line_errors, register, to_object  # noqa: E402

log = logging.getLogger("arspec.job")
register()


def fingerprint(c: GenerateConfig) -> dict:
    """What decides the images: the settings and the version of the code that samples them
    (decoding.BYTES_VERSION). A rerun on the same out_dir must match it."""
    data = {k: getattr(c.data, k) for k in ("name", "path", "prompt_column", "id_column", "builtin_count")}
    model = {k: v for k, v in dataclasses.asdict(c.model).items() if k != "device"}
    return {"bytes_version": BYTES_VERSION, "model": model, "engine": dataclasses.asdict(c.engine), "data": data,
            "seed": c.seed}


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_out_dir(out_dir: Path, fp: dict) -> None:
    """job.json records `fp` (written atomically: actors/output.py); a rerun must match it."""
    from actors.output import OutDirError, write_bytes_atomic
    path = out_dir / "job.json"
    try:
        old = json.loads(path.read_text()) if path.exists() else None
    except (ValueError, UnicodeDecodeError) as e:
        if any((out_dir / "images").glob("*.parquet")):
            raise OutDirError(f"{path} is damaged ({str(e)[:80]}) and out_dir holds committed parts made with the "
                              f"settings it recorded: restore it, or use a new out_dir") from None
        log.warning(f"[generate] {path} is damaged ({str(e)[:80]}) and no part is committed: writing it again")
        old = None
    if old is None:
        write_bytes_atomic(json.dumps(fp, indent=2).encode(), path, "job.json")
        return
    old, new = _flat(old), _flat(fp)
    if old.get("bytes_version") != new["bytes_version"]:
        raise ConfigError(f"out_dir={out_dir} was written by a version of arspec that samples differently "
                          f"(bytes_version {old.get('bytes_version', 1)}, this one {new['bytes_version']}); "
                          f"its images cannot be completed with these: use a new out_dir")
    keys = sorted(set(old) | set(new), key=lambda k: (not k.endswith(".name"), k))  # a changed engine/model first
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    if diffs:
        raise ConfigError(f"out_dir={out_dir} was written by a different config ({'; '.join(diffs[:3])}); "
                          f"use a new out_dir or the same settings")


def validate(c: GenerateConfig, prompts: list = ()) -> None:
    """Build the model and engine once in the driver: a bad setting, or prompts the model cannot take
    (text for a class-conditional model), fail before any actor starts."""
    from decoding.engines import build_engine
    from decoding.registry import load_bundle
    cl = c.cluster
    for key in ("num_actors", "batch_size"):
        if getattr(cl, key) is not None and getattr(cl, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(cl, key)}: must be >= 1")
    if c.verify not in ("quick", "full"):
        raise ConfigError(f"verify={c.verify}: choose quick (sizes and Parquet footers) or full (also checksums)")
    if cl.grace_s < 0 or cl.lock_timeout_s <= 0:
        raise ConfigError(f"cluster.grace_s={cl.grace_s} / cluster.lock_timeout_s={cl.lock_timeout_s}: "
                          f"must be >= 0 / > 0")
    if cl.num_cpus_per_actor <= 0 and cl.num_gpus_per_actor <= 0:
        raise ConfigError("cluster.num_cpus_per_actor and cluster.num_gpus_per_actor are both 0: give actors a slot")
    try:
        bundle = load_bundle(dataclasses.replace(c.model, device="cpu"))
        build_engine(bundle, c.engine)
        if hasattr(bundle, "check_prompts"):
            bundle.check_prompts(prompts)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None


def start_ray(cl) -> bool:
    """Attach to cluster.address, or start a local Ray. Returns whether we started it."""
    import ray
    if ray.is_initialized():
        return False
    if cl.address:
        ray.init(address=cl.address)
        return True
    need = math.ceil((cl.num_actors or 1) * cl.num_cpus_per_actor)
    # address="local": a private Ray even when a head already runs on this machine (ray.init would attach
    # to it, and refuse num_cpus)
    ray.init(address="local", num_cpus=cl.local_num_cpus or max(need, os.cpu_count() or 1),
             num_gpus=None if cl.num_gpus_per_actor else 0, include_dashboard=False)
    return True


def actor_slots(cl) -> int:
    """cluster.num_actors=null: as many actors as the Ray cluster has slots (GPUs, or CPU groups)."""
    import ray
    res = ray.cluster_resources()
    if cl.num_gpus_per_actor > 0:
        return max(1, int(res.get("GPU", 0) // cl.num_gpus_per_actor))
    return max(1, int(res.get("CPU", 1) // cl.num_cpus_per_actor))  # validate() refused 0 CPUs and 0 GPUs


def actor_timeline(results: list, ray_ready: float) -> dict:
    """From the actors' own clocks: start-up (Ray ready -> an actor's first batch) and idle time (gaps
    between its batches: scheduling, result hand-off), which is what the job adds per image."""
    by_actor = {}
    for r in results:
        if r.started is not None:  # error parts made by the driver carry no actor timing
            by_actor.setdefault((r.node, r.pid), []).append(r)
    if not by_actor:
        return {"actor_start_seconds": None, "idle_seconds": None}
    starts, idle = [], 0.0
    for rs in by_actor.values():
        first, last = min(r.started for r in rs), max(r.ended for r in rs)
        starts.append(first - ray_ready)
        idle += max(0.0, (last - first) - sum(r.gen_s + r.write_s for r in rs))
    return {"actor_start_seconds": round(max(starts), 2), "idle_seconds": round(idle, 2)}


def summarize(results: list, c: GenerateConfig, total: int, already: int, seconds: float, ray_start_s: float,
              ray_ready: float) -> dict:
    """engine_seconds: summed engine time inside the actors; write_seconds: PNG + Parquet; idle_seconds:
    summed gaps between an actor's batches; the rest of `seconds` is Ray and actor start-up."""
    images = sum(r.images for r in results)
    errors = sum(r.errors for r in results)
    taus = [t for r in results for t in r.tau]
    walls = [w for r in results for w in r.wall_s]
    gen = sum(r.gen_s for r in results)
    acceptance = sorted({r.acceptance for r in results if r.acceptance})  # as the engine reports it
    return {"engine": c.engine.name, "acceptance": acceptance[0] if len(acceptance) == 1 else acceptance or None,
            "prompts": total,
            "already_done": already, "images": images, "errors": errors, "seconds": round(seconds, 2),
            "images_per_s": round(images / seconds, 3) if seconds > 0 else None,
            "mean_accept_len": round(sum(taus) / len(taus), 3) if taus else None,
            "engine_s_per_image": round(sum(walls) / len(walls), 4) if walls else None,
            "engine_seconds": round(gen, 2),
            "write_seconds": round(sum(r.write_s for r in results), 2),
            "ray_start_seconds": round(ray_start_s, 2), **actor_timeline(results, ray_ready),
            "num_actors": c.cluster.num_actors, "batch_size": c.cluster.batch_size,
            "nodes": len({r.node for r in results if r.node}),
            "out_dir": c.out_dir}


def run(cfg: DictConfig) -> dict:
    from workflows.lock import OutDirLock, Stop, on_sigterm
    from workflows.prompts import read_prompts

    c: GenerateConfig = to_object(cfg)
    items = read_prompts(c.data)
    validate(c, [it["prompt"] for it in items])
    out_dir = Path(c.out_dir)
    stop = Stop(c.cluster.grace_s)
    with on_sigterm(stop), OutDirLock(out_dir, c.cluster.lock_timeout_s, stop):   # workflows/lock.py
        return _generate(c, items, out_dir, stop)


def _generate(c: GenerateConfig, items: list[dict], out_dir: Path, stop) -> dict:
    from actors.output import recover, write_bytes_atomic
    from actors.pool import Progress, run_batches
    from decoding.sampling import prompt_seed
    from workflows.lock import Preempted

    check_out_dir(out_dir, fingerprint(c))
    parts = {p: e["prompt_ids"] for p, e in recover(out_dir, c.verify).items()}   # quarantines damaged parts
    done = {pid for ids in parts.values() for pid in ids}
    pending = [{**it, "seed": prompt_seed(c.seed, it["prompt_id"])} for it in items if it["prompt_id"] not in done]
    already = len(items) - len(pending)
    log.info(f"[generate] {len(items)} prompts, {already} already in {out_dir}, {len(pending)} to generate "
             f"with engine={c.engine.name}")
    t0 = time.time()
    results, ray_start_s = [], 0.0
    if pending and not stop:
        bs = c.cluster.batch_size
        batches = [pending[i:i + bs] for i in range(0, len(pending), bs)]
        started = start_ray(c.cluster)
        stop.catch_sigterm()   # again: ray.init's core worker replaced the handler with one that aborts
        ray_start_s = time.time() - t0
        if c.cluster.num_actors is None:
            c.cluster.num_actors = actor_slots(c.cluster)
            log.info(f"[generate] cluster.num_actors=null: {c.cluster.num_actors} actor(s), one per slot")
        try:
            results = run_batches(c, out_dir, batches, Progress(len(items), already), stop)
        finally:
            if started:
                import ray
                ray.shutdown()
    summary = summarize(results, c, len(items), already, time.time() - t0, ray_start_s, t0 + ray_start_s)
    summary["stopped"] = stop.reason
    write_bytes_atomic(json.dumps(summary, indent=2).encode(), out_dir / "summary.json", "summary.json")
    log.info("[generate] summary " + json.dumps(summary))
    left = len(pending) - summary["images"] - summary["errors"]
    if stop and left:
        raise Preempted(f"[generate] stopped ({stop.reason}): {summary['images'] + summary['errors']} prompts "
                        f"committed in this run, {left} left; rerun the same command to finish")
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
@one_line_errors
def main(cfg: DictConfig) -> dict:
    from actors.output import JobExit
    try:
        return run(cfg)
    except JobExit as e:   # out_dir unwritable (3), held by another job (4), stopped by SIGTERM (143)
        print(f"{e.prefix}{e}", file=sys.stderr)
        sys.exit(e.code)


if __name__ == "__main__":
    cli(main)
