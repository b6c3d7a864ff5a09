"""The LlamaGen bundle: VQ tokenizer + GPT (+ FLAN-T5 for t2i, + drafter) on one device, and the
conditions a batch of prompts gives: class ids for c2i, left-padded T5 features for t2i.

On a GPU the transformers run in bf16 (`model.dtype=auto`) with SDPA attention and the KV cache, tree
masks and sampling on the device. `model.compile=true` wraps the GPT's and the drafter's forwards in
torch.compile (dynamic shapes: the visible cache prefix grows every step, and tree blocks vary).
"""
from __future__ import annotations

import re

import torch

from decoding.bundle import Conditions, ModelBundle, pick_dtype
from decoding.llamagen.config import C2IConfig, LlamaGenConfig, T2IConfig, gpt_args
from decoding.llamagen.load import load_drafter, load_gpt, load_vq
from decoding.sampling import SamplingParams


def class_ids(prompts, num_classes: int) -> list[int]:
    """Prompts as class ids: ints, or strings of digits (a CSV column, the job's string prompts)."""
    out = []
    for p in prompts:
        if isinstance(p, str) and re.fullmatch(r"\s*\d+\s*", p):
            p = int(p)
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < num_classes:
            raise ValueError(f"prompt {p!r} is not a class id of this model: valid ids are 0..{num_classes - 1} "
                             f"(model.num_classes={num_classes}); fix data.classes (data=imagenet_classes) or the "
                             f"class_id column of data.path")
        out.append(p)
    return out


def captions(prompts) -> list:
    """Prompts as captions for a text-conditional model, or one ValueError line naming the first that is not."""
    for p in prompts:
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt {p!r} is empty or not text: this text-conditional model takes captions")
    return list(prompts)


class LlamaGenBundle(ModelBundle):
    def __init__(self, name, vq, gpt, drafter, device, dtype: str, sampling: SamplingParams, t5=None):
        super().__init__(name, vq, gpt, None, drafter, device, dtype, sampling)
        self.t5 = t5

    def check_prompts(self, prompts) -> list:
        """The prompts as this model takes them (class ids for c2i, text for t2i), or one ValueError line
        naming the first that is not. The job's driver makes the same check from the config alone
        (the families' check_prompts) on every prompt before any actor starts."""
        a = self.gpt.args
        return class_ids(prompts, a.num_classes) if a.model_type == "c2i" else captions(prompts)

    def conditions(self, prompts) -> Conditions:
        prompts = self.check_prompts(prompts)
        if self.gpt.args.model_type == "c2i":
            return Conditions(torch.tensor(prompts, dtype=torch.long, device=self.device), None, [])
        feats, mask = self.t5(prompts)
        return Conditions(feats.to(self.dtype), mask, [])


def compile_forwards(bundle: ModelBundle, backend: str = "inductor", **kw) -> ModelBundle:
    """torch.compile the GPT's forward (prefill, decode steps, tree verification) and the drafter's.
    Dynamic shapes: the attention reads the visible prefix of the cache, which grows every step."""
    bundle.gpt.forward_embeds = torch.compile(bundle.gpt.forward_embeds, dynamic=True, backend=backend, **kw)
    if bundle.drafter is not None:
        bundle.drafter.forward = torch.compile(bundle.drafter.forward, dynamic=True, backend=backend, **kw)
    return bundle


def load(cfg: LlamaGenConfig, device: torch.device, sampling: SamplingParams) -> LlamaGenBundle:
    """Load the checkpoints `cfg` names (strictly; one line per problem) onto `device`."""
    dtype = pick_dtype(cfg.dtype, device)
    t5 = None
    if isinstance(cfg, T2IConfig):   # first: a missing extra or path fails before the big files are read
        from decoding.llamagen.t5 import T5Features
        a = gpt_args(cfg)
        t5 = T5Features(cfg.t5_path, a.cls_token_num, device, dtype)
        if t5.dim != a.caption_dim:
            raise ValueError(f"model.t5_path={cfg.t5_path}: its d_model is {t5.dim}, the GPT reads "
                             f"model.caption_dim={a.caption_dim} (FLAN-T5-XL: 2048)")
    gpt = load_gpt(cfg, dtype)
    bundle = LlamaGenBundle(cfg.name, load_vq(cfg), gpt, load_drafter(cfg, gpt, dtype), device, cfg.dtype,
                            sampling, t5)
    return compile_forwards(bundle) if cfg.compile else bundle


__all__ = ["C2IConfig", "T2IConfig", "LlamaGenBundle", "class_ids", "compile_forwards", "load"]
