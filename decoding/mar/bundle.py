"""A continuous-token bundle: KL VAE + MAR target (+ draft MAR, + caption encoder), on one device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from decoding.bundle import cast, pick_dtype
from decoding.models.mar import MAR
from decoding.models.packed import pack_linears
from decoding.models.text import TextEncoder
from decoding.models.vae import AutoencoderKL
from decoding.sampling import NEUTRAL, SamplingParams


@dataclass
class MarConditions:
    """Per prompt: class ids [B] (class-conditional MAR), or caption features [B, L, dim] and mask [B, L]."""
    labels: Optional[torch.Tensor] = None
    features: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None
    unknown_words: Optional[list] = None

    def __len__(self) -> int:
        return len(self.labels if self.labels is not None else self.features)

    def split(self) -> list["MarConditions"]:
        """One MarConditions per prompt."""
        one = lambda t, b: None if t is None else t[b:b + 1]  # noqa: E731
        return [MarConditions(one(self.labels, b), one(self.features, b), one(self.mask, b),
                              list((self.unknown_words or [0] * len(self))[b:b + 1])) for b in range(len(self))]

    @staticmethod
    def cat(parts: list["MarConditions"]) -> "MarConditions":
        both = lambda name: None if getattr(parts[0], name) is None else torch.cat([getattr(c, name) for c in parts])  # noqa: E731
        return MarConditions(both("labels"), both("features"), both("mask"),
                             [w for c in parts for w in (c.unknown_words or [0] * len(c))])


DRAFT_SHARES = ("seq_len", "token_dim", "cond", "buffer_size", "caption_dim", "class_num", "num_sampling_steps")


def check_parts(target: MAR, draft: Optional[MAR], vae_channels: int, names=("the MAR", "the draft MAR", "the VAE")) -> None:
    """What the parts must share (on skeletons too: the driver checks headers): the draft the target's tokens,
    condition and sampler; the VAE the tokens' channels. `names` say which setting each part came from."""
    if draft is not None:
        for key in DRAFT_SHARES:
            if getattr(draft.args, key) != getattr(target.args, key):
                raise ValueError(f"{names[1]}: its {key} ({getattr(draft.args, key)}) differs from the target's "
                                 f"({getattr(target.args, key)}): a draft must share the target's tokens and condition")
        for key in ("num_sampling_steps", "clip_x0"):   # the sampler as run (model.* may override the args)
            if getattr(draft.diffloss, key) != getattr(target.diffloss, key):
                raise ValueError(f"{names[1]}: its diffusion sampler has {key}={getattr(draft.diffloss, key)} and the "
                                 f"target's {getattr(target.diffloss, key)}: aligned trajectories need the same sampler")
    if target.args.token_dim != vae_channels:
        raise ValueError(f"{names[2]}: it makes {vae_channels}-channel latents and {names[0]} reads "
                         f"{target.args.token_dim}-channel tokens: give the VAE the MAR was trained on "
                         f"(kl16.ckpt for the released MARs)")


class MarBundle:
    """`tokens = "continuous"`: the engines `mar` and `cspd` take it, the discrete ones refuse it."""
    tokens = "continuous"

    def __init__(self, name: str, vae: AutoencoderKL, mar: MAR, draft: Optional[MAR] = None,
                 text: Optional[TextEncoder] = None, device="cpu", dtype: str = "auto",
                 sampling: SamplingParams = NEUTRAL):
        self.name, self.sampling = name, sampling
        self.device = torch.device(device)
        self.dtype = pick_dtype(dtype, self.device)
        check_parts(mar, draft, vae.args.embed_dim)
        self.vae, self.text = (m.to(self.device).eval() if m is not None else None for m in (vae, text))
        # The transformers run in `dtype`; on a CPU the diffusion head stays fp32 (its inputs are a few rows:
        # bf16 buys nothing there and costs precision in the σ that cspd's acceptance reads).
        self.mar, self.draft = (self._place(m) if m is not None else None for m in (mar, draft))
        self.grid = mar.args.seq_h
        self.image_size = self.grid * mar.args.patch_size * vae.args.downsample

    def _place(self, m: MAR) -> MAR:
        m = cast(m.to(self.device), self.dtype).eval()
        if self.device.type == "cpu":
            m.diffloss.float()
        return pack_linears(m)

    def conditions(self, prompts: list) -> MarConditions:
        if self.text is not None:
            for p in prompts:
                if not isinstance(p, str) or not p.strip():
                    raise ValueError(f"prompt {p!r} is empty or not text")
            feats, mask, unknown = self.text.encode(prompts)
            return MarConditions(features=feats, mask=mask, unknown_words=unknown)
        n = self.mar.args.class_num
        labels = []
        for p in prompts:
            s = str(p).strip()
            if not s.lstrip("-").isdigit() or not 0 <= int(s) < n:
                raise ValueError(f"prompt {p!r}: model {self.name!r} is class-conditional: give class ids 0..{n - 1}")
            labels.append(int(s))
        return MarConditions(labels=torch.tensor(labels, device=self.device), unknown_words=[0] * len(labels))

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor) -> np.ndarray:
        """Tokens [B, N, C] (scaled latents, raster order) -> uint8 images [B, H, W, 3], one image at a time
        (convolution numerics depend on the batch size; an image's bytes must not)."""
        latents = self.mar.unpatchify(tokens.float()) / self.vae.args.scale
        x = torch.cat([self.vae.decode(z[None].to(self.device)).float() for z in latents])
        return ((x.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1).cpu().numpy()
