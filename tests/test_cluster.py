"""The job against what a cluster can give (the shared 2-node x 2-CPU test cluster): a request it cannot
meet, fewer actors than asked, a model the actors cannot load."""
from __future__ import annotations

import json
import logging
import shutil
import time

import pytest
from safetensors.torch import load_file, save_file

from tests.test_job import base, images, job
from workflows.config import ConfigError


def test_gpu_request_on_a_cluster_without_gpus_is_one_line_after_wait_s(ray_cluster, tiny_weights, tmp_path):
    t0 = time.time()
    with pytest.raises(ConfigError) as e:
        job(*base(tiny_weights, tmp_path / "run", "cluster=gpu", "cluster.wait_s=1", "data.limit=2"))
    assert time.time() - t0 < 60
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("cluster: 1 actor(s) of {'CPU': 4.0, 'GPU': 1.0} asked (cluster.num_actors=null: one per "
                          "slot, 0 now, at least 1)")
    assert "none placed within cluster.wait_s=1 s; the cluster has 2 node(s) with CPU 4, GPU 0 in all" in msg


def test_fewer_actors_than_asked_run_on_those_placed_and_say_so(ray_cluster, tiny_weights, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="arspec.job")
    s = job(*base(tiny_weights, tmp_path / "run", "data.limit=6", "cluster.batch_size=2", "cluster.num_actors=3",
                  "cluster.num_cpus_per_actor=2", "cluster.wait_s=1"))
    assert (s["images"], s["actors"], s["num_actors"], s["nodes"]) == (6, 2, 3, 2)
    assert "3 actor(s) of {'CPU': 2.0} asked (cluster.num_actors=3), 2 placed within cluster.wait_s=1 s" in caplog.text
    assert "running on 2 actor(s)" in caplog.text
    assert len(images(tmp_path / "run")) == 6


def test_a_model_the_actors_cannot_load_fails_the_job_in_one_line(ray_cluster, tiny_weights, tmp_path):
    """The header is sound (the driver passes it), the tensors do not fit the arguments it names: only an
    actor finds out, and the job stops with that reason instead of writing every prompt as an error."""
    d = tmp_path / "w"
    shutil.copytree(tiny_weights, d)
    sd = load_file(d / "vq.safetensors")
    from safetensors import safe_open
    with safe_open(str(d / "vq.safetensors"), "pt") as f:
        meta = f.metadata()
    sd = {k: v for k, v in sd.items() if "quantize" not in k}       # drop the codebook
    save_file(sd, str(d / "vq.safetensors"), metadata=meta)
    with pytest.raises(ConfigError, match=r"^model: the generator actors could not start: .*(Missing key|quantize)"):
        job(*base(tiny_weights, tmp_path / "run", f"model.weights_dir={d}", "data.limit=2", "cluster.num_actors=1",
                  "cluster.max_actor_restarts=0"))
    assert not (tmp_path / "run" / "images").exists() or not list((tmp_path / "run" / "images").iterdir())
    assert json.loads((tmp_path / "run" / "job.json").read_text())["model"]["weights_dir"] == str(d)
