"""Reliability of the job (issue 18): a crash at every write boundary, damaged parts, two jobs on one
out_dir, a full disk / read-only mount / permission denied, SIGTERM, a lost node. Each case ends with
a rerun that must be exact (every prompt once, no orphan rows, the manifest listing exactly the
committed parts) and byte-identical to an undisturbed run."""
from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import _thread
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

import actors.output as output
from actors.generator import Generator
from actors.pool import record_part, part_name
from decoding.sampling import prompt_seed
from tests.conftest import REPO
from tests.test_job import TINY, image_bytes, images, job
from workflows.config import ConfigError, to_object
from workflows.generate import check_out_dir, fingerprint
from workflows.lock import LockHeld, OutDirLock, Preempted, Stop
from workflows.prompts import read_prompts

N = 28                                   # prompts of the reference run; every test uses a prefix of them
TOKENS_PER_IMAGE = 16


def args(tiny_weights, out, limit, *extra):
    return [f"model.weights_dir={tiny_weights}", f"out_dir={out}", *TINY, f"data.limit={limit}", *extra]


@pytest.fixture(scope="module")
def reference(ray_cluster, tiny_weights, tmp_path_factory):
    """An undisturbed run of the first N prompts: (out_dir, image bytes, token ids per prompt)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    job(*args(tiny_weights, out, N, "cluster.batch_size=4"))
    return out, image_bytes(out), _tokens(out)


def _tokens(out: Path) -> dict:
    t = pq.read_table(out / "tokens").to_pandas().sort_values(["prompt_id", "token_index"])
    return {pid: g.token_id.tolist() for pid, g in t.groupby("prompt_id")}


def assert_exact(out: Path, reference, n: int) -> None:
    """Every one of the first n prompts exactly once, bytes and tokens identical to the reference, the
    manifest listing exactly the committed parts, no temporary file left, nothing damaged."""
    _, ref_bytes, ref_tokens = reference
    df = images(out)                                   # pq.read_table of the whole directory
    assert len(df) == n and df.prompt_id.is_unique
    want = {k: ref_bytes[k] for k in sorted(ref_bytes)[:n]}          # the first n prompts (ids in file order)
    assert image_bytes(out) == want
    assert _tokens(out) == {k: ref_tokens[k] for k in want}          # no orphan or duplicate token rows
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(e["part"] for e in manifest) == sorted(f.stem for f in (out / "images").glob("*.parquet"))
    assert sorted(p for e in manifest for p in e["prompt_ids"]) == sorted(df.prompt_id)
    assert not [f for f in out.rglob("*") if f.name.endswith(".tmp")]
    parts, damaged = output.inspect(out, "full")
    assert not damaged and len(parts) == len(manifest)


def quarantined(out: Path) -> list[str]:
    return sorted(str(f.relative_to(out)) for f in (out / "quarantine").rglob("*.parquet"))


class Crash(Exception):
    """What a kill -9 at that moment would leave: the exception stops the writer right there."""


@pytest.fixture
def fault():
    """Set actors.output.FAULT to crash at one write boundary; reset afterwards."""
    def at(point):
        def hook(p):
            if p == point:
                raise Crash(p)
        output.FAULT = hook if point else None
    yield at
    output.FAULT = None


def typed(tiny_weights, out, limit, *extra):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return to_object(compose("generate", overrides=args(tiny_weights, out, limit, *extra)))


def pending_items(c) -> list[dict]:
    return [{**it, "position": i, "seed": prompt_seed(c.seed, it["prompt_id"])} for i, it in enumerate(read_prompts(c.data))]


# A part with no failed prompt writes no errors file: its errors step is the removal of one an earlier
# attempt left (before and after it; nothing to tear midway).
PART_POINTS = [f"{when}:{table}" for table in output.WRITE_ORDER for when in ("before", "mid", "after")
               if (when, table) != ("mid", "errors")]


def crash_at_each_point(gen, out, items: list[dict], n: int, fault) -> None:
    """Parts of 2 prompts written by the actor's code in this process: two whole ones, then one crash at
    each write point of a part (PART_POINTS) and at the manifest line (after it, and midway): 24 prompts."""
    plan = ["ok", "ok", *PART_POINTS, "after:manifest-line", "mid:manifest-line"]
    for point, batch in zip(plan, [items[i:i + 2] for i in range(0, n, 2)]):
        fault(point if point in PART_POINTS else None)
        try:
            res = gen.run(part_name(batch), batch)
            fault(point if point != "ok" else None)
            record_part(out, res)
        except Crash as e:
            assert str(e) == point
    fault(None)


def test_crash_at_every_part_write_boundary_then_rerun_is_exact(reference, tiny_weights, tmp_path, fault, caplog):
    """Each batch of 2 prompts is stopped at a different boundary of its part: before, in the middle of
    (half the bytes written) and after each of its three files, then after the part's manifest line and
    in the middle of it (a torn line; last, as the driver dies there). One rerun must then generate
    exactly the prompts of the uncommitted parts, quarantine nothing (a crash is not damage) and give
    the reference's bytes. Writing the images file before the tokens file, or writing straight to the
    final names, leaves a committed part with a missing or torn file: quarantined, and this test fails."""
    out = tmp_path / "run"
    c = typed(tiny_weights, out, N)
    items = pending_items(c)
    check_out_dir(out, fingerprint(c))                # what the job writes first
    threads = torch.get_num_threads()
    gen = Generator(c, str(out))                      # the actor's code, in this process
    torch.set_num_threads(threads)
    crash_at_each_point(gen, out, items, N, fault)
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 4     # 3 whole lines and the torn one
    caplog.set_level(logging.WARNING, logger="arspec.job")
    s = job(*args(tiny_weights, out, N, "cluster.batch_size=4"))
    committed_before = 2 + 2 + 1              # ok, ok, after:images, after:manifest-line, mid:manifest-line
    assert s["already_done"] == 2 * committed_before and s["images"] == N - 2 * committed_before
    assert not quarantined(out), f"a crash window left a damaged committed part: {caplog.text}"
    assert "quarantined" not in caplog.text
    assert_exact(out, reference, N)


@pytest.mark.parametrize("points", [
    ["before:job.json", "mid:job.json", "after:job.json", "before:manifest", "mid:manifest", "after:manifest"]])
def test_crash_writing_job_json_or_the_manifest_then_rerun_is_exact(reference, tiny_weights, tmp_path, fault, points):
    """Each run is stopped at one boundary of job.json (written before anything else) or of the
    manifest's rewrite on start; the next run must go on and end exact. job.json written in place (the
    old code) leaves a torn one that stops every later run."""
    out, n = tmp_path / "run", 8
    c = typed(tiny_weights, out, n)
    items = pending_items(c)
    for point in points:
        if point == "before:manifest":      # give the manifest rewrite something to lose: 2 committed parts
            threads = torch.get_num_threads()
            gen = Generator(c, str(out))
            torch.set_num_threads(threads)
            for batch in (items[0:2], items[2:4]):
                record_part(out, gen.run(part_name(batch), batch))
        fault(point)
        with pytest.raises(Crash, match=point):
            job(*args(tiny_weights, out, n, "cluster.batch_size=2"))
    fault(None)
    s = job(*args(tiny_weights, out, n, "cluster.batch_size=2"))
    assert (s["already_done"], s["images"]) == (4, 4)
    assert json.loads((out / "job.json").read_text())["seed"] == 0
    assert not quarantined(out)
    assert_exact(out, reference, n)


def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def test_damaged_parts_are_quarantined_and_regenerated(reference, tiny_weights, tmp_path, caplog):
    """A truncated images file and a truncated tokens file (a failed copy, a bad disk), a byte flipped
    inside a third part (same size: its page checksum, or verify=full's sha256, sees it), and a part repeating prompts that
    another part holds (two jobs once wrote this out_dir). workflows.verify names them and exits 1; the
    rerun moves each to quarantine/ with a line and regenerates their prompts."""
    ref_out = reference[0]
    out = tmp_path / "run"
    shutil.copytree(ref_out, out)
    parts = sorted(f.stem for f in (out / "images").glob("*.parquet"))
    _truncate(out / "images" / f"{parts[0]}.parquet")
    _truncate(out / "tokens" / f"{parts[1]}.parquet")
    flip = out / "images" / f"{parts[2]}.parquet"
    data = bytearray(flip.read_bytes())
    data[len(data) // 3] ^= 0xFF
    flip.write_bytes(bytes(data))
    c = typed(tiny_weights, out, N)
    threads = torch.get_num_threads()
    held = set(pq.read_table(out / "images" / f"{parts[3]}.parquet").column("prompt_id").to_pylist())
    dup = [it for it in pending_items(c) if it["prompt_id"] in held][-2:]    # a sound part holds them (its last two)
    gen = Generator(c, str(out))
    torch.set_num_threads(threads)
    repeats = part_name(dup)                            # its positions lie inside parts[3]'s
    res = gen.run(repeats, dup)
    record_part(out, res)

    # (3 runs: a corrupt page read on pyarrow's thread pool aborted the process at exit in 7 of 12 runs)
    for _ in range(3):
        r = subprocess.run([sys.executable, "-m", "workflows.verify", f"out_dir={out}"], capture_output=True,
                           text=True, cwd=REPO, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(parts[0] in x and "images/" in x and "the manifest recorded" in x for x in lines), r.stdout
    assert any(parts[1] in x and "tokens/" in x for x in lines), r.stdout
    assert any(repeats in x and f"already in {parts[3]}" in x for x in lines), r.stdout
    assert any(parts[2] in x and "page checksum failed" in x for x in lines), r.stdout    # quick: page CRCs
    assert "sha256 differs" in output.inspect(out, "full")[1][parts[2]]                # full: the sha256

    caplog.set_level(logging.WARNING, logger="arspec.job")
    s = job(*args(tiny_weights, out, N, "cluster.batch_size=4", "verify=full"))
    assert s["images"] == 12                            # the three damaged parts' prompts
    for p in (parts[0], parts[1], parts[2], repeats):
        assert f"quarantined {p}:" in caplog.text
        assert f"quarantine/images/{p}.parquet" in quarantined(out)
    assert_exact(out, reference, N)
    from workflows.verify import main as verify_main
    assert verify_main([f"out_dir={out}", "verify=full"]) == 0


def test_second_job_on_a_held_out_dir_is_refused_naming_the_owner(reference, tiny_weights, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    with OutDirLock(out):
        with pytest.raises(LockHeld, match=rf"out_dir={out} is in use by the job of pid {os.getpid()} on host "
                                            rf"{socket.gethostname()} started .* \(heartbeat \d+s ago"):
            job(*args(tiny_weights, out, N))
    # another host's job, heartbeat fresh: refused (its pid means nothing here)
    (out / "job.lock").write_text(json.dumps({"host": "node-b", "pid": 1, "boot_id": "x", "started": "then",
                                              "token": "t"}))
    with pytest.raises(LockHeld, match="in use by the job of pid 1 on host node-b"):
        job(*args(tiny_weights, out, N))
    assert LockHeld.code == 4


def test_dead_or_silent_owner_is_taken_over_with_a_line(reference, tiny_weights, tmp_path, caplog):
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    caplog.set_level(logging.WARNING, logger="arspec.job")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    me = OutDirLock(out).me
    (out / "job.lock").write_text(json.dumps({**me, "pid": dead.pid, "pid_start": "1", "token": "old"}))
    s = job(*args(tiny_weights, out, N))
    assert s["already_done"] == N and f"its lock's owner, the job of pid {dead.pid}" in caplog.text
    assert "is no longer running" in caplog.text and not (out / "job.lock").exists()
    # another host, silent past cluster.lock_timeout_s
    (out / "job.lock").write_text(json.dumps({"host": "node-b", "pid": 1, "boot_id": "x", "started": "t", "token": "b"}))
    os.utime(out / "job.lock", (time.time() - 120, time.time() - 120))
    job(*args(tiny_weights, out, N, "cluster.lock_timeout_s=60"))
    assert re.search(r"pid 1 on host node-b started t, has been silent for 12\ds \(cluster.lock_timeout_s=60\)",
                     caplog.text), caplog.text
    assert_exact(out, reference, N)


def test_lock_heartbeat_and_a_lock_taken_away_stops_the_job(tmp_path):
    stop = Stop(grace_s=0)
    lock = OutDirLock(tmp_path, timeout_s=0.8, stop=stop).acquire()
    try:
        os.utime(lock.path, (time.time() - 100, time.time() - 100))
        time.sleep(0.6)
        assert time.time() - lock.path.stat().st_mtime < 1          # touched by the heartbeat
        lock.path.write_text(json.dumps({**lock.me, "token": "someone-else"}))
        time.sleep(0.6)
        assert stop.reason == f"another job took over out_dir={tmp_path}"
    finally:
        lock.release()
    assert lock.path.exists()                       # not ours any more: left to its owner


def _clean_env():
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    # RAY_ADDRESS=local: start a new Ray even where /tmp/ray/ray_current_cluster names a running one
    return {**env, "HYDRA_FULL_ERROR": "0", "RAY_USAGE_STATS_ENABLED": "0", "RAY_ADDRESS": "local"}


def _namespaces_work() -> bool:
    try:
        return subprocess.run(["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temporary(tmp_path):
    """A part file fails after its first chunk (the disk filled up): the file under its name is still the
    old one, and the half-written temporary is gone, not left to hold the space a rerun needs."""
    path = tmp_path / "part.parquet"
    path.write_bytes(b"old")

    def chunks():
        yield b"new, first chunk"
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    with pytest.raises(output.OutDirError, match="ENOSPC"):
        output.write_chunks_atomic(chunks(), path, "part")
    assert path.read_bytes() == b"old" and sorted(tmp_path.iterdir()) == [path]


def test_permission_denied_is_one_line_naming_the_path(reference, tiny_weights, tmp_path, fault):
    """(As root, permissions cannot be denied for real here: the writer's own OSError is injected.)"""
    def deny(p):
        if p == "mid:job.json":
            raise PermissionError(errno.EACCES, "Permission denied")
    output.FAULT = deny
    with pytest.raises(output.OutDirError) as e:
        job(*args(tiny_weights, tmp_path / "run", 2))
    assert str(e.value).startswith(f"cannot write {tmp_path / 'run' / 'job.json'}: Permission denied (EACCES); "
                                   "committed parts are intact")
    assert e.value.code == 3 and "\n" not in str(e.value)


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_sigterm_stops_within_grace_and_rerun_is_exact(reference, tiny_weights, tmp_path, after_parts, sig, code):
    """SIGTERM mid-job (what spot instances and schedulers send), or Ctrl-C (SIGINT): no new batches,
    in-flight ones get cluster.grace_s (0 here: dropped at once), then Preempted (exit 143, or 130 after
    Ctrl-C). The rerun completes exactly."""
    out = tmp_path / "run"
    unhandled = []
    previous = signal.signal(sig, lambda *_: unhandled.append(1))   # what the job must replace
    after_parts(2, lambda: os.kill(os.getpid(), sig))
    try:
        with pytest.raises(Preempted, match=rf"stopped \({sig.name}\): .* left; rerun the same command") as e:
            job(*args(tiny_weights, out, N, "cluster.batch_size=2", "cluster.num_actors=2", "cluster.grace_s=0"))
    finally:
        signal.signal(sig, previous)
    assert not unhandled, f"{sig.name} reached the handler before the job's: the job did not handle it"
    assert e.value.code == code
    assert json.loads((out / "summary.json").read_text())["stopped"] == sig.name
    assert not (out / "job.lock").exists()
    done = len(output.inspect(out)[0])
    assert 2 <= done < N // 2
    if sig == signal.SIGTERM:        # (the stop is the same code for both signals: one rerun checks it)
        job(*args(tiny_weights, out, N, "cluster.batch_size=2"))
        assert_exact(out, reference, N)


def test_what_a_writer_killed_mid_part_leaves_is_removed_when_the_job_ends(reference, tiny_weights, tmp_path,
                                                                          after_parts):
    """A writer killed mid-part (its node lost, the job stopped with no grace left) leaves a temporary
    file and maybe the tokens file of a part it never committed; the next run's start would clean them,
    but a job that completes must not leave them in the data set it hands over. They are planted here
    mid-job, after the job's start-up cleaning: without the cleaning at the end, assert_exact fails."""
    out, n = tmp_path / "run", 12
    planted = []

    def plant():
        tokens = out / "tokens"
        orphan = tokens / "part-0000009990-0000009992-0123456789abcdef.parquet"
        shutil.copy(next(tokens.glob("part-*.parquet")), orphan)
        (tokens / f".{orphan.name}.4242.deadbeef.tmp").write_bytes(b"PAR1 torn")
        planted.append(orphan)
    after_parts(1, plant)
    job(*args(tiny_weights, out, n, "cluster.batch_size=2", "cluster.num_actors=1"))
    assert planted, "the leftovers were not planted mid-job"
    assert_exact(out, reference, n)


def test_lost_node_its_batches_are_retried_elsewhere(ray_cluster, reference, tiny_weights, tmp_path, caplog,
                                                      after_parts):
    """A third node joins; one actor (2 CPUs) on each node; the node is removed from the cluster right
    after the 2nd part is recorded (not only an actor process: its raylet and everything on it). The other
    nodes are full, so Ray cannot restart its actor: the job must hand its batches to the others and complete."""
    node = ray_cluster.add_node(num_cpus=2)
    ray_cluster.wait_for_nodes()
    out, n = tmp_path / "run", 24
    removed, finished = [], threading.Event()

    def remove():
        ray_cluster.remove_node(node)
        removed.append(time.time())

    def watchdog():
        if not finished.wait(270):
            _thread.interrupt_main()            # the job hangs: fail instead of waiting forever
    after_parts(2, remove)
    th = threading.Thread(target=watchdog, daemon=True)
    th.start()
    caplog.set_level(logging.WARNING, logger="arspec.job")
    try:
        s = job(*args(tiny_weights, out, n, "cluster.batch_size=2", "cluster.num_actors=3",
                      "cluster.num_cpus_per_actor=2"))
    except KeyboardInterrupt:
        pytest.fail("the job did not finish within 270 s")
    finally:
        finished.set()
        th.join()
    assert removed, "the node was not removed mid-job"
    assert "was on a lost node" in caplog.text
    assert s["errors"] == 0
    assert_exact(out, reference, n)


def _tree(d: Path) -> dict:
    return {str(f.relative_to(d)): f.read_bytes() if f.is_file() else None for f in sorted(d.rglob("*"))}


def test_an_out_dir_that_is_not_a_jobs_is_refused_and_left_untouched(reference, tiny_weights, tmp_path, caplog):
    """A directory holding files no job writes (names like a job's temporaries and parts, but not
    theirs), the filesystem root and the source tree: refused in one line naming what was found, before
    anything (the lock included) is written. In a job's own out_dir such files are left alone: not
    removed as leftovers, not quarantined as damaged parts. (The old code deleted the first four and
    moved photos.parquet to quarantine/, exit 0.)"""
    mine = {".notes.tmp": b"notes", "tokens/vocab.parquet": None, "tokens/draft.tmp": b"draft",
            "errors/log.parquet": None, "images/photos.parquet": None}
    some = next((reference[0] / "images").glob("*.parquet")).read_bytes()
    out = tmp_path / "user"
    for name, data in mine.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_bytes(data or some)
    before = _tree(out)
    with pytest.raises(ConfigError, match=rf"out_dir={out} is not a job's directory \(job.json is missing\) and "
                                          rf"holds \.notes\.tmp, errors/log\.parquet, images/photos\.parquet, \.\.\.: "
                                          rf"nothing was changed"):
        job(*args(tiny_weights, out, 4))
    assert _tree(out) == before
    for where in ("/", str(REPO)):
        with pytest.raises(ConfigError, match=f"out_dir={where} is not a job's directory"):
            job(*args(tiny_weights, where, 4))
    assert not Path("/job.lock").exists() and not (REPO / "job.lock").exists()

    ran = tmp_path / "run"                      # a job's own out_dir, with the user's files put into it
    shutil.copytree(reference[0], ran)
    for name, data in mine.items():
        (ran / name).write_bytes(data or some)
    caplog.set_level(logging.WARNING, logger="arspec.job")
    s = job(*args(tiny_weights, ran, N))
    assert s["already_done"] == N and "quarantined" not in caplog.text
    assert f"out_dir={ran} also holds 5 entries no job writes" in caplog.text
    assert all((ran / name).read_bytes() == (data or some) for name, data in mine.items())


def test_committed_parts_without_job_json_are_refused(reference, tiny_weights, tmp_path):
    """job.json deleted from a finished out_dir, rerun with another seed: refused in one line (the old
    code wrote a new job.json saying seed 7 over seed 0's images, exit 0). A damaged job.json beside
    committed parts is refused the same way, as bad input (exit 2), not as "cannot write" (3)."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    (out / "job.json").unlink()
    with pytest.raises(ConfigError, match=rf"out_dir={out} holds a job's files \(images/part-.*\) but its job.json "
                                          rf"is missing: it recorded the settings they were made with"):
        job(*args(tiny_weights, out, N, "seed=7"))
    assert not (out / "job.json").exists() and not (out / "job.lock").exists()
    (out / "job.json").write_text('{"seed": 0, "engine": ')
    with pytest.raises(ConfigError, match=r"but its job.json is damaged \(.*\): it recorded the settings"):
        job(*args(tiny_weights, out, N))


def _flip_readable(path: Path, start: int) -> int:
    """Flip one byte of `path` (same size) at the first offset from `start` where a reader that checks
    no page checksum still reads the file, into different values: damage nothing else would notice.
    -> the offset."""
    data = path.read_bytes()
    want = pq.read_table(path)
    for at in range(start, len(data)):
        bad = bytearray(data)
        bad[at] ^= 0x01
        try:
            got = pq.read_table(pa.BufferReader(bytes(bad)))
        except Exception:
            continue
        if not got.equals(want):
            path.write_bytes(bytes(bad))
            return at
    raise AssertionError(f"no readable flip in {path}")


def test_a_lost_manifest_does_not_make_damage_the_recorded_truth(reference, tiny_weights, tmp_path, caplog):
    """manifest.jsonl deleted, then one byte flipped inside a tokens part's data, where a plain reader
    still reads it (same size, other values): the part has no manifest line to compare against, so
    verify (quick or full) and the rerun check it from its files alone: its page checksum fails, it is
    named, quarantined and regenerated, and a line says that parts had no manifest line. And a flipped
    byte inside a PNG, manifest intact: verify=quick names it (its page checksum). The old code reported
    0 damaged for both and wrote the damaged file's sha256 into the rebuilt manifest."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    parts = sorted(f.stem for f in (out / "images").glob("*.parquet"))
    png = out / "images" / f"{parts[1]}.parquet"
    data = bytearray(png.read_bytes())
    data[data.index(b"IDAT") + 8] ^= 0x01                  # inside the first image's compressed pixels
    png.write_bytes(bytes(data))
    from workflows.verify import main as verify_main
    r = subprocess.run([sys.executable, "-m", "workflows.verify", f"out_dir={out}"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 1 and f"damaged {parts[1]}: images/{parts[1]}.parquet: unreadable Parquet data or a " \
        f"page checksum failed" in r.stdout, r.stdout + r.stderr
    (out / "manifest.jsonl").unlink()
    tokens = out / "tokens" / f"{parts[0]}.parquet"
    col = pq.ParquetFile(tokens).metadata.row_group(0).column(3)         # token_id
    _flip_readable(tokens, col.data_page_offset + col.total_compressed_size // 2)
    for mode in ("quick", "full"):
        r = subprocess.run([sys.executable, "-m", "workflows.verify", f"out_dir={out}", f"verify={mode}"],
                           capture_output=True, text=True, cwd=REPO, timeout=120)
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"damaged {parts[0]}: tokens/{parts[0]}.parquet: unreadable Parquet data or a page checksum" \
            in r.stdout, r.stdout
        assert f"; {len(parts)} part(s) have no manifest line: checked from their files alone" in r.stdout
    caplog.set_level(logging.WARNING, logger="arspec.job")
    s = job(*args(tiny_weights, out, N, "cluster.batch_size=4", "verify=full"))
    assert s["images"] == 8 and f"{len(parts) - 2} committed part(s) had no manifest line" in caplog.text
    assert quarantined(out) == sorted(f"quarantine/{t}/{p}.parquet" for p in parts[:2] for t in ("images", "tokens"))
    assert_exact(out, reference, N)
    assert verify_main([f"out_dir={out}", "verify=full"]) == 0


def _cli(tmp_path, *extra) -> list[str]:
    return [sys.executable, "-m", "workflows.generate", *TINY, "cluster.batch_size=2", "cluster.num_actors=1",
            "cluster.local_num_cpus=1", f"hydra.run.dir={tmp_path / 'hydra'}", *extra]


@pytest.mark.skipif(not shutil.which("unshare") or not _namespaces_work(),
                    reason="needs unshare -Urm (an unprivileged user + mount namespace) for a tiny tmpfs")
def test_a_full_disk_and_a_read_only_mount_exit_3_in_one_line_and_the_reruns_finish(reference, tiny_weights,
                                                                                   tmp_path, caplog):
    """out_dir on tmpfs mounts in a user and mount namespace (no root needed). Every failure exits 3 with
    one line naming the path and its cause, and no traceback:
    - a 120 kB mount filled to the last byte before the job starts: the lock cannot be written (ENOSPC),
      and none is left (the old code: a traceback and an empty job.lock that refused the next run for 60 s);
    - space freed, the rerun starts on the same out_dir and fills the mount mid-run (ENOSPC): its committed
      parts are sound, and the same out_dir on a roomy disk completes exactly;
    - a mount remounted read-only once the job has committed a part (EROFS; the old code: the lock's
      release raised and a traceback replaced the line), and a new out_dir on it while read-only (EROFS):
      the dead job's lock is taken over at once by the rerun, which completes exactly."""
    full, ro = tmp_path / "full", tmp_path / "ro"
    full.mkdir(), ro.mkdir()
    cli = _cli(tmp_path, f"model.weights_dir={tiny_weights}", f"data.limit={N}")
    q = lambda a: " ".join(f"'{x}'" for x in a)  # noqa: E731
    script = f"""
        mount -t tmpfs -o size=120k tmpfs {full} && mount -t tmpfs -o size=8m tmpfs {ro} || exit 90
        dd if=/dev/zero of={full}/filler bs=1k 2>/dev/null
        {q(cli)} out_dir={full}/run > /dev/null 2> {tmp_path}/start.err; echo $? > {tmp_path}/start.rc
        ls -A {full}/run > {tmp_path}/start.ls
        rm {full}/filler
        {q(cli)} out_dir={full}/run > /dev/null 2> {tmp_path}/full.err; echo $? > {tmp_path}/full.rc
        cp -a {full}/run {tmp_path}/full-run
        {q(cli)} out_dir={ro}/run > /dev/null 2> {tmp_path}/ro.err & job=$!
        until ls {ro}/run/images/*.parquet > /dev/null 2>&1 || ! kill -0 $job 2>/dev/null; do sleep 0.05; done
        until mount -o remount,ro {ro} 2>/dev/null || ! kill -0 $job 2>/dev/null; do sleep 0.02; done
        wait $job; echo $? > {tmp_path}/ro.rc
        {q(cli)} out_dir={ro}/new > /dev/null 2> {tmp_path}/ro_start.err; echo $? > {tmp_path}/ro_start.rc
        cp -a {ro}/run {tmp_path}/ro-run
    """
    r = subprocess.run(["unshare", "-Urm", "sh", "-c", script], cwd=REPO, env=_clean_env(), timeout=500,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    nospace, readonly = "No space left on device (ENOSPC)", "Read-only file system (EROFS)"
    causes = {"start": (nospace, full), "full": (nospace, full), "ro": (readonly, ro), "ro_start": (readonly, ro)}
    for name, (cause, mnt) in causes.items():
        err = (tmp_path / f"{name}.err").read_text()
        lines = [x for x in err.splitlines() if x.strip() and not x.startswith("(")]   # "(Actor pid=..)": Ray's
        assert (tmp_path / f"{name}.rc").read_text().strip() == "3", (name, err)
        assert lines[-1].startswith(f"error: cannot write {mnt}/") and cause in lines[-1], (name, err)
        assert "Traceback" not in err, (name, err)
    assert "job.lock" not in (tmp_path / "start.ls").read_text()
    parts, damaged = output.inspect(tmp_path / "full-run", "full")
    assert parts and not damaged                                   # committed parts intact
    s = job(*args(tiny_weights, tmp_path / "full-run", N, "cluster.batch_size=2"))
    assert s["already_done"] == sum(parts.values()) < N
    assert_exact(tmp_path / "full-run", reference, N)
    caplog.set_level(logging.WARNING, logger="arspec.job")
    job(*args(tiny_weights, tmp_path / "ro-run", N, "cluster.batch_size=2"))
    assert "taking over out_dir" in caplog.text and "is no longer running" in caplog.text, caplog.text
    assert_exact(tmp_path / "ro-run", reference, N)


def _listening(pids: set[int]) -> list[str]:
    """Local addresses of the TCP sockets the processes `pids` listen on (ss)."""
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[3] for line in out.splitlines()
            if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids]


def _descendants(pid: int) -> dict[int, str]:
    from tests.chaos import descendants
    return descendants({pid})


@pytest.mark.skipif(not shutil.which("ss"), reason="needs ss (iproute2) to list listening sockets")
def test_a_private_ray_listens_on_loopback_only(tiny_weights, tmp_path):
    """cluster.address=null: every socket the job's Ray listens on (GCS, raylet, agents, workers, the
    driver's core worker) is on 127.0.0.1, sampled once a part is committed. (The old code bound them
    to 0.0.0.0 or the machine's address.) Then SIGTERM ends the job (143)."""
    out = tmp_path / "run"
    proc = subprocess.Popen(_cli(tmp_path, f"model.weights_dir={tiny_weights}", "data.limit=400", f"out_dir={out}",
                                 "cluster.grace_s=0"), cwd=REPO, env=_clean_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.time()
        while proc.poll() is None and not list((out / "images").glob("*.parquet")) and time.time() - t0 < 200:
            time.sleep(0.05)
        pids = {proc.pid, *_descendants(proc.pid)}
        addresses = _listening(pids)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert len(pids) > 3 and len(addresses) > 3, (pids, addresses, err)
    assert all(re.fullmatch(r"(127\.0\.0\.1|\[::ffff:127\.0\.0\.1\]|\[::1\]):\d+", a) for a in addresses), addresses
    assert proc.returncode == 143, err


@pytest.mark.parametrize("when", ["gcs_server", "ray::IDLE"])
def test_sigterm_while_ray_starts_exits_143_with_ray_shut_down(tiny_weights, tmp_path, when):
    """SIGTERM once the private Ray's GCS process exists (its node starting), or once its first worker
    does (the driver connecting, when Ray's own handlers are in place): exit 143 with the usual line,
    and every process the job started gone when it exits. (The old code: exit 15 with nothing printed,
    or a stack dump and SIGABRT, Ray's processes left behind.)"""
    out = tmp_path / "run"
    proc = subprocess.Popen(_cli(tmp_path, f"model.weights_dir={tiny_weights}", "data.limit=8", f"out_dir={out}"),
                            cwd=REPO, env=_clean_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen, t0 = {}, time.time()
    try:
        while proc.poll() is None and time.time() - t0 < 200:
            seen.update(_descendants(proc.pid))
            if any(when in cmd for cmd in seen.values()):
                proc.send_signal(signal.SIGTERM)
                break
            time.sleep(0.01)
        err = proc.communicate(timeout=120)[1]
    finally:
        proc.kill()
    assert any(when in cmd for cmd in seen.values()), "the job ended before Ray started"
    lines = [x for x in err.splitlines() if x.strip()]
    assert proc.returncode == 143, err
    assert re.fullmatch(r"\[generate\] stopped \(SIGTERM\): 0 prompts committed in this run, 8 left; rerun the "
                        r"same command to finish", lines[-1]), err
    t1 = time.time()                  # Ray's worker processes exit as they notice the raylet gone
    while [p for p in seen if Path(f"/proc/{p}").exists()] and time.time() - t1 < 30:
        time.sleep(0.1)
    left = {p: c[:80] for p, c in seen.items() if Path(f"/proc/{p}").exists()}
    assert not left, left
    assert not (out / "job.lock").exists()


def test_rows_never_exceed_the_prompts_and_a_batch_that_cannot_fit_is_refused(ray_cluster, tiny_weights, tmp_path,
                                                                             monkeypatch):
    """cluster.batch_size=10000 on 6 prompts: the actor decodes in 6 rows (the images record the batch
    each ran in: 6, or fewer where the stream regrouped its last rows; the old
    code allocated caches for 10000, 20000 with CFG). A batch whose KV cache and logits, estimated from
    the model's dims, exceed the device's free memory (100 kB injected) is refused before any is
    allocated, in one line naming cluster.batch_size and how many rows fit."""
    s = job(*args(tiny_weights, tmp_path / "big", 6, "cluster.batch_size=10000", "cluster.num_actors=1"))
    batch = images(tmp_path / "big").batch_size
    assert s["images"] == 6 and batch.max() == 6 and batch.min() >= 1
    from ray import cloudpickle

    import actors.pool
    import tests.poison
    cloudpickle.register_pickle_by_value(tests.poison)
    monkeypatch.setattr(actors.pool, "Generator", tests.poison.CrampedGenerator)
    try:
        with pytest.raises(ConfigError, match=r"could not start: MemoryError: cluster.batch_size=40: 40 rows need at "
                                              r"least 0\.\d MiB .* the device has 0\.1 MiB free: lower "
                                              r"cluster.batch_size \(at most \d+ fit\)"):
            job(*args(tiny_weights, tmp_path / "cramped", 40, "cluster.batch_size=40", "cluster.num_actors=1"))
    finally:
        cloudpickle.unregister_pickle_by_value(tests.poison)
    assert not list((tmp_path / "cramped").glob("images/*.parquet"))


def test_a_job_whose_lock_was_taken_over_commits_nothing_more(reference, tiny_weights, tmp_path):
    """The lock taken over (another job's token in it) while this job's actor decodes a batch: the
    actor writes no file of that part and the driver appends no manifest line (the old code committed
    both, and the driver went on appending duplicate lines)."""
    out = tmp_path / "run"
    c = typed(tiny_weights, out, 4)
    check_out_dir(out, fingerprint(c))
    lock = OutDirLock(out).acquire()
    try:
        threads = torch.get_num_threads()
        gen = Generator(c, str(out), lock.me["token"])
        torch.set_num_threads(threads)
        items = pending_items(c)
        res = gen.run(part_name(items[:2]), items[:2])                # holds the lock: committed
        record_part(out, res, lock.me["token"])
        (out / "job.lock").write_text(json.dumps({**lock.me, "token": "the-new-owner"}))
        with pytest.raises(output.LockLost, match=f"another job took over out_dir={out}"):
            gen.run(part_name(items[2:]), items[2:])
        with pytest.raises(output.LockLost):
            record_part(out, res, lock.me["token"])
    finally:
        lock.release()
    assert sorted(f.stem for t in output.TABLES for f in (out / t).glob("*.parquet")) == [res.part] * 2   # no errors file
    assert len((out / "manifest.jsonl").read_text().splitlines()) == 1
    assert output.LockLost.code == 143


def test_a_suspended_owner_on_this_host_is_taken_over_once_silent(reference, tiny_weights, tmp_path, caplog):
    """The lock's owner runs on this host (its pid alive, e.g. stopped with SIGSTOP) but its heartbeat
    is older than cluster.lock_timeout_s: taken over with a line, as the README says of a silent owner
    (the old code refused it for as long as the pid lived)."""
    out = tmp_path / "run"
    shutil.copytree(reference[0], out)
    owner = subprocess.Popen(["sleep", "300"])
    try:
        me = OutDirLock(out).me
        from workflows.lock import pid_start
        (out / "job.lock").write_text(json.dumps({**me, "pid": owner.pid, "pid_start": pid_start(owner.pid),
                                                  "token": "suspended"}))
        os.utime(out / "job.lock", (time.time() - 120, time.time() - 120))
        caplog.set_level(logging.WARNING, logger="arspec.job")
        s = job(*args(tiny_weights, out, N, "cluster.lock_timeout_s=60"))
    finally:
        owner.kill()
        owner.wait()
    assert s["already_done"] == N
    assert re.search(rf"its lock's owner, the job of pid {owner.pid} on host .*, has been silent for 1\d\ds", caplog.text)


def test_a_prompt_file_with_no_prompts_is_refused_in_one_line(tiny_weights, tmp_path):
    """A Parquet prompt file with no rows: one line naming data.path, exit 2, nothing generated (the
    old code exited 0 with no word)."""
    data = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), data)
    r = subprocess.run([sys.executable, "-m", "workflows.generate", f"model.weights_dir={tiny_weights}", "data=file",
                        f"data.path={data}", f"out_dir={tmp_path / 'run'}", f"hydra.run.dir={tmp_path / 'h'}"],
                       capture_output=True, text=True, cwd=REPO, timeout=120, env=_clean_env())
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0] == f"error: data.path={data}: holds no prompts (data.limit=None): nothing to generate; give a " \
                       f"prompt set with rows in it"
    assert not (tmp_path / "run" / "job.json").exists()


def _part(out: Path, start: int, images: list[str], errors: list[str]) -> tuple[str, dict]:
    """A part of `images` + `errors` prompts at positions start.., written by output.write_part as an actor
    writes it (tiny PNGs, no token rows) -> (its name, its files' info)."""
    import numpy as np
    ids = images + errors
    part = part_name([{"position": start + i, "prompt_id": p} for i, p in enumerate(ids)])
    png = output.png_bytes(np.zeros((4, 4, 3), np.uint8))
    rows = [{"prompt_id": p, "prompt": p, "seed": 0, "engine": "vanilla", "model": "shapes",
             "image": {"bytes": png, "path": None}, "width": 4, "height": 4, "part": part} for p in images]
    failed = [{"prompt_id": p, "prompt": p, "seed": 0, "engine": "vanilla", "error": "boom", "part": part}
              for p in errors]
    files = output.write_part(out, part, pa.Table.from_pylist(rows, schema=output.IMAGE_SCHEMA),
                              output.TOKEN_SCHEMA.empty_table(), pa.Table.from_pylist(failed, schema=output.ERROR_SCHEMA))
    output.append_manifest(out, output.manifest_entry(part, ids, len(images), len(errors), files))
    return part, files


def test_only_a_part_with_failed_prompts_has_an_errors_file_and_every_part_stays_verifiable(tmp_path):
    """No errors file for a part whose prompts all made images (the old code wrote an empty one per part):
    one an earlier attempt left is removed before the images file commits; the manifest lists none; verify
    (with and without manifest lines: images + errors rows must be the prompts the part's name spans) finds
    every part sound; pandas and pyarrow read an errors/ with no file as an empty table. A part's errors file
    lost, or one beside a part recorded without, is damage."""
    import pandas as pd
    from workflows.verify import main as verify
    out = tmp_path / "run"
    (out / "errors").mkdir(parents=True)
    stale = output.ERROR_SCHEMA.empty_table()        # an earlier attempt at part 0's prompts failed one of them
    ok = part_name([{"position": 0, "prompt_id": "a"}, {"position": 1, "prompt_id": "b"}])
    pq.write_table(pa.Table.from_pylist([{"prompt_id": "a", "error": "oom"}], schema=stale.schema),
                   out / "errors" / f"{ok}.parquet")
    assert _part(out, 0, ["a", "b"], [])[0] == ok
    assert list((out / "errors").iterdir()) == [] and len(pd.read_parquet(out / "errors")) == 0
    assert pq.read_table(out / "errors").num_rows == 0
    bad, files = _part(out, 2, ["c"], ["d"])
    assert set(files) == {"images", "tokens", "errors"}
    (out / "job.json").write_text("{}")
    assert output.inspect(out, "full") == ({ok: 2, bad: 2}, {})
    assert verify([f"out_dir={out}"]) == 0
    assert pd.read_parquet(out / "errors").prompt_id.tolist() == ["d"]
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert "errors" not in manifest[0]["files"] and manifest[0]["errors"] == 0
    (out / "manifest.jsonl").rename(tmp_path / "manifest.jsonl")
    assert output.inspect(out) == ({ok: 2, bad: 2}, {})              # checked from the files alone
    (out / "errors" / f"{bad}.parquet").rename(tmp_path / "lost.parquet")
    assert "rows for 1 prompts (and no errors file), its name spans 2" in output.inspect(out)[1][bad]
    (tmp_path / "manifest.jsonl").rename(out / "manifest.jsonl")
    assert output.inspect(out)[1][bad] == f"errors/{bad}.parquet: missing"
    (tmp_path / "lost.parquet").rename(out / "errors" / f"{ok}.parquet")
    assert "the manifest recorded no errors file" in output.inspect(out)[1][ok]
