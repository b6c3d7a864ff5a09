"""The job's --help page and its one-line messages, as a user meets them on the command line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from decoding.engines import ENGINES
from decoding.registry import families
from tests.conftest import REPO


def cli(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "workflows.generate", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO, env={**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"})


def test_help_lists_engines_and_models_with_a_line_each_and_hides_the_schema_groups():
    r = cli("--help")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "schema/" not in r.stdout and "Powered by Hydra" not in r.stdout
    for name, engine in ENGINES.items():
        line = next(x for x in lines if x.strip().startswith(f"engine={name} "))
        assert len(line.split(None, 1)[1]) > 20, line          # a description, not a bare name
        assert ("[drafter]" in line) == engine.uses_drafter, line
    for name in families():
        line = next(x for x in lines if x.strip().startswith(f"model={name} "))
        assert len(line.split(None, 1)[1]) > 20, line
    pick = r.stdout[r.stdout.index("Which engine:"):]
    assert "engine=vanilla" in pick and "engine=sjd or engine=mc_sjd" in pick and "engine=eagle2" in pick
    assert "engine=auto" in pick


def one_error_line(r: subprocess.CompletedProcess) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    return lines[0]


def test_an_out_dir_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    line = one_error_line(cli(f"out_dir={tmp_path / 'afile' / 'run'}", f"hydra.run.dir={tmp_path / 'h'}"))
    assert f"out_dir={tmp_path / 'afile' / 'run'}" in line and "is a file" in line


def test_a_broken_jsonl_line_is_named_once_by_its_number(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"prompt": b}\n')
    line = one_error_line(cli("data=file", f"data.path={tmp_path / 'p.jsonl'}", f"out_dir={tmp_path / 'o'}",
                              f"hydra.run.dir={tmp_path / 'h'}"))
    assert line.startswith("error: data.path=") and "line 2 is not valid JSON" in line


def test_a_run_leaves_no_hydra_folder_in_the_working_tree(tmp_path):
    before = set((REPO / "outputs").rglob("*")) if (REPO / "outputs").exists() else set()
    one_error_line(cli("data=file", f"data.path={tmp_path}", f"out_dir={tmp_path / 'o'}"))   # no hydra.run.dir
    after = set((REPO / "outputs").rglob("*")) if (REPO / "outputs").exists() else set()
    assert after == before
    assert list(Path(os.environ["ARSPEC_HYDRA_DIR"]).rglob("generate.log"))


def test_help_explains_and_quotes_no_measurement():
    """Help says what each option is and which to pick; figures (speedups, rates, shares) belong to the
    measurements, which change with the host: none in the page built from the conf comments."""
    import re
    from workflows.help import generate_help
    text = generate_help()
    figures = re.findall(r"\d+(?:\.\d+)?\s*(?:x|×)(?![a-z0-9])|\d+(?:\.\d+)?\s*%|\bimg/s\b|images/s|\bran \d", text)
    assert not figures, figures


def test_the_cpu_bench_hint_says_what_it_does_as_it_goes(caplog):
    """The CPU-sized bench_gpu run (its docstring's and the README's hint, here with one batch size) logs a
    line per engine and batch, the shapes reference included, before the final table (a user saw nothing
    for minutes); on a CPU the LlamaGen-sized default models are warned of, with the CPU-sized command."""
    import logging

    import torch
    from hydra import compose, initialize_config_dir
    from workflows import bench_gpu
    caplog.set_level(logging.INFO, logger="arspec.bench_gpu")
    hint = bench_gpu.CPU_RUN.split()[3:]
    assert hint == ["models=[small]", "images=2", "shapes_prompts=2", "reps=3"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("bench_gpu", overrides=[*hint, "shapes_prompts=1", "batch_sizes=[1]", "device=cpu"])
    report = bench_gpu.run(cfg)
    lines = [r.getMessage() for r in caplog.records if r.name == "arspec.bench_gpu"]
    engines = list(cfg.engines)
    for label, batches in (("shapes model: ", 1), ("small, batch size 1: ", 2)):
        for n in engines:
            said = [x for x in lines if x.startswith(f"[bench_gpu] {label}batch ") and f" {n}: " in x]
            assert len(said) == batches, (label, n, lines)
    assert set(report["results"]["small"][1]["measured"]) == set(engines)
    assert not any("on a CPU" in x for x in lines)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        default = compose("bench_gpu")
    assert bench_gpu.too_big(default, torch.device("cpu")) == ["GPT-L", "GPT-XL"]    # warned of, with CPU_RUN
    assert bench_gpu.too_big(cfg, torch.device("cpu")) == []


@pytest.mark.parametrize("module, args, message", [
    ("workflows.bench", ["batch_sizes=[4,0]"], "batch_sizes=[4, 0]: each must be >= 1"),
    ("workflows.bench_plan", ["sizes=[0]"], "sizes=[0]: give prompt counts >= 1"),
    ("workflows.bench_analyze", ["images=0"], "images=0: must be >= 1"),
    ("workflows.bench_job", ["cluster.bach_size=4"], "cluster.bach_size: ClusterConfig has no setting 'bach_size'"),
])
def test_every_benchmark_cli_refuses_a_bad_setting_in_one_line(module, args, message):
    """Each benchmark command is a CLI too: a bad setting exits 2 with one line, before any work."""
    r = subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=120, cwd=REPO,
                       env={**os.environ, "HYDRA_FULL_ERROR": "0", "OMP_NUM_THREADS": "1"})
    assert message in one_error_line(r)
