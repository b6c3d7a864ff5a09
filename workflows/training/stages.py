"""Where stages find each other's outputs: one safetensors file per model in the weights folder."""
from __future__ import annotations

from pathlib import Path

from decoding.checkpoint import load_module
from decoding.models.drafter import Drafter
from decoding.models.gpt import GPT
from decoding.models.text import TextEncoder
from decoding.models.vq import VQModel
from decoding.shapes.scorer import Scorer

MODELS = {m.kind: m for m in (VQModel, GPT, TextEncoder, Drafter, Scorer)}


def load_stage(out_dir: Path, name: str):
    path = Path(out_dir) / f"{name}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run the `{name}` stage first "
                                f"(python -m workflows.train stages=[{name}])")
    return load_module(path, MODELS[name])
