"""The job with out_dir and data.path on an object store, against a real S3 server (SeaweedFS, started by
the `s3_server` fixture, tests/seaweed.py; no mock of the S3 API): a whole job and its readers, a driver
killed mid-job, a damaged object, a second job, bad stores, and a store that stops mid-job."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from actors.output import JobExit
from actors.store import at
from tests.conftest import REPO
from workflows.config import ConfigError
from workflows.generate import run

BUCKET = "arspec"
N = 8           # prompts: 4 parts of 2
TINY = ["engine.sampling.cfg_scale=2.0", "cluster.batch_size=2", "cluster.num_actors=1"]
PROMPTS = [{"id": f"p{i}", "prompt": p} for i, p in enumerate(
    ["a red circle", "a blue square", "a green triangle", "a dragon", "a small red square", "a big blue circle",
     "two green circles", "a yellow triangle"])]


@pytest.fixture(scope="module")
def s3(s3_server, tmp_path_factory):
    """The server's AWS environment set for this module, its bucket, and the prompt file on it and on disk."""
    with pytest.MonkeyPatch.context() as mp:
        for k, v in s3_server.env().items():
            mp.setenv(k, v)
        c = s3_server.client()
        c.create_bucket(Bucket=BUCKET)
        body = "".join(json.dumps(p) + "\n" for p in PROMPTS).encode()
        c.put_object(Bucket=BUCKET, Key="prompts/p.jsonl", Body=body)
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
def reference(s3, ray_cluster, tiny_weights, tmp_path_factory):
    """The same prompts generated to a local disk: what every s3 run must equal, byte for byte."""
    out = tmp_path_factory.mktemp("local") / "run"
    job(*args(tiny_weights, out, s3[1]))
    return image_bytes(out)


def cli(*argv, module="workflows.generate", timeout=240):
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, timeout=timeout,
                          cwd=REPO, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


def test_whole_job_on_s3_then_verify_and_readers(s3, ray_cluster, tiny_weights, reference):
    server, _ = s3
    out = f"s3://{BUCKET}/whole"
    s = job(*args(tiny_weights, out))
    assert (s["images"], s["errors"]) == (N, 0)
    keys = server.keys(BUCKET, "whole/")
    parts = sorted(k.split("/")[-1] for k in keys if k.startswith("whole/images/"))
    assert len(parts) == N // 2
    for t in ("images", "tokens", "errors"):
        assert sorted(k.split("/")[-1] for k in keys if k.startswith(f"whole/{t}/")) == parts
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
    images = pads.dataset(f"{BUCKET}/whole/images", filesystem=fs)   # noqa: F841 (DuckDB finds it by name)
    n, tau = duckdb.sql("select count(*), avg(mean_accept_len) from images").fetchall()[0]
    assert n == N and tau >= 1.0
    hf = datasets.Dataset(pads.dataset(f"{BUCKET}/whole/images", filesystem=fs).to_table())
    from PIL import Image
    assert isinstance(hf[0]["image"], Image.Image) and hf[0]["image"].size == (8, 8)
