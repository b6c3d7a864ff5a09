"""LlamaGen-style GPT for image tokens, weight-compatible with FoundationVision/LlamaGen.

Pre-norm decoder, RMSNorm, bias-free linears, SwiGLU, 2D RoPE whose condition rows are all zero.
c2i conditions on a class label, t2i on caption features (T5 for real checkpoints, the shapes text
encoder for the built-in model). The KV cache is static and addressed by slot, so a block of draft
tokens can be written with a tree mask and the accepted path compacted afterwards (see kv_cache.py).

Positions come in two flavours: `pos` is the logical sequence position (condition tokens first, image
token i at cls_token_num + i) and picks the RoPE row; `slots` is where a token's K/V live in the cache.
For plain decoding they coincide; inside a draft tree they do not.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from decoding.models.kv_cache import KVCache


def find_multiple(n: int, k: int) -> int:
    return n if n % k == 0 else n + k - (n % k)


@dataclass
class GPTArgs:
    dim: int = 768
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: Optional[int] = None
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    vocab_size: int = 16384
    block_size: int = 256          # image tokens = grid_size ** 2
    model_type: str = "c2i"        # "c2i" | "t2i"
    num_classes: int = 1000
    caption_dim: int = 2048
    cls_token_num: int = 1         # 1 for c2i, 120 for LlamaGen t2i
    class_dropout_prob: float = 0.1
    token_dropout_p: float = 0.0
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0
    # Not in LlamaGen (off for its checkpoints): a learned embedding of each image token's grid cell,
    # added to its input. RoPE gives only relative offsets, and a small model trained for minutes on a
    # CPU cannot tell from them where in the image it is; the shipped shapes model turns this on.
    abs_pos_embed: bool = False
    # RoPE rows of the condition positions. "zero" is LlamaGen's (cos = sin = 0, so q and k vanish there and
    # every image token reads the plain average of the caption's values; its checkpoints need it).
    # "identity" (cos = 1, sin = 0) keeps their keys, so an image token can attend to one word: the
    # shipped shapes model uses it, a small model cannot learn left from right through the average.
    cond_rope: str = "zero"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def grid_size(self) -> int:
        g = math.isqrt(self.block_size)
        if g * g != self.block_size:
            raise ValueError(f"model.block_size={self.block_size} must be a square number of tokens")
        return g

    @classmethod
    def from_name(cls, name: str, **overrides) -> "GPTArgs":
        if name not in GPT_PRESETS:
            raise ValueError(f"unknown GPT preset {name!r}; choose one of {sorted(GPT_PRESETS)}")
        return replace(cls(**GPT_PRESETS[name]), **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


GPT_PRESETS = {
    "GPT-B": dict(n_layer=12, n_head=12, dim=768),
    "GPT-L": dict(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": dict(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": dict(n_layer=48, n_head=24, dim=1536),
    "GPT-3B": dict(n_layer=24, n_head=32, dim=3200),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class MLP(nn.Module):
    """cap_proj of LlamaGen's CaptionEmbedder: fc1 -> GELU(tanh) -> fc2, no biases."""

    def __init__(self, in_features: int, hidden: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden, bias=False)
        self.fc2 = nn.Linear(hidden, out_features, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class LabelEmbedder(nn.Module):
    def __init__(self, num_classes: int, dim: int, dropout_prob: float):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, dim)  # last row = null class
        self.num_classes, self.dropout_prob = num_classes, dropout_prob

    def forward(self, labels: torch.Tensor, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        if drop is not None:
            labels = torch.where(drop, self.num_classes, labels)
        return self.embedding_table(labels).unsqueeze(1)


class CaptionEmbedder(nn.Module):
    def __init__(self, caption_dim: int, dim: int, token_num: int, dropout_prob: float):
        super().__init__()
        self.cap_proj = MLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(token_num, caption_dim) / caption_dim ** 0.5)
        self.dropout_prob = dropout_prob

    def forward(self, caption: torch.Tensor, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        if drop is not None:
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)


class FeedForward(nn.Module):
    def __init__(self, a: GPTArgs):
        super().__init__()
        hidden = int(2 * 4 * a.dim / 3)
        if a.ffn_dim_multiplier is not None:
            hidden = int(a.ffn_dim_multiplier * hidden)
        hidden = find_multiple(hidden, a.multiple_of)
        self.w1 = nn.Linear(a.dim, hidden, bias=False)
        self.w3 = nn.Linear(a.dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, a.dim, bias=False)
        self.dropout = nn.Dropout(a.ffn_dropout_p) if a.ffn_dropout_p else nn.Identity()

    def forward(self, x):
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D]; rope [B, T, D/2] complex (cos + i sin), rotating interleaved pairs."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * rope[:, :, None]).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, a: GPTArgs):
        super().__init__()
        self.n_head, self.head_dim = a.n_head, a.head_dim
        self.n_kv_head = a.n_kv_head or a.n_head
        self.wqkv = nn.Linear(a.dim, (self.n_head + 2 * self.n_kv_head) * self.head_dim, bias=False)
        self.wo = nn.Linear(a.dim, a.dim, bias=False)
        self.resid_dropout = nn.Dropout(a.resid_dropout_p) if a.resid_dropout_p else nn.Identity()
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, rope, mask, slots=None, rows=None):
        B, T, _ = x.shape
        kv = self.n_kv_head * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv, kv], dim=-1)
        q = apply_rope(q.view(B, T, self.n_head, self.head_dim), rope)
        k = apply_rope(k.view(B, T, self.n_kv_head, self.head_dim), rope)
        v = v.view(B, T, self.n_kv_head, self.head_dim)
        q = q.transpose(1, 2)
        if slots is not None:  # cached decoding; training runs without a cache
            k, v = self.kv_cache.update(slots, k, v, rows)  # -> whole cache [B, Hkv, S, D]
            k, v = k[:, :, : mask.shape[-1]], v[:, :, : mask.shape[-1]]  # the mask may cover only a prefix
            q = q.to(k.dtype)  # the cache may be kept in fp32 (see setup_caches)
        else:
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.n_kv_head != self.n_head:
            k = k.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
            v = v.repeat_interleave(self.n_head // self.n_kv_head, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.resid_dropout(self.wo(y.transpose(1, 2).reshape(B, T, -1).to(x.dtype)))


class TransformerBlock(nn.Module):
    def __init__(self, a: GPTArgs):
        super().__init__()
        self.attention = Attention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a.dim, a.norm_eps)
        self.ffn_norm = RMSNorm(a.dim, a.norm_eps)

    def forward(self, x, rope, mask, slots=None, rows=None):
        h = x + self.attention(self.attention_norm(x), rope, mask, slots, rows)
        return h + self.feed_forward(self.ffn_norm(h))


def rope_table_2d(grid_size: int, head_dim: int, base: float, cls_token_num: int,
                  cond_rope: str = "zero") -> torch.Tensor:
    """[cls + grid², head_dim/2, 2]: condition rows zero (or cos 1, sin 0); cell (r, c) gets concat(r·f, c·f)."""
    if cond_rope not in ("zero", "identity"):
        raise ValueError(f"model cond_rope={cond_rope!r}: use 'zero' (LlamaGen) or 'identity'")
    half = head_dim // 2
    freqs = 1.0 / base ** (torch.arange(0, half, 2)[: half // 2].float() / half)
    t = torch.arange(grid_size, dtype=torch.float32)
    f = torch.outer(t, freqs)
    grid = torch.cat([f[:, None, :].expand(-1, grid_size, -1), f[None, :, :].expand(grid_size, -1, -1)], -1)
    table = torch.stack([grid.cos(), grid.sin()], -1).flatten(0, 1)
    cond = torch.zeros(cls_token_num, half, 2)
    if cond_rope == "identity":
        cond[..., 0] = 1.0
    return torch.cat([cond, table])


def rope_complex(table: torch.Tensor) -> torch.Tensor:
    """[..., D/2, 2] (cos, sin) -> complex [..., D/2]; condition rows stay exactly 0."""
    return torch.complex(table[..., 0].contiguous(), table[..., 1].contiguous())


class GPT(nn.Module):
    kind, Args = "gpt", GPTArgs

    def __init__(self, a: GPTArgs):
        super().__init__()
        self.args = a
        if a.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(a.num_classes, a.dim, a.class_dropout_prob)
        elif a.model_type == "t2i":
            self.cls_embedding = CaptionEmbedder(a.caption_dim, a.dim, a.cls_token_num, a.class_dropout_prob)
        else:
            raise ValueError(f"model.model_type={a.model_type!r}: use 'c2i' or 't2i'")
        self.tok_embeddings = nn.Embedding(a.vocab_size, a.dim)
        if a.abs_pos_embed:
            self.pos_embeddings = nn.Embedding(a.block_size, a.dim)
        self.tok_dropout = nn.Dropout(a.token_dropout_p) if a.token_dropout_p else nn.Identity()
        self.layers = nn.ModuleList(TransformerBlock(a) for _ in range(a.n_layer))
        self.norm = RMSNorm(a.dim, a.norm_eps)
        self.output = nn.Linear(a.dim, a.vocab_size, bias=False)
        self.register_buffer("rope", rope_complex(rope_table_2d(a.grid_size, a.head_dim, a.rope_base,
                                                                a.cls_token_num, a.cond_rope)), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    # -- caches -------------------------------------------------------------------------------------
    def setup_caches(self, batch: int, seq_len: int, dtype=torch.float32):
        a = self.args
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(batch, seq_len, a.n_kv_head or a.n_head, a.head_dim,
                                               dtype, self.output.weight.device)

    def caches(self) -> list[KVCache]:
        return [layer.attention.kv_cache for layer in self.layers]

    # -- embeddings ---------------------------------------------------------------------------------
    def embed_condition(self, cond: torch.Tensor, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Class labels [B] or caption features [B, cls_token_num, caption_dim] -> [B, cls, dim]."""
        return self.cls_embedding(cond, drop)[:, : self.args.cls_token_num]

    def embed_tokens(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok_embeddings(idx)

    # -- forward ------------------------------------------------------------------------------------
    def forward_embeds(self, h: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                       slots: Optional[torch.Tensor] = None, rows: Optional[torch.Tensor] = None) -> torch.Tensor:
        """h [B, T, dim], pos [B, T] logical positions, mask [B, T, S] (S <= cache length: the prefix of
        cache slots attention reads; T without a cache), `rows` [B] the cache rows (default the first B).
        Returns the final hidden state after the last norm (the 'feature' EAGLE drafts from)."""
        rope = self.rope[pos]
        if self.args.abs_pos_embed:  # image cell of each input token; condition positions get none
            cell = pos - self.args.cls_token_num
            h = h + self.pos_embeddings(cell.clamp(min=0)) * (cell >= 0)[..., None].to(h.dtype)
        h = self.tok_dropout(h)
        for layer in self.layers:
            h = layer(h, rope, mask, slots, rows)
        return self.norm(h)

    def logits(self, feature: torch.Tensor) -> torch.Tensor:
        return self.output(feature).float()

    def forward_train(self, cond_emb: torch.Tensor, tokens: torch.Tensor,
                      cond_mask: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher forcing without a cache. cond_emb [B, cls, dim], tokens [B, N] (all image tokens).
        Returns (logits [B, N, V] predicting tokens, features [B, cls+N-1, dim])."""
        B, N = tokens.shape
        cls = self.args.cls_token_num
        h = torch.cat([cond_emb, self.embed_tokens(tokens[:, :-1])], 1)
        T = h.shape[1]
        pos = torch.arange(T, device=h.device).expand(B, T)
        mask = causal_mask(T, cond_mask, h.device)
        feat = self.forward_embeds(h, pos, mask)
        return self.logits(feat[:, cls - 1:]), feat


def causal_mask(T: int, cond_mask: Optional[torch.Tensor], device) -> torch.Tensor:
    """[B or 1, T, T] causal mask; padded condition columns hidden; every row sees itself."""
    m = torch.ones(T, T, dtype=torch.bool, device=device).tril()[None]
    if cond_mask is not None:
        cols = torch.ones(cond_mask.shape[0], T, dtype=torch.bool, device=device)
        cols[:, : cond_mask.shape[1]] = cond_mask
        m = (m & cols[:, None, :]) | torch.eye(T, dtype=torch.bool, device=device)[None]
    return m
