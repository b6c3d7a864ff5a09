"""One streaming pass over a run's images: which grid cells are flat, prompt adherence, and features.

The images table is read in record batches of `batch` rows (PNG bytes, a few KB each), so memory stays
flat at any run size. Per image it keeps a small row (prompt id, split, the flat-cell mask as a string of
'0'/'1', adherence per attribute) and, for at most `feature_ids` images, a feature vector.

Features for the distribution distances are the output of the shapes scorer's `body`: its penultimate
layer (Linear -> GELU, 256 values), just before the attribute heads. The scorer is trained to read shape,
colour, size, position, background and texture, so the features summarise exactly what the prompt asks
for; they are caught with a forward hook while `score_prompts` runs, one forward for both.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
from PIL import Image

from decoding.shapes.scorer import score_prompts

FLAT_TOL = 12.0  # grey levels: a cell is flat when its pixels and its 4 neighbours' means stay this close


def flat_cells(images: np.ndarray, grid: int, tol: float = FLAT_TOL) -> np.ndarray:
    """uint8 [B, H, W, 3] -> bool [B, grid, grid]: True where the cell's pixels are within `tol` of the
    cell's mean colour (every channel) and the 4 neighbouring cells' means are too (edges padded)."""
    B, H = images.shape[:2]
    c = H // grid
    cells = images.reshape(B, grid, c, grid, c, 3).transpose(0, 1, 3, 2, 4, 5).reshape(B, grid, grid, c * c, 3)
    mean = cells.sum(3, dtype=np.int32).astype(np.float32) / (c * c)      # [B, g, g, 3]
    # the largest |pixel - mean| of a cell is at its darkest or brightest pixel: uint8 reductions, no copy
    flat = np.maximum(cells.max(3) - mean, mean - cells.min(3)).max(-1) < tol
    pad = np.pad(mean, ((0, 0), (1, 1), (1, 1), (0, 0)), mode="edge")
    for dr, dc in ((0, 1), (2, 1), (1, 0), (1, 2)):
        flat &= np.abs(pad[:, dr:dr + grid, dc:dc + grid] - mean).max(-1) < tol
    return flat


def decode(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))


@dataclass
class ImageFacts:
    table: pa.Table                                   # prompt_id, split, grid, mask, adh_<attribute>...
    flat_share: np.ndarray | None                     # [grid, grid] share of images flat at each cell
    features: dict[str, np.ndarray] = field(default_factory=dict)   # prompt_id -> [F] float32
    attributes: list[str] = field(default_factory=list)             # adherence columns, 'all' last


def _chunks(images_dir: str, batch: int):
    """Record batches of the images folder regrouped into lists of up to `batch` rows (the job writes
    parts of a batch each, often 8 rows: too few for one scorer forward)."""
    cols = ["prompt_id", "prompt", "split", "image", "num_tokens"]
    pending = {c: [] for c in cols}
    from actors.store import ObjPath
    where = ds.dataset(images_dir.key, filesystem=images_dir.fs, format="parquet") \
        if isinstance(images_dir, ObjPath) else ds.dataset(str(images_dir), format="parquet")
    for rb in where.to_batches(columns=cols, batch_size=batch):
        for c in cols:
            pending[c] += (rb.column(c).field("bytes") if c == "image" else rb.column(c)).to_pylist()
        if len(pending["prompt_id"]) >= batch:
            yield pending
            pending = {c: [] for c in cols}
    if pending["prompt_id"]:
        yield pending


def scan(images_dir: str, scorer=None, feature_ids: set[str] | None = None, batch: int = 512) -> ImageFacts:
    """Stream a run's images folder once (see the module doc)."""
    feature_ids = feature_ids or set()
    caught: list = []
    hook = None
    body = getattr(scorer, "body", None)
    if body is not None and feature_ids:
        hook = body.register_forward_hook(lambda m, i, o: caught.append(o.detach().float().cpu().numpy()))
    ids, splits, grids, masks, adh, feats = [], [], [], [], [], {}
    flat_sum, flat_n = None, 0
    try:
        for ch in _chunks(images_dir, batch):
            pid, ntok = ch["prompt_id"], np.asarray(ch["num_tokens"])
            pix = np.stack([decode(b) for b in ch["image"]])
            grid = math.isqrt(int(ntok[0]))
            if not (ntok == grid * grid).all() or pix.shape[1] % grid or pix.shape[1] != pix.shape[2]:
                raise ValueError(f"{images_dir}: images differ in size or their token grid does not tile them "
                                 f"({pix.shape[1:3]}, {sorted(set(ntok.tolist()))} tokens)")
            flat = flat_cells(pix, grid)
            if flat_sum is None or flat_sum.shape != flat.shape[1:]:
                flat_sum, flat_n = np.zeros(flat.shape[1:]), 0
            flat_sum += flat.sum(0)
            flat_n += len(flat)
            ids += pid
            splits += ch["split"]
            grids += [grid] * len(pid)
            masks += [r.tobytes().decode() for r in flat.reshape(len(flat), -1).astype(np.uint8) + ord("0")]
            if scorer is not None:
                caught.clear()
                adh += score_prompts(scorer, pix, ch["prompt"])
                if caught:
                    f = np.concatenate(caught)
                    feats.update({p: f[j].copy() for j, p in enumerate(pid) if p in feature_ids})  # not views:
                    # a view would keep its whole chunk's features alive
    finally:
        if hook is not None:
            hook.remove()
    cols = {"prompt_id": pa.array(ids, pa.string()), "split": pa.array(splits, pa.string()),
            "grid": pa.array(grids, pa.int32()), "mask": pa.array(masks, pa.string())}
    scored = [a for a in adh if a is not None]
    attributes = [k for k in scored[0] if k != "all"] + ["all"] if scored else []
    for k in attributes:
        cols[f"adh_{k}"] = pa.array([np.nan if a is None else a[k] for a in adh], pa.float64())
    return ImageFacts(pa.table(cols), None if flat_sum is None else flat_sum / max(flat_n, 1), feats, attributes)
