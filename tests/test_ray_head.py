"""The README's cluster path on a real Ray head: `ray start --head` in a subprocess (its own ports and temp
dir, dashboard on 127.0.0.1, token authentication), the job submitted through the Ray Jobs SDK, and the
default command (`cluster.address=null`) run beside that head. Only that head is stopped.

Needs `ray[default]` (the dashboard and the Jobs API); skipped without it. Takes about a minute or two
(a head, a job, a local Ray): it is not part of the fast suite's budget.
"""
from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="ray[default] is not installed (pip install 'ray[default]')")
job_submission = pytest.importorskip("ray.job_submission")

from tests.conftest import REPO  # noqa: E402
from tests.test_job import TINY, images  # noqa: E402

PORTS = ("port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port",
         "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port")


def free_ports(n: int, avoid: range = range(0)) -> list[int]:
    """n distinct ports free now, none in `avoid` (the head's worker port range: Ray refuses a component
    port inside it)."""
    socks, ports = [], []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        if s.getsockname()[1] not in avoid:
            ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _processes_under(temp_dir: str) -> list[int]:
    """Pids of the processes this head started: their command lines name its own temp dir."""
    pids = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and temp_dir.encode() in (p / "cmdline").read_bytes():
                pids.append(int(p.name))
        except OSError:
            continue
    return pids


@pytest.fixture(scope="module")
def ray_head():
    """A private head: -> (gcs address, dashboard url, token, Jobs SDK client). Stopped by its own `ray start --block`
    process, then any process left that carries its temp dir is killed by pid."""
    temp_dir = tempfile.mkdtemp(prefix="rh", dir="/tmp")       # short: Ray's socket paths must fit
    worker = free_ports(1)[0]
    ports = dict(zip(PORTS, free_ports(len(PORTS), avoid=range(worker, worker + 201))))
    token = secrets.token_hex(32)
    env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    args = [ray_cli, "start", "--head", "--block", f"--temp-dir={temp_dir}", "--num-cpus=2", "--num-gpus=0",
            "--dashboard-host=127.0.0.1", "--disable-usage-stats", f"--min-worker-port={worker}",
            f"--max-worker-port={worker + 200}", *(f"--{k}={v}" for k, v in ports.items())]
    log = open(Path(temp_dir) / "head.log", "w")
    head = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard-port']}"
    try:
        client, t0 = None, time.time()
        while client is None:
            if head.poll() is not None or time.time() - t0 > 180:
                pytest.fail(f"the Ray head did not start: {(Path(temp_dir) / 'head.log').read_text()[-2000:]}")
            try:
                client = job_submission.JobSubmissionClient(url, headers={"Authorization": f"Bearer {token}"})
            except Exception:
                time.sleep(1)
        yield f"127.0.0.1:{ports['port']}", url, token, client
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for pid in _processes_under(temp_dir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log.close()
        shutil.rmtree(temp_dir, ignore_errors=True)


def test_job_submitted_to_a_real_head_with_token_auth(ray_head, tiny_weights, tmp_path):
    _, url, token, client = ray_head
    out = tmp_path / "run"
    entry = (f"python -m workflows.generate cluster.address=auto cluster.num_actors=null cluster.num_cpus_per_actor=1 "
             f"model.weights_dir={tiny_weights} data.limit=6 cluster.batch_size=2 out_dir={out} {' '.join(TINY)}")
    job_id = client.submit_job(entrypoint=entry, runtime_env={
        "working_dir": str(REPO), "excludes": [".git", "outputs", "runs", "bench"],
        "env_vars": {"RAY_USAGE_STATS_ENABLED": "0"}})
    t0, status = time.time(), None
    while time.time() - t0 < 300:
        status = client.get_job_status(job_id)
        if status.is_terminal():
            break
        time.sleep(1)
    logs = client.get_job_logs(job_id)
    assert status == job_submission.JobStatus.SUCCEEDED, logs[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["images"], summary["errors"], summary["actors"], summary["num_actors"]) == (6, 0, 2, 2)
    assert len(images(out)) == 6 and "Connected to Ray cluster" in logs
    # without the token the head refuses the Jobs API
    with pytest.raises(Exception, match="(?i)auth|401|403|token"):
        job_submission.JobSubmissionClient(url, headers={"Authorization": "Bearer " + "0" * 64}).list_jobs()


def test_run_by_hand_with_an_explicit_address_and_token_auth(ray_head, tiny_weights, tmp_path):
    """`python -m workflows.generate cluster.address=HOST:PORT` on a token-auth head, the README's way: with
    RAY_AUTH_MODE unset Ray does not use the token for an explicit address (only for "auto"), and the job
    fails in one line saying to set it; with RAY_AUTH_MODE=token it attaches and completes."""
    gcs, _, token, _ = ray_head
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    env.update(RAY_AUTH_TOKEN=token, RAY_USAGE_STATS_ENABLED="0")

    def generate(out, **more):
        return subprocess.run([sys.executable, "-m", "workflows.generate", f"model.weights_dir={tiny_weights}", *TINY,
                               f"cluster.address={gcs}", "data.limit=2", "cluster.num_actors=1",
                               "cluster.num_cpus_per_actor=1", f"out_dir={out}"],
                              cwd=REPO, capture_output=True, text=True, timeout=300, env={**env, **more})
    r = generate(tmp_path / "refused", RAY_gcs_server_port_wait_time_s="2")  # Ray's connect retries: 2, not 20 s
    assert r.returncode == 2 and f"error: cluster.address={gcs}: cannot connect" in r.stderr
    assert "set RAY_AUTH_MODE=token and give its token" in r.stderr.strip().splitlines()[-1]
    r = generate(tmp_path / "run", RAY_AUTH_MODE="token")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Connected to Ray cluster" in r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["images"] == 2


def test_default_command_starts_a_private_ray_beside_a_running_head(ray_head, tiny_weights, tmp_path):
    """cluster.address=null with RAY_ADDRESS pointing at the head (as `ray job submit` or a `ray start`
    leaves it): the job starts its own local Ray instead of attaching (which used to die with
    `ValueError: When connecting to an existing cluster, num_cpus and num_gpus must not be provided`)."""
    gcs, _, _, client = ray_head
    before = len(client.list_jobs())
    r = subprocess.run([sys.executable, "-m", "workflows.generate", f"model.weights_dir={tiny_weights}", *TINY,
                        "data.limit=2", "cluster.num_actors=1", f"out_dir={tmp_path / 'run'}"],
                       cwd=REPO, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "RAY_ADDRESS": gcs, "RAY_USAGE_STATS_ENABLED": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Started a local Ray instance" in r.stderr and "Connecting to existing Ray cluster" not in r.stderr
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["images"] == 2
    assert len(client.list_jobs()) == before
