"""LlamaGen model families (FoundationVision/LlamaGen): `llamagen_c2i` (class-conditional, GPT-B to GPT-3B
with VQ-16) and `llamagen_t2i` (text-conditional GPT-XL with FLAN-T5-XL features), loaded from the public
checkpoints on a local path (docs/design.md, "LlamaGen checkpoints").

  config.py   the settings (`model=llamagen_c2i` / `model=llamagen_t2i`), presets and their arguments
  layouts.py  what a checkpoint holds (family, dims, preset) and the EAGLE/LANTERN key layout
  load.py     strict loaders for the GPT, the VQ tokenizer and drafters (ours or EAGLE/LANTERN)
  t5.py       FLAN-T5 caption features (optional `transformers` extra), LlamaGen's left padding
  bundle.py   the bundle: class ids or captions -> conditions; optional torch.compile of the forwards
  c2i.py, t2i.py   the two registry entries
"""
