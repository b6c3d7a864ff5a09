"""What a checkpoint is: `python -m workflows.inspect_checkpoint PATH [PATH ...] [--json]`.

The first thing to run when a load fails. For each file: its format and container (which entry holds
the weights), what it is (LlamaGen GPT c2i/t2i, VQ tokenizer, EAGLE drafter in our layout or the public
EAGLE/LANTERN one, or one of arspec's own files), its dimensions and the preset they match, the
training arguments it carries, and the settings that load it. Reads with weights_only=True (memory-
mapped), like the loaders; nothing is executed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from types import SimpleNamespace

from decoding.checkpoint import read_checkpoint
from decoding.llamagen.config import guess_heads
from decoding.llamagen.layouts import DERIVED, KINDS, LAYOUTS, describe, drop_derived
from decoding.llamagen.load import recorded

MAR_KINDS = {"mar": "MAR (LTH14/mar layout: transformer + diffusion head; model=mar)",
             "kl_vae": "KL VAE (LDM layout, MAR's kl16.ckpt; model.vae_ckpt)"}
ARGS_SHOWN = ("gpt_model", "gpt_type", "image_size", "downsample_size", "num_classes", "cls_token_num", "vq_model",
              "codebook_size", "codebook_embed_dim", "global_batch_size", "epochs", "lr")


def _file(path: Path) -> Path:
    """A drafter directory (EAGLE/LANTERN: config.json + weights) stands for its weights file."""
    if path.is_dir():
        for name in ("model.safetensors", "pytorch_model.bin", "drafter.safetensors"):
            if (path / name).exists():
                return path / name
    return path


def _metadata(path: Path) -> dict:
    if path.suffix != ".safetensors":
        return {}
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as f:
        return f.metadata() or {}


def settings(info: dict, path: str) -> str:
    """The overrides that load this file."""
    if info.get("arspec_kind") in ("gpt", "vq", "text", "scorer"):   # a shapes-model file
        return f"model=shapes model.weights_dir={Path(info['path']).parent}"
    kind = info["kind"]
    key = "" if info["container"] in ("model", "raw") else f" model.gpt_weights_key={info['container']}"
    if kind in ("gpt_c2i", "gpt_t2i"):
        family = "llamagen_c2i" if kind == "gpt_c2i" else "llamagen_t2i"
        heads = info["recorded"].get("heads") or guess_heads(info["dim"]) or "<heads>"
        dims = f"model.gpt_model={info['preset']}" if info["preset"] else \
            f"model.dim={info['dim']} model.n_layer={info['n_layer']} model.n_head={heads}"
        size = info["recorded"].get("size") or "<the size it was trained at: 256|384|512>"
        extra = [f"model.codebook_size={info['vocab_size']}"] if info["vocab_size"] != 16384 else []
        if kind == "gpt_c2i" and info["num_classes"] != 1000:
            extra.append(f"model.num_classes={info['num_classes']}")
        if kind == "gpt_t2i" and info["caption_dim"] != 2048:
            extra.append(f"model.caption_dim={info['caption_dim']}")
        return " ".join([f"model={family}", f"model.gpt_ckpt={path}", dims, f"model.image_size={size}", *extra]) + key
    if kind == "vq":
        vq = f"model.vq_model={info['preset']}" if info["preset"] else f"model.vq_ch_mult=[{','.join(map(str, info['ch_mult']))}]"
        extra = [f"model.{k}={info[k]}" for k in ("codebook_size", "codebook_embed_dim")
                 if info[k] != {"codebook_size": 16384, "codebook_embed_dim": 8}[k]]
        extra += [f"model.vq_{k}={info[k]}" for k, d in (("ch", 128), ("z_channels", 256), ("num_res_blocks", 2))
                  if info[k] != d]
        return " ".join([f"model.vq_ckpt={path}", vq, *extra]) + key
    if kind == "drafter":
        return f"model.drafter_ckpt={path}"
    return ""


def mar_settings(info: dict, path: str) -> str:
    """The overrides that load a MAR or KL VAE file (decoding/mar/family.py)."""
    if info.get("arspec_kind"):                                    # the continuous shapes models' own files
        return f"model=mar model.weights_dir={Path(info['path']).parent}"
    if info["kind"] == "kl_vae":
        scale = "" if info["preset"] == "kl16" else " model.vae_scale=<1 / std of its latents>"
        return f"model.vae_ckpt={path}{scale} (with model=mar model.mar_ckpt=<the MAR trained on it>)"
    from decoding.mar.checkpoints import HEADS_BY_WIDTH
    extra = [] if "model_ema" in info["entries"] else ["model.use_ema=false"]
    if info["dims"]["encoder_embed_dim"] not in HEADS_BY_WIDTH:
        extra.append("model.num_heads=<its attention heads>")
    return " ".join([f"model=mar model.mar_ckpt={path} model.vae_ckpt=<its kl16.ckpt>", *extra]) + \
        f" (as cspd's draft: model.draft_mar_ckpt={path})"


def _inspect_mar(p: Path, info: dict, path: str) -> dict:
    from decoding.mar.checkpoints import inspect as mar_inspect
    m = mar_inspect(p)
    info.update(kind=m["family"], layout=None, preset=m["preset"], dims=m["dims"], container=(
        "model_ema" if "model_ema" in info["entries"] else info["container"]))
    info["settings"] = mar_settings(info, path)
    return info


def inspect(path: str) -> dict:
    p = _file(Path(path).expanduser())
    meta = _metadata(p) if p.exists() else {}
    ck = read_checkpoint(p, setting="checkpoint")
    info = {"path": str(p), "bytes": p.stat().st_size, "format": ck.format, "container": ck.container,
            "entries": ck.entries, "derived_keys": sorted(k for k in ck.state_dict if DERIVED.search(k))}
    if "kind" in meta:                                   # one of arspec's own files
        info["arspec_kind"] = meta["kind"]
        info["arspec_args"] = json.loads(meta["args"]) if "args" in meta else None
    from decoding.mar.checkpoints import family_of
    sd = {k: v for k, v in ck.state_dict.items() if not k.startswith("loss.")}   # an LDM VAE's training loss
    if family_of(sd) in ("mar", "kl_vae") or meta.get("kind") in ("mar", "kl_vae"):
        info["parameters"] = sum(v.numel() for v in sd.values())
        info["dtype"] = str(next(iter(sd.values())).dtype).replace("torch.", "") if sd else "?"
        return _inspect_mar(p, info, path)
    info.update(describe(drop_derived(ck.state_dict)))
    saved = ck.extra.get("args")
    if saved is not None:
        info["args"] = {k: getattr(saved, k) for k in ARGS_SHOWN if hasattr(saved, k)}
    if info["kind"] in ("gpt_c2i", "gpt_t2i"):      # what the file records beyond its shapes (a VQ-16 grid)
        rec = recorded(ck, info, SimpleNamespace(cls_token_num=1), p)
        info["recorded"] = {"heads": rec.get("heads", (None,))[0],
                            "size": rec["grid"][0] * 16 if "grid" in rec else rec.get("size", (None,))[0]}
    info["settings"] = settings(info, path)
    if info["kind"] == "unknown":
        info["first_keys"] = sorted(ck.state_dict)[:12]
    return info


def report(info: dict) -> str:
    size = info["bytes"] / 2**20
    where = "a raw state dict" if info["container"] == "raw" else f"entries {info['entries']}; weights under {info['container']!r}"
    lines = [f"{info['path']}  ({info['format']}, {size:,.1f} MiB)", f"  container: {where}"]
    if "arspec_kind" in info:
        lines.append(f"  arspec file: kind {info['arspec_kind']!r}, args {info['arspec_args']}")
    lines.append(f"  kind: {MAR_KINDS.get(info['kind']) or KINDS[info['kind']]}"
                 + (f", {LAYOUTS[info['layout']]}" if info["layout"] else ""))
    lines.append(f"  weights: {info['parameters'] / 1e6:,.2f}M parameters ({info['dtype']})"
                 + (f"; derived buffers ignored: {info['derived_keys']}" if info["derived_keys"] else ""))
    k = info["kind"]
    if k in ("gpt_c2i", "gpt_t2i"):
        cond = f"{info['num_classes']} classes (+ the null class)" if k == "gpt_c2i" else \
            f"caption dim {info['caption_dim']}, {info['cls_token_num']} caption tokens"
        lines.append(f"  dims: dim {info['dim']}, {info['n_layer']} layers, vocab {info['vocab_size']}, FFN {info['ffn_hidden']}, {cond}")
        heads = info["recorded"]["heads"]
        lines.append(f"  preset: {info['preset']} ({info['n_head']} heads)" if info["preset"] else
                     "  preset: none matches (dim, layers): give model.dim, model.n_layer and model.n_head"
                     + (f" ({heads} heads recorded)" if heads else " (heads not recorded: LlamaGen's are 64 wide)"))
        example = "c2i_L_384.pt" if k == "gpt_c2i" else "t2i_XL_stage2_512.pt"
        size = info["recorded"]["size"]
        lines.append(f"  image size: {size} px, as the file records it" if size else
                     f"  image size: not recorded (LlamaGen names it in the file: {example})")
    elif k == "vq":
        lines.append(f"  dims: codebook {info['codebook_size']} x {info['codebook_embed_dim']}, ch {info['ch']}, "
                     f"ch_mult {info['ch_mult']}, z_channels {info['z_channels']}, {info['num_res_blocks']} res blocks, "
                     f"downsample {info['downsample']}")
        lines.append(f"  preset: {info['preset'] or 'none (give model.vq_ch_mult)'}")
    elif k in MAR_KINDS:
        lines.append(f"  dims: {info['dims']}")
        lines.append(f"  preset: {info['preset']}")
    elif k == "drafter":
        lines.append(f"  dims: dim {info['dim']}, {info['n_layer']} layer(s), fc bias {info['fc_bias']}"
                     + (f", carries a copy of its target's embeddings (vocab {info['vocab_size']})" if info["vocab_size"] else ""))
    else:
        lines.append(f"  first keys: {info['first_keys']}")
    if info.get("args"):
        lines.append(f"  saved training args: {info['args']}")
    if info["settings"]:
        lines.append(f"  load it with: {info['settings']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workflows.inspect_checkpoint", description=__doc__.split("\n")[0])
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--json", action="store_true", help="print JSON instead of text")
    opts = ap.parse_args(argv)
    status = 0
    for path in opts.paths:
        try:
            info = inspect(path)
        except (FileNotFoundError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            status = 2
            continue
        print(json.dumps(info, default=str) if opts.json else report(info))
    return status


if __name__ == "__main__":
    sys.exit(main())
