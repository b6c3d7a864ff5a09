"""Public MAR checkpoints reproduce LTH14/mar's own sampler: a checkpoint-last.pth and a kl16.ckpt in the
public layout (tests/mar_layouts.py), loaded through model=mar as a user would (model.mar_ckpt,
model.vae_ckpt, model.num_heads), give with our `mar` engine the tokens and images that MAR.sample_tokens
and its AutoencoderKL gave for the same generation orders and noise (tests/fixtures/mar_reference.json,
made by tests/fixtures/make_mar_reference.py with the reference code; this test needs neither it nor timm).

The engine's randomness comes from two methods, `order` (each image's generation order) and `noise` (x_T
and the diffusion ε of the positions a step samples); here a subclass returns the fixture's instead of
the per-prompt streams' draws. Everything else is the engine as it runs: the loaders, the schedule, the
CFG rows and scale, the temperature, the diffusion sampler, and the VAE decode with MAR's latent scale.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from decoding.engines import engine_config
from decoding.engines.mar import Mar
from decoding.mar.checkpoints import HEADS_BY_WIDTH
from decoding.mar.family import MarConfig
from decoding.models.mar import MARArgs
from decoding.registry import load_bundle
from tests.fixtures.make_mar_reference import OUT as FIXTURE, RUNS, noise_tables, run_key
from tests.mar_layouts import NUM_HEADS, SAMPLING_STEPS, checksum, mar_weights, vae_weights, write_public

# fp32 rounding differs between any two implementations, and the sampler's first step (t = 999) multiplies
# the error of ε by ~670 (50 steps), CFG's ε_u + s (ε_c - ε_u) by a few more: observed up to 4.8e-6 without
# CFG and 1.2e-5 with it, for tokens of std ~0.4 (what each model setting changes moves them by > 1e-2).
ATOL = {False: 2e-5, True: 5e-5}


class ReplayMar(Mar):
    """The `mar` engine with given orders [B, N] and noise (x_T [B, N, C], ε [B, N, S, C]) by position."""

    def __init__(self, bundle, cfg, orders, x_T, eps):
        super().__init__(bundle, cfg)
        self.orders, self.x_T, self.eps = orders, x_T, eps

    def order(self, streams):
        return self.orders.to(self.device)

    def noise(self, streams, pos, steps):
        b = torch.arange(len(pos), device=pos.device)[:, None]
        return self.x_T[b, pos], self.eps[b, pos, :steps]


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def bundle(tmp_path_factory, fixture):
    """The bundle loaded from the public files, as `model=mar model.mar_ckpt=... model.vae_ckpt=...
    model.num_heads=4 model.num_sampling_steps=50` would (the width is no preset's: the heads are not in
    the weights)."""
    assert checksum(mar_weights(0)) == pytest.approx(fixture["mar_weights_checksum"], rel=1e-12)   # the same weights
    assert checksum(vae_weights(1)) == pytest.approx(fixture["vae_weights_checksum"], rel=1e-12)
    mar_ckpt, vae_ckpt = write_public(tmp_path_factory.mktemp("mar_public"))
    return load_bundle(MarConfig(mar_ckpt=str(mar_ckpt), vae_ckpt=str(vae_ckpt), num_heads=NUM_HEADS,
                                 num_sampling_steps=SAMPLING_STEPS, device="cpu", dtype="float32"))


@pytest.mark.parametrize("run", RUNS, ids=[run_key(*r) for r in RUNS])
def test_public_mar_checkpoint_reproduces_the_reference_sampler(bundle, fixture, run):
    cfg_scale, schedule, temperature = run
    ref = fixture["runs"][run_key(*run)]
    assert bundle.mar.diffloss.num_sampling_steps == fixture["num_sampling_steps"]
    assert bundle.vae.args.scale == fixture["vae_scale"]
    N, C = bundle.mar.args.seq_len, bundle.mar.args.token_dim
    engine = ReplayMar(bundle, engine_config("mar", num_iter=fixture["num_iter"], cfg_schedule=schedule,
                                             sampling={"cfg_scale": cfg_scale, "temperature": temperature}),
                       *noise_tables(fixture["seeds"], N, C, fixture["num_sampling_steps"]))
    res = engine.generate(bundle.conditions(fixture["labels"]), fixture["seeds"])

    # the same positions revealed at each step (MAR reveals the end of its order first)
    step_of = np.full((len(res), N), -1)
    for b, r in enumerate(res):
        step_of[b, r.records["row"] * bundle.grid + r.records["col"]] = r.records["step"]
    assert step_of.tolist() == ref["step_of"]
    # the same tokens, to fp32 rounding (amplified by the sampler, see ATOL)
    got, want = np.stack([r.tokens for r in res]), np.array(ref["tokens"], dtype=np.float64)
    assert got.shape == want.shape == (len(res), N, C)
    err = np.abs(got - want).max()
    assert err <= ATOL[cfg_scale != 1.0], f"tokens differ from the reference by up to {err:.3g}"
    # the same images: KL decode of tokens / 0.2325, quantised as MAR's evaluation does (±1 at a rounding edge)
    images = np.stack([r.image for r in res]).astype(int)
    assert images.shape == np.shape(ref["images"])
    err = np.abs(images - np.array(ref["images"])).max()
    assert err <= 1, f"image bytes differ from the reference's by up to {err}"


def test_presets_are_the_reference_s(fixture):
    """MAR-B/L/H as the reference builds them (the loader takes a preset's heads for a checkpoint of its width)."""
    for name, ref in fixture["presets"].items():
        a = MARArgs.from_name(name)
        assert {k: getattr(a, k) for k in ref} == ref, name
        assert HEADS_BY_WIDTH[ref["encoder_embed_dim"]] == ref["encoder_num_heads"]
