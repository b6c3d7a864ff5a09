"""MAR's diffusion head (LTH14/mar `DiffLoss`), weight-compatible: a small MLP with adaLN that predicts, for
one continuous token, the noise ε and a learned variance interpolation, conditioned on the MAR decoder's
vector z for that token's position.

Training: 1000-step cosine schedule, loss = MSE on ε + the variational bound for the variance (IDDPM's
"learned range", the mean frozen in that term). Sampling: DDPM ancestral steps on a respaced schedule
(`num_sampling_steps`, 100 in MAR), temperature multiplies σ_t at every step but the last, which adds
no noise, so a token equals its last step's mean μ_0. CFG combines ε only: the variance comes from the
conditional branch, and both branches see the same x_t (docs/design.md, "Continuous models").

The sampler takes its noise from the caller: x_T and one ε per step for every token, so two models can
follow aligned trajectories (CSpD), and it returns what speculative acceptance needs: μ_0, σ_0 (with
temperature) and L = Σ_{t≥1} log σ_t per dimension (without it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

TRAIN_STEPS = 1000


# -- the noise schedule ---------------------------------------------------------------------------------
def cosine_betas(steps: int = TRAIN_STEPS, max_beta: float = 0.999) -> np.ndarray:
    """IDDPM cosine schedule: alpha_bar(t) = cos((t + 0.008) / 1.008 * pi / 2)^2, float64."""
    def ab(t):
        return math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
    return np.array([min(1 - ab((i + 1) / steps) / ab(i / steps), max_beta) for i in range(steps)])


def respaced_steps(num_steps: int, count: int) -> list[int]:
    """The kept timesteps of IDDPM's `space_timesteps(num_steps, str(count))` (one section): the stride
    is accumulated in floats and rounded, exactly as there."""
    if not 1 <= count <= num_steps:
        raise ValueError(f"num_sampling_steps={count}: must be in [1, {num_steps}]")
    stride = 1 if count <= 1 else (num_steps - 1) / (count - 1)
    kept, cur = [], 0.0
    for _ in range(count):
        kept.append(round(cur))
        cur += stride
    return sorted(set(kept))


class Schedule:
    """A (possibly respaced) DDPM chain: its betas and the constants of q and of the posterior, float64
    on the host, and `timestep_map`: the original-scale t the network sees at each respaced index."""

    def __init__(self, sampling_steps: int | None = None):
        base = cosine_betas()
        kept = list(range(TRAIN_STEPS)) if sampling_steps is None else respaced_steps(TRAIN_STEPS, sampling_steps)
        ac_base = np.cumprod(1.0 - base)
        ac = ac_base[kept]
        betas = 1.0 - ac / np.append(1.0, ac[:-1])
        self.timestep_map = np.array(kept)
        self.num_timesteps = len(kept)
        self.betas = betas
        self.ac = ac
        ac_prev = np.append(1.0, ac[:-1])
        self.sqrt_ac, self.sqrt_1m_ac = np.sqrt(ac), np.sqrt(1.0 - ac)
        self.sqrt_recip_ac, self.sqrt_recipm1_ac = np.sqrt(1.0 / ac), np.sqrt(1.0 / ac - 1)
        post_var = betas * (1.0 - ac_prev) / (1.0 - ac)
        self.post_logvar = np.log(np.append(post_var[1], post_var[1:])) if len(post_var) > 1 else np.log(betas)
        self.coef1 = betas * np.sqrt(ac_prev) / (1.0 - ac)
        self.coef2 = (1.0 - ac_prev) * np.sqrt(1.0 - betas) / (1.0 - ac)
        self.max_logvar = np.log(betas)


@lru_cache(maxsize=None)
def schedule(sampling_steps: int | None = None) -> Schedule:
    return Schedule(sampling_steps)


def extract(a: np.ndarray, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(a, dtype=torch.float32, device=t.device)[t].reshape(-1, *([1] * (like.dim() - 1)))


def normal_kl(m1, lv1, m2, lv2):
    return 0.5 * (-1.0 + lv2 - lv1 + torch.exp(lv1 - lv2) + (m1 - m2) ** 2 * torch.exp(-lv2))


def _approx_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


def discretized_gaussian_loglik(x, mean, log_scale):
    """IDDPM's decoder likelihood at t = 0 (bins of width 2/255, open-ended beyond ±0.999), nats."""
    c, inv = x - mean, torch.exp(-log_scale)
    cdf_plus, cdf_min = _approx_cdf(inv * (c + 1 / 255)), _approx_cdf(inv * (c - 1 / 255))
    return torch.where(x < -0.999, torch.log(cdf_plus.clamp(min=1e-12)),
                       torch.where(x > 0.999, torch.log((1 - cdf_min).clamp(min=1e-12)),
                                   torch.log((cdf_plus - cdf_min).clamp(min=1e-12))))


# -- the network (SimpleMLPAdaLN) -----------------------------------------------------------------------
def timestep_embedding(t: torch.Tensor, dim: int = 256, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding, [cos, sin] order as in MAR/DiT: t [N] -> [N, dim]."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t[:, None].float() * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class TimestepEmbedder(nn.Module):
    def __init__(self, width: int, freq_dim: int = 256):
        super().__init__()
        self.freq_dim = freq_dim
        self.mlp = nn.Sequential(nn.Linear(freq_dim, width), nn.SiLU(), nn.Linear(width, width))

    def forward(self, t):
        return self.mlp(timestep_embedding(t, self.freq_dim).to(self.mlp[0].weight.dtype))


class ResBlock(nn.Module):
    def __init__(self, w: int):
        super().__init__()
        self.in_ln = nn.LayerNorm(w, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 3 * w))

    def forward(self, x, y):
        return self.modulated(x, self.adaLN_modulation(y))

    def modulated(self, x, mod):
        shift, scale, gate = mod.chunk(3, dim=-1)
        return x + gate * self.mlp(self.in_ln(x) * (1 + scale) + shift)


class FinalLayer(nn.Module):
    def __init__(self, w: int, out: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(w, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(w, out)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(w, 2 * w))

    def forward(self, x, y):
        return self.modulated(x, self.adaLN_modulation(y))

    def modulated(self, x, mod):
        shift, scale = mod.chunk(2, dim=-1)
        return self.linear(self.norm_final(x) * (1 + scale) + shift)


class SimpleMLPAdaLN(nn.Module):
    """x [N, C], t [N] (original-scale timesteps), c [N, z_channels] -> [N, 2C] = [ε | variance values]."""

    def __init__(self, in_channels: int, width: int, z_channels: int, depth: int):
        super().__init__()
        self.in_channels = in_channels
        self.time_embed = TimestepEmbedder(width)
        self.cond_embed = nn.Linear(z_channels, width)
        self.input_proj = nn.Linear(in_channels, width)
        self.res_blocks = nn.ModuleList(ResBlock(width) for _ in range(depth))
        self.final_layer = FinalLayer(width, 2 * in_channels)
        self._init()

    def _init(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.time_embed.mlp[0].weight, std=0.02)
        nn.init.normal_(self.time_embed.mlp[2].weight, std=0.02)
        for lin in [b.adaLN_modulation[-1] for b in self.res_blocks] + [self.final_layer.adaLN_modulation[-1],
                                                                         self.final_layer.linear]:
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    def forward(self, x, t, c):
        return self.forward_y(x, self.time_embed(t) + self.cond_embed(c))

    def forward_y(self, x, y):
        """With y = time embedding + condition embedding given (the sampler builds it once per step).
        The same function as the blocks' own forward, with fewer kernel launches: the adaLN modulations of
        all blocks are one matmul (the 1 of `1 + scale` folded into its bias) and each modulation is one
        addcmul. A diffusion step is a few dozen tiny ops, so their count is its cost on a CPU."""
        h = self.input_proj(x)
        w, b = self._fused_adaln()
        mods = F.linear(F.silu(y), w, b).split(self._mod_sizes, dim=-1)
        for block, mod in zip(self.res_blocks, mods):
            shift, scale1, gate = mod.chunk(3, dim=-1)
            fc1, fc2 = block.mlp[0], block.mlp[2]
            a = torch.addcmul(shift, block.in_ln(h), scale1)
            h = torch.addcmul(h, gate, F.linear(F.silu(F.linear(a, fc1.weight, fc1.bias)), fc2.weight, fc2.bias))
        shift, scale1 = mods[-1].chunk(2, dim=-1)
        return self.final_layer.linear(torch.addcmul(shift, self.final_layer.norm_final(h), scale1))

    @property
    def _mod_sizes(self):
        return [b.adaLN_modulation[-1].out_features for b in self.res_blocks] + \
               [self.final_layer.adaLN_modulation[-1].out_features]

    def _fused_adaln(self):
        """All blocks' adaLN Linears stacked: (weight, bias with +1 on every `scale` chunk)."""
        lins = [b.adaLN_modulation[-1] for b in self.res_blocks] + [self.final_layer.adaLN_modulation[-1]]
        cached = not torch.is_grad_enabled()
        key = tuple((m.weight.data_ptr(), m.weight._version, m.bias._version, m.weight.dtype) for m in lins)
        if cached and getattr(self, "_fused_key", None) == key:
            return self._fused
        w = self.input_proj.out_features
        ones = torch.cat([torch.cat([torch.zeros(w), torch.ones(w), torch.zeros(n - 2 * w)]) for n in self._mod_sizes])
        fused = (torch.cat([m.weight for m in lins]),
                 torch.cat([m.bias for m in lins]) + ones.to(lins[0].bias.device, lins[0].bias.dtype))
        if cached:
            self._fused, self._fused_key = fused, key
        return fused


# -- the head: loss and sampler ------------------------------------------------------------------------
@dataclass
class HeadSample:
    """Per token [n, C]: the sample (= μ_0), σ_0 with temperature, L = Σ_{t≥1} log σ_t without it."""
    x: torch.Tensor
    sigma0: torch.Tensor
    log_sigma_sum: torch.Tensor


class DiffLoss(nn.Module):
    def __init__(self, target_channels: int, z_channels: int, depth: int, width: int, num_sampling_steps: int = 100):
        super().__init__()
        self.in_channels = target_channels
        self.num_sampling_steps = num_sampling_steps
        self.clip_x0: float | None = None   # sampling: clip the predicted x_0 to ±clip_x0 (IDDPM's clip_denoised; MAR: None)
        self.net = SimpleMLPAdaLN(target_channels, width, z_channels, depth)

    def loss(self, target: torch.Tensor, z: torch.Tensor, mask: torch.Tensor | None = None,
             generator: torch.Generator | None = None, last_step_prob: float = 0.0,
             teacher: tuple | None = None) -> torch.Tensor:
        """target [n, C], z [n, Dd], mask [n] (1 = counts): MSE on ε + the variational bound (bits).

        The head runs in fp32 whatever autocast says (its inputs are a few rows): sampling starts at
        t = T-1, where the cosine schedule's ᾱ is 2e-9 and the first step multiplies the error of ε by
        ~316 (100 sampling steps; more with fewer), so ε must be right to ~1e-3 there; bf16 gives 3 digits.
        `last_step_prob`: the fraction of rows trained at t = T-1 instead of a uniform t (MAR: 0). Any
        weighting over t has the same minimiser (the best ε per t); this one spends more of a short run
        where the sampler amplifies errors most.
        `teacher`: (head, z_teacher [n, Dd'], weight): add weight * the mean squared difference between this
        head's outputs (ε and variance values) and the teacher head's at the same x_t, t (distillation of a
        draft onto its target: CSpD accepts a token when the two agree)."""
        s = schedule(None)
        n = len(target)
        t = torch.randint(0, s.num_timesteps, (n,), device=target.device, generator=generator)
        if last_step_prob > 0:
            last = torch.rand(n, device=target.device, generator=generator) < last_step_prob
            t = torch.where(last, torch.full_like(t, s.num_timesteps - 1), t)
        target = target.float()
        noise = torch.randn(target.shape, device=target.device, generator=generator, dtype=target.dtype)
        x_t = extract(s.sqrt_ac, t, target) * target + extract(s.sqrt_1m_ac, t, target) * noise
        with torch.autocast(target.device.type, enabled=False):
            out = self.net(x_t, t, z.float())
            eps, v = out.split(self.in_channels, dim=1)
            mse = (eps - noise).pow(2).mean(1)
            # the variational bound trains the variance only (the mean is frozen in it)
            mean, logvar = self._mean_logvar(s, x_t, t, eps.detach(), v)
            true_mean = extract(s.coef1, t, target) * target + extract(s.coef2, t, target) * x_t
            kl = normal_kl(true_mean, extract(s.post_logvar, t, target), mean, logvar).mean(1) / math.log(2.0)
            nll = -discretized_gaussian_loglik(target, mean, 0.5 * logvar).mean(1) / math.log(2.0)
            loss = mse + torch.where(t == 0, nll, kl)
            if teacher is not None:
                head, z_t, weight = teacher
                with torch.no_grad():
                    ref = head.net(x_t, t, z_t.float())
                loss = loss + weight * (out - ref).pow(2).mean(1)
        if mask is None:
            return loss.mean()
        return (loss * mask).sum() / mask.sum().clamp(min=1)

    @staticmethod
    def _mean_logvar(s: Schedule, x_t, t, eps, v):
        frac = (v + 1) / 2
        logvar = frac * extract(s.max_logvar, t, x_t) + (1 - frac) * extract(s.post_logvar, t, x_t)
        x0 = extract(s.sqrt_recip_ac, t, x_t) * x_t - extract(s.sqrt_recipm1_ac, t, x_t) * eps
        return extract(s.coef1, t, x_t) * x0 + extract(s.coef2, t, x_t) * x_t, logvar

    @torch.no_grad()
    def sample(self, z: torch.Tensor, x_T: torch.Tensor, noise: torch.Tensor, temperature: float,
               cfg: torch.Tensor | None = None, steps: int | None = None) -> HeadSample:
        """Respaced DDPM sampling of n tokens with the caller's noise.

        z: [n, Dd] conditions, or [2n, Dd] = [cond; uncond] with `cfg` [n] (the guidance scale per token);
        x_T: [n, C]; noise: [n, S, C] (ε for respaced step i at [:, i]; step 0 adds none), S = `steps`
        (None: this head's num_sampling_steps). The state x_t stays fp32 whatever the weights' dtype.

        Per step i (IDDPM's p_sample with a learned range, in fewer ops): log σ_i² = lo_i + hi_i * v (the
        interpolation between log β̃_i and log β_i), μ_i = a_i x_t - b_i ε (the posterior mean of the
        predicted x_0), x_{t-1} = μ_i + σ_i * temperature * ε_i. With `clip_x0` set, the predicted x_0 is
        clipped to ±clip_x0 first (IDDPM's clip_denoised with a bound in token units): at t = 999 it is
        (x_T − √(1−ᾱ) ε̂)/√ᾱ with √ᾱ = 5e-5, so a small ε error there is a huge x_0 (docs/design.md)."""
        S = steps or self.num_sampling_steps
        k = _sampler_constants(S)
        t = torch.as_tensor(k["t"], device=x_T.device)
        C, n, dtype = self.in_channels, len(x_T), self.net.input_proj.weight.dtype
        c = self.net.cond_embed(z.to(dtype))                              # [n or 2n, w], once
        temb = self.net.time_embed(t)                                     # [S, w], once
        guided = cfg is not None
        scale = cfg[:, None].float() if guided else None
        x = x_T.float()
        noise = noise.float() * temperature
        L = torch.zeros_like(x)
        for i in range(S - 1, -1, -1):
            out = self.net.forward_y((torch.cat([x, x]) if guided else x).to(dtype), c + temb[i]).float()
            eps, v = out[:n, :C], out[:n, C:]                            # variance: the conditional branch
            if guided:
                eps = torch.lerp(out[n:, :C], eps, scale)                 # uncond + s (cond - uncond)
            logvar = v.mul(k["hi"][i]).add_(k["lo"][i])
            if self.clip_x0 is None:
                mean = torch.sub(x * k["a"][i], eps, alpha=k["b"][i])
            else:
                x0 = torch.sub(x * k["r1"][i], eps, alpha=k["r2"][i]).clamp_(-self.clip_x0, self.clip_x0)
                mean = torch.add(x * k["c2"][i], x0, alpha=k["c1"][i])
            sigma = torch.exp(0.5 * logvar)
            if i == 0:
                return HeadSample(mean, sigma * temperature, L)
            L.add_(logvar, alpha=0.5)
            x = torch.addcmul(mean, sigma, noise[:, i])
        raise AssertionError("unreachable")


@lru_cache(maxsize=16)
def _sampler_constants(steps: int) -> dict:
    """Per respaced step, as Python floats (no device tensors to index, no host syncs): the network's
    timestep t, lo/hi of log σ² = lo + hi * v, and a/b of the mean a * x_t - b * ε."""
    s = schedule(steps)
    mid, half = (s.max_logvar + s.post_logvar) / 2, (s.max_logvar - s.post_logvar) / 2
    return {"t": [int(v) for v in s.timestep_map], "lo": [float(v) for v in mid], "hi": [float(v) for v in half],
            "a": [float(v) for v in s.coef1 * s.sqrt_recip_ac + s.coef2],
            "b": [float(v) for v in s.coef1 * s.sqrt_recipm1_ac],
            # unfolded (clip_x0): x_0 = r1 x_t - r2 ε, mean = c1 x_0 + c2 x_t
            "r1": [float(v) for v in s.sqrt_recip_ac], "r2": [float(v) for v in s.sqrt_recipm1_ac],
            "c1": [float(v) for v in s.coef1], "c2": [float(v) for v in s.coef2]}
