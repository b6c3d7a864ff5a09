"""The job's plan without Ray: streamed prompts, the committed-part index and its verification, bounded
memory, and validation that reads checkpoint headers only."""
from __future__ import annotations

import json
import shutil
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hydra import compose, initialize_config_dir

from actors.output import ids_digest, part_name, part_span
from tests.conftest import REPO
from workflows.config import ConfigError, DataConfig, to_object
from workflows.plan import CommittedIndex, Plan
from workflows.prompts import PromptSource


def prompts_file(path, n, swap=None):
    rows = [{"id": f"p{i}", "prompt": f"a red circle {i}"} for i in range(n)]
    if swap:
        a, b = swap
        rows[a], rows[b] = rows[b], rows[a]
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=3)
    return path


def committed_name(start, stop):
    return part_name([{"prompt_id": f"p{i}", "position": i} for i in range(start, stop)])


def plan(path, names, batch_size=3, **data):
    src = PromptSource(DataConfig(name="file", path=str(path), id_column="id", **data))
    return Plan(src, CommittedIndex(path.parent, names), batch_size, seed=0)


def test_part_names_carry_positions_and_digest():
    items = [{"prompt_id": "a", "position": 7}, {"prompt_id": "b", "position": 8}]
    assert part_span(part_name(items)) == (7, 9, ids_digest(["a", "b"]))
    assert part_span("part-0123456789abcdef") is None          # a name from before positions


def test_resume_skips_committed_positions_and_batches_never_span_them(tmp_path):
    path = prompts_file(tmp_path / "p.parquet", 11)
    p = plan(path, [committed_name(0, 4), committed_name(6, 8)])
    st = p.check()
    assert (st.prompts, st.already, st.pending, st.batches) == (11, 6, 5, 2)
    batches = list(p.batches())
    assert [[it["position"] for it in b] for b in batches] == [[4, 5], [8, 9, 10]]
    assert [[it["prompt_id"] for it in b] for b in batches] == [["p4", "p5"], ["p8", "p9", "p10"]]
    assert all(isinstance(it["seed"], int) for b in batches for it in b)
    # a larger data.limit later: the same committed parts, the rest planned after them
    assert plan(path, [committed_name(0, 4), committed_name(4, 6)], limit=8).check().pending == 2


def test_a_changed_prompt_file_is_refused_naming_the_part(tmp_path):
    path = prompts_file(tmp_path / "p.parquet", 8, swap=(1, 2))
    with pytest.raises(ConfigError, match=r"part part-0000000000-0000000004-\w+ holds other prompts than positions "
                                          r"0..3 .*the prompt file changed"):
        plan(path, [committed_name(0, 4)]).check()
    with pytest.raises(ConfigError, match="named before parts recorded their positions"):
        plan(path, ["part-0123456789abcdef"]).check()


def test_duplicate_ids_are_found_in_the_planning_pass(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"id": i % 5000, "prompt": "x"}) + "\n" for i in range(5001)))
    with pytest.raises(ConfigError, match=r"1 duplicate ids .*first: '0'"):
        plan(path, []).check()


def test_planning_memory_does_not_grow_with_the_prompt_set(tmp_path):
    """Python allocations while planning and streaming 40k prompts stay a few MB (the chunk in hand),
    where holding them (the list the driver used to build) takes ~20 MB."""
    path = tmp_path / "big.jsonl"
    with open(path, "w") as f:
        for i in range(40_000):
            f.write(json.dumps({"id": f"prompt-{i:08d}", "prompt": f"a red circle above a blue square {i}"}) + "\n")
    p = plan(path, [], batch_size=8)
    tracemalloc.start()
    st = p.check()
    n = sum(len(b) for b in p.batches())
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert st.pending == n == 40_000
    assert peak < 8e6, f"planning held {peak / 1e6:.1f} MB"


def test_chunks_follow_the_file_not_the_whole(tmp_path):
    path = prompts_file(tmp_path / "p.parquet", 20_000)
    chunks = list(PromptSource(DataConfig(name="file", path=str(path))).chunks())
    assert len(chunks) > 1 and sum(map(len, chunks)) == 20_000 and max(map(len, chunks)) <= 8192


# -- validation from checkpoint headers only ------------------------------------------------------------

def validate(tiny_weights, *overrides):
    from workflows.generate import validate as v
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        v(to_object(compose("generate", overrides=[f"model.weights_dir={tiny_weights}", *overrides])))


def test_validation_reads_no_weights(tiny_weights, monkeypatch):
    import decoding.shapes.family as fam

    def no_load(*a, **k):
        raise AssertionError("the driver loaded a model")
    monkeypatch.setattr(fam, "load_module", no_load)
    validate(tiny_weights, "engine=eagle2")


def test_validation_refuses_bad_checkpoints_from_their_headers(tiny_weights, tmp_path):
    d = tmp_path / "w"
    shutil.copytree(tiny_weights, d)
    (d / "drafter.safetensors").unlink()
    with pytest.raises(ConfigError, match="engine 'adt_tree' drafts trees with a drafter, and the model has none"):
        validate(d, "engine=adt_tree")
    with open(d / "gpt.safetensors", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    with pytest.raises(ConfigError, match=r"gpt.safetensors: truncated: its header describes \d+ bytes, the file has"):
        validate(d)
    shutil.copy(d / "vq.safetensors", d / "gpt.safetensors")
    with pytest.raises(ConfigError, match="gpt.safetensors holds a 'vq' model, expected 'gpt'"):
        validate(d)


def test_a_refused_prompt_file_leaves_no_job_json(tmp_path):
    """The planning pass runs before a new out_dir records its settings, so fixing the file or the setting
    and rerunning is not refused as 'a different config'."""
    from workflows.generate import plan_job
    path = tmp_path / "d.csv"
    path.write_text("id,prompt\n1,a\n1,b\n")
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        c = to_object(compose("generate", overrides=["data=file", f"data.path={path}", "data.id_column=id",
                                                     f"out_dir={tmp_path / 'run'}"]))
    with pytest.raises(ConfigError, match="duplicate ids"):
        plan_job(c)
    assert not (tmp_path / "run" / "job.json").exists()
    c.data.id_column = None
    assert plan_job(c).stats.pending == 2 and (tmp_path / "run" / "job.json").exists()
