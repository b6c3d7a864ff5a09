"""Speculative acceptance for continuous tokens (CSpD, docs/design.md "Continuous engines"): the per-token
log acceptance ratio and the acceptance-rejection sampler of the residual, on the device, in log space.

Each model's distribution for a token is summarised by its diffusion sampler (decoding/models/diffloss.py)
along the aligned trajectory (the same x_T and ε_t for both): the final-step Gaussian N(μ_0, σ_0²) (σ_0
with temperature) and L = Σ_{t≥1} log σ_t per dimension. The draft proposes x = μ_q0 + σ_q0 ε_0, a draw
of its final Gaussian (ε_0: the step-0 noise of that position, which the sampler itself does not use), and

    log r = Σ_d [log σ_q0 − log σ_p0] + τ Σ_d (L_p − L_q) − ½ Σ_d ((x − μ_p0) / (λ σ_p0))² + ½ Σ_d ((x − μ_q0) / (λ σ_q0))²

and the draft is accepted when log u < log r. λ (CSpD's "inner temperature", 42 there) widens both kernels
and τ = 1 adds the reference's trajectory term: both are relaxations. With λ = 1 and τ = 0, log r is the
log density ratio of the two final Gaussians given the shared trajectory noise, and with the residual
below a token is an exact draw of the target's final Gaussian N(μ_p0, σ_p0²) (tests/test_cspd.py checks
it through the engine). The reference multiplies the raw densities, which overflow or vanish over 16
dimensions and 99 steps; sums of logs do not.

A rejected token is redrawn from the residual ∝ max(0, p − c·q), c = exp(τ Σ_d (L_q − L_p)), by
acceptance-rejection with proposal p: max(0, p − c·q) ≤ M·p with M = 1, so a proposal x ~ p is kept with
probability max(0, 1 − c·q(x)/p(x)). Tries are bounded; a token whose tries all fail is reported (`ok`
False) so the caller can fall back explicitly.
"""
from __future__ import annotations

import math

import torch

LOG_2PI = math.log(2 * math.pi)


def gaussian_logpdf(x: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """log N(x; μ, diag σ²), summed over the last dimension."""
    return (-0.5 * ((x - mu) / sigma).pow(2) - torch.log(sigma) - 0.5 * LOG_2PI).sum(-1)


def log_accept_ratio(x: torch.Tensor, mu_q, sigma_q, L_q, mu_p, sigma_p, L_p, lam: float,
                     tau: float = 1.0) -> torch.Tensor:
    """[..., D] tensors -> log r [...] (see the module docstring; tau weighs the trajectory term)."""
    return (torch.log(sigma_q) - torch.log(sigma_p) + tau * (L_p - L_q)).sum(-1) \
        - 0.5 * ((x - mu_p) / (lam * sigma_p)).pow(2).sum(-1) + 0.5 * ((x - mu_q) / (lam * sigma_q)).pow(2).sum(-1)


def residual_sample(mu_p, sigma_p, mu_q, sigma_q, log_c, normals: torch.Tensor, uniforms: torch.Tensor,
                    bound: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw from ∝ max(0, p − c·q) by acceptance-rejection with proposal p, all tries at once.

    mu_*, sigma_*: [..., D]; log_c: [...]; normals: [..., T, D] and uniforms [..., T], one per try.
    Returns (x [..., D]: the first accepted proposal, ok [...]: whether any try was accepted; where none
    was, x is μ_p and the caller decides). `bound` is the envelope M (max(0, p − c·q) ≤ M·p): 1 is right;
    a smaller one clips the acceptance probability and draws from the wrong distribution (the tests show it)."""
    x = mu_p[..., None, :] + sigma_p[..., None, :] * normals                                  # [..., T, D]
    log_ratio = log_c[..., None] + gaussian_logpdf(x, mu_q[..., None, :], sigma_q[..., None, :]) \
        - gaussian_logpdf(x, mu_p[..., None, :], sigma_p[..., None, :])                       # log(c q / p)
    # accept iff u < (1 - c q / p) / M, i.e. log u + log M < log(1 - exp(log_ratio)) (never where c q >= p)
    log_keep = torch.where(log_ratio < 0, torch.log(-torch.expm1(log_ratio.clamp(max=-1e-30))),
                           torch.full_like(log_ratio, -math.inf))
    accept = torch.log(uniforms) + math.log(bound) < log_keep                                  # [..., T]
    ok = accept.any(-1)
    first = accept.float().argmax(-1)                                                         # the first accepted try
    pick = x.gather(-2, first[..., None, None].expand(*first.shape, 1, x.shape[-1])).squeeze(-2)
    return torch.where(ok[..., None], pick, mu_p), ok
