"""Shared fixtures: tiny random-weight models for unit checks, one Ray instance for the whole run."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray starts its workers at niceness 15: beside other CPU-bound work (the suite must pass on a busy
# machine) the job tests' actors then got almost no CPU, and one job test took over 10 minutes. The
# tests' Ray workers run at the priority of the test process instead.
os.environ.setdefault("RAY_worker_niceness", "0")
# Hydra's per-run folders (conf/*.yaml hydra.run.dir) go to a temporary directory, not the working tree:
# the tests' subprocesses inherit it
HYDRA_DIR = tempfile.mkdtemp(prefix="arspec-hydra-")
os.environ["ARSPEC_HYDRA_DIR"] = HYDRA_DIR
atexit.register(shutil.rmtree, HYDRA_DIR, True)
# the cost tables an engine measures (decoding/engines/cost.py) go to a folder of this run, not the user's
# cache: a test that measures measures afresh, and no test reads a table another run measured
if "ARSPEC_CACHE" not in os.environ:
    os.environ["ARSPEC_CACHE"] = tempfile.mkdtemp(prefix="arspec-cache-")
    atexit.register(shutil.rmtree, os.environ["ARSPEC_CACHE"], True)
# the cores this process may use, at most two, unless OMP_NUM_THREADS says otherwise: the suite runs on
# pytest-xdist workers (pyproject's addopts), which share the cores; on a busy host a second thread that
# is not scheduled stalls every op of the first
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(2, (os.cpu_count() or 1) // WORKERS))))

from decoding.bundle import Conditions, ModelBundle  # noqa: E402
from decoding.models.drafter import Drafter, DrafterArgs  # noqa: E402
from decoding.models.gpt import GPT, GPTArgs  # noqa: E402
from decoding.models.vq import VQArgs, VQModel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def tiny_bundle(vocab=4, grid=2, dim=32, n_layer=2, std=0.5, seed=0, model_type="c2i", dtype="float32") -> ModelBundle:
    """Random GPT + drafter over a tiny vocabulary and grid: short sequences whose exact distribution
    can be enumerated. Large init std makes the distributions far from uniform."""
    torch.manual_seed(seed)
    vq = VQModel(VQArgs(codebook_size=vocab, codebook_embed_dim=4, ch=32, ch_mult=[1], z_channels=32,
                        num_res_blocks=1))
    a = GPTArgs(dim=dim, n_layer=n_layer, n_head=2, vocab_size=vocab, block_size=grid * grid, num_classes=3,
                model_type=model_type, caption_dim=8, cls_token_num=1 if model_type == "c2i" else 3)
    gpt, drafter = GPT(a), Drafter(DrafterArgs.for_target(a))
    for p in list(gpt.parameters()) + list(drafter.parameters()):
        torch.nn.init.normal_(p, std=std)
    return ModelBundle("tiny", vq.eval(), gpt.eval(), drafter=drafter.eval(), dtype=dtype)


def cost_file(d: Path, target=lambda R, T: 10.0 + 0.01 * T, drafter=lambda R, T: 0.05 * R * T ** 0.5,
              width_ms: float = 0.0, overhead_ms: dict | None = None, name: str = "costs.json") -> str:
    """A cost table written as `engine.costs=PATH` takes it (cost.py CostTable): the tree engines decide
    from these numbers and measure nothing, so that no test's steps depend on the host's timings. The
    default: verifying is nearly free (a GPU-like device), drafting cheap, attention width free."""
    import json
    from decoding.engines.cost import ROWS, TOKENS
    table = {"rows": list(ROWS), "tokens": list(TOKENS),
             "target_ms": [[target(R, T) for T in TOKENS] for R in ROWS],
             "drafter_ms": [[drafter(R, T) for T in TOKENS] for R in ROWS],
             "width_ms": [width_ms] * len(ROWS), "overhead_ms": overhead_ms or {}}
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(table))
    return str(d / name)


# the cost table the tree engines in tests decide from unless a test gives its own (cost_file's default)
COSTS = cost_file(Path(tempfile.mkdtemp(prefix="arspec-costs-")))
atexit.register(shutil.rmtree, str(Path(COSTS).parent), True)


class QuietHost:
    """busy.Load on a host where nothing else runs: the suite's xdist workers and a busy machine would make
    every table measured in this process count as timed beside other work, and be measured again
    (cost.py ATTEMPTS); how many times a table is measured is a test's to decide: one that wants a busy
    host sets cost.Load itself."""

    def others(self) -> float:
        return 0.0


@pytest.fixture(autouse=True)
def quiet_host(monkeypatch):
    import decoding.engines.cost as cost
    monkeypatch.setattr(cost, "Load", QuietHost)


def labels(n: int, label: int = 1) -> Conditions:
    return Conditions(torch.full((n,), label, dtype=torch.long), None, [])


@pytest.fixture(scope="session")
def tiny():
    return tiny_bundle()


def write_tiny_weights(d: Path, grid: int = 4, seed: int = 0) -> Path:
    """A random shapes-format bundle (VQ, t2i GPT, word-level text encoder, drafter) that generates an
    8x8 image in milliseconds: the job's plumbing is tested on it, the shipped model end to end."""
    from decoding.checkpoint import save_module
    from decoding.models.text import TextArgs, TextEncoder
    from workflows.training.gpt import shapes_vocab
    torch.manual_seed(seed)
    vq_args = VQArgs(codebook_size=16, codebook_embed_dim=4, ch=32, ch_mult=[1, 2], z_channels=32, num_res_blocks=1)
    text_args = TextArgs(vocab=shapes_vocab(), max_len=6, dim=16, n_layer=1, n_head=2)
    gpt_args = GPTArgs(dim=32, n_layer=1, n_head=2, vocab_size=16, block_size=grid * grid, model_type="t2i",
                       caption_dim=16, cls_token_num=6, abs_pos_embed=True,
                       cond_rope="identity")
    gpt = GPT(gpt_args)
    for p in gpt.parameters():
        torch.nn.init.normal_(p, std=0.3)
    d.mkdir(parents=True, exist_ok=True)
    save_module(VQModel(vq_args), d / "vq.safetensors", dtype=torch.float32)
    save_module(TextEncoder(text_args), d / "text.safetensors", dtype=torch.float32)
    save_module(gpt, d / "gpt.safetensors", dtype=torch.float32)
    save_module(Drafter(DrafterArgs.for_target(gpt_args)), d / "drafter.safetensors", dtype=torch.float32)
    return d


@pytest.fixture(scope="session")
def tiny_weights(tmp_path_factory):
    return write_tiny_weights(tmp_path_factory.mktemp("tiny-weights"))


def pytest_xdist_auto_num_workers(config) -> int:
    """`-n auto`: one worker per core, at most 4 (each holds a torch and the models it loaded)."""
    return max(1, min(4, os.cpu_count() or 1))


def pytest_collection_modifyitems(config, items) -> None:
    """The tests on the shared Ray instance run on one xdist worker, so that the run starts one Ray."""
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.xdist_group("ray"))


@pytest.fixture(scope="session")
def ray_cluster():
    """The one Ray instance of the test run: a 2-node ray.cluster_utils.Cluster on this machine."""
    import ray
    from ray.cluster_utils import Cluster
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    cluster.add_node(num_cpus=2)
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def after_parts(monkeypatch):
    """`after_parts(n, action)`: tests/faults.py's hook in this process (action() right after the driver
    records its n-th part), undone when the test ends."""
    import actors.pool
    from tests import faults

    def arm(n: int, action) -> None:
        monkeypatch.setattr(actors.pool, "record_part", actors.pool.record_part)    # restored at teardown
        faults.after_parts(n, action)
    return arm


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3 server (SeaweedFS, tests/seaweed.py) for the object-store tests, stopped by its PID at the end."""
    from tests.seaweed import Seaweed
    server = Seaweed(tmp_path_factory.mktemp("seaweed"))
    server.start()
    yield server
    server.stop()
