"""A small word-level text encoder for shapes captions (the stand-in for FLAN-T5 in LlamaGen t2i).

Words outside the vocabulary map to <unk>, so any real prompt encodes; captions are left-padded to
`max_len` like LlamaGen's T5 prefix, and the mask marks the real words.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

PAD, UNK = "<pad>", "<unk>"


@dataclass
class TextArgs:
    vocab: list = field(default_factory=list)  # index 0 = <pad>, 1 = <unk>
    max_len: int = 16
    dim: int = 64
    n_layer: int = 2
    n_head: int = 4

    def to_dict(self) -> dict:
        return asdict(self)


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def build_vocab(texts) -> list[str]:
    vocab = sorted({w for t in texts for w in words(t)})
    return [PAD, UNK] + vocab


class TextEncoder(nn.Module):
    kind, Args = "text", TextArgs

    def __init__(self, a: TextArgs):
        super().__init__()
        if len(a.vocab) < 2 or a.vocab[:2] != [PAD, UNK]:
            raise ValueError("text vocab must start with '<pad>', '<unk>'")
        self.args = a
        self.index = {w: i for i, w in enumerate(a.vocab)}
        self.tok = nn.Embedding(len(a.vocab), a.dim)
        self.pos = nn.Parameter(torch.zeros(a.max_len, a.dim))
        layer = nn.TransformerEncoderLayer(a.dim, a.n_head, 4 * a.dim, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, a.n_layer, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(a.dim)

    def tokenize(self, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """-> ids [B, L] (left-padded), mask [B, L] (True = word), unknown-word count per text."""
        L = self.args.max_len
        ids = torch.zeros(len(texts), L, dtype=torch.long)
        unknown = []
        for b, t in enumerate(texts):
            seq = [self.index.get(w, 1) for w in words(t)][:L] or [1]
            unknown.append(sum(i == 1 for i in seq))
            ids[b, L - len(seq):] = torch.tensor(seq)
        return ids, ids != 0, unknown

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.tok(ids) + self.pos
        return self.norm(self.blocks(h, src_key_padding_mask=~mask))

    @torch.no_grad()
    def encode(self, texts: list[str]):
        ids, mask, unknown = self.tokenize(texts)
        device = self.pos.device
        return self(ids.to(device), mask.to(device)), mask.to(device), unknown
