"""Strict loaders for LlamaGen checkpoints: the GPT, the VQ tokenizer, and EAGLE drafters (ours, or the
public EAGLE/LANTERN layout).

Every file goes through `decoding.checkpoint.read_checkpoint` (safetensors, or torch.load with
weights_only=True; containers `model`, `module`, `state_dict`, `ema` or a raw FSDP state dict) and
`load_strict`: a key missing, a key left over or a shape that differs is one error line naming them and
the setting to change, never a partial load (LlamaGen's own samplers load with strict=False). The only
keys dropped are derived buffers (layouts.DERIVED: RoPE tables, masks, KV caches, VQ usage counts).

Big models are built on the meta device and take the checkpoint's tensors as they are (assign=True),
so a 3B checkpoint is neither randomly initialised first nor held twice in memory.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from decoding.bundle import cast
from decoding.checkpoint import load_strict, read_checkpoint
from decoding.llamagen.config import LlamaGenConfig, describe, drafter_args, gpt_args, guess_heads, vq_args
from decoding.llamagen.layouts import KINDS, describe as describe_sd, drop_derived, from_hf, summary
from decoding.models.drafter import Drafter, DrafterArgs
from decoding.models.gpt import GPT, GPT_PRESETS, GPTArgs, rope_complex, rope_table_2d
from decoding.models.vq import VQModel
from decoding.registry import NOTES

INSPECT = "python -m workflows.inspect_checkpoint"
_HOME = {"gpt_c2i": "model=llamagen_c2i model.gpt_ckpt", "gpt_t2i": "model=llamagen_t2i model.gpt_ckpt",
         "vq": "model.vq_ckpt", "drafter": "model.drafter_ckpt"}


CHECK_ONLY = "check"   # a _materialize dtype: the strict key/shape check alone (inspect), nothing cast or built


def _materialize(build, sd: dict, what: str, hint: str = "", dtype=None, buffers: Optional[dict] = None):
    """`build()` on the meta device, `sd` loaded strictly into it (its tensors assigned), the non-persistent
    buffers made real (the RoPE table from the arguments, plus `buffers`), floats cast to `dtype` (None:
    fp32; CHECK_ONLY: returned as loaded, the tensors still memory-mapped)."""
    with torch.device("meta"):
        m = build()
    load_strict(m, sd, what, hint, assign=True)
    if dtype is CHECK_ONLY:
        return m
    a = m.args if isinstance(m, GPT) else m.args.gpt_args() if isinstance(m, Drafter) else None
    if a is not None:
        m.rope = rope_complex(rope_table_2d(a.grid_size, a.head_dim, a.rope_base, a.cls_token_num, a.cond_rope))
    for name, value in (buffers or {}).items():
        setattr(m, name, value)
    meta = [n for n, t in [*m.named_parameters(), *m.named_buffers()] if t.is_meta]
    if meta:
        raise RuntimeError(f"{type(m).__name__}: {meta} were not loaded (a new non-persistent buffer?)")
    return (cast(m, dtype) if dtype is not None else m.float()).eval()


def _wrong_kind(setting: str, path, d: dict, want: str) -> ValueError:
    home = _HOME.get(d["kind"])
    fix = f"; it belongs in {home}=" if home and home != f"model.{setting}" else ""
    return ValueError(f"model.{setting}={path}: holds {summary(d)}, not a {KINDS[want].split(' (')[0]}{fix}")


SIZE_IN_NAME = re.compile(r"_(\d{3,4})$")    # LlamaGen's file names end in the image size: c2i_L_384.pt
_SAID: set = set()                              # (path, size) whose assumed image size was said in this process


def recorded(ck, d: dict, a: GPTArgs, path) -> dict:
    """What a GPT checkpoint tells beyond its weights' shapes, each as (value, where it says so): `heads`
    and `grid` from a RoPE table (freqs_cis, which some exports keep: the condition rows, then grid x grid
    rows of head size / 2), `heads` and `size` from its saved training args where they are this GPT's (their
    gpt_model has the weights' dims); else `size` from a LlamaGen file name."""
    out = {}
    rope = next((t for k, t in ck.state_dict.items() if k.endswith("freqs_cis") and t.dim() == 3), None)
    if rope is not None:
        rows = rope.shape[0] - (d.get("cls_token_num") or a.cls_token_num)
        if rows > 0 and math.isqrt(rows) ** 2 == rows:
            out["grid"] = (math.isqrt(rows), "its RoPE table")
        if d["dim"] % (2 * rope.shape[1]) == 0:
            out["heads"] = (d["dim"] // (2 * rope.shape[1]), "its RoPE table")
    args = ck.extra.get("args")
    preset = GPT_PRESETS.get(getattr(args, "gpt_model", None))
    if preset and (preset["dim"], preset["n_layer"]) == (d["dim"], d["n_layer"]):
        out.setdefault("heads", (preset["n_head"], f"its saved args, gpt_model={args.gpt_model}"))
        if isinstance(getattr(args, "image_size", None), int):
            out["size"] = (args.image_size, "its saved args")
    name = SIZE_IN_NAME.search(Path(path).stem)
    if name:
        out.setdefault("size", (int(name.group(1)), "its file name"))
    return out


def _gpt_fixes(d: dict, a: GPTArgs, cfg: LlamaGenConfig, rec: dict) -> list[str]:
    """The settings that would make the config describe the checkpoint `d` (from its shapes; the head
    count as `rec` records it, else the preset's, else guessed and said so)."""
    fixes = []
    if (d["dim"], d["n_layer"]) != (a.dim, a.n_layer):
        heads = rec.get("heads", (d["n_head"],))[0]
        explicit = any(getattr(cfg, k) is not None for k in ("dim", "n_layer", "n_head"))
        if d["preset"] and not explicit and heads == d["n_head"]:
            fixes.append(f"model.gpt_model={d['preset']}")
        else:
            guess = "" if heads else " (assumed: the checkpoint does not record its head count)"
            fixes.append(f"model.dim={d['dim']} model.n_layer={d['n_layer']} "
                         f"model.n_head={heads or guess_heads(d['dim']) or '<heads>'}{guess}")
    if d["vocab_size"] != a.vocab_size:
        fixes.append(f"model.codebook_size={d['vocab_size']}")
    if d.get("num_classes") not in (None, a.num_classes):
        fixes.append(f"model.num_classes={d['num_classes']}")
    if d.get("caption_dim") not in (None, a.caption_dim):
        fixes.append(f"model.caption_dim={d['caption_dim']}")
    if d.get("cls_token_num") not in (None, a.cls_token_num) and a.model_type == "t2i":
        fixes.append(f"model.cls_token_num={d['cls_token_num']}")
    return fixes


def _unseen_fixes(cfg: LlamaGenConfig, a: GPTArgs, rec: dict) -> list[tuple[str, str]]:
    """(setting, why) for what the weights load with either way but decode wrong: a head count or an image
    size other than the ones the checkpoint records."""
    out = []
    if "heads" in rec and rec["heads"][0] != a.n_head:
        n, how = rec["heads"]
        out.append((f"model.n_head={n}", f"model.n_head={a.n_head}: model.gpt_ckpt={cfg.gpt_ckpt} has {n} heads ({how})"))
    down = vq_args(cfg).downsample
    size, how = (rec["grid"][0] * down, rec["grid"][1]) if "grid" in rec else rec.get("size", (None, ""))
    if size is not None and size != cfg.image_size:
        out.append((f"model.image_size={size}", f"model.image_size={cfg.image_size}: model.gpt_ckpt={cfg.gpt_ckpt} "
                                                f"was trained at {size} px ({how})"))
    elif size is None and (cfg.gpt_ckpt, cfg.image_size) not in _SAID:
        _SAID.add((cfg.gpt_ckpt, cfg.image_size))
        NOTES.warning(f"model.image_size={cfg.image_size} assumed: model.gpt_ckpt={cfg.gpt_ckpt} does not record the "
                      f"size it was trained at (no RoPE table or saved args, no size in its name as in c2i_L_384.pt); "
                      f"set model.image_size if it is another")
    return out


def load_gpt(cfg: LlamaGenConfig, dtype: torch.dtype) -> GPT:
    a = gpt_args(cfg)
    if not cfg.gpt_ckpt:
        raise ValueError(f"model.gpt_ckpt is not set: point it at a LlamaGen {a.model_type} GPT checkpoint "
                         f"(e.g. {'c2i_L_384.pt' if a.model_type == 'c2i' else 't2i_XL_stage2_512.pt'})")
    ck = read_checkpoint(cfg.gpt_ckpt, cfg.gpt_weights_key, setting="model.gpt_ckpt")
    sd = drop_derived(ck.state_dict)
    d = describe_sd(sd)
    want = f"gpt_{a.model_type}"
    if d["kind"] != want:
        raise _wrong_kind("gpt_ckpt", cfg.gpt_ckpt, d, want)
    if d["layout"] == "hf":
        sd = from_hf(sd, "model.")[0]
    rec = recorded(ck, d, a, cfg.gpt_ckpt)
    fixes = _gpt_fixes(d, a, cfg, rec)
    unseen = [(fix, why) for fix, why in _unseen_fixes(cfg, a, rec) if fix.split("=")[0] not in " ".join(fixes)]
    if unseen and not fixes:     # the weights would load, and decode wrong
        raise ValueError(f"{'; '.join(why for _, why in unseen)}: set {' '.join(fix for fix, _ in unseen)}")
    fixes += [fix for fix, _ in unseen]
    hint = (f"it holds {summary(d)}: set {' '.join(fixes)}; " if fixes else "") + f"see {INSPECT} {cfg.gpt_ckpt}"
    return _materialize(lambda: GPT(a), sd, f"model.gpt_ckpt={cfg.gpt_ckpt} ({ck.container}) into "
                        f"{describe(a, cfg)}", hint, dtype)


def load_vq(cfg: LlamaGenConfig, dtype=None) -> VQModel:
    """The VQ tokenizer in fp32 (one decode per image; its codes must not move)."""
    a = vq_args(cfg)
    if not cfg.vq_ckpt:
        raise ValueError("model.vq_ckpt is not set: point it at a LlamaGen VQ checkpoint (e.g. vq_ds16_c2i.pt)")
    ck = read_checkpoint(cfg.vq_ckpt, setting="model.vq_ckpt")
    sd = drop_derived(ck.state_dict)
    d = describe_sd(sd)
    if d["kind"] != "vq":
        raise _wrong_kind("vq_ckpt", cfg.vq_ckpt, d, "vq")
    fixes = []
    if d["ch_mult"] != a.ch_mult:
        fixes.append(f"model.vq_model={d['preset']}" if d["preset"] else f"model.vq_ch_mult={d['ch_mult']}")
    for key, ours in (("codebook_size", a.codebook_size), ("codebook_embed_dim", a.codebook_embed_dim),
                      ("ch", a.ch), ("z_channels", a.z_channels), ("num_res_blocks", a.num_res_blocks)):
        if d[key] != ours:
            fixes.append(f"model.{'vq_' if key in ('ch', 'z_channels', 'num_res_blocks') else ''}{key}={d[key]}")
    hint = (f"it holds {summary(d)}: set {' '.join(fixes)}; " if fixes else "") + f"see {INSPECT} {cfg.vq_ckpt}"
    return _materialize(lambda: VQModel(a), sd, f"model.vq_ckpt={cfg.vq_ckpt} ({ck.container})", hint,
                        dtype if dtype is CHECK_ONLY else None)


# -- drafters --------------------------------------------------------------------------------------------
class LanternDrafter(Drafter):
    """An EAGLE/LANTERN drafter. LANTERN feeds it token id 0 at the condition positions (its input ids are
    120 zeros, then the image tokens), where our drafters read the condition's own embedding: rows whose
    next position is still in the condition get the embedding of token 0 (c2i has no such rows)."""

    def __init__(self, a: DrafterArgs, cond_token: torch.Tensor):
        super().__init__(a)
        self.register_buffer("cond_token", cond_token.detach().float().clone(), persistent=False)

    def forward(self, emb, feat, pos, mask, *args, **kw):   # the rest (cache slots, ...) as Drafter takes them
        emb = torch.where((pos < self.args.cls_token_num)[..., None], self.cond_token.to(emb.dtype), emb)
        return super().forward(emb, feat, pos, mask, *args, **kw)


def _drafter_files(path: Path) -> tuple[Path, dict]:
    """A drafter path is a file, or a directory holding one (EAGLE/LANTERN: config.json + weights)."""
    if path.is_dir():
        names = ("model.safetensors", "pytorch_model.bin", "drafter.safetensors")
        found = next((path / n for n in names if (path / n).exists()), None)
        if found is None:
            raise FileNotFoundError(f"model.drafter_ckpt={path}: a directory without {', '.join(names)}")
        conf = path / "config.json"
    else:
        found, conf = path, path.parent / "config.json"
    return found, (json.loads(conf.read_text()) if conf.exists() else {})


def _check_target(path, a: DrafterArgs, t: GPTArgs, model: str) -> None:
    theirs = {"dim": a.dim, "block_size": a.block_size, "cls_token_num": a.cls_token_num, "cond_rope": a.cond_rope}
    mine = {"dim": t.dim, "block_size": t.block_size, "cls_token_num": t.cls_token_num, "cond_rope": t.cond_rope}
    diffs = [f"{k} {theirs[k]} (target: {mine[k]})" for k in theirs if theirs[k] != mine[k]]
    if diffs:
        raise ValueError(f"model.drafter_ckpt={path}: was trained for another target ({', '.join(diffs)}); train one "
                         f"for this target: python -m workflows.train stages=[drafter] model={model} ...")


def load_drafter(cfg: LlamaGenConfig, gpt: GPT, dtype: torch.dtype) -> Optional[Drafter]:
    if not cfg.drafter_ckpt:
        return None
    path = Path(cfg.drafter_ckpt).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model.drafter_ckpt={path}: no such file or directory")
    file, conf = _drafter_files(path)
    t = gpt.args
    where = f"model.drafter_ckpt={path}"
    meta = _metadata(file)
    ck = read_checkpoint(file, setting="model.drafter_ckpt")
    sd = drop_derived(ck.state_dict)
    if meta.get("kind") == "drafter":                            # ours: its arguments travel in the metadata
        a = DrafterArgs(**json.loads(meta["args"]))
        _check_target(path, a, t, cfg.name)
        return _materialize(lambda: Drafter(a), sd, where, dtype=dtype)
    d = describe_sd(sd)
    if d["kind"] != "drafter":
        raise _wrong_kind("drafter_ckpt", path, d, "drafter")
    if d["dim"] != t.dim:
        _check_target(path, replace(DrafterArgs.for_target(t), dim=d["dim"]), t, cfg.name)
    if d["layout"] == "arspec":                                  # ours without its metadata (e.g. a .pt export)
        a = drafter_args(t, d["n_layer"])
        return _materialize(lambda: Drafter(a), sd, where, dtype=dtype)
    sd, aside = from_hf(sd)
    if "fc.bias" not in sd:                                      # EAGLE configs with "bias": false
        sd["fc.bias"] = torch.zeros(sd["fc.weight"].shape[0], dtype=sd["fc.weight"].dtype)
    emb = aside.get("embed_tokens.weight")
    own = gpt.tok_embeddings.weight.detach().float()
    if emb is not None and (emb.shape != own.shape or (emb.float() - own).abs().max() > 1e-2 * own.abs().max()):
        raise ValueError(f"{where}: its embed_tokens ({list(emb.shape)}) are not the target's tok_embeddings "
                         f"({list(own.shape)}): it was trained for another target")
    a = drafter_args(t, d["n_layer"], n_head=conf.get("num_attention_heads", t.n_head),
                     norm_eps=conf.get("rms_norm_eps", 1e-6))   # LANTERN's configs: 1e-6
    return _materialize(lambda: LanternDrafter(a, torch.zeros(t.dim)), sd, f"{where} (EAGLE/LANTERN layout)",
                        dtype=dtype, buffers={"cond_token": own[0].clone()})


def inspect(cfg: LlamaGenConfig) -> dict:
    """What the job's driver checks without loading the model: every file readable, of the right kind,
    its keys and shapes exactly the configured model's (the loaders' own checks, so the same one-line
    errors). Torch files are memory-mapped and nothing is cast, so a multi-GB checkpoint costs the driver
    address space, not memory. -> {"drafter": bool}."""
    gpt = load_gpt(cfg, CHECK_ONLY)
    load_vq(cfg, CHECK_ONLY)
    return {"drafter": load_drafter(cfg, gpt, CHECK_ONLY) is not None}


def _metadata(file: Path) -> dict:
    """A safetensors file's metadata ({} for other files, or one that cannot be read: read_checkpoint
    then reports it in one line)."""
    if file.suffix != ".safetensors":
        return {}
    from safetensors import safe_open
    try:
        with safe_open(str(file), framework="pt") as f:
            return f.metadata() or {}
    except Exception:
        return {}
