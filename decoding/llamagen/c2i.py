"""`model=llamagen_c2i`: LlamaGen class-conditional GPT-B/L/XL/XXL/3B with VQ-16 (ImageNet, 1000 classes).

Sampling defaults are LlamaGen's demo sampler's (autoregressive/sample/sample_c2i.py): CFG 4.0, top-k 2000,
temperature 1, no top-p. (Its FID runs use CFG 1.5-2.0 and no top-k: engine.sampling.cfg_scale=2.0
engine.sampling.top_k=0.)
"""
from __future__ import annotations

from decoding.llamagen.bundle import class_ids, load as load_llamagen
from decoding.llamagen.config import C2IConfig
from decoding.llamagen.load import inspect
from decoding.registry import Family
from decoding.sampling import SamplingParams

SAMPLING = SamplingParams(cfg_scale=4.0, temperature=1.0, top_k=2000, top_p=1.0)


def load(cfg: C2IConfig, device):
    return load_llamagen(cfg, device, SAMPLING)


def check_prompts(cfg: C2IConfig, prompts) -> None:
    class_ids(prompts, cfg.num_classes)


FAMILY = Family("llamagen_c2i", C2IConfig, load, SAMPLING, inspect=inspect, check_prompts=check_prompts)
