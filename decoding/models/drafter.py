"""EAGLE-style drafter (SafeAILab/EAGLE, as used by LANTERN and ADT-Tree).

Input at sequence position p: fc(concat(e_{p+1}, f_p)), where f_p is the target's final (post-norm)
hidden state at p and e_{p+1} the target's input embedding of the next position (a caption embedding
inside the condition prefix, a token embedding after it). One decoder layer without its input norm
predicts f_{p+1}; the target's frozen output head turns it into logits. The token embedding and the
head are the target's own and are not stored with the drafter.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn

from decoding.models.gpt import GPTArgs, TransformerBlock, rope_complex, rope_table_2d
from decoding.models.kv_cache import KVCache


@dataclass
class DrafterArgs:
    dim: int = 768
    n_head: int = 12
    n_layer: int = 1
    block_size: int = 256
    cls_token_num: int = 1
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    multiple_of: int = 256
    cond_rope: str = "zero"  # the target's (GPTArgs.cond_rope)

    @classmethod
    def for_target(cls, t: GPTArgs, n_layer: int = 1) -> "DrafterArgs":
        return cls(dim=t.dim, n_head=t.n_head, n_layer=n_layer, block_size=t.block_size,
                   cls_token_num=t.cls_token_num, rope_base=t.rope_base, norm_eps=t.norm_eps,
                   multiple_of=t.multiple_of, cond_rope=t.cond_rope)

    def gpt_args(self) -> GPTArgs:
        return GPTArgs(dim=self.dim, n_head=self.n_head, n_layer=self.n_layer, block_size=self.block_size,
                       cls_token_num=self.cls_token_num, rope_base=self.rope_base, norm_eps=self.norm_eps,
                       multiple_of=self.multiple_of, cond_rope=self.cond_rope)

    def to_dict(self) -> dict:
        return asdict(self)


class Drafter(nn.Module):
    kind, Args = "drafter", DrafterArgs

    def __init__(self, a: DrafterArgs):
        super().__init__()
        self.args = a
        g = a.gpt_args()
        self.fc = nn.Linear(2 * a.dim, a.dim, bias=True)
        self.layers = nn.ModuleList(TransformerBlock(g) for _ in range(a.n_layer))
        self.layers[0].attention_norm = nn.Identity()  # EAGLE: no input norm on the first layer
        self.register_buffer("rope", rope_complex(rope_table_2d(g.grid_size, g.head_dim, a.rope_base,
                                                                a.cls_token_num, a.cond_rope)), persistent=False)

    def setup_caches(self, batch: int, seq_len: int, dtype=torch.float32):
        g = self.args.gpt_args()
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, seq_len, g.n_head, g.head_dim, dtype, self.fc.weight.device)

    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers]

    def forward(self, emb: torch.Tensor, feat: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                slots=None, rows=None) -> torch.Tensor:
        """emb = e_{p+1}, feat = f_p, both [B, T, dim]; pos [B, T] = p + 1 (the position whose feature
        is predicted, which picks the RoPE row). Returns predicted features [B, T, dim]."""
        h = self.fc(torch.cat([emb, feat.to(emb.dtype)], -1))
        rope = self.rope[pos]
        for layer in self.layers:
            h = layer(h, rope, mask, slots, rows)
        return h
