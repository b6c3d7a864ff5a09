"""Public MAR and KL-16 checkpoints: read the container, work out the model's sizes from its weights, load
strictly, and say in one line what is wrong when a file is not what its setting expects.

- MAR `checkpoint-last.pth`: {'model', 'model_ema', 'optimizer', 'epoch', 'scaler', 'args'} (args is an
  argparse.Namespace: allowed by the weights-only unpickler, nothing else is). `model_ema` is for inference.
- KL-16 `kl16.ckpt`: {'model': LDM-layout state dict}. Keys under `loss.` (LDM's training discriminator and
  perceptual loss, where present) are not part of the autoencoder and are set aside; every other key must
  match, both ways.
- Our own safetensors (with kind + args metadata) load as they are.

`inspect(path)` says what a file is (family, preset, dims, container) without building a model, and
`load_mar` / `load_vae` with `check_only=True` run every check of a load on the meta device (no weights
copied, torch files memory-mapped): what the job's driver does before anything starts.
"""
from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Optional

import torch

from decoding.checkpoint import load_module, read_safetensors
from decoding.models.mar import MAR, MAR_PRESETS, MARArgs
from decoding.models.vae import AutoencoderKL, VAEArgs

HEADS_BY_WIDTH = {p["encoder_embed_dim"]: p["encoder_num_heads"] for p in MAR_PRESETS.values()}
VAE_STRIDE = 16          # MAR's released models: KL-16 tokens, 256 px -> 16 x 16
NOMINAL_RESOLUTION = 256  # a VAE's attention levels are named by resolution; only their level matters here


def read_container(path: str | Path, field: str) -> tuple[dict, dict]:
    """-> (the checkpoint's top-level dict, or {'model': raw state dict}; safetensors metadata or {})."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{field}={path}: no such file")
    try:
        if path.suffix == ".safetensors":
            sd, meta = read_safetensors(path)
            return {"model": sd}, meta
        with torch.serialization.safe_globals([argparse.Namespace]):
            try:
                ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:   # mmap needs the zip format; a legacy file loads without it
                if "mmap can only be used" not in str(e):
                    raise
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file: say so in one line
        msg = " ".join(str(e).split())[:160]
        raise ValueError(f"{field}={path}: cannot be read as a safetensors or torch checkpoint ({type(e).__name__}: {msg})") from None
    if not isinstance(ckpt, dict):
        raise ValueError(f"{field}={path}: holds a {type(ckpt).__name__}, not a checkpoint dict")
    if all(torch.is_tensor(v) for v in ckpt.values()):
        return {"model": ckpt}, {}
    return ckpt, {}


def family_of(sd: dict) -> str:
    keys = set(sd)
    if "z_proj.weight" in keys and any(k.startswith("diffloss.net.") for k in keys):
        return "mar"
    if "post_quant_conv.weight" in keys and any(k.startswith("encoder.down.") for k in keys):
        return "kl_vae"
    if "quantize.embedding.weight" in keys:
        return "vq (LlamaGen)"
    if "tok_embeddings.weight" in keys:
        return "gpt (LlamaGen)"
    return "unknown"


def _state(ckpt: dict, field: str, path, use_ema: bool) -> dict:
    key = "model_ema" if use_ema else "model"
    if key not in ckpt:
        others = ", ".join(sorted(map(str, ckpt)))
        fix = "set model.use_ema=false to load 'model'" if use_ema and "model" in ckpt else "check the file"
        raise ValueError(f"{field}={path}: no '{key}' in the checkpoint (it has: {others}); {fix}")
    return ckpt[key]


def _count(sd: dict, prefix: str) -> int:
    pat = re.compile(re.escape(prefix) + r"(\d+)\.")
    return len({m.group(1) for k in sd if (m := pat.match(k))})


def mar_args(sd: dict, num_heads: Optional[int] = None, num_sampling_steps: Optional[int] = None) -> MARArgs:
    """MAR's sizes from its weights (patch size 1 and VAE stride 16, as in every released model)."""
    D, C = sd["z_proj.weight"].shape
    Dd = sd["decoder_embed.weight"].shape[0]
    N = sd["diffusion_pos_embed_learned"].shape[1]
    heads = num_heads or HEADS_BY_WIDTH.get(D)
    if heads is None:
        raise ValueError(f"a MAR of width {D} is none of the presets ({sorted(HEADS_BY_WIDTH)}): set model.num_heads")
    side = int(round(N ** 0.5))
    cond = "class" if "class_emb.weight" in sd else "caption"
    return MARArgs(img_size=side * VAE_STRIDE, vae_stride=VAE_STRIDE, encoder_embed_dim=D,
                   encoder_depth=_count(sd, "encoder_blocks."), encoder_num_heads=heads, decoder_embed_dim=Dd,
                   decoder_depth=_count(sd, "decoder_blocks."), decoder_num_heads=num_heads or HEADS_BY_WIDTH.get(Dd, heads),
                   mlp_ratio=sd["encoder_blocks.0.mlp.fc1.weight"].shape[0] / D, vae_embed_dim=C, cond=cond,
                   class_num=sd["class_emb.weight"].shape[0] if cond == "class" else 0,
                   caption_dim=sd["caption_proj.weight"].shape[1] if cond == "caption" else 0,
                   buffer_size=sd["encoder_pos_embed_learned"].shape[1] - N,
                   diffloss_d=_count(sd, "diffloss.net.res_blocks."), diffloss_w=sd["diffloss.net.input_proj.weight"].shape[0],
                   num_sampling_steps=num_sampling_steps or 100)


def vae_args(sd: dict, scale: float) -> VAEArgs:
    """The KL VAE's sizes from its weights (LDM layout)."""
    ch = sd["encoder.conv_in.weight"].shape[0]
    levels = _count(sd, "encoder.down.")
    mult = [sd[f"encoder.down.{i}.block.0.conv1.weight"].shape[0] // ch for i in range(levels)]
    attn = lambda part: [NOMINAL_RESOLUTION >> i for i in range(levels) if f"{part}.{i}.attn.0.q.weight" in sd]  # noqa: E731
    return VAEArgs(embed_dim=sd["post_quant_conv.weight"].shape[0], ch=ch, ch_mult=mult,
                   num_res_blocks=_count(sd, "encoder.down.0.block."), resolution=NOMINAL_RESOLUTION,
                   enc_attn_resolutions=attn("encoder.down"), dec_attn_resolutions=attn("decoder.up"),
                   norm_groups=32, scale=scale)


def _build(cls, args, check_only: bool) -> torch.nn.Module:
    """The model, or (check_only) its skeleton on the meta device: shapes without memory."""
    if not check_only:
        return cls(args)
    with torch.device("meta"):
        return cls(args)


def load_strict(model: torch.nn.Module, sd: dict, field: str, path) -> torch.nn.Module:
    """load_state_dict(strict) with the first differences in one line, instead of a page of keys; a model
    on the meta device is only checked."""
    own = model.state_dict()
    missing = [k for k in own if k not in sd]
    unexpected = [k for k in sd if k not in own]
    shapes = [f"{k} {tuple(sd[k].shape)} vs {tuple(v.shape)}" for k, v in own.items()
              if k in sd and tuple(sd[k].shape) != tuple(v.shape)]
    if missing or unexpected or shapes:
        parts = [f"{len(x)} {what} ({', '.join(x[:3])}{', ...' if len(x) > 3 else ''})"
                 for x, what in ((missing, "missing"), (unexpected, "unexpected"), (shapes, "of the wrong shape")) if x]
        raise ValueError(f"{field}={path}: does not fit the model its weights describe: {'; '.join(parts)}")
    if any(p.is_meta for p in model.parameters()):
        return model
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in sd.items()}, strict=True)
    return model.eval()


def _expect(sd: dict, want: str, field: str, path) -> None:
    got = family_of(sd)
    if got != want:
        hint = {"kl_vae": "it is a KL VAE: pass it as model.vae_ckpt", "mar": "it is a MAR: pass it as model.mar_ckpt"}
        raise ValueError(f"{field}={path}: not a {want} checkpoint ({hint.get(got, f'it looks like {got}')})")


def load_mar(path, field: str = "model.mar_ckpt", use_ema: bool = True, num_heads: Optional[int] = None,
             num_sampling_steps: Optional[int] = None, check_only: bool = False) -> MAR:
    ckpt, meta = read_container(path, field)
    if meta.get("kind") == MAR.kind:  # one of ours: sizes in its metadata
        m = _build(MAR, MARArgs(**meta["args"]), True) if check_only else load_module(path, MAR)
        if num_sampling_steps:
            m.diffloss.num_sampling_steps = num_sampling_steps
        return m
    if not meta:  # what the file is first (its weights under either key), then the key asked for
        _expect(next((v for k, v in ckpt.items() if k in ("model_ema", "model") and isinstance(v, dict)), {}),
                "mar", field, path)
    sd = _state(ckpt, field, path, use_ema) if not meta else ckpt["model"]
    _expect(sd, "mar", field, path)
    try:
        args = mar_args(sd, num_heads, num_sampling_steps)
    except (KeyError, IndexError) as e:
        raise ValueError(f"{field}={path}: a MAR checkpoint without {e}: the file is incomplete") from None
    except ValueError as e:
        raise ValueError(f"{field}={path}: {e}") from None
    return load_strict(_build(MAR, args, check_only), sd, field, path)


def load_vae(path, field: str = "model.vae_ckpt", scale: float = 0.2325, check_only: bool = False) -> AutoencoderKL:
    ckpt, meta = read_container(path, field)
    if meta.get("kind") == AutoencoderKL.kind:
        return _build(AutoencoderKL, VAEArgs(**meta["args"]), True) if check_only else load_module(path, AutoencoderKL)
    sd = _state(ckpt, field, path, use_ema=False)
    sd = {k: v for k, v in sd.items() if not k.startswith("loss.")}
    _expect(sd, "kl_vae", field, path)
    try:
        args = vae_args(sd, scale)
    except (KeyError, IndexError) as e:
        raise ValueError(f"{field}={path}: a KL VAE checkpoint without {e}: the file is incomplete") from None
    return load_strict(_build(AutoencoderKL, args, check_only), sd, field, path)


def inspect(path) -> dict:
    """What a checkpoint is: {'family', 'container', and for MAR / KL VAE: 'preset', 'dims'}."""
    ckpt, meta = read_container(path, "checkpoint")
    container = sorted(map(str, ckpt)) if not meta else ["safetensors", meta.get("kind", "no kind")]
    sd = ckpt.get("model_ema") or ckpt.get("model") or {}
    out = {"path": str(path), "family": meta.get("kind") or family_of(sd), "container": container}
    if out["family"] == "mar":
        # heads are not in the weights: any value describes the sizes (the loader asks for model.num_heads)
        a = mar_args(sd, num_heads=HEADS_BY_WIDTH.get(sd["z_proj.weight"].shape[0], 1)) if not meta else MARArgs(**meta["args"])
        dims = {k: getattr(a, k) for k in ("encoder_embed_dim", "encoder_depth", "decoder_embed_dim", "decoder_depth",
                                           "diffloss_d", "diffloss_w", "vae_embed_dim", "buffer_size", "cond",
                                           "class_num", "img_size")}
        out["preset"] = next((n for n, p in MAR_PRESETS.items() if all(dims[k] == v for k, v in p.items()
                                                                        if k in dims)), "custom")
        out["dims"] = dims
    elif out["family"] == "kl_vae":
        sd = {k: v for k, v in sd.items() if not k.startswith("loss.")}
        a = vae_args(sd, 0.2325) if not meta else VAEArgs(**meta["args"])
        out["dims"] = {"embed_dim": a.embed_dim, "ch": a.ch, "ch_mult": a.ch_mult, "num_res_blocks": a.num_res_blocks,
                       "downsample": a.downsample}
        out["preset"] = "kl16" if (a.embed_dim, a.ch, list(a.ch_mult)) == (16, 128, [1, 1, 2, 2, 4]) else "custom"
    return out
