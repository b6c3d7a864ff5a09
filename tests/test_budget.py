"""Batch- and hardware-aware speculation: the budget rule on known cost curves, engines whose steps
switch between plain and speculative (the drafter then catches up on a backlog), and continuous
batching (a slot takes the next prompt as soon as its image is done) without changing any image."""
from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.bundle import Conditions
from decoding.engines import build_engine, engine_config
from decoding.engines.requests import Request
from decoding.engines.budget import CONFIDENT, FLOOR_EVERY, MARGIN, PROBE_MAX, PROBE_MIN, PROBE_SHARE, Budget, bucket
from decoding.engines import proposers
from decoding.engines.cost import CostTable, measure
from tests.conftest import COSTS, cost_file, labels, tiny_bundle

ROWS, TOKENS = [2, 4, 8, 16, 32], [1, 2, 4, 8, 16, 32]


def table(target, drafter=lambda R, T: 0.05 * R * T ** 0.5) -> CostTable:
    return CostTable(ROWS, TOKENS, [[target(R, T) for T in TOKENS] for R in ROWS],
                     [[drafter(R, T) for T in TOKENS] for R in ROWS])


def test_cost_table_interpolates_and_extrapolates():
    c = table(lambda R, T: R + 10 * T)
    assert c.target(4, 1) == pytest.approx(14) and c.target(6, 3) == pytest.approx(36)
    assert c.target(64, 64) == pytest.approx(64 + 640)                 # linear past the grid
    q = table(lambda R, T: R + T * T)                                # past the grid: the last segment's slope
    assert q.target(8, 64) == pytest.approx(8 + 32 * 32 + (64 - 32) * (32 * 32 - 16 * 16) / (32 - 16))


def test_a_measured_cost_that_falls_with_more_tokens_is_pooled_away():
    """cost.nondecreasing: a forward over more tokens never costs less, so a dip (another process ran
    during the shorter call) is pooled with its neighbours, least squares; a rising line is kept."""
    from decoding.engines.cost import nondecreasing
    assert nondecreasing([1.0, 3.0, 2.0, 4.0]) == pytest.approx([1.0, 2.5, 2.5, 4.0])
    assert nondecreasing([5.0, 1.0, 1.0, 1.0]) == pytest.approx([2.0] * 4)
    assert nondecreasing([1.0, 2.0, 2.0, 7.0]) == [1.0, 2.0, 2.0, 7.0]


def test_speculate_where_verifying_is_cheap_and_not_where_it_is_compute_bound():
    """A GPU-like device (a forward costs about the same for 1 or 16 tokens) speculates deeply; a device
    where cost grows with every token per row (a CPU at large batch) takes plain steps."""
    flat = Budget(table(lambda R, T: 10.0 + 0.01 * R * T), max_nodes=16, width=4)
    steep = Budget(table(lambda R, T: 1.0 * R * T), max_nodes=16, width=4)
    assert flat.model_plan(R=2, pending=1) >= 8
    assert steep.model_plan(R=32, pending=1) == 0
    # batch size decides on one device: a forward of 1 token costs as much as 4 up to 4 rows, then grows
    knee = Budget(table(lambda R, T: 5.0 + 0.5 * max(R * T - 8, 0)), max_nodes=16, width=4)
    assert knee.model_plan(R=2, pending=1) > 0 and knee.model_plan(R=32, pending=1) == 0


def test_choose_takes_what_the_drafts_are_worth():
    b = Budget(table(lambda R, T: 10.0 + 0.5 * T), max_nodes=8, width=4)
    sure = torch.tensor([[1.0, 0.99, 0.98, 0.97, 0.96, 0.95, 0.94, 0.93]])
    hopeless = torch.tensor([[0.01] * 8])
    assert b.choose(2, sure, 8, drafted_ms=1.0) == 8
    assert b.choose(2, hopeless, 8, drafted_ms=1.0) == 0


def test_budget_learns_acceptance_and_reads_overheads_from_the_table():
    b = Budget(table(lambda R, T: 10.0), max_nodes=4, width=2)
    assert b.model_plan(2, 1) == 4                                 # the prior: every node pays
    for _ in range(50):
        b.observe(2, 2, step_ms=15.0, tokens_per_row=2.0, accepted_by_rank=np.array([1.0, 0.0]),
                  predicted=2.0, accepted=1.0)
    assert b.value[0] > 0.95 and b.value[1] < 0.05 and b.value[3] <= b.value[1]
    assert b.calibration == pytest.approx(0.5, rel=0.02)
    assert b.model_plan(2, 1) == 1                                 # what the model plans follows what was learnt
    cold = Budget(table(lambda R, T: 10.0), max_nodes=4, width=2)
    assert cold.model_plan(2, 1) == 4
    for _ in range(50):
        cold.observe(2, 4, step_ms=10.0, accepted_by_rank=np.zeros(4))
    assert cold.model_plan(2, 1) == 0


def test_the_overhead_of_a_step_comes_from_the_table_per_batch_shape_and_kind():
    """The work outside the forwards grows with the rows (at batch 8 on a CPU 9-11 ms of a 30 ms
    speculative step, at batch 1 1-4 ms): the table's overhead at R = 16 makes speculation lose there
    without touching R = 2; a plain step's own overhead makes it dearer, and speculation pay again; a
    chain budget reads the chain's."""
    base = table(lambda R, T: 2.0 * R + 0.5 * R * T)
    assert Budget(base, max_nodes=4, width=2).model_plan(R=16, pending=1) > 0     # forwards alone: it pays
    spec = dataclasses.replace(base, overhead_ms={"spec": [0.0, 0.0, 0.0, 60.0, 60.0]})
    b = Budget(spec, max_nodes=4, width=2)
    assert b.model_plan(R=16, pending=1) == 0 and b.model_plan(R=2, pending=1) > 0
    both = dataclasses.replace(base, overhead_ms={"spec": [0.0, 0.0, 0.0, 60.0, 60.0],
                                                  "plain": [0.0, 0.0, 0.0, 200.0, 200.0]})
    assert Budget(both, max_nodes=4, width=2).model_plan(R=16, pending=1) > 0
    chain = dataclasses.replace(base, overhead_ms={"chain": [0.0, 0.0, 0.0, 1e4, 1e4]})
    assert Budget(chain, 0, 1, chain=4).model_plan(R=16, pending=1) == 0
    assert Budget(chain, max_nodes=4, width=2).model_plan(R=16, pending=1) > 0


def test_cost_table_is_measured_for_the_bundle():
    c = measure(tiny_bundle(vocab=8, grid=4), rows=(2, 4), tokens=(1, 4), reps=1)
    assert np.array(c.target_ms).shape == (2, 2) and min(min(r) for r in c.target_ms) > 0
    assert len(c.width_ms) == 2 and min(c.width_ms) >= 0 and c.width(64) >= 0     # never a negative cost


def test_a_forward_timed_cheaper_with_more_tokens_is_pooled(monkeypatch):
    """Timings that fall with the tokens (another process ran during the short calls) reach the table
    pooled non-decreasing (cost.nondecreasing), for the target and the drafter."""
    import decoding.engines.cost as cost
    times = iter([5.0, 1.0, 3.0] * 100)
    monkeypatch.setattr(cost, "_least_ms", lambda call, dev, reps: next(times))
    c = measure(tiny_bundle(vocab=8, grid=4), rows=(2,), tokens=(1, 2, 4), reps=1)
    assert c.target_ms == [[3.0, 3.0, 3.0]] and c.drafter_ms == [[3.0, 3.0, 3.0]]


def test_a_cost_table_keeps_the_lesser_of_two_timed_passes_cell_by_cell(monkeypatch):
    """A burst of other work (a job's start) can cover every repeat of a cell in one pass: each cell is
    the lesser of two passes over the grid, timed after an untimed one."""
    import decoding.engines.cost as cost
    passes = [[5.0, 6.0, 7.0], [5.0, 6.0, 7.0], [1.0, 1.0],          # target, drafter, width (prefix lo, hi)
              [4.0, 9.0, 9.0], [6.0, 6.0, 6.5], [1.0, 2.0]]
    times = iter([t for p in passes for t in p])
    monkeypatch.setattr(cost, "_least_ms", lambda call, dev, reps: next(times))
    c = measure(tiny_bundle(vocab=8, grid=4), rows=(2,), tokens=(1, 2, 4), reps=1)
    assert c.target_ms == [[4.0, 6.0, 7.0]] and c.drafter_ms == [[5.0, 6.0, 6.5]]
    assert next(times, None) is None                                  # two timed passes, no more


def test_cost_table_measures_only_the_rows_asked_and_caches_them(tmp_path, monkeypatch):
    """An engine asks for its own row count when a batch starts: only rows the cache lacks are measured,
    and the cache keeps every row measured so far; one measured row scales in proportion to R."""
    import decoding.engines.cost as cost
    asked, real = [], cost.measure
    monkeypatch.setattr(cost, "measure", lambda b, rows: asked.append(list(rows)) or real(b, rows=rows, reps=1))
    b = tiny_bundle(vocab=8, grid=4)
    assert cost.cost_table(b, rows=(), cache_dir=str(tmp_path)).rows == [] and asked == []
    one = cost.cost_table(b, rows=(4,), cache_dir=str(tmp_path))
    assert one.rows == [4] and one.target(8, 2) == pytest.approx(2 * one.target(4, 2))
    both = cost.cost_table(b, rows=(8,), cache_dir=str(tmp_path))
    assert both.rows == [4, 8] and both.target_ms[0] == one.target_ms[0]
    assert cost.cost_table(b, rows=(4, 8), cache_dir=str(tmp_path)).rows == [4, 8]
    assert asked == [[4], [8]]
    path = next((tmp_path / "costs").glob("*.json"))              # a table from before width_ms: measured again
    old = {k: v for k, v in json.loads(path.read_text()).items() if k != "width_ms"}
    path.write_text(json.dumps(old))
    assert len(cost.cost_table(b, rows=(4,), cache_dir=str(tmp_path)).width_ms) == 1 and asked[-1] == [4]

def test_engines_that_start_together_measure_a_row_count_once(tmp_path, monkeypatch):
    """Actors of one machine start together: one measures, the others wait and read its rows, so every
    engine on the device decides from the same table (and no measurement runs beside another)."""
    import threading
    import decoding.engines.cost as cost
    asked, real = [], cost.measure
    monkeypatch.setattr(cost, "measure", lambda b, rows: asked.append(list(rows)) or real(b, rows=rows, reps=1))
    b = tiny_bundle(vocab=8, grid=4)
    got = []
    threads = [threading.Thread(target=lambda: got.append(cost.cost_table(b, rows=(4,), cache_dir=str(tmp_path))))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert asked == [[4]] and len(got) == 3 and all(t == got[0] for t in got)




@pytest.mark.parametrize("extra, says", [
    ({"overhead_ms": [1.0, 2.0]}, "not a cost table"),
    ({"overhead_ms": {"spec": "abcde"}}, "overhead_ms.spec must be"),
    ({"overhead_ms": {"chain": [float("nan")] * 5}}, "overhead_ms.chain must be"),
    ({"width_ms": [0.1]}, "width_ms must be"),
    ({"width_ms": [-0.1] * 5}, "width_ms must be"),
    ({"busy": 3}, "busy must be"),
    ({"busy": ["x"] * 5}, "busy must be"),
    ({"rows": [[2], [4], [8], [16], [32]]}, "rows must hold"),
])
def test_a_given_table_with_a_bad_optional_field_is_refused_in_one_line(tmp_path, extra, says):
    """engine.costs=PATH written by hand: the per-row fields besides the grid (overheads, attention width,
    the load it was measured under) are checked where the table is read, before any actor starts, not
    met later as a traceback in a step or the bench's summary."""
    path = tmp_path / "t.json"
    path.write_text(json.dumps({**json.loads(Path(COSTS).read_text()), **extra}))
    with pytest.raises(ValueError, match=rf"^engine.costs=.*t.json: {says}") as e:
        engine_config("adt_tree", costs=str(path))
    assert "\n" not in str(e.value)

class Loads:
    """cost.Load reporting the given cores of other work, one measurement after another."""

    def __init__(self, *others):
        self.left = list(others)

    def __call__(self):
        return self

    def others(self) -> float:
        return self.left.pop(0) if len(self.left) > 1 else self.left[0]


def test_a_table_timed_beside_other_work_is_measured_again_and_keeps_each_cells_least(tmp_path, monkeypatch, caplog):
    """Other processes that use the host's CPU while a table is measured make its larger forwards look
    dearer, and a table is kept for good: it is measured again (up to ATTEMPTS times, until the host was
    quiet), and each cell, overhead and the load seen are the least of the attempts. Where the host
    stays busy, the table is kept with a warning that names the file to delete."""
    import logging
    import decoding.engines.cost as cost
    b = tiny_bundle(vocab=8, grid=4)
    grids = iter([[[5.0, 9.0]], [[6.0, 7.0]], [[8.0, 8.0]], [[4.0, 9.5]], [[7.0, 9.0]]])
    overheads = iter([3.0, 1.0, 2.0, 0.5, 4.0])
    asked = []

    def measure(bundle, rows):
        asked.append(list(rows))
        g = next(grids)
        return cost.CostTable(list(rows), list(cost.TOKENS[:2]), g, g, width_ms=[0.1])

    monkeypatch.setattr(cost, "TOKENS", cost.TOKENS[:2])
    monkeypatch.setattr(cost, "measure", measure)
    monkeypatch.setattr(cost, "Load", Loads(0.9, 0.1))
    t = cost.cost_table(b, rows=(4,), cache_dir=str(tmp_path / "a"), calibrate=lambda R, f: {"plain": next(overheads)})
    assert asked == [[4], [4]] and t.target_ms == [[5.0, 7.0]] and t.overhead_ms == {"plain": [1.0]}
    assert t.busy == [0.1]
    assert cost.cost_table(b, rows=(4,), cache_dir=str(tmp_path / "a")) == t and len(asked) == 2   # kept

    monkeypatch.setattr(cost, "Load", Loads(1.5))                      # busy through every attempt
    with caplog.at_level(logging.WARNING, logger="arspec.cost"):
        t = cost.cost_table(b, rows=(8,), cache_dir=str(tmp_path / "b"), calibrate=lambda R, f: {"plain": next(overheads)})
    assert len(asked) == 2 + cost.ATTEMPTS == 5 and t.rows == [8] and t.busy == [1.5]
    assert t.target_ms == [[4.0, 8.0]] and t.overhead_ms == {"plain": [0.5]}
    assert "1.50 cores" in caplog.text and str(tmp_path / "b") in caplog.text


def test_the_host_load_counts_other_processes_cpu():
    """busy.Load, for real: a CPU-bound process beside this one shows as about a core of other work."""
    import subprocess
    import sys
    import time
    from decoding.engines.busy import Load, cpu_seconds
    if cpu_seconds() is None:
        pytest.skip("no /proc on this host: its load counts as none")
    hog = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)                                                # (the interpreter's start)
        load = Load()
        time.sleep(1.5)
        assert load.others() > 0.5
    finally:
        hog.kill()
        hog.wait()

SAMPLING = dict(cfg_scale=2.0, temperature=0.8, top_k=5, top_p=0.9)
# costs: the tests' cost table (tests/conftest.py): no step depends on the host's timings
TREES = {"eagle2": dict(total_tokens=8, depth=3, width=3, chain=0, costs=COSTS),
         "adt_tree": dict(total_tokens=8, depth=2, width=2, d_min=1, d_max=4, w_min=1, w_max=3, chain=0, costs=COSTS)}


def test_a_stream_that_meets_a_new_row_count_measures_it_and_keeps_its_rows(tmp_path, monkeypatch):
    """Without a given table an engine measures once, when its first batch starts, the row counts of that
    batch and of every batch it may regroup into (halving): the forwards and each step kind's overhead
    (calibrate.py runs real steps on a throwaway batch); nothing is measured mid-stream, beside other
    work. A stream that regroups into fewer rows does so mid-stream, and the live rows' K/V must survive
    it: tokens stay vanilla's, and the table holds the overheads of plain, tree and chain steps."""
    import decoding.engines.cost as cost
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    asked, real = [], cost.measure
    monkeypatch.setattr(cost, "measure", lambda b, rows: asked.append(sorted(rows)) or real(b, rows=rows, reps=1))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(6), range(6))
    engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, **{**TREES["adt_tree"], "chain": 4,
                                                                              "costs": ""}))
    outs = list(engine.stream([Request(c, i, i) for i, c in enumerate(labels(6).split())], slots=8))
    assert sorted(o.key for o in outs) == list(range(6)) and not any(o.error for o in outs)
    assert {o.key: o.result.tokens.tolist() for o in outs} == {i: r.tokens.tolist() for i, r in enumerate(ref)}
    table = engine.costs
    assert asked == [[2, 4, 8, 16]] and table.rows == [2, 4, 8, 16], asked   # 8 slots with CFG, and halves
    assert sorted(table.overhead_ms) == ["chain", "plain", "spec"]
    assert all(len(line) == len(table.rows) and min(line) >= 0 for line in table.overhead_ms.values())


def test_a_given_cost_table_is_all_an_engine_decides_from(tmp_path, monkeypatch):
    """engine.costs=PATH: the engine measures nothing and prices every step from the file, so two
    engines (bf16 here, where a step's kind changes the bytes) given the same table take the same
    steps and give the same bytes even when every clock they could read returns noise."""
    import random
    import time as time_module
    import decoding.engines.cost as cost
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path / "cache"))
    asked = []
    monkeypatch.setattr(cost, "measure", lambda *a, **k: asked.append(a))
    path = cost_file(tmp_path, target=lambda R, T: 10.0 + 0.5 * R * T, overhead_ms={"spec": [2.0] * 5})
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3, dtype="bfloat16")
    kw = {**TREES["adt_tree"], "chain": 4, "costs": path}

    def run_once():
        engine = build_engine(bundle, engine_config("adt_tree", sampling=SAMPLING, **kw))
        outs = list(engine.stream([Request(c, i, i) for i, c in enumerate(labels(6).split())], slots=4))
        return {o.key: (o.result.tokens.tolist(), {k: o.result.records[k].tolist()
                                                    for k in ("step", "tree_depth", "tree_width", "accept_len")})
                for o in outs}
    first = run_once()
    noise = random.Random(0)
    for name in ("perf_counter", "thread_time", "monotonic", "time", "process_time"):
        monkeypatch.setattr(time_module, name, lambda: noise.uniform(0, 1e6))
    assert run_once() == first and not asked
    depth = np.array([d for _, rec in first.values() for d in rec["tree_depth"]])
    assert (depth == 0).any() and (depth > 0).any()                  # plain and speculative steps both ran
    with pytest.raises(ValueError, match=r"^engine.costs=.*nowhere.json: no such file"):
        build_engine(bundle, engine_config("adt_tree", costs=str(tmp_path / "nowhere.json")))
    (tmp_path / "bad.json").write_text('{"rows": [2]}')
    with pytest.raises(ValueError, match=r"^engine.costs=.*bad.json: not a cost table"):
        engine_config("adt_tree", costs=str(tmp_path / "bad.json"))       # validate: the driver, before actors
    nan = cost_file(tmp_path, target=lambda R, T: float("nan") if T == 8 else 1.0, name="nan.json")
    with pytest.raises(ValueError, match=r"^engine.costs=.*nan.json: target_ms must hold finite numbers"):
        engine_config("auto", costs=nan)
    table = json.loads(Path(COSTS).read_text())
    (tmp_path / "rows.json").write_text(json.dumps({**table, "rows": table["rows"][::-1]}))
    with pytest.raises(ValueError, match=r"^engine.costs=.*rows.json: rows and tokens must be increasing"):
        engine_config("adt_tree", costs=str(tmp_path / "rows.json"))


def alternate(engine, pattern):
    """Make the engine's budget plan follow `pattern` (0 = plain step), cycling."""
    calls = iter(range(10**9))
    engine.budget.plan = lambda R, pending, confidence=None: pattern[next(calls) % len(pattern)]


@pytest.mark.parametrize("name", list(TREES))
def test_plain_and_speculative_steps_mixed_commit_vanillas_tokens(name):
    """Runs of plain steps leave the drafter behind; the next speculative step catches it up on the
    backlog in one forward. The tokens stay vanilla's and drafts are still accepted after a backlog."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(24), range(24))
    engine = build_engine(bundle, engine_config(name, sampling=SAMPLING, budget="fixed", **TREES[name]))
    alternate(engine, [0, 0, 0, 6, 0, 8, 8])
    out = engine.generate(labels(24), range(24))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    budgets = np.concatenate([r.records["budget"] for r in out])
    accepted = np.concatenate([r.records["accepted"] for r in out])
    assert (budgets == 0).any() and (budgets > 0).any() and accepted.sum() > 20


def test_continuous_batching_gives_every_prompt_its_own_image():
    """12 prompts through 5 slots (refilled as images finish, in whatever order), or through 16 slots of
    which 4 stay empty, give the same tokens as a fixed batch, and every prompt comes back once."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    for name, kw in [("vanilla", {}), ("eagle2", dict(TREES["eagle2"], budget="fixed"))]:
        engine = build_engine(bundle, engine_config(name, sampling=SAMPLING, **kw))
        alone = engine.generate(labels(12), list(range(50, 62)))
        conds = labels(12).split()
        for slots in (5, 16):                                    # 16: four rows never get a prompt
            outs = list(engine.stream((Request(c, 50 + i, key=i) for i, c in enumerate(conds)), slots=slots))
            assert sorted(o.key for o in outs) == list(range(12)) and not any(o.error for o in outs), outs
            got = {o.key: o.result.tokens.tolist() for o in outs}
            assert [got[i] for i in range(12)] == [r.tokens.tolist() for r in alone]
            assert all(o.result.wall_s > 0 for o in outs)


def test_a_reused_row_logs_nothing_of_the_image_before():
    """A row that takes the next prompt starts an empty token log: a plain step writes only some columns
    (no draft, no acceptance, no tree), and what the row's last image left there must not show. Checked
    per step: its tokens accept all but the last, share the step's budget, and a plain step (budget 0)
    accepts none and drafted nothing."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, **dict(TREES["eagle2"], budget="fixed")))
    alternate(engine, [0, 0, 8])                                   # 8: the tree's total_tokens
    outs = list(engine.stream((Request(c, 70 + i, key=i) for i, c in enumerate(labels(12).split())), slots=3))
    blocks = 0
    for o in outs:
        r = o.result.records
        for s in np.unique(r["step"]):
            at = r["step"] == s
            assert r["accepted"][at].sum() == r["accept_len"][at][0] - 1 == at.sum() - 1, (o.key, s)
            assert len(set(r["budget"][at])) == 1 and len(set(r["tree_depth"][at])) == 1, (o.key, s)
            if r["budget"][at][0] == 0:
                assert not r["accepted"][at].any() and np.isnan(r["q_draft"][at]).all(), (o.key, s)
            blocks += 1
    assert not any(o.error for o in outs) and blocks > 12 * 8
    budgets = {int(b) for o in outs for b in o.result.records["budget"]}
    assert {0, 8} <= budgets <= set(range(9))                        # (fewer nodes near an image's end)


@pytest.mark.parametrize("name", ["vanilla", "eagle2", "adt_tree"])
def test_a_row_that_is_done_does_not_widen_attention(name):
    """Attention reads every row up to the largest slot a forward writes (base.visible). A row whose image
    is done, or a slot left empty, rides along in its batch's forwards parked on its first slots
    (base.parked): no target or drafter forward reads further than the rows still decoding need, and
    the images do not change (the continuous-batching test above). Rows ride parked while requests
    wait or the batch waits to restart together; here the stream's end would regroup them away
    (base.SlotEngine.stream), so the regroup is switched off."""
    bundle = tiny_bundle(vocab=8, grid=6, seed=1, std=0.3)
    kw = {} if name == "vanilla" else dict(TREES[name], budget="fixed")
    engine = build_engine(bundle, engine_config(name, sampling=SAMPLING, **kw))
    engine.refill, engine.regroups = 0, False
    L, N = engine.L, engine.N
    reach = 1 if name == "vanilla" else kw["total_tokens"] + 1 + 3 * 3      # block, or drafter scratch
    seen, step = {"limit": None, "checked": 0, "parked": 0}, engine.step

    def spy_step(st):
        live = st.log.n[st.log.n < N]
        seen["limit"] = L + int(live.max()) + reach
        seen["parked"] += int(len(live) < len(st.log.n))
        step(st)
    engine.step = spy_step

    def spy(forward, at):                                                  # at: the mask's argument
        def wrapped(*args, **kw):
            mask = args[at] if len(args) > at else kw["mask"]
            if seen["limit"] is not None:
                assert mask.shape[-1] <= seen["limit"], (mask.shape, seen["limit"])
                seen["checked"] += 1
            return forward(*args, **kw)
        return wrapped
    engine.gpt.forward_embeds = spy(engine.gpt.forward_embeds, 2)     # (h, pos, mask, ...)
    if engine.uses_drafter:
        engine.drafter.forward = spy(engine.drafter.forward, 3)       # (emb, feat, pos, mask, ...)
    outs = list(engine.stream((Request(c, i, key=i) for i, c in enumerate(labels(3).split())), slots=2))
    assert len(outs) == 3 and not any(o.error for o in outs)
    assert seen["parked"] > 10 and seen["checked"] > 30                     # steps with a done row were checked


def test_rows_that_drifted_a_little_restart_together_and_images_do_not_change():
    """Speculation moves rows apart. A free row whose batch-mates finish within refill_wait tokens waits
    for them, so the next prompts start in step (attention reads every row up to the longest one); with
    refill 0 rows refill one by one. Either way every prompt gets vanilla's image."""
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    conds = labels(12).split()
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(12), list(range(12)))
    groups = {}
    for wait in (0, 16):
        engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, budget="fixed", **TREES["eagle2"]))
        engine.refill = wait
        alternate(engine, [0, 3, 0, 0, 2])
        admit, sizes = engine.admit, []
        engine.admit = lambda st, rows, *a, _a=admit, _s=sizes: _s.append(len(rows)) or _a(st, rows, *a)
        outs = list(engine.stream((Request(c, i, key=i) for i, c in enumerate(conds)), slots=4))
        assert {o.key: o.result.tokens.tolist() for o in outs} == {i: r.tokens.tolist() for i, r in enumerate(ref)}
        groups[wait] = sizes
    assert groups[16] == [4, 4, 4]                     # 16 tokens per image: rows always within 16 of each other
    assert len(groups[0]) > 3 and min(groups[0]) < 4   # at once: rows refill apart


def test_a_failing_prompt_does_not_stop_the_stream():
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, budget="fixed", **TREES["eagle2"]))
    good = labels(3).split()
    bad = Conditions(torch.tensor([99]), None, [0])              # no such class: the embedding lookup fails
    outs = {o.key: o for o in engine.stream([Request(good[0], 1, 0), Request(bad, 2, 1), Request(good[1], 3, 2),
                                             Request(good[2], 4, 3)], slots=2)}
    assert outs[1].error and "IndexError" in outs[1].error
    assert all(outs[k].result is not None for k in (0, 2, 3))


def drafts_accepted_per_step(out) -> float:
    """Drafts accepted per speculative step over a batch's results (each step's tokens share one step)."""
    rec = {k: np.concatenate([r.records[k] for r in out]) for k in ("budget", "accepted", "accept_len")}
    spec = rec["budget"] > 0
    return float(rec["accepted"][spec].sum() / (1.0 / rec["accept_len"][spec]).sum())


def test_drafts_after_plain_steps_are_as_good_as_after_speculative_ones():
    """The catch-up must give the drafter exactly the features it missed: with the shipped model's
    trained drafter, speculative steps that follow two plain steps accept as many drafts per step as
    steps that follow speculative ones. (Tokens cannot show a drafter bug: they are the target's.)"""
    from decoding.registry import load_bundle
    from decoding.shapes.family import ShapesConfig
    from decoding.shapes.world import builtin_prompts
    bundle = load_bundle(ShapesConfig(device="cpu", dtype="float32"))
    prompts = [p["prompt"] for p in builtin_prompts(4, seed=3)]
    per_step = {}
    for pattern in ([12], [0, 0, 12]):
        engine = build_engine(bundle, engine_config("eagle2", budget="fixed", total_tokens=12, depth=4, width=3))
        alternate(engine, pattern)
        out = engine.generate(bundle.conditions(prompts), [11, 12, 13, 14])
        per_step[tuple(pattern)] = drafts_accepted_per_step(out)
    assert per_step[(12,)] > 1.5                                   # the trained drafter is right often
    assert per_step[(0, 0, 12)] > 0.9 * per_step[(12,)], per_step


def test_after_a_long_plain_stretch_the_drafter_catches_up_on_the_recent_pairs_only(monkeypatch):
    """A return to speculation after 60 plain steps feeds the drafter at most CATCH_UP_MAX pairs (the
    older ones stay masked), not the whole backlog; its drafts are still accepted about as often as after
    a short stretch, and the tokens are vanilla's."""
    from decoding.engines.proposers import CATCH_UP_MAX
    from decoding.registry import load_bundle
    from decoding.shapes.family import ShapesConfig
    from decoding.shapes.world import builtin_prompts
    bundle = load_bundle(ShapesConfig(device="cpu", dtype="float32"))
    cond = bundle.conditions([p["prompt"] for p in builtin_prompts(4, seed=3)])
    ref = build_engine(bundle, engine_config("vanilla")).generate(cond, [11, 12, 13, 14])
    per_step, widths, forward = {}, [], bundle.drafter.forward
    monkeypatch.setattr(bundle.drafter, "forward", lambda emb, *a, **k: widths.append(emb.shape[1]) or forward(emb, *a, **k))
    for pattern in ([0, 0, 12], [0] * 60 + [12] * 4):
        engine = build_engine(bundle, engine_config("eagle2", budget="fixed", total_tokens=12, depth=4, width=3))
        alternate(engine, pattern)
        widths.clear()
        out = engine.generate(cond, [11, 12, 13, 14])
        assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
        assert max(widths) <= max(CATCH_UP_MAX, engine.L), sorted(widths)[-5:]
        per_step[len(pattern)] = drafts_accepted_per_step(out)
    assert per_step[64] > 0.8 * per_step[3] and per_step[64] > 1.0, per_step


def run(b: Budget, world, steps: int, R: int = 2) -> list[int]:
    """Drive the budget's plan/observe loop for `steps` steps in a synthetic world: world(K) -> (ms,
    tokens per row) of a step planned with K (0 = plain). No clock: the times are the world's. Returns
    the plans."""
    plans = []
    for _ in range(steps):
        K = b.plan(R, pending=1)
        ms, tokens = world(K)
        b.observe(R, K, step_ms=ms, tokens_per_row=tokens)
        plans.append(K)
    return plans


PLAIN = (10.0, 1.0)                            # a plain step: 10 ms, one token per row: 0.1 token/ms
HARD = lambda K: PLAIN if K == 0 else (24.0 + K, 2.0)         # noqa: E731  spec 2.4x the time, 2 tokens
EASY = lambda K: PLAIN if K == 0 else (12.0 + 0.1 * K, 3.5)   # noqa: E731  spec 0.28 token/ms


def optimistic() -> Budget:
    """A model that always expects speculation to pay (verifying is nearly free, drafts all accepted)."""
    b = Budget(table(lambda R, T: 10.0 + 0.01 * T), max_nodes=16, width=4)
    b.value[:] = 1.0
    return b


def test_measured_goodput_overrules_an_optimistic_model():
    """The cost model says speculate; every speculative step measures below a plain step. The budget
    takes plain steps after a few tries (each bucket once, then probes at doubling intervals), so the
    tokens per ms stay within a few percent of plain steps alone."""
    b = optimistic()
    plans = run(b, HARD, 600)
    assert b.model_plan(2, 1) > 0                           # the model still believes in speculation
    spec = [i for i, K in enumerate(plans) if K > 0]
    assert len(spec) <= 14, spec
    ms, tokens = zip(*(HARD(K) for K in plans))
    assert sum(tokens) / sum(ms) >= 0.95 * PLAIN[1] / PLAIN[0]
    gaps = np.diff(spec[-4:])                                   # the probes back off geometrically
    assert (np.diff(gaps) > 0).all() and gaps[-1] >= 128, spec


def test_probes_find_an_easy_stretch_and_speculation_resumes():
    """After a hard stretch (plain steps, probes backed off), the image turns easy: a probe measures that
    speculation pays, and from then on the steps speculate (but for a plain step per FLOOR_EVERY, which
    keeps the floor's rate fresh)."""
    b = optimistic()
    run(b, HARD, 300)
    plans = run(b, EASY, 400)
    first = next(i for i, K in enumerate(plans) if K > 0)
    assert first <= PROBE_MAX                                    # no later than the longest back-off
    after = plans[first:]
    assert sum(K == 0 for K in after) <= len(after) // FLOOR_EVERY + 1, plans


def test_a_probe_runs_long_enough_to_spread_the_catch_up_it_pays():
    """The first speculative step after plain steps pays the drafter's catch-up on them (here 12 ms: it
    measures 0.81x plain), the next ones do not (1.3x plain). A probe of one step would back off for
    good; a probe of PROBE_RUN steps, judged together and not cut short (without its catch-up the first
    step beats plain), finds that speculation pays, and most steps speculate from then on."""
    b = optimistic()
    last, plans = 0, []
    for _ in range(600):
        K = b.plan(2, pending=1)
        catch_up = 12.0 if K > 0 and last == 0 else 0.0
        ms, tokens = PLAIN if K == 0 else (20.0 + catch_up, 2.6)
        b.observe(2, K, step_ms=ms, tokens_per_row=tokens, catch_up_ms=catch_up)
        plans.append(K)
        last = K
    assert sum(K > 0 for K in plans[-300:]) >= 250, plans[-300:]


def test_confident_plain_steps_probe_at_once_only_where_speculation_has_paid():
    """A plain stretch whose rows draw their tokens with high target probability probes as soon as
    PROBE_MIN steps have passed, whatever the back-off, where speculation has gained; where it has only
    lost (batch 8-16 on a CPU) confidence starts no probe. The cue is read only when it could start one."""
    for gained, trained in ((True, EASY), (False, DEAR)):
        b = optimistic()
        run(b, trained, 100 if gained else 600)
        for _ in range(300):                                  # dear probes: the back-off grows
            K = b.plan(2, pending=1)
            ms, tokens = DEAR(K)
            b.observe(2, K, step_ms=ms, tokens_per_row=tokens)
        g = b.measured[2]
        assert (g.net > 0) == gained and g.wait > 4 * PROBE_MIN
        asked, plans = [], []
        for level in [CONFIDENT - 0.2] * 12 + [CONFIDENT + 0.05] * 12:
            K = b.plan(2, pending=1, confidence=lambda v=level: asked.append(v) or v)
            b.observe(2, K, step_ms=PLAIN[0], tokens_per_row=1.0) if K == 0 else \
                b.observe(2, K, step_ms=20.0, tokens_per_row=2.6)
            plans.append(K)
        confident_probe = any(K > 0 for K in plans[12:])
        assert confident_probe == gained, plans
        assert not any(K > 0 for K in plans[:12]) or g.step - g.last_spec >= g.wait, plans
        if not gained:
            assert not asked                                   # never read where it cannot start a probe


DEAR = lambda K: PLAIN if K == 0 else (50.0 + K, 2.0)         # noqa: E731  a probe loses 3 plain steps


def test_probes_that_lose_several_plain_steps_come_rarely_where_speculation_never_paid():
    """Batch 16 on a CPU: a speculative step costs 5 plain steps and commits 2 tokens. After the model's
    first tries, probes doubling from 4 steps would come at steps ~130, 258, 514 of 1000; a failed probe
    waits until what it lost (3 plain steps) is PROBE_SHARE of the steps since: 1 probe (at most 2)."""
    b = optimistic()
    plans = run(b, DEAR, 1000)
    late = [i for i, K in enumerate(plans) if K > 0 and i >= 100]
    assert len(late) <= 2, late
    g = b.measured[2]
    assert g.wait >= 3 / PROBE_SHARE and g.net < 0


def test_quiet_plain_stretches_skip_the_budget_and_change_no_decision():
    """Where speculation has only lost, the steps up to the next probe are certain to be plain: the
    engine takes them without plan or observe (Budget.quiet, each step a `hold`). Driven alongside a
    budget that plans and observes every step, the quiet one speculates at exactly the same steps,
    observes the PLAIN_LAST plain steps before each probe, and skips most steps; where speculation has
    paid (the confidence cue may start a probe any step), nothing is quiet."""
    from decoding.engines.budget import PLAIN_LAST
    full = optimistic()
    run(full, DEAR, 200)
    lean = copy.deepcopy(full)                                   # both from the same state
    spec_full = [i for i, K in enumerate(run(full, DEAR, 3000)) if K > 0]
    spec_lean, observed, quiet, i = [], [], 0, 0
    while i < 3000:
        if quiet:
            quiet, K = quiet - 1, lean.hold(2)
        else:
            K = lean.plan(2, pending=1)
            ms, tokens = DEAR(K)
            lean.observe(2, K, step_ms=ms, tokens_per_row=tokens)
            observed.append(i)
            quiet = lean.quiet(2, pending=1) if K == 0 else 0
        if K > 0:
            spec_lean.append(i)
        i += 1
    assert spec_lean == spec_full and len(spec_full) >= 2, (spec_lean, spec_full)
    for s in spec_lean:
        assert set(range(s - PLAIN_LAST, s + 1)) <= set(observed), s
    assert len(observed) < 0.2 * 3000, len(observed)
    paid = optimistic()
    run(paid, EASY, 100)
    run(paid, DEAR, 300)
    assert paid.measured[2].net > 0 and paid.quiet(2, pending=1) == 0


def test_where_speculation_has_paid_a_failed_probe_only_doubles_the_wait():
    """Batch 1: easy stretches pay for the probes that find them. After an easy stretch (speculation
    gained), the same dear probes back off by doubling, so the next easy stretch is found as soon as
    before; the share rule applies only where speculation has lost in all."""
    b = optimistic()
    run(b, EASY, 100)
    g = b.measured[2]
    assert g.net > 0
    waits = []
    for _ in range(300):
        K = b.plan(2, pending=1)
        ms, tokens = DEAR(K)
        b.observe(2, K, step_ms=ms, tokens_per_row=tokens)
        waits.append(g.wait)
    grown = [w for w in dict.fromkeys(waits) if w > PROBE_MIN]
    assert grown and all(b_ == 2 * a for a, b_ in zip(grown, grown[1:])) and grown[0] <= 2 * PROBE_MIN, grown
    plans = run(b, EASY, 400)
    assert next(i for i, K in enumerate(plans) if K > 0) <= 2 * grown[-1]


def test_only_a_step_that_beats_plain_by_the_margin_restarts_the_back_off():
    """A speculative step that is no probe restarts the probes' back-off only when it beat the plain
    rate by MARGIN: one step's time is noisy, and a step at 1.05x plain is no evidence that speculation
    pays."""
    b = optimistic()
    for _ in range(5):
        b.observe(2, 0, step_ms=10.0)              # plain: 0.1 token / row / ms
    g = b.goodput(2)
    g.wait, g.probing = 64, False
    b.observe(2, 4, step_ms=10.0, tokens_per_row=(1 + MARGIN) / 2)   # beats plain, not by MARGIN
    assert g.wait == 64
    b.observe(2, 4, step_ms=10.0, tokens_per_row=1.01 * MARGIN)
    assert g.wait == PROBE_MIN


def test_a_new_prompt_restarts_the_back_off_only_where_speculation_has_paid():
    """A hard stretch backs the probes off (up to PROBE_MAX); the next prompt is a new image. Where
    speculation has paid at this R, its arrival starts the back-off over, so the next easy image is
    found at once; where it has only lost, the back-off stands."""
    paid = optimistic()
    run(paid, EASY, 100)
    run(paid, HARD, 600)
    assert paid.measured[2].wait >= 128 and paid.measured[2].net > 0
    paid.admit(2)
    assert paid.measured[2].wait == PROBE_MIN
    plans = run(paid, EASY, 50)
    assert next(i for i, K in enumerate(plans) if K > 0) <= PROBE_MIN, plans
    lost = optimistic()
    run(lost, DEAR, 600)
    wait = lost.measured[2].wait
    lost.admit(2)
    assert lost.measured[2].wait == wait >= 128
    again = copy.deepcopy(paid)
    again.measured[2].wait = PROBE_MAX
    again.admit(2)
    assert again.measured[2].wait == PROBE_MIN


def test_an_unmeasured_tree_needs_the_models_word_by_the_margin_a_measured_one_needs():
    """Rule 2: a bucket never measured at this R is tried only where the model expects it to beat a
    plain step by MARGIN, as a measured one must. The model's acceptance comes from the steps that
    speculated and leans optimistic: at batch 16 on a CPU it tried buckets it put at 1.01-1.07x plain,
    each measured 0.62-0.75x."""
    def budget(ratio):
        b = Budget(table(lambda R, T: 10.0, drafter=lambda R, T: 0.0), max_nodes=1, width=1)
        for _ in range(2):
            b.observe(2, 0, step_ms=10.0)           # the floor: plain steps, no overhead
        b.costs = dataclasses.replace(b.costs, overhead_ms={"spec": [1.8 / (0.1 * ratio) - 10.0] * len(ROWS)})
        rates = b.model_rates(2, 1)
        assert rates[1] / rates[0] == pytest.approx(ratio)
        return b
    assert budget(1.05).model_plan(2, 1) == 1 and budget(1.05).plan(2, 1) == 0
    assert budget(1.05 * MARGIN).plan(2, 1) == 1


def test_measurement_overrules_a_pessimistic_model_too():
    """A cost model that says plain (verifying costs grow with every token) is probed, and when the probe
    measures that speculation pays, speculation is taken even though the model still says plain."""
    b = Budget(table(lambda R, T: 1.0 * R * T), max_nodes=8, width=2)
    assert b.model_plan(32, 1) == 0
    plans = run(b, EASY, 40, R=32)
    assert b.model_plan(32, 1) == 0 and plans[0] == 0           # the first step measures the floor
    assert sum(K > 0 for K in plans[-20:]) >= 19, plans


def test_one_noisy_plain_step_does_not_stop_speculation_that_pays():
    """The plain rate is the hardware's: an EMA over plain steps, not replaced by the latest one. A single
    plain step measured twice as fast as usual (a quiet moment on a shared machine) leaves it below the
    speculative rate, and speculation goes on."""
    b = optimistic()
    modest = lambda K: PLAIN if K == 0 else (14.0, 1.8)                 # noqa: E731  0.129 vs 0.1 token/ms
    run(b, modest, 200)
    plans = run(b, lambda K: (5.0, 1.0) if K == 0 else modest(K), FLOOR_EVERY + 2)   # one fast plain step
    assert sum(K == 0 for K in plans) == 1
    assert all(K > 0 for K in run(b, modest, 20))


def test_steps_that_slow_down_with_position_do_not_fake_a_win():
    """Every step, plain or speculative, costs more as the rows' positions grow, and half as much again
    when the batch restarts (a saw tooth of 256 steps). Speculation loses at every position (HARD): the
    budget must see that whatever the position, so it speculates no more than in a flat world. Absolute
    rates kept from early positions fail this (18 speculative steps against 13)."""
    def saw(b, steps):
        plans = []
        for i in range(steps):
            K = b.plan(2, pending=1)
            ms, tokens = HARD(K)
            scale = 1.0 + (i % 256) / 256                     # 1x at a restart, 2x at the end of an image
            b.observe(2, K, step_ms=ms * scale, tokens_per_row=tokens)
            plans.append(K)
        return plans
    flat = sum(K > 0 for K in run(optimistic(), HARD, 1500))
    assert sum(K > 0 for K in saw(optimistic(), 1500)) <= flat + 2


def test_a_probe_is_judged_by_what_its_drafts_were_worth_not_by_one_draw():
    """A speculative step that happened to commit 1 token although its drafts were worth 3 more (the
    drafter's calibrated path probabilities) is a draw, not a measurement of the bucket: the bucket
    stays above plain. Judged by the tokens it committed, one such step marked it below plain."""
    b = optimistic()
    run(b, lambda K: PLAIN, 3)                                   # the plain rate: 0.1 token / ms
    b.observe(2, 4, step_ms=20.0, tokens_per_row=1.0, predicted=3.0, accepted=0.0, behind=3.0)
    assert not b.goodput(2).below_plain(bucket(4)), b.goodput(2).rate
    b.observe(2, 16, step_ms=20.0, tokens_per_row=7.0, predicted=0.2, accepted=6.0, behind=0.2)
    assert b.goodput(2).below_plain(bucket(16)), b.goodput(2).rate     # and a lucky draw is no win


def test_a_step_is_worth_what_it_moves_the_rows_furthest_from_done():
    """A batch takes as many steps as its slowest row: a step whose drafts were worth 3 tokens to the
    mean row but 0.2 to the rows furthest behind is below plain (0.06 token / ms against 0.1); the same
    step without that information (one row, say) is above."""
    for behind, below in ((0.2, True), (None, False)):
        b = optimistic()
        run(b, lambda K: PLAIN, 3)                               # the plain rate: 0.1 token / ms
        b.observe(2, 4, step_ms=20.0, tokens_per_row=4.0, predicted=12.0, accepted=12.0,
                  behind=behind)
        assert b.goodput(2).below_plain(bucket(4)) == below, (behind, b.goodput(2).rate)


def test_the_engine_reports_the_worth_of_the_rows_furthest_from_done(monkeypatch, tmp_path):
    """`behind` is the mean Σ of verified path probabilities over the unfinished rows with the fewest
    tokens, as the step found them."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, **TREES["eagle2"]))
    with_width(engine, 0.0)
    seen, by_rank, spec = [], proposers.by_rank_of, engine.speculate
    def record(tree, v, active):
        out = by_rank(tree, v, active)
        seen[-1]["per_row"] = out[2]
        return out
    def step(st, active, kind, plan, **kw):
        if kind == "spec":
            seen.append({"n": st.log.n.clone(), "active": active.clone()})
        return spec(st, active, kind, plan, **kw)
    observe = engine.budget.observe
    def obs(*a, **k):
        if a[1] > 0:
            seen[-1]["behind"] = k["behind"]
        return observe(*a, **k)
    monkeypatch.setattr(proposers, "by_rank_of", record)
    monkeypatch.setattr(engine, "speculate", step)
    monkeypatch.setattr(engine.budget, "observe", obs)
    engine.generate(labels(8), range(8))
    checked = 0
    for s in seen:
        if s.get("per_row") is None:
            continue
        n = torch.where(s["active"], s["n"], 10 ** 6)
        rows = s["active"] & (s["n"] == n.min())
        assert s["behind"] == pytest.approx(float(s["per_row"][rows].mean()))
        checked += int(rows.sum() < s["active"].sum())            # some steps had rows ahead
    assert checked > 0, len(seen)


def with_width(engine, ms_per_slot: float):
    """Give an auto-budget tree engine a known cost table: flat forwards, and `ms_per_slot` of attention
    width per slot (cost.py width_ms)."""
    engine.costs = engine.budget.costs = dataclasses.replace(table(lambda R, T: 10.0 + 0.01 * T),
                                                             width_ms=[ms_per_slot] * len(ROWS))


@pytest.mark.parametrize("name", list(TREES))
def test_rows_in_step_stay_in_step_where_running_ahead_costs_the_batch_more(name, tmp_path, monkeypatch):
    """Where one slot of attention width costs the batch more than a token saves a row (tree.py _room),
    rows that started together take plain steps, as vanilla's do, whatever the budget plans; where it
    costs nothing they speculate. Either way the tokens are vanilla's."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(8), range(8))
    depth = {}
    for width in (10.0, 0.0):
        engine = build_engine(bundle, engine_config(name, sampling=SAMPLING, **TREES[name]))
        with_width(engine, width)
        alternate(engine, [8])
        out = engine.generate(labels(8), range(8))
        assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
        depth[width] = np.stack([r.records["tree_depth"] for r in out])
    assert (depth[10.0] == 0).all() and (depth[0.0] > 0).any()


def test_rows_behind_catch_up_by_speculation_and_none_passes_the_leader(tmp_path, monkeypatch):
    """Rows out of step (four free speculative steps move them apart), then a device where width is
    dear: from then on the longest row moves by at most one token per step, and rows behind it still
    speculate (by more than one token in a step). Tokens stay vanilla's."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(8), range(8))
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, **TREES["eagle2"]))
    with_width(engine, 0.0)
    alternate(engine, [8])
    step, moves = engine.step, []

    def traced(st):
        if len(moves) == 4:
            with_width(engine, 10.0)
        before = st.log.n.clone()
        step(st)
        moves.append((int(before.max()), int(st.log.n.max()), int((st.log.n - before).max())))
    engine.step = traced
    out = engine.generate(labels(8), range(8))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    later = [m for m in moves[4:] if m[0] < engine.N]
    assert moves[4][0] > 5 and all(hi <= lo + 1 for lo, hi, _ in later), moves
    assert any(most > 1 for _, _, most in later), moves


def test_fixed_budget_ignores_measurements():
    b = Budget(None, max_nodes=6, width=2)
    assert run(b, HARD, 20) == [6] * 20


def test_plain_steps_teach_no_acceptance():
    """v_k is what speculative steps measured: plain steps leave it alone (a drift back to the prior made
    the model over-optimistic; probes, not the prior, try speculation again)."""
    b = Budget(table(lambda R, T: 10.0 + 0.3 * T), max_nodes=8, width=2)
    for _ in range(30):
        b.observe(2, 8, step_ms=15.0, tokens_per_row=1.0, accepted_by_rank=np.zeros(8))
    before = b.value.copy()
    for _ in range(30):
        b.observe(2, 0, step_ms=10.5)
    assert (b.value == before).all() and b.model_plan(2, 1) == 0


def test_a_step_teaches_the_acceptance_of_each_rank_by_draft_score():
    """proposers.by_rank_of: v_k is the acceptance of each row's k-th best node by draft score, wherever
    the node stands in the block; finished rows and padding teach nothing; `predicted` is the Σ of the
    verified nodes' path probabilities over the busy rows (what the calibration divides by)."""
    from decoding.engines.verify import Tree, Verdict
    ln = np.log
    # path probabilities: row 0 a 0.6, b 0.25 (a's sibling), c 0.3 (under a); row 1 d 0.2, padding; row 2 done
    tree = Tree(tok=torch.tensor([[0, 1, 2, 3], [0, 4, 0, 0], [0, 5, 6, 0]]),
                parent=torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1], [-1, 0, 1, -1]]),
                depth=torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0], [0, 1, 2, 0]]),
                q=torch.zeros(3, 4),
                score=torch.tensor([[0.0, ln(0.6), ln(0.25), ln(0.3)], [0.0, ln(0.2), 0.0, 0.0],
                                    [0.0, ln(0.9), ln(0.8), 0.0]]).float())
    on_path = torch.tensor([[False, True, False, True], [False, False, False, False], [False, True, True, False]])
    v = Verdict(on_path, on_path.sum(1), torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long),
                torch.zeros(3, 4), torch.zeros(3), torch.zeros(3, 4, dtype=torch.long))
    hit, predicted, per_row = proposers.by_rank_of(tree, v, torch.tensor([True, True, False]))
    # rank 1: a (accepted), d (not); rank 2: c (accepted), padding; rank 3: b (not), padding
    assert hit.tolist() == pytest.approx([0.5, 0.5, 0.0])
    assert predicted == pytest.approx(0.6 + 0.25 + 0.3 + 0.2, abs=1e-6)
    assert per_row[:2].tolist() == pytest.approx([1.15, 0.2], abs=1e-6)


def aten_ops(fn) -> dict:
    """{aten op: calls} of fn() (counts, not times: deterministic)."""
    from collections import Counter
    from torch.profiler import ProfilerActivity, profile
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return Counter(e.name for e in p.events() if e.name.startswith("aten::"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_pending_feature_write_touches_only_its_rows(dtype):
    """put_rows writes the indexed rows and nothing else, without copying the buffer (an op count cannot
    see it: scatter_ into a bf16 buffer on a CPU is one op that copies the whole [R, S, D] buffer twice)."""
    from torch.profiler import ProfilerActivity, profile
    from decoding.engines.commit import put_rows
    buf = torch.zeros(6, 40, 8, dtype=dtype)
    idx = torch.tensor([[3, 39], [0, 1], [5, 5], [39, 2], [7, 8], [1, 0]])
    values = torch.randn(6, 2, 8).to(dtype)
    want = buf.clone()
    for r in range(6):
        for k in range(2):
            want[r, idx[r, k]] = values[r, k]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        put_rows(buf, idx, values)
    assert torch.equal(buf, want)
    big = [e.name for e in p.events() if any(list(s) == list(buf.shape) for s in e.input_shapes if s)
           and e.name in ("aten::copy_", "aten::clone", "aten::_to_copy")]
    assert not big, big


@pytest.mark.parametrize("name", list(TREES))
def test_a_plain_step_is_vanillas_step(name, tmp_path, monkeypatch):
    """A plain step of a tree engine does vanilla's work: the same forward, no drafter, no more reads
    back from the device (`item`), and beyond vanilla's ops only the append of the root's feature to the
    drafter's pending buffer (a handful of index ops, whatever the model's size)."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    cond = labels(8)

    def ready(engine):
        st = engine.start(8)
        with torch.inference_mode():
            engine.admit(st, torch.arange(8), cond, list(range(8)))
        return st

    van = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING))
    vst = ready(van)
    tree = build_engine(bundle, engine_config(name, sampling=SAMPLING, **TREES[name]))
    tst = ready(tree)
    tree.budget.plan = lambda R, pending, confidence=None: 0
    # `_room` reads the rows' lengths back where the measured width cost says attention width matters (the
    # step's documented exception): fixed here, so that the count does not depend on the host's timings
    monkeypatch.setattr(tree.planner, "room", lambda st: (None, True))
    calls = []
    monkeypatch.setattr(tree, "drafter", lambda *a, **k: calls.append(1))
    plain, vanilla = aten_ops(lambda: tree.step(tst)), aten_ops(lambda: van.step(vst))
    assert not calls                                                   # the drafter rests
    syncs = ("aten::item", "aten::_local_scalar_dense")
    assert [plain[k] for k in syncs] == [vanilla[k] for k in syncs], (plain, vanilla)
    assert plain["aten::linear"] == vanilla["aten::linear"]              # the same forward
    extra = sum(plain.values()) - sum(vanilla.values())
    assert extra <= 24, {k: plain[k] - vanilla[k] for k in set(plain) | set(vanilla) if plain[k] != vanilla[k]}
    assert tst.log.n.tolist() == vst.log.n.tolist() == [2] * 8


@pytest.mark.parametrize("name", list(TREES))
def test_the_auto_budget_mixes_steps_and_commits_vanillas_tokens(name, tmp_path, monkeypatch):
    """With the default budget (cost model + measured goodput) the first steps are plain (they measure
    the floor) and a probe speculates within PROBE_MIN steps; whatever the mix, the tokens are vanilla's."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(12), range(12))
    engine = build_engine(bundle, engine_config(name, sampling=SAMPLING, **TREES[name]))
    assert not engine.budget.fixed
    for i in range(2):                                          # the second batch starts from what was learnt
        out = engine.generate(labels(12), range(12))
        assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
        if i == 0:                  # (the second may be all plain: how long the probes wait is measured)
            depth = np.stack([r.records["tree_depth"] for r in out])
            assert (depth == 0).any() and (depth > 0).any()


@pytest.mark.parametrize("name", list(TREES))
def test_where_speculation_only_lost_the_engine_skips_the_budget_and_commits_vanillas_tokens(name, tmp_path,
                                                                                        monkeypatch):
    """A budget that learnt that speculation loses at this batch shape, the next probe far off: the
    engine's steps are vanilla's, and after the first one it neither plans, measures nor reads the rows'
    lengths back (`_room`) once the drafter's catch-up reached its cap, until the probe is near
    (Budget.quiet)."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    ref = build_engine(bundle, engine_config("vanilla", sampling=SAMPLING)).generate(labels(12), range(12))
    engine = build_engine(bundle, engine_config(name, sampling=SAMPLING, **TREES[name]))
    engine.generate(labels(12), range(12))                         # measures the floor and the costs
    for g in engine.budget.measured.values():                     # at every row count the batch ran:
        g.net, g.wait, g.last_spec = -5.0, PROBE_MAX, g.step         # it lost; the next probe is far off
        g.rate.update({b: 0.5 for b in range(1, bucket(engine.budget.max) + 1)})
    monkeypatch.setattr(proposers, "CATCH_UP_MAX", 2)                 # the catch-up's cap: reached at step 2
    calls = []
    for obj, fn in ((engine.budget, "observe"), (engine.budget, "plan"), (engine.planner, "room")):
        real = getattr(obj, fn)
        monkeypatch.setattr(obj, fn, lambda *a, real=real, fn=fn, **k: calls.append(fn) or real(*a, **k))
    out = engine.generate(labels(12), range(12))
    assert [r.tokens.tolist() for r in out] == [r.tokens.tolist() for r in ref]
    # 2 of 15 steps, then quiet (whether those 2 plan or hold depends on `_room`, on the measured costs)
    assert calls.count("room") == calls.count("observe") == 2 and calls.count("plan") <= 2, calls


def test_the_engine_reports_each_step_to_the_budget_as_planned(tmp_path, monkeypatch):
    """What the measured goodput is made of: every step reports the K it was planned with (0 = plain)
    and the tokens it committed per unfinished row (plain: 1; speculative: 1 + accepted drafts), idle
    and finished rows not counted; and new prompts are announced (Budget.admit)."""
    monkeypatch.setenv("ARSPEC_CACHE", str(tmp_path))
    bundle = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    engine = build_engine(bundle, engine_config("eagle2", sampling=SAMPLING, **TREES["eagle2"]))
    plans, seen = [], []
    observe = engine.budget.observe
    # a fixed mix of plain and speculative plans (the budget's own choice depends on measured time, and
    # this test is about what the engine reports, not what the budget chooses)
    engine.budget.plan = lambda R, pending, confidence=None: plans.append([0, 4, 8][len(plans) % 3]) or plans[-1]   # <= total_tokens
    engine.planner.room = lambda st: (None, True)   # (a measured width cost would hold rows in step: plain steps unplanned)
    engine.budget.observe = lambda R, K, ms, tokens=1.0, *a, **k: (seen.append((K, ms, tokens)),
                                                                   observe(R, K, ms, tokens, *a, **k))
    admitted = []
    engine.budget.admit = admitted.append                              # a new prompt: the budget hears of it
    outs = engine.stream([Request(c, i, i) for i, c in enumerate(labels(6).split())], slots=8)   # 2 slots idle
    outs = list(outs)
    assert not [o.error for o in outs if o.error], [o.error for o in outs if o.error]
    assert admitted and set(admitted) == {16}
    out = [o.result for o in outs]
    assert [K for K, _, _ in seen] == plans and 0 in plans and max(plans) > 0
    assert all(ms > 0 for _, ms, _ in seen)
    assert all(t == 1.0 for K, _, t in seen if K == 0)
    step = np.stack([r.records["step"] for r in out])                  # [prompts, N]: the step of each token
    for s, (K, _, tokens) in enumerate(seen, start=1):
        rows = (step == s).any(1)
        assert tokens == pytest.approx((step == s).sum() / rows.sum()), (s, K)
    assert max(t for K, _, t in seen if K > 0) > 1.0                   # drafts were accepted
