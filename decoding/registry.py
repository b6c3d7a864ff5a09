"""Model families by name: `load_bundle(model_cfg)` is the one way a model is loaded (actor, bench,
analyze and training all call it).

A family is a config dataclass (its settings and their defaults, the job's Hydra `model` schema), a
loader that turns it into a `ModelBundle`, and the family's sampling defaults (guidance scale, top-k:
LlamaGen's reference values differ by task). Families live in their own modules and register here by
name, so the core imports none of them (docs/design.md, "Layers").
"""
from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from decoding.bundle import DTYPES, ModelBundle
from decoding.sampling import SamplingParams


# What a loader assumes and says (e.g. an image size its checkpoint does not record). The job's driver
# says it in its check (inspect_model); its actors, loading the same files again, keep it to themselves
# (actors/generator.py), so a job says it once.
NOTES = logging.getLogger("arspec.model")


@dataclass
class ModelConfig:
    """What every family's config has."""
    name: str = "shapes"
    device: str = "auto"      # auto = cuda when this process sees a GPU, else cpu
    dtype: str = "auto"       # auto = bf16 on CUDA or on CPUs with AMX / AVX512-BF16, else fp32; float32 | bfloat16

    def __post_init__(self):
        """The two settings every family shares, refused in one line before any actor loads a model. Whether
        the device exists is the actors' to say: a driver without a GPU may drive actors with one."""
        if self.dtype not in DTYPES:
            raise ValueError(f"model.dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        try:
            kind = torch.device(self.device).type if self.device != "auto" else "auto"
        except RuntimeError:
            kind = None
        if kind not in ("auto", "cpu", "cuda"):
            raise ValueError(f"model.device={self.device!r}: use auto, cpu, cuda or cuda:N")


@dataclass(frozen=True)
class Family:
    name: str
    config: type                                          # a ModelConfig subclass
    load: Callable[[ModelConfig, torch.device], ModelBundle]
    sampling: SamplingParams                              # every field set
    scorer: Optional[Callable[[ModelConfig], object]] = None   # prompt adherence, where the family has one
    # What the job's driver checks without loading weights (checkpoint headers, decoding.checkpoint.
    # read_header): raises FileNotFoundError / ValueError naming the setting; returns {"drafter": bool}.
    inspect: Optional[Callable[[ModelConfig], dict]] = None
    # Whether the model can take these prompts, from its config alone (class ids for a class-conditional
    # model): raises ValueError naming the first that it cannot. The driver runs it over the stream.
    check_prompts: Optional[Callable[[ModelConfig, list], None]] = None
    tokens: str = "discrete"                              # or "continuous" (its bundles' `tokens`)


_MODULES = {"shapes": "decoding.shapes.family", "llamagen_c2i": "decoding.llamagen.c2i",
            "llamagen_t2i": "decoding.llamagen.t2i", "mar": "decoding.mar.family"}


def families() -> dict[str, Family]:
    return {name: importlib.import_module(mod).FAMILY for name, mod in _MODULES.items()}


def family(name: str) -> Family:
    if name not in _MODULES:
        raise ValueError(f"model.name={name!r} is not a model family: choose one of {sorted(_MODULES)}")
    return importlib.import_module(_MODULES[name]).FAMILY


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def load_bundle(cfg: ModelConfig) -> ModelBundle:
    """The bundle `cfg` names, on its device, with its family's sampling defaults."""
    return family(cfg.name).load(cfg, resolve_device(cfg.device))


def inspect_model(cfg: ModelConfig) -> Optional[dict]:
    """The family's header-only check of `cfg` ({"drafter": bool}), or None when the family has none (its
    files are then first read by the actors that load it)."""
    fam = family(cfg.name)
    return fam.inspect(cfg) if fam.inspect else None


def prompt_check(cfg: ModelConfig) -> Optional[Callable[[list], None]]:
    """The family's prompt check bound to `cfg`, or None when any prompt will do."""
    fam = family(cfg.name)
    return None if fam.check_prompts is None else (lambda prompts: fam.check_prompts(cfg, prompts))
