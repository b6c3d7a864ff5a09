"""The analysis report: `python -m workflows.analyze run_dir=runs/shapes/adt_tree`, or several runs side
by side: `run_dirs=[runs/shapes/vanilla,runs/shapes/eagle2]`, or a sweep's parent folder
`run_dir=runs/sweep` (every run folder in it).

Writes <out>/index.html (self-contained: open it in a browser, no server) and <out>/summary.json, with
out = <run_dir>/report for one run and <common parent>/report for several (`out=...` to choose). What
the page shows and how each number is defined: docs/design.md, "Analysis report"; the code:
workflows/report/.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from workflows.config import ConfigError, cli, one_line_errors, to_object
from workflows.report import ReportConfig, build

log = logging.getLogger("arspec.analyze")


@dataclass
class AnalyzeConfig(ReportConfig):
    run_dir: Optional[str] = None        # a run folder, or a folder of run folders (a sweep)
    run_dirs: list = field(default_factory=list)


ConfigStore.instance().store(name="analyze_schema", node=AnalyzeConfig)


def inputs(c: AnalyzeConfig) -> list[str]:
    paths = ([c.run_dir] if c.run_dir else []) + list(c.run_dirs)
    if not paths:
        raise ConfigError("run_dir / run_dirs: give a run folder (run_dir=runs/shapes/adt_tree), a list "
                          "(run_dirs=[A,B]) or a sweep's parent folder")
    return paths


@hydra.main(version_base="1.3", config_path="../conf", config_name="analyze")
@one_line_errors
def main(cfg: DictConfig) -> None:
    c: AnalyzeConfig = to_object(cfg)
    out = build(inputs(c), c)
    html = out / "index.html"
    log.info(f"[analyze] wrote {html} ({html.stat().st_size / 1e6:.2f} MB) and {out / 'summary.json'}")
    print(html)


if __name__ == "__main__":
    cli(main)
