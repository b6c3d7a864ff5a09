"""Weights on disk. Our own models: safetensors whose metadata carries the model's kind and arguments,
so a file loads with no flags. Public releases (LlamaGen, MAR): safetensors, or a torch checkpoint read
with `weights_only=True`. Never unrestricted pickle.
"""
from __future__ import annotations

import argparse
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

CHECKPOINT_KEYS = ("model_ema", "ema", "model", "module", "state_dict")
# Training scripts save their argparse.Namespace next to the weights (LlamaGen's {"model", "optimizer",
# "steps", "args"}): the one non-tensor class a weights_only load is allowed to rebuild (it only sets
# attributes). Nothing else is: an unknown class is refused, never executed.
SAFE_GLOBALS = [argparse.Namespace]
# Prefixes a wrapper adds to every key (DDP's `module.`, torch.compile's `_orig_mod.`).
WRAPPER_PREFIXES = ("module.", "_orig_mod.")


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


# -- public checkpoints: container detection and strict loading ---------------------------------------
@dataclass
class Checkpoint:
    """The weights found in a checkpoint file and where they were found."""
    state_dict: dict          # name -> tensor, wrapper prefixes removed
    container: str            # the entry that held them ("model", "ema", ...) or "raw"
    entries: list             # the file's top-level entries (for a raw state dict: [])
    format: str               # "safetensors" | "torch"
    extra: dict               # the other top-level entries that are not tensors (e.g. saved "args")


def _first_line(e: BaseException) -> str:
    """The exception's first sentence (torch's zip errors go on for a paragraph)."""
    text = str(e).strip()
    text = text.splitlines()[0] if text else ""
    return f"{type(e).__name__}: {text.split('. ')[0].rstrip('.')}"


def is_state_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(v, torch.Tensor) for v in obj.values())


def find_weights(obj, keys=("model", "module", "state_dict", "ema"), key: Optional[str] = None,
                 setting: str = "checkpoint") -> tuple[dict, str]:
    """-> (state dict, container) of a loaded checkpoint: the entry `key` if given, else the first of
    `keys` present, else the object itself when it is a raw state dict (FSDP exports)."""
    if not isinstance(obj, dict):
        raise ValueError(f"{setting}: holds a {type(obj).__name__}, not a dict of weights")
    if key is not None:
        if not is_state_dict(obj.get(key)):
            raise ValueError(f"{setting}: has no weights under {key!r}; its entries are {sorted(map(str, obj))}")
        return obj[key], key
    for k in keys:
        if is_state_dict(obj.get(k)):
            return obj[k], k
    if is_state_dict(obj):
        return obj, "raw"
    raise ValueError(f"{setting}: no weights under {', '.join(keys)} and not a raw state dict; "
                     f"its entries are {sorted(map(str, obj))[:8]}")


def strip_wrapper_prefixes(sd: dict) -> dict:
    for prefix in WRAPPER_PREFIXES:
        if sd and all(k.startswith(prefix) for k in sd):
            sd = {k[len(prefix):]: v for k, v in sd.items()}
    return sd


def read_checkpoint(path, key: Optional[str] = None, keys=("model", "module", "state_dict", "ema"),
                    setting: str = "checkpoint", mmap: bool = True) -> Checkpoint:
    """A public checkpoint (safetensors, or a torch file read with weights_only=True) and the weights in
    it. Every failure is one line naming `setting` (the config key that points at the file)."""
    path = Path(path).expanduser()
    where = f"{setting}={path}"
    if not path.exists():
        raise FileNotFoundError(f"{where}: no such file")
    if path.is_dir():
        raise ValueError(f"{where}: is a directory, not a checkpoint file")
    if path.suffix == ".safetensors":
        try:
            with safe_open(str(path), framework="pt") as f:
                sd = {k: f.get_tensor(k) for k in f.keys()}
        except Exception as e:
            raise ValueError(f"{where}: not a readable safetensors file ({_first_line(e)})") from None
        return Checkpoint(strip_wrapper_prefixes(sd), "raw", [], "safetensors", {})
    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            try:
                obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:   # mmap needs the zip format; a legacy file loads without it
                if not (mmap and "mmap can only be used" in str(e)):
                    raise
                obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        text = str(e)
        refused = re.search(r"(?i)unsupported (?:global: )?GLOBAL (\S+)", text)
        if refused:
            raise ValueError(f"{where}: holds Python objects a weights-only load refuses ({refused.group(1)}): "
                             f"the safety check that keeps a checkpoint from running code, not damage; re-save "
                             f"only its state dict, or convert it to safetensors") from None
        detail = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", text)
        raise ValueError(f"{where}: not a readable checkpoint: corrupted, truncated, or not a torch or "
                         f"safetensors file ({detail.group(1) if detail else _first_line(e)})") from None
    sd, container = find_weights(obj, keys, key, where)
    entries = [] if container == "raw" else sorted(map(str, obj))
    extra = {} if container == "raw" else {k: v for k, v in obj.items() if not isinstance(v, (dict, torch.Tensor))}
    return Checkpoint(strip_wrapper_prefixes(dict(sd)), container, entries, "torch", extra)


def _shape(t) -> str:
    return "[" + ", ".join(map(str, t.shape)) + "]"


def _some(names: list, n: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:n]) + (f", ... ({len(names)} in all)" if len(names) > n else "")


def state_dict_diff(expected: dict, sd: dict) -> list[str]:
    """What keeps `sd` from loading strictly into a module whose state dict is `expected`:
    missing keys, unexpected keys, shape mismatches (each a short phrase; empty = it fits)."""
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    shapes = [f"{k} {_shape(sd[k])} (expected {_shape(expected[k])})" for k in expected
              if k in sd and tuple(sd[k].shape) != tuple(expected[k].shape)]
    out = []
    if missing:
        out.append(f"missing {_some(missing)}")
    if unexpected:
        out.append(f"unexpected {_some(unexpected)}")
    if shapes:
        out.append(f"shape mismatch {_some(shapes, 2)}")
    return out


def load_strict(module: torch.nn.Module, sd: dict, what: str, hint: str = "", assign: bool = False) -> torch.nn.Module:
    """Load `sd` into `module` strictly: every key present, none extra, every shape equal, or one
    ValueError line naming them (`what` says which file and model; `hint` the fix). assign=True keeps
    the given tensors (no copy; the module may have been built on the meta device)."""
    problems = state_dict_diff(module.state_dict(), sd)
    if problems:
        raise ValueError(f"{what}: does not fit: {'; '.join(problems)}" + (f"; {hint}" if hint else ""))
    module.load_state_dict(sd, strict=True, assign=assign)
    return module
