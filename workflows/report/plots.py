"""The report's figures (matplotlib, Agg): each takes the queries' small results and returns PNG bytes.

Every figure has a title, axes with their units and a legend (or a labelled colour bar); a run keeps its
colour in every figure (`colours`).
"""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

# text.parse_math off: prompts and run names are text, drawn as written; a `$` in them is not TeX
plt.rcParams.update({"font.size": 10, "axes.titlesize": 11, "axes.labelsize": 10, "legend.fontsize": 9,
                     "figure.dpi": 100, "axes.grid": True, "grid.alpha": 0.3, "text.parse_math": False})


def colours(labels: list[str]) -> dict[str, tuple]:
    cmap = plt.get_cmap("tab10")
    return {label: cmap(i % 10) for i, label in enumerate(labels)}


def png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def tau_hist(taus: dict[str, np.ndarray], col: dict) -> bytes:
    """Distribution of τ over images, one step histogram per run, its mean as a dashed line."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    hi = max(float(v.max()) for v in taus.values() if len(v))
    edges = np.linspace(0.5, max(hi, 1.5) + 0.25, 40)
    for label, v in taus.items():
        if not len(v):
            continue
        ax.hist(v, bins=edges, histtype="step", lw=1.8, color=col[label], label=f"{label} (mean {v.mean():.2f})")
        ax.axvline(v.mean(), color=col[label], ls="--", lw=1)
    ax.set(title="τ per image: tokens committed per target forward", xlabel="τ (tokens / target forward)",
           ylabel="images")
    ax.legend(loc="upper right")
    return png(fig)


def versus(rows: dict[str, list[dict]], baseline: dict[str, str], col: dict) -> bytes:
    """Step compression and speedup over the baseline run, per split (where the value exists), grouped by run."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    w = 0.8 / max(len(rows), 1)
    for ax, key, title in zip(axes, ("compression", "speedup"),
                              ("step compression (baseline target forwards / run's)",
                               "speedup (baseline engine seconds / run's)")):
        splits = list(dict.fromkeys(r["split"] for rs in rows.values() for r in rs if r[key] is not None))
        x = np.arange(len(splits))
        for i, (label, rs) in enumerate(rows.items()):
            by = {r["split"]: r[key] for r in rs if r[key] is not None}
            vals = [by.get(s, np.nan) for s in splits]
            bars = ax.bar(x + (i - (len(rows) - 1) / 2) * w, vals, w, color=col[label],
                          label=f"{label} vs {baseline[label]}")
            ax.bar_label(bars, labels=["" if np.isnan(v) else f"{v:.2f}" for v in vals], fontsize=8)
        ax.axhline(1, color="k", lw=0.8)
        ax.set_xticks(x, splits)
        ax.set(title=title, xlabel="split (image set)", ylabel="× baseline")
        ax.margins(y=0.15)
    axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("Against the non-speculative baseline run on the same prompts and seeds", y=1.02)
    return png(fig)


def depth_acceptance(paths: dict[str, list[dict]], shapes: dict[str, list[dict]], col: dict) -> bytes:
    """Left: acceptance at depth k of the accepted path. Right: accepted share by the tree's depth d."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for label, rs in paths.items():
        axes[0].plot([r["depth"] for r in rs], [100 * r["rate"] for r in rs], "o-", color=col[label], label=label)
    axes[0].set(title="Acceptance at depth k of the accepted path", xlabel="depth k (drafts already accepted + 1)",
                ylabel="P(k-th draft accepted | k-1 were) (%)", ylim=(0, 102))
    axes[0].legend()
    for label, rs in shapes.items():
        axes[1].plot([r["value"] for r in rs], [100 * r["accepted"] for r in rs], "s-", color=col[label], label=label)
    axes[1].set(title="Tokens from the draft, by the depth d of their tree", xlabel="tree depth d (levels)",
                ylabel="tokens accepted from the draft (%)", ylim=(0, 102))
    if shapes:
        axes[1].legend()
    else:
        axes[1].text(0.5, 0.5, "no run logs a tree depth", ha="center", va="center", transform=axes[1].transAxes)
    return png(fig)


def calibration(draft: dict[str, list[dict]], target: dict[str, list[dict]], col: dict) -> bytes:
    """Left: mean target probability vs draft probability of accepted drafts (diagonal = calibrated).
    Right: share of committed tokens that came from the draft, by their target probability."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    axes[0].plot([0, 1], [0, 1], color="0.5", ls=":", label="calibrated (p = q)")
    for label, rs in draft.items():
        axes[0].plot([r["q"] for r in rs], [r["p"] for r in rs], "o-", color=col[label], label=label)
    axes[0].set(title="Accepted drafts: target vs draft probability", xlabel="draft probability q (mean per bin of 0.1)",
                ylabel="target probability p of the same token", xlim=(0, 1), ylim=(0, 1.02))
    axes[0].legend(loc="upper left")
    for label, rs in target.items():
        axes[1].plot([r["p"] for r in rs], [100 * r["accepted"] for r in rs], "o-", color=col[label], label=label)
    axes[1].set(title="Committed tokens drafted and accepted, by p", xlabel="target probability p (mean per bin of 0.1)",
                ylabel="drafted and accepted (% of tokens)", xlim=(0, 1), ylim=(0, 102))
    if target:
        axes[1].legend(loc="upper left")
    return png(fig)


def cell_maps(cells: dict[str, dict[str, np.ndarray]], flat_share: dict[str, np.ndarray]) -> bytes:
    """One row per run: accepted share, mean tree depth and width, and share of flat images, per grid cell.
    A column shares its colour scale across runs, so rows compare directly."""
    metrics = [("accepted", "accepted from draft (%)", 100, "Greens"), ("tree_depth", "mean tree depth (levels)", 1, "viridis"),
               ("tree_width", "mean tree width (nodes / level)", 1, "magma"), ("flat", "flat cells (% of images)", 100, "Greys")]
    metrics = [m for m in metrics if any(m[0] in c for c in cells.values()) or (m[0] == "flat" and flat_share)]
    labels = list(cells)
    maps = {lb: [(m, (flat_share.get(lb) if m[0] == "flat" else cells[lb].get(m[0]))) for m in metrics] for lb in labels}
    maps = {lb: [(m, v) for m, v in ms if v is not None] for lb, ms in maps.items()}   # left-aligned per row
    vmax = {m[0]: max((float(np.nanmax(v * m[2])) for ms in maps.values() for mm, v in ms if mm[0] == m[0]), default=1) or 1
            for m in metrics}
    fig, axes = plt.subplots(len(labels), len(metrics), figsize=(3.3 * len(metrics), 2.9 * len(labels)), squeeze=False)
    for i, label in enumerate(labels):
        for j in range(len(metrics)):
            ax = axes[i, j]
            ax.grid(False)
            if j >= len(maps[label]):
                ax.axis("off")
                continue
            (key, title, scale, cmap), m = maps[label][j]
            im = ax.imshow(m * scale, cmap=cmap, vmin=0, vmax=vmax[key], interpolation="nearest")
            ax.set_title(f"{label}\n{title}", fontsize=9)
            ax.set_xlabel("grid column")
            ax.set_ylabel("grid row")
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).set_label(title.split("(")[-1].rstrip(")"), fontsize=8)
    fig.suptitle("Per grid cell, over all images of each run", y=1.0)
    fig.tight_layout()
    return png(fig)


def flat_busy(rows: dict[str, list[dict]], col: dict) -> bytes:
    """Accepted share and tree depth on flat vs busy cells (all images), one pair of bars per run."""
    keys = [("accepted", "tokens accepted from the draft (%)", 100), ("tree_depth", "mean tree depth (levels)", 1)]
    keys = [k for k in keys if any(k[0] in r for rs in rows.values() for r in rs)]
    fig, axes = plt.subplots(1, len(keys), figsize=(5.5 * len(keys), 3.8), squeeze=False)
    labels = list(rows)
    x = np.arange(len(labels))
    for ax, (key, ylabel, scale) in zip(axes[0], keys):
        for k, (cell, hatch) in enumerate((("flat", ""), ("busy", "//"))):
            vals = [next((scale * (r.get(key) or 0) for r in rows[lb] if r["split"] == "all" and r["cell"] == cell), np.nan)
                    for lb in labels]
            bars = ax.bar(x + (k - 0.5) * 0.38, vals, 0.38, color=[col[lb] for lb in labels], hatch=hatch,
                          edgecolor="k", lw=0.5)
            ax.bar_label(bars, fmt="%.2f" if scale == 1 else "%.0f", fontsize=8)
            ax.bar(0, 0, 0, color="w", edgecolor="k", hatch=hatch, label=f"{cell} cells")     # legend key only
        ax.set_xticks(x, labels, rotation=15)
        ax.set(title=ylabel.split(" (")[0] + ": flat vs busy cells", xlabel="run", ylabel=ylabel)
        ax.margins(y=0.18)
        ax.legend(loc="upper center", ncol=2)
    return png(fig)


def adherence(values: dict[str, dict[str, float]], counts: dict[str, int], col: dict) -> bytes:
    """Prompt adherence per attribute (and all at once), one dot per run with ±1 standard error
    (binomial, sqrt(p(1-p)/n) over the n scored images)."""
    attrs = list(dict.fromkeys(k for v in values.values() for k in v))
    fig, ax = plt.subplots(figsize=(11, 3.8))
    x = np.arange(len(attrs))
    w = 0.7 / max(len(values), 1)
    lo = 100.0
    for i, (label, v) in enumerate(values.items()):
        p = np.array([v.get(a, np.nan) for a in attrs])
        se = np.sqrt(p * (1 - p) / max(counts[label], 1))
        ax.errorbar(x + (i - (len(values) - 1) / 2) * w, 100 * p, yerr=100 * se, fmt="o", ms=6, capsize=3,
                    color=col[label], label=f"{label} (n = {counts[label]})")
        lo = min(lo, float(np.nanmin(100 * (p - se))))
    ax.set_xticks(x, [a if a != "all" else "all at once" for a in attrs])
    ax.set(title="Prompt adherence (the family's scorer reads the generated image), ±1 standard error",
           xlabel="attribute asked for", ylabel="images that match (%)", ylim=(max(0, 10 * np.floor(lo / 10) - 5), 102))
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1))
    return png(fig)


def distances(rows: list[dict], col: dict, k_nn: int) -> bytes:
    """Fréchet distance to the baseline's images and the precision / recall pair, one bar per run."""
    labels = [r["run"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    x = np.arange(len(labels))
    bars = axes[0].bar(x, [r["frechet"] for r in rows], color=[col[lb] for lb in labels],
                       hatch=None, edgecolor="k", lw=0.5)
    for b, r in zip(bars, rows):
        b.set_hatch("//" if r["relaxed"] else "")
    axes[0].bar_label(bars, fmt="%.2f", fontsize=8)
    axes[0].set_xticks(x, labels, rotation=15)
    axes[0].set(title="Fréchet distance to the baseline's images", xlabel="run (hatched: relaxed acceptance)",
                ylabel="Fréchet distance (scorer features²)")
    axes[0].bar(0, 0, color="w", edgecolor="k", hatch="//", label="relaxed (lossy)")
    axes[0].bar(0, 0, color="w", edgecolor="k", label="exact (lossless): the noise floor")
    axes[0].legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    axes[0].margins(y=0.15)
    for k, (key, hatch) in enumerate((("precision", ""), ("recall", ".."))):
        b = axes[1].bar(x + (k - 0.5) * 0.38, [100 * r[key] for r in rows], 0.38, color=[col[lb] for lb in labels],
                        hatch=hatch, edgecolor="k", lw=0.5)
        axes[1].bar_label(b, fmt="%.0f", fontsize=8)
        axes[1].bar(0, 0, 0, color="w", edgecolor="k", hatch=hatch, label=key)       # legend key only
    axes[1].set_xticks(x, labels, rotation=15)
    axes[1].set(title=f"Precision / recall against the baseline (k = {k_nn})", xlabel="run",
                ylabel="% of samples in the other set's manifold", ylim=(0, 110))
    axes[1].legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
    return png(fig)


def examples(label: str, items: list[tuple[np.ndarray, str, dict]], depth_max: float) -> bytes:
    """One row per image: the image, the cells accepted from the draft, the tree depth per cell."""
    has_depth = any("tree_depth" in m for _, _, m in items)
    ncol = 3 if has_depth else 2
    fig, axes = plt.subplots(len(items), ncol, figsize=(2.9 * ncol + 0.6, 2.7 * len(items)), squeeze=False)
    for ax, (img, prompt, maps) in zip(axes, items):
        for a in ax:
            a.grid(False)
        ax[0].imshow(img, interpolation="nearest")
        ax[0].set_title(_wrap(prompt), fontsize=8)
        ax[0].set_xlabel("pixels")
        im = ax[1].imshow(maps["accepted"], cmap="Greens", vmin=0, vmax=1, interpolation="nearest")
        ax[1].set_title("accepted from the draft", fontsize=9)
        ax[1].set_xlabel("grid column")
        ax[1].set_ylabel("grid row")
        fig.colorbar(im, ax=ax[1], fraction=0.046, ticks=[0, 1]).set_label("0 target / 1 draft", fontsize=8)
        if has_depth:
            im = ax[2].imshow(maps["tree_depth"], cmap="viridis", vmin=0, vmax=depth_max or 1, interpolation="nearest")
            ax[2].set_title("tree depth of its step", fontsize=9)
            ax[2].set_xlabel("grid column")
            cb = fig.colorbar(im, ax=ax[2], fraction=0.046)
            cb.locator = matplotlib.ticker.MaxNLocator(integer=True)   # depths are whole levels
            cb.update_ticks()
            cb.set_label("levels", fontsize=8)
    fig.suptitle(f"{label}: examples", y=1.0)
    fig.tight_layout()
    return png(fig)


def profile(name: str, profiles: dict[str, dict], col: dict) -> bytes:
    """A family's own token column against acceptance (report.queries.profile)."""
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for label, p in profiles.items():
        if p["kind"] == "values":
            ax.plot([r["value"] for r in p["rows"]], [100 * r["accepted"] for r in p["rows"]], "o-", color=col[label],
                    label=label)
            ax.set(ylabel="tokens accepted from the draft (%)", ylim=(0, 102))
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        else:
            for accepted, ls in ((True, "-"), (False, ":")):
                rs = [r for r in p["rows"] if r["accepted"] == accepted]
                ax.plot([p["lo"] + (r["bin"] + 0.5) * p["width"] for r in rs], [r["tokens"] for r in rs], "o" + ls,
                        color=col[label], label=f"{label}, {'accepted' if accepted else 'not accepted'}")
            ax.set(ylabel="tokens")
    ax.set(title=f"Token column '{name}' (written by this engine family)", xlabel=f"{name} (as logged)")
    ax.legend()
    return png(fig)


def _wrap(text: str, width: int = 34) -> str:
    words, lines, cur = text.split(), [], ""
    for w in words:
        if len(cur) + len(w) + 1 > width and cur:
            lines.append(cur)
            cur = w
        else:
            cur = f"{cur} {w}".strip()
    return "\n".join(lines + [cur])
