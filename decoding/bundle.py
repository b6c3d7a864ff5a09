"""A model bundle: tokenizer + target GPT (+ text encoder, + drafter), loaded once per actor by
`decoding.registry.load_bundle`, with the model family's sampling defaults."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from decoding.models.gpt import GPT
from decoding.models.packed import pack_linears
from decoding.models.text import TextEncoder
from decoding.models.vq import VQModel
from decoding.sampling import NEUTRAL, SamplingParams


def cpu_has_fast_bf16() -> bool:
    """AMX tiles (Intel) or AVX512-BF16 (AMD Zen 4+, Intel Cooper Lake+): bf16 matmuls run several
    times faster than fp32 there (about 4.5x measured on this project's AMD EPYC, 2 threads)."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


DTYPES = ("auto", "float32", "bfloat16", "float16")   # model.dtype's choices


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 where the hardware has fast bf16 matmuls (CUDA, or such a CPU), else fp32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def cast(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Floating-point parameters and buffers to `dtype`; complex ones (the RoPE table) stay as they are,
    where Module.to(dtype) would cast them to real and drop the sines."""
    return {torch.float32: module.float, torch.bfloat16: module.bfloat16, torch.float16: module.half}[dtype]()


def for_inference(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """A transformer as the engines run it: on `device`, cast to `dtype`, in eval mode, and with its bf16
    CPU linear layers packed for oneDNN once (models/packed.py: the same results, ~2x faster calls)."""
    return pack_linears(cast(module.to(device), dtype).eval())


@dataclass
class Conditions:
    """Per-prompt conditioning: caption features [B, L, caption_dim] and their mask [B, L] (t2i), or
    class labels [B] and no mask (c2i); unknown-word counts per prompt."""
    features: torch.Tensor
    mask: torch.Tensor | None
    unknown_words: list

    def __len__(self) -> int:
        return len(self.features)

    def split(self) -> list["Conditions"]:
        """One Conditions per prompt."""
        return [Conditions(self.features[b:b + 1], None if self.mask is None else self.mask[b:b + 1],
                           list(self.unknown_words[b:b + 1]) or [0]) for b in range(len(self))]

    @staticmethod
    def cat(parts: list["Conditions"]) -> "Conditions":
        return Conditions(torch.cat([c.features for c in parts]),
                          None if parts[0].mask is None else torch.cat([c.mask for c in parts]),
                          [w for c in parts for w in (c.unknown_words or [0] * len(c))])


class ModelBundle:
    def __init__(self, name: str, vq: VQModel, gpt: GPT, text: Optional[TextEncoder] = None,
                 drafter=None, device: str = "cpu", dtype: str = "auto", sampling: SamplingParams = NEUTRAL):
        self.name, self.sampling = name, sampling
        self.device = torch.device(device)
        self.dtype = pick_dtype(dtype, self.device)
        # The transformers run in `dtype` (weights cast once, as gpt-fast does: autocast would recast every
        # weight at every call, which costs more than the matmul at these sizes); the tokenizer and text
        # encoder stay in fp32 (one call per image or prompt).
        self.vq, self.text = (m.to(self.device).eval() if m is not None else None for m in (vq, text))
        self.gpt, self.drafter = (for_inference(m, self.device, self.dtype) if m is not None else None
                                  for m in (gpt, drafter))
        g = self.gpt.args.grid_size
        self.grid = g
        self.image_size = g * vq.args.downsample

    def conditions(self, prompts: list[str]) -> Conditions:
        if self.text is None:
            raise ValueError(f"model {self.name!r} has no text encoder: it cannot take text prompts")
        for p in prompts:
            if not isinstance(p, str) or not p.strip():
                raise ValueError(f"prompt {p!r} is empty or not text")
        feats, mask, unknown = self.text.encode(prompts)
        return Conditions(feats.to(self.dtype), mask, unknown)

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> np.ndarray:
        """Code indices [B, grid²] -> uint8 images [B, H, W, 3]. One image at a time: convolution
        numerics depend on the batch size, and an image's bytes must not depend on its batch."""
        shape = [1, self.vq.args.codebook_embed_dim, self.grid, self.grid]
        x = torch.cat([self.vq.decode_code(t[None].to(self.device), shape).float() for t in tokens])
        return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()

