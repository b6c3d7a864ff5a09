"""The built-in `shapes` model family: VQ tokenizer, t2i GPT, word-level text encoder and EAGLE
drafter trained on the shapes world by `python -m workflows.train`, shipped as safetensors in
decoding/shapes/weights/ (see TRAINING.md there), plus the attribute scorer for prompt adherence."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from decoding.bundle import ModelBundle
from decoding.checkpoint import load_module, read_header
from decoding.models.drafter import Drafter
from decoding.models.gpt import GPT
from decoding.models.text import TextEncoder
from decoding.models.vq import VQModel
from decoding.registry import Family, ModelConfig
from decoding.sampling import SamplingParams
from decoding.shapes.scorer import Scorer

WEIGHTS = Path(__file__).parent / "weights"


@dataclass
class ShapesConfig(ModelConfig):
    name: str = "shapes"
    weights_dir: Optional[str] = None     # null = the weights shipped in the package


def weights_dir(cfg: ShapesConfig) -> Path:
    return Path(cfg.weights_dir) if cfg.weights_dir else WEIGHTS


def _files(cfg: ShapesConfig) -> dict:
    """file stem -> model class of the bundle's files present in weights_dir (the drafter is optional)."""
    d = weights_dir(cfg)
    missing = [f for f in ("vq", "gpt", "text") if not (d / f"{f}.safetensors").exists()]
    if missing:
        raise FileNotFoundError(f"model.weights_dir={d} lacks {', '.join(m + '.safetensors' for m in missing)}; "
                                f"train them with `python -m workflows.train` or point model.weights_dir elsewhere")
    files = {"vq": VQModel, "gpt": GPT, "text": TextEncoder, "drafter": Drafter}
    return {k: cls for k, cls in files.items() if (d / f"{k}.safetensors").exists()}


def inspect(cfg: ShapesConfig) -> dict:
    """Headers only: each file is one of ours, of the right kind, with arguments its class accepts."""
    d = weights_dir(cfg)
    files = _files(cfg)
    for stem, cls in files.items():
        path = d / f"{stem}.safetensors"
        meta, _ = read_header(path)
        if meta.get("kind") != cls.kind:
            raise ValueError(f"model.weights_dir={d}: {path.name} holds a {meta.get('kind')!r} model, "
                             f"expected {cls.kind!r}")
        try:
            cls.Args(**meta["args"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"model.weights_dir={d}: {path.name} carries unusable arguments ({e})") from None
    return {"drafter": "drafter" in files}


def load(cfg: ShapesConfig, device) -> ModelBundle:
    d = weights_dir(cfg)
    _files(cfg)
    drafter = load_module(d / "drafter.safetensors", Drafter) if (d / "drafter.safetensors").exists() else None
    return ModelBundle("shapes", load_module(d / "vq.safetensors", VQModel), load_module(d / "gpt.safetensors", GPT),
                       load_module(d / "text.safetensors", TextEncoder), drafter, device, cfg.dtype, FAMILY.sampling)


def scorer(cfg: ShapesConfig) -> Optional[Scorer]:
    path = weights_dir(cfg) / "scorer.safetensors"
    return load_module(path, Scorer) if path.exists() else None


# CFG 1.5: these small models follow the caption best there; CFG >= 3 wrecks their images (TRAINING.md).
FAMILY = Family("shapes", ShapesConfig, load, SamplingParams(cfg_scale=1.5, temperature=1.0, top_k=0, top_p=1.0),
                scorer, inspect)
