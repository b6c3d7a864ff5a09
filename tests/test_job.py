"""The batch job on real Ray (a 2-node ray.cluster_utils.Cluster): sharding, resume, faults, bad input."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from workflows.config import ConfigError
from workflows.generate import run

# fp32: there the job's default engine (auto: trees and chains) commits vanilla's tokens, so an image's bytes
# are the same for any sharding, batch or resume; in bf16 (auto on this CPU) a tree engine's bytes depend
# on its batch-mates (README, "Reproducible"), and these tests compare bytes across runs
TINY = ["engine.sampling.cfg_scale=2.0", "model.dtype=float32"]


def job_config(*overrides):
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        return compose("generate", overrides=list(overrides))


def job(*overrides) -> dict:
    return run(job_config(*overrides))


def images(out: Path) -> pd.DataFrame:
    return pq.read_table(out / "images").to_pandas()


def image_bytes(out: Path) -> dict:
    df = images(out)
    return {pid: img["bytes"] for pid, img in zip(df.prompt_id, df.image)}


def base(tiny_weights, out, *extra):
    return [f"model.weights_dir={tiny_weights}", f"out_dir={out}", *TINY, *extra]


def test_two_actors_on_two_nodes_and_identical_bytes_for_any_sharding(ray_cluster, tiny_weights, tmp_path):
    one = job(*base(tiny_weights, tmp_path / "one", "data.limit=12", "cluster.batch_size=1", "cluster.num_actors=1"))
    two = job(*base(tiny_weights, tmp_path / "two", "data.limit=12", "cluster.batch_size=4", "cluster.num_actors=2",
                    "cluster.num_cpus_per_actor=2"))
    assert one["images"] == two["images"] == 12 and two["nodes"] == 2
    assert one["invalid_tokens"] == two["invalid_tokens"] == 0 and images(tmp_path / "two").invalid_tokens.eq(0).all()
    timeline = [two[k] for k in ("actor_start_seconds", "idle_seconds")]  # filled from the actors' clocks
    assert all(isinstance(x, float) and x >= 0 for x in timeline)
    tokens = [pq.read_table(tmp_path / d / "tokens").to_pandas().sort_values(["prompt_id", "token_index"])
              for d in ("one", "two")]
    assert tokens[0].token_id.tolist() == tokens[1].token_id.tolist()
    a, b = image_bytes(tmp_path / "one"), image_bytes(tmp_path / "two")
    assert a == b and len(a) == 12
    tok = pq.read_table(tmp_path / "two" / "tokens").to_pandas()
    assert len(tok) == 12 * 16 and tok.groupby("prompt_id").token_index.nunique().eq(16).all()


def test_rows_in_flight_and_the_part_size_are_two_settings(ray_cluster, tiny_weights, tmp_path):
    """cluster.batch_size is the rows an actor decodes at once, cluster.part_size the prompts a part holds
    (what is committed and resumed): 12 prompts in parts of 6, decoded 2 rows at a time, give 2 parts whose
    images ran in batches of at most 2, and the bytes of any other split."""
    six = job(*base(tiny_weights, tmp_path / "six", "data.limit=12", "cluster.batch_size=2", "cluster.part_size=6",
                    "cluster.num_actors=1"))
    one = job(*base(tiny_weights, tmp_path / "one", "data.limit=12", "cluster.batch_size=4", "cluster.num_actors=1"))
    assert six["images"] == one["images"] == 12 and (six["batch_size"], six["part_size"]) == (2, 6)
    assert len(list((tmp_path / "six" / "images").glob("part-*.parquet"))) == 2
    assert len(list((tmp_path / "one" / "images").glob("part-*.parquet"))) == 3
    assert images(tmp_path / "six").batch_size.max() <= 2
    assert image_bytes(tmp_path / "six") == image_bytes(tmp_path / "one")


@pytest.mark.parametrize("engine", ["mar", "cspd"])
def test_continuous_engines_run_through_the_job(ray_cluster, tmp_path, engine):
    """The continuous half through actors and Parquet, as a user runs it (model=mar, the shipped models)."""
    out = tmp_path / engine
    s = job("model=mar", f"engine={engine}", "engine.num_iter=4", f"out_dir={out}", "data.limit=2", "model.dtype=float32")
    assert s["images"] == 2 and s["errors"] == 0 and s["invalid_tokens"] == 0
    assert len(images(out)) == 2 and not (out / "errors").exists() or pq.read_table(out / "errors").num_rows == 0
    assert images(out).batch_size.tolist() == [2, 2]       # one part of two prompts: decoded together


def test_rerun_resumes_and_writes_every_prompt_once(ray_cluster, tiny_weights, tmp_path):
    out = tmp_path / "run"
    first = job(*base(tiny_weights, out, "data.limit=6", "cluster.batch_size=4"))
    second = job(*base(tiny_weights, out, "data.limit=14", "cluster.batch_size=4"))
    third = job(*base(tiny_weights, out, "data.limit=14", "cluster.batch_size=4"))
    assert (first["images"], second["already_done"], second["images"], third["images"]) == (6, 6, 8, 0)
    assert json.loads((out / "summary.json").read_text()) == second   # the no-op third run kept the figures
    assert first["num_actors"] == 4  # cluster.num_actors=null: one per CPU of the 2 x 2-CPU test cluster
    df = images(out)
    assert len(df) == 14 and df.prompt_id.is_unique
    manifest = [json.loads(x) for x in (out / "manifest.jsonl").read_text().splitlines()]
    assert sorted(pid for e in manifest for pid in e["prompt_ids"]) == sorted(df.prompt_id)


def test_other_engine_on_same_out_dir_is_refused(ray_cluster, tiny_weights, tmp_path):
    out = tmp_path / "run"
    job(*base(tiny_weights, out, "data.limit=2", "engine=vanilla"))
    with pytest.raises(ConfigError, match=r"written by a different config \(engine.*vanilla.*eagle2"):
        job(*base(tiny_weights, out, "data.limit=2", "engine=eagle2"))


def test_a_resume_that_resolves_another_device_or_dtype_is_refused(ray_cluster, tiny_weights, tmp_path):
    """model.dtype=auto resolves per machine (bf16 where the CPU has AMX or on a GPU, else fp32), and the
    bytes follow it: job.json records what the first run's actors resolved, and a rerun that resolves
    otherwise (here: job.json says the job began on a GPU in bf16) stops before any part, in one line."""
    out = tmp_path / "run"
    first = job(*base(tiny_weights, out, "data.limit=2"))
    recorded = json.loads((out / "job.json").read_text())
    assert recorded["resolved"]["device"] == "cpu" and first["resolved"] == recorded["resolved"]
    assert recorded["resolved"]["dtype"] in ("float32", "bfloat16")
    moved = {**recorded, "resolved": {"device": "cuda", "dtype": "bfloat16"}}
    (out / "job.json").write_text(json.dumps(moved))
    with pytest.raises(ConfigError, match=r"written with model.device=cuda model.dtype=bfloat16, and this run "
                                          r"resolves cpu .*: set model.device=cuda model.dtype=bfloat16"):
        job(*base(tiny_weights, out, "data.limit=4"))
    assert len(images(out)) == 2


def test_killed_actor_is_replaced_and_its_batch_retried(ray_cluster, tiny_weights, tmp_path, after_parts):
    from tests.chaos import descendants, raylet_pids
    out = tmp_path / "run"
    killed = []

    def kill():   # an actor of this cluster only: a scan of every ray::Generator killed a user's job beside the tests
        pids = sorted(p for p, c in descendants(raylet_pids(ray_cluster)).items() if "ray::Generator" in c)
        if pids:
            os.kill(pids[0], signal.SIGKILL)
            killed.append(pids[0])
    after_parts(2, kill)
    summary = job(*base(tiny_weights, out, "data.limit=40", "cluster.batch_size=2", "cluster.num_actors=2",
                        "engine=eagle2"))
    assert killed, "no actor was killed"
    df = images(out)
    assert summary["errors"] == 0 and len(df) == 40 and df.prompt_id.is_unique
    assert len({p for p in df.part}) == 20


def test_a_batch_that_keeps_killing_its_actor_becomes_error_rows_and_the_job_goes_on(
        ray_cluster, tiny_weights, tmp_path, monkeypatch):
    """A batch whose every attempt kills the process running it (here: os._exit) is committed as error
    rows naming the actor's death once its attempts are used up; the batch that shared its actor when it
    first died, and every other batch, are generated, and the job ends."""
    from ray import cloudpickle                      # Ray's own copy, which pickles its actor classes

    import actors.pool
    import tests.poison
    cloudpickle.register_pickle_by_value(tests.poison)
    monkeypatch.setattr(actors.pool, "Generator", tests.poison.PoisonedGenerator)
    data = tmp_path / "p.parquet"
    ids = ["a", "b", "poison", "c", "d", "e"]
    pq.write_table(pa.Table.from_pylist([{"id": i, "prompt": "a red circle"} for i in ids]), data)
    try:
        s = job(*base(tiny_weights, tmp_path / "run", "data=file", f"data.path={data}", "data.id_column=id",
                      "cluster.batch_size=2", "cluster.num_actors=2", "cluster.max_actor_restarts=1"))
    finally:
        cloudpickle.unregister_pickle_by_value(tests.poison)
    assert (s["images"], s["errors"]) == (4, 2)
    err = pq.read_table(tmp_path / "run" / "errors").to_pandas().set_index("prompt_id")
    assert set(err.index) == {"poison", "c"} and err.error.str.contains("ActorDiedError|RayActorError").all()
    assert set(images(tmp_path / "run").prompt_id) == {"a", "b", "d", "e"}


def test_a_job_takes_the_same_steps_whatever_its_actors_timing(ray_cluster, tmp_path, monkeypatch):
    """Two runs of one command, the second with its third batch 2 s late (a busy node), decide every
    step alike: the same batches on each actor in the same order, the same batch-mates, so the same token
    log (step kinds, accepted lengths, drafts' probabilities) and rows per image; in bf16, where a step's
    kind and batch-mates move the bytes, that is what makes a run repeat. The shipped model, whose rows
    drift apart (a tiny grid finishes every row within the tree engines' refill wait). Actors taking
    whichever batch came next, two at a time, logged other steps here (README, "Reproducible")."""
    from ray import cloudpickle

    import actors.pool
    import tests.poison
    from tests.conftest import cost_file
    from workflows.prompts import read_prompts
    shapes = read_prompts(job_config("data.limit=12").data)
    ids = [*(f"p{i}" for i in range(4)), "slow", *(f"p{i}" for i in range(5, 12))]   # "slow": the third batch
    data = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": i, "prompt": it["prompt"]} for i, it in zip(ids, shapes)]), data)
    # verifying costs about as much more as on a CPU, so that the budgets' choices follow what they learnt
    costs = cost_file(tmp_path, target=lambda R, T: 10.0 + 0.4 * R * T)
    args = [*TINY, "data=file", f"data.path={data}", "data.id_column=id", "cluster.batch_size=4", "cluster.part_size=2",
            "cluster.num_actors=2", "engine=adt_tree", f"engine.costs={costs}"]
    assert job(*args, f"out_dir={tmp_path / 'quiet'}")["images"] == len(ids)
    cloudpickle.register_pickle_by_value(tests.poison)
    monkeypatch.setattr(actors.pool, "Generator", tests.poison.SlowGenerator)
    try:
        assert job(*args, f"out_dir={tmp_path / 'slow'}")["images"] == len(ids)
    finally:
        cloudpickle.unregister_pickle_by_value(tests.poison)
    runs = {}
    for name in ("quiet", "slow"):
        tokens = pq.read_table(tmp_path / name / "tokens").to_pandas().sort_values(["prompt_id", "step", "token_index"])
        runs[name] = (tokens.reset_index(drop=True), images(tmp_path / name).set_index("prompt_id").sort_index())
    (t1, i1), (t2, i2) = runs["quiet"], runs["slow"]
    pd.testing.assert_frame_equal(t1, t2)
    assert i1.batch_size.tolist() == i2.batch_size.tolist() and i1.target_forwards.tolist() == i2.target_forwards.tolist()
    assert [b["bytes"] for b in i1.image] == [b["bytes"] for b in i2.image]


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "workflows.generate", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "HYDRA_FULL_ERROR": "0"})


def test_a_first_run_on_a_private_ray_is_quiet_and_writes_no_empty_errors_file(tiny_weights, tmp_path):
    """The job's own local Ray (cluster.address=null, RAY_AUTH_MODE unset, as on a fresh machine): Ray's
    "Token authentication is enabled for this Ray cluster" warning, printed on every start while the mode
    was left to Ray, is not there; no prompt failed, so no errors file (there was an empty one per part),
    and the readers and verify take the out_dir as it is."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_AUTH_MODE", "RAY_ADDRESS")}
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "workflows.generate", *base(tiny_weights, out, "data.limit=2"),
                        "engine=vanilla", "cluster.num_actors=1", f"hydra.run.dir={tmp_path / 'h'}"],
                       capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**env, "HYDRA_FULL_ERROR": "0", "RAY_USAGE_STATS_ENABLED": "0"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Started a local Ray instance" in r.stderr
    assert "Token authentication" not in r.stderr, r.stderr[-3000:]
    assert json.loads((out / "summary.json").read_text())["images"] == 2
    assert not list(out.rglob("errors/*.parquet")) and len(pd.read_parquet(out / "errors")) == 0
    assert len(pd.read_parquet(out / "images")) == 2
    from workflows.verify import main as verify
    assert verify([f"out_dir={out}", "verify=full"]) == 0


def test_killed_driver_resumes_with_no_duplicates_and_identical_bytes(ray_cluster, tiny_weights, tmp_path):
    args = [f"model.weights_dir={tiny_weights}", *TINY, "data.limit=30", "cluster.batch_size=2",
            f"cluster.address={ray_cluster.address}", "engine=adt_tree"]
    # SIGKILLed right after its 3rd part is recorded; the actors die with it, their in-flight parts
    # (at most 2 per actor, 4 actors here) written or not
    cut = subprocess.run([sys.executable, "-m", "tests.faults", "3", *args, f"out_dir={tmp_path / 'cut'}"],
                         cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=300)
    assert cut.returncode == -signal.SIGKILL, cut.stderr[-3000:]
    partial = len(list((tmp_path / "cut" / "images").glob("*.parquet")))
    assert 3 <= partial < 15, "the driver was not killed mid-job"
    resumed = job(*args, f"out_dir={tmp_path / 'cut'}")                # the rerun and the reference, in this process
    assert 2 * 3 <= resumed["already_done"] < 30                       # the parts recorded before the kill: not redone
    job(*args, f"out_dir={tmp_path / 'whole'}")
    cut, whole = images(tmp_path / "cut"), images(tmp_path / "whole")
    assert len(cut) == len(whole) == 30 and cut.prompt_id.is_unique
    assert image_bytes(tmp_path / "cut") == image_bytes(tmp_path / "whole")
    tokens = pq.read_table(tmp_path / "cut" / "tokens").to_pandas()
    assert len(tokens) == 30 * 16                       # no orphan or duplicate token rows


def test_failing_prompts_become_error_rows(ray_cluster, tiny_weights, tmp_path):
    data = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": "ok1", "prompt": "a red circle"}, {"id": "empty", "prompt": "   "},
                                         {"id": "null", "prompt": None}, {"id": "ok2", "prompt": "a dragon"}]), data)
    s = job(*base(tiny_weights, tmp_path / "run", "data=file", f"data.path={data}", "data.id_column=id",
                  "cluster.batch_size=4"))
    assert (s["images"], s["errors"]) == (2, 2)
    err = pq.read_table(tmp_path / "run" / "errors").to_pandas().set_index("prompt_id")
    assert set(err.index) == {"empty", "null"} and err.error.str.contains("empty or not text").all()
    assert set(images(tmp_path / "run").prompt_id) == {"ok1", "ok2"}


def test_prompts_that_are_not_text_become_error_rows_with_their_json(ray_cluster, tiny_weights, tmp_path):
    """A JSON-lines file holds any JSON value as a prompt: a number, a list, an object, a boolean. Each
    fails alone as "not text" and its error row holds the value's JSON text; the good prompt is an image
    and the job ends normally. (A list once failed the whole part, four times, and killed the job.)"""
    bad = [5.5, ["a", "b"], {"shape": "circle"}, True]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"id": f"p{i}", "prompt": p}) + "\n" for i, p in enumerate([*bad, "a red circle"])))
    s = job(*base(tiny_weights, tmp_path / "run", "data=file", f"data.path={data}", "data.id_column=id",
                  "cluster.batch_size=4"))
    assert (s["images"], s["errors"]) == (1, 4)
    err = pq.read_table(tmp_path / "run" / "errors").to_pandas().set_index("prompt_id").sort_index()
    assert err.prompt.tolist() == [json.dumps(p) for p in bad] and err.error.str.contains("not text").all()
    assert images(tmp_path / "run").prompt_id.tolist() == ["p4"]


@pytest.mark.parametrize("overrides, message", [
    (["engine=nope"], "engine=nope: no such engine; choose one of adt_tree, auto, cspd, eagle2, mar, mc_sjd, sjd, vanilla"),
    (["engine.name=nope"], "engine.name='nope' is not an engine"),
    (["engine=eagle2", "engine.dmax=4"], "engine.dmax: Eagle2Config has no setting 'dmax'; its settings are"),
    (["engine=eagle2", "engine.d_max=4"], "engine.d_max: Eagle2Config has no setting 'd_max'"),   # adt_tree's key
    (["engine.acceptance=lantern"], "engine.acceptance: AutoConfig has no setting 'acceptance'"),   # the default engine
    (["engine=eagle2", "engine.depth=deep"], "engine.depth='deep': Value 'deep' of type 'str' could not be converted to Integer"),
    (["engine.sampling.top_p=2"], "engine.sampling.top_p=2.0: must be in (0, 1]"),
    (["model.weights=/x"], "model.weights: ShapesConfig has no setting 'weights'"),
    # '+' adds a key Hydra would refuse: refused all the same, never dropped in silence
    (["+engine.chian=4"], "engine.chian: AutoConfig has no setting 'chian'; its settings are costs, name, sampling"),
    (["+engine.sampling.tempreature=2"], "engine.sampling.tempreature: SamplingParams has no setting 'tempreature'; "
                                        "did you mean engine.sampling.temperature?"),
    (["model.weights_dir=/nonexistent"], "model.weights_dir=/nonexistent lacks"),
    ([f"engine.costs={REPO / 'README.md'}"], "README.md: not a cost table"),     # before any actor starts
    (["data=file", "data.path=/nonexistent.csv"], "data.path=/nonexistent.csv: no such file"),
    (["data=file", f"data.path={REPO / 'pyproject.toml'}"], "unknown format '.toml'"),
    (["cluster.batch_size=0"], "cluster.batch_size=0: must be >= 1"),
    (["cluster.torch_threads=0"], "cluster.torch_threads=0: must be >= 1"),
    (["model.dtype=float8"], "model.dtype='float8': choose one of auto, float32, bfloat16, float16"),
    *([(["model.device=cuda"], "model.device=cuda: this machine has no GPU torch can use")]
      if not torch.cuda.is_available() else []),                       # (where the private Ray's actors run)
    (["engine=adt_tree", "engine.d_max=1"], "d_min <= depth <= d_max"),
])
def test_config_errors_fail_at_once_with_one_line(tmp_path, tiny_weights, overrides, message):
    r = _cli(f"model.weights_dir={tiny_weights}", *overrides, f"out_dir={tmp_path / 'run'}", timeout=120)
    assert r.returncode != 0
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert message in lines[0] and lines[0].startswith("error: "), r.stderr
    assert len(lines) == 1 and r.returncode == 2, r.stderr
    assert not (tmp_path / "run" / "images").exists()


@pytest.mark.parametrize("engine", ["mar", "cspd"])
def test_more_continuous_steps_than_tokens_fail_at_once_with_one_line(tmp_path, engine):
    """The shipped continuous model's 256 tokens, read from its header in the driver: before any actor
    starts, not in each of them after a model load."""
    r = _cli("model=mar", f"engine={engine}", "engine.num_iter=100000", f"out_dir={tmp_path / 'run'}", timeout=120)
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert lines == ["error: engine.num_iter=100000: more AR steps than the model's 256 tokens; set engine.num_iter "
                     "to at most 256"] and r.returncode == 2, r.stderr
    assert not (tmp_path / "run" / "images").exists()


def test_images_table_opens_in_pandas_duckdb_and_datasets(ray_cluster, tiny_weights, tmp_path):
    import datasets
    import duckdb
    from PIL import Image
    out = tmp_path / "run"
    job(*base(tiny_weights, out, "data.limit=3", "engine=eagle2"))
    df = images(out)
    assert {"prompt_id", "prompt", "seed", "engine", "model", "image", "width", "height", "num_tokens",
            "target_forwards", "draft_forwards", "mean_accept_len", "wall_s", "batch_size"} <= set(df.columns)
    n, tau = duckdb.sql(f"select count(*), avg(mean_accept_len) from '{out}/images/*.parquet'").fetchall()[0]
    assert n == 3 and tau >= 1.0
    ds = datasets.load_dataset("parquet", data_files=str(out / "images" / "*.parquet"), split="train")
    assert isinstance(ds[0]["image"], Image.Image) and ds[0]["image"].size == (8, 8)
    tok = duckdb.sql(f"select sum(accepted::int), count(*) from '{out}/tokens/*.parquet'").fetchall()[0]
    assert tok[1] == 3 * 16
