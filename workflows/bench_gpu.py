"""GPU benchmark on LlamaGen-sized targets: `python -m workflows.bench_gpu [models=[GPT-L,GPT-XL]]
[batch_sizes=[1,8]] [images=16] [compile=true]`. The same command runs on a CPU at a small size (`CPU_RUN`):
`python -m workflows.bench_gpu models=[small] images=2 shapes_prompts=2 reps=3`. It logs a line per
engine and batch as it goes.

For each model size (random weights in LlamaGen's shapes: no checkpoint needed, and none is read) and
each batch size, it runs vanilla, eagle2 and adt_tree on the same class ids and seeds, interleaved batch
by batch, and reports:
  - the forward cost curve: ms of one target / drafter forward by tokens per forward, at the batch's
    rows (2 x batch with CFG), the KV cache half full;
  - τ (tokens per target forward), step compression, ms per step and wall speedup over vanilla;
  - a PREDICTION: random weights give τ ≈ 1 (the drafter agrees with nothing), so the script also runs
    the same engine settings on the shipped shapes model, takes its τ and drafter forwards per step, and
    predicts the speedup at that τ from this device's measured costs:
        step = C_target(budget + 1 tokens) + (drafter forwards per step, shapes) x C_drafter(width tokens)
               + glue (this run's measured ms per step minus its forwards: sampling, trials, KV moves)
        predicted speedup = τ(shapes) x vanilla ms per step / step.
Timings synchronise the device; nothing here is a test. Results: printed, and written to `out` as JSON.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import replace
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from decoding.bundle import pick_dtype
from decoding.engines import build_engine
from decoding.engines.base import CachedModel, visible
from decoding.llamagen.bundle import LlamaGenBundle, compile_forwards
from decoding.llamagen.c2i import SAMPLING
from decoding.llamagen.config import C2IConfig, describe, gpt_args, vq_args
from decoding.models.drafter import Drafter, DrafterArgs
from decoding.models.gpt import GPT
from decoding.models.vq import VQModel
from decoding.registry import resolve_device
from decoding.sampling import prompt_seed
from workflows.bench import engine_config
from workflows.config import ConfigError, cli, one_line_errors, register

log = logging.getLogger("arspec.bench_gpu")
register()
CPU_RUN = "python -m workflows.bench_gpu models=[small] images=2 shapes_prompts=2 reps=3"
CPU_SIZED_DIM = 768      # GPT-B's width: from there up a model is LlamaGen-sized, slow on a CPU


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_bundle(settings: dict, device: torch.device, dtype: str, compile: bool) -> LlamaGenBundle:
    """A c2i bundle with random weights of the given LlamaGen size, built on the device. The VQ is VQ-16
    at narrow widths: decoding an image is not what this measures."""
    cfg = C2IConfig(**settings, device=str(device), dtype=dtype)
    a = gpt_args(cfg)
    narrow = replace(cfg, vq_ch=32, vq_z_channels=32, vq_num_res_blocks=1)
    with torch.device(device):
        gpt, vq, drafter = GPT(a), VQModel(vq_args(narrow)), Drafter(DrafterArgs.for_target(a))
    bundle = LlamaGenBundle(f"random {describe(a, cfg)}", vq.eval(), gpt.eval(), drafter.eval(), device, dtype, SAMPLING)
    return compile_forwards(bundle) if compile else bundle


@torch.inference_mode()
def cost_curve(bundle, rows: int, tokens: list[int], reps: int) -> dict:
    """Median ms of one target and one drafter forward over T tokens per row, `rows` rows, with half the
    cache committed (attention reads that prefix plus the block)."""
    out = {}
    a, dev = bundle.gpt.args, bundle.device
    S = a.cls_token_num + a.block_size + max(tokens) + 1
    P = a.cls_token_num + a.block_size // 2
    for name, m in (("target", bundle.gpt), ("drafter", bundle.drafter)):
        cache = CachedModel(m, rows, S, bundle.dtype)
        cache.valid[:, :P] = True
        for T in tokens:
            slots = (P + torch.arange(T, device=dev)).expand(rows, T)
            pos = slots.clamp(max=a.cls_token_num + a.block_size - 1)   # a tree's depths stay on the grid
            mask = visible(cache.valid, slots[..., None])
            h = torch.randn(rows, T, a.dim, device=dev, dtype=bundle.dtype)
            call = (lambda: bundle.gpt.logits(m.forward_embeds(h, pos, mask, slots))) if name == "target" else \
                (lambda: bundle.gpt.logits(m(h, h, pos, mask, slots)))
            ts = []
            for _ in range(reps + 3):
                sync(dev)
                t0 = time.perf_counter()
                call()
                sync(dev)
                ts.append(time.perf_counter() - t0)
            out.setdefault(name, {})[T] = round(1000 * float(np.median(ts[3:])), 3)
    return out


def run_engines(bundle, engines: dict, prompts: list, batch: int, seed: int, label: str = "") -> dict:
    """Every engine on the same prompts and seeds, interleaved batch by batch. Per engine: τ, target and
    drafter forwards, engine ms per step. Times the engine's decoding loop alone (`Engine.tokens`, device
    synchronised), not the image decode the job adds to every engine alike. A progress line per engine and
    batch (`label` says which run)."""
    rows = {n: [] for n in engines}
    names = list(engines)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    for bi, chunk in enumerate(batches):
        for n in names[bi % len(names):] + names[:bi % len(names)]:
            cond = bundle.conditions(chunk)
            seeds = [prompt_seed(seed, f"{bi}-{j}-{p}") for j, p in enumerate(chunk)]
            with torch.inference_mode():
                sync(bundle.device)
                t0 = time.perf_counter()
                log_ = engines[n].tokens(cond, seeds)
                sync(bundle.device)
                engine_s = time.perf_counter() - t0
            tf, df = log_.target_forwards.tolist(), log_.draft_forwards.tolist()
            rows[n].append({"tau": [int(k) / max(t, 1) for k, t in zip(log_.n.tolist(), tf)], "tf": tf, "df": df,
                            "engine_s": engine_s, "steps": max(tf), "images": len(chunk)})
            log.info(f"[bench_gpu] {label}batch {bi + 1}/{len(batches)} {n}: {len(chunk)} image(s), "
                     f"τ {np.mean(rows[n][-1]['tau']):.2f}, {engine_s:.2f} s")
    out = {}
    for n, rs in rows.items():
        images = sum(r["images"] for r in rs)
        tf, df = sum(sum(r["tf"]) for r in rs), sum(sum(r["df"]) for r in rs)
        out[n] = {"images": images, "tau": round(float(np.mean([t for r in rs for t in r["tau"]])), 3),
                  "target_forwards_per_image": tf / images, "draft_forwards_per_step": round(df / tf, 3),
                  "ms_per_step": round(1000 * sum(r["engine_s"] for r in rs) / sum(r["steps"] for r in rs), 3),
                  "s_per_image": round(sum(r["engine_s"] for r in rs) / images, 4)}
    base = out["vanilla"]
    for n, r in out.items():
        r["step_compression"] = round(base["target_forwards_per_image"] / r["target_forwards_per_image"], 3)
        r["speedup"] = round(base["s_per_image"] / r["s_per_image"], 3)
    return out


def shapes_reference(cfg, device: torch.device) -> dict:
    """τ and drafter forwards per step of each engine setting on the shipped shapes model (batch 1)."""
    from decoding.registry import load_bundle
    from decoding.shapes.family import ShapesConfig
    from decoding.shapes.world import builtin_prompts
    if cfg.shapes_tau is not None:
        return {n: {"tau": float(t), "draft_forwards_per_step": None} for n, t in cfg.shapes_tau.items()}
    bundle = load_bundle(ShapesConfig(device=str(device), dtype=cfg.dtype))
    prompts = [p["prompt"] for p in builtin_prompts(cfg.shapes_prompts, seed=1)]
    engines = {n: build_engine(bundle, engine_config(cfg.variants[n])) for n in cfg.engines}
    log.info(f"[bench_gpu] shapes model reference: {', '.join(engines)} on {len(prompts)} prompt(s) at batch 1")
    out = run_engines(bundle, engines, prompts, 1, cfg.seed, "shapes model: ")
    return {n: {"tau": r["tau"], "draft_forwards_per_step": r["draft_forwards_per_step"]} for n, r in out.items()}


def lanes(e) -> int:
    """Tokens per row of one drafter level forward: the tree's (largest) width."""
    return max(getattr(e, "w_max", e.width), 1)


def predict(measured: dict, costs: dict, shapes: dict, engines: dict) -> dict:
    """The speedup the cost curve predicts at the shapes model's τ (see the module docstring)."""
    vanilla = measured["vanilla"]["ms_per_step"]
    out = {}
    for n, r in measured.items():
        if n == "vanilla" or n not in shapes:
            continue
        e = engines[n].cfg
        verify, level = costs["target"][e.total_tokens + 1], costs["drafter"][lanes(e)]
        glue = max(0.0, r["ms_per_step"] - verify - r["draft_forwards_per_step"] * level)
        s = shapes[n]
        dfps = s["draft_forwards_per_step"] if s["draft_forwards_per_step"] is not None else r["draft_forwards_per_step"]
        step = verify + dfps * level + glue
        out[n] = {"shapes_tau": s["tau"], "predicted_ms_per_step": round(step, 3),
                  "predicted_speedup": round(s["tau"] * vanilla / step, 3),
                  "parts_ms": {"verify": verify, "drafter_level": level, "drafter_forwards_per_step": dfps,
                               "glue": round(glue, 3)}}
    return out


def table(report: dict) -> str:
    lines = []
    for model, per_batch in report["results"].items():
        for b, r in per_batch.items():
            costs = r["cost_ms"]
            lines += [f"\n{model}, batch {b} ({report['device']}, {report['dtype']}, compile={report['compile']})",
                      "forward cost (ms) by tokens per forward: target " + ", ".join(f"{t}: {v}" for t, v in costs["target"].items())
                      + " | drafter " + ", ".join(f"{t}: {v}" for t, v in costs["drafter"].items()),
                      "| engine | τ | step compression | ms/step | s/image | wall speedup | shapes τ | PREDICTED speedup at shapes τ |",
                      "|---|---|---|---|---|---|---|---|"]
            for n, m in r["measured"].items():
                p = r["prediction"].get(n, {})
                lines.append(f"| {n} | {m['tau']} | {m['step_compression']} | {m['ms_per_step']} | {m['s_per_image']} | "
                             f"{m['speedup']} | {p.get('shapes_tau', '-')} | {p.get('predicted_speedup', '-')} |")
    return "\n".join(lines)


def too_big(cfg, device: torch.device) -> list[str]:
    """The models that are LlamaGen-sized (GPT-B's width or more), where the device is a CPU."""
    if device.type != "cpu":
        return []
    return [m for m in cfg.models if gpt_args(C2IConfig(**dict(cfg.sizes[m]))).dim >= CPU_SIZED_DIM]


def run(cfg: DictConfig) -> dict:
    torch.manual_seed(cfg.seed)
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = resolve_device(cfg.device)
    unknown = [m for m in cfg.models if m not in cfg.sizes] + [e for e in cfg.engines if e not in cfg.variants]
    if unknown:
        raise ConfigError(f"models/engines: no size or variant named {unknown[0]!r}; sizes: {list(cfg.sizes)}, "
                          f"variants: {list(cfg.variants)} (add one with +sizes.NAME={{...}} or +variants.NAME=[...])")
    if "vanilla" not in cfg.engines:
        raise ConfigError("engines: must include vanilla (the baseline)")
    big = too_big(cfg, device)
    if big:
        log.warning(f"[bench_gpu] on a CPU: {', '.join(big)} are LlamaGen-sized and take long here (a line per "
                    f"engine and batch follows); the CPU-sized run is {CPU_RUN}")
    shapes = shapes_reference(cfg, device)
    log.info(f"[bench_gpu] shapes model reference (τ, drafter forwards per step): {shapes}")
    report = {"device": str(device), "dtype": str(pick_dtype(cfg.dtype, device)), "compile": cfg.compile,
              "torch": torch.__version__, "config": OmegaConf.to_container(cfg, resolve=True), "shapes": shapes,
              "results": {}}
    if device.type == "cuda":
        report["gpu"] = torch.cuda.get_device_name(device)
    for name in cfg.models:
        bundle = random_bundle(dict(cfg.sizes[name]), device, cfg.dtype, cfg.compile)
        engines = {n: build_engine(bundle, engine_config(cfg.variants[n])) for n in cfg.engines}
        need = sorted({*cfg.cost_tokens, *(e.cfg.total_tokens + 1 for n, e in engines.items() if n != "vanilla"),
                       *(lanes(e.cfg) for n, e in engines.items() if n != "vanilla")})
        classes = torch.randint(bundle.gpt.args.num_classes, (cfg.images,)).tolist()
        for b in cfg.batch_sizes:
            log.info(f"[bench_gpu] {name} ({bundle.name}), batch {b}")
            costs = cost_curve(bundle, 2 * b, need, cfg.reps)
            measured = run_engines(bundle, engines, classes, b, cfg.seed, f"{name}, batch size {b}: ")
            report["results"].setdefault(name, {})[b] = {
                "cost_ms": costs, "measured": measured, "prediction": predict(measured, costs, shapes, engines)}
        del bundle, engines
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return report


@hydra.main(version_base="1.3", config_path="../conf", config_name="bench_gpu")
@one_line_errors
def main(cfg: DictConfig) -> None:
    report = run(cfg)
    out = Path(cfg.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(table(report))
    print("\nPREDICTED: the speedup this device's measured costs give at the τ the same engine settings reach "
          "on the shapes model (random weights give τ ≈ 1); not a measurement.")
    log.info(f"[bench_gpu] wrote {out}")


if __name__ == "__main__":
    cli(main)
