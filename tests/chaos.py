"""Chaos run for the job (issue 18; not part of the default test run, it takes minutes):

    python -m tests.chaos [--prompts 200] [--batch-size 4] [--max-minutes 25] [--seed 0] [--driver-faults 6] [--tiny]

On a 2-node ray.cluster_utils.Cluster, the job (`python -m workflows.generate`, attached to the
cluster, vanilla on the built-in shapes model; `--tiny`: random tiny weights) is run over and over on
one out_dir while random faults hit it: SIGKILL of generator actors, removal of the worker node (a new
one joins after a few seconds), SIGKILL of the driver, SIGTERM of the driver (cluster.grace_s), SIGTERM
while the driver starts (connecting to Ray), a disk already full when the driver starts, and the
out_dir remounted read-only mid-run. The out_dir is on a tmpfs mounted in a private mount namespace
(the command re-runs itself under `unshare -m`, or `-Urm` when not root), which the cluster's
processes share. After each fault the driver is left to finish or is rerun, until a run completes. Then an undisturbed run
writes a second out_dir, and the two must hold every prompt exactly once with identical image bytes
and token ids, the manifest listing exactly the committed parts, nothing damaged. Prints a JSON
summary; exits 0 when all of that holds.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
REPO = Path(__file__).resolve().parents[1]


def descendants(roots: set[int]) -> dict[int, str]:
    """pid -> cmdline of every process below `roots` (this cluster's raylets): never another job's actors."""
    parent, cmd = {}, {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                parent[int(p.name)] = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(p.name)] = (p / "cmdline").read_bytes().decode(errors="replace")
            except (OSError, IndexError, ValueError):
                continue
    out, frontier = {}, set(roots)
    while frontier:
        frontier = {pid for pid, pp in parent.items() if pp in frontier and pid not in out}
        out.update({pid: cmd[pid] for pid in frontier})
    return out


def raylet_pids(cluster) -> set[int]:
    pids = set()
    for node in cluster.list_all_nodes():
        for info in node.all_processes.get("raylet", []):
            pids.add(info.process.pid)
    return pids


def parts(out: Path) -> int:
    return len(list((out / "images").glob("*.parquet")))


def fill(path: Path) -> None:
    """Write zeros to `path` until its filesystem is full (ENOSPC)."""
    with open(path, "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def remount(mnt: Path, mode: str, proc: subprocess.Popen) -> bool:
    """Remount `mnt` ro/rw, retrying while files open for writing make it busy; False if the driver
    ended first."""
    while subprocess.run(["mount", "-o", f"remount,{mode}", str(mnt)], capture_output=True).returncode:
        if mode == "ro" and proc.poll() is not None:
            return False
        time.sleep(0.02)
    return True


def main() -> int:
    if not os.environ.get("ARSPEC_CHAOS_NS"):       # a private mount namespace for the out_dir's tmpfs
        flags = "-m" if os.geteuid() == 0 else "-Urm"
        os.execvpe("unshare", ["unshare", flags, sys.executable, "-m", "tests.chaos", *sys.argv[1:]],
                   {**os.environ, "ARSPEC_CHAOS_NS": "1"})
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-minutes", type=float, default=25)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--driver-faults", type=int, default=6, help="the first N rounds end with a killed driver")
    ap.add_argument("--tiny", action="store_true", help="random tiny weights instead of the shipped shapes model")
    ap.add_argument("--work", default=None, help="directory for the out_dirs and logs (default: a new temp dir)")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    work = Path(a.work or tempfile.mkdtemp(prefix="arspec-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    mnt = work / "mnt"
    mnt.mkdir(exist_ok=True)
    subprocess.run(["mount", "--make-rprivate", "/"], check=False)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], check=True)

    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    worker = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)   # for the node bookkeeping only

    model = []
    if a.tiny:
        sys.path.insert(0, str(REPO))
        from tests.conftest import write_tiny_weights
        model = [f"model.weights_dir={write_tiny_weights(work / 'tiny-weights')}"]
    common = [*model, "engine=vanilla", f"data.builtin_count={max(96, a.prompts)}", f"data.limit={a.prompts}",
              f"cluster.batch_size={a.batch_size}", f"cluster.address={cluster.address}", "cluster.grace_s=5",
              f"hydra.run.dir={work / 'hydra'}"]

    def driver(out: Path, log: Path) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "workflows.generate", *common, f"out_dir={out}"], cwd=REPO,
                                stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                env={**os.environ, "HYDRA_FULL_ERROR": "0"})

    chaos, events, rcs, t0 = mnt / "chaos", Counter(), [], time.time()
    term_rcs, full_rcs, ro_rcs = [], [], []   # exit codes of the drivers sent SIGTERM, started on a full disk, made read-only
    full_locks = []                           # a job.lock left by a driver that started on a full disk
    deadline = t0 + a.max_minutes * 60
    rounds, done = 0, False
    kinds = ["actor", "node", "driver-kill", "driver-term", "term-startup", "disk-full", "read-only"]
    firsts = rng.sample(kinds, len(kinds))
    while time.time() < deadline and not done:
        rounds += 1
        log = work / f"round-{rounds:02d}.log"
        if rounds <= len(kinds) and firsts[rounds - 1] == "disk-full":
            fill(mnt / "filler")
            proc = driver(chaos, log)
            full_rcs.append(proc.wait(timeout=600))
            full_locks.append((chaos / "job.lock").exists())
            (mnt / "filler").unlink()
            events["disk full at start"] += 1
            rcs.append(full_rcs[-1])
            continue
        proc = driver(chaos, log)
        # this round's faults, each once the driver has committed 1-3 more parts: a few actor kills and
        # maybe the node, then maybe the driver; the first four rounds cover every kind
        plan = ["actor"] * rng.randint(0, 2) + (["node"] if rng.random() < 0.3 else [])
        plan.append(rng.choice(["driver-kill", "driver-term"] if rounds <= a.driver_faults else ["none"]))
        if rounds <= len(kinds):
            plan.insert(0, firsts[rounds - 1])
        if rounds > a.driver_faults + 2:
            plan = ["none"]                       # enough: let it finish
        termed = False
        for fault in plan:
            if fault == "term-startup":                  # before its first part: while it connects to Ray
                time.sleep(rng.uniform(0.5, 4))
                proc.send_signal(signal.SIGTERM)
                events["driver SIGTERM during start-up"] += 1
                termed = True
                break
            wait_parts = parts(chaos) + rng.randint(1, 3)
            while proc.poll() is None and parts(chaos) < wait_parts and time.time() < deadline:
                time.sleep(0.1)
            if proc.poll() is not None or fault == "none":
                break
            if fault == "actor":
                gens = [p for p, c in descendants(raylet_pids(cluster)).items() if "ray::Generator" in c]
                if gens:
                    os.kill(rng.choice(gens), signal.SIGKILL)
                    events["actor SIGKILL"] += 1
            elif fault == "node":
                cluster.remove_node(worker)
                events["node removed"] += 1
                time.sleep(rng.uniform(2, 6))
                worker = cluster.add_node(num_cpus=2)
                events["node added"] += 1
            elif fault == "read-only":
                if remount(mnt, "ro", proc):
                    ro_rcs.append(proc.wait(timeout=600))
                    remount(mnt, "rw", proc)
                    events["out_dir read-only mid-run"] += 1
                break
            elif fault in ("driver-kill", "driver-term"):
                proc.send_signal(signal.SIGKILL if fault == "driver-kill" else signal.SIGTERM)
                events[f"driver {'SIGKILL' if fault == 'driver-kill' else 'SIGTERM'}"] += 1
                termed = fault == "driver-term"
                break
        try:
            rc = proc.wait(timeout=max(1, min(600, deadline - time.time())))
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
            events["driver timed out"] += 1
        rcs.append(rc)
        if termed:
            term_rcs.append(rc)
        text = log.read_text(errors="replace")
        events["lock takeovers"] += text.count("taking over out_dir")
        events["parts quarantined"] += text.count("quarantined part")
        events["batches moved off a lost node"] += text.count("was on a lost node")
        done = rc == 0
    chaos_s = time.time() - t0

    whole = work / "whole"
    t1 = time.time()
    proc = driver(whole, work / "whole.log")
    rc_whole = proc.wait()
    whole_s = time.time() - t1
    ray.shutdown()
    cluster.shutdown()
    fault_rcs = {"disk full at start": full_rcs, "read-only mid-run": ro_rcs, "SIGTERM": term_rcs}

    sys.path.insert(0, str(REPO))
    import pyarrow.parquet as pq
    from actors.output import inspect

    def read(out: Path):
        im = pq.read_table(out / "images").to_pandas()
        tok = pq.read_table(out / "tokens").to_pandas().sort_values(["prompt_id", "token_index"])
        err = pq.read_table(out / "errors").to_pandas() if list((out / "errors").glob("*.parquet")) else None
        return im, {p: g.token_id.tolist() for p, g in tok.groupby("prompt_id")}, err

    checks = {}
    if done and rc_whole == 0:
        (ci, ct, ce), (wi, wt, we) = read(chaos), read(whole)
        manifest = [json.loads(x) for x in (chaos / "manifest.jsonl").read_text().splitlines()]
        checks = {
            "every prompt once": len(ci) == a.prompts and ci.prompt_id.is_unique,
            "no error rows": (ce is None or len(ce) == 0) and (we is None or len(we) == 0),
            "image bytes identical": dict(zip(ci.prompt_id, (x["bytes"] for x in ci.image)))
            == dict(zip(wi.prompt_id, (x["bytes"] for x in wi.image))),
            "token ids identical": ct == wt,
            "manifest exact": sorted(e["part"] for e in manifest) == sorted(f.stem for f in (chaos / "images").glob("*.parquet"))
            and sorted(p for e in manifest for p in e["prompt_ids"]) == sorted(ci.prompt_id),
            "verify=full clean": not inspect(chaos, "full")[1],
            "no temporary files": not [f for f in chaos.rglob("*") if f.name.endswith(".tmp")],
            "SIGTERM: exit 143 (or 0 when it finished within the grace)": all(rc in (143, 0) for rc in term_rcs),
            "disk full at start: exit 3, no lock left": all(rc == 3 for rc in full_rcs) and not any(full_locks),
            "read-only mid-run: exit 3": all(rc == 3 for rc in ro_rcs),
        }
    summary = {"prompts": a.prompts, "batch_size": a.batch_size, "model": "tiny" if a.tiny else "shapes",
               "rounds": rounds, "completed": done, "driver exit codes": rcs, "fault exit codes": fault_rcs,
               "events": dict(events),
               "chaos seconds": round(chaos_s, 1), "undisturbed run seconds": round(whole_s, 1),
               "undisturbed exit code": rc_whole, "checks": checks, "ok": bool(checks) and all(checks.values()),
               "work": str(work)}
    print(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
