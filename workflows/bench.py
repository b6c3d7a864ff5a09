"""Side-by-side engine benchmark: `python -m workflows.bench [prompts=N] [batch_size=B | batch_sizes=[1,8]]
[engines=[...]]`; the continuous engines: `python -m workflows.bench baseline=mar engines=[mar,cspd]`;
a first look on a CPU: `python -m workflows.bench prompts=4 engines=[vanilla,auto]`.

Every variant is a list of `generate` overrides (so it uses exactly the job's engine configs) and runs
on the same prompts and seeds, in one process, interleaved batch by batch (the order rotates), so
machine noise hits all engines alike; `rounds=N` runs the prompts N times on each engine (the order
still rotating), for batch sizes where one round is a batch or two. Reported per split (flat /
textured shapes backgrounds) and overall: τ (tokens per target forward), step compression (vanilla
forwards / engine forwards), wall speedup over vanilla (median and spread over batches), efficiency
(speedup / compression), and prompt adherence from the shapes scorer. It also times the target and the drafter per forward at
several block sizes, which decides what speculative decoding can win on this machine. With several
batch sizes it ends with one table and one plot by batch size (`<out>_by_batch.png`).
"""
from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf

from decoding.engines import build_engine
from decoding.registry import family, load_bundle
from decoding.sampling import prompt_seed
from decoding.shapes.scorer import mean_adherence, score_prompts
from decoding.shapes.world import builtin_prompts
from workflows.config import ConfigError, cli, one_line_errors, register, to_object

log = logging.getLogger("arspec.bench")
CONF = Path(__file__).resolve().parents[1] / "conf"
register()


def variant_config(overrides: list[str]):
    """The job's (model, engine) settings for these `generate` overrides (conf/engine/*.yaml + overrides;
    an engine's YAML picks the model family it serves, e.g. engine=mar picks model=mar)."""
    if GlobalHydra.instance().is_initialized():  # inside this app: conf/ is already on the search path
        cfg = compose("generate", overrides=list(overrides))
    else:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose("generate", overrides=list(overrides))
    return to_object(cfg.model), to_object(cfg.engine)


def engine_config(overrides: list[str]):
    """The job's engine settings for these `generate` overrides."""
    return variant_config(overrides)[1]


@torch.inference_mode()
def forward_costs(bundle, sizes=(1, 8, 16, 32, 60), reps: int = 20) -> dict:
    """Median ms of one target / drafter forward over a block of T tokens after a known prefix of up to
    200, CFG batch of 2 rows. Blocks longer than the model's sequence are left out."""
    from decoding.engines.base import CachedModel, visible
    if getattr(bundle, "tokens", "discrete") == "continuous":
        return mar_costs(bundle)
    out = {}
    models = {"target": bundle.gpt} | ({"drafter": bundle.drafter} if bundle.drafter is not None else {})
    dim, positions = bundle.gpt.args.dim, bundle.gpt.rope.shape[0]
    sizes = [T for T in sizes if T <= positions]
    known = min(200, positions - max(sizes))
    for name, m in models.items():
        cache = CachedModel(m, 2, positions, bundle.dtype)
        cache.valid[:, :known] = True
        for T in sizes:
            slots = (known + torch.arange(T)).expand(2, T)
            mask = visible(cache.valid, slots[..., None])
            h = torch.randn(2, T, dim, dtype=bundle.dtype)
            call = (lambda: m.forward_embeds(h, slots, mask, slots)) if name == "target" else \
                (lambda: m(h, h, slots, mask, slots))
            ts = []
            for i in range(reps + 3):
                t0 = time.perf_counter()
                f = call()
                if name == "drafter":
                    bundle.gpt.logits(f)
                ts.append(time.perf_counter() - t0)
            out[f"{name}_T{T}_ms"] = round(1000 * float(np.median(ts[3:])), 3)
    return out


@torch.inference_mode()
def mar_costs(bundle, known=(0, 128, 240), tokens=(1, 8, 32), reps: int = 5) -> dict:
    """Continuous models, CFG batch of 2 rows: median ms of one transformer forward (encoder over the
    condition slots + `known` tokens, decoder over every position) and of one diffusion-head run (all
    its sampling steps) for `tokens` tokens at once, for the target and the draft."""
    from decoding.models.mar import MAR
    out = {}
    models = {"target": bundle.mar} | ({"draft": bundle.draft} if bundle.draft is not None else {})
    for name, m in models.items():
        m: MAR
        a, dev = m.args, bundle.device
        buf = m.fake_latent[:, None].expand(2, a.buffer_size, -1)
        x = torch.randn(2, a.seq_len, a.token_dim, device=dev)
        for k in known:
            idx = torch.arange(k, device=dev).expand(2, k)
            out[f"{name}_transformer_known{k}_ms"] = _median_ms(lambda: m.forward_z(x, idx, buf), reps)
        S, C = m.diffloss.num_sampling_steps, a.token_dim
        for n in tokens:
            z = torch.randn(2 * n, a.decoder_embed_dim, device=dev, dtype=m.decoder_embed.weight.dtype)
            call = lambda: m.diffloss.sample(z, torch.randn(n, C, device=dev), torch.randn(n, S, C, device=dev),  # noqa: E731
                                             1.0, torch.full((n,), 2.0, device=dev))
            out[f"{name}_diffusion_{S}steps_T{n}_ms"] = _median_ms(call, reps)
    return out


def _median_ms(call, reps: int) -> float:
    ts = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        call()
        ts.append(time.perf_counter() - t0)
    return round(1000 * float(np.median(ts[1:])), 3)


def _engines(cfg: DictConfig, chosen: list[str]) -> tuple[dict, dict, dict]:
    """Each variant's engine on the model its overrides compose (the bench's `model` settings where it is
    that family), one bundle per distinct model: (bundles, name -> (bundle key, engine), scorers)."""
    model = to_object(cfg.model)
    bundles, engines, scorers = {}, {}, {}
    for name in chosen:
        m, e = variant_config(cfg.variants[name])
        m = model if m.name == model.name else m
        key = repr(m)
        if key not in bundles:
            bundles[key] = load_bundle(m)
            fam = family(m.name)
            scorers[key] = fam.scorer(m) if fam.scorer else None
        engines[name] = (key, build_engine(bundles[key], e))
    return bundles, engines, scorers


def _row(prompt: dict, r, score, bi: int) -> dict:
    """One image's figures for `summarize` (r: an ImageResult)."""
    per_step = 1.0 / np.maximum(r.records["accept_len"], 1)           # each step's tokens sum to 1
    budget = r.records.get("budget")
    drafted = r.records["window_pos"] >= 0 if "window_pos" in r.records else None
    return {"split": prompt["split"], "tau": r.mean_accept_len, "steps": float(per_step.sum()),
            "budget": float((budget * per_step).sum()) if budget is not None else 0.0,
            "plain": float(per_step[budget == 0].sum()) if budget is not None else 0.0,
            "drafted": int(drafted.sum()) if drafted is not None else 0,
            "accepted": int(r.records["accepted"][drafted].sum()) if drafted is not None else 0,
            "fallbacks": int(r.records["fallback"].sum()) if "fallback" in r.records else 0,
            "target_forwards": r.target_forwards, "draft_forwards": r.draft_forwards,
            "wall_s": r.wall_s, "phase_s": r.phase_s, "adherence": score, "batch": bi}


def _ceiling(cfg: DictConfig, e, rows: list[dict]) -> float:
    """A tree engine's: its budget's (the acceptance it learnt; budget.py `Budget.ceiling`). Without a
    drafter, chain steps only: this run's τ at the cost table's price of a chain forward against a plain
    one (no overhead)."""
    R = cfg.batch_size * (2 if e.sampling.use_cfg else 1)
    if e.trees:
        return round(e.budget.ceiling(R), 3)
    return round(float(np.mean([r["tau"] for r in rows])) * e.costs.target(R, 1) / e.costs.target(R, 1 + e.cfg.chain), 3)


def check(cfg: DictConfig) -> None:
    """The bench's own settings, each refused in one line (ConfigError) before anything loads."""
    for key, what in (("rounds", "times each engine runs the prompts"), ("prompts", "built-in prompts to run"),
                      ("threads", "torch threads")):
        if cfg[key] < 1:
            raise ConfigError(f"{key}={cfg[key]}: must be >= 1 ({what})")
    sizes = list(cfg.batch_sizes or [cfg.batch_size])
    if min(sizes) < 1:
        name = f"batch_sizes={sizes}: each" if cfg.batch_sizes else f"batch_size={cfg.batch_size}:"
        raise ConfigError(f"{name} must be >= 1 (prompts decoded at once)")
    unknown = [n for n in (cfg.engines or []) if n not in cfg.variants]
    if unknown:
        raise ConfigError(f"engines={list(cfg.engines)}: no variant {unknown}; defined: {list(cfg.variants)} "
                          f"(add one with +variants.NAME=[overrides])")


def run_bench(cfg: DictConfig) -> dict:
    check(cfg)
    torch.set_num_threads(cfg.threads)
    chosen = list(cfg.engines or cfg.variants)
    if cfg.baseline not in chosen:
        chosen.insert(0, cfg.baseline)
    bundles, engines, scorers = _engines(cfg, chosen)
    prompts = builtin_prompts(cfg.prompts, seed=cfg.prompt_seed)
    batches = [prompts[i:i + cfg.batch_size] for i in range(0, len(prompts), cfg.batch_size)]
    names = list(engines)
    rows = {n: [] for n in names}
    wall = {n: [] for n in names}
    # Each round runs every batch on every engine, the engines' order rotating from batch to batch and
    # round to round, so a host that speeds up or slows down over a run (7-15% between runs on a shared
    # 2-core VM) weighs on each engine alike. Engines keep what they learnt between rounds, as an actor
    # does between its batches: later rounds are warm.
    for bi, batch in [(r * len(batches) + i, b) for r in range(cfg.rounds) for i, b in enumerate(batches)]:
        for n in names[bi % len(names):] + names[:bi % len(names)]:
            key, engine = engines[n]
            bundle, scorer = bundles[key], scorers[key]
            res = engine.generate(bundle.conditions([p["prompt"] for p in batch]),
                                  [prompt_seed(cfg.seed, p["prompt_id"]) for p in batch])
            wall[n].append(sum(r.wall_s for r in res))
            scores = score_prompts(scorer, np.stack([r.image for r in res]), [p["prompt"] for p in batch]) \
                if scorer else [None] * len(res)
            rows[n] += [_row(p, r, s, bi) for p, r, s in zip(batch, res, scores)]
        log.info(f"[bench] batch {bi + 1}/{len(batches) * cfg.rounds} " +
                 " ".join(f"{n}={np.mean([r['tau'] for r in rows[n]]):.2f}τ" for n in names))
    costs = {}
    for key, bundle in bundles.items():
        costs.update({(f"{bundle.name}_{k}" if len(bundles) > 1 else k): v for k, v in forward_costs(bundle).items()})
    trees = {n: e for n, (_, e) in engines.items() if getattr(e, "costs", None) is not None}
    return {"config": OmegaConf.to_container(cfg, resolve=True), "forward_costs": costs,
            "cost_model": next((e.costs.summary() for e in trees.values()), None),
            # the best speedup over vanilla any tree could give here, from the cost model and the
            # acceptance each engine learnt
            "ceiling": {n: _ceiling(cfg, e, rows[n]) for n, e in trees.items()},
            "torch_threads": torch.get_num_threads(), "dtype": sorted({str(b.dtype) for b in bundles.values()}),
            "results": summarize(rows, wall, baseline=cfg.baseline)}


def summarize(rows: dict, wall: dict, baseline: str) -> dict:
    """Per split (flat, textured, all) and engine: `_figures` against the baseline on the same prompts."""
    out = {}
    for split in ("flat", "textured", "all"):
        base = [r for r in rows[baseline] if split in ("all", r["split"])]
        for n, rs in rows.items():
            rs = [r for r in rs if split in ("all", r["split"])]
            if rs:
                out.setdefault(split, {})[n] = _figures(rs, base)
    return out


def _figures(rs: list[dict], base: list[dict]) -> dict:
    """An engine's figures over its images `rs` (`_row`s), against the baseline's `base` on the same
    prompts, in the same order."""
    # per batch speedup: baseline wall / engine wall on the same prompts
    by_batch = {}
    for r, b in zip(rs, base):
        by_batch.setdefault(r["batch"], [0.0, 0.0])
        by_batch[r["batch"]][0] += b["wall_s"]
        by_batch[r["batch"]][1] += r["wall_s"]
    speedups = [bw / ew for bw, ew in by_batch.values()]
    compression = np.mean([b["target_forwards"] for b in base]) / np.mean([r["target_forwards"] for r in rs])
    speedup = float(np.sum([b["wall_s"] for b in base]) / np.sum([r["wall_s"] for r in rs]))
    adh = mean_adherence([r["adherence"] for r in rs])
    paired = [(attributes_right(r["adherence"]), attributes_right(b["adherence"])) for r, b in zip(rs, base)]
    diffs = [a - b for a, b in paired if a is not None and b is not None]
    steps = sum(r["target_forwards"] for r in rs)
    phases = {k: round(1000 * sum(r["phase_s"].get(k, 0.0) for r in rs) / steps, 2)
              for k in rs[0]["phase_s"]}
    return {
        "images": len(rs), "tau": round(float(np.mean([r["tau"] for r in rs])), 3),
        "step_compression": round(float(compression), 3), "speedup": round(speedup, 3),
        "speedup_median": round(float(np.median(speedups)), 3),
        "speedup_p10_p90": [round(float(np.percentile(speedups, q)), 3) for q in (10, 90)],
        "efficiency": round(speedup / compression, 3),
        "s_per_image": round(float(np.mean([r["wall_s"] for r in rs])), 4),
        "draft_forwards_per_image": round(float(np.mean([r["draft_forwards"] for r in rs])), 1),
        "ms_per_step": round(1000 * sum(r["wall_s"] for r in rs) / steps, 2),
        "phase_ms_per_step": phases,  # where a step's time goes (vanilla: the forward)
        "images_per_s": round(len(rs) / sum(r["wall_s"] for r in rs), 3),
        # the draft nodes a step verified (budget.py), and how many steps were plain
        "budget_per_step": round(sum(r["budget"] for r in rs) / max(sum(r["steps"] for r in rs), 1), 2),
        "plain_steps": round(sum(r["plain"] for r in rs) / max(sum(r["steps"] for r in rs), 1), 3),
        "phase_s_per_image": {k: round(sum(r["phase_s"].get(k, 0.0) for r in rs) / len(rs), 4)
                              for k in rs[0]["phase_s"]},
        # continuous drafts (cspd): accepted / drafted, and residual-sampler fallbacks
        "draft_accept_rate": (round(sum(r["accepted"] for r in rs) / sum(r["drafted"] for r in rs), 4)
                              if sum(r["drafted"] for r in rs) else None),
        "fallbacks": sum(r["fallbacks"] for r in rs),
        "adherence": adh and adh["all"], "adherence_by_attribute": adh,
        # the share of a caption's attributes drawn right (a finer scale than `all`), and its
        # paired difference from the baseline on the same prompts and seeds, ± 1.96 standard errors
        "attributes": round(float(np.mean([a for a, _ in paired if a is not None])), 3) if diffs else None,
        "attributes_vs_baseline": ([round(float(np.mean(diffs)), 3),
                                    round(float(1.96 * np.std(diffs, ddof=1) / np.sqrt(len(diffs))), 3)]
                                   if len(diffs) > 1 else None)}


def attributes_right(score: dict | None) -> float | None:
    """The share of a caption's attributes the scorer found right (its `all` is 1 only when every one is)."""
    return None if score is None else float(np.mean([v for k, v in score.items() if k != "all"]))


def table(results: dict) -> str:
    lines = []
    for split, engines in results.items():
        lines += [f"\n{split}", "| engine | τ | step compression | speedup (total) | speedup median [p10, p90] | "
                  "efficiency | s/image | ms/step (phases) | draft accept | adherence: all / attributes (Δ vs baseline) |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for n, r in engines.items():
            phases = " ".join(f"{k} {v}" for k, v in r["phase_ms_per_step"].items())
            lines.append(f"| {n} | {r['tau']} | {r['step_compression']} | {r['speedup']} | {r['speedup_median']} "
                         f"{r['speedup_p10_p90']} | {r['efficiency']} | {r['s_per_image']} | {r['ms_per_step']} "
                         f"({phases}) | {r['draft_accept_rate'] if r['draft_accept_rate'] is not None else '-'} | "
                         f"{adherence_cell(r)} |")
    return "\n".join(lines)


def adherence_cell(r: dict) -> str:
    if r.get("attributes") is None:
        return f"{r['adherence']}"
    d = r["attributes_vs_baseline"]
    return f"{r['adherence']} / {r['attributes']}" + (f" ({d[0]:+.3f} ± {d[1]:.3f})" if d else "")


def _pyplot():
    """matplotlib's pyplot on the file-only backend (a bench may run with no display)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot(results: dict, path: Path) -> None:
    plt = _pyplot()
    splits = [s for s in ("flat", "textured", "all") if s in results]
    names = list(results[splits[0]])
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, key, title in ((axes[0], "tau", "τ (tokens / target forward)"), (axes[1], "speedup", "wall speedup vs the baseline")):
        x = np.arange(len(names))
        for i, s in enumerate(splits):
            ax.bar(x + (i - 1) * 0.27, [results[s][n][key] for n in names], 0.27, label=s)
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title)
        ax.axhline(1.0, color="k", lw=0.6)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_by_batch(results: dict, path: Path) -> None:
    """{B: {engine: summary}} -> images/s and speedup over the baseline against batch size, one line per
    engine: where an engine wins at batch 1 and loses at the job's batch size shows at a glance."""
    plt = _pyplot()
    sizes = sorted(results)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for n in results[sizes[0]]:
        for ax, key in ((axes[0], "images_per_s"), (axes[1], "speedup")):
            ax.plot(sizes, [results[B][n][key] for B in sizes], marker="o", label=n)
    for ax, title in ((axes[0], "images / s"), (axes[1], "speedup over the baseline (same prompts and seeds)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(B) for B in sizes])
        ax.set_xlabel("batch size")
        ax.set_title(title)
    axes[1].axhline(1.0, color="k", lw=0.6)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench")
@one_line_errors
def main(cfg: DictConfig) -> None:
    check(cfg)
    sizes = list(cfg.batch_sizes or [cfg.batch_size])
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    reports = {}
    for B in sizes:
        cfg.batch_size = B
        reports[B] = report = run_bench(cfg)
        path = out if len(sizes) == 1 else out.with_name(f"{out.stem}_b{B}{out.suffix}")
        path.write_text(json.dumps(report, indent=2))
        plot(report["results"], path.with_suffix(".png"))
        print(f"\n## batch_size={B}")
        print("forward ms:", json.dumps(report["forward_costs"]))
        if report["cost_model"]:
            print("cost model:", report["cost_model"])
            print("ceiling (best tree speedup the costs allow, from learnt acceptance):", report["ceiling"])
        print(table(report["results"]))
        log.info(f"[bench] wrote {path} and {path.with_suffix('.png')}")
    if len(sizes) > 1:
        by_batch = {B: r["results"]["all"] for B, r in reports.items()}
        print("\n## by batch size (all prompts)\n" + by_batch_size(by_batch))
        figure = out.with_name(f"{out.stem}_by_batch.png")
        plot_by_batch(by_batch, figure)
        log.info(f"[bench] wrote {figure}")


def by_batch_size(results: dict) -> str:
    """{B: {engine: summary}} -> one table: throughput, τ, step phases and budget per batch size."""
    lines = ["| batch | engine | images/s | × vanilla | τ | ms/step (phases) | budget/step | plain steps |",
             "|---|---|---|---|---|---|---|---|"]
    for B, engines in results.items():
        for n, r in engines.items():
            phases = " ".join(f"{k} {v}" for k, v in r["phase_ms_per_step"].items())
            lines.append(f"| {B} | {n} | {r['images_per_s']} | {r['speedup']} | {r['tau']} | {r['ms_per_step']} "
                         f"({phases}) | {r['budget_per_step']} | {r['plain_steps']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    cli(main)
