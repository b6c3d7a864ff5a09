"""What a state dict is, from its key names and shapes alone: a LlamaGen GPT (c2i or t2i), a LlamaGen VQ
tokenizer, an EAGLE drafter (ours, or the public EAGLE/LANTERN layout), and its dimensions and preset.
The loaders use it to refuse a wrong-family file in one line; `python -m workflows.inspect_checkpoint`
prints it.

Two key layouts reach the same modules:
- LlamaGen's own (`tok_embeddings`, `layers.N.attention.wqkv`, `feed_forward.w1/w2/w3`, ...), which our
  GPT and drafter use as they are;
- Hugging Face Llama names, used by EAGLE/LANTERN drafters (`fc`, `layers.N.self_attn.{q,k,v,o}_proj`,
  `mlp.{gate,up,down}_proj`, `post_attention_layernorm`, plus a frozen copy of the target's
  `embed_tokens`) and by LANTERN's converted LlamaGen bases (the same under `model.`, with `lm_head`).
  `from_hf` renames them: q, k, v stack into wqkv in that order, rows head-major; LANTERN applies
  LlamaGen's interleaved 2D RoPE to them, so no row permutation is needed (unlike Meta -> HF Llama).
"""
from __future__ import annotations

import re
from collections import Counter

import torch

from decoding.llamagen.config import VQ_PRESETS
from decoding.models.gpt import GPT_PRESETS, find_multiple

# Buffers some checkpoints carry that are derived, not learned: rebuilt from the arguments (RoPE tables,
# masks), allocated per batch (KV caches), or training statistics (LlamaGen VQ's codebook usage).
DERIVED = re.compile(r"(^|\.)(freqs_cis|causal_mask|kv_cache\.[kv]_cache|rotary_emb\.inv_freq|codebook_used)$")

KINDS = {"gpt_c2i": "LlamaGen GPT, class-conditional (model=llamagen_c2i)",
         "gpt_t2i": "LlamaGen GPT, text-conditional (model=llamagen_t2i)",
         "vq": "LlamaGen VQ image tokenizer (model.vq_ckpt)",
         "drafter": "EAGLE drafter (model.drafter_ckpt)",
         "unknown": "not a LlamaGen GPT, VQ tokenizer or EAGLE drafter"}
LAYOUTS = {"llamagen": "LlamaGen key names", "hf": "Hugging Face Llama names (LANTERN's converted LlamaGen)",
           "eagle": "EAGLE/LANTERN drafter layout (Hugging Face Llama names)", "arspec": "arspec's own layout"}

_LAYER = {"self_attn.o_proj": "attention.wo", "mlp.gate_proj": "feed_forward.w1", "mlp.up_proj": "feed_forward.w3",
          "mlp.down_proj": "feed_forward.w2", "input_layernorm": "attention_norm",
          "post_attention_layernorm": "ffn_norm"}


def drop_derived(sd: dict) -> dict:
    return {k: v for k, v in sd.items() if not DERIVED.search(k)}


def detect(sd: dict) -> tuple[str, str]:
    """-> (kind, layout): kind in KINDS, layout in LAYOUTS ('' for unknown)."""
    keys = set(sd)
    if "tok_embeddings.weight" in keys and "layers.0.attention.wqkv.weight" in keys:
        if "cls_embedding.embedding_table.weight" in keys:
            return "gpt_c2i", "llamagen"
        if "cls_embedding.cap_proj.fc1.weight" in keys:
            return "gpt_t2i", "llamagen"
    if "model.embed_tokens.weight" in keys and "model.layers.0.self_attn.q_proj.weight" in keys:
        if "model.cls_embedding.embedding_table.weight" in keys:
            return "gpt_c2i", "hf"
        if "model.cls_embedding.cap_proj.fc1.weight" in keys:
            return "gpt_t2i", "hf"
    if "quantize.embedding.weight" in keys and "decoder.conv_in.weight" in keys:
        return "vq", "llamagen"
    if "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys:
        return "drafter", "eagle"
    if "fc.weight" in keys and "layers.0.attention.wqkv.weight" in keys and "tok_embeddings.weight" not in keys:
        return "drafter", "arspec"
    return "unknown", ""


def from_hf(sd: dict, prefix: str = "") -> tuple[dict, dict]:
    """Hugging Face Llama names (under `prefix`, e.g. 'model.') -> LlamaGen names. Returns (renamed state
    dict, the entries that have no LlamaGen counterpart: the drafter's frozen `embed_tokens`)."""
    out, aside = {}, {}
    for k, v in sd.items():
        name = k[len(prefix):] if prefix and k.startswith(prefix) else k
        m = re.match(r"layers\.(\d+)\.(.+)\.weight$", name)
        if m and m.group(2) in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            continue  # stacked below
        if m and m.group(2) in _LAYER:
            out[f"layers.{m.group(1)}.{_LAYER[m.group(2)]}.weight"] = v
        elif k == "lm_head.weight":
            out["output.weight"] = v
        elif name == "embed_tokens.weight" and prefix:     # a converted GPT's input embedding
            out["tok_embeddings.weight"] = v
        elif name == "embed_tokens.weight":                # a drafter's frozen copy of its target's
            aside[name] = v
        else:
            out[name] = v
    for i in sorted({int(m.group(1)) for k in sd if (m := re.match(rf"{re.escape(prefix)}layers\.(\d+)\.self_attn\.q_proj", k))}):
        parts = [sd.get(f"{prefix}layers.{i}.self_attn.{p}_proj.weight") for p in "qkv"]
        if any(p is None for p in parts):
            missing = [f"{prefix}layers.{i}.self_attn.{p}_proj.weight" for p, t in zip("qkv", parts) if t is None]
            raise ValueError(f"missing {', '.join(missing)}")
        out[f"layers.{i}.attention.wqkv.weight"] = torch.cat(parts, 0)
    return out, aside


def _layers(sd: dict, pattern: str) -> int:
    return len({m.group(1) for k in sd if (m := re.match(pattern, k))})


def _dtype(sd: dict) -> str:
    counts = Counter(str(v.dtype).replace("torch.", "") for v in sd.values() if v.is_floating_point())
    return ", ".join(f"{d}" for d, _ in counts.most_common())


def describe(sd: dict) -> dict:
    """Kind, layout and dimensions of a state dict, and the preset they match (None if none)."""
    kind, layout = detect(sd)
    out = {"kind": kind, "layout": layout, "dtype": _dtype(sd),
           "parameters": sum(v.numel() for k, v in sd.items() if not DERIVED.search(k))}
    if kind in ("gpt_c2i", "gpt_t2i"):
        g = from_hf(sd, "model.")[0] if layout == "hf" else sd
        vocab, dim = g["tok_embeddings.weight"].shape
        n_layer = _layers(g, r"layers\.(\d+)\.attention\.wqkv")
        qkv = g["layers.0.attention.wqkv.weight"].shape[0]
        ffn = g["layers.0.feed_forward.w1.weight"].shape[0]
        out.update(dim=dim, n_layer=n_layer, vocab_size=vocab, ffn_hidden=ffn, gqa=qkv != 3 * dim)
        preset = next((n for n, p in GPT_PRESETS.items() if (p["dim"], p["n_layer"]) == (dim, n_layer)), None)
        out.update(preset=preset, n_head=GPT_PRESETS[preset]["n_head"] if preset else None,
                   ffn_is_llamagen=ffn == find_multiple(int(8 * dim / 3), 256))
        if kind == "gpt_c2i":
            out["num_classes"] = g["cls_embedding.embedding_table.weight"].shape[0] - 1
        else:
            out["caption_dim"] = g["cls_embedding.cap_proj.fc1.weight"].shape[1]
            out["cls_token_num"] = g["cls_embedding.uncond_embedding"].shape[0] if "cls_embedding.uncond_embedding" in g else None
    elif kind == "vq":
        levels = _layers(sd, r"encoder\.conv_blocks\.(\d+)\.")
        ch = sd["encoder.conv_in.weight"].shape[0]
        ch_mult = [sd[f"encoder.conv_blocks.{i}.res.0.conv2.weight"].shape[0] // ch for i in range(levels)]
        size, edim = sd["quantize.embedding.weight"].shape
        out.update(codebook_size=size, codebook_embed_dim=edim, ch=ch, ch_mult=ch_mult,
                   z_channels=sd["encoder.conv_out.weight"].shape[0],
                   num_res_blocks=_layers(sd, r"encoder\.conv_blocks\.0\.res\.(\d+)\."), downsample=2 ** (levels - 1),
                   preset=next((n for n, m in VQ_PRESETS.items() if m == ch_mult), None))
    elif kind == "drafter":
        pattern = r"layers\.(\d+)\.self_attn\.q_proj" if layout == "eagle" else r"layers\.(\d+)\.attention\.wqkv"
        out.update(dim=sd["fc.weight"].shape[0], n_layer=_layers(sd, pattern), fc_bias="fc.bias" in sd,
                   vocab_size=sd["embed_tokens.weight"].shape[0] if "embed_tokens.weight" in sd else None)
    return out


def summary(d: dict) -> str:
    """One phrase for error messages: 'a LlamaGen VQ image tokenizer (codebook 16384 x 8)'."""
    kind = d["kind"]
    if kind in ("gpt_c2i", "gpt_t2i"):
        cond = f"{d['num_classes']} classes" if kind == "gpt_c2i" else f"caption dim {d['caption_dim']}"
        return (f"a {KINDS[kind].split(' (')[0]} ({d['preset'] or 'no preset'}: dim {d['dim']}, {d['n_layer']} layers, "
                f"vocab {d['vocab_size']}, {cond})")
    if kind == "vq":
        return f"a {KINDS[kind].split(' (')[0]} ({d['preset'] or 'custom'}: codebook {d['codebook_size']} x {d['codebook_embed_dim']})"
    if kind == "drafter":
        return f"an {KINDS[kind].split(' (')[0]} ({LAYOUTS[d['layout']]}, dim {d['dim']}, {d['n_layer']} layer(s))"
    return "something else (" + KINDS["unknown"] + ")"
