"""Sampling on the device: the counter-based random streams, the inverse-CDF sampler, settings and their
defaults, and the pin that ties the bytes an image gets to decoding.BYTES_VERSION."""
from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from decoding import BYTES_VERSION
from decoding.engines import build_engine, engine_config
from decoding.sampling import NEUTRAL, SamplingParams, Streams, cfg_combine, filtered_probs, prompt_seed, sample
from tests.conftest import labels, tiny_bundle


def test_streams_are_reproducible_per_prompt_and_independent_of_the_batch():
    a = Streams([7, 8, 9], "cpu").uniform(1, torch.arange(50)[None])
    b = Streams([9], "cpu").uniform(1, torch.arange(50)[None])
    assert torch.equal(a[2], b[0])                               # same seed, same numbers, alone or not
    assert not torch.equal(a[0], a[1])
    assert torch.equal(Streams([7], "cpu").uniform(1, 3, 4), Streams([7], "cpu").uniform(1, 3, 4))
    assert not torch.equal(Streams([7], "cpu").uniform(1, 3, 4), Streams([7], "cpu").uniform(1, 4, 3))


def test_uniforms_are_uniform_and_neighbours_independent():
    """2D histogram of (u(pos), u(pos + 1)) over many prompts and positions: flat (chi-square)."""
    u = Streams(range(2000), "cpu").uniform(1, torch.arange(101)[None], 0)   # [2000, 101]
    assert 0 < u.min() and u.max() < 1
    x, y = u[:, :-1].flatten().numpy(), u[:, 1:].flatten().numpy()
    h, _, _ = np.histogram2d(x, y, bins=10, range=[[0, 1], [0, 1]])
    assert chisquare(h.ravel()).pvalue > 1e-3
    # and across the trial counter and across seeds
    t = Streams(range(20000), "cpu").uniform(2, 5, torch.arange(2)[None])
    h, _, _ = np.histogram2d(t[:, 0].numpy(), t[:, 1].numpy(), bins=10, range=[[0, 1], [0, 1]])
    assert chisquare(h.ravel()).pvalue > 1e-3


def test_normals_are_standard():
    z = Streams(range(4000), "cpu").normal(6, torch.arange(25)[None]).flatten()
    assert abs(float(z.mean())) < 0.02 and abs(float(z.std()) - 1) < 0.02
    assert abs(float((z > 1.96).float().mean()) - 0.025) < 0.004


def test_sample_follows_the_distribution_and_never_picks_zero_mass():
    p = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    keys = Streams(range(30000), "cpu").bits(1, 0)
    x = sample(p.expand(30000, -1), keys)
    counts = np.bincount(x.numpy(), minlength=6)
    assert counts[[0, 2, 5]].sum() == 0
    assert chisquare(counts[[1, 3, 4]], np.array([0.5, 0.2, 0.3]) * 30000).pvalue > 1e-3
    edge = sample(torch.tensor([0.0, 0.0, 1e-30, 0.0]).expand(3, -1), torch.tensor([0, 2**32 - 1, 12345]))
    assert edge.tolist() == [2, 2, 2]                            # any mass at all beats none


def test_the_same_key_draws_the_same_token_from_nearby_distributions():
    """Why the sampler is a race (sampling.sample): two distributions 0.064 apart in total variation,
    sampled with the same keys, agree on at least (1 - TV) / (1 + TV) of the draws whatever the order of
    the tokens (here 0.92); an inverse CDF with shared uniforms agreed on 0.60, as the moved mass lies
    across the vocabulary's order."""
    rng = np.random.default_rng(0)
    p = torch.from_numpy(rng.dirichlet(np.full(64, 0.3)).astype(np.float32))
    q = 0.9 * p + 0.1 * p[torch.from_numpy(rng.permutation(64))]
    keys = Streams(range(20000), "cpu").bits(1, 0)
    same = float((sample(p.expand(20000, -1), keys) == sample(q.expand(20000, -1), keys)).float().mean())
    tv = float((p - q).abs().sum() / 2)
    assert same >= (1 - tv) / (1 + tv) - 0.01, (same, tv)


def test_guidance_temperature_top_k_and_top_p_by_hand():
    """The distribution every engine samples from and verifies against, on numbers worked by hand (the
    engines' own tests compare engines with each other, so they share any error made here)."""
    p = SamplingParams(cfg_scale=2.0, temperature=1.0, top_k=3, top_p=0.9)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [1.0, 1.0, 1.0, 1.0]])         # rows [cond; uncond]
    combined = cfg_combine(logits, p)
    assert combined.tolist() == [[3.0, 1.0, -1.0, -3.0]]                         # uncond + 2 (cond - uncond)
    # top-k 3 drops -3; of softmax(3, 1, -1) = 0.867, 0.117, 0.016 top-p 0.9 keeps the first two (the
    # second crosses 0.9) and drops the third
    e = np.exp([3.0, 1.0])
    assert filtered_probs(combined, p)[0].tolist() == pytest.approx([*(e / e.sum()), 0.0, 0.0], abs=1e-6)
    # temperature 2 flattens before the filters: softmax(1.5, 0.5, -0.5) = 0.665, 0.245, 0.090; top-p 0.95
    # keeps all three (0.910 before the third)
    hot = SamplingParams(cfg_scale=2.0, temperature=2.0, top_k=3, top_p=0.95)
    e = np.exp([1.5, 0.5, -0.5])
    assert filtered_probs(combined, hot)[0].tolist() == pytest.approx([*(e / e.sum()), 0.0], abs=1e-6)
    e = np.exp([3.0, 1.0])                                                         # top-k 2 alone
    assert filtered_probs(combined, SamplingParams(cfg_scale=2.0, temperature=1.0, top_k=2, top_p=1.0))[0].tolist() \
        == pytest.approx([*(e / e.sum()), 0.0, 0.0], abs=1e-6)
    assert filtered_probs(combined, SamplingParams(cfg_scale=2.0, temperature=0.0, top_k=0, top_p=1.0))[0].tolist() \
        == [1.0, 0.0, 0.0, 0.0]                                                  # greedy


def test_settings_take_the_model_family_defaults_and_refuse_unknown_keys():
    assert SamplingParams(top_k=5).over(NEUTRAL) == SamplingParams(cfg_scale=1.0, temperature=1.0, top_k=5, top_p=1.0)
    with pytest.raises(ValueError, match="engine.sampling.temperature=-1"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"engine.d_max: engine 'eagle2' has no such setting"):
        engine_config("eagle2", d_max=4)
    with pytest.raises(ValueError, match="engine.acceptance: engine 'vanilla' has no such setting"):
        engine_config("vanilla", acceptance="lantern")
    from decoding.registry import family
    shapes = family("shapes")
    assert shapes.sampling.cfg_scale == 1.5                      # the shapes models' default, in one place
    assert engine_config("vanilla").sampling.cfg_scale is None   # the engine takes it from the model


def test_engines_report_their_acceptance():
    b = tiny_bundle()
    assert build_engine(b, engine_config("vanilla")).acceptance == "exact"
    assert build_engine(b, engine_config("eagle2")).acceptance == "exact"
    assert build_engine(b, engine_config("eagle2", acceptance="lantern", lantern_k=2)).acceptance == "lantern"


def test_prompt_seed_is_stable():
    assert prompt_seed(0, "a") == prompt_seed(0, "a") != prompt_seed(1, "a")
    assert prompt_seed(0, "shapes-0000") == 1775256821480558210


# The tokens a fixed tiny model gives for fixed seeds, per BYTES_VERSION. If this fails, the code now
# samples differently: bump decoding.BYTES_VERSION (old out_dirs must not be completed with new images)
# and record the new digest here.
GOLDEN = {2: "0c5c577f32e0", 3: "6a2abefb1dcf", 4: "a0e50d798697", 5: "b4b5b37e8be6", 6: "b4b5b37e8be6",
          7: "fbca3bc65bba"}  # 5 adds the Jacobi engines; 6 continuous only; 7 Jacobi only


def test_bytes_version_pins_the_sampled_tokens():
    b = tiny_bundle(vocab=8, grid=4, seed=1, std=0.3)
    sampling = dict(cfg_scale=2.0, temperature=0.9, top_k=6, top_p=0.95)
    h = hashlib.blake2b(digest_size=6)
    for name, kw in (("vanilla", {}), ("eagle2", dict(total_tokens=8, depth=3, width=3)),
                     ("adt_tree", dict(total_tokens=8, depth=2, width=2, d_min=1, d_max=4, w_min=1, w_max=3)),
                     ("sjd", dict(chain=4)), ("mc_sjd", dict(chain=4)), ("mc_sjd", dict(chain=4, coupling="gumbel"))):
        for r in build_engine(b, engine_config(name, sampling=sampling, **kw)).generate(labels(4), [1, 2, 3, 4]):
            h.update(r.tokens.astype(np.int64).tobytes())
    assert h.hexdigest() == GOLDEN.get(BYTES_VERSION), (
        f"tokens changed ({h.hexdigest()}): bump decoding.BYTES_VERSION and record the new digest in GOLDEN")
