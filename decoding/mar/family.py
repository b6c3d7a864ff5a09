"""The `mar` model family: continuous tokens (a KL VAE, a MAR target with its diffusion head, optionally a
smaller draft MAR for `cspd`).

With no checkpoint settings it loads the continuous shapes models trained by `python -m workflows.train
stages=[mar_vae,mar,mar_draft]` and shipped in decoding/mar/weights/ (caption-conditioned, with the
shapes word encoder). With `model.mar_ckpt` (+ `model.vae_ckpt`, optionally `model.draft_mar_ckpt`) it
loads public LTH14/mar releases: `checkpoint-last.pth` ({'model', 'model_ema', ...}: `model_ema` when
`use_ema`) and the KL-16 VAE (`{'model': ...}`), strictly, with their sizes read from the weights
(decoding/mar/checkpoints.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from decoding.checkpoint import load_module, read_header
from decoding.mar.bundle import MarBundle, check_parts
from decoding.mar.checkpoints import inspect, load_mar, load_vae
from decoding.models.mar import MAR, MARArgs
from decoding.models.text import TextEncoder
from decoding.models.vae import AutoencoderKL
from decoding.registry import Family, ModelConfig
from decoding.sampling import SamplingParams

WEIGHTS = Path(__file__).parent / "weights"


@dataclass
class MarConfig(ModelConfig):
    name: str = "mar"
    weights_dir: Optional[str] = None        # the shipped continuous shapes models (null = packaged)
    mar_ckpt: Optional[str] = None           # a public MAR checkpoint-last.pth (or .safetensors): the target
    draft_mar_ckpt: Optional[str] = None     # a smaller public MAR for cspd (e.g. MAR-B drafting for MAR-H)
    vae_ckpt: Optional[str] = None           # the KL-16 VAE (kl16.ckpt) the MAR checkpoints were trained on
    use_ema: bool = True                     # public checkpoints: `model_ema` (inference); false: `model`
    num_heads: Optional[int] = None          # public checkpoints: attention heads (null = by the MAR preset of that width)
    vae_scale: float = 0.2325                # public checkpoints: token = scale * VAE latent (KL-16)
    num_sampling_steps: Optional[int] = None  # diffusion steps per token (null = the model's own: MAR 100)
    clip_x0: Optional[float] = None          # clip the head's predicted x_0 to ±this (null = the model's own:
                                             # none for MAR checkpoints, the shipped models carry theirs)


def weights_dir(cfg: MarConfig) -> Path:
    return Path(cfg.weights_dir) if cfg.weights_dir else WEIGHTS


def _settings(cfg: MarConfig) -> None:
    """The settings' own consistency (no file read)."""
    if cfg.mar_ckpt is None and (cfg.draft_mar_ckpt or cfg.vae_ckpt):
        set_ = "model.draft_mar_ckpt" if cfg.draft_mar_ckpt else "model.vae_ckpt"
        raise ValueError(f"{set_} is set but model.mar_ckpt is not: give the target MAR checkpoint too")
    if cfg.mar_ckpt is not None and cfg.vae_ckpt is None:
        raise ValueError("model.vae_ckpt is not set: a MAR checkpoint needs the KL VAE it was trained on (kl16.ckpt)")
    if cfg.clip_x0 is not None and not cfg.clip_x0 > 0:
        raise ValueError(f"model.clip_x0={cfg.clip_x0}: must be > 0 (null = the model's own setting)")
    if cfg.num_sampling_steps is not None and not 1 <= cfg.num_sampling_steps <= 1000:
        raise ValueError(f"model.num_sampling_steps={cfg.num_sampling_steps}: must be in [1, 1000] (null = the model's own)")


def _public(cfg: MarConfig, check_only: bool):
    """target, draft (or None), VAE from the public checkpoints, with the sampler settings applied."""
    target = load_mar(cfg.mar_ckpt, "model.mar_ckpt", cfg.use_ema, cfg.num_heads, cfg.num_sampling_steps, check_only)
    draft = None if cfg.draft_mar_ckpt is None else load_mar(
        cfg.draft_mar_ckpt, "model.draft_mar_ckpt", cfg.use_ema, cfg.num_heads, cfg.num_sampling_steps, check_only)
    vae = load_vae(cfg.vae_ckpt, "model.vae_ckpt", cfg.vae_scale, check_only)
    _sampler(cfg, target, draft)
    check_parts(target, draft, vae.args.embed_dim, (f"model.mar_ckpt={cfg.mar_ckpt}",
                                                   f"model.draft_mar_ckpt={cfg.draft_mar_ckpt}", f"model.vae_ckpt={cfg.vae_ckpt}"))
    return target, draft, vae


def load(cfg: MarConfig, device) -> MarBundle:
    _settings(cfg)
    if cfg.mar_ckpt is None:
        return _load_shipped(cfg, device)
    target, draft, vae = _public(cfg, check_only=False)
    return MarBundle("mar", vae, target, draft, None, device, cfg.dtype, FAMILY.sampling)


def check(cfg: MarConfig) -> dict:
    """What the job's driver checks before anything starts, without loading weights: the settings, every
    file readable and of the right kind, its keys and shapes exactly the model its weights describe (meta
    device, memory-mapped), and the parts fitting together (draft and target, VAE channels), each refusal
    one line naming the setting and the fix. -> {"drafter": bool (a draft MAR, for cspd), "seq_len": the
    target's tokens per image}."""
    _settings(cfg)
    if cfg.mar_ckpt is not None:
        target, draft, _ = _public(cfg, check_only=True)
        return {"drafter": draft is not None, "seq_len": target.args.seq_len}
    d = weights_dir(cfg)
    _shipped_files(d)
    with torch.device("meta"):
        target, draft = (MAR(MARArgs(**read_header(d / f"{f}.safetensors")[0]["args"]))
                         if (d / f"{f}.safetensors").exists() else None for f in ("mar", "draft"))
    _sampler(cfg, target, draft)
    check_parts(target, draft, read_header(d / "vae.safetensors")[0]["args"]["embed_dim"],
                (f"model.weights_dir={d} (mar)", f"model.weights_dir={d} (draft)", f"model.weights_dir={d} (vae)"))
    return {"drafter": draft is not None, "seq_len": target.args.seq_len}


def _sampler(cfg: MarConfig, *models) -> None:
    """The sampler settings given in `model.` over the models' own."""
    for m in models:
        if m is not None:
            if cfg.num_sampling_steps:
                m.diffloss.num_sampling_steps = cfg.num_sampling_steps
            if cfg.clip_x0 is not None:
                m.diffloss.clip_x0 = cfg.clip_x0


def _shipped_files(d: Path) -> None:
    missing = [f for f in ("vae", "mar", "text") if not (d / f"{f}.safetensors").exists()]
    if missing:
        raise FileNotFoundError(f"model.weights_dir={d} lacks {', '.join(m + '.safetensors' for m in missing)}; "
                                f"train them with `python -m workflows.train stages=[mar_vae,mar,mar_draft]` "
                                f"or point model.weights_dir elsewhere")


def _load_shipped(cfg: MarConfig, device) -> MarBundle:
    d = weights_dir(cfg)
    _shipped_files(d)
    target = load_module(d / "mar.safetensors", MAR)
    draft = load_module(d / "draft.safetensors", MAR) if (d / "draft.safetensors").exists() else None
    _sampler(cfg, target, draft)
    return MarBundle("mar", load_module(d / "vae.safetensors", AutoencoderKL), target, draft,
                     load_module(d / "text.safetensors", TextEncoder), device, cfg.dtype, FAMILY.sampling)


def scorer(cfg: MarConfig):
    """The shapes attribute scorer reads these 64x64 images too (public checkpoints: none)."""
    if cfg.mar_ckpt is not None:
        return None
    from decoding.shapes.family import FAMILY as SHAPES, ShapesConfig
    return SHAPES.scorer(ShapesConfig())


# MAR's reference evaluation: linear CFG schedule, temperature 1; the scale depends on the model (MAR-B 2.9,
# -L 3.0, -H 3.2). The shipped shapes models use 3 as well (not tuned on them: the bench's adherence says
# how well they follow the caption at it).
FAMILY = Family("mar", MarConfig, load, SamplingParams(cfg_scale=3.0, temperature=1.0, top_k=0, top_p=1.0), scorer,
                inspect=check, tokens="continuous")

__all__ = ["FAMILY", "MarConfig", "WEIGHTS", "inspect", "load"]
