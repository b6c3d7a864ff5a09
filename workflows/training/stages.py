"""Where stages find each other's outputs: one safetensors file per model in the weights folder."""
from __future__ import annotations

from pathlib import Path

from decoding.bundle import load_module


def load_stage(out_dir: Path, name: str):
    path = Path(out_dir) / f"{name}.safetensors"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run the `{name}` stage first "
                                f"(python -m workflows.train stages=[{name}])")
    return load_module(path, name)
