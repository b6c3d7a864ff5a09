"""Weights on disk: safetensors with the model's arguments in the metadata, or a trusted-format
torch checkpoint read with `weights_only=True` (LlamaGen/MAR releases). Never unrestricted pickle."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CHECKPOINT_KEYS = ("model_ema", "ema", "model", "module", "state_dict")


def save_module(module: torch.nn.Module, path: str | Path, kind: str, args: dict,
                dtype: torch.dtype = torch.float16, **meta) -> Path:
    """Write module.state_dict() (floats cast to `dtype`, the shipping precision) plus its arguments."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous()
          for k, v in module.state_dict().items()}
    metadata = {"kind": kind, "args": json.dumps(args), **{k: json.dumps(v) for k, v in meta.items()}}
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


def read_state_dict(path: str | Path) -> dict:
    """A raw state dict from .safetensors or a torch checkpoint (dict with model/ema/... or raw)."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path} (check the model.*_path settings)")
    if path.suffix == ".safetensors":
        return read_safetensors(path)[0]
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    for key in CHECKPOINT_KEYS:
        if isinstance(ckpt, dict) and isinstance(ckpt.get(key), dict):
            return ckpt[key]
    return ckpt
