"""The training loop every stage shares: AdamW, warmup + cosine LR, bf16 autocast on a GPU or where the CPU
has fast bf16 matmuls (AMX or AVX512-BF16; fp32 master weights), progress lines with ETA."""
from __future__ import annotations

import logging
import math
import time
from typing import Callable

import numpy as np
import torch

from decoding.bundle import pick_dtype
from decoding.shapes.world import render, sample_scenes

log = logging.getLogger("arspec.train")


def run_steps(name: str, params, step_fn: Callable[[int], tuple[torch.Tensor, dict]], steps: int,
              lr: float, weight_decay: float = 0.0, warmup: int = 50, betas=(0.9, 0.95),
              log_every: int = 50, grad_clip: float = 1.0, device: str = "cpu") -> dict:
    params = [p for p in params if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=betas, weight_decay=weight_decay)
    dtype = pick_dtype("auto", torch.device(device))
    log.info(f"[{name}] {sum(p.numel() for p in params) / 1e6:.2f}M trainable parameters, autocast {dtype}")
    t0, ema = time.time(), {}
    for step in range(steps):
        scale = min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / steps))
        for g in opt.param_groups:
            g["lr"] = lr * max(scale, 0.02)
        with torch.autocast(device, dtype=dtype, enabled=dtype != torch.float32):
            loss, metrics = step_fn(step)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip:
            torch.nn.utils.clip_grad_norm_(params, grad_clip)
        opt.step()
        for k, v in {"loss": loss.item(), **metrics}.items():
            ema[k] = v if k not in ema else 0.95 * ema[k] + 0.05 * v
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (steps - step - 1)
            stats = " ".join(f"{k}={v:.4f}" for k, v in ema.items())
            log.info(f"[{name}] step {step + 1}/{steps} {stats} lr={lr * scale:.2e} "
                     f"elapsed={el:.0f}s eta={eta:.0f}s")
    return {**ema, "seconds": time.time() - t0}


def to_float(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 64, 64, 3] -> float [B, 3, 64, 64] in [-1, 1]."""
    return images_u8.permute(0, 3, 1, 2).float() / 127.5 - 1.0


def render_pool(n: int, seed: int) -> tuple[list, torch.Tensor]:
    """n random scenes and their renders as uint8 [n, 64, 64, 3]."""
    scenes = sample_scenes(n, seed)
    return scenes, torch.from_numpy(np.stack([render(s) for s in scenes]))
