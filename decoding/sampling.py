"""Sampling shared by every engine: its parameters, CFG, the filtered target distribution, and the
per-prompt random streams, all on the model's device.

Vanilla decoding and speculative verification call the same `filtered_probs`, so "lossless" means
exactly "the distribution vanilla samples from" (docs/design.md, "Sampling").

Random numbers are counter-based: a uniform is a hash of (prompt seed, counters), e.g. (token
position, trial). Any number of draws per step stays reproducible, draws for B prompts are one batched
tensor op, and a prompt's image does not depend on its batch, its actor or the order of the job.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, fields, replace
from typing import Optional

import torch


@dataclass
class SamplingParams:
    """How a token is drawn from the target's logits. A field left None takes the model family's
    default (see `decoding.registry`): LlamaGen c2i and t2i, MAR and the shapes models differ."""
    cfg_scale: Optional[float] = None     # classifier-free guidance; 1 = off
    temperature: Optional[float] = None   # 0 = greedy
    top_k: Optional[int] = None           # 0 = off
    top_p: Optional[float] = None         # 1 = off

    def __post_init__(self):
        checks = {"temperature": (lambda v: 0 <= v < math.inf, "must be a finite number >= 0 (0 = greedy)"),
                  "top_k": (lambda v: v >= 0 and float(v).is_integer(), "must be a whole number >= 0 (0 = off)"),
                  "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
                  "cfg_scale": (lambda v: 0 <= v < math.inf, "must be a finite number >= 0 (1 = no guidance)")}
        for name, (ok, rule) in checks.items():
            v = getattr(self, name)
            if v is not None and not ok(v):
                raise ValueError(f"engine.sampling.{name}={v}: {rule}")

    def over(self, base: "SamplingParams") -> "SamplingParams":
        """These settings on top of `base` (the model family's defaults): every field set."""
        out = replace(base, **{f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None})
        unset = [f.name for f in fields(out) if getattr(out, f.name) is None]
        if unset:
            raise ValueError(f"engine.sampling.{unset[0]} is not set and the model has no default for it")
        return out

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale != 1.0


NEUTRAL = SamplingParams(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0)  # plain softmax, no guidance


def cfg_combine(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Rows are [cond; uncond] when CFG is on: uncond + (cond - uncond) * scale."""
    if not p.use_cfg:
        return logits
    cond, uncond = logits.chunk(2, dim=0)
    return uncond + (cond - uncond) * p.cfg_scale


def filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """CFG-combined logits [..., V] -> the distribution to sample from (temperature, top-k, top-p), fp32.
    The row's maximum is subtracted before dividing by the temperature, so a tiny temperature gives the
    top token(s) all the mass instead of inf - inf = NaN."""
    logits = logits.float()
    if p.temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = (logits - logits.amax(-1, keepdim=True)) / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = logits.topk(p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        drop_sorted = sorted_probs.cumsum(-1) - sorted_probs > p.top_p  # keep the token that crosses top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


SPARSE = 4          # race only the tokens some row can draw where they are at most 1/SPARSE of the vocabulary,
SPARSE_FROM = 4096  # in vocabularies this large: below, the race over all costs about what finding them does


def sample(probs: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """An exponential race (the Gumbel-max trick): probs [..., V] (unnormalised is fine), key [...] one
    draw's random bits (`Streams.bits`) -> token ids [...]. Each token v gets E_v = -log U_v, U_v uniform
    from the hash of (key, v), and the draw is argmax_v p_v / E_v: of independent Exp(1) times, the one
    that wins scaled by 1/p falls on v with probability p_v / Σp. E_v lies in [1.2e-10, 16.7]
    (`exponential`), so a token of zero mass scores exactly 0 and one of any normal-float mass scores above
    0: a zero-mass token is never drawn. A row of no mass at all (an empty slot of a continuous batch)
    gives a valid id to ignore.

    Why a race and not the inverse CDF: the same key draws the same token from two nearby distributions
    far more often, whatever the order of the vocabulary. A tree engine's chain step (engines/tree.py)
    drafts the target's draws made after a prefix that may since have changed, and they are accepted
    when the new draw, with the same key, agrees: on the shapes model at batch 1, 4.42 -> 4.95 tokens a
    chain step, 2.23-2.33x -> 2.56-2.67x vanilla (docs/design.md, "Chains and Jacobi windows").

    Only tokens of mass can win, so where the tokens any row can draw are at most 1/SPARSE of a large
    vocabulary (top-k, top-p, one-hot rows) only those race: the same token, each with the same E_v and
    ties to the lowest id, for a fraction of the hashing (a race at V = 16,384 hashes [rows, V]).
    A NaN mass counts as mass, so that it shows up in the draw as it would in the full race."""
    V = probs.shape[-1]
    if V >= SPARSE_FROM and probs.numel() and not bool(probs.min() > 0):    # zeros (or a NaN) somewhere
        cols = (probs.reshape(-1, V).amax(0) != 0).nonzero()[:, 0]           # ascending ids some row can draw
        if len(cols) * SPARSE <= V:
            return _race_among(probs, key, cols)
    e = exponential(pcg_hash(key[..., None] ^ torch.arange(V, device=probs.device)))
    return (probs / e).argmax(-1)


def _race_among(probs: torch.Tensor, key: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """`sample`'s race over the tokens cols [C] (ascending) only; a row of no mass draws 0."""
    if len(cols) == 0:
        return torch.zeros(key.shape, dtype=torch.long, device=probs.device)
    e = exponential(pcg_hash(key[..., None] ^ cols))
    won = cols[(probs.index_select(-1, cols) / e).argmax(-1)]
    return torch.where(probs.amax(-1) != 0, won, 0)                    # an empty row: 0, as in the full race


# -- counter-based random streams ---------------------------------------------------------------------
_M32 = 0xFFFFFFFF


def unit(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes [...] -> float32 uniforms (k + 1/2) 2^-23 with k = h >> 9, the top 23 bits. Each value
    has at most 24 significant bits, so it is exact in float32: u lies in [2^-24, 1 - 2^-24], never 0 or 1,
    and log(u), log(1 - u) and -log(u) > 0 are finite. (On a 2^-24 grid the top value rounds to 1.0 in
    float32.) Use them in float32 or wider: bf16 and fp16 round values near 1 up to 1."""
    return ((h >> 9).float() + 0.5) * (1.0 / 2**23)


def exponential(h: torch.Tensor) -> torch.Tensor:
    """32-bit hashes [...] -> float32 Exp(1) times E = -log(1 - w), w = (h + 1/2) 2^-32 capped at 1 - 2^-24:
    E in [1.2e-10, 16.7], positive and finite. w is exact where E is small (h < 2^23: where a race is won)
    and has float32's relative precision elsewhere, so two tokens tie for a win with probability ~2^-24;
    -log(u) of a uniform on a grid near 1 would tie one draw in ~2^23 / V (0.2% at V = 16,384), and a
    tie goes to the lower token id."""
    w = h.float().add_(0.5).mul_(1.0 / 2**32).clamp_(max=1 - 2**-24)       # in place: [rows, V] at V = 16,384
    return w.neg_().log1p_().neg_()


def pcg_hash(x: torch.Tensor) -> torch.Tensor:
    """PCG output permutation of 32-bit values held in int64 (Jarzynski & Olano 2020, "pcg_hash").
    The multipliers are below 2^30, so no product leaves int64: the same bits on every device. In place
    after the first product: a race hashes [rows, V] values per draw, and each fresh [rows, V] int64
    tensor is an allocation and another pass over memory (docs/measurements.md, 2026-12-07)."""
    s = (x * 747796405).add_(2891336453).bitwise_and_(_M32)
    w = (s >> (s >> 28).add_(4)).bitwise_xor_(s).mul_(277803737).bitwise_and_(_M32)
    return (w >> 22).bitwise_xor_(w)


def prompt_seed(global_seed: int, prompt_id: str) -> int:
    """A prompt's seed: a function of the job's seed and the prompt's id only."""
    digest = hashlib.blake2b(f"{global_seed}:{prompt_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


class Streams:
    """One random stream per prompt (row), addressed by integer counters.

    `uniform(c1, c2, ...)` -> float32 tensor in (0, 1) whose leading dimension is the rows; each counter
    is an int or an int tensor broadcastable to [rows, ...]. Counters below 2^32; the same counters
    give the same number, different counters independent ones. Engines name their counters by purpose
    (the first counter), then e.g. token position and trial (docs/design.md, "Random streams").
    """

    def __init__(self, seeds, device):
        self.device = device
        self.key = self._keys(seeds)                      # [B]

    def _keys(self, seeds) -> torch.Tensor:
        s = torch.as_tensor([int(x) for x in seeds], dtype=torch.int64, device=self.device)
        return pcg_hash(pcg_hash(s & _M32) ^ (s >> 32))

    def reseed(self, rows: torch.Tensor, seeds) -> None:
        """Give rows [k] the streams of new prompts (a slot of a continuous batch takes a new prompt)."""
        self.key[rows] = self._keys(seeds)

    def copy_rows(self, old: "Streams", dst: torch.Tensor, src: torch.Tensor) -> None:
        """Rows dst continue old's rows src (an engine regrouped its batch)."""
        self.key[dst] = old.key[src]

    def __len__(self) -> int:
        return len(self.key)

    def select(self, rows: torch.Tensor) -> "Streams":
        """The streams of rows [k] alone (the same numbers as these rows draw here)."""
        out = Streams.__new__(Streams)
        out.device, out.key = self.device, self.key[rows]
        return out

    def bits(self, *counters) -> torch.Tensor:
        h = self.key
        for c in counters:
            c = torch.as_tensor(c, dtype=torch.int64, device=self.device)
            h = h.reshape(h.shape + (1,) * max(c.dim() - h.dim(), 0))
            h = pcg_hash(h ^ (c & _M32))
        return pcg_hash(h)

    def uniform(self, *counters) -> torch.Tensor:
        """float32 uniforms strictly inside (0, 1) (`unit`), so log(u) is finite and u < 1 passes any test
        u < r with r >= 1."""
        return unit(self.bits(*counters))

    def normal(self, *counters) -> torch.Tensor:
        """Standard normals by Box-Muller from two uniforms of the same counters (lanes 0 and 1 of a
        last counter added here)."""
        u1, u2 = (self.uniform(*counters, lane) for lane in (0, 1))
        return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos(2 * torch.pi * u2)


# Purposes: the first counter of every draw, so that streams used for different things never meet.
SAMPLE, ACCEPT, JACOBI, GUMBEL, NOISE = range(1, 6)
