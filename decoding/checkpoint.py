"""Weights on disk. Our own models: safetensors whose metadata carries the model's kind and arguments,
so a file loads with no flags. Public releases (LlamaGen, MAR): safetensors, or a torch checkpoint read
with `weights_only=True`. Never unrestricted pickle.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CHECKPOINT_KEYS = ("model_ema", "ema", "model", "module", "state_dict")


def save_module(module: torch.nn.Module, path: str | Path, dtype: torch.dtype = torch.float16, **meta) -> Path:
    """Write module.state_dict() (floats cast to `dtype`, the shipping precision) with the module's
    kind and arguments (and any `meta`, JSON-encoded) in the metadata. Written under a temporary name
    and renamed, so a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in module.state_dict().items()}
    metadata = {"kind": module.kind, "args": json.dumps(module.args.to_dict()),
                **{k: json.dumps(v) for k, v in meta.items()}}
    tmp = path.with_suffix(path.suffix + ".tmp")
    save_file(sd, str(tmp), metadata=metadata)
    tmp.chmod(0o644)
    tmp.replace(path)
    return path


def read_safetensors(path: str | Path) -> tuple[dict, dict]:
    """-> (state dict in float32, metadata with JSON values decoded)."""
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        sd = {k: f.get_tensor(k) for k in f.keys()}
    sd = {k: v.float() if v.is_floating_point() else v for k, v in sd.items()}
    return sd, {k: (v if k == "kind" else json.loads(v)) for k, v in meta.items()}


def load_module(path: str | Path, cls) -> torch.nn.Module:
    """Build `cls` (a model class with `kind` and `Args`) from one of our safetensors files."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    sd, meta = read_safetensors(path)
    if meta.get("kind") != cls.kind:
        raise ValueError(f"{path} holds a {meta.get('kind')!r} model, expected {cls.kind!r}")
    model = cls(cls.Args(**meta["args"]))
    model.load_state_dict(sd, strict=True)
    return model.eval()


def read_state_dict(path: str | Path) -> dict:
    """A raw state dict from .safetensors or a torch checkpoint (dict with model/ema/... or raw)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path} (check the model.*_ckpt settings)")
    if path.suffix == ".safetensors":
        return read_safetensors(path)[0]
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    for key in CHECKPOINT_KEYS:
        if isinstance(ckpt, dict) and isinstance(ckpt.get(key), dict):
            return ckpt[key]
    return ckpt
