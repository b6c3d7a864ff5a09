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

from decoding.checkpoint import load_module
from decoding.mar.bundle import MarBundle
from decoding.mar.checkpoints import inspect, load_mar, load_vae
from decoding.models.mar import MAR
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


def load(cfg: MarConfig, device) -> MarBundle:
    if cfg.mar_ckpt is None:
        if cfg.draft_mar_ckpt or cfg.vae_ckpt:
            set_ = "model.draft_mar_ckpt" if cfg.draft_mar_ckpt else "model.vae_ckpt"
            raise ValueError(f"{set_} is set but model.mar_ckpt is not: give the target MAR checkpoint too")
        return _load_shipped(cfg, device)
    if cfg.vae_ckpt is None:
        raise ValueError("model.vae_ckpt is not set: a MAR checkpoint needs the KL VAE it was trained on (kl16.ckpt)")
    target = load_mar(cfg.mar_ckpt, "model.mar_ckpt", cfg.use_ema, cfg.num_heads, cfg.num_sampling_steps)
    draft = None if cfg.draft_mar_ckpt is None else \
        load_mar(cfg.draft_mar_ckpt, "model.draft_mar_ckpt", cfg.use_ema, cfg.num_heads, cfg.num_sampling_steps)
    vae = load_vae(cfg.vae_ckpt, "model.vae_ckpt", cfg.vae_scale)
    _sampler(cfg, target, draft)
    return MarBundle("mar", vae, target, draft, None, device, cfg.dtype, FAMILY.sampling)


def _sampler(cfg: MarConfig, *models) -> None:
    """The sampler settings given in `model.` over the models' own."""
    if cfg.clip_x0 is not None and not cfg.clip_x0 > 0:
        raise ValueError(f"model.clip_x0={cfg.clip_x0}: must be > 0 (null = the model's own setting)")
    for m in models:
        if m is not None:
            if cfg.num_sampling_steps:
                m.diffloss.num_sampling_steps = cfg.num_sampling_steps
            if cfg.clip_x0 is not None:
                m.diffloss.clip_x0 = cfg.clip_x0


def _load_shipped(cfg: MarConfig, device) -> MarBundle:
    d = weights_dir(cfg)
    missing = [f for f in ("vae", "mar", "text") if not (d / f"{f}.safetensors").exists()]
    if missing:
        raise FileNotFoundError(f"model.weights_dir={d} lacks {', '.join(m + '.safetensors' for m in missing)}; "
                                f"train them with `python -m workflows.train stages=[mar_vae,mar,mar_draft]` "
                                f"or point model.weights_dir elsewhere")
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
                tokens="continuous")

__all__ = ["FAMILY", "MarConfig", "WEIGHTS", "inspect", "load"]
