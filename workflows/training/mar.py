"""Stages `mar_vae`, `mar` and `mar_draft`: the continuous shapes models (decoding/mar/), trained on CPU.

- `mar_vae`: a KL autoencoder (LDM layout, 64x64 images -> 16x16 latent tokens) with L1 + L2
  reconstruction and a small KL term; its latent scale (MAR's 0.2325 for KL-16) is 1 / std of the
  training latents, stored in its arguments.
- `mar` / `mar_draft`: a caption-conditioned MAR target and a smaller draft, trained the MAR way (random
  orders, truncated-Gaussian masking ratio, diffusion loss on the masked tokens, condition dropout for
  CFG, an EMA of the weights is what ships) on posterior samples of the VAE's latents. The caption
  encoder is the shapes family's word-level encoder, frozen and copied next to the weights, so the
  continuous bundle is self-contained.

Every stage can resume from its own weights (`resume=true`), and writes one safetensors file.
"""
from __future__ import annotations

import copy
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from decoding.checkpoint import load_module, save_module
from decoding.models.mar import MAR, MARArgs
from decoding.models.text import TextEncoder
from decoding.models.vae import AutoencoderKL, VAEArgs
from workflows.training.common import render_pool, run_steps, to_float
from workflows.training.vq import psnr

log = logging.getLogger("arspec.train")


def _need(path: Path, stage: str) -> Path:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run the `{stage}` stage first "
                                f"(python -m workflows.train stages=[{stage}])")
    return path


# -- the VAE --------------------------------------------------------------------------------------------
@torch.no_grad()
def encode_pool(vae: AutoencoderKL, images_u8: torch.Tensor, chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    vae.eval()
    out = [vae.moments(to_float(images_u8[i:i + chunk])) for i in range(0, len(images_u8), chunk)]
    return torch.cat([m for m, _ in out]), torch.cat([v for _, v in out])


@torch.no_grad()
def evaluate_vae(vae: AutoencoderKL, images_u8: torch.Tensor) -> dict:
    mean, logvar = encode_pool(vae, images_u8)
    recs = torch.cat([vae.decode(mean[i:i + 128]) for i in range(0, len(mean), 128)])
    gen = torch.Generator().manual_seed(0)
    noisy = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
    recs_s = torch.cat([vae.decode(noisy[i:i + 128]) for i in range(0, len(noisy), 128)])
    vae.train()
    x = to_float(images_u8)
    return {"psnr_db": psnr(recs, x), "psnr_sampled_db": psnr(recs_s, x),
            "latent_std": float(mean.std()), "posterior_std": float(torch.exp(0.5 * logvar).mean()),
            "kl_per_element": float(AutoencoderKL.kl(mean, logvar).mean() / mean[0].numel())}


def train_vae(cfg, out_dir: Path) -> dict:
    torch.manual_seed(cfg.seed)
    args = VAEArgs(embed_dim=cfg.embed_dim, ch=cfg.ch, ch_mult=list(cfg.ch_mult), num_res_blocks=cfg.num_res_blocks,
                   resolution=64, enc_attn_resolutions=list(cfg.attn_resolutions),
                   dec_attn_resolutions=list(cfg.attn_resolutions), norm_groups=cfg.norm_groups, scale=1.0)
    vae = AutoencoderKL(args)
    if cfg.resume:
        vae.load_state_dict(load_module(_need(out_dir / "vae.safetensors", "mar_vae"), AutoencoderKL).state_dict())
    _, train = render_pool(cfg.train_images, seed=cfg.seed)
    _, held_out = render_pool(cfg.eval_images, seed=cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed)

    def step(_):
        x = to_float(train[torch.randint(len(train), (cfg.batch,), generator=gen)])
        if cfg.crop:  # crops on the latent lattice: the same convolutions, a fraction of the cost
            g = args.downsample
            r, c = (int(v) * g for v in torch.randint(0, (x.shape[2] - cfg.crop) // g + 1, (2,), generator=gen))
            x = x[:, :, r:r + cfg.crop, c:c + cfg.crop]
        mean, logvar = vae.moments(x)
        z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
        rec = vae.decode(z).float()
        rec_loss = (rec - x).abs().mean() + F.mse_loss(rec, x)
        kl = AutoencoderKL.kl(mean.float(), logvar.float()).mean() / mean[0].numel()
        return rec_loss + cfg.kl_weight * kl, {"rec": rec_loss.item(), "kl": kl.item()}

    stats = run_steps("mar_vae", vae.parameters(), step, cfg.steps, cfg.lr, log_every=cfg.log_every)
    if cfg.full_steps:  # the crop-trained decoder on whole images, the encoder frozen (latents do not move)
        crop_metrics = evaluate_vae(vae, held_out)
        log.info(f"[mar_vae] after crops: {crop_metrics}")
        for m in (vae.encoder, vae.quant_conv):
            m.requires_grad_(False)

        def full_step(_):
            x = to_float(train[torch.randint(len(train), (cfg.full_batch,), generator=gen)])
            with torch.no_grad():
                mean, logvar = vae.moments(x)
                z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=gen)
            rec = vae.decode(z).float()
            return (rec - x).abs().mean() + F.mse_loss(rec, x), {}

        stats = run_steps("mar_vae_decoder", [p for p in vae.parameters() if p.requires_grad], full_step,
                          cfg.full_steps, cfg.full_lr, log_every=cfg.log_every)
        stats["psnr_after_crops_db"] = crop_metrics["psnr_db"]
    metrics = evaluate_vae(vae, held_out)
    vae.args.scale = round(1.0 / metrics["latent_std"], 4)   # MAR feeds scale * latent (KL-16: 0.2325)
    log.info(f"[mar_vae] held-out {metrics}, latent scale {vae.args.scale}")
    save_module(vae.eval(), out_dir / "vae.safetensors", metrics=metrics)
    return {**stats, **metrics, "scale": vae.args.scale}


# -- MAR target and draft -------------------------------------------------------------------------------
def copy_text_encoder(src: Path, out_dir: Path) -> TextEncoder:
    """The shapes family's caption encoder, copied beside the MAR weights (frozen: its features are what
    the MAR learns to read)."""
    dst = out_dir / "text.safetensors"
    if not dst.exists():  # once: a MAR trained on these features keeps them when the shapes GPT is retrained
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_need(src, "gpt"), dst)
    return load_module(dst, TextEncoder)


class EMA:
    """EMA of the weights with MAR's rate, warmed up (decay min(rate, (1+n)/(10+n))) for short runs."""

    def __init__(self, model: torch.nn.Module, rate: float):
        self.model, self.rate, self.n = copy.deepcopy(model).eval(), rate, 0
        self.model.requires_grad_(False)

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        d = min(self.rate, (1 + self.n) / (10 + self.n))
        for e, p in zip(self.model.parameters(), model.parameters()):
            e.lerp_(p.detach(), 1 - d)
        self.n += 1


def _text_src(cfg) -> Path:
    from decoding.shapes.family import WEIGHTS
    return Path(cfg.text_from) if cfg.text_from else WEIGHTS / "text.safetensors"


def _mar_args(cfg, vae: AutoencoderKL, text: TextEncoder) -> MARArgs:
    return MARArgs(img_size=64, vae_stride=vae.args.downsample, encoder_embed_dim=cfg.dim, encoder_depth=cfg.enc_depth,
                   encoder_num_heads=cfg.heads, decoder_embed_dim=cfg.dim, decoder_depth=cfg.dec_depth,
                   decoder_num_heads=cfg.heads, vae_embed_dim=vae.args.embed_dim, mask_ratio_min=cfg.mask_ratio_min,
                   label_drop_prob=cfg.cond_dropout, cond="caption", class_num=0, caption_dim=text.args.dim,
                   buffer_size=text.args.max_len, diffloss_d=cfg.head_depth, diffloss_w=cfg.head_width,
                   num_sampling_steps=cfg.num_sampling_steps, clip_x0=cfg.get("clip_x0"))


def train_mar(cfg, out_dir: Path, name: str = "mar") -> dict:
    """Stage `mar` (cfg.file = mar) or `mar_draft` (cfg.file = draft): the same recipe, other sizes."""
    torch.manual_seed(cfg.seed)
    vae = load_module(_need(out_dir / "vae.safetensors", "mar_vae"), AutoencoderKL)
    text = copy_text_encoder(_text_src(cfg), out_dir)
    model = MAR(_mar_args(cfg, vae, text))
    path = out_dir / f"{cfg.file}.safetensors"
    if cfg.resume:
        model.load_state_dict(load_module(_need(path, name), MAR).state_dict())
        log.info(f"[{name}] resuming from {path}")
    log.info(f"[{name}] {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    def pool(n, seed):
        scenes, images = render_pool(n, seed)
        mean, logvar = encode_pool(vae, images)
        ids, mask, _ = text.tokenize([s.caption for s in scenes])
        with torch.no_grad():
            feats = text(ids, mask)
        return mean, logvar, feats, mask

    mean, logvar, feats, mask = pool(cfg.train_images, cfg.seed)
    ev = pool(cfg.eval_images, cfg.seed + 1)
    log.info(f"[{name}] encoded {len(mean)} training images to {tuple(mean.shape[1:])} latents")
    gen = torch.Generator().manual_seed(cfg.seed)
    ema = EMA(model, cfg.ema)
    teacher = None
    if cfg.get("distill", 0):  # the draft imitates the target's head (trained before it: stage `mar`)
        t_model = load_module(_need(out_dir / f"{cfg.teacher}.safetensors", "mar"), MAR).eval().requires_grad_(False)
        teacher = (t_model, cfg.distill)
        log.info(f"[{name}] distilling from {cfg.teacher}.safetensors (weight {cfg.distill})")

    aux = None
    if cfg.get("aux_x0", 0):  # a training-only linear probe z -> token (MAR.loss); not saved
        aux = (torch.nn.Linear(model.args.decoder_embed_dim, model.args.token_dim), cfg.aux_x0)
        log.info(f"[{name}] auxiliary token regression from z (weight {cfg.aux_x0})")

    def tokens_of(m, lv, g):
        z = m + torch.exp(0.5 * lv) * torch.randn(m.shape, generator=g)   # posterior samples, as MAR trains
        return model.patchify(z * vae.args.scale)

    def step(i):
        if i:
            ema.update(model)
        if i and i % cfg.save_every == 0:  # a killed run leaves weights to resume from
            save_module(ema.model, path, partial_step=i)
        b = torch.randint(len(mean), (cfg.batch,), generator=gen)
        drop = torch.rand(cfg.batch, generator=gen) < cfg.cond_dropout
        buf = model.buffer(features=feats[b], mask=mask[b], drop=drop)
        t_arg = None
        if teacher is not None:
            with torch.no_grad():
                t_arg = (teacher[0], teacher[0].buffer(features=feats[b], mask=mask[b], drop=drop), teacher[1])
        return model.loss(tokens_of(mean[b], logvar[b], gen), buf, cfg.diffusion_batch_mul, gen,
                          last_step_prob=cfg.get("last_step_prob", 0.0), teacher=t_arg, aux=aux), {}

    params = list(model.parameters()) + (list(aux[0].parameters()) if aux else [])
    stats = run_steps(name, params, step, cfg.steps, cfg.lr, weight_decay=cfg.weight_decay,
                      warmup=cfg.warmup, log_every=cfg.log_every)
    ema.update(model)
    metrics = evaluate_mar(ema.model, vae, ev, cfg.seed)
    log.info(f"[{name}] held-out diffusion loss (EMA weights) {metrics}")
    save_module(ema.model, path, metrics=metrics)
    return {**stats, **metrics}


@torch.no_grad()
def evaluate_mar(model: MAR, vae: AutoencoderKL, ev, seed: int, reps: int = 4) -> dict:
    """Held-out diffusion loss at masking ratios 0.9 and 0.5, with and without the caption: a model that
    reads the caption does better with it."""
    mean, logvar, feats, mask = ev
    model.eval()
    out = {}
    for ratio in (0.9, 0.5):
        for cond in (True, False):
            g = torch.Generator().manual_seed(seed)
            losses = []
            for _ in range(reps):
                z = mean + torch.exp(0.5 * logvar) * torch.randn(mean.shape, generator=g)
                tokens = model.patchify(z * vae.args.scale)
                B, N, _ = tokens.shape
                order = torch.rand(B, N, generator=g).argsort(1)
                known = order[:, math.ceil(N * ratio):].sort(1).values
                drop = torch.full((B,), not cond)
                zc = model.forward_z(tokens, known, model.buffer(features=feats, mask=mask, drop=drop))
                masked = torch.ones(B, N).scatter_(1, known, 0.0)
                losses.append(model.diffloss.loss(tokens.reshape(B * N, -1), zc.reshape(B * N, -1),
                                                  masked.reshape(-1), generator=g).item())
            out[f"eval_loss_mask{ratio}_{'cond' if cond else 'uncond'}"] = round(float(np.mean(losses)), 4)
    out.update(sampler_check(model, vae, ev, seed))
    return out


@torch.no_grad()
def sampler_check(model: MAR, vae: AutoencoderKL, ev, seed: int, steps: int = 100) -> dict:
    """What the sampler needs of the head, on held-out images at masking ratio 0.9 with the caption:
    the ε error at t = T-1 (the first sampling step multiplies it by ~316) and the spread of tokens drawn
    by the 100-step sampler against the data's (a head whose first step is off drifts to huge tokens),
    with the model's clip_x0 and without."""
    from decoding.models.diffloss import schedule
    mean, logvar, feats, mask = ev
    g = torch.Generator().manual_seed(seed)
    tokens = model.patchify(mean * vae.args.scale)
    B, N, C = tokens.shape
    order = torch.rand(B, N, generator=g).argsort(1)
    known = order[:, math.ceil(N * 0.9):].sort(1).values
    z = model.forward_z(tokens, known, model.buffer(features=feats, mask=mask)).reshape(B * N, -1)
    x0 = tokens.reshape(B * N, C)
    s = schedule(None)
    T = s.num_timesteps - 1
    noise = torch.randn(x0.shape, generator=g)
    x_t = math.sqrt(s.ac[T]) * x0 + math.sqrt(1 - s.ac[T]) * noise
    eps = model.diffloss.net(x_t, torch.full((len(x0),), T), z)[:, :C]
    x_T, eps_t = torch.randn(x0.shape, generator=g), torch.randn(len(x0), steps, C, generator=g)
    out = {"eps_mse_last_step": round(float((eps - noise).pow(2).mean()), 6), "data_std": round(float(x0.std()), 4),
           "sample_std": round(float(model.diffloss.sample(z, x_T, eps_t, 1.0, steps=steps).x.std()), 4)}
    clip, model.diffloss.clip_x0 = model.diffloss.clip_x0, None
    out["sample_std_unclipped"] = round(float(model.diffloss.sample(z, x_T, eps_t, 1.0, steps=steps).x.std()), 4)
    model.diffloss.clip_x0 = clip
    return out
