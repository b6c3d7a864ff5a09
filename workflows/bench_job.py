"""What the job costs on top of the engine: `python -m workflows.bench_job [generate overrides...]`.

Runs the same prompts three ways, each into a fresh out_dir: the engine called directly in this
process (one Generator, no Ray, no Parquet), the job with 1 actor, and the job with 2 actors. Reports
throughput and the per-image overhead of Ray + PNG + Parquet over the direct engine, with the fixed
start-up (Ray start, model load in the actor) shown apart, since it does not grow with the job. The
per-image overhead is taken from the actors' own clocks within each job run (writes + idle gaps between
batches over engine time); the comparison with the direct run is kept, but it also carries whatever the
host did between the two runs.
"""
from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from workflows.config import cli, register, to_object

CONF = Path(__file__).resolve().parents[1] / "conf"
register()


def config(overrides: list[str]):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("generate", overrides=overrides)


def direct(c) -> dict:
    """The engine alone, in process, with the actor's thread count and batches."""
    from actors.generator import Generator
    from decoding.engines.requests import Request
    from decoding.sampling import prompt_seed
    from workflows.prompts import read_prompts
    items = [{**it, "seed": prompt_seed(c.seed, it["prompt_id"])} for it in read_prompts(c.data)]
    t0 = time.perf_counter()
    gen = Generator(c, c.out_dir)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    requests = [Request(gen.bundle.conditions([it["prompt"]]), it["seed"], i) for i, it in enumerate(items)]
    for o in gen.engine.stream(requests, c.cluster.batch_size):   # the actor's continuous batching
        if o.error:
            raise RuntimeError(o.error)
    return {"images": len(items), "seconds": round(time.perf_counter() - t0, 2), "load_seconds": round(load_s, 2)}


def main(argv: list[str]) -> dict:
    from workflows.generate import run
    with tempfile.TemporaryDirectory() as tmp:
        c = to_object(config(argv + [f"out_dir={tmp}/direct"]))
        threads = torch.get_num_threads()
        d = direct(c)
        torch.set_num_threads(threads)
        jobs = {}
        for n in (1, 2):
            jobs[n] = run(config(argv + [f"out_dir={tmp}/actors{n}", f"cluster.num_actors={n}"]))
    one = jobs[1]
    per_image_direct = d["seconds"] / d["images"]
    keys = ("seconds", "images_per_s", "engine_seconds", "write_seconds", "idle_seconds", "ray_start_seconds",
            "actor_start_seconds")
    # the job's steady-state time per image: everything except Ray start and the actor's model load
    steady = (one["seconds"] - one["ray_start_seconds"] - d["load_seconds"]) / one["images"]
    report = {
        "overrides": argv, "images": d["images"],
        "direct_engine_s_per_image": round(per_image_direct, 4),
        "job_1_actor": {k: one[k] for k in keys},
        "job_2_actors": {k: jobs[2][k] for k in keys + ("nodes",)},
        "scaling_2_vs_1": round(jobs[2]["images_per_s"] / one["images_per_s"], 3),
        # what the job adds per image, from the actors' own clocks in one run (immune to host drift):
        # PNG + Parquet writes and the idle gaps between batches, over the engine's time
        "job_overhead_fraction": {n: round((j["write_seconds"] + j["idle_seconds"]) / j["engine_seconds"], 4)
                                  for n, j in jobs.items()},
        # the same against a separate in-process run: also carries the host's run-to-run drift
        "vs_direct_per_image_s": round(steady - per_image_direct, 4),
        "vs_direct_fraction": round((steady - per_image_direct) / per_image_direct, 4),
        "fixed_startup_s": round(one["ray_start_seconds"] + d["load_seconds"], 2),
    }
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    cli(lambda: main(sys.argv[1:]))
