"""Offline analysis of a run: `python -m workflows.analyze run_dir=runs/shapes/adt_tree [examples=6]`.

Reads out_dir/images and out_dir/tokens and writes out_dir/analysis/:
  summary.json   images, errors, τ, prompt adherence (shapes scorer), acceptance and tree depth on
                 flat vs busy cells, all per split (flat / textured backgrounds);
  trees.png      example images next to the tree depth chosen at each grid cell and what was accepted;
  depth_by_cell.png  mean tree depth and acceptance per grid position over the whole run.
A cell is "flat" when its pixels and those of its 4 neighbours are within a few grey levels of the
cell's mean colour, "busy" otherwise (object edges, speckle).
"""
from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import hydra
import numpy as np
import pyarrow.parquet as pq
from omegaconf import DictConfig
from PIL import Image

from decoding.registry import family
from decoding.shapes.scorer import mean_adherence, score_prompts

log = logging.getLogger("arspec.analyze")


def flat_cells(image: np.ndarray, grid: int, tol: float = 12.0) -> np.ndarray:
    """[grid, grid] bool: cells whose 3x3 neighbourhood is one flat colour."""
    c = image.shape[0] // grid
    cells = image.reshape(grid, c, grid, c, 3).transpose(0, 2, 1, 3, 4).reshape(grid, grid, c * c, 3).astype(float)
    mean = cells.mean(2)
    flat = np.abs(cells - mean[:, :, None]).max((2, 3)) < tol
    pad = np.pad(mean, ((1, 1), (1, 1), (0, 0)), mode="edge")
    for dr, dc in ((0, 1), (2, 1), (1, 0), (1, 2)):
        flat &= np.abs(pad[dr:dr + grid, dc:dc + grid] - mean).max(-1) < tol
    return flat


def load_run(run_dir: Path):
    images = pq.read_table(run_dir / "images").to_pandas()
    tokens = pq.read_table(run_dir / "tokens").to_pandas()
    errors = pq.read_table(run_dir / "errors").to_pandas() if (run_dir / "errors").exists() else None
    return images, tokens, errors


def decode(img) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(img["bytes"])).convert("RGB"))


def cell_stats(images, tokens, grid: int) -> dict:
    """Per image: tree depth and acceptance grids, and the flat-cell mask of the generated image."""
    out = {}
    by_prompt = dict(tuple(tokens.groupby("prompt_id")))
    for pid, img in zip(images.prompt_id, images.image):
        t = by_prompt[pid]
        cell = (t.row * grid + t.col).to_numpy()   # placed by cell: MAR generates in a random order
        grids = {k: np.zeros(grid * grid, dtype=t[c].dtype) for k, c in (("depth", "tree_depth"), ("accepted", "accepted"))}
        grids["depth"][cell], grids["accepted"][cell] = t.tree_depth.to_numpy(), t.accepted.to_numpy()
        out[pid] = {**{k: v.reshape(grid, grid) for k, v in grids.items()}, "flat": flat_cells(decode(img), grid)}
    return out


def summarize(images, tokens, errors, stats, scorer) -> dict:
    pix = np.stack([decode(x) for x in images.image])
    adherence = score_prompts(scorer, pix, list(images.prompt)) if scorer is not None else [None] * len(images)
    images = images.assign(adherence=adherence)
    out = {"images": len(images), "errors": 0 if errors is None else len(errors),
           "engine": sorted(images.engine.unique().tolist())}
    for split in ["all"] + sorted(images.split.dropna().unique().tolist()):
        sub = images if split == "all" else images[images.split == split]
        st = [stats[p] for p in sub.prompt_id]
        flat = np.concatenate([s["flat"].ravel() for s in st])
        depth = np.concatenate([s["depth"].ravel() for s in st])
        acc = np.concatenate([s["accepted"].ravel() for s in st])
        out[split] = {
            "images": len(sub), "tau": round(float(sub.mean_accept_len.mean()), 3),
            "adherence": mean_adherence(list(sub.adherence)),
            "flat_cell_fraction": round(float(flat.mean()), 3),
            "tree_depth_flat": round(float(depth[flat].mean()), 3) if flat.any() else None,
            "tree_depth_busy": round(float(depth[~flat].mean()), 3) if (~flat).any() else None,
            "accepted_flat": round(float(acc[flat].mean()), 3) if flat.any() else None,
            "accepted_busy": round(float(acc[~flat].mean()), 3) if (~flat).any() else None,
            "s_per_image": round(float(sub.wall_s.mean()), 4),
        }
    return out


def plot_examples(images, stats, path: Path, n: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    picks = images.head(n)
    fig, axes = plt.subplots(len(picks), 3, figsize=(7.5, 2.5 * len(picks)), squeeze=False)
    vmax = max(int(stats[p]["depth"].max()) for p in picks.prompt_id) or 1
    for ax, (pid, img, prompt) in zip(axes, zip(picks.prompt_id, picks.image, picks.prompt)):
        s = stats[pid]
        ax[0].imshow(decode(img), interpolation="nearest")
        ax[0].set_title(prompt[:48], fontsize=7)
        im = ax[1].imshow(s["depth"], cmap="viridis", vmin=0, vmax=vmax)
        ax[1].set_title("tree depth per cell", fontsize=8)
        ax[2].imshow(s["accepted"], cmap="Greens", vmin=0, vmax=1)
        ax[2].contour(s["flat"], levels=[0.5], colors="red", linewidths=0.6)
        ax[2].set_title("accepted (green); flat region (red line)", fontsize=7)
        for a in ax:
            a.set_xticks([]), a.set_yticks([])
        fig.colorbar(im, ax=ax[1], fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_by_cell(stats, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    depth = np.mean([s["depth"] for s in stats.values()], 0)
    acc = np.mean([s["accepted"] for s in stats.values()], 0)
    flat = np.mean([s["flat"] for s in stats.values()], 0)
    fig, axes = plt.subplots(1, 3, figsize=(10, 3.2))
    for ax, m, title in zip(axes, (depth, acc, flat), ("mean tree depth", "accepted fraction", "flat fraction")):
        im = ax.imshow(m, cmap="viridis")
        ax.set_title(title, fontsize=9)
        ax.set_xticks([]), ax.set_yticks([])
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def analyze(run_dir: Path, examples: int = 6, weights_dir: str | None = None) -> dict:
    images, tokens, errors = load_run(run_dir)
    grid = int(round(np.sqrt(tokens.groupby("prompt_id").size().iloc[0])))
    shapes = family("shapes")
    scorer = shapes.scorer(shapes.config(weights_dir=weights_dir))
    stats = cell_stats(images, tokens, grid)
    out_dir = run_dir / "analysis"
    out_dir.mkdir(exist_ok=True)
    summary = summarize(images, tokens, errors, stats, scorer)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_examples(images, stats, out_dir / "trees.png", examples)
    plot_by_cell(stats, out_dir / "depth_by_cell.png")
    return summary


@hydra.main(version_base="1.3", config_path="../conf", config_name="analyze")
def main(cfg: DictConfig) -> None:
    summary = analyze(Path(cfg.run_dir), cfg.examples, cfg.weights_dir)
    print(json.dumps(summary, indent=2))
    log.info(f"[analyze] wrote {Path(cfg.run_dir) / 'analysis'}")


if __name__ == "__main__":
    main()
