"""The analysis report of one or more runs (`python -m workflows.analyze`): a self-contained HTML page
with figures, plus summary.json. runs.py finds and pairs the runs, queries.py computes over their
Parquet folders with DuckDB, images.py makes one pass over the images (flat cells, adherence, features),
distance.py compares image distributions, plots.py and html.py draw, build.py puts it together."""
from workflows.report.build import ReportConfig, build

__all__ = ["ReportConfig", "build"]
