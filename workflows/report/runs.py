"""Which runs a report covers: finding run folders, naming them, and pairing each with its baseline.

A run folder is an out_dir of `workflows.generate` (docs/design.md, "Output contract"): it holds
`images/` and `job.json`. A report takes one, a list, or a folder whose subfolders are runs (a sweep's
parent, e.g. `out_dir=runs/sweep/${engine.name}` with `-m engine=...`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from actors.store import ObjPath, StoreConfigError, at, entries, source
from workflows.config import ConfigError


@dataclass
class Run:
    path: Path
    label: str                      # unique within the report: the folder name, with its parent if needed
    engine: str                     # engine.name from job.json
    acceptance: str                 # exact | lantern | cspd(lam=42) | ... as the engine reported it (`reported_acceptance`)
    model: dict                     # the model settings from job.json (family name first)
    settings: dict = field(default_factory=dict)   # the engine's settings from job.json
    seed: int | None = None
    batch_size: int | None = None   # from summary.json, when the job wrote one
    resolved: dict | None = None    # model.device and model.dtype as the actors resolved them (job.json)
    baseline: "Run | None" = None   # the non-speculative run of the same prompts it is compared with

    @property
    def relaxed(self) -> bool:
        """Only a run whose engine reported exact acceptance for every image is lossless."""
        return self.acceptance != "exact"

    def glob(self, table: str) -> str | ObjPath | None:
        """DuckDB glob of a table's parts, or None when the run has none (e.g. no errors/). A run on an object
        store: the table's prefix (queries.source reads it through the store's pyarrow filesystem)."""
        d = self.path / table
        if isinstance(d, ObjPath):
            return d if any(n.endswith(".parquet") for n in entries(d)) else None
        return str(d / "*.parquet") if d.is_dir() and any(d.glob("*.parquet")) else None


def is_run(path: Path) -> bool:
    return (path / "job.json").is_file() and (path / "images").is_dir()


def _at(p):
    try:
        return at(p)
    except StoreConfigError as e:
        raise ConfigError(f"run_dirs: {e}") from None


def find_runs(paths: list[str | Path]) -> list[Path]:
    """Each path is a run folder, or a folder whose direct subfolders include runs (a sweep); a folder may
    be a prefix on an object store (s3://bucket/runs/x, actors/store.py)."""
    found = []
    for p in map(_at, paths):
        if not p.is_dir():
            raise ConfigError(f"run_dirs: {p} is not a folder; give run folders (out_dir of a generate job) "
                              f"or a folder of them")
        subs = [p] if is_run(p) else sorted(q for q in p.iterdir() if q.is_dir() and is_run(q))
        if not subs:
            raise ConfigError(f"run_dirs: {p} holds no run (a run folder has images/ and job.json, as "
                              f"`python -m workflows.generate out_dir=...` writes them)")
        key = lambda q: q if isinstance(q, ObjPath) else q.resolve()   # noqa: E731
        found += [q for q in subs if key(q) not in {key(f) for f in found}]
    return found


def non_default_settings(r: Run) -> dict:
    """The run's engine settings that differ from its engine's defaults (all of them when this checkout
    does not know the engine); sampling fields left null (the family's default) are dropped."""
    import dataclasses
    from decoding.engines import ENGINES
    flat = lambda d, pre="": {k2: v2 for k, v in d.items()  # noqa: E731
                              for k2, v2 in (flat(v, f"{pre}{k}.") if isinstance(v, dict) else {f"{pre}{k}": v}).items()}
    mine = {k: v for k, v in flat(r.settings).items() if k != "name" and v is not None}
    engine = ENGINES.get(r.engine)
    if engine is None:
        return mine
    default = flat(dataclasses.asdict(engine.Config()))
    return {k: v for k, v in mine.items() if k not in default or default[k] != v}


def reported_acceptance(path: Path) -> str:
    """What the engine said its acceptance is: the images table's `acceptance` column (each image's engine
    writes it), else summary.json's; `unknown` when neither exists, several values joined by `+`. Never a
    default: a setting missing from job.json says nothing about the engine (cspd has no such setting)."""
    import pyarrow.parquet as pq
    parts = [path / "images" / n for n in sorted(entries(path / "images")) if n.endswith(".parquet")]
    seen = set()
    for p in parts:
        if "acceptance" in pq.read_schema(source(p)).names:
            seen |= {v for v in pq.read_table(source(p), columns=["acceptance"]).column(0).to_pylist() if v}
    if not seen and (path / "summary.json").is_file():
        v = json.loads((path / "summary.json").read_text()).get("acceptance")
        seen = set(v) if isinstance(v, list) else {v} if v else set()
    return "+".join(sorted(seen)) or "unknown"


def _labels(paths: list[Path]) -> list[str]:
    labels = [p.name for p in paths]
    if len(set(labels)) < len(labels):
        labels = [f"{p.parent.name}/{p.name}" for p in paths]
    if len(set(labels)) < len(labels):
        labels = [str(p) for p in paths]
    return labels


def load_runs(paths: list[Path], baselines: list[str]) -> list[Run]:
    """Runs with their metadata; baselines (engine names such as vanilla) first, then in the given order."""
    runs = []
    for p, label in zip(paths, _labels(paths)):
        job = json.loads((p / "job.json").read_text())
        summary = json.loads((p / "summary.json").read_text()) if (p / "summary.json").is_file() else {}
        engine = job.get("engine", {})
        runs.append(Run(p, label, engine.get("name", "?"), reported_acceptance(p), job.get("model", {}),
                        engine, job.get("seed"), summary.get("batch_size"), job.get("resolved")))
    runs.sort(key=lambda r: r.engine not in baselines)
    return runs


def pair_baselines(runs: list[Run], matched: dict[tuple[str, str], int], baselines: list[str]) -> None:
    """Give each run the baseline run (engine in `baselines`, same model family) that shares the most
    (prompt_id, seed) pairs with it; matched[(run label, baseline label)] counts them."""
    for r in runs:
        if r.engine in baselines:
            continue
        cands = [b for b in runs if b is not r and b.engine in baselines and b.model.get("name") == r.model.get("name")
                 and matched.get((r.label, b.label), 0) > 0]
        r.baseline = max(cands, key=lambda b: matched[(r.label, b.label)], default=None)
