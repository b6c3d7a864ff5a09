"""The analysis report: its queries on small hand-made tables with exact expected numbers, the flat-cell
rule, the distribution distances on sets whose answers are known in closed form, and one report built
end to end over synthetic runs (workflows.bench_analyze) of every engine family."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.output import ERROR_SCHEMA, IMAGE_SCHEMA, TOKEN_SCHEMA, png_bytes
from tests.conftest import REPO
from workflows.config import ConfigError
from workflows.report import distance, queries as Q
from workflows.report.images import flat_cells, scan
from workflows.report.runs import find_runs, load_runs, pair_baselines

NAN = float("nan")


# -- hand-made runs ---------------------------------------------------------------------------------------
def _image(kind: str) -> np.ndarray:
    """8x8 pixels on a 2x2 token grid (4x4-pixel cells). 'flat': one colour everywhere. 'corner': a
    black/white checkerboard in cell (1, 0) (row 1, column 0), white elsewhere: (1, 0) is busy, its
    neighbours (0, 0) and (1, 1) see its grey mean and are busy too, (0, 1) is flat."""
    img = np.full((8, 8, 3), 255, np.uint8)
    if kind == "flat":
        img[:] = (40, 80, 200)
    else:
        img[4:, :4] = ((np.indices((4, 4)).sum(0) % 2) * 255)[..., None]
    return img


def _schema(cols) -> pa.Schema:
    """The job's types for the columns a hand-made table holds: a column that a later engine adds to
    TOKEN_COLUMNS (e.g. budget) is left out, as in a run written before it existed."""
    return pa.schema([f for f in TOKEN_SCHEMA if f.name in cols])


def _write_run(root, name, engine, images: list[dict], tokens: dict | None, errors: list[dict] = ()):
    d = root / name
    (d / "images").mkdir(parents=True)
    (d / "job.json").write_text(json.dumps({"model": {"name": "shapes"}, "engine": {"name": engine}, "seed": 0}))
    rows = [{"prompt": "p", "engine": engine, "model": "shapes", "width": 8, "height": 8, "num_tokens": 4,
             "batch_size": 2, "acceptance": "exact", "unknown_words": 0, "part": "part-0", **im} for im in images]
    pq.write_table(pa.Table.from_pylist(rows, schema=IMAGE_SCHEMA), d / "images" / "part-0.parquet")
    if tokens is not None:
        (d / "tokens").mkdir()
        pq.write_table(pa.Table.from_pydict(tokens, schema=_schema(tokens)), d / "tokens" / "part-0.parquet")
    if errors:
        (d / "errors").mkdir()
        pq.write_table(pa.Table.from_pylist(list(errors), schema=ERROR_SCHEMA), d / "errors" / "part-0.parquet")
    return d


# A speculative run of two images, 4 tokens each on a 2x2 grid (token i at cell (i // 2, i % 2)).
# Image a: step 0 the prefill token; step 1 accepts 2 drafts + a bonus (tree depth 3, width 2).
# Image b: step 1 accepts nothing (bonus only; depth 2, width 4); step 2 accepts 1 draft + a bonus (depth 4).
# Probabilities are binary fractions, so bins and means are exact.
SPEC = {
    "prompt_id": ["a"] * 4 + ["b"] * 4,
    "token_index": [0, 1, 2, 3] * 2, "row": [0, 0, 1, 1] * 2, "col": [0, 1, 0, 1] * 2,
    "token_id": [5, 6, 7, 8, 1, 2, 3, 4],
    "step": [0, 1, 1, 1, 0, 1, 2, 2],
    "accepted": [False, True, True, False, False, False, True, False],
    "accept_len": [1, 3, 3, 3, 1, 1, 2, 2],
    "p_target": [0.9375, 0.8125, 0.5625, 0.1875, 0.5, 0.3125, 0.9375, 0.0625],
    "q_draft": [NAN, 0.6875, 0.5625, NAN, NAN, NAN, 0.875, NAN],
    "tree_depth": [0, 3, 3, 3, 0, 2, 4, 4],
    "tree_width": [0, 2, 2, 2, 0, 4, 1, 1],
    "engine": ["eagle2"] * 8,
}
SPEC_IMAGES = [
    {"prompt_id": "a", "seed": 11, "split": "flat", "image": {"bytes": png_bytes(_image("flat")), "path": None},
     "target_forwards": 2, "draft_forwards": 5, "mean_accept_len": 2.0, "wall_s": 1.0},
    {"prompt_id": "b", "seed": 12, "split": "textured", "image": {"bytes": png_bytes(_image("corner")), "path": None},
     "target_forwards": 3, "draft_forwards": 7, "mean_accept_len": 4 / 3, "wall_s": 2.0},
]
# The baseline: the same two (prompt, seed) pairs, one more prompt, and prompt a under another seed.
BASE_IMAGES = [
    {"prompt_id": "a", "seed": 11, "split": "flat", "target_forwards": 4, "wall_s": 0.5},
    {"prompt_id": "b", "seed": 12, "split": "textured", "target_forwards": 4, "wall_s": 0.5},
    {"prompt_id": "c", "seed": 13, "split": "flat", "target_forwards": 4, "wall_s": 0.5},
    {"prompt_id": "a", "seed": 99, "split": "flat", "target_forwards": 8, "wall_s": 9.0},
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    spec = _write_run(root, "eagle2", "eagle2", SPEC_IMAGES, SPEC, errors=[
        {"prompt_id": "x", "prompt": "", "seed": 1, "engine": "eagle2", "error": "empty prompt\nTraceback ...", "part": "p"},
        {"prompt_id": "y", "prompt": "", "seed": 2, "engine": "eagle2", "error": "empty prompt", "part": "p"},
        {"prompt_id": "z", "prompt": "?", "seed": 3, "engine": "eagle2", "error": "CUDA out of memory", "part": "p"}])
    flat = {"bytes": png_bytes(_image("flat")), "path": None}
    base = _write_run(root, "vanilla", "vanilla", [{**b, "image": flat, "draft_forwards": 0, "mean_accept_len": 1.0}
                                                   for b in BASE_IMAGES], None)
    con = Q.connect("1GB")
    tables = {n: Q.Tables(con, Q.parquet(str(d / "images" / "*.parquet")),
                          Q.parquet(str(d / "tokens" / "*.parquet")) if (d / "tokens").exists() else None,
                          Q.parquet(str(d / "errors" / "*.parquet")) if (d / "errors").exists() else None)
              for n, d in (("spec", spec), ("base", base))}
    return root, tables


def test_image_summary_per_split(runs):
    _, t = runs
    rows = {r["split"]: r for r in Q.image_summary(t["spec"])}
    assert list(rows) == ["all", "flat", "textured"]
    a = rows["all"]
    assert a["images"] == 2
    assert a["tau"] == pytest.approx((2 + 4 / 3) / 2, abs=1e-6)
    assert a["tau_pooled"] == pytest.approx(8 / 5)               # 8 tokens over 5 target forwards
    assert (a["target_forwards"], a["draft_forwards"], a["s_per_image"]) == (2.5, 6.0, 1.5)
    assert rows["textured"]["tau_pooled"] == pytest.approx(4 / 3)
    assert Q.tau_values(t["spec"]).tolist() == pytest.approx([2.0, 4 / 3])


def test_versus_joins_on_prompt_and_seed(runs):
    _, t = runs
    assert Q.matched(t["spec"], t["base"]) == 2
    rows = {r["split"]: r for r in Q.versus(t["spec"], t["base"])}
    assert rows["all"]["matched"] == 2
    assert rows["all"]["compression"] == pytest.approx(8 / 5)    # (4 + 4) / (2 + 3)
    assert rows["all"]["speedup"] == pytest.approx(1.0 / 3.0)    # (0.5 + 0.5) / (1 + 2)
    assert rows["flat"]["compression"] == pytest.approx(2.0) and rows["flat"]["speedup"] == pytest.approx(0.5)
    assert rows["textured"]["compression"] == pytest.approx(4 / 3) and rows["textured"]["speedup"] == pytest.approx(0.25)


def test_errors_grouped_by_first_line(runs):
    _, t = runs
    assert Q.errors(t["spec"]) == [{"error": "empty prompt", "prompts": 2, "example": "x"},
                                   {"error": "CUDA out of memory", "prompts": 1, "example": "z"}]
    assert Q.errors(t["base"]) == []


def test_speculative(runs):
    _, t = runs
    assert Q.speculative(t["spec"]) and not Q.speculative(t["base"])


def test_step_histogram_and_acceptance_by_depth(runs):
    _, t = runs
    hist = Q.step_histogram(t["spec"])
    assert hist == {(2, 3): 1, (0, 2): 1, (1, 4): 1}             # (accepted drafts, tree depth): steps
    rates = Q.depth_acceptance(hist)
    # k=1: all 3 steps reach depth 1, 2 accept; k=2: (2,3) and (1,4) reach it, 1 accepts; k=3: (2,3) only, none
    assert [(r["depth"], r["reached"], r["accepted"]) for r in rates] == [(1, 3, 2), (2, 2, 1), (3, 1, 0)]
    assert [r["rate"] for r in rates] == [2 / 3, 1 / 2, 0.0]


def test_a_tree_that_ends_at_depth_k_does_not_reach_depth_k_plus_one():
    # a depth-2 tree whose 2 drafts were accepted could not have accepted a third: at k=3 only the
    # depth-3 trees that accepted 2 count as reached (2 of them), and one accepted a third
    rates = Q.depth_acceptance({(2, 2): 1, (2, 3): 1, (3, 3): 1})
    assert [(r["depth"], r["reached"], r["accepted"]) for r in rates] == [(1, 3, 3), (2, 3, 3), (3, 2, 1)]


def test_acceptance_by_depth_without_trees():
    # Jacobi-style steps (no tree depth logged): k=1 reached by all 4 steps, 3 accept one or more; k=2
    # reached by those 3, 2 accept two or more; k=3 by those 2, 1 accepts three or more; k=4 reached by 1, none.
    rates = Q.depth_acceptance({(0, 0): 1, (1, 0): 1, (2, 0): 1, (3, 0): 1})
    assert [(r["depth"], r["reached"], r["accepted"]) for r in rates] == [(1, 4, 3), (2, 3, 2), (3, 2, 1)]


def test_acceptance_by_tree_depth_and_width(runs):
    _, t = runs
    assert Q.by_value(t["spec"], "tree_depth") == [
        {"value": 0, "tokens": 2, "accepted": 0.0}, {"value": 2, "tokens": 1, "accepted": 0.0},
        {"value": 3, "tokens": 3, "accepted": 2 / 3}, {"value": 4, "tokens": 2, "accepted": 0.5}]
    assert [(r["value"], r["tokens"]) for r in Q.by_value(t["spec"], "tree_width")] == [(0, 2), (1, 2), (2, 3), (4, 1)]


def test_calibration(runs):
    _, t = runs
    # accepted drafts: q 0.6875 (p 0.8125), q 0.5625 (p 0.5625), q 0.875 (p 0.9375): bins 6, 5, 8
    assert Q.calibration_draft(t["spec"]) == [
        {"bin": 5, "tokens": 1, "q": 0.5625, "p": 0.5625}, {"bin": 6, "tokens": 1, "q": 0.6875, "p": 0.8125},
        {"bin": 8, "tokens": 1, "q": 0.875, "p": 0.9375}]
    # all committed tokens by p: bin 9 holds 0.9375 (prefill, not drafted) and 0.9375 (accepted)
    got = {r["bin"]: (r["tokens"], r["p"], r["accepted"]) for r in Q.calibration_target(t["spec"])}
    assert got == {0: (1, 0.0625, 0.0), 1: (1, 0.1875, 0.0), 3: (1, 0.3125, 0.0), 5: (2, 0.53125, 0.5),
                   8: (1, 0.8125, 1.0), 9: (2, 0.9375, 0.5)}


def test_cells(runs):
    _, t = runs
    c = Q.cells(t["spec"])
    np.testing.assert_array_equal(c["tokens"], [[2, 2], [2, 2]])
    np.testing.assert_array_equal(c["accepted"], [[0, 0.5], [1, 0]])
    np.testing.assert_array_equal(c["tree_depth"], [[0, 2.5], [3.5, 3.5]])
    np.testing.assert_array_equal(c["tree_width"], [[0, 3], [1.5, 1.5]])


def test_flat_cells_rule():
    got = flat_cells(np.stack([_image("flat"), _image("corner")]), 2)
    np.testing.assert_array_equal(got, [[[True, True], [True, True]], [[False, True], [False, False]]])
    dot = np.full((8, 8, 3), 200, np.uint8)
    dot[0, 0] = 100                     # one pixel 100 levels off (the cell's mean moves 6.25): busy cell
    np.testing.assert_array_equal(flat_cells(dot[None], 2)[0], [[False, True], [True, True]])
    ramp = np.zeros((8, 8, 3), np.uint8)
    ramp[:, 4:] = 11                                             # neighbours 11 grey levels apart: flat at tol 12
    assert flat_cells(ramp[None], 2).all() and not flat_cells(ramp[None], 2, tol=11).any()


def test_flat_busy_joins_each_token_to_its_own_image_cells(runs):
    root, t = runs
    facts = scan(str(root / "eagle2" / "images"))
    assert facts.table.column("mask").to_pylist() == ["1111", "0100"]
    np.testing.assert_array_equal(facts.flat_share, [[0.5, 1.0], [0.5, 0.5]])
    t["spec"].con.register("flat_spec", facts.table)
    got = {(r["split"], r["cell"]): r for r in Q.flat_busy(t["spec"], "flat_spec")}
    # flat: all of a (accepted 2 of 4; depths 0,3,3,3) and b's cell (0,1) (token 1: not accepted, depth 2);
    # busy: b's tokens 0, 2, 3 (accepted: token 2; depths 0, 4, 4)
    assert (got["all", "flat"]["tokens"], got["all", "flat"]["accepted"], got["all", "flat"]["tree_depth"]) == (5, 0.4, 2.2)
    assert (got["all", "busy"]["tokens"], got["all", "busy"]["accepted"], got["all", "busy"]["tree_depth"]) == (3, 1 / 3, 8 / 3)
    assert (got["flat", "flat"]["tokens"], got["flat", "flat"]["accepted"]) == (4, 0.5)
    assert ("flat", "busy") not in got
    assert (got["textured", "busy"]["tokens"], got["textured", "flat"]["tokens"]) == (3, 1)


def test_image_tokens_and_ids(runs):
    _, t = runs
    m = Q.image_tokens(t["spec"], "b")
    np.testing.assert_array_equal(m["accepted"], [[0, 0], [1, 0]])
    np.testing.assert_array_equal(m["tree_depth"], [[0, 2], [4, 4]])
    assert sorted(Q.first_ids(t["base"], 5)) == ["a", "a", "b", "c"]
    assert Q.first_ids(t["base"], 5) == Q.first_ids(t["base"], 5)
    assert set(Q.image_bytes(t["spec"], ["b", "zz"])) == {"b"}


def test_a_probability_of_one_falls_in_the_top_bin(tmp_path):
    """q = 1 (a point-mass draft: a copied neighbour, a greedy target) and p = 1 go to the last of the
    ten calibration bins, not an eleventh."""
    n = 3
    cols = {"prompt_id": ["a"] * n, "token_index": list(range(n)), "row": [0] * n, "col": list(range(n)),
            "token_id": [1] * n, "step": [0, 1, 1], "accepted": [False, True, False], "accept_len": [1, 2, 2],
            "p_target": [1.0, 1.0, 0.95], "q_draft": [NAN, 1.0, NAN], "tree_depth": [0] * n, "tree_width": [0] * n,
            "engine": ["sjd"] * n, "proposer": [3] * n}
    pq.write_table(pa.Table.from_pydict(cols, schema=pa.schema(_schema(Q.COMMON))), tmp_path / "t.parquet")
    t = Q.Tables(Q.connect("1GB"), "unused", Q.parquet(str(tmp_path / "t.parquet")))
    assert [r["bin"] for r in Q.calibration_draft(t)] == [9]
    assert [(r["bin"], r["tokens"]) for r in Q.calibration_target(t)] == [(9, 3)]


@pytest.mark.parametrize("logged", [True, False])
def test_tree_shapes_come_from_drafter_trees_only(tmp_path, logged):
    """A chain step logs its chain's length as depth (16) and a plain step 0: neither is a tree's shape.
    The cell maps, the per-depth table and one image's map average the drafter trees' tokens alone
    (proposer 2); a run written before the proposer column averages every token, as it did."""
    n = 4
    cols = {"prompt_id": ["a"] * n, "token_index": list(range(n)), "row": [0] * n, "col": list(range(n)),
            "token_id": [1] * n, "step": [0, 1, 2, 3], "accepted": [False, True, True, False], "accept_len": [1] * n,
            "p_target": [0.5] * n, "q_draft": [NAN] * n, "tree_depth": [0, 16, 3, 5], "tree_width": [0, 1, 2, 4],
            "engine": ["adt_tree"] * n, "proposer": [0, 1, 2, 2]}
    if not logged:
        del cols["proposer"]
    pq.write_table(pa.Table.from_pydict(cols, schema=_schema(cols)), tmp_path / "t.parquet")
    t = Q.Tables(Q.connect("1GB"), "unused", Q.parquet(str(tmp_path / "t.parquet")))
    want = [NAN, NAN, 3.0, 5.0] if logged else [0.0, 16.0, 3.0, 5.0]
    np.testing.assert_equal(Q.cells(t)["tree_depth"][0], want)
    np.testing.assert_equal(Q.image_tokens(t, "a")["tree_depth"][0], want)
    assert [r["value"] for r in Q.by_value(t, "tree_depth")] == ([3, 5] if logged else [0, 3, 5, 16])
    assert [r["value"] for r in Q.by_value(t, "tree_width")] == ([2, 4] if logged else [0, 1, 2, 4])


def test_profile_of_family_columns(tmp_path):
    """Columns beyond the common ones (a continuous family's window position and log acceptance ratio)
    are found and profiled against acceptance; token_id may be null."""
    n = 6
    cols = {"prompt_id": ["a"] * n, "token_index": list(range(n)), "row": [0] * n, "col": list(range(n)),
            "token_id": [None] * n, "step": [0, 1, 1, 1, 2, 2], "accepted": [False, True, True, False, True, False],
            "accept_len": [1, 3, 3, 3, 2, 2], "p_target": [NAN] * n, "q_draft": [NAN] * n, "tree_depth": [0] * n,
            "tree_width": [0] * n, "engine": ["cspd"] * n, "proposer": [4] * n, "window_pos": [0, 0, 1, 2, 0, 1],
            "log_ratio": [0.0, -0.25, -0.5, -3.0, -0.125, float("-inf")], "budget": [0] * n, "scale": [NAN] + [0.5] * 5}
    schema = pa.schema([*_schema(Q.COMMON), pa.field("window_pos", pa.int32()), pa.field("log_ratio", pa.float32()),
                        pa.field("budget", pa.int32()), pa.field("scale", pa.float32())])
    pq.write_table(pa.Table.from_pydict(cols, schema=schema), tmp_path / "t.parquet")
    t = Q.Tables(Q.connect("1GB"), "unused", Q.parquet(str(tmp_path / "t.parquet")))
    assert Q.extra_columns(t) == {"window_pos": "INTEGER", "log_ratio": "FLOAT", "budget": "INTEGER", "scale": "FLOAT"}
    # constant columns (a fill value: the run's engine does not write them) get no panel
    assert Q.profile(t, "budget", "INTEGER") is None and Q.profile(t, "scale", "FLOAT") is None
    wp = Q.profile(t, "window_pos", "INTEGER")
    assert wp["kind"] == "values"
    assert [(r["value"], r["tokens"], r["accepted"]) for r in wp["rows"]] == [(0, 3, 2 / 3), (1, 2, 0.5), (2, 1, 0.0)]
    lr = Q.profile(t, "log_ratio", "FLOAT")                     # finite values in [-3, 0]: 10 bins of 0.3
    assert (lr["kind"], lr["lo"], lr["width"]) == ("bins", -3.0, pytest.approx(0.3))
    assert {(r["bin"], r["accepted"]): r["tokens"] for r in lr["rows"]} == {(0, False): 1, (8, True): 1, (9, True): 2,
                                                                            (9, False): 1}
    assert Q.calibration_draft(t) is None and Q.calibration_target(t) is None   # no probabilities logged
    assert Q.step_histogram(t) == {(2, 0): 1, (1, 0): 1}


# -- distances -------------------------------------------------------------------------------------------
def test_frechet_closed_forms():
    a, b = np.array([[0.0], [2.0]]), np.array([[1.0], [5.0]])
    assert distance.frechet(a, b) == pytest.approx((1 - 3) ** 2 + 2 + 8 - 2 * np.sqrt(2 * 8))   # = 6
    x = np.array([[1, 0], [-1, 0], [0, 2], [0, -2]], float)      # covariance diag(2/3, 8/3)
    y = np.array([[2, 0], [-2, 0], [0, 1], [0, -1]], float)      # covariance diag(8/3, 2/3)
    assert distance.frechet(x, y) == pytest.approx(20 / 3 - 2 * (4 / 3 + 4 / 3))               # = 4/3
    assert distance.frechet(x, x + [3.0, 4.0]) == pytest.approx(25.0)
    assert abs(distance.frechet(x, x)) < 1e-9


def test_frechet_matches_the_matrix_square_root_formula():
    from scipy import linalg
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(200, 6)), rng.normal(size=(150, 6)) @ rng.normal(size=(6, 6)) + 0.5
    sa, sb = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    ref = ((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(sa + sb - 2 * linalg.sqrtm(sa @ sb).real)
    assert distance.frechet(a, b) == pytest.approx(ref, rel=1e-9)


def test_precision_recall_hand_made():
    r = np.array([[0.0], [1], [2], [3], [4]])                    # k=1 balls: radius 1 around each
    g = np.array([[0.5], [10], [4.9], [-1.2]])                   # k=1 radii: 1.7, 5.1, 4.4, 1.7
    # precision: 0.5 and 4.9 fall in a reference ball, 10 and -1.2 do not; recall: every reference point
    # is in a generated ball (0, 1, 2 in -1.2's or 0.5's, 3 and 4 in 4.9's)
    assert distance.precision_recall(r, g, k=1) == (0.5, 1.0)
    assert distance.precision_recall(g, r, k=1) == (1.0, 0.5)
    r2 = np.vstack([r, [[20.0]]])                                # 20's ball (radius 16) takes in 10
    assert distance.precision_recall(r2, g, k=1)[0] == 0.75
    assert distance.precision_recall(r, g, k=2, chunk=2) == distance.precision_recall(r, g, k=2)


# -- runs and the whole report -----------------------------------------------------------------------------
def test_find_runs_and_baselines(runs):
    root, _ = runs
    found = find_runs([root])
    assert [p.name for p in found] == ["eagle2", "vanilla"]
    rs = load_runs(found, ["vanilla"])
    assert [r.label for r in rs] == ["vanilla", "eagle2"]        # baselines first
    pair_baselines(rs, {("eagle2", "vanilla"): 2}, ["vanilla"])
    assert rs[1].baseline is rs[0] and rs[0].baseline is None
    pair_baselines(rs, {("eagle2", "vanilla"): 0}, ["vanilla"])  # no shared prompt: no baseline
    assert rs[1].baseline is None
    rs[0].model = {"name": "llamagen"}                           # another model family: no baseline
    pair_baselines(rs, {("eagle2", "vanilla"): 2}, ["vanilla"])
    assert rs[1].baseline is None


def test_acceptance_is_what_the_engine_reported_never_a_default(tmp_path, pair_engines):
    """job.json of a cspd run has no engine.acceptance: the run's acceptance is what its images say (the
    engine's own `acceptance`), so λ = 42 is relaxed and only λ = 1 is exact; a run that reports nothing is
    `unknown`, not exact."""
    from workflows.bench_analyze import make_run, scene_pool
    for name, engine in pair_engines.items():
        make_run(tmp_path / name, "cspd_like", 8, 8, scene_pool(4, 0), 0)
        t = pq.read_table(tmp_path / name / "images")
        t = t.set_column(t.schema.get_field_index("acceptance"), "acceptance",
                         pa.array([engine.acceptance] * len(t), pa.string()))
        pq.write_table(t, tmp_path / name / "images" / "part-000000.parquet")
        assert "acceptance" not in json.loads((tmp_path / name / "job.json").read_text())["engine"]
    (tmp_path / "empty" / "images").mkdir(parents=True)
    (tmp_path / "empty" / "job.json").write_text(json.dumps({"engine": {"name": "cspd"}}))
    rs = {r.label: r for r in load_runs(find_runs([tmp_path]), ["mar"])}
    assert (rs["lam42"].acceptance, rs["lam42"].relaxed) == ("cspd(lam=42)", True)
    assert (rs["lam1"].acceptance, rs["lam1"].relaxed) == ("exact", False)
    assert (rs["mar"].acceptance, rs["mar"].relaxed) == ("exact", False)
    assert (rs["empty"].acceptance, rs["empty"].relaxed) == ("unknown", True)


@pytest.fixture(scope="module")
def pair_engines():
    """The real engines' reports: mar, cspd at its defaults (λ = 42) and at λ = 1, on tiny random MARs."""
    from decoding.engines import build_engine, engine_config
    from tests.test_cspd import bundle, tiny_mar
    b = bundle(tiny_mar(0), tiny_mar(1))
    return {"mar": build_engine(b, engine_config("mar", num_iter=8)),
            "lam42": build_engine(b, engine_config("cspd", num_iter=8)),
            "lam1": build_engine(b, engine_config("cspd", num_iter=8, lam=1.0, trajectory_terms=False))}


def test_report_end_to_end(tmp_path):
    """Synthetic runs of every family (bench_analyze's generator): the page is self-contained, shows each
    panel, and its numbers are the queries' and the distances'. The synthetic runs reuse the same
    rendered image for the same prompt, so every run's images equal vanilla's: distance 0, P = R = 1."""
    from workflows.bench_analyze import make_run, scene_pool
    from workflows.report import ReportConfig, build
    pool = scene_pool(16, 0)
    for engine in ("vanilla", "adt_tree", "lantern", "cspd_like"):
        make_run(tmp_path / "sweep" / engine, engine, 24, 8, pool, 0)
    (tmp_path / "sweep" / "sjd" / "images").mkdir(parents=True)          # a run with nothing committed yet
    (tmp_path / "sweep" / "sjd" / "job.json").write_text(json.dumps({"engine": {"name": "sjd"}}))
    out = build([tmp_path / "sweep"], ReportConfig(out=str(tmp_path / "report"), examples=1, side_by_side=2,
                                                   feature_images=20), command="test")
    page = (out / "index.html").read_text()
    assert not re.search(r"""(src|href)=["'](?!data:|#)""", page)   # nothing loaded from outside
    assert "http://" not in page and "https://" not in page
    for anchor in ("runs", "summary", "errors", "tau", "speed", "depth", "calibration", "cells", "flat",
                   "adherence", "distance", "family", "examples", "samples"):
        assert f'id="{anchor}"' in page
    assert "Not shown" not in page
    assert "Left out, no image committed yet: sjd." in page
    assert "window_pos" in page and "log_accept_ratio" in page
    s = {r["label"]: r for r in json.loads((out / "summary.json").read_text())["runs"]}
    assert [s[k]["baseline"] for k in ("vanilla", "adt_tree", "lantern", "cspd_like")] == [None] + ["vanilla"] * 3
    d = s["lantern"]["distance"]
    assert d["images"] == 20 and abs(d["frechet"]) < 1e-6 and d["precision"] == d["recall"] == 1.0
    tok = pq.read_table(tmp_path / "sweep" / "adt_tree" / "tokens").to_pandas()
    img = pq.read_table(tmp_path / "sweep" / "adt_tree" / "images").to_pandas()
    assert s["adt_tree"]["summary"][0]["tau_pooled"] == pytest.approx(len(tok) / img.target_forwards.sum(), abs=1e-6)
    assert s["adt_tree"]["summary"][0]["tau"] == pytest.approx(img.mean_accept_len.mean(), abs=1e-5)
    assert "features" not in s["adt_tree"] and "flat_share" not in s["adt_tree"]
    comp = s["adt_tree"]["versus"][0]
    assert comp["split"] == "all" and comp["compression"] == pytest.approx(24 * 256 / img.target_forwards.sum(), abs=1e-6)
    assert s["adt_tree"]["adherence"]["all"]["all"] == 1.0      # true renders of their captions
    assert s["cspd_like"]["calibration_draft"] is None and s["cspd_like"]["speculative"]
    assert s["cspd_like"]["acceptance"] == "cspd(lam=42)" and s["lantern"]["acceptance"] == "lantern"
    assert s["vanilla"]["acceptance"] == "exact"


def test_a_run_whose_every_prompt_failed_gets_a_page_of_its_errors(tmp_path):
    """Every prompt an error row (an empty images part, as the job commits it): the page lists the errors
    and says why each figure is missing; it once died drawing an empty τ histogram."""
    from workflows.report import ReportConfig, build
    _write_run(tmp_path, "failed", "adt_tree", [], {k: [] for k in SPEC}, errors=[
        {"prompt_id": "x", "prompt": "", "seed": 1, "engine": "adt_tree", "error": "empty prompt", "part": "p"}])
    out = build([tmp_path / "failed"], ReportConfig(out=str(tmp_path / "report")), command="test")
    page = (out / "index.html").read_text()
    assert "empty prompt" in page and "no run has an image yet (only error rows)" in page
    assert [e["prompts"] for e in json.loads((out / "summary.json").read_text())["runs"][0]["errors"]] == [1]


def test_a_prompt_with_dollar_signs_is_drawn_as_written(tmp_path):
    """Matplotlib reads $...$ as TeX: a prompt with "$\\frac{$" stopped the report with a parse error."""
    from workflows.report import ReportConfig, build
    images = [{**SPEC_IMAGES[0], "prompt": "a red circle for $5, $\\frac{$ and $x^$"}, SPEC_IMAGES[1]]
    run = _write_run(tmp_path, "dollars", "eagle2", images, SPEC)
    out = build([run], ReportConfig(out=str(tmp_path / "report"), examples=2, scorer=False), command="test")
    assert (out / "figures" / "examples_dollars.png").stat().st_size > 0


@pytest.mark.parametrize("table", ["images", "tokens"])
def test_a_damaged_part_is_one_line_naming_the_way_out(tmp_path, table):
    """A part cut short after the job committed it (a copy that stopped half-way): one line that points to
    workflows.verify, not a DuckDB or Arrow traceback."""
    from workflows.report import ReportConfig, build
    run = _write_run(tmp_path, "cut", "eagle2", SPEC_IMAGES, SPEC)
    part = run / table / "part-0.parquet"
    part.write_bytes(part.read_bytes()[:200])
    with pytest.raises(ConfigError) as e:
        build([run], ReportConfig(out=str(tmp_path / "report")), command="test")
    line = str(e.value)
    assert line.startswith("run_dirs: a part file cannot be read (") and "\n" not in line
    assert line.endswith("`python -m workflows.verify out_dir=RUN` lists a run's damaged parts, and the job's "
                         "next run over that out_dir regenerates them")


def test_cli_refuses_a_missing_folder_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "workflows.analyze", f"run_dir={tmp_path / 'nope'}"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: run_dirs: {tmp_path / 'nope'} is not a folder; give run "
                                                f"folders (out_dir of a generate job) or a folder of them"]


def test_bench_scores_attributes_and_their_paired_difference_from_the_baseline():
    """The bench's finer adherence: the share of a caption's attributes drawn right, and the engine's
    paired difference from the baseline on the same prompts (mean ± 1.96 standard errors)."""
    from workflows.bench import summarize

    def row(hits, split="flat"):
        s = dict(zip(("shape", "colour", "size", "position"), map(float, hits)))
        return {"split": split, "tau": 1.0, "steps": 1.0, "budget": 0.0, "plain": 1.0, "drafted": 0, "accepted": 0,
                "fallbacks": 0, "target_forwards": 4, "draft_forwards": 0, "wall_s": 1.0, "phase_s": {"forward": 1.0},
                "adherence": {**s, "all": float(all(hits))}, "batch": 0}
    base = [row([1, 1, 1, 1]), row([1, 0, 0, 0]), row([1, 1, 0, 0])]
    eng = [row([1, 1, 1, 0]), row([1, 0, 0, 0]), row([0, 0, 0, 0])]
    r = summarize({"base": base, "eng": eng}, {}, baseline="base")["all"]
    assert r["base"]["attributes"] == pytest.approx(0.583, abs=1e-3) and r["base"]["attributes_vs_baseline"] == [0, 0]
    diffs = np.array([-0.25, 0.0, -0.5])
    assert r["eng"]["attributes"] == pytest.approx(1 / 3, abs=1e-3)
    assert r["eng"]["attributes_vs_baseline"] == pytest.approx(
        [diffs.mean(), 1.96 * diffs.std(ddof=1) / np.sqrt(3)], abs=1e-3)
    assert r["eng"]["adherence"] == 0.0 and r["base"]["adherence"] == pytest.approx(1 / 3, abs=1e-3)


def test_bench_rounds_rotate_the_engines_and_count_every_image(monkeypatch, tiny_weights):
    """rounds=2 runs the prompts twice on each engine; from one batch to the next the engines' order
    rotates, so host drift over a run weighs on each alike; a round count below 1 is refused."""
    from hydra import compose, initialize_config_dir
    import workflows.bench as bench
    from workflows.config import one_line
    calls, build = [], bench.build_engine

    def traced(bundle, cfg):
        engine = build(bundle, cfg)
        run, name = engine.generate, len(calls)
        calls.append([])
        engine.generate = lambda *a, **k: calls[0].append(name) or run(*a, **k)
        return engine
    monkeypatch.setattr(bench, "build_engine", traced)
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("bench", overrides=["prompts=2", "batch_size=2", "rounds=2", "engines=[vanilla,again]",
                                          f"model.weights_dir={tiny_weights}", "model.dtype=float32",
                                          '+variants.again=["engine=vanilla"]'])
        bad = compose("bench", overrides=["rounds=0"])
        refused = {o: compose("bench", overrides=[o]) for o in ("prompts=0", "batch_sizes=[4,0]", "threads=0",
                                                                   "engines=[vanilla,nope]")}
        with pytest.raises(Exception) as unknown:                   # the bench's config has no schema class
            compose("bench", overrides=["out_dir=/tmp/x"])
    assert one_line(unknown.value) == ("out_dir: the config has no setting 'out_dir'; its settings are baseline, batch_size, "
                                       "batch_sizes, engines, model, out, prompt_seed, prompts, rounds, seed, threads, variants")
    report = bench.run_bench(cfg)
    assert calls[0] == [0, 1, 1, 0]                             # engine 0 first, then engine 1 first
    assert {n: r["images"] for n, r in report["results"]["all"].items()} == {"vanilla": 4, "again": 4}
    with pytest.raises(ConfigError, match="rounds=0: must be >= 1"):
        bench.run_bench(bad)
    for override, cfg in refused.items():                       # each one line, before anything loads
        with pytest.raises(ConfigError, match=re.escape(override.split("=")[0] + "=")):
            bench.check(cfg)
