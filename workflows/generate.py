"""The batch job: `python -m workflows.generate [engine=...] [data=...] [out_dir=...] [seed=...]`.

Streams the prompts, skips those already committed in out_dir, and runs the rest in batches on Ray
generator actors (docs/design.md, "The job on a cluster"). Every bad setting fails before Ray starts,
with one line naming the field; the driver reads checkpoint headers only, the actors load the model.
`cluster.address=null` starts a private local Ray (even when a head runs on this machine); `auto` or an
address attaches. A request for actors the cluster cannot place is one line after `cluster.wait_s`.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import sys
import time
from typing import Optional

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")   # before anything can import ray

import hydra  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from decoding import BYTES_VERSION  # noqa: E402
from workflows.config import ConfigError, GenerateConfig, cli, one_line_errors, register, to_object  # noqa: E402

log = logging.getLogger("arspec.job")
register()
LOCAL_WAIT_S = 10.0   # a private local Ray cannot grow: what it cannot place now it never will


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


def _job_json(out_dir) -> tuple[Optional[dict], str]:
    """(the settings job.json records, or None; what is wrong with it: "" or why it is not a job's)."""
    path = out_dir / "job.json"
    if not path.is_file():
        return None, "is missing"
    try:
        job = json.loads(path.read_bytes())
    except (ValueError, UnicodeDecodeError) as e:
        return None, f"is damaged ({str(e)[:80]})"
    if not (isinstance(job, dict) and {"engine", "model", "seed"} <= set(job)):
        return None, "is not a job's (no engine, model and seed)"
    return job, ""


def out_dir_of(c: GenerateConfig):
    """out_dir as a Path, or an ObjPath for a URI (actors/store.py); a scheme no filesystem knows is one line."""
    from actors.store import ObjPath, StoreConfigError, at
    try:
        out = at(c.out_dir)
    except StoreConfigError as e:
        raise ConfigError(f"out_dir={e}") from None
    if isinstance(out, ObjPath) and out.scheme != "s3":   # workflows/lock.py ObjectLock
        raise ConfigError(f"out_dir={c.out_dir}: a job writes to a {out.scheme}:// prefix only where it can lock it "
                          f"against a second job (a conditional create), which it does on s3:// stores: use the "
                          f"store's S3 endpoint (s3:// with AWS_ENDPOINT_URL), or a local out_dir")
    return out


def claim_out_dir(out_dir) -> None:
    """A job writes only into an absent or empty directory, or one that is recognisably a job's: its
    job.json, or no more than what a job's first moments leave (its lock, job.json's temporary file).
    Anything else is refused in one line naming what was found, before anything is written there. On an
    object store the same, by listing the prefix, after checking its bucket and credentials."""
    from actors.output import survey
    from actors.store import ObjPath, StoreConfigError, check_reachable
    if isinstance(out_dir, ObjPath):
        try:
            check_reachable(out_dir)
        except StoreConfigError as e:
            raise ConfigError(str(e)) from None
    elif not out_dir.exists():
        parent = next((p for p in out_dir.absolute().parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise ConfigError(f"out_dir={out_dir}: {parent} is a file, not a directory: use a path under a directory")
        return
    elif not out_dir.is_dir():
        raise ConfigError(f"out_dir={out_dir} is a file, not a directory: use a new or empty directory")
    job, problem = _job_json(out_dir)
    written, foreign = survey(out_dir)
    if job is not None:
        if foreign:
            log.warning(f"[generate] out_dir={out_dir} also holds {len(foreign)} entries no job writes "
                        f"({', '.join(foreign[:3])}): left alone")
        return
    if foreign:
        raise ConfigError(f"out_dir={out_dir} is not a job's directory (job.json {problem}) and holds "
                          f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}: nothing was changed; "
                          f"use a new or empty directory")
    if written:
        raise ConfigError(f"out_dir={out_dir} holds a job's files ({written[0]}, ...) but its job.json {problem}: "
                          f"it recorded the settings they were made with; restore it, or use a new out_dir")
    if problem != "is missing":
        log.warning(f"[generate] {out_dir / 'job.json'} {problem} and nothing else is committed: writing it again")


def check_out_dir(out_dir, fp: dict) -> None:
    """job.json records `fp` (written atomically: actors/output.py); a rerun must match it. (That the
    out_dir is a job's at all is claim_out_dir's check, made before the lock is written.)"""
    from actors.output import write_bytes_atomic
    old = _job_json(out_dir)[0]
    if old is None:
        write_bytes_atomic(json.dumps(fp, indent=2).encode(), out_dir / "job.json", "job.json")
        return
    old, new = _flat({k: v for k, v in old.items() if k != "resolved"}), _flat(fp)   # (check_resolved's)
    if old.get("bytes_version") != new["bytes_version"]:
        raise ConfigError(f"out_dir={out_dir} was written by a version of arspec that samples differently "
                          f"(bytes_version {old.get('bytes_version', 1)}, this one {new['bytes_version']}); "
                          f"its images cannot be completed with these: use a new out_dir")
    keys = sorted(set(old) | set(new), key=lambda k: (not k.endswith(".name"), k))  # a changed engine/model first
    diffs = [f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in keys if old.get(k) != new.get(k)]
    if diffs:
        raise ConfigError(f"out_dir={out_dir} was written by a different config ({'; '.join(diffs[:3])}); "
                          f"use a new out_dir or the same settings")


def check_resolved(out_dir, seen: list[dict], token: Optional[str] = None) -> None:
    """Every actor resolved model.device and model.dtype alike, and as the run that started out_dir did
    (job.json `resolved`, recorded by the first run to start its actors): bf16 and fp32, or a GPU and a
    CPU, give different bytes, and one out_dir must not mix them."""
    from actors.output import check_lock, write_bytes_atomic
    kinds = sorted({json.dumps(r, sort_keys=True) for r in seen})
    if len(kinds) > 1:
        raise ConfigError(f"model.device / model.dtype resolve differently on the actors ({'; '.join(kinds)}): set "
                          f"both (e.g. model.device=cuda model.dtype=bfloat16) so every actor makes the same bytes")
    job = json.loads((out_dir / "job.json").read_text())
    now, then = seen[0], job.get("resolved")
    if then is None:
        check_lock(out_dir, token)
        write_bytes_atomic(json.dumps({**job, "resolved": now}, indent=2).encode(), out_dir / "job.json", "job.json")
    elif then != now:
        raise ConfigError(f"out_dir={out_dir} was written with model.device={then['device']} model.dtype={then['dtype']}, "
                          f"and this run resolves {now['device']} {now['dtype']}: set model.device={then['device']} "
                          f"model.dtype={then['dtype']} to finish it, or use a new out_dir")


def validate(c: GenerateConfig) -> None:
    """Every check that needs no weights: settings, the engine against the model's checkpoint headers
    (decoding.registry.inspect_model). The model itself is loaded only in the actors."""
    from decoding.engines import check_engine
    from decoding.registry import family, inspect_model
    cl = c.cluster
    for key in ("num_actors", "batch_size", "part_size", "torch_threads", "local_num_cpus"):
        if getattr(cl, key) is not None and getattr(cl, key) < 1:
            raise ConfigError(f"cluster.{key}={getattr(cl, key)}: must be >= 1")
    if c.verify not in ("quick", "full"):
        raise ConfigError(f"verify={c.verify}: choose quick (sizes, Parquet footers and page checksums) or full (sha256 of every file)")
    if cl.grace_s < 0 or cl.lock_timeout_s <= 0:
        raise ConfigError(f"cluster.grace_s={cl.grace_s} / cluster.lock_timeout_s={cl.lock_timeout_s}: "
                          f"must be >= 0 / > 0")
    if cl.wait_s < 0:
        raise ConfigError(f"cluster.wait_s={cl.wait_s}: must be >= 0 (seconds to wait for the actors to be placed)")
    if cl.num_cpus_per_actor < 0 or cl.num_gpus_per_actor < 0:
        raise ConfigError("cluster.num_cpus_per_actor / num_gpus_per_actor: must be >= 0")
    if cl.num_cpus_per_actor <= 0 and cl.num_gpus_per_actor <= 0:
        raise ConfigError("cluster.num_cpus_per_actor and cluster.num_gpus_per_actor are both 0: give actors a slot")
    if cl.address is None and c.model.device.startswith("cuda"):
        import torch
        if not torch.cuda.is_available():    # a private Ray runs its actors here (a cluster's may have GPUs)
            raise ConfigError(f"model.device={c.model.device}: this machine has no GPU torch can use; use "
                              f"model.device=auto (cpu here), or attach to a cluster with GPUs (cluster.address)")
    try:
        info = inspect_model(c.model)
        check_engine(c.engine, family(c.model.name).tokens, info["drafter"] if info else True, c.model.name,
                     (info or {}).get("seq_len"))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    if info is None:
        log.info(f"[generate] model.name={c.model.name}: no header check for this family; the actors load it")


# Ray's single-machine mode (read when ray is imported, by this process and every Ray process it
# starts): a private local Ray binds GCS, raylet, agents and workers to 127.0.0.1 only.
LOOPBACK_ENV = ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Token authentication for that private Ray, chosen explicitly: a new local Ray turns it on by itself
# and then warns on every start that it did ("Token authentication is enabled for this Ray cluster. Set
# RAY_AUTH_MODE=disabled to opt out"). Read once, when ray is imported; a RAY_AUTH_MODE already set is kept.
LOCAL_AUTH_ENV = ("RAY_AUTH_MODE", "token")


def start_ray(cl, stop) -> str | None:
    """Attach to cluster.address, or start a private local Ray on loopback only (address="local": never
    a head that happens to run on this machine, nor RAY_ADDRESS). -> "attached", "local", or None when
    Ray was already initialized by the caller. A SIGTERM meanwhile is held (Stop.held) and then requests
    `stop` like any other: ray.init installs handlers that exit, or dump a stack and abort, on it."""
    import ray
    if ray.is_initialized():
        return None
    with stop.held():
        _ray_init(cl)
    return "attached" if cl.address else "local"


def _ray_init(cl) -> None:
    import ray
    if cl.address:
        try:
            ray.init(address=cl.address)
        except ConnectionError as e:   # Ray turns token mode on by itself only for "auto", never for an address
            token = ("set RAY_AUTH_MODE=token and " if os.environ.get("RAY_AUTH_MODE", "").lower() != "token" else "")
            raise ConfigError(f"cluster.address={cl.address}: cannot connect ({str(e).splitlines()[0]}); start the "
                              f"cluster (ray start --head), or use cluster.address=null for a local Ray; if the head "
                              f"uses token authentication, {token}give its token (RAY_AUTH_TOKEN or "
                              f"~/.ray/auth_token)") from None
        return
    if os.environ.get(LOOPBACK_ENV[0]) != LOOPBACK_ENV[1]:
        log.warning(f"[generate] ray was imported before the job could set {'='.join(LOOPBACK_ENV)}: this private "
                    f"Ray listens on every interface of this machine")
    need = math.ceil((cl.num_actors or 1) * cl.num_cpus_per_actor)
    ray.init(address="local", num_cpus=cl.local_num_cpus or max(need, os.cpu_count() or 1),
             num_gpus=None if cl.num_gpus_per_actor else 0, include_dashboard=False)


def _bundle(cl) -> dict:
    return {k: v for k, v in (("CPU", cl.num_cpus_per_actor), ("GPU", cl.num_gpus_per_actor)) if v > 0}


def cluster_slots(cl) -> int:
    """How many actors the cluster's live nodes hold now (cluster.num_actors=null): per node, its GPUs
    / num_gpus_per_actor and its CPUs / num_cpus_per_actor, whichever is fewer."""
    import ray
    return sum(int(min(n["Resources"].get(k, 0) // v for k, v in _bundle(cl).items()))
               for n in ray.nodes() if n["Alive"])


def cluster_has() -> str:
    import ray
    nodes = [n["Resources"] for n in ray.nodes() if n["Alive"]]
    total = {k: sum(r.get(k, 0) for r in nodes) for k in ("CPU", "GPU")}
    return f"{len(nodes)} node(s) with CPU {total['CPU']:g}, GPU {total['GPU']:g} in all"


def place_actors(cl, n: int, asked: str, wait_s: float) -> list:
    """Reserve one placement-group bundle per actor; wait up to wait_s for them (an autoscaler may add
    nodes meanwhile). -> the placement groups placed, at least one; none is a ConfigError in one line
    naming what was asked and what the cluster has."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    bundle = _bundle(cl)
    pgs = [placement_group([bundle]) for _ in range(n)]
    refs = {pg.ready(): pg for pg in pgs}
    ready, _ = ray.wait(list(refs), num_returns=n, timeout=min(1.0, wait_s))
    if len(ready) < n:
        log.info(f"[generate] waiting up to cluster.wait_s={wait_s:g} s for {n} actor(s) of {bundle}; "
                 f"the cluster has {cluster_has()}")
        ready, _ = ray.wait(list(refs), num_returns=n, timeout=wait_s)
    placed = [refs[r] for r in ready]
    for pg in pgs:
        if pg not in placed:
            remove_placement_group(pg)
    what = f"{n} actor(s) of {bundle} asked ({asked})"
    if not placed:
        raise ConfigError(f"cluster: {what}, none placed within cluster.wait_s={wait_s:g} s; the cluster has "
                          f"{cluster_has()}: lower cluster.num_gpus_per_actor / num_cpus_per_actor (cluster=local "
                          f"runs on CPUs), or add nodes that have them")
    if len(placed) < n:
        log.warning(f"[generate] cluster: {what}, {len(placed)} placed within cluster.wait_s={wait_s:g} s "
                    f"(the cluster has {cluster_has()}): running on {len(placed)} actor(s)")
    return placed


class Tally:
    """The job's figures, summed as parts commit (nothing per prompt is kept); also the progress line."""

    def __init__(self, progress):
        self.progress = progress
        self.images = self.errors = self.tau_n = self.wall_n = self.invalid_tokens = 0
        self.tau = self.wall = self.gen_s = self.write_s = 0.0
        self.acceptance, self.nodes, self.actors = set(), set(), {}

    def update(self, r) -> None:
        self.progress.update(r)
        self.images += r.images
        self.errors += r.errors
        self.invalid_tokens += r.invalid_tokens
        self.tau += sum(r.tau)
        self.tau_n += len(r.tau)
        self.wall += sum(r.wall_s)
        self.wall_n += len(r.wall_s)
        self.gen_s += r.gen_s
        self.write_s += r.write_s
        if r.acceptance:
            self.acceptance.add(r.acceptance)
        if r.node:
            self.nodes.add(r.node)
        if r.started is not None:  # error parts made by the driver carry no actor timing
            a = self.actors.setdefault((r.node, r.pid), [math.inf, -math.inf, 0.0])
            a[0], a[1], a[2] = min(a[0], r.started), max(a[1], r.ended), a[2] + r.gen_s + r.write_s


def actor_timeline(t: Tally, ray_ready: float) -> dict:
    """From the actors' own clocks: start-up (Ray ready -> an actor's first batch) and idle time (gaps
    between its batches: scheduling, result hand-off), which is what the job adds per image."""
    if not t.actors:
        return {"actor_start_seconds": None, "idle_seconds": None}
    starts = [first - ray_ready for first, _, _ in t.actors.values()]
    idle = sum(max(0.0, (last - first) - busy) for first, last, busy in t.actors.values())
    return {"actor_start_seconds": round(max(starts), 2), "idle_seconds": round(idle, 2)}


def summarize(t: Tally, c: GenerateConfig, total: int, already: int, seconds: float, ray_start_s: float,
              ray_ready: float, actors: int) -> dict:
    """engine_seconds: summed engine time inside the actors; write_seconds: PNG + Parquet; idle_seconds:
    summed gaps between an actor's batches; the rest of `seconds` is Ray and actor start-up."""
    acceptance = sorted(t.acceptance)  # as the engine reports it
    return {"engine": c.engine.name, "acceptance": acceptance[0] if len(acceptance) == 1 else acceptance or None,
            "prompts": total,
            "already_done": already, "images": t.images, "errors": t.errors, "invalid_tokens": t.invalid_tokens,
            "seconds": round(seconds, 2),
            "images_per_s": round(t.images / seconds, 3) if seconds > 0 else None,
            "mean_accept_len": round(t.tau / t.tau_n, 3) if t.tau_n else None,
            "engine_s_per_image": round(t.wall / t.wall_n, 4) if t.wall_n else None,
            "engine_seconds": round(t.gen_s, 2),
            "write_seconds": round(t.write_s, 2),
            "ray_start_seconds": round(ray_start_s, 2), **actor_timeline(t, ray_ready),
            "num_actors": c.cluster.num_actors, "actors": actors, "batch_size": c.cluster.batch_size,
            "part_size": c.cluster.part_size or c.cluster.batch_size,
            "nodes": len(t.nodes),
            "out_dir": c.out_dir}


def no_prompts(c: GenerateConfig) -> ConfigError:
    """The one line for a prompt set with nothing to generate: an empty file (no rows, blank lines only, a
    header only), or data.limit=0."""
    if c.data.limit == 0:
        return ConfigError("data.limit=0: nothing to generate; give data.limit >= 1, or null for every prompt")
    where = f"data.path={c.data.path}" if c.data.path else f"data={c.data.name}"
    return ConfigError(f"{where}: holds no prompts (data.limit={c.data.limit}): nothing to generate; give a "
                       f"prompt set with rows in it")


def check_prompts(c: GenerateConfig) -> None:
    """The prompt file opens, its columns are there, and it holds a prompt (its first chunk read), before
    anything is written to out_dir: a resume reads the same prompts, so an empty set is never a finished job's."""
    from workflows.prompts import PromptSource
    if next(iter(PromptSource(c.data).chunks()), None) is None:
        raise no_prompts(c)


def plan_job(c: GenerateConfig, verify: str = "quick"):
    """The streamed plan of the job and its checking pass (no Ray): what `run` does before Ray starts,
    and what workflows.bench_plan measures. Damaged parts are quarantined first (actors/output.recover)."""
    from actors.output import recover
    from decoding.registry import prompt_check
    from workflows.plan import CommittedIndex, Plan
    from workflows.prompts import PromptSource
    source = PromptSource(c.data)
    out_dir, fp = out_dir_of(c), fingerprint(c)
    started = _job_json(out_dir)[0] is not None    # else nothing is committed (claim_out_dir)
    if started:
        check_out_dir(out_dir, fp)
    parts = recover(out_dir, verify) if started else {}
    check = prompt_check(c.model)
    plan = Plan(source, CommittedIndex(out_dir, parts), c.cluster.part_size or c.cluster.batch_size, c.seed,
                check=None if check is None else lambda chunk: check([r["prompt"] for r in chunk]))
    del parts
    try:
        plan.check()
    except ConfigError:
        raise
    except ValueError as e:     # a prompt the model cannot take (text for a class-conditional model)
        raise ConfigError(f"data: {e}") from None
    if not plan.stats.prompts:
        raise no_prompts(c)
    check_out_dir(out_dir, fp)   # a new out_dir gets its job.json only once its prompts passed the check
    return plan


def run(cfg: DictConfig) -> dict:
    from workflows.lock import Stop, on_sigterm, out_dir_lock
    c: GenerateConfig = to_object(cfg)
    validate(c)
    if c.cluster.address is None and "ray" not in sys.modules:    # before ray is imported (start_ray)
        os.environ[LOOPBACK_ENV[0]] = LOOPBACK_ENV[1]
        os.environ.setdefault(*LOCAL_AUTH_ENV)
    out_dir = out_dir_of(c)
    claim_out_dir(out_dir)      # (on a store: its bucket and credentials, before the prompts are read from it)
    check_prompts(c)            # before the lock creates out_dir
    stop = Stop(c.cluster.grace_s)
    with on_sigterm(stop), out_dir_lock(out_dir, c.cluster.lock_timeout_s, stop) as lock:   # workflows/lock.py
        return _generate(c, out_dir, stop, lock.me["token"])


def _generate(c: GenerateConfig, out_dir, stop, token: Optional[str] = None) -> dict:
    from actors.output import check_lock, write_bytes_atomic
    from actors.pool import Progress
    from workflows.lock import Preempted
    plan = plan_job(c, c.verify)
    st = plan.stats
    log.info(f"[generate] {st.prompts} prompts, {st.already} already in {out_dir}, {st.pending} to generate "
             f"in {st.batches} batch(es) with engine={c.engine.name}")
    t0 = time.time()
    tally, ray_start_s, actors = Tally(Progress(st.prompts, st.already)), 0.0, 0
    if st.pending and not stop:
        ray_start_s, actors = _run(c, out_dir, stop, token, plan, tally, t0)
    summary = summarize(tally, c, st.prompts, st.already, time.time() - t0, ray_start_s, t0 + ray_start_s, actors)
    summary["stopped"] = stop.reason
    summary["resolved"] = (_job_json(out_dir)[0] or {}).get("resolved")     # device and dtype (check_resolved)
    check_lock(out_dir, token)
    if st.pending or not (out_dir / "summary.json").exists():
        write_bytes_atomic(json.dumps(summary, indent=2).encode(), out_dir / "summary.json", "summary.json")
    else:   # a rerun with nothing left to do keeps the figures of the run that made the images
        log.info(f"[generate] every prompt is already in {out_dir}: nothing generated, summary.json kept as it was")
    log.info("[generate] summary " + json.dumps(summary))
    if summary["invalid_tokens"] and summary["acceptance"] != "lantern":
        log.error(f"[generate] internal error: {summary['invalid_tokens']} committed tokens that the sampler can "
                  f"never produce (zero target probability, or not finite); the images table's invalid_tokens "
                  f"column names the images: please report it with the settings in job.json")
    left = st.pending - summary["images"] - summary["errors"]
    if stop and left:
        raise Preempted(f"[generate] stopped ({stop.reason}): {summary['images'] + summary['errors']} prompts "
                        f"committed in this run, {left} left; rerun the same command to finish", stop.reason)
    return summary


def _run(c: GenerateConfig, out_dir, stop, token, plan, tally, t0: float) -> tuple[float, int]:
    """The plan's batches on Ray (started here, shut down after): (seconds Ray took to start, actors)."""
    import ray
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from actors.output import check_lock, fold_manifest, remove_leftovers
    from actors.pool import ActorStartError, run_batches
    st, cl = plan.stats, c.cluster
    kind = start_ray(cl, stop)
    ray_start_s, pgs = time.time() - t0, []
    try:
        if not stop:       # (a SIGTERM while Ray started: nothing is placed, Ray is shut down below)
            slots = cluster_slots(cl)
            asked = f"cluster.num_actors={cl.num_actors}"
            if cl.num_actors is None:
                cl.num_actors = max(1, slots)
                asked = f"cluster.num_actors=null: one per slot, {slots} now, at least 1"
                log.info(f"[generate] cluster.num_actors=null: {cl.num_actors} actor(s), one per slot "
                         f"({_bundle(cl)} each)")
            pgs = place_actors(cl, min(cl.num_actors, st.batches), asked,
                               cl.wait_s if kind != "local" else min(cl.wait_s, LOCAL_WAIT_S))
            run_batches(c, out_dir, plan.batches(), tally, [PlacementGroupSchedulingStrategy(pg, 0) for pg in pgs],
                        stop, token, st.pending, lambda seen: check_resolved(out_dir, seen, token))
    except ActorStartError as e:
        raise ConfigError(f"model: {e}") from None
    finally:
        for pg in pgs:
            remove_placement_group(pg)
        if kind:
            ray.shutdown()
    check_lock(out_dir, token)
    remove_leftovers(out_dir)    # what writers killed mid-part (a lost node, a stop) left behind
    fold_manifest(out_dir)       # object stores: the parts' manifest/PART.json into manifest.jsonl
    return ray_start_s, len(pgs)


@hydra.main(version_base="1.3", config_path="../conf", config_name="generate")
@one_line_errors
def main(cfg: DictConfig) -> dict:
    from actors.output import JobExit
    try:
        return run(cfg)
    except JobExit as e:   # out_dir unwritable (3), held by another job (4), stopped by SIGTERM (143)
        print(f"{e.prefix}{e}", file=sys.stderr)
        sys.exit(e.code)
    except KeyboardInterrupt:   # a second Ctrl-C (the first stops gracefully: lock.Stop)
        print("[generate] stopped at once (Ctrl-C): committed parts are kept; rerun the same command to "
              "finish", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    cli(main)
