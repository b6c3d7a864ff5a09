"""LlamaGen VQ tokenizer (VQ-16 architecture), weight-compatible, with widths from config.

Encoder: conv_in, per level `num_res_blocks` ResnetBlocks (+ AttnBlocks on the last level) and a
stride-2 downsample, mid (res, attn, res), GroupNorm, swish, conv_out -> quant_conv -> codebook of
l2-normalised codes. The decoder mirrors it. `decode_code(idx, shape=[B, C, h, w])` returns [-1, 1].
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class VQArgs:
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    codebook_l2_norm: bool = True
    ch: int = 128
    ch_mult: list = field(default_factory=lambda: [1, 1, 2, 2, 4])
    z_channels: int = 256
    num_res_blocks: int = 2
    norm_groups: int = 32
    commit_loss_beta: float = 0.25

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def to_dict(self) -> dict:
        return asdict(self)


def swish(x):
    return x * torch.sigmoid(x)


class ResnetBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=1e-6)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.norm2 = nn.GroupNorm(groups, cout, eps=1e-6)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.nin_shortcut = nn.Conv2d(cin, cout, 1) if cin != cout else None

    def forward(self, x):
        h = self.conv2(swish(self.norm2(self.conv1(swish(self.norm1(x))))))
        return (x if self.nin_shortcut is None else self.nin_shortcut(x)) + h


class AttnBlock(nn.Module):
    def __init__(self, c: int, groups: int):
        super().__init__()
        self.norm = nn.GroupNorm(groups, c, eps=1e-6)
        self.q, self.k, self.v, self.proj_out = (nn.Conv2d(c, c, 1) for _ in range(4))

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q, k, v = (m(h).reshape(B, C, H * W).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, C, H, W)
        return x + self.proj_out(y)


class Downsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, stride=2)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.conv = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


def _mid(c: int, g: int) -> nn.ModuleList:
    return nn.ModuleList([ResnetBlock(c, c, g), AttnBlock(c, g), ResnetBlock(c, c, g)])


def _run_level(block: nn.Module, h):
    for i, res in enumerate(block.res):
        h = res(h)
        if len(block.attn):
            h = block.attn[i](h)
    return h


class Encoder(nn.Module):
    def __init__(self, a: VQArgs):
        super().__init__()
        g, n = a.norm_groups, len(a.ch_mult)
        self.conv_in = nn.Conv2d(3, a.ch, 3, padding=1)
        self.conv_blocks = nn.ModuleList()
        cin = a.ch
        for level, mult in enumerate(a.ch_mult):
            block, cout = nn.Module(), a.ch * mult
            block.res = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout, g) for i in range(a.num_res_blocks))
            block.attn = nn.ModuleList(AttnBlock(cout, g) for _ in range(a.num_res_blocks) if level == n - 1)
            if level != n - 1:
                block.downsample = Downsample(cout)
            self.conv_blocks.append(block)
            cin = cout
        self.mid = _mid(cin, g)
        self.norm_out = nn.GroupNorm(g, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, a.z_channels, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.conv_blocks:
            h = _run_level(block, h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for m in self.mid:
            h = m(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, a: VQArgs):
        super().__init__()
        g, n = a.norm_groups, len(a.ch_mult)
        cin = a.ch * a.ch_mult[-1]
        self.conv_in = nn.Conv2d(a.z_channels, cin, 3, padding=1)
        self.mid = _mid(cin, g)
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(n)):
            block, cout = nn.Module(), a.ch * a.ch_mult[level]
            block.res = nn.ModuleList(ResnetBlock(cin if i == 0 else cout, cout, g) for i in range(a.num_res_blocks + 1))
            block.attn = nn.ModuleList(AttnBlock(cout, g) for _ in range(a.num_res_blocks + 1) if level == n - 1)
            if level != 0:
                block.upsample = Upsample(cout)
            self.conv_blocks.append(block)
            cin = cout
        self.norm_out = nn.GroupNorm(g, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, 3, 3, padding=1)

    def forward(self, z):
        h = self.conv_in(z)
        for m in self.mid:
            h = m(h)
        for block in self.conv_blocks:
            h = _run_level(block, h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    def __init__(self, n_e: int, e_dim: int, l2_norm: bool):
        super().__init__()
        self.l2_norm = l2_norm
        self.embedding = nn.Embedding(n_e, e_dim)
        nn.init.uniform_(self.embedding.weight, -1.0 / n_e, 1.0 / n_e)

    def codebook(self) -> torch.Tensor:
        w = self.embedding.weight
        return F.normalize(w, dim=-1) if self.l2_norm else w

    def lookup(self, z: torch.Tensor) -> torch.Tensor:
        """z [..., C] -> nearest code indices [...], in fp32 even under autocast (ties must not flip)."""
        with torch.autocast(z.device.type, enabled=False):
            zf = F.normalize(z.float(), dim=-1) if self.l2_norm else z.float()
            e = self.codebook().float()
            d = zf.pow(2).sum(-1, keepdim=True) + e.pow(2).sum(-1) - 2 * zf @ e.t()
            return d.argmin(-1)

    def get_codebook_entry(self, idx: torch.Tensor, shape=None) -> torch.Tensor:
        z = self.codebook()[idx]
        if shape is not None:  # [B, C, h, w]
            z = z.reshape(shape[0], shape[2], shape[3], shape[1]).permute(0, 3, 1, 2).contiguous()
        return z


class VQModel(nn.Module):
    kind, Args = "vq", VQArgs

    def __init__(self, a: VQArgs):
        super().__init__()
        self.args = a
        self.encoder = Encoder(a)
        self.decoder = Decoder(a)
        self.quantize = VectorQuantizer(a.codebook_size, a.codebook_embed_dim, a.codebook_l2_norm)
        self.quant_conv = nn.Conv2d(a.z_channels, a.codebook_embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(a.codebook_embed_dim, a.z_channels, 1)

    def encode_pre(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> continuous latents [B, h, w, C] before quantisation."""
        return self.quant_conv(self.encoder(x)).permute(0, 2, 3, 1)

    @torch.no_grad()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Images [B, 3, H, W] in [-1, 1] -> code indices [B, h*w] (raster order)."""
        return self.quantize.lookup(self.encode_pre(x)).flatten(1)

    def decode(self, quant: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.post_quant_conv(quant))

    def decode_code(self, idx: torch.Tensor, shape) -> torch.Tensor:
        return self.decode(self.quantize.get_codebook_entry(idx, shape))

    def forward_train(self, x: torch.Tensor):
        """Straight-through VQ. Returns (reconstruction, codebook loss + commitment loss, indices)."""
        z = self.encode_pre(x)
        if self.args.codebook_l2_norm:
            z = F.normalize(z, dim=-1)
        idx = self.quantize.lookup(z)
        zq = self.quantize.codebook()[idx]
        loss = F.mse_loss(zq, z.detach()) + self.args.commit_loss_beta * F.mse_loss(z, zq.detach())
        zq = z + (zq - z).detach()
        return self.decode(zq.permute(0, 3, 1, 2)), loss, idx
