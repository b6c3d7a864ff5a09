"""Random-weight checkpoints in the public LlamaGen / EAGLE / LANTERN layouts, for tests/test_llamagen.py and
for tests/fixtures/make_llamagen_greedy.py (which feeds the same weights to LlamaGen's own code).

Weights are a pure function of (seed, key name): uniforms from the counter-based hash of
decoding.sampling (integer arithmetic, the same bits on any machine and torch version), scaled to the
wanted standard deviation. So the fixture made once with the reference code stays valid.
"""
from __future__ import annotations

import argparse
import math
import re
from pathlib import Path

import torch
from safetensors.torch import save_file

from decoding.llamagen.config import C2IConfig, T2IConfig, gpt_args, vq_args
from decoding.models.drafter import Drafter, DrafterArgs
from decoding.models.gpt import GPT
from decoding.models.vq import VQModel
from decoding.sampling import Streams, prompt_seed

SQRT3 = math.sqrt(3.0)


def det_tensor(shape, seed: int, name: str, std: float, mean: float = 0.0) -> torch.Tensor:
    """Uniform with the given mean and std, a function of (seed, name) only. Its own bits-to-float map
    (the sampler's of BYTES_VERSION <= 4), kept so that the weights, and the fixture made from them with
    the reference code, do not move when the sampler's uniforms do."""
    n = math.prod(shape)
    h = Streams([prompt_seed(seed, name)], "cpu").bits(torch.arange(n)[None])[0]
    u = ((h >> 8).float() + 0.5) * (1.0 / 2**24)
    return (mean + (u * 2 - 1) * std * SQRT3).reshape(shape)


def det_state_dict(module: torch.nn.Module, seed: int) -> dict:
    """Every persistent tensor of `module`: norms ~1, embeddings std 1, linears std 1/sqrt(fan_in),
    the output head 3/sqrt(dim) (sharp distributions, so greedy choices are far from ties)."""
    out = {}
    for name, t in module.state_dict().items():
        if not t.is_floating_point():
            out[name] = t
        elif re.search(r"norm[^.]*\.weight$", name):
            out[name] = det_tensor(t.shape, seed, name, 0.1, mean=1.0)
        elif name.endswith(".bias") or t.dim() == 1:
            out[name] = det_tensor(t.shape, seed, name, 0.05)
        elif "embedding" in name or name == "tok_embeddings.weight":
            out[name] = det_tensor(t.shape, seed, name, 1.0)
        elif name == "output.weight":
            out[name] = det_tensor(t.shape, seed, name, 3.0 / math.sqrt(t.shape[1]))
        else:
            fan_in = math.prod(t.shape[1:])
            out[name] = det_tensor(t.shape, seed, name, 1.0 / math.sqrt(fan_in))
    return out


def small_c2i(**kw) -> C2IConfig:
    """A LlamaGen c2i config at test size: dim 64, 2 layers, 4 heads, vocab 128, 10 classes, VQ-16 layout
    with narrow widths, 64 px -> 4x4 tokens (kw overrides)."""
    base = dict(dim=64, n_layer=2, n_head=4, codebook_size=128, codebook_embed_dim=8, vq_ch=32, vq_z_channels=32,
                vq_num_res_blocks=1, image_size=64, num_classes=10, device="cpu", dtype="float32")
    return C2IConfig(**{**base, **kw})


def small_t2i(**kw) -> T2IConfig:
    base = dict(dim=64, n_layer=2, n_head=4, codebook_size=128, codebook_embed_dim=8, vq_ch=32, vq_z_channels=32,
                vq_num_res_blocks=1, image_size=64, cls_token_num=120, caption_dim=16, device="cpu", dtype="float32")
    return T2IConfig(**{**base, **kw})


def gpt_weights(cfg, seed: int = 0) -> dict:
    """A LlamaGen-layout GPT state dict for `cfg` (our GPT's keys are LlamaGen's; test_models pins them)."""
    with torch.device("meta"):
        m = GPT(gpt_args(cfg))
    return det_state_dict(m, seed)


def vq_weights(cfg, seed: int = 1) -> dict:
    """A LlamaGen-layout VQ state dict, with the `quantize.codebook_used` buffer LlamaGen's VQ saves."""
    with torch.device("meta"):
        m = VQModel(vq_args(cfg))
    sd = det_state_dict(m, seed)
    sd["quantize.codebook_used"] = torch.zeros(65536)
    return sd


def drafter_weights(cfg, seed: int = 2) -> dict:
    with torch.device("meta"):
        m = Drafter(DrafterArgs.for_target(gpt_args(cfg)))
    return det_state_dict(m, seed)


def save(sd: dict, path: Path, container: str = "model") -> Path:
    """Write `sd` as the public releases do. model: DDP training checkpoint {"model", "optimizer", "steps",
    "args" (an argparse.Namespace)}; ema: {"model", "ema", ...} where both differ; module: DeepSpeed;
    state_dict; raw: an FSDP consolidated state dict; safetensors."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    args = argparse.Namespace(gpt_model="GPT-B", image_size=256, global_batch_size=256, lr=1e-4, ema=container == "ema")
    optimizer = {"state": {0: {"step": torch.tensor(10.0), "exp_avg": torch.zeros(3)}},
                 "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "weight_decay": 0.05, "params": [0]}]}
    if container == "safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    elif container == "raw":
        torch.save(sd, path)
    elif container == "model":
        torch.save({"model": sd, "optimizer": optimizer, "steps": 10, "args": args}, path)
    elif container == "ema":
        torch.save({"model": {k: v * 0 for k, v in sd.items()}, "ema": sd, "optimizer": optimizer, "steps": 10,
                    "args": args}, path)
    elif container in ("module", "state_dict"):
        torch.save({container: sd}, path)
    else:
        raise ValueError(container)
    return path


_HF_LAYER = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}


def to_hf(sd: dict, dim: int, prefix: str = "") -> dict:
    """Our / LlamaGen names -> Hugging Face Llama names (the inverse of layouts.from_hf, written
    independently here): wqkv splits into q, k, v (dim rows each, no GQA)."""
    out = {}
    for k, v in sd.items():
        m = re.match(r"layers\.(\d+)\.(.+)\.weight$", k)
        if m and m.group(2) == "attention.wqkv":
            for name, part in zip("qkv", v.split(dim, 0)):
                out[f"{prefix}layers.{m.group(1)}.self_attn.{name}_proj.weight"] = part.clone()
        elif m and m.group(2) in _HF_LAYER:
            out[f"{prefix}layers.{m.group(1)}.{_HF_LAYER[m.group(2)]}.weight"] = v
        elif k == "output.weight":
            out["lm_head.weight"] = v
        elif k == "tok_embeddings.weight":
            out[f"{prefix}embed_tokens.weight"] = v
        else:
            out[prefix + k] = v
    return out
