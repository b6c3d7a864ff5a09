"""Random-weight checkpoints in the public LTH14/mar layout, and the noise of a sampling run, for
tests/test_mar_reference.py and for tests/fixtures/make_mar_reference.py (which feeds the same weights and
the same noise to MAR's own code).

The files are what LTH14/mar writes and reads: `checkpoint-last.pth` = {'model', 'model_ema', 'optimizer',
'epoch', 'scaler', 'args'} (util/misc.py save_model; inference reads `model_ema`) and `kl16.ckpt` =
{'model': the KL VAE's state dict}. The key names are those of MAR-B/L/H and of KL-16; only the sizes are
cut down, each through an argument that the reference's constructors take: `MAR(...)` with narrow, shallow
encoder / decoder / diffusion head (norm eps 1e-6, as its mar_base/large/huge presets), and
`AutoencoderKL(embed_dim=16, ch_mult=(1, 1))` (its channel width 128 and 2 residual blocks per level are
fixed there; two levels instead of KL-16's five).

Weights and noise are pure functions of (seed, name): tests/llamagen_layouts.det_tensor's integer hashing
with its own frozen bits-to-float map, so the fixture made once with the reference code stays valid.
"""
from __future__ import annotations

import argparse
import math
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn as nn

from decoding.models.mar import MAR, MARArgs
from decoding.models.vae import AutoencoderKL, VAEArgs
from tests.llamagen_layouts import SQRT3, det_tensor

# The reference MAR's constructor arguments (models/mar.py MAR.__init__); the rest are its defaults.
# 64 px / VAE stride 16 -> a 4 x 4 grid of 16-channel tokens; 64 condition slots as every released MAR.
MAR_TINY = dict(img_size=64, vae_stride=16, patch_size=1, encoder_embed_dim=64, encoder_depth=2, encoder_num_heads=4,
                decoder_embed_dim=48, decoder_depth=2, decoder_num_heads=4, mlp_ratio=4.0, vae_embed_dim=16,
                class_num=1000, buffer_size=64, diffloss_d=2, diffloss_w=96)
NUM_HEADS = 4                 # not in the weights: the user gives model.num_heads for a width that is no preset
SAMPLING_STEPS = 50           # diffusion steps per token (the reference's num_sampling_steps='50'; ours
                              # model.num_sampling_steps=50): half its default, to keep the test short
KL_TINY = dict(embed_dim=16, ch_mult=(1, 1))    # the reference AutoencoderKL's arguments
VAE_SCALE = 0.2325            # MAR: tokens = 0.2325 * KL-16 latents


def mar_args() -> MARArgs:
    return MARArgs(**MAR_TINY, num_sampling_steps=SAMPLING_STEPS)


def vae_args() -> VAEArgs:
    return VAEArgs(embed_dim=KL_TINY["embed_dim"], ch=128, ch_mult=list(KL_TINY["ch_mult"]), num_res_blocks=2,
                   enc_attn_resolutions=[16], dec_attn_resolutions=[], scale=VAE_SCALE)


# Standard deviations by parameter name (first match), over fan-in scaling for every other weight. The
# embeddings are O(1) so that positions and classes matter to attention.
_STD = (("pos_embed_learned", 0.5), ("class_emb.", 1.0), ("fake_latent", 1.0), ("mask_token", 1.0),
        ("post_quant_conv.weight", 0.25), ("decoder.conv_out.weight", 0.3))


def det_weights(module: nn.Module, seed: int) -> dict:
    """Every tensor of `module`'s state dict, a function of (seed, key name): norm scales 1 ± 0.17, biases
    std 0.05, weights std/sqrt(fan-in) (std 1 or _STD's), bare parameters and class embeddings std itself."""
    norms = {f"{n}.weight" for n, m in module.named_modules() if isinstance(m, (nn.LayerNorm, nn.GroupNorm))}
    out = {}
    for name, t in module.state_dict().items():
        std = next((s for key, s in _STD if key in name), 1.0)
        if name in norms:
            out[name] = det_tensor(t.shape, seed, name, 0.1, mean=1.0)
        elif name.endswith(".bias"):
            out[name] = det_tensor(t.shape, seed, name, 0.05)
        elif "." not in name or name.startswith("class_emb."):
            out[name] = det_tensor(t.shape, seed, name, std)
        else:
            out[name] = det_tensor(t.shape, seed, name, std / math.sqrt(math.prod(t.shape[1:])))
    return out


def denoising_head(sd: dict, seed: int, prefix: str = "diffloss.net.", P: float = 10.0) -> dict:
    """The diffusion head's weights, random around the map a trained head has at t = 999: ε ≈ x_t.

    A purely random head fails there by O(1), and the sampler's first step (t = 999, where sqrt(ᾱ) = 5e-5)
    multiplies the error of ε by hundreds: its tokens end ~2e4, where no absolute tolerance is tight and a VAE
    (whose GroupNorms undo any scale) would decode the same image with or without MAR's latent scale.
    Here input_proj puts x_t in the first C of the width's dimensions and a fixed zero-mean pattern of
    size P in the others, so that the final LayerNorm divides by a nearly constant σ; the final linear
    undoes that LayerNorm on the first C (σ (I + J/(w - C)), J all ones), so ε = x_t + what the residual
    blocks add: their gates (and the final adaLN's shift and scale) are random functions of the time step
    and of the MAR's condition z, made small enough (3e-3 and 1e-3 of the usual size) that tokens stay
    O(1) after that factor (~670 at 50 steps). The variance outputs stay random."""
    out = dict(sd)
    w, C = sd[prefix + "input_proj.weight"].shape
    pattern = det_tensor((w - C,), seed, prefix + "pattern", P).double()
    pattern = (pattern - pattern.mean()).float()
    out[prefix + "input_proj.weight"] = torch.cat([torch.eye(C), torch.zeros(w - C, C)])
    out[prefix + "input_proj.bias"] = torch.cat([torch.zeros(C), pattern])
    for k in [k for k in sd if k.startswith(prefix) and ".adaLN_modulation.1." in k]:
        size = torch.full((sd[k].shape[0],), 1e-3)                  # the final layer's shift and scale
        if k.startswith(prefix + "res_blocks."):
            size = torch.tensor([1.0, 1.0, 3e-3]).repeat_interleave(sd[k].shape[0] // 3)   # shift, scale, gate
        out[k] = sd[k] * size.reshape(-1, *[1] * (sd[k].dim() - 1))
    sigma = math.sqrt(float(pattern.double().pow(2).sum() + C) / w + 1e-6)   # LayerNorm's σ for |x_t|² = C
    lin = sd[prefix + "final_layer.linear.weight"].clone()
    lin[:C] = 0
    lin[:C, :C] = sigma * (torch.eye(C) + torch.ones(C, C) / (w - C))
    lin[C:] *= 0.5
    out[prefix + "final_layer.linear.weight"] = lin
    bias = sd[prefix + "final_layer.linear.bias"].clone()
    bias[:C] = 0
    out[prefix + "final_layer.linear.bias"] = bias
    return out


@lru_cache(maxsize=2)
def mar_weights(seed: int = 0) -> dict:
    """A MAR state dict in the reference's key names (ours are the same: tests/test_mar.py pins them).
    Cached: read-only."""
    with torch.device("meta"):
        m = MAR(mar_args())
    return denoising_head(det_weights(m, seed), seed)


@lru_cache(maxsize=2)
def vae_weights(seed: int = 1) -> dict:
    """A KL VAE state dict in the LDM key names of kl16.ckpt. Cached: read-only."""
    with torch.device("meta"):
        m = AutoencoderKL(vae_args())
    return det_weights(m, seed)


def checksum(sd: dict) -> float:
    return float(sum(v.double().abs().sum() for v in sd.values()))


def write_public(d: Path) -> tuple[Path, Path]:
    """checkpoint-last.pth and kl16.ckpt in `d`, as LTH14/mar saves them. `model` (the raw weights, zeros
    here) differs from `model_ema` (what inference reads): a loader that reads the wrong one fails."""
    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    ema = mar_weights(0)
    raw = {k: torch.zeros_like(v) for k, v in ema.items()}
    args = argparse.Namespace(model="mar_custom", img_size=MAR_TINY["img_size"],
                              vae_path="pretrained_models/vae/kl16.ckpt", vae_embed_dim=16, vae_stride=16, buffer_size=64, diffloss_d=MAR_TINY["diffloss_d"],
                              diffloss_w=MAR_TINY["diffloss_w"], num_sampling_steps=str(SAMPLING_STEPS))
    optimizer = {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(3)}},
                 "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.02, "params": [0]}]}
    torch.save({"model": raw, "model_ema": ema, "optimizer": optimizer, "epoch": 399, "scaler": {"scale": 65536.0},
                "args": args}, d / "checkpoint-last.pth")
    torch.save({"model": vae_weights(1)}, d / "kl16.ckpt")
    return d / "checkpoint-last.pth", d / "kl16.ckpt"


def det_normal(shape, seed: int, name: str) -> torch.Tensor:
    """Standard normals, a function of (seed, name): the inverse normal CDF of det_tensor's uniforms."""
    return torch.erfinv(det_tensor(shape, seed, name, 1.0 / SQRT3)) * math.sqrt(2.0)


def run_noise(seed: int, n: int = 16, channels: int = 16, steps: int = SAMPLING_STEPS):
    """One image's randomness, by absolute token position: (order [n], reveal order (the first token
    revealed first, as our engines count; MAR's own `orders` are this reversed), x_T [n, C], ε [n, S, C]
    (ε[:, i] for respaced diffusion step i; step 0 adds none))."""
    order = det_tensor((n,), seed, "order", 1.0).argsort(stable=True)
    return order, det_normal((n, channels), seed, "x_T"), det_normal((n, steps, channels), seed, "eps")
