"""CSpD's acceptance and residual sampling (statistical and exact), and the `mar` / `cspd` engines on tiny
random MARs: trajectory alignment, draft == target, the explicit fallback, batch independence."""
from __future__ import annotations

import copy
import logging
import math

import numpy as np
import pytest
import torch
from scipy import stats

from decoding.engines import build_engine, engine_config
from decoding.engines.continuous import gaussian_logpdf, log_accept_ratio, residual_sample
from decoding.engines.mar import mar_schedule
from decoding.mar.bundle import MarBundle
from decoding.models.diffloss import HeadSample
from decoding.models.mar import MAR, MARArgs
from decoding.models.vae import AutoencoderKL, VAEArgs
from decoding.sampling import SamplingParams


def tiny_mar(seed: int, std: float = 0.1, **kw) -> MAR:
    torch.manual_seed(seed)
    a = MARArgs(**{**dict(img_size=64, vae_stride=16, encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=2,
                          decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, vae_embed_dim=4, class_num=5,
                          buffer_size=4, diffloss_d=2, diffloss_w=32, num_sampling_steps=10), **kw})
    m = MAR(a)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    # variance values near 0 (as a trained head gives): σ between the two bounds, not e^-50
    torch.nn.init.normal_(m.diffloss.net.final_layer.linear.weight, std=0.02)
    return m.eval()


def tiny_vae() -> AutoencoderKL:
    torch.manual_seed(0)
    return AutoencoderKL(VAEArgs(embed_dim=4, ch=32, ch_mult=[1, 2], num_res_blocks=1, enc_attn_resolutions=[],
                                 dec_attn_resolutions=[], scale=0.5)).eval()


def bundle(target: MAR, draft: MAR | None, cfg_scale: float = 2.0, dtype: str = "float32") -> MarBundle:
    return MarBundle("tiny", tiny_vae(), target, draft, None, "cpu", dtype,
                     SamplingParams(cfg_scale=cfg_scale, temperature=1.0, top_k=0, top_p=1.0))


@pytest.fixture(scope="module")
def pair():
    return tiny_mar(0), tiny_mar(1)


# -- the residual sampler -------------------------------------------------------------------------------
def _draws(mu_p, sig_p, mu_q, sig_q, log_c, n, tries=64, bound=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    D = len(mu_p)
    normals = torch.randn(n, tries, D, generator=g)
    uniforms = torch.rand(n, tries, generator=g).clamp_min(1e-12)
    rep = lambda v: torch.tensor(v, dtype=torch.float32).expand(n, D)  # noqa: E731
    x, ok = residual_sample(rep(mu_p), rep(sig_p), rep(mu_q), rep(sig_q), torch.full((n,), log_c), normals, uniforms,
                            bound=bound)
    return x[ok].numpy(), ok.float().mean().item()


def _residual_density(grid_pts, mu_p, sig_p, mu_q, sig_q, log_c):
    x = torch.tensor(grid_pts, dtype=torch.float64)
    lp = gaussian_logpdf(x, torch.tensor(mu_p, dtype=torch.float64), torch.tensor(sig_p, dtype=torch.float64))
    lq = gaussian_logpdf(x, torch.tensor(mu_q, dtype=torch.float64), torch.tensor(sig_q, dtype=torch.float64))
    return (lp.exp() - math.exp(log_c) * lq.exp()).clamp(min=0).numpy()


def _chi2_1d(samples, case, bins=24):
    mu_p, sig_p = case[0][0], case[1][0]
    edges = np.linspace(mu_p - 5 * sig_p, mu_p + 5 * sig_p, bins + 1)
    fine = np.linspace(edges[0], edges[-1], 20001)
    dens = _residual_density(fine[:, None], *case)
    cdf = np.concatenate([[0], np.cumsum((dens[1:] + dens[:-1]) / 2 * np.diff(fine))])
    probs = np.diff(np.interp(edges, fine, cdf / cdf[-1]))
    obs = np.histogram(samples[:, 0], edges)[0]
    keep = probs * len(samples) >= 5
    exp = probs[keep] / probs[keep].sum() * obs[keep].sum()
    return stats.chisquare(obs[keep], exp).pvalue


CASE_1D = ([0.0], [1.0], [0.9], [0.7], 0.0)            # p = N(0, 1), q = N(0.9, 0.7²), c = 1
CASE_1D_C = ([0.0], [1.0], [0.2], [1.3], math.log(0.6))  # c != 1: the residual of the trajectory-weighted test


@pytest.mark.parametrize("case", [CASE_1D, CASE_1D_C])
def test_residual_sampler_draws_max_p_minus_cq_1d(case):
    samples, ok = _draws(*case, n=30000)
    assert ok > 0.99
    assert _chi2_1d(samples, case) > 1e-3


def test_residual_sampler_with_a_wrong_bound_is_caught_1d():
    samples, _ = _draws(*CASE_1D, n=30000, bound=0.3)   # max(0, p - q) <= 0.3 p is false: clipped acceptance
    assert _chi2_1d(samples, CASE_1D) < 1e-6


CASE_2D = ([0.0, 0.0], [1.0, 0.6], [0.6, -0.4], [0.7, 0.9], 0.0)


def _chi2_2d(samples, case, cells=6):
    (m0, m1), (s0, s1) = case[0], case[1]
    e0, e1 = np.linspace(m0 - 4 * s0, m0 + 4 * s0, cells + 1), np.linspace(m1 - 4 * s1, m1 + 4 * s1, cells + 1)
    f0, f1 = np.linspace(e0[0], e0[-1], 601), np.linspace(e1[0], e1[-1], 601)
    X, Y = np.meshgrid((f0[1:] + f0[:-1]) / 2, (f1[1:] + f1[:-1]) / 2, indexing="ij")
    dens = _residual_density(np.stack([X.ravel(), Y.ravel()], 1), *case).reshape(X.shape)
    probs = np.zeros((cells, cells))
    i0, i1 = np.digitize(X[:, 0], e0) - 1, np.digitize(Y[0], e1) - 1
    np.add.at(probs, (i0[:, None].repeat(len(i1), 1), i1[None].repeat(len(i0), 0)), dens)
    inside = (samples[:, 0] > e0[0]) & (samples[:, 0] < e0[-1]) & (samples[:, 1] > e1[0]) & (samples[:, 1] < e1[-1])
    obs = np.histogram2d(samples[inside, 0], samples[inside, 1], [e0, e1])[0]
    probs, obs = probs.ravel() / probs.sum(), obs.ravel()
    keep = probs * inside.sum() >= 5
    return stats.chisquare(obs[keep], probs[keep] / probs[keep].sum() * obs[keep].sum()).pvalue


def test_residual_sampler_draws_max_p_minus_q_2d():
    samples, ok = _draws(*CASE_2D, n=30000)
    assert ok > 0.99
    assert _chi2_2d(samples, CASE_2D) > 1e-3
    wrong, _ = _draws(*CASE_2D, n=30000, bound=0.3)
    assert _chi2_2d(wrong, CASE_2D) < 1e-6


# -- the acceptance ratio -------------------------------------------------------------------------------
def raw_accept_ratio(x, mu_q, sig_q, L_q, mu_p, sig_p, L_p, lam):
    """The reference's arithmetic (MarkXCloud/CSpD DistributionProcessor): products of raw densities."""
    F = torch.exp((L_p - L_q).sum(-1))
    p_t = torch.exp(-0.5 * (((x - mu_p) / sig_p / lam) ** 2).sum(-1))
    q_t = torch.exp(-0.5 * (((x - mu_q) / sig_q / lam) ** 2).sum(-1))
    parts = (F, p_t, q_t, sig_q.prod(-1), sig_p.prod(-1), p_t * F, p_t * F * sig_q.prod(-1), q_t * sig_p.prod(-1))
    tiny = torch.finfo(torch.float32).tiny
    normal = torch.stack([(v.abs() > tiny) & torch.isfinite(v) for v in parts]).all(0)  # no precision lost
    return p_t * F * sig_q.prod(-1) / (q_t * sig_p.prod(-1)), normal


def test_log_space_and_raw_acceptance_agree_where_finite():
    g = torch.Generator().manual_seed(0)
    n, D = 2000, 16
    mu_q, mu_p = torch.randn(n, D, generator=g), torch.randn(n, D, generator=g) * 0.3
    sig_q, sig_p = (0.05 + torch.rand(n, D, generator=g) for _ in range(2))
    L_q, L_p = (torch.randn(n, D, generator=g) * 0.2 - 3 for _ in range(2))
    x = mu_q + 0.1 * torch.randn(n, D, generator=g)
    for lam in (1.0, 42.0):
        log_r = log_accept_ratio(x, mu_q, sig_q, L_q, mu_p, sig_p, L_p, lam)
        raw, normal = raw_accept_ratio(x, mu_q, sig_q, L_q, mu_p, sig_p, L_p, lam)
        finite = normal & (raw > 1e-30) & (raw < 1e30)  # no subnormal on the way: float32 keeps its precision
        assert finite.float().mean() > 0.3 and torch.isfinite(log_r).all()
        assert torch.allclose(log_r[finite], torch.log(raw[finite]), atol=1e-3, rtol=1e-4)
        if lam == 1.0:  # over 16 dimensions the raw densities underflow for about half of these tokens
            assert (raw == 0).float().mean() > 0.2
    # 99 steps x 16 dims of trajectory terms: the raw product overflows, the log stays exact
    big_Lp, big_Lq = L_p * 0 + 4.0, L_q * 0 - 4.0
    raw, _ = raw_accept_ratio(x, mu_q, sig_q, big_Lq, mu_p, sig_p, big_Lp, 1.0)
    log_r = log_accept_ratio(x, mu_q, sig_q, big_Lq, mu_p, sig_p, big_Lp, 1.0)
    assert not torch.isfinite(raw).all() and torch.isfinite(log_r).all()


# -- the engines ----------------------------------------------------------------------------------------
def test_mar_schedule_is_mars():
    assert [n for n, _ in mar_schedule(256, 256, 1.0, "linear")] == [1] * 256
    counts = [n for n, _ in mar_schedule(256, 64, 1.0, "linear")]
    assert sum(counts) == 256 and counts[0] == 1 and max(counts) <= 7 and len(counts) == 64
    # the linear CFG scale follows the clamped mask length of the next step: 1 + (cfg-1)(N - mask_len)/N
    assert mar_schedule(16, 4, 3.0, "linear")[0] == (2, pytest.approx(1 + 2 * 2 / 16))
    assert all(s == 3.0 for _, s in mar_schedule(16, 4, 3.0, "constant"))


def test_each_token_gets_its_positions_noise_and_its_steps_guidance(pair):
    """A token's diffusion noise is keyed by its position in the image, not by its place in the step that
    reveals it (tokens revealed by different steps would share noise, and draft and target trajectories
    are aligned by position); its guidance scale is the one of the step that reveals it (the linear
    schedule grows with the steps)."""
    from decoding.sampling import Streams
    engine = build_engine(bundle(pair[0], None), engine_config("mar", num_iter=4, cfg_schedule="linear"))
    streams = Streams([7], "cpu")
    x_one, eps_one = engine.noise(streams, torch.tensor([[5]]), 10)
    x_two, eps_two = engine.noise(streams, torch.tensor([[3, 5]]), 10)
    assert torch.equal(x_two[:, 1], x_one[:, 0]) and torch.equal(eps_two[:, 1], eps_one[:, 0])
    assert not torch.equal(x_two[:, 0], x_two[:, 1])
    plan = engine.plan
    want = [plan[1][1]] * plan[1][0] + [plan[3][1]] * plan[3][0]
    assert engine.scales([1, 3], 2).tolist() == [want, want] and plan[1][1] < plan[3][1]


def test_cspd_with_draft_equal_to_target_accepts_everything_and_is_mar_up_to_sigma0(pair):
    target, _ = pair
    b = bundle(target, target)
    cond = b.conditions(["1", "3", "0"])
    seeds = [11, 12, 13]
    ref = build_engine(b, engine_config("mar", num_iter=12)).generate(cond, seeds)
    # one step per window: the target verifies under exactly the context the draft saw; every proposal
    # μ_0 + σ_0 ε_0 is kept, so the image is mar's up to σ_0 ε_0 (σ_0 < 0.0065 for any head), the prefill exactly
    got = build_engine(b, engine_config("cspd", num_iter=12, num_draft=1, lam=1.0)).generate(cond, seeds)
    for r, g in zip(ref, got):
        drafted = g.records["window_pos"] >= 0
        assert drafted.sum() > 0 and g.records["accepted"][drafted].all()
        assert (g.records["log_accept_ratio"][drafted] == 0).all()
        diff = np.abs(r.tokens - g.tokens).max(-1)
        assert diff.max() < 6 * 0.0065 and diff.max() > 0 and (diff == 0).sum() >= (~drafted).sum()
    # longer windows: the target sees only the tokens before the window (the reference's pre-window mask),
    # so identical models agree exactly on the first step of each window, not on the later ones
    got = build_engine(b, engine_config("cspd", num_iter=12, num_draft=4, lam=1.0)).generate(cond, seeds)
    for g in got:
        # (up to float32 rounding: the target's head runs on more rows, and 10 diffusion steps of a random
        # head amplify a last-bit difference to up to ~0.1 σ_0, which log r sees times the proposal's ε_0)
        first, later = g.records["window_pos"] == 0, g.records["window_pos"] > 0
        assert np.abs(g.records["log_accept_ratio"][first]).max() < 0.5
        assert np.abs(g.records["log_accept_ratio"][later]).max() > 1.0


def test_verify_accepts_a_draft_identical_to_the_target_and_keeps_its_sample(pair):
    target, draft = pair
    e = build_engine(bundle(target, draft), engine_config("cspd", num_iter=12, num_draft=4, lam=1.0))
    g = torch.Generator().manual_seed(0)
    B, m, C = 3, 7, 4
    p = HeadSample(torch.randn(B, m, C, generator=g), 0.1 + torch.rand(B, m, C, generator=g),
                   -torch.rand(B, m, C, generator=g))
    q = [HeadSample(p.x[:, :3], p.sigma0[:, :3], p.log_sigma_sum[:, :3]),
         HeadSample(p.x[:, 3:], p.sigma0[:, 3:], p.log_sigma_sum[:, 3:])]
    from decoding.sampling import Streams
    pos = torch.arange(m).expand(B, m)
    x, log_r, accepted, fell_back = e.verify(q, p.x, p, pos, Streams([1, 2, 3], "cpu"))
    assert accepted.all() and (log_r == 0).all() and not fell_back.any() and torch.equal(x, p.x)


def test_fallback_is_explicit_counted_and_logged(pair, caplog):
    target, draft = pair
    e = build_engine(bundle(target, draft), engine_config("cspd", num_iter=12, num_draft=4, lam=1.0, max_tries=1))
    # constructed: the residual max(0, p - c q) is empty when c q >= p everywhere. q twice as wide as p and
    # c = e^10 (L_q - L_p = 10): c q / p >= e^10 / 2^4 > 1, and log r ~ 4 log 2 - 10: rejected
    g = torch.Generator().manual_seed(0)
    B, m, C = 2, 5, 4
    p = HeadSample(torch.randn(B, m, C, generator=g), 0.1 + torch.rand(B, m, C, generator=g), torch.zeros(B, m, C))
    q = [HeadSample(p.x + 0.1 * p.sigma0, 2 * p.sigma0, torch.full((B, m, C), 10.0 / C))]
    from decoding.sampling import Streams
    x, _, accepted, fell_back = e.verify(q, q[0].x, p, torch.arange(m).expand(B, m), Streams([1, 2], "cpu"))
    assert not accepted.any() and fell_back.all()
    assert torch.equal(x, p.x)  # the target's own aligned sample, not the reference's zero vector
    # end to end, the same construction at the draft's diffusion head: a draft whose head reports, for the
    # target's own trajectory, a Gaussian twice as wide and c = e^10 (one step per window, so the target
    # verifies under the draft's context and sees the same μ)
    class WideHead(type(target.diffloss)):
        def sample(self, *a, **kw):
            s = super().sample(*a, **kw)
            return HeadSample(s.x + 0.1 * s.sigma0, 2 * s.sigma0, s.log_sigma_sum + 10.0 / s.x.shape[-1])
    wide = copy.deepcopy(target)
    wide.diffloss.__class__ = WideHead
    b = bundle(target, wide)
    e = build_engine(b, engine_config("cspd", num_iter=12, num_draft=1, lam=1.0, max_tries=3))
    cond = b.conditions(["1", "2"])
    with caplog.at_level(logging.WARNING, logger="arspec.cspd"):
        res = e.generate(cond, [5, 6])
    n = sum(int(r.records["fallback"].sum()) for r in res)
    drafted = sum(int((r.records["window_pos"] >= 0).sum()) for r in res)
    assert n == drafted > 0                                    # every drafted token fell back, and is counted
    for r in res:                                              # and logged, once per image
        assert sum(f"for {int(r.records['fallback'].sum())} of 16 tokens" in rec.message for rec in caplog.records) >= 1
    assert len(caplog.records) == len(res)
    ref = build_engine(bundle(target, target), engine_config("mar", num_iter=12)).generate(cond, [5, 6])
    for r, m in zip(res, ref):  # the fallback is the target's own sample: the image is mar's
        assert not r.records["accepted"].any() and np.array_equal(r.tokens, m.tokens)


@pytest.mark.parametrize("name", ["mar", "cspd"])
def test_image_does_not_depend_on_its_batch(pair, name):
    target, draft = pair
    b = bundle(target, draft)
    engine = build_engine(b, engine_config(name, num_iter=8, **({"num_draft": 3} if name == "cspd" else {})))
    prompts, seeds = ["1", "2", "4"], [21, 22, 23]
    together = engine.generate(b.conditions(prompts), seeds)
    alone = engine.generate(b.conditions(prompts[1:2]), seeds[1:2])[0]
    # the same numbers up to float rounding: matmuls over 3 rows and over 1 may round differently
    np.testing.assert_allclose(together[1].tokens, alone.tokens, rtol=1e-5, atol=1e-5)
    assert np.array_equal(together[1].records["accepted"], alone.records["accepted"])


def test_continuous_engines_refuse_discrete_models_and_back(pair, tiny):
    target, draft = pair
    with pytest.raises(ValueError, match="engine 'mar' samples continuous tokens and model 'tiny' is discrete"):
        build_engine(tiny, engine_config("mar"))
    with pytest.raises(ValueError, match="engine=vanilla samples discrete tokens"):
        build_engine(bundle(target, draft), engine_config("vanilla"))
    with pytest.raises(ValueError, match="engine cspd needs a draft MAR"):
        build_engine(bundle(target, None), engine_config("cspd", num_iter=8))
    with pytest.raises(ValueError, match="engine.num_iter=64: more AR steps than the model's 16 tokens"):
        build_engine(bundle(target, draft), engine_config("mar", num_iter=64))
    with pytest.raises(ValueError, match="engine.sampling.top_k=5: continuous tokens have no top_k"):
        engine_config("cspd", sampling={"top_k": 5})
    with pytest.raises(ValueError, match="engine.lam=0"):
        engine_config("cspd", lam=0)


@pytest.mark.parametrize("name", ["mar", "cspd"])
def test_engines_run_in_bf16(name):
    """The transformers in bf16 (the CPU default where bf16 matmuls are fast), the head in fp32."""
    import copy as _copy
    b = bundle(_copy.deepcopy(tiny_mar(0)), _copy.deepcopy(tiny_mar(1)), dtype="bfloat16")
    assert b.mar.z_proj.weight.dtype == torch.bfloat16 and b.mar.diffloss.net.input_proj.weight.dtype == torch.float32
    from decoding.models.packed import PackedLinear, available
    assert isinstance(b.mar.z_proj, PackedLinear) == available() and not isinstance(b.mar.diffloss.net.input_proj, PackedLinear)
    res = build_engine(b, engine_config(name, num_iter=6)).generate(b.conditions(["1", "2"]), [1, 2])
    assert np.isfinite(res[0].tokens).all() and res[0].image.shape == (8, 8, 3)


def test_draft_and_target_must_share_the_sampler(pair):
    """Aligned trajectories need the same sampler: a draft with another step count or x_0 clip is refused."""
    t, d = (copy.deepcopy(m) for m in pair)
    d.diffloss.clip_x0 = 5.0
    with pytest.raises(ValueError, match="clip_x0"):
        bundle(t, d)
    d.diffloss.clip_x0, d.diffloss.num_sampling_steps = None, 20
    with pytest.raises(ValueError, match="num_sampling_steps"):
        bundle(t, d)


# -- exactness through the engine: λ = 1 without trajectory terms -----------------------------------------
def gaussian_world(C: int, steps: int = 1, shift: float = 1.0, log_var: float = 0.0) -> MarBundle:
    """A small continuous world: 4 tokens of C dimensions (1 or 2) whose heads read their position only
    (decoder_norm zeroed: z = the position's embedding), so the target's conditional of a token is the same
    under any mask and `mar`'s token is exactly the μ_p0 cspd verifies against. With one diffusion step a
    token is N(x_T / √ᾱ_0 − b ε̂, σ_0²) given x_T: Gaussian tokens. The draft is the target with its head's
    output biased: ε̂ by `shift` (its final mean moves by −shift σ_0 per dimension: the Gaussians overlap and
    about half the drafts are kept, so the residual matters) and the variance value by `log_var` (its σ_t
    and so L_q move: what the trajectory terms read)."""
    t = tiny_mar(0, img_size=32, vae_embed_dim=C, class_num=1, buffer_size=1, clip_x0=3.0, num_sampling_steps=steps)
    with torch.no_grad():
        t.decoder_norm.weight.zero_()
        t.decoder_norm.bias.zero_()
    d = copy.deepcopy(t)
    with torch.no_grad():
        bias = d.diffloss.net.final_layer.linear.bias
        bias[:C] += torch.tensor([shift, -0.5 * shift][:C])
        bias[C:] += log_var
    vae = AutoencoderKL(VAEArgs(embed_dim=C, ch=8, ch_mult=[1, 2], num_res_blocks=1, enc_attn_resolutions=[],
                                dec_attn_resolutions=[], norm_groups=4, scale=1.0))
    return MarBundle("gauss", vae.eval(), t, d, None, "cpu", "float32",
                     SamplingParams(cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0))


def standardized_tokens(b: MarBundle, n: int = 2000, **settings) -> tuple[np.ndarray, float]:
    """cspd's tokens (λ = 1, no trajectory terms, every token drafted) as (x − μ_p0) / σ_p0 [n·4, C], with
    μ_p0 `mar`'s token for the same seed and σ_p0 the target's final σ there; and the accepted share."""
    from decoding.sampling import Streams
    seeds, cond = list(range(n)), b.conditions(["0"] * n)
    cfg = dict(num_iter=4, num_draft=2, prefill_ratio=0.0, lam=1.0, trajectory_terms=False)
    with torch.inference_mode():
        mar = build_engine(b, engine_config("mar", num_iter=4))
        mu = mar.tokens(cond, seeds).latents
        e = build_engine(b, engine_config("cspd", **{**cfg, **settings}))
        log = e.tokens(cond, seeds)
        pos = torch.arange(4).expand(n, 4)
        p = mar.head(b.mar, mar.features(b.mar, mu, pos[:, :0], mar.buffer(b.mar, cond)), pos, torch.ones(n, 4),
                     Streams(seeds, "cpu"))
    assert torch.equal(p.x, mu)
    accepted = float(np.mean([log.records(i)["accepted"].mean() for i in range(n)]))
    return ((log.latents - mu) / p.sigma0).reshape(-1, b.mar.args.token_dim).numpy(), accepted


def exact_pvalue(D: np.ndarray) -> float:
    """The smallest KS p-value of: each dimension against N(0, 1), and (2-D) the squared radius against χ²(2)."""
    ps = [stats.kstest(D[:, i], "norm").pvalue for i in range(D.shape[1])]
    if D.shape[1] > 1:
        ps.append(stats.kstest((D ** 2).sum(1), stats.chi2(D.shape[1]).cdf).pvalue)
    return min(ps)


# (C, diffusion steps, the draft's ε shift, its variance shift): Gaussian tokens with overlapping drafts, and
# 10-step chains whose draft has other σ_t (L_q ≠ L_p: the reference's trajectory terms then matter)
WORLDS = {"1d": (1, 1, 1.0, 0.0), "2d": (2, 1, 1.0, 0.0), "1d_10_steps": (1, 10, 0.0, 0.3), "2d_10_steps": (2, 10, 0.0, 0.3)}


def exact(world: str, **settings) -> bool:
    """The exactness check: tokens standardized by the target's final Gaussian are N(0, 1) (p > 1e-3) and,
    in the one-step worlds, alignment keeps more than 30% of the drafts."""
    D, accepted = standardized_tokens(gaussian_world(*WORLDS[world]), **settings)
    return exact_pvalue(D) > 1e-3 and (accepted > 0.3 or WORLDS[world][1] > 1)


@pytest.mark.parametrize("world", list(WORLDS))
def test_cspd_at_lam_1_draws_the_targets_final_gaussian_exactly(world):
    """Through the engine: with λ = 1 and no trajectory terms each token is N(μ_p0, σ_p0²) on its aligned
    trajectory, `mar`'s token blurred by its own last-step σ (exact speculative sampling given the shared
    noise), while aligned drafts are kept often."""
    assert exact(world)


@pytest.mark.parametrize("breakage, worlds", [
    ("bound", ["1d", "2d"]), ("target_noise", ["1d", "2d"]), ("draft_noise", ["1d", "2d"]),
    ("mean_proposal", ["1d", "2d"]), ("trajectory_terms", ["1d_10_steps", "2d_10_steps"])])
def test_exactness_check_catches_a_broken_engine(breakage, worlds, monkeypatch):
    """The check above fails for each way of breaking the engine: a residual envelope M = 0.3 (clipped
    acceptance), the target verifying on noise not keyed by the token's position (not `mar`'s trajectory),
    the draft on noise not aligned with the target's (still exact, but acceptance collapses), the draft
    proposing its mean μ_q0 instead of a draw, and the reference's trajectory terms at λ = 1."""
    import decoding.engines.cspd as cspd
    from decoding.engines.mar import ContinuousEngine
    settings = {}
    if breakage == "bound":
        right = cspd.residual_sample
        monkeypatch.setattr(cspd, "residual_sample", lambda *a, **k: right(*a, **{**k, "bound": 0.3}))
    elif breakage in ("target_noise", "draft_noise"):
        noise, head = ContinuousEngine.noise, ContinuousEngine.head

        def shifted(e, m, z, pos, scale, streams):
            if (m is e.mar) != (breakage == "target_noise"):
                return head(e, m, z, pos, scale, streams)
            e.noise = lambda s, p, steps: noise(e, s, (p + 1) % e.N, steps)   # the next position's noise
            try:
                return head(e, m, z, pos, scale, streams)
            finally:
                del e.noise
        monkeypatch.setattr(ContinuousEngine, "head", shifted)
    elif breakage == "mean_proposal":
        monkeypatch.setattr(ContinuousEngine, "final_noise", lambda e, streams, pos: torch.zeros(*pos.shape, e.C))
    else:
        settings["trajectory_terms"] = True
    for world in worlds:
        assert not exact(world, **settings)


def test_final_noise_is_the_samplers_unused_step_zero_noise(pair):
    """ε_0 of a position is `noise`'s ε at step 0 (aligned like the rest of its trajectory)."""
    from decoding.sampling import Streams
    e = build_engine(bundle(*pair), engine_config("cspd", num_iter=8))
    pos = torch.tensor([[3, 0, 9], [1, 2, 15]])
    _, eps = e.noise(Streams([4, 5], "cpu"), pos, 10)
    assert torch.equal(e.final_noise(Streams([4, 5], "cpu"), pos), eps[:, :, 0])


@pytest.mark.parametrize("name", ["mar", "cspd"])
def test_a_row_that_starts_mid_batch_decodes_as_it_would_alone(pair, name):
    """Continuous batching: a prompt admitted into a free row while the others are steps ahead (rows join
    after 0, 2 and 3 steps of the batch) gets the image it would get alone: each row follows its own
    schedule, noise and windows."""
    b = bundle(*pair)
    e = build_engine(b, engine_config(name, num_iter=8, **({"num_draft": 2, "prefill_ratio": 0.3} if name == "cspd" else {})))
    prompts, seeds = ["1", "2", "4"], [31, 32, 33]
    st = e.start(3)
    for row, lag in enumerate([0, 2, 3]):
        while int(st.log.target_forwards[0]) < lag:        # a step is one target forward per row
            e.step(st)
        e.admit(st, torch.tensor([row]), b.conditions(prompts[row:row + 1]), seeds[row:row + 1])
    while bool((st.log.n < e.N).any()):
        e.step(st)
    for row in range(3):
        alone = e.tokens(b.conditions(prompts[row:row + 1]), seeds[row:row + 1])
        np.testing.assert_allclose(st.log.latents[row], alone.latents[0], rtol=1e-5, atol=1e-5)
        got, want = st.log.records(row), alone.records(0)
        for col in ("step", "row", "col", "accepted", "window_pos", "accept_len", "proposer"):
            assert np.array_equal(got[col], want[col]), col
        assert int(st.log.target_forwards[row]) == int(alone.target_forwards[0])
        assert int(st.log.draft_forwards[row]) == int(alone.draft_forwards[0])


def test_a_stream_batches_continuous_prompts_and_a_failing_one_fails_alone(pair):
    """`stream` (the job's path) decodes MAR prompts in batches of `slots`, not one by one; a prompt the
    model cannot take (a class id past its table) fails alone, and the prompt that takes its row is
    decoded as it would be alone."""
    from decoding.engines.requests import Request
    from decoding.mar.bundle import MarConditions
    b = bundle(*pair)
    e = build_engine(b, engine_config("cspd", num_iter=8, num_draft=2))
    bad = MarConditions(labels=torch.tensor([99]), unknown_words=[0])
    reqs = [Request(b.conditions([p]), s, k) for k, (p, s) in enumerate([("1", 41), ("2", 42)])]
    reqs += [Request(bad, 43, "bad"), Request(b.conditions(["3"]), 44, 3), Request(b.conditions(["0"]), 45, 4)]
    out = {o.key: o for o in e.stream(reqs, slots=3)}
    assert sorted(out, key=str) == [0, 1, 3, 4, "bad"]
    assert out["bad"].result is None and "IndexError" in out["bad"].error
    for k, (p, s) in {0: ("1", 41), 1: ("2", 42), 3: ("3", 44), 4: ("0", 45)}.items():
        r = out[k].result
        assert out[k].error is None and r.batch == 3            # the rows it ran with
        alone = e.generate(b.conditions([p]), [s])[0]
        np.testing.assert_allclose(r.tokens, alone.tokens, rtol=1e-5, atol=1e-5)
        assert np.array_equal(r.records["accepted"], alone.records["accepted"])
