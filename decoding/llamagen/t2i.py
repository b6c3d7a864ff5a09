"""`model=llamagen_t2i`: LlamaGen text-conditional GPT-XL with VQ-16, conditioned on 120 left-padded
FLAN-T5-XL tokens (the optional `transformers` extra; model.t5_path is a local directory).

Sampling defaults are LlamaGen's sampler's (autoregressive/sample/sample_t2i.py): CFG 7.5, top-k 1000,
temperature 1, no top-p.
"""
from __future__ import annotations

from decoding.llamagen.bundle import captions, load as load_llamagen
from decoding.llamagen.config import T2IConfig
from decoding.llamagen.load import inspect
from decoding.registry import Family
from decoding.sampling import SamplingParams

SAMPLING = SamplingParams(cfg_scale=7.5, temperature=1.0, top_k=1000, top_p=1.0)


def load(cfg: T2IConfig, device):
    return load_llamagen(cfg, device, SAMPLING)


def check_prompts(cfg: T2IConfig, prompts) -> None:
    captions(prompts)


FAMILY = Family("llamagen_t2i", T2IConfig, load, SAMPLING, inspect=inspect, check_prompts=check_prompts)
