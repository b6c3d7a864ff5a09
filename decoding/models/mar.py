"""MAR (LTH14/mar), weight-compatible: a bidirectional MAE-style encoder/decoder over a grid of continuous
tokens, and a diffusion head (decoding/models/diffloss.py) that samples each token from the decoder's
vector at its position.

Encoder input: `buffer_size` condition slots (the class embedding in every slot, or, for captions, one
projected word per slot) followed by the known tokens; masked tokens are dropped. The decoder puts
`mask_token` at every unknown position, and `diffusion_pos_embed_learned` is added to its outputs.
Keys as in MAR's checkpoints: `class_emb`, `fake_latent`, `z_proj`, `z_proj_ln`, `encoder_pos_embed_learned`,
`encoder_blocks.{i}` (timm Block: norm1, attn.qkv, attn.proj, norm2, mlp.fc1, mlp.fc2), `encoder_norm`,
`decoder_embed`, `mask_token`, `decoder_pos_embed_learned`, `decoder_blocks.{i}`, `decoder_norm`,
`diffusion_pos_embed_learned`, `diffloss.net.*`. Caption-conditioned models (ours) have `caption_proj`
instead of `class_emb`.

Known positions are given as indices [R, k] (every row knows the same number of tokens, as in MAR,
where one mask schedule serves the whole batch), so no step needs a host sync.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from decoding.models.diffloss import DiffLoss


@dataclass
class MARArgs:
    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    encoder_embed_dim: int = 1024
    encoder_depth: int = 16
    encoder_num_heads: int = 16
    decoder_embed_dim: int = 1024
    decoder_depth: int = 16
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    vae_embed_dim: int = 16
    mask_ratio_min: float = 0.7
    label_drop_prob: float = 0.1
    cond: str = "class"              # "class" (class_emb, MAR) | "caption" (caption_proj, one word per slot)
    class_num: int = 1000
    caption_dim: int = 0
    buffer_size: int = 64
    diffloss_d: int = 3
    diffloss_w: int = 1024
    num_sampling_steps: int = 100
    clip_x0: Optional[float] = None  # sampling: clip the head's predicted x_0 to ±clip_x0 (MAR: none; DiffLoss.sample)
    norm_eps: float = 1e-6           # MAR's presets: partial(nn.LayerNorm, eps=1e-6)

    @property
    def seq_h(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.seq_h ** 2

    @property
    def token_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size ** 2

    @classmethod
    def from_name(cls, name: str, **overrides) -> "MARArgs":
        if name not in MAR_PRESETS:
            raise ValueError(f"unknown MAR preset {name!r}; choose one of {sorted(MAR_PRESETS)}")
        return replace(cls(**MAR_PRESETS[name]), **overrides)

    def to_dict(self) -> dict:
        return asdict(self)


def _preset(dim, depth, heads, d, w):
    return dict(encoder_embed_dim=dim, encoder_depth=depth, encoder_num_heads=heads, decoder_embed_dim=dim,
                decoder_depth=depth, decoder_num_heads=heads, diffloss_d=d, diffloss_w=w)


# The diffusion heads of the released checkpoints (README / demo): B 6 x 1024, L 8 x 1280, H 12 x 1536.
MAR_PRESETS = {"mar_base": _preset(768, 12, 12, 6, 1024), "mar_large": _preset(1024, 16, 16, 8, 1280),
               "mar_huge": _preset(1280, 20, 16, 12, 1536)}


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, C))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """timm's ViT Block as MAR builds it: pre-norm, qkv bias, exact GELU, no layer scale."""

    def __init__(self, dim: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, heads)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MAR(nn.Module):
    kind, Args = "mar", MARArgs

    def __init__(self, a: MARArgs):
        super().__init__()
        if a.cond not in ("class", "caption"):
            raise ValueError(f"MAR cond={a.cond!r}: choose 'class' or 'caption'")
        self.args = a
        D, Dd, N, buf = a.encoder_embed_dim, a.decoder_embed_dim, a.seq_len, a.buffer_size
        if a.cond == "class":
            self.class_emb = nn.Embedding(a.class_num, D)
        else:
            self.caption_proj = nn.Linear(a.caption_dim, D)
        self.fake_latent = nn.Parameter(torch.zeros(1, D))
        self.z_proj = nn.Linear(a.token_dim, D)
        self.z_proj_ln = nn.LayerNorm(D, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, N + buf, D))
        self.encoder_blocks = nn.ModuleList(Block(D, a.encoder_num_heads, a.mlp_ratio, a.norm_eps)
                                            for _ in range(a.encoder_depth))
        self.encoder_norm = nn.LayerNorm(D, eps=a.norm_eps)
        self.decoder_embed = nn.Linear(D, Dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, Dd))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, N + buf, Dd))
        self.decoder_blocks = nn.ModuleList(Block(Dd, a.decoder_num_heads, a.mlp_ratio, a.norm_eps)
                                            for _ in range(a.decoder_depth))
        self.decoder_norm = nn.LayerNorm(Dd, eps=a.norm_eps)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, N, Dd))
        self._init()
        self.diffloss = DiffLoss(a.token_dim, Dd, a.diffloss_d, a.diffloss_w, a.num_sampling_steps)
        self.diffloss.clip_x0 = a.clip_x0

    def _init(self):
        """MAR's init: normal(0.02) embeddings, xavier-uniform Linears, unit LayerNorms (before the head,
        which keeps its own)."""
        for p in (self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        if hasattr(self, "class_emb"):
            nn.init.normal_(self.class_emb.weight, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # -- condition -----------------------------------------------------------------------------------
    def buffer(self, labels: Optional[torch.Tensor] = None, features: Optional[torch.Tensor] = None,
               mask: Optional[torch.Tensor] = None, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The condition slots [R, buffer_size, D]: a class embedding in every slot (MAR), or one caption
        word per slot (features [R, L, caption_dim], L = buffer_size, left-padded; padding slots hold
        `fake_latent`). Rows with drop [R] True get `fake_latent` everywhere: the unconditional branch."""
        a = self.args
        fake = self.fake_latent[:, None]                                          # [1, 1, D]
        if a.cond == "class":
            slots = self.class_emb(labels)[:, None].expand(-1, a.buffer_size, -1)
            keep = torch.ones(slots.shape[:2], dtype=torch.bool, device=slots.device)
        else:
            if features.shape[1] != a.buffer_size:
                raise ValueError(f"caption of {features.shape[1]} slots for a MAR with buffer_size={a.buffer_size}")
            slots = self.caption_proj(features.to(self.caption_proj.weight.dtype))
            keep = mask if mask is not None else torch.ones(slots.shape[:2], dtype=torch.bool, device=slots.device)
        if drop is not None:
            keep = keep & ~drop[:, None]
        return torch.where(keep[..., None], slots, fake.to(slots.dtype))

    # -- the transformer -----------------------------------------------------------------------------
    def encode(self, tokens: torch.Tensor, known: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        """tokens [R, N, C] (values at unknown positions are ignored), known [R, k] positions (sorted),
        buffer [R, buf, D] -> encoder output [R, buf + k, D]."""
        buf = self.args.buffer_size
        pos = self.encoder_pos_embed_learned[0]
        x = self.z_proj(tokens.gather(1, known[..., None].expand(-1, -1, tokens.shape[-1])).to(self.z_proj.weight.dtype))
        x = torch.cat([buffer.to(x.dtype) + pos[:buf], x + pos[buf + known]], dim=1)
        x = self.z_proj_ln(x)
        for blk in self.encoder_blocks:
            x = blk(x)
        return self.encoder_norm(x)

    def decode(self, h: torch.Tensor, known: torch.Tensor) -> torch.Tensor:
        """Encoder output [R, buf + k, D] -> diffusion conditions z [R, N, Dd] for every position."""
        buf, N = self.args.buffer_size, self.args.seq_len
        h = self.decoder_embed(h)
        R, Dd = h.shape[0], h.shape[-1]
        x = self.mask_token.to(h.dtype).expand(R, buf + N, Dd).clone()
        x[:, :buf] = h[:, :buf]
        x.scatter_(1, (buf + known)[..., None].expand(-1, -1, Dd), h[:, buf:])
        x = x + self.decoder_pos_embed_learned
        for blk in self.decoder_blocks:
            x = blk(x)
        return self.decoder_norm(x)[:, buf:] + self.diffusion_pos_embed_learned

    def forward_z(self, tokens: torch.Tensor, known: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
        return self.decode(self.encode(tokens, known, buffer), known)

    # -- training ------------------------------------------------------------------------------------
    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[B, C, h, w] -> [B, h*w/p², C*p²] tokens in raster order (MAR's patchify)."""
        B, C, H, W = latents.shape
        p = self.args.patch_size
        x = latents.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (H // p) * (W // p), C * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        B, p, h, C = tokens.shape[0], self.args.patch_size, self.args.seq_h, self.args.vae_embed_dim
        return tokens.reshape(B, h, h, C, p, p).permute(0, 3, 1, 4, 2, 5).reshape(B, C, h * p, h * p)

    def mask_ratio(self, generator: Optional[torch.Generator] = None) -> float:
        """MAR's masking ratio: a Gaussian (mean 1, std 0.25) truncated to [mask_ratio_min, 1]."""
        lo = self.args.mask_ratio_min
        cdf = lambda v: 0.5 * (1 + math.erf((v - 1.0) / 0.25 / math.sqrt(2)))  # noqa: E731
        u = torch.rand((), generator=generator).item()
        p = cdf(lo) + u * (cdf(1.0) - cdf(lo))
        return min(1.0, max(lo, 1.0 + 0.25 * math.sqrt(2) * torch.erfinv(torch.tensor(2 * p - 1)).item()))

    def loss(self, tokens: torch.Tensor, buffer: torch.Tensor, diffusion_batch_mul: int = 4,
             generator: Optional[torch.Generator] = None, last_step_prob: float = 0.0,
             teacher: Optional[tuple] = None, aux: Optional[tuple] = None) -> torch.Tensor:
        """tokens [B, N, C] (scaled latents), buffer [B, buf, D] (condition dropout already applied):
        random orders, one masking ratio per batch (MAR), diffusion loss on the masked tokens, each
        repeated `diffusion_batch_mul` times with its own timestep and noise. `last_step_prob`: see
        DiffLoss.loss. `teacher`: (MAR, its buffer, weight): the teacher sees the same known tokens and its
        head the same x_t and t; this model's head is pulled towards its outputs (DiffLoss.loss). `aux`: (probe, weight): add weight * the MSE of probe(z) against the masked tokens, a
        training-only regression that gives the transformer a direct signal of each token's expected value
        (the diffusion loss alone teaches where the object is slowly: its ε error is mostly noise)."""
        B, N, C = tokens.shape
        order = torch.rand(B, N, generator=generator).argsort(1).to(tokens.device)
        n_masked = math.ceil(N * self.mask_ratio(generator))
        known = order[:, n_masked:].sort(1).values
        masked = order[:, :n_masked]

        def conditions(model, buf):
            # the head runs on the masked tokens only (MAR runs it on all and zeroes the others' loss: the same loss)
            z = model.forward_z(tokens, known, buf)
            return z.gather(1, masked[..., None].expand(-1, -1, z.shape[-1])).reshape(B * n_masked, -1)

        z = conditions(self, buffer)
        target = tokens.gather(1, masked[..., None].expand(-1, -1, C)).reshape(B * n_masked, C)
        m = diffusion_batch_mul
        distill = None
        if teacher is not None:
            model, buf, weight = teacher
            with torch.no_grad():
                distill = (model.diffloss, conditions(model, buf).repeat(m, 1), weight)
        loss = self.diffloss.loss(target.repeat(m, 1), z.repeat(m, 1), generator=generator,
                                  last_step_prob=last_step_prob, teacher=distill)
        if aux is not None:
            probe, weight = aux
            loss = loss + weight * F.mse_loss(probe(z.float()), target.float())
        return loss
