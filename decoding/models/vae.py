"""KL autoencoder in the LDM layout (the KL-16 tokenizer of LTH14/mar), weight-compatible, widths from config.

Encoder: conv_in, per level `num_res_blocks` ResnetBlocks (+ AttnBlocks at the resolutions listed in
`enc_attn_resolutions`) and a stride-2 downsample (all but the last level), mid (res, attn, res),
GroupNorm, swish, conv_out to 2 * embed_dim moments -> quant_conv. The decoder mirrors it with
`num_res_blocks + 1` blocks per level. Keys: `encoder.down.{i}.block.{j}`, `encoder.down.{i}.attn.{j}`,
`encoder.down.{i}.downsample.conv`, `encoder.mid.{block_1,attn_1,block_2}`, `decoder.up.{i}...`,
`quant_conv`, `post_quant_conv` (docs/design.md, "Continuous models").

The building blocks are the VQ tokenizer's (decoding/models/vq.py): LlamaGen took them from LDM too,
with the same parameter names. MAR scales latents by `scale` (0.2325 for KL-16) outside the VAE:
tokens = scale * z, and z = tokens / scale before decoding.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn

from decoding.models.vq import AttnBlock, Downsample, ResnetBlock, Upsample, swish


@dataclass
class VAEArgs:
    embed_dim: int = 16                 # latent channels (MAR's vae_embed_dim)
    ch: int = 128
    ch_mult: list = field(default_factory=lambda: [1, 1, 2, 2, 4])
    num_res_blocks: int = 2
    resolution: int = 256               # image side: decides which level an attn resolution names
    enc_attn_resolutions: list = field(default_factory=lambda: [16])
    dec_attn_resolutions: list = field(default_factory=list)   # MAR's AutoencoderKL: none in the decoder
    norm_groups: int = 32
    scale: float = 0.2325               # MAR token = scale * latent

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)

    def to_dict(self) -> dict:
        return asdict(self)


class _Level(nn.Module):
    def __init__(self, blocks, attn):
        super().__init__()
        self.block, self.attn = nn.ModuleList(blocks), nn.ModuleList(attn)

    def forward(self, h):
        for i, b in enumerate(self.block):
            h = b(h)
            if len(self.attn):
                h = self.attn[i](h)
        return h


class _Mid(nn.Module):
    def __init__(self, c: int, g: int):
        super().__init__()
        self.block_1, self.attn_1, self.block_2 = ResnetBlock(c, c, g), AttnBlock(c, g), ResnetBlock(c, c, g)

    def forward(self, h):
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    def __init__(self, a: VAEArgs):
        super().__init__()
        g, n = a.norm_groups, len(a.ch_mult)
        self.conv_in = nn.Conv2d(3, a.ch, 3, padding=1)
        self.down = nn.ModuleList()
        cin, res = a.ch, a.resolution
        for level, mult in enumerate(a.ch_mult):
            cout = a.ch * mult
            blocks = [ResnetBlock(cin if i == 0 else cout, cout, g) for i in range(a.num_res_blocks)]
            attn = [AttnBlock(cout, g) for _ in blocks] if res in a.enc_attn_resolutions else []
            lvl = _Level(blocks, attn)
            if level != n - 1:
                lvl.downsample = Downsample(cout)
                res //= 2
            self.down.append(lvl)
            cin = cout
        self.mid = _Mid(cin, g)
        self.norm_out = nn.GroupNorm(g, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, 2 * a.embed_dim, 3, padding=1)

    def forward(self, x):
        h = self.conv_in(x)
        for lvl in self.down:
            h = lvl(h)
            if hasattr(lvl, "downsample"):
                h = lvl.downsample(h)
        return self.conv_out(swish(self.norm_out(self.mid(h))))


class Decoder(nn.Module):
    def __init__(self, a: VAEArgs):
        super().__init__()
        g, n = a.norm_groups, len(a.ch_mult)
        cin, res = a.ch * a.ch_mult[-1], a.resolution // a.downsample
        self.conv_in = nn.Conv2d(a.embed_dim, cin, 3, padding=1)
        self.mid = _Mid(cin, g)
        up = []
        for level in reversed(range(n)):
            cout = a.ch * a.ch_mult[level]
            blocks = [ResnetBlock(cin if i == 0 else cout, cout, g) for i in range(a.num_res_blocks + 1)]
            attn = [AttnBlock(cout, g) for _ in blocks] if res in a.dec_attn_resolutions else []
            lvl = _Level(blocks, attn)
            if level != 0:
                lvl.upsample = Upsample(cout)
                res *= 2
            up.insert(0, lvl)   # up[i] is level i, as in LDM
            cin = cout
        self.up = nn.ModuleList(up)
        self.norm_out = nn.GroupNorm(g, cin, eps=1e-6)
        self.conv_out = nn.Conv2d(cin, 3, 3, padding=1)

    def forward(self, z):
        h = self.mid(self.conv_in(z))
        for lvl in reversed(self.up):
            h = lvl(h)
            if hasattr(lvl, "upsample"):
                h = lvl.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class AutoencoderKL(nn.Module):
    kind, Args = "kl_vae", VAEArgs

    def __init__(self, a: VAEArgs):
        super().__init__()
        self.args = a
        self.encoder, self.decoder = Encoder(a), Decoder(a)
        self.quant_conv = nn.Conv2d(2 * a.embed_dim, 2 * a.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(a.embed_dim, a.embed_dim, 1)

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Images [B, 3, H, W] in [-1, 1] -> posterior (mean, logvar), each [B, embed_dim, h, w];
        logvar clamped to [-30, 20] as LDM's DiagonalGaussianDistribution does."""
        mean, logvar = self.quant_conv(self.encoder(x)).chunk(2, dim=1)
        return mean, logvar.clamp(-30.0, 20.0)

    def decode(self, z: torch.Tensor) -> torch.Tensor:
        """Latents [B, embed_dim, h, w] (unscaled) -> images [B, 3, H, W], about [-1, 1]."""
        return self.decoder(self.post_quant_conv(z))

    @staticmethod
    def kl(mean: torch.Tensor, logvar: torch.Tensor) -> torch.Tensor:
        """KL(posterior || N(0, I)) per image, summed over latent elements."""
        return 0.5 * (mean.pow(2) + logvar.exp() - 1.0 - logvar).sum(dim=(1, 2, 3))
