"""FLAN-T5 caption features for LlamaGen t2i, as its sampler makes them (language/t5.py, sample_t2i.py).

The tokenizer pads each caption on the right to `max_len` (120) tokens with its closing `</s>` counted as
a real token; T5's encoder runs under that attention mask. LlamaGen then moves the padding to the left:
row j of the new sequence is row (j + n) mod L of the old (n real tokens), the mask is flipped, and the
padding rows are zeroed. The GPT hides the padded columns from every query (docs/design.md, "Models").

Text is lowercased and stripped, LlamaGen's `use_text_preprocessing=False` path; its default also runs
PixArt's caption cleaner twice (URLs, HTML, @handles, odd punctuation), which ordinary prompts pass
through unchanged. `transformers` is an optional extra (`pip install -e ".[t5]"`); weights come from a
local directory only, nothing is downloaded.
"""
from __future__ import annotations

from pathlib import Path

import torch

EXTRA = 'pip install -e ".[t5]"'


def t5_dir(path) -> Path:
    """The directory with the T5 model: `path` itself, or LlamaGen's layout `path/flan-t5-xl`."""
    if not path:
        raise ValueError("model.t5_path is not set: point it at a local FLAN-T5-XL directory "
                         "(google/flan-t5-xl; LlamaGen keeps it in pretrained_models/t5-ckpt/flan-t5-xl)")
    p = Path(path).expanduser()
    for d in (p, p / "flan-t5-xl"):
        if (d / "config.json").is_file():
            return d
    raise FileNotFoundError(f"model.t5_path={path}: no T5 model there (no config.json in it or in flan-t5-xl/); "
                            f"download google/flan-t5-xl into it")


def left_pad(h: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded features h [B, L, D] with mask [B, L] (the first n_b rows real) -> left-padded features
    with the padding rows zeroed, and the flipped mask."""
    L = mask.shape[1]
    n = mask.sum(1, keepdim=True)
    rows = (torch.arange(L, device=h.device)[None] + n) % L
    mask = mask.flip(-1)
    return h.gather(1, rows[..., None].expand_as(h)) * mask[..., None].to(h.dtype), mask


class T5Features:
    """Caption -> (features [B, max_len, d_model], mask [B, max_len] bool), left-padded as LlamaGen does."""

    def __init__(self, path, max_len: int, device, dtype: torch.dtype):
        try:
            from transformers import AutoTokenizer, T5EncoderModel
        except ImportError:
            raise ValueError(f"model.t5_path: the T5 text encoder needs the optional transformers extra: {EXTRA}") from None
        d = t5_dir(path)
        self.tokenizer = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
        self.tokenizer.padding_side = "right"   # left_pad assumes it
        self.model = T5EncoderModel.from_pretrained(str(d), local_files_only=True).to(device=device, dtype=dtype).eval()
        self.max_len, self.device = max_len, torch.device(device)
        self.dim = self.model.config.d_model

    @torch.no_grad()
    def __call__(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.tokenizer([t.lower().strip() for t in texts], max_length=self.max_len, padding="max_length",
                             truncation=True, return_attention_mask=True, add_special_tokens=True, return_tensors="pt")
        ids, mask = tok["input_ids"].to(self.device), tok["attention_mask"].to(self.device)
        h = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        return left_pad(h, mask.bool())
