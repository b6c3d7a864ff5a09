"""A model bundle: tokenizer + target GPT (+ text encoder, + drafter), loaded once per actor.

The built-in `shapes` bundle lives in decoding/weights/shapes/ as safetensors files whose metadata
carries each model's arguments, so loading needs no flags.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from decoding.checkpoint import read_safetensors
from decoding.models.gpt import GPT, GPTArgs
from decoding.models.text import TextArgs, TextEncoder
from decoding.models.vq import VQArgs, VQModel

SHAPES_DIR = Path(__file__).parent / "weights" / "shapes"


def _builders():
    from decoding.models.drafter import Drafter, DrafterArgs
    from decoding.scorer import Scorer, ScorerArgs
    return {"vq": (VQArgs, VQModel), "gpt": (GPTArgs, GPT), "text": (TextArgs, TextEncoder),
            "drafter": (DrafterArgs, Drafter), "scorer": (ScorerArgs, Scorer)}


def load_module(path: str | Path, expect: Optional[str] = None) -> torch.nn.Module:
    """Build a model from one of our safetensors files (its kind and arguments are in the metadata)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    sd, meta = read_safetensors(path)
    kind = meta.get("kind")
    if expect is not None and kind != expect:
        raise ValueError(f"{path} holds a {kind!r} model, expected {expect!r}")
    args_cls, model_cls = _builders()[kind]
    model = model_cls(args_cls(**meta["args"]))
    model.load_state_dict(sd, strict=True)
    return model.eval()


def cpu_has_fast_bf16() -> bool:
    """AMX tiles (Intel) or AVX512-BF16 (AMD Zen 4+, Intel Cooper Lake+): bf16 matmuls run several
    times faster than fp32 there (about 4.5x measured on this project's AMD EPYC, 2 threads)."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


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


@dataclass
class Conditions:
    """Per-prompt conditioning for a t2i GPT: caption features, their mask, unknown-word counts."""
    features: torch.Tensor      # [B, L, caption_dim]
    mask: torch.Tensor          # [B, L] bool
    unknown_words: list


class ModelBundle:
    def __init__(self, name: str, vq: VQModel, gpt: GPT, text: Optional[TextEncoder] = None,
                 drafter=None, device: str = "cpu", dtype: str = "auto"):
        self.name = name
        self.device = torch.device(device)
        self.dtype = pick_dtype(dtype, self.device)
        # The transformers run in `dtype` (weights cast once, as gpt-fast does: autocast would recast every
        # weight at every call, which costs more than the matmul at these sizes); the tokenizer and text
        # encoder stay in fp32 (one call per image or prompt).
        self.vq, self.text = (m.to(self.device).eval() if m is not None else None for m in (vq, text))
        self.gpt, self.drafter = (cast(m.to(self.device), self.dtype).eval() if m is not None else None
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


def load_shapes_bundle(weights_dir: str | Path | None = None, with_drafter: bool = True,
                       device: str = "cpu", dtype: str = "auto") -> ModelBundle:
    d = Path(weights_dir) if weights_dir else SHAPES_DIR
    missing = [f for f in ("vq", "gpt", "text") if not (d / f"{f}.safetensors").exists()]
    if missing:
        raise FileNotFoundError(f"model.weights_dir={d} lacks {', '.join(m + '.safetensors' for m in missing)}; "
                                f"train them with `python -m workflows.train` or point model.weights_dir elsewhere")
    drafter = None
    if with_drafter and (d / "drafter.safetensors").exists():
        drafter = load_module(d / "drafter.safetensors", "drafter")
    return ModelBundle("shapes", load_module(d / "vq.safetensors", "vq"), load_module(d / "gpt.safetensors", "gpt"),
                       load_module(d / "text.safetensors", "text"), drafter, device, dtype)
