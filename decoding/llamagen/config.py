"""Settings of the LlamaGen families (the Hydra `model` schemas) and the model arguments they give.

Defaults are LlamaGen's sampling scripts' (autoregressive/sample/sample_c2i.py, sample_t2i.py): c2i GPT-B
at 384 px, t2i GPT-XL at 512 px with 120 FLAN-T5 tokens, VQ-16 with a 16384 x 8 codebook. A preset names
the GPT's depth and width; `dim`, `n_layer`, `n_head` override it (explicit dims), and the VQ's widths can
be given the same way. A GPT's weights do not depend on the image size (the RoPE table is rebuilt), so
`image_size` must match the checkpoint's: the loader refuses another size where the file records one (a
RoPE table, saved training args, LlamaGen's file name: c2i_L_384.pt) and says the size it assumes where not.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import List, Optional

from decoding.models.drafter import DrafterArgs
from decoding.models.gpt import GPT_PRESETS, GPTArgs
from decoding.models.vq import VQArgs
from decoding.registry import ModelConfig

VQ_PRESETS = {"VQ-16": [1, 1, 2, 2, 4], "VQ-8": [1, 2, 2, 4]}   # ch_mult: 4 or 3 downsamplings
IMAGE_SIZES = (256, 384, 512)                                    # LlamaGen's released sizes


@dataclass
class LlamaGenConfig(ModelConfig):
    name: str = "llamagen_c2i"
    gpt_ckpt: Optional[str] = None        # LlamaGen GPT checkpoint: .pt/.pth ({"model": ...} or raw FSDP) or .safetensors
    vq_ckpt: Optional[str] = None         # VQ tokenizer checkpoint (vq_ds16_c2i.pt, vq_ds16_t2i.pt)
    drafter_ckpt: Optional[str] = None    # EAGLE drafter: ours (workflows.train stages=[drafter]) or the EAGLE/LANTERN layout; null = none
    gpt_weights_key: Optional[str] = None # gpt_ckpt's entry with the weights (e.g. ema); null = model, module, state_dict, ema: the first present
    gpt_model: str = "GPT-B"              # GPT-B | GPT-L | GPT-XL | GPT-XXL | GPT-3B
    dim: Optional[int] = None             # explicit dims: override the preset's
    n_layer: Optional[int] = None
    n_head: Optional[int] = None
    image_size: int = 384                 # 256 | 384 | 512 for the released checkpoints
    vq_model: str = "VQ-16"               # VQ-16 | VQ-8
    codebook_size: int = 16384            # = the GPT's vocabulary
    codebook_embed_dim: int = 8
    vq_ch: int = 128                      # VQ widths (LlamaGen's constructor defaults)
    vq_z_channels: int = 256
    vq_num_res_blocks: int = 2
    vq_ch_mult: Optional[List[int]] = None  # null = the vq_model preset's
    compile: bool = False                 # torch.compile the GPT and drafter forwards (GPU; first batches compile)


@dataclass
class C2IConfig(LlamaGenConfig):
    name: str = "llamagen_c2i"
    num_classes: int = 1000               # class ids 0..num_classes-1; the null class (CFG) is num_classes


@dataclass
class T2IConfig(LlamaGenConfig):
    name: str = "llamagen_t2i"
    gpt_model: str = "GPT-XL"
    image_size: int = 512
    t5_path: Optional[str] = None         # local FLAN-T5-XL directory (or its parent, LlamaGen's pretrained_models/t5-ckpt)
    cls_token_num: int = 120              # T5 tokens per caption (left-padded)
    caption_dim: int = 2048               # T5's d_model


def _bad(key: str, value, rule: str) -> ValueError:
    return ValueError(f"model.{key}={value!r}: {rule}")


def vq_args(cfg: LlamaGenConfig) -> VQArgs:
    if cfg.vq_ch_mult is None and cfg.vq_model not in VQ_PRESETS:
        raise _bad("vq_model", cfg.vq_model, f"choose one of {', '.join(VQ_PRESETS)} or give model.vq_ch_mult")
    ch_mult = list(cfg.vq_ch_mult if cfg.vq_ch_mult is not None else VQ_PRESETS[cfg.vq_model])
    a = VQArgs(codebook_size=cfg.codebook_size, codebook_embed_dim=cfg.codebook_embed_dim, ch=cfg.vq_ch,
               ch_mult=ch_mult, z_channels=cfg.vq_z_channels, num_res_blocks=cfg.vq_num_res_blocks)
    if cfg.vq_ch % a.norm_groups:
        raise _bad("vq_ch", cfg.vq_ch, f"must be a multiple of {a.norm_groups} (the VQ's GroupNorm groups)")
    return a


def gpt_args(cfg: LlamaGenConfig) -> GPTArgs:
    """The GPT the settings describe: preset + explicit dims, vocabulary = codebook, grid from image size."""
    if cfg.gpt_model not in GPT_PRESETS:
        raise _bad("gpt_model", cfg.gpt_model, f"choose one of {', '.join(GPT_PRESETS)} (or set model.dim, n_layer, n_head)")
    dims = {k: getattr(cfg, k) for k in ("dim", "n_layer", "n_head") if getattr(cfg, k) is not None}
    down = vq_args(cfg).downsample
    if cfg.image_size % down:
        raise _bad("image_size", cfg.image_size, f"must be a multiple of the VQ's downsampling ({down}); "
                   f"LlamaGen's are {', '.join(map(str, IMAGE_SIZES))}")
    grid = cfg.image_size // down
    t2i = isinstance(cfg, T2IConfig)
    a = GPTArgs.from_name(cfg.gpt_model, **dims, vocab_size=cfg.codebook_size, block_size=grid * grid,
                          model_type="t2i" if t2i else "c2i",
                          num_classes=getattr(cfg, "num_classes", 1000), caption_dim=getattr(cfg, "caption_dim", 2048),
                          cls_token_num=cfg.cls_token_num if t2i else 1)
    if a.dim % a.n_head or a.head_dim % 4:
        if cfg.n_head is None:      # the preset's head count: name the setting that was given, and the one to add
            raise _bad("dim", a.dim, f"{cfg.gpt_model}'s {a.n_head} heads (model.n_head is not set) do not split it "
                       f"into whole heads of a size divisible by 4 (2D RoPE): set model.n_head too"
                       + (f", e.g. model.n_head={guess_heads(a.dim)} ({a.dim // guess_heads(a.dim)}-wide heads)"
                          if guess_heads(a.dim) else ""))
        raise _bad("n_head", a.n_head, f"dim {a.dim} / n_head must be a whole head size divisible by 4 (2D RoPE)")
    return a


def guess_heads(dim: int) -> Optional[int]:
    """A head count for `dim` when nothing records one: LlamaGen's 64-wide heads (GPT-B to XXL), else the
    widest head under 64 that divides dim and is divisible by 4 (2D RoPE); None when none is."""
    width = next((w for w in range(64, 3, -4) if dim % w == 0), None)
    return None if width is None else dim // width


def drafter_args(target: GPTArgs, n_layer: int = 1, **overrides) -> DrafterArgs:
    return replace(DrafterArgs.for_target(target, n_layer=n_layer), **overrides)


def describe(a: GPTArgs, cfg: LlamaGenConfig) -> str:
    """e.g. 'GPT-L c2i (dim 1024, 24 layers, 16 heads, vocab 16384, 1000 classes, 24x24 tokens)'."""
    cond = f"{a.num_classes} classes" if a.model_type == "c2i" else f"{a.cls_token_num} x {a.caption_dim} caption"
    explicit = any(getattr(cfg, k) is not None for k in ("dim", "n_layer", "n_head"))
    name = "explicit dims" if explicit else cfg.gpt_model
    return (f"{name} {a.model_type} (dim {a.dim}, {a.n_layer} layers, {a.n_head} heads, vocab {a.vocab_size}, "
            f"{cond}, {a.grid_size}x{a.grid_size} tokens)")
