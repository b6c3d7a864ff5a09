"""The job with out_dir and data.path on an object store, against a real S3 server (SeaweedFS, started by
the `s3_server` fixture, tests/seaweed.py; no mock of the S3 API): a whole job and its readers, a driver
killed mid-job, a damaged object, a second job, bad stores, and a store that stops mid-job."""
from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from actors.store import at
from tests.conftest import REPO
from workflows.config import ConfigError
from workflows.generate import run
from tests.test_reliability import fault  # noqa: F401 (the write-boundary fixture)

BUCKET = "arspec"
N = 8           # prompts: 4 parts of 2
# vanilla: the runs compared here (a local one, s3 ones, reruns) batch their prompts as they arrive, and the
# acceptance statistics the report compares follow the batches with a speculative engine; fp32: test_job.TINY
TINY = ["engine=vanilla", "engine.sampling.cfg_scale=2.0", "model.dtype=float32", "cluster.batch_size=2", "cluster.num_actors=1"]
PROMPTS = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(
    ["a red circle", "a blue square", "a green triangle", "a dragon", "a small red square", "a big blue circle",
     "two green circles", "a yellow triangle"])]


@pytest.fixture(scope="module")
def s3(ray_cluster, s3_server, tmp_path_factory):
    """The server's AWS environment set for this module, its bucket, and the prompt file on it and on disk.
    (Ray starts first, without these variables: the job hands them to its actors.)"""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        c = s3_server.client()
        c.create_bucket(Bucket=BUCKET)
        body = "".join(json.dumps(p) + "\n" for p in PROMPTS).encode()
        c.put_object(Bucket=BUCKET, Key="prompts/p.jsonl", Body=body)
        sink = pa.BufferOutputStream()
        pq.write_table(pa.Table.from_pylist(PROMPTS), sink, row_group_size=3)   # read by row groups
        c.put_object(Bucket=BUCKET, Key="prompts/p.parquet", Body=sink.getvalue().to_pybytes())
        local = tmp_path_factory.mktemp("prompts") / "p.jsonl"
        local.write_bytes(body)
        yield s3_server, local


def job(*overrides) -> dict:
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return run(compose("generate", overrides=list(overrides)))


def args(tiny_weights, out, data=f"s3://{BUCKET}/prompts/p.jsonl", *extra) -> list[str]:
    return [f"model.weights_dir={tiny_weights}", f"out_dir={out}", "data=file", f"data.path={data}",
            "data.id_column=id", *TINY, *extra]


def table(out: str, name: str) -> pd.DataFrame:
    """A table of an out_dir read as a user would: pyarrow over the store's filesystem."""
    import pyarrow.dataset as ds
    where = at(out) / name
    return ds.dataset(where.key, filesystem=where.fs, format="parquet").to_table().to_pandas()


def image_bytes(out) -> dict:
    if isinstance(out, str):
        df = table(out, "images")
    else:
        df = pq.read_table(out / "images").to_pandas()
    return {pid: img["bytes"] for pid, img in zip(df.prompt_id, df.image)}


@pytest.fixture(scope="module")
def local_run(s3, ray_cluster, tiny_weights, tmp_path_factory):
    """The same prompts generated to a local disk."""
    out = tmp_path_factory.mktemp("local") / "run"
    job(*args(tiny_weights, out, s3[1]))
    return out


@pytest.fixture(scope="module")
def reference(local_run):
    """What every s3 run must equal, byte for byte: the local run's images."""
    return image_bytes(local_run)


def cli(*argv, module="workflows.generate", timeout=240):
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


@pytest.fixture(scope="module")
def whole(s3, ray_cluster, tiny_weights):
    """One whole job on s3://arspec/whole, prompts read from the store: its summary."""
    return job(*args(tiny_weights, f"s3://{BUCKET}/whole"))


def copy_prefix(server, src: str, dst: str) -> None:
    c = server.client()
    for k in server.keys(BUCKET, src + "/"):
        if not k.endswith("/"):
            c.copy_object(Bucket=BUCKET, Key=dst + k[len(src):], CopySource={"Bucket": BUCKET, "Key": k})


def files(server, prefix: str) -> dict:
    """The objects under a prefix (SeaweedFS also lists "dir/" markers: left out)."""
    return {k: v for k, v in server.keys(BUCKET, prefix + "/").items() if not k.endswith("/")}


def test_whole_job_on_s3_then_verify_and_readers(s3, whole, reference):
    server, _ = s3
    out = f"s3://{BUCKET}/whole"
    s = whole
    assert (s["images"], s["errors"]) == (N, 0)
    keys = server.keys(BUCKET, "whole/")
    parts = sorted(k.split("/")[-1] for k in keys if k.startswith("whole/images/"))
    assert len(parts) == N // 2
    for t in ("images", "tokens"):
        assert sorted(k.split("/")[-1] for k in keys if k.startswith(f"whole/{t}/")) == parts
    assert not [k for k in keys if k.startswith("whole/errors/") and not k.endswith("/")]   # no prompt failed
    assert {"whole/job.json", "whole/summary.json", "whole/manifest.jsonl"} <= set(keys)
    assert not [k for k in keys if (k.startswith("whole/manifest/") and not k.endswith("/")) or "job.lock" in k]  # folded, released (SeaweedFS keeps "dir/" markers)
    manifest = [json.loads(x) for x in server.client().get_object(Bucket=BUCKET, Key="whole/manifest.jsonl")
                ["Body"].read().splitlines()]
    assert sorted(e["part"] + ".parquet" for e in manifest) == parts
    assert image_bytes(out) == reference
    assert len(table(out, "tokens")) == N * 16
    from workflows.verify import main as verify
    assert verify([f"out_dir={out}"]) == 0 and verify([f"out_dir={out}", "verify=full"]) == 0
    # the README's readers
    import datasets
    import duckdb
    import pyarrow.dataset as pads
    import pyarrow.fs as pafs
    fs = pafs.S3FileSystem(endpoint_override=server.endpoint)
    df = pd.read_parquet(f"{BUCKET}/whole/images", filesystem=fs)
    assert len(df) == N
    con = duckdb.connect()
    con.register("images", pads.dataset(f"{BUCKET}/whole/images", filesystem=fs))
    n, tau = con.sql("select count(*), avg(mean_accept_len) from images").fetchall()[0]
    assert n == N and tau >= 1.0
    hf = datasets.Dataset(pads.dataset(f"{BUCKET}/whole/images", filesystem=fs).to_table())
    from PIL import Image
    assert isinstance(hf[0]["image"], Image.Image) and hf[0]["image"].size == (8, 8)


# A driver in a subprocess, attached to the tests' Ray, with the write-boundary hook (actors/output.py FAULT)
# doing ACTION at its K-th committed manifest line: a deterministic point mid-job.
DRIVER = textwrap.dedent("""
    import os, signal, sys
    from actors import output
    from workflows.config import cli
    from workflows.generate import main
    seen = [0]
    def hook(point):
        if point == "after:manifest-line":
            seen[0] += 1
            if seen[0] == int(os.environ["AT_LINE"]):
                ACTION
    output.FAULT = hook
    cli(main)
""")


def driver(action: str, at_line: int, argv: list[str], extra_env=None):
    code = DRIVER.replace("ACTION", action)
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=240, cwd=REPO,
                          env={**os.environ, "HYDRA_FULL_ERROR": "0", "AT_LINE": str(at_line), **(extra_env or {})})


def committed_parts(server, prefix: str) -> list[str]:
    return sorted(k.split("/")[-1] for k in files(server, prefix) if k.startswith(f"{prefix}/images/"))


def assert_complete(server, prefix: str, reference) -> None:
    """Every prompt once, bytes equal to the local run, tokens matching, no lock, no unfolded manifest lines."""
    out = f"s3://{BUCKET}/{prefix}"
    assert image_bytes(out) == reference
    tokens = table(out, "tokens")
    assert len(tokens) == N * 16 and set(tokens.prompt_id) == set(reference)
    keys = files(server, prefix)
    assert not [k for k in keys if "job.lock" in k or f"{prefix}/manifest/" in k], keys
    assert sorted(k.split("/")[-1] for k in keys if k.startswith(f"{prefix}/tokens/")) == committed_parts(server, prefix)
    assert not [k for k in keys if k.startswith(f"{prefix}/errors/")]     # no prompt failed: no errors objects


def test_driver_killed_mid_job_then_resumed_byte_identical(s3, ray_cluster, tiny_weights, reference, caplog):
    server, _ = s3
    argv = args(tiny_weights, f"s3://{BUCKET}/cut", f"s3://{BUCKET}/prompts/p.jsonl",
                f"cluster.address={ray_cluster.address}")
    r = driver("os.kill(os.getpid(), signal.SIGKILL)", 2, argv)
    assert r.returncode == -9, r.stderr[-2000:]
    parts = committed_parts(server, "cut")
    assert 2 <= len(parts) < N // 2, parts             # killed mid-job
    assert any("job.lock" in k for k in files(server, "cut"))   # a dead driver's lock: taken over on the rerun
    caplog.set_level(logging.WARNING, logger="arspec.job")
    assert job(*argv)["already_done"] >= len(parts)                  # the rerun, in this process: committed parts kept
    assert "taking over" in caplog.text and "is no longer running" in caplog.text, caplog.text
    assert_complete(server, "cut", reference)


def test_damaged_objects_are_quarantined_and_regenerated(s3, whole, ray_cluster, tiny_weights, reference, caplog):
    """A byte flipped inside one part's images object (same size: its page checksum sees it) and another
    part's tokens object cut short: workflows.verify names both and exits 1; the rerun moves each part's
    objects to quarantine/ and generates its prompts again, byte-identical."""
    import logging
    server, _ = s3
    copy_prefix(server, "whole", "damaged")
    parts = committed_parts(server, "damaged")
    c = server.client()
    key = f"damaged/images/{parts[1]}"
    data = bytearray(c.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[data.index(b"IHDR") + 6] ^= 0xFF              # inside a PNG, inside a data page
    c.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    key = f"damaged/tokens/{parts[2]}"
    c.put_object(Bucket=BUCKET, Key=key, Body=c.get_object(Bucket=BUCKET, Key=key)["Body"].read()[:-100])
    out = f"s3://{BUCKET}/damaged"
    r = cli(f"out_dir={out}", module="workflows.verify")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"damaged {parts[1][:-8]}: images/" in r.stdout and "page checksum failed" in r.stdout, r.stdout
    assert f"damaged {parts[2][:-8]}: tokens/" in r.stdout and "the manifest recorded" in r.stdout, r.stdout
    caplog.set_level(logging.WARNING, logger="arspec.job")
    s = job(*args(tiny_weights, out))
    assert (s["images"], s["already_done"]) == (4, N - 4)
    keys = files(server, "damaged")
    for p in (parts[1], parts[2]):
        assert f"quarantined {p[:-8]}:" in caplog.text
        assert all(f"damaged/quarantine/{t}/{p}" in keys for t in ("images", "tokens"))
    assert_complete(server, "damaged", reference)
    from workflows.verify import main as verify
    assert verify([f"out_dir={out}", "verify=full"]) == 0


def test_second_job_on_a_held_prefix_is_refused_and_a_dead_or_silent_owner_taken_over(
        s3, ray_cluster, tiny_weights, reference, caplog):
    """The lock is created with If-None-Match: * (a second create fails, whatever the timing), refreshed and
    taken over with If-Match."""
    import logging
    import socket
    import time
    from workflows.lock import LockHeld, ObjectLock
    server, _ = s3
    out = f"s3://{BUCKET}/held"
    with ObjectLock(at(out)):
        with pytest.raises(LockHeld, match=rf"out_dir={out} is in use by the job of pid {os.getpid()} on host "
                                            rf"{socket.gethostname()}"):
            ObjectLock(at(out)).acquire()
        with pytest.raises(LockHeld, match=rf"out_dir={out} is in use by the job of pid {os.getpid()}"):
            job(*args(tiny_weights, out))
        assert list(files(server, "held")) == ["held/job.lock"]       # nothing else written
    assert files(server, "held") == {}                                 # released
    # another host's job, silent past cluster.lock_timeout_s (the store's clock: Date - Last-Modified)
    server.client().put_object(Bucket=BUCKET, Key="held/job.lock", Body=json.dumps(
        {"host": "node-b", "pid": 1, "boot_id": "x", "started": "then", "token": "b"}).encode())
    with pytest.raises(LockHeld, match="in use by the job of pid 1 on host node-b"):
        job(*args(tiny_weights, out, f"s3://{BUCKET}/prompts/p.jsonl", "cluster.lock_timeout_s=60"))
    time.sleep(3)       # past lock_timeout_s=1 on the store's clock (whole seconds: Date, Last-Modified)
    caplog.set_level(logging.WARNING, logger="arspec.job")
    job(*args(tiny_weights, out, f"s3://{BUCKET}/prompts/p.jsonl", "cluster.lock_timeout_s=1"))
    assert "pid 1 on host node-b started then, has been silent for" in caplog.text
    assert_complete(server, "held", reference)


def test_lock_on_s3_takeover_race_and_a_lock_taken_away_stops_the_job(s3):
    """Two jobs that judged the same lock stale: only one takeover goes through (If-Match on the ETag they
    read). A job whose lock another took over sees it at its next heartbeat and stops (Stop requested), and
    its heartbeat does not write over the new owner's lock."""
    import time
    from workflows.lock import ObjectLock, Stop
    server, _ = s3
    out = at(f"s3://{BUCKET}/race")
    c = server.client()
    c.put_object(Bucket=BUCKET, Key="race/job.lock", Body=json.dumps({"host": "node-b", "pid": 1, "token": "old"}).encode())
    a, b = ObjectLock(out), ObjectLock(out)
    judged = [x.read()[0] for x in (a, b)]
    assert judged[0] == judged[1]
    assert a.take_over(judged[0]) and not b.take_over(judged[1])
    assert json.loads(c.get_object(Bucket=BUCKET, Key="race/job.lock")["Body"].read())["token"] == a.me["token"]
    c.delete_object(Bucket=BUCKET, Key="race/job.lock")
    stop = Stop(grace_s=0)
    with ObjectLock(out, timeout_s=0.8, stop=stop) as lock:
        etag = c.head_object(Bucket=BUCKET, Key="race/job.lock")["ETag"]
        t0 = time.time()
        while c.head_object(Bucket=BUCKET, Key="race/job.lock")["ETag"] == etag and time.time() - t0 < 30:
            time.sleep(0.05)                                   # its heartbeat rewrites the lock (If-Match)
        assert json.loads(c.get_object(Bucket=BUCKET, Key="race/job.lock")["Body"].read())["token"] == lock.me["token"]
        c.put_object(Bucket=BUCKET, Key="race/job.lock", Body=json.dumps({"host": "node-c", "pid": 2, "token": "new"}).encode())
        t0 = time.time()
        while not stop and time.time() - t0 < 30:
            time.sleep(0.05)
        assert stop.reason == f"another job took over out_dir={out}"
    assert json.loads(c.get_object(Bucket=BUCKET, Key="race/job.lock")["Body"].read())["token"] == "new"
    # the same, one step at a time: neither a heartbeat nor the release touches a lock that is no longer ours
    c.delete_object(Bucket=BUCKET, Key="race/job.lock")
    lock = ObjectLock(out, timeout_s=600).acquire()
    c.put_object(Bucket=BUCKET, Key="race/job.lock", Body=json.dumps({"host": "node-d", "pid": 3, "token": "d"}).encode())
    lock._touch()
    lock.release()
    assert json.loads(c.get_object(Bucket=BUCKET, Key="race/job.lock")["Body"].read())["token"] == "d"


def test_endpoint_in_the_uri_instead_of_the_environment(s3, whole, monkeypatch):
    """s3://bucket/prefix?endpoint_override=host:port&scheme=http: the store's filesystem and the lock's
    client both take the endpoint from the URI when AWS_ENDPOINT_URL is not set."""
    from workflows.lock import ObjectLock
    from workflows.verify import main as verify
    server, _ = s3
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    query = f"?endpoint_override={server.endpoint.split('://')[1]}&scheme=http"
    assert verify([f"out_dir=s3://{BUCKET}/whole{query}", "verify=full"]) == 0
    with ObjectLock(at(f"s3://{BUCKET}/uri{query}")):
        assert "uri/job.lock" in files(server, "uri")
    assert files(server, "uri") == {}


def one_line(e) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_bad_stores_are_refused_in_one_line_and_nothing_is_written_or_deleted(s3, whole, tiny_weights, monkeypatch):
    """Before the lock or Ray: an unknown scheme, a missing bucket, refused or absent credentials, a
    prefix holding other people's objects or another job's, a prompt file that is not there."""
    server, _ = s3
    c = server.client()
    c.put_object(Bucket=BUCKET, Key="theirs/notes.txt", Body=b"not a job's")
    copy_prefix(server, "whole", "otherjob")
    before = server.keys(BUCKET)
    cases = [
        (["out_dir=nosuch://arspec/x"], "unknown scheme nosuch://"),
        (["out_dir=memory://arspec/x"], "a job writes to a memory:// prefix only where it can lock it"),
        (["out_dir=s3://no-such-bucket/x"], "bucket 'no-such-bucket' does not exist"),
        ([f"out_dir=s3://{BUCKET}/theirs"], f"out_dir=s3://{BUCKET}/theirs is not a job's directory (job.json is "
                                            f"missing) and holds notes.txt: nothing was changed"),
        ([f"out_dir=s3://{BUCKET}/otherjob", "engine.sampling.cfg_scale=3.0"], "was written by a different config"),
        ([f"out_dir=s3://{BUCKET}/new", f"data.path=s3://{BUCKET}/prompts/none.jsonl"], "no such file"),
    ]
    for extra, message in cases:
        with pytest.raises(ConfigError) as e:
            job(*args(tiny_weights, "unset"), *extra)
        assert message in one_line(e), (extra, str(e.value))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    with pytest.raises(ConfigError) as e:
        job(*args(tiny_weights, f"s3://{BUCKET}/new"))
    assert "the credentials were refused" in one_line(e)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    with pytest.raises(ConfigError) as e:
        job(*args(tiny_weights, f"s3://{BUCKET}/new"))
    assert "no credentials" in one_line(e)
    assert server.keys(BUCKET) == before                       # nothing written, changed or deleted
    # what a user sees: one line, exit 2, before Ray starts (no private Ray is ever started here)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "nobody")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong")
    r = cli(*args(tiny_weights, f"s3://{BUCKET}/new"), "cluster.address=null")
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "credentials were refused" in lines[0], r.stderr
    assert "ray" not in (r.stdout + r.stderr).lower()


def test_store_that_stops_mid_job_exits_in_one_line_and_the_rerun_finishes(s3, ray_cluster, tiny_weights, reference):
    """The server is stopped (by its PID) when the driver has committed its first part: the job exits 3 with
    one line; with the server back, every committed part is sound (nothing half-visible), and the rerun
    finishes byte-identical."""
    server, _ = s3
    argv = args(tiny_weights, f"s3://{BUCKET}/outage", f"s3://{BUCKET}/prompts/p.parquet",
                f"cluster.address={ray_cluster.address}")
    try:
        r = driver("os.killpg(int(os.environ['WEED_PID']), signal.SIGTERM)", 1, argv,
                   {"WEED_PID": str(server.proc.pid)})
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 3 and last.startswith("error: cannot reach s3://") or \
            last.startswith("error: cannot write"), r.stderr[-3000:]
        assert "rerun the same command" in last and "Traceback" not in r.stderr, r.stderr[-3000:]
    finally:
        server.stop()
        server.start()
    from workflows.verify import main as verify
    assert verify([f"out_dir=s3://{BUCKET}/outage", "verify=full"]) == 0
    have = {k.split("/")[-1] for k in files(server, "outage") if k.startswith("outage/tokens/")}
    assert set(committed_parts(server, "outage")) <= have     # each committed part's images object came after its tokens
    job(*argv)                                                       # the rerun, in this process
    assert_complete(server, "outage", reference)


def test_analyze_reads_a_run_on_s3_as_it_reads_the_same_run_on_disk(s3, whole, local_run, tmp_path):
    """workflows.analyze over s3://arspec/whole (DuckDB over the job's pyarrow filesystem) gives the numbers
    it gives for the local run of the same prompts."""
    from workflows.report import ReportConfig, build
    cfg = dict(examples=1, side_by_side=2, scorer=False, threads=1)
    got = build([f"s3://{BUCKET}/whole"], ReportConfig(out=str(tmp_path / "s3"), **cfg))
    want = build([local_run], ReportConfig(out=str(tmp_path / "local"), **cfg))
    def facts(x):      # every number but the measured seconds (wall clock of each run)
        if isinstance(x, dict):
            return {k: facts(v) for k, v in x.items() if k not in ("path", "label", "seconds", "s_per_image")}
        return [facts(v) for v in x] if isinstance(x, list) else x
    runs = [facts(json.loads((d / "summary.json").read_text())["runs"][0]) for d in (got, want)]
    assert runs[0] == runs[1] and runs[0]["summary"][0]["images"] == N
    assert (got / "index.html").stat().st_size > 10_000


def test_crash_at_every_write_boundary_on_s3_then_rerun_is_exact(s3, ray_cluster, tiny_weights, tmp_path, fault):
    """tests/test_reliability.py's boundary test on the store: each batch of 2 built-in prompts stopped at a
    different point of its part (before, midway through and after each object; after and midway through
    its manifest line object). The rerun (batches of 4: other part names) regenerates exactly the
    uncommitted parts, quarantines nothing, removes the uncommitted parts' objects, and equals a local run.
    An images object written before the tokens one, or any object made visible before it is whole, leaves
    a damaged committed part: quarantined, and this test fails."""
    import torch

    import actors.output as output
    from actors.generator import Generator
    from tests.test_reliability import crash_at_each_point, pending_items
    from workflows.config import to_object
    from workflows.generate import check_out_dir, fingerprint
    server, _ = s3
    n = 26

    def shapes(out, *extra):
        return [f"model.weights_dir={tiny_weights}", f"out_dir={out}", "engine.sampling.cfg_scale=2.0",
                "cluster.num_actors=1", f"data.limit={n}", *extra]
    job(*shapes(tmp_path / "local", "cluster.batch_size=4"))
    want = image_bytes(tmp_path / "local")
    out = f"s3://{BUCKET}/crash"
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        c = to_object(compose("generate", overrides=shapes(out)))
    items = pending_items(c)
    check_out_dir(at(out), fingerprint(c))
    threads = torch.get_num_threads()
    gen = Generator(c, out)                           # the actor's code, in this process
    torch.set_num_threads(threads)
    crash_at_each_point(gen, out, items, n, fault)
    assert len(output.read_manifest(out)) == 3          # 3 line objects; the one stopped midway is not there
    s = job(*shapes(out, "cluster.batch_size=4"))
    assert (s["already_done"], s["images"]) == (10, n - 10)   # ok, ok, after:images, both manifest-line points
    keys = files(server, "crash")
    assert not [k for k in keys if "/quarantine/" in k], keys
    assert image_bytes(out) == want
    parts = committed_parts(server, "crash")
    assert sorted(k.split("/")[-1] for k in keys if k.startswith("crash/tokens/")) == parts   # the uncommitted parts'
    assert not [k for k in keys if k.startswith("crash/errors/")]                           # objects are gone
    manifest = [json.loads(x) for x in server.client().get_object(Bucket=BUCKET, Key="crash/manifest.jsonl")
                ["Body"].read().splitlines()]
    assert sorted(e["part"] + ".parquet" for e in manifest) == parts
    from workflows.verify import main as verify
    assert verify([f"out_dir={out}", "verify=full"]) == 0
