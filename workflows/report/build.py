"""Build the report of one or more runs: the numbers (queries, one image pass per run, distances), the
figures and the page; index.html and summary.json in the report folder.

Per run it works from the columns every engine family writes, so trees, Jacobi windows and continuous
tokens all get the summary, τ, errors, speed against the baseline, per-cell maps, flat vs busy cells and
adherence; the tree and draft-probability panels appear when a run logs tree depths and draft
probabilities, and a column a family adds is profiled against acceptance (report.queries).
"""
from __future__ import annotations

import dataclasses
import json
import resource
import shlex
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import pyarrow as pa

from workflows.config import ConfigError
from workflows.report import distance, html as H, plots, queries as Q
from workflows.report.images import decode, scan
from workflows.report.runs import Run, find_runs, load_runs, non_default_settings, pair_baselines


@dataclass
class ReportConfig:
    out: Optional[str] = None            # report folder; null = <run>/report, or <common parent>/report
    examples: int = 3                    # images per speculative run shown with their per-cell maps
    side_by_side: int = 8                # prompts shown across all runs
    feature_images: int = 5000           # images per run for the distances (the same prompts in each run)
    pr_k: int = 3                        # neighbours of the precision / recall manifolds
    scorer: bool = True                  # prompt adherence and distance features (the family's scorer)
    baselines: list = field(default_factory=lambda: ["vanilla", "mar"])   # non-speculative engines
    memory_limit: str = "2GB"            # DuckDB's; past it aggregates spill to <out>/.duckdb_tmp
    threads: Optional[int] = None        # DuckDB threads; null = all cores
    image_batch: int = 512               # images decoded at a time


def default_out(paths: list[Path]) -> Path:
    """Beside the run(s); for runs on an object store a local folder, reports/<their names>."""
    from actors.store import ObjPath
    if any(isinstance(p, ObjPath) for p in paths):
        return Path("reports") / "+".join(p.name for p in paths)[:100]
    if len(paths) == 1:
        return paths[0] / "report"
    parts = [p.resolve().parts for p in paths]
    common = [a for a, *rest in zip(*parts) if all(a == b for b in rest)]
    return Path(*common) / "report"


def _scorer(run: Run, cache: dict):
    """The run's model family scorer (None where the family has none), built from its job.json settings."""
    from decoding.registry import family
    key = json.dumps(run.model, sort_keys=True)
    if key not in cache:
        try:
            fam = family(run.model.get("name", ""))
        except ValueError:
            cache[key] = None
            return None
        names = {f.name for f in dataclasses.fields(fam.config)}
        cfg = fam.config(**{k: v for k, v in run.model.items() if k in names})
        cache[key] = fam.scorer(cfg) if fam.scorer else None
        if cache[key] is not None:
            cache[key].eval()
    return cache[key]


def _adherence(table, attributes: list[str]) -> dict[str, dict[str, float]]:
    """{split: {attribute: mean over scored images}} with 'all' the whole run."""
    if not attributes:
        return {}
    split = np.asarray(table.column("split").to_pylist(), dtype=object)
    out = {}
    for s in ["all", *sorted({x for x in split if x is not None})]:
        sel = np.ones(len(split), bool) if s == "all" else split == s
        vals = {a: table.column(f"adh_{a}").to_numpy()[sel] for a in attributes}
        if np.isfinite(vals["all"]).any():
            out[s] = {a: float(np.nanmean(v)) for a, v in vals.items()}
            out[s]["images"] = int(np.isfinite(vals["all"]).sum())
    return out


class _Clock:
    """Seconds per named stage, for the progress lines (bench_analyze reports them)."""
    def __init__(self):
        self.t0 = self.last = time.perf_counter()
        self.stages = []

    def __call__(self, name: str):
        now = time.perf_counter()
        self.stages.append((name, now - self.last, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024))
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.t0

    def __str__(self):
        return ", ".join(f"{n} {s:.1f} s" for n, s, _ in self.stages) + "; peak RSS after each: " + \
            ", ".join(f"{m:.0f}" for _, _, m in self.stages) + " MB"


def collect(runs: list[Run], con, cfg: ReportConfig) -> tuple[dict, dict]:
    """Every number of the report per run label, and each run's DuckDB tables."""
    tabs = {r.label: Q.Tables(con, *(Q.source(con, r.glob(t)) for t in ("images", "tokens", "errors")))
            for r in runs}
    matched = {(r.label, b.label): Q.matched(tabs[r.label], tabs[b.label])
               for r in runs for b in runs if r is not b and b.engine in cfg.baselines and r.engine not in cfg.baselines}
    pair_baselines(runs, matched, cfg.baselines)
    scorers, data = {}, {}
    for i, r in enumerate(runs):
        t = tabs[r.label]
        clock = _Clock()
        d = data[r.label] = {"summary": Q.image_summary(t), "tau": Q.tau_values(t), "errors": Q.errors(t)}
        d["versus"] = Q.versus(t, tabs[r.baseline.label]) if r.baseline else None
        if d["versus"] and not (r.batch_size == 1 and r.baseline.batch_size == 1):
            for v in d["versus"]:          # engine seconds are per batch, shared by its images: a split's
                if v["split"] != "all":    # own seconds exist only at batch size 1
                    v["speedup"] = None
        d["speculative"] = Q.speculative(t)
        clock("images table")
        if t.tok is not None:
            d["cells"] = Q.cells(t)
            d["extra"] = {c: Q.profile(t, c, ty) for c, ty in Q.extra_columns(t).items()}
            clock("cells")
        if t.tok is not None and d["speculative"]:
            hist = Q.step_histogram(t)
            d["steps"] = hist and {f"{a},{dd}": n for (a, dd), n in sorted(hist.items())}
            d["depth_acceptance"] = Q.depth_acceptance(hist) if hist else None
            clock("steps")
            d["by_tree_depth"] = Q.by_value(t, "tree_depth") if t.has("tree_depth") else None
            d["by_tree_width"] = Q.by_value(t, "tree_width") if t.has("tree_width") else None
            d["calibration_draft"] = Q.calibration_draft(t)
            d["calibration_target"] = Q.calibration_target(t)
            clock("tokens by depth, width, probability")
        scorer = _scorer(r, scorers) if cfg.scorer else None
        ids = set(Q.first_ids(t, cfg.feature_images)) if scorer is not None and cfg.feature_images > 1 else set()
        facts = scan(r.path / "images", scorer, ids, cfg.image_batch)
        clock("image pass")
        name = f"flat_{i}"
        con.register(name, facts.table)
        d["flat_busy"] = Q.flat_busy(t, name) if t.tok is not None and d["speculative"] else None
        clock("flat/busy join")
        d["flat_share"] = facts.flat_share
        d["adherence"] = _adherence(facts.table, facts.attributes)
        d["features"] = facts.features
        d["seconds"] = clock.total()
        print(f"[analyze] {r.label}: {d['summary'][0]['images'] if d['summary'] else 0} images in {d['seconds']:.1f} s "
              f"({clock})", file=sys.stderr)
    for r in runs:
        d, b = data[r.label], r.baseline
        d["distance"] = None
        if b is not None and d["features"] and data[b.label]["features"]:
            common = sorted(set(d["features"]) & set(data[b.label]["features"]))
            if len(common) > max(cfg.pr_k, 2):
                x = np.stack([data[b.label]["features"][p] for p in common])
                y = np.stack([d["features"][p] for p in common])
                prec, rec = distance.precision_recall(x, y, cfg.pr_k)
                d["distance"] = {"baseline": b.label, "images": len(common), "frechet": distance.frechet(x, y),
                                 "precision": prec, "recall": rec}
    return data, tabs


# -- the page -------------------------------------------------------------------------------------------
def _settings_line(r: Run) -> str:
    return ", ".join(f"{k}={v}" for k, v in non_default_settings(r).items()) or "defaults"


def _summary_rows(runs, data) -> list[list]:
    rows = []
    for r in runs:
        d = data[r.label]
        vs = {v["split"]: v for v in (d["versus"] or [])}
        fb = {(x["split"], x["cell"]): x for x in (d.get("flat_busy") or [])}
        for s in d["summary"]:
            v, a = vs.get(s["split"], {}), d["adherence"].get(s["split"], {})
            rows.append([H.esc(r.label), H.esc(s["split"]), s["images"], H.fmt(s["tau"]),
                         f'{H.fmt(s["tau_p50"], 2)} [{H.fmt(s["tau_p10"], 2)}, {H.fmt(s["tau_p90"], 2)}]',
                         H.fmt(s["tau_pooled"]),
                         H.fmt(s["target_forwards"], 1), H.fmt(s["draft_forwards"], 1), H.fmt(s["s_per_image"]),
                         H.fmt(v.get("compression")), H.fmt(v.get("speedup")),
                         H.pct(fb.get((s["split"], "flat"), {}).get("accepted")),
                         H.pct(fb.get((s["split"], "busy"), {}).get("accepted")), H.pct(a.get("all"))])
    return rows


def page(runs: list[Run], data: dict, figs: dict, samples: dict, examples: dict, cfg: ReportConfig, command: str,
         skipped: list[str]) -> str:
    S = []
    # runs
    rows = [[H.esc(r.label), f"<code>{H.esc(r.path)}</code>", H.esc(r.engine), H.esc(r.acceptance),
             H.esc(_settings_line(r)), r.seed, r.batch_size or "—",
             H.esc(" ".join(r.resolved.values())) if r.resolved else "—",
             data[r.label]["summary"][0]["images"] if data[r.label]["summary"] else 0,
             sum(e["prompts"] for e in data[r.label]["errors"]), H.esc(r.baseline.label if r.baseline else "—")]
            for r in runs]
    low = sorted({r.resolved["dtype"] for r in runs if r.resolved and r.resolved["dtype"] != "float32"})
    note = (f"<p>Runs in {', '.join(low)}: a speculative engine's tokens can differ from its baseline's there "
            f"(a forward over a tree rounds differently from one over a single token), while the distribution is "
            f"the same (exact acceptance); compare quality by the scores, not by identical pixels. In float32 an "
            f"exact engine's tokens are its baseline's.</p>") if low else ""
    S.append(("runs", "Runs", H.table(["run", "folder", "engine", "acceptance", "engine settings", "seed", "batch",
                                        "device, dtype", "images", "errors", "baseline"], rows, left=5) + note))
    # summary
    S.append(("summary", "Summary", H.table(
        ["run", "split", "images", "τ mean", "τ median [p10, p90]", "τ pooled", "target fwd / image",
         "draft fwd / image", "engine s / image", "step compression", "speedup", "accepted, flat cells", "accepted, busy cells",
         "adherence (all attributes)"], _summary_rows(runs, data), left=2)
        + '<p class="muted">τ: tokens committed per target forward, per image (mean and percentiles over images); pooled: all tokens ÷ all target forwards. '
          "Step compression and speedup are against the baseline run on the same (prompt, seed) pairs: Σ baseline "
          "target forwards ÷ Σ this run's, and Σ baseline engine seconds ÷ Σ this run's. Those seconds are each "
          "image's share of its batch's wall time from the actors' clocks: they carry the batch size and how busy "
          "the host was during each run; <code>python -m workflows.bench</code> times engines interleaved in one "
          "process. Accepted: share of tokens taken from the draft.</p>"))
    # errors
    err_rows = [[H.esc(r.label), e["prompts"], H.esc(e["error"]), H.esc(e["example"])]
                for r in runs for e in data[r.label]["errors"]]
    S.append(("errors", "Errors", H.table(["run", "prompts", "reason (first line)", "example prompt_id"], err_rows, left=1)
              if err_rows else "<p>No prompt failed in any run.</p>"))
    # figures
    cap = {
        "tau": "Each run's τ over its images; dashed: the mean. Vanilla commits one token per forward (τ = 1).",
        "versus": "Bars per split (image set) and overall; 1 is the baseline's own cost. Speed is the job's wall "
                  "time per image, see the note under the summary; it is shown per split only when both runs used "
                  "batch size 1 (a batch's time is shared by its images, which mix splits).",
        "depth": "Left: of the speculative steps that had accepted k−1 drafts and whose tree reached depth k, the "
                 "share that accepted a k-th (for runs without tree depths, every step that got that far). Right: "
                 "the share of tokens taken from the draft, by the depth d of the tree that produced them (ADT-Tree "
                 "picks d per step; EAGLE-2's is fixed, and shorter only where fewer tokens are left at the end of an image).",
        "calibration": "Left: accepted drafts in bins of their draft probability q (0.1 wide): the mean target "
                       "probability p of the same tokens against the mean q. On the diagonal the drafter is "
                       "calibrated; below it, over-confident. The log holds committed tokens only, so drafts the target "
                       "rejected are not in it, and acceptance per q bin cannot be read from it. Right: all committed "
                       "tokens in bins of their target probability p: the share the draft proposed and the target "
                       "accepted.",
        "cells": "Averages over every image of a run at each grid cell (row 0 at the top). Flat cells: the cell's "
                 "pixels and its 4 neighbours' mean colours are within 12 grey levels of its mean colour; busy: object "
                 "edges, speckle.",
        "flat": "Tokens on flat and busy cells of their own image (cells decided from the generated pixels).",
        "adherence": "The model family's scorer reads each generated image and compares it with the attributes the "
                     "prompt asks for; 'all' needs every attribute right. Error bars: ±1 binomial standard error.",
        "distance": "Features: the shapes scorer's penultimate layer (256 values after its last hidden Linear + GELU, "
                    "the input of its attribute heads), on the same prompts in both runs. Fréchet distance of the "
                    "Gaussians fitted to the two feature sets (FID's formula); precision / recall as in Kynkäänniemi "
                    f"et al. 2019 with k = {cfg.pr_k}. Lossless runs sample vanilla's distribution with other draws: their "
                    "numbers are the noise floor a relaxed run should be read against. The Fréchet distance of finite "
                    f"samples is biased upwards, more so with few images per feature ({_feature_dim(data)} features): "
                    "compare runs at the same number of images only.",
    }
    for key, anchor, title in (("tau", "tau", "τ per image"), ("versus", "speed", "Against the baseline"),
                               ("depth", "depth", "Acceptance by tree depth"),
                               ("calibration", "calibration", "Draft and target probabilities"),
                               ("cells", "cells", "Per grid cell"), ("flat", "flat", "Flat vs busy cells"),
                               ("adherence", "adherence", "Prompt adherence"),
                               ("distance", "distance", "Distance to the baseline's images")):
        body = H.figure(figs[key], cap[key], title) if key in figs else \
            f'<p class="muted">Not shown: {H.esc(figs.get("why_" + key, "no run has the columns it needs"))}.</p>'
        if key == "adherence" and key in figs:
            body += _adherence_table(runs, data)
        if key == "distance" and key in figs:
            body += _distance_table(runs, data)
        S.append((anchor, title, body))
    # family columns
    if figs.get("extra"):
        S.append(("family", "Engine-family columns", "".join(
            H.figure(p, f"<code>{H.esc(c)}</code>: values as logged; integer columns with few values show the share "
                        f"accepted per value, others a histogram of accepted and other tokens.", c)
            for c, p in figs["extra"].items())))
    # examples
    if examples:
        S.append(("examples", "Examples", "".join(H.figure(p, f"{H.esc(label)}: the image, the cells whose token was "
                                                              f"accepted from the draft, and the depth of the tree "
                                                              f"that produced each token.", label)
                                                     for label, p in examples.items())))
    # side by side
    if samples["ids"]:
        head = ["prompt"] + [H.esc(r.label) for r in runs]
        rows = [[H.esc(samples["prompt"][p]) + f'<br><span class="muted">{H.esc(p)}</span>']
                + [H.img(samples["png"][r.label][p], f"{r.label} {p}") + f'<span class="muted">τ {H.fmt(samples["tau"][r.label].get(p), 2)}</span>'
                   for r in runs] for p in samples["ids"]]
        S.append(("samples", "Same prompt, every run", H.table(head, rows, left=1, cls="sbs")
                  + '<p class="muted">The same prompt and seed in each run (shown at 2× with square pixels).</p>'))
    else:
        S.append(("samples", "Same prompt, every run", "<p>No prompt is in every run.</p>"))
    sub = (f"{len(runs)} run(s), generated {time.strftime('%Y-%m-%d %H:%M')} by <code>{H.esc(command)}</code>. "
           f"Every number comes from the runs' Parquet folders; summary.json beside this page holds them all."
           + (f" Left out, no image committed yet: {H.esc(', '.join(skipped))}." if skipped else ""))
    return H.page("arspec run report", sub, S)


def _feature_dim(data: dict) -> int | None:
    return next((len(v) for d in data.values() for v in d["features"].values()), None)


def _adherence_table(runs, data) -> str:
    rows = []
    for r in runs:
        for s, a in data[r.label]["adherence"].items():
            rows.append([H.esc(r.label), H.esc(s), a["images"]] + [H.pct(v) for k, v in a.items() if k != "images"])
    attrs = next((list(a) for r in runs for a in data[r.label]["adherence"].values()), [])
    return H.table(["run", "split", "scored images"] + [("all attributes" if k == "all" else k) for k in attrs if k != "images"],
                   rows, left=2)


def _distance_table(runs, data) -> str:
    rows = [[H.esc(r.label), f"relaxed: {H.esc(r.acceptance)}" if r.relaxed else "exact", H.esc(d["baseline"]), d["images"], H.fmt(d["frechet"]),
             H.pct(d["precision"]), H.pct(d["recall"])]
            for r in runs if (d := data[r.label]["distance"])]
    return H.table(["run", "acceptance", "against", "images", "Fréchet distance", "precision", "recall"], rows, left=3)


# -- figures -------------------------------------------------------------------------------------------
def figures(runs: list[Run], data: dict, cfg: ReportConfig) -> dict:
    col = plots.colours([r.label for r in runs])
    taus = {r.label: data[r.label]["tau"] for r in runs}
    figs = {"tau": plots.tau_hist(taus, col)} if any(len(v) for v in taus.values()) else \
        {"why_tau": "no run has an image yet (only error rows)"}
    vs = {r.label: data[r.label]["versus"] for r in runs if data[r.label]["versus"]}
    if vs:
        figs["versus"] = plots.versus(vs, {r.label: r.baseline.label for r in runs if r.baseline}, col)
    else:
        figs["why_versus"] = "no baseline run (engine vanilla or mar) shares prompts and seeds with another run"
    paths = {r.label: data[r.label]["depth_acceptance"] for r in runs if data[r.label].get("depth_acceptance")}
    shapes = {r.label: [x for x in data[r.label]["by_tree_depth"] if x["value"] > 0] for r in runs
              if data[r.label].get("by_tree_depth") and any(x["value"] > 0 for x in data[r.label]["by_tree_depth"])}
    if paths:
        figs["depth"] = plots.depth_acceptance(paths, shapes, col)
    else:
        figs["why_depth"] = "no run has speculative steps (all tokens come from step 0 or a non-speculative engine)"
    cd = {r.label: data[r.label]["calibration_draft"] for r in runs if data[r.label].get("calibration_draft")}
    ct = {r.label: data[r.label]["calibration_target"] for r in runs
          if data[r.label].get("calibration_target")}
    if cd or ct:
        figs["calibration"] = plots.calibration(cd, ct, col)
    else:
        figs["why_calibration"] = "no run logs draft and target probabilities of speculative steps"
    cells = {r.label: _cell_maps(data[r.label]) for r in runs if data[r.label].get("cells")}
    if cells:
        figs["cells"] = plots.cell_maps(cells, {r.label: data[r.label]["flat_share"] for r in runs
                                                if data[r.label]["flat_share"] is not None})
    fb = {r.label: data[r.label]["flat_busy"] for r in runs if data[r.label].get("flat_busy")}
    if fb:
        figs["flat"] = plots.flat_busy(fb, col)
    else:
        figs["why_flat"] = "no speculative run"
    adh = {r.label: {k: v for k, v in data[r.label]["adherence"]["all"].items() if k != "images"}
           for r in runs if data[r.label]["adherence"].get("all")}
    if adh:
        figs["adherence"] = plots.adherence(adh, {r.label: data[r.label]["adherence"]["all"]["images"] for r in runs
                                                  if r.label in adh}, col)
    else:
        figs["why_adherence"] = "the runs' model family has no scorer, or their prompts are not ones it reads"
    dist = [dict(run=r.label, relaxed=r.relaxed, **data[r.label]["distance"]) for r in runs if data[r.label]["distance"]]
    if dist:
        figs["distance"] = plots.distances(dist, col, cfg.pr_k)
    else:
        figs["why_distance"] = "needs a baseline run and a scorer with features (the shapes family has one)"
    extra = {}
    for c in sorted({c for r in runs for c in (data[r.label].get("extra") or {})}):
        prof = {r.label: p for r in runs if (p := (data[r.label].get("extra") or {}).get(c))}
        if prof:
            extra[c] = plots.profile(c, prof, col)
    figs["extra"] = extra
    return figs


def _cell_maps(d: dict) -> dict:
    m = dict(d["cells"])
    for k in ("tree_depth", "tree_width"):
        if k in m and not (np.asarray(m[k]) > 0).any():   # NaN compares False
            del m[k]                                   # not a tree engine: nothing to map
    if not d.get("speculative"):
        m.pop("accepted", None)                        # no speculative step: nothing is accepted
    return m


def samples(runs: list[Run], tabs: dict, data: dict, n: int) -> dict:
    """Up to n prompts that every run generated, in the hash order of their ids."""
    out = {"ids": [], "prompt": {}, "png": {r.label: {} for r in runs}, "tau": {r.label: {} for r in runs}}
    if n <= 0:
        return out
    cand = Q.first_ids(tabs[runs[0].label], 16 * n)
    got = {r.label: Q.image_bytes(tabs[r.label], cand) for r in runs}
    ids = [p for p in cand if all(p in got[r.label] for r in runs)][:n]
    out["ids"] = ids
    for r in runs:
        taus = dict(tabs[r.label].con.execute(
            f"SELECT prompt_id, mean_accept_len FROM {tabs[r.label].img} WHERE prompt_id IN ({', '.join('?' * len(ids))})",
            ids).fetchall()) if ids else {}
        for p in ids:
            out["png"][r.label][p] = got[r.label][p][0]
            out["prompt"][p] = got[r.label][p][1]
            out["tau"][r.label][p] = taus.get(p)
    return out


def example_figures(runs: list[Run], tabs: dict, data: dict, n: int) -> dict:
    out = {}
    for r in runs:
        t = tabs[r.label]
        if n <= 0 or t.tok is None or not data[r.label].get("speculative"):
            continue
        ids = Q.first_ids(t, n)
        got = Q.image_bytes(t, ids)
        items = [(decode(got[p][0]), got[p][1], m) for p in ids if p in got and (m := Q.image_tokens(t, p))]
        if items:
            depths = [m["tree_depth"] for _, _, m in items if "tree_depth" in m]   # NaN off tree steps
            depth = max((float(np.nanmax(d)) for d in depths if np.isfinite(d).any()), default=1)
            out[r.label] = plots.examples(r.label, items, depth)
    return out


# -- entry ----------------------------------------------------------------------------------------------
def _per_run(d: dict) -> dict:
    """A run's numbers for summary.json, less the per-image arrays (τ of every image, feature vectors,
    flat-cell shares) that the figures were drawn from: only a run's top level holds them, so a summary
    row's own "tau" stays."""
    return {k: v for k, v in d.items() if k not in ("features", "tau", "flat_share")}


def _jsonable(x):
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return [_jsonable(v) for v in x.tolist()]
    if isinstance(x, (np.floating, float)):
        return None if not np.isfinite(x) else round(float(x), 6)
    if isinstance(x, np.integer):
        return int(x)
    return x


def build(paths: list, cfg: ReportConfig, command: str | None = None) -> Path:
    """Write <out>/index.html, <out>/summary.json and <out>/figures/*.png for the runs under `paths`;
    returns <out>. A part file that cannot be read is one line: the reader's message and the way out."""
    try:
        return _build(paths, cfg, command)
    except (Q.duckdb.Error, pa.ArrowException) as e:
        raise ConfigError(f"run_dirs: a part file cannot be read ({str(e).splitlines()[0]}); `python -m "
                          f"workflows.verify out_dir=RUN` lists a run's damaged parts, and the job's next run "
                          f"over that out_dir regenerates them") from None


def _build(paths: list, cfg: ReportConfig, command: str | None) -> Path:
    found = find_runs(paths)
    runs = load_runs(found, list(cfg.baselines))
    skipped = [r.label for r in runs if r.glob("images") is None]        # nothing committed yet
    runs = [r for r in runs if r.glob("images") is not None]
    if not runs:
        raise ConfigError(f"run_dirs: no image has been committed in {', '.join(map(str, found))} yet; "
                          f"run the job first")
    out = Path(cfg.out) if cfg.out else default_out(found)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / ".duckdb_tmp"
    con = Q.connect(cfg.memory_limit, str(tmp), cfg.threads)
    try:
        data, tabs = collect(runs, con, cfg)
        clock = _Clock()
        figs = figures(runs, data, cfg)
        clock("figures")
        side = samples(runs, tabs, data, cfg.side_by_side)
        clock("side by side")
        ex = example_figures(runs, tabs, data, cfg.examples)
        clock("examples")
    finally:
        con.close()
        shutil.rmtree(tmp, ignore_errors=True)
    fdir = out / "figures"                                # the same figures as files, for docs and slides
    fdir.mkdir(exist_ok=True)
    for name, png in [*((k, v) for k, v in figs.items() if isinstance(v, bytes)),
                      *((f"family_{k}", v) for k, v in figs.get("extra", {}).items()),
                      *((f"examples_{k}", v) for k, v in ex.items())]:
        (fdir / f"{name.replace('/', '_')}.png").write_bytes(png)
    print(f"[analyze] page: {clock.total():.1f} s ({clock})", file=sys.stderr)
    command = command or " ".join(shlex.quote(a) for a in ["python", "-m", "workflows.analyze", *sys.argv[1:]])
    (out / "index.html").write_text(page(runs, data, figs, side, ex, cfg, command, skipped))
    summary = {"runs": [{"label": r.label, "path": str(r.path), "engine": r.engine, "acceptance": r.acceptance,
                         "baseline": r.baseline.label if r.baseline else None, **_jsonable(_per_run(data[r.label]))} for r in runs]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return out
