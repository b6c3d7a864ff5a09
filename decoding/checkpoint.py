"""Weights on disk. Our own models: safetensors whose metadata carries the model's kind and arguments,
so a file loads with no flags. Public releases (LlamaGen, MAR): safetensors, or a torch checkpoint read
with `weights_only=True`. Never unrestricted pickle.
"""
from __future__ import annotations

import json
import struct
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


def read_header(path: str | Path) -> tuple[dict, dict]:
    """-> (metadata with JSON values decoded, {tensor name: (dtype, shape)}) of a safetensors file, from
    its header alone: no tensor is read, so the job's driver checks a multi-GB checkpoint in
    milliseconds. A file shorter than its header says (a truncated copy) is refused here too."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 2 <= n <= min(size - 8, 100_000_000):
            raise ValueError(f"{path}: not a safetensors file (no readable header)")
        try:
            header = json.loads(f.read(n))
        except ValueError:
            raise ValueError(f"{path}: not a safetensors file (its header is not JSON)") from None
    meta = header.pop("__metadata__", None) or {}
    end = max((t["data_offsets"][1] for t in header.values()), default=0)
    if 8 + n + end > size:
        raise ValueError(f"{path}: truncated: its header describes {8 + n + end} bytes, the file has {size}")
    meta = {k: (v if k == "kind" else json.loads(v)) for k, v in meta.items()}
    return meta, {k: (t["dtype"], tuple(t["shape"])) for k, t in header.items()}


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
