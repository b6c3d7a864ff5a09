"""The continuous models: MAR, its diffusion head and the KL VAE in the public layouts (round trips through
the containers LTH14/mar writes, one-line errors for wrong files), the `mar` family through the registry,
the Hydra defaults that pair the continuous engines with it, and the tokens table for continuous tokens."""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch

from decoding.engines import build_engine, engine_config
from decoding.mar.checkpoints import inspect, load_mar, load_vae
from decoding.mar.family import MarConfig
from decoding.models.diffloss import Schedule, cosine_betas, respaced_steps
from decoding.models.mar import MAR, MAR_PRESETS, MARArgs
from decoding.models.vae import AutoencoderKL, VAEArgs
from decoding.registry import load_bundle

SMALL = dict(img_size=64, vae_stride=16, encoder_embed_dim=48, encoder_depth=2, encoder_num_heads=4,
             decoder_embed_dim=48, decoder_depth=1, decoder_num_heads=4, vae_embed_dim=4, class_num=10,
             buffer_size=4, diffloss_d=2, diffloss_w=32, num_sampling_steps=8)
SMALL_VAE = dict(embed_dim=4, ch=32, ch_mult=[1, 2, 2, 2, 2], num_res_blocks=1, enc_attn_resolutions=[16],
                 dec_attn_resolutions=[])


def randomize(m: torch.nn.Module, seed: int, std: float = 0.05) -> torch.nn.Module:
    torch.manual_seed(seed)
    for p in m.parameters():
        torch.nn.init.normal_(p, std=std)
    return m.eval()


def save_mar_checkpoint(path: Path, seed: int, **over) -> tuple[MAR, MAR]:
    """A random MAR in LTH14/mar's checkpoint-last.pth container: model, model_ema, optimizer, epoch, scaler, args."""
    model, ema = randomize(MAR(MARArgs(**{**SMALL, **over})), seed), randomize(MAR(MARArgs(**{**SMALL, **over})), seed + 100)
    torch.save({"model": model.state_dict(), "model_ema": ema.state_dict(),
                "optimizer": {"state": {}, "param_groups": [{"lr": 1e-4}]}, "epoch": 399,
                "scaler": {"scale": 65536.0}, "args": argparse.Namespace(model="mar_custom", diffloss_d=2)}, path)
    return model, ema


def save_vae_checkpoint(path: Path, seed: int = 0) -> AutoencoderKL:
    """A random KL VAE in the kl16.ckpt container ({'model': ...}), with an LDM training-loss key beside it."""
    vae = randomize(AutoencoderKL(VAEArgs(**SMALL_VAE)), seed, std=0.02)
    torch.save({"model": {**vae.state_dict(), "loss.discriminator.main.0.weight": torch.zeros(2, 3, 4, 4)}}, path)
    return vae


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    d = tmp_path_factory.mktemp("public")
    target = save_mar_checkpoint(d / "target.pth", 0)
    draft = save_mar_checkpoint(d / "draft.pth", 1, encoder_embed_dim=32, encoder_num_heads=4, decoder_embed_dim=32,
                                decoder_num_heads=4, encoder_depth=1, diffloss_w=16)
    vae = save_vae_checkpoint(d / "kl16.ckpt")
    return d, target, draft, vae


# -- layouts ---------------------------------------------------------------------------------------------
def test_presets_have_the_released_sizes():
    """MAR-B/L/H with their diffusion heads: 208M / 479M / 943M parameters (LTH14/mar README)."""
    with torch.device("meta"):
        sizes = {n: sum(p.numel() for p in MAR(MARArgs.from_name(n)).parameters()) for n in MAR_PRESETS}
        vae = AutoencoderKL(VAEArgs())
    assert [round(sizes[n] / 1e6, 1) for n in ("mar_base", "mar_large", "mar_huge")] == [207.9, 478.3, 942.4]
    keys = set(vae.state_dict())
    assert {"encoder.down.4.attn.1.q.weight", "encoder.down.3.downsample.conv.weight", "encoder.mid.attn_1.proj_out.weight",
            "encoder.down.2.block.0.nin_shortcut.weight", "decoder.up.1.block.0.nin_shortcut.weight",
            "decoder.up.3.upsample.conv.weight", "decoder.mid.block_2.conv2.weight", "quant_conv.weight"} <= keys
    assert not any(k.startswith(("decoder.up.4.attn", "encoder.down.4.downsample", "decoder.up.0.upsample")) for k in keys)
    assert tuple(vae.state_dict()["quant_conv.weight"].shape) == (32, 32, 1, 1)


def test_diffusion_schedule_is_iddpm_cosine_respaced():
    assert respaced_steps(1000, 100)[:8] == [0, 10, 20, 30, 40, 50, 61, 71] and respaced_steps(1000, 100)[-1] == 999
    b = cosine_betas()
    assert b.shape == (1000,) and b.max() == 0.999 and abs(b[0] - 4.1e-5) < 1e-6
    s = Schedule(100)
    assert s.num_timesteps == 100 and np.allclose(np.cumprod(1 - s.betas), np.cumprod(1 - b)[s.timestep_map])


# -- public checkpoints ---------------------------------------------------------------------------------
def test_mar_checkpoint_round_trip_ema_and_model(public):
    d, (model, ema), _, _ = public
    got = load_mar(d / "target.pth", num_heads=4)
    assert got.args.encoder_depth == 2 and got.args.class_num == 10 and got.args.buffer_size == 4
    for k, v in ema.state_dict().items():
        assert torch.equal(got.state_dict()[k], v), k
    raw = load_mar(d / "target.pth", use_ema=False, num_heads=4)
    assert torch.equal(raw.z_proj.weight, model.z_proj.weight)
    with torch.no_grad():  # same weights, same function
        tokens, known = torch.randn(2, 16, 4), torch.tensor([[1, 5], [0, 9]])
        buf = got.buffer(labels=torch.tensor([3, 7]))
        assert torch.equal(got.forward_z(tokens, known, buf), ema.forward_z(tokens, known, buf))


def test_vae_checkpoint_round_trip(public):
    d, _, _, vae = public
    got = load_vae(d / "kl16.ckpt", scale=0.5)
    assert got.args.ch_mult == [1, 2, 2, 2, 2] and got.args.enc_attn_resolutions == [16] and got.args.scale == 0.5
    x = torch.rand(1, 3, 32, 32) * 2 - 1
    with torch.no_grad():
        assert torch.equal(got.decode(got.moments(x)[0]), vae.decode(vae.moments(x)[0]))
    assert inspect(d / "kl16.ckpt")["family"] == "kl_vae"
    info = inspect(d / "target.pth")
    assert info["family"] == "mar" and info["preset"] == "custom" and "model_ema" in info["container"]


def test_public_checkpoints_generate_through_the_registry(public):
    d = public[0]
    cfg = MarConfig(mar_ckpt=str(d / "target.pth"), draft_mar_ckpt=str(d / "draft.pth"), vae_ckpt=str(d / "kl16.ckpt"),
                    num_heads=4, num_sampling_steps=8, device="cpu", dtype="float32")
    bundle = load_bundle(cfg)
    cond = bundle.conditions([3, "7"])
    for name, kw in (("mar", {}), ("cspd", {"num_draft": 2})):
        engine = build_engine(bundle, engine_config(name, num_iter=6, **kw))
        res, bare = engine.generate(cond, [1, 2]), engine.generate(cond, [1, 2], images=False)
        assert res[0].image.shape == (64, 64, 3) and res[0].tokens.shape == (16, 4)
        assert bare[0].image is None and np.array_equal(bare[1].tokens, res[1].tokens)
    with pytest.raises(ValueError, match=r"prompt 'a cat': model 'mar' is class-conditional: give class ids 0\.\.9"):
        bundle.conditions(["a cat"])


@pytest.mark.parametrize("case, field, message", [
    ("garbage", "mar_ckpt", "cannot be read as a safetensors or torch checkpoint"),
    ("vae_as_mar", "mar_ckpt", "not a mar checkpoint (it is a KL VAE: pass it as model.vae_ckpt)"),
    ("mar_as_vae", "vae_ckpt", "not a kl_vae checkpoint (it is a MAR: pass it as model.mar_ckpt)"),
    ("wrong_shape", "mar_ckpt", "does not fit the model its weights describe: 1 of the wrong shape "
                                "(decoder_pos_embed_learned (1, 19, 48) vs (1, 20, 48))"),
    ("missing_key", "mar_ckpt", "does not fit the model its weights describe: 1 missing (mask_token)"),
    ("no_ema", "mar_ckpt", "no 'model_ema' in the checkpoint (it has: epoch, model); set model.use_ema=false"),
    ("absent", "vae_ckpt", "no such file"),
    ("odd_width", "mar_ckpt", "a MAR of width 48 is none of the presets ([768, 1024, 1280]): set model.num_heads"),
])
def test_wrong_checkpoints_fail_in_one_line(public, tmp_path, case, field, message):
    d = public[0]
    good = torch.load(d / "target.pth", weights_only=False)
    paths = {"mar_ckpt": d / "target.pth", "vae_ckpt": d / "kl16.ckpt"}
    bad = tmp_path / f"{case}.pth"
    if case == "garbage":
        bad.write_bytes(b"\x00not a checkpoint" * 100)
    elif case == "vae_as_mar":
        bad = d / "kl16.ckpt"
    elif case == "mar_as_vae":
        bad = d / "target.pth"
    elif case == "wrong_shape":
        sd = dict(good["model_ema"])
        sd["decoder_pos_embed_learned"] = sd["decoder_pos_embed_learned"][:, :19]
        torch.save({"model_ema": sd}, bad)
    elif case == "missing_key":
        torch.save({"model_ema": {k: v for k, v in good["model_ema"].items() if k != "mask_token"}}, bad)
    elif case == "no_ema":
        torch.save({"model": good["model"], "epoch": 3}, bad)
    elif case == "absent":
        bad = tmp_path / "nowhere" / "kl16.ckpt"
    elif case == "odd_width":
        bad = d / "target.pth"
    paths[field] = bad
    cfg = MarConfig(mar_ckpt=str(paths["mar_ckpt"]), vae_ckpt=str(paths["vae_ckpt"]), device="cpu",
                    num_heads=None if case == "odd_width" else 4)
    with pytest.raises((ValueError, FileNotFoundError)) as e:
        load_bundle(cfg)
    text = str(e.value)
    assert "\n" not in text and text.startswith(f"model.{field}={bad}: ") and message in text, text


def test_mar_family_needs_the_target_with_its_vae(public):
    d = public[0]
    with pytest.raises(ValueError, match="model.vae_ckpt is not set"):
        load_bundle(MarConfig(mar_ckpt=str(d / "target.pth"), num_heads=4))
    with pytest.raises(ValueError, match="model.draft_mar_ckpt is set but model.mar_ckpt is not"):
        load_bundle(MarConfig(draft_mar_ckpt=str(d / "draft.pth")))


# -- the job's configuration and output -----------------------------------------------------------------
def test_continuous_engines_pick_the_mar_family_by_default():
    from hydra import compose, initialize_config_dir

    from workflows.config import register, to_object
    register()
    conf = Path(__file__).resolve().parents[1] / "conf"
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        pick = lambda *ov: to_object(compose("generate", overrides=list(ov)))  # noqa: E731
        for engine in ("mar", "cspd"):
            c = pick(f"engine={engine}")
            assert c.model.name == "mar" and c.engine.name == engine and c.out_dir == f"runs/mar/{engine}"
        assert pick("engine=cspd", "engine.lam=1", "model.num_sampling_steps=20").model.num_sampling_steps == 20
        assert pick("engine=mar", "model=shapes").model.name == "shapes"   # the command line wins...
        assert pick().model.name == "shapes" and pick("model=mar").engine.name == "auto"   # auto runs mar there


def test_generate_refuses_an_engine_the_model_cannot_serve(tmp_path):
    """...and the job says in one line that it cannot work."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-m", "workflows.generate", "engine=mar", "model=shapes",
                          f"out_dir={tmp_path}"], capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == ("error: engine 'mar' samples continuous tokens and model 'shapes' "
                                                   "is discrete: use model=mar (the continuous shapes models, or MAR "
                                                   "checkpoints)")


def test_tokens_table_has_null_token_ids_for_continuous_tokens(public):
    from actors.output import TOKEN_SCHEMA, token_table
    d = public[0]
    bundle = load_bundle(MarConfig(mar_ckpt=str(d / "target.pth"), draft_mar_ckpt=str(d / "draft.pth"),
                                   vae_ckpt=str(d / "kl16.ckpt"), num_heads=4, num_sampling_steps=8, device="cpu",
                                   dtype="float32"))
    res = build_engine(bundle, engine_config("cspd", num_iter=6, num_draft=2)).generate(bundle.conditions([1]), [3])
    t = token_table(["p0"], [res[0].records], "cspd")
    assert t.schema == TOKEN_SCHEMA and t.num_rows == 16
    assert t.column("token_id").null_count == 16
    df = t.to_pandas()
    assert sorted(zip(df.row, df.col)) == [(r, c) for r in range(4) for c in range(4)]   # every cell once
    drafted = df.window_pos >= 0
    assert drafted.any() and df.log_accept_ratio[drafted].notna().all() and df.log_accept_ratio[~drafted].isna().all()


@pytest.mark.parametrize("clip", [None, 0.5])
def test_sampler_is_iddpms_p_sample_loop(clip):
    """The head's sampler (constants folded, adaLN fused) against a plain transcription of IDDPM's
    p_sample with a learned range and MAR's forward_with_cfg, in float64; with clip_x0, IDDPM's
    clip_denoised (x_0 clamped before the posterior mean) with that bound."""
    from decoding.models.diffloss import DiffLoss, extract, schedule
    torch.manual_seed(0)
    head = randomize(DiffLoss(4, 16, depth=2, width=32, num_sampling_steps=20), 0, std=0.2).double()
    n, S = 3, 20
    z, x_T, noise = torch.randn(2 * n, 16).double(), torch.randn(n, 4), torch.randn(n, S, 4)
    cfg, temp = torch.tensor([1.5, 2.0, 3.0]), 0.9
    head.clip_x0 = clip
    got = head.sample(z, x_T, noise, temp, cfg)
    s = schedule(S)
    x = x_T.double()
    L = torch.zeros_like(x)
    with torch.no_grad():
        for i in reversed(range(S)):
            t = torch.full((n,), i)
            half = x
            out = head.net(torch.cat([half, half]), torch.full((2 * n,), int(s.timestep_map[i])), z)
            eps_c, eps_u = out[:n, :4], out[n:, :4]
            eps = eps_u + cfg[:, None].double() * (eps_c - eps_u)
            frac = (out[:n, 4:] + 1) / 2
            logvar = frac * extract(s.max_logvar, t, x).double() + (1 - frac) * extract(s.post_logvar, t, x).double()
            x0 = extract(s.sqrt_recip_ac, t, x).double() * x - extract(s.sqrt_recipm1_ac, t, x).double() * eps
            if clip is not None:
                x0 = x0.clamp(-clip, clip)
            mean = extract(s.coef1, t, x).double() * x0 + extract(s.coef2, t, x).double() * x
            if i:
                L += 0.5 * logvar
                x = mean + torch.exp(0.5 * logvar) * temp * noise[:, i].double()
            else:
                sigma0 = torch.exp(0.5 * logvar) * temp
                x = mean
    assert torch.allclose(got.x.double(), x, atol=1e-4) and torch.allclose(got.sigma0.double(), sigma0, rtol=1e-4)
    assert torch.allclose(got.log_sigma_sum.double(), L, atol=1e-4)


def test_head_trains_in_fp32_under_autocast():
    """The first sampling step multiplies the head's ε error at t = T-1 by ~316 (100 steps), so the head
    must learn ε to ~1e-3 there: its loss is computed in fp32 even inside a bf16 autocast (the training
    loop's on CPUs with fast bf16). A bf16 head trained the shipped models of an earlier run into
    samplers whose tokens drifted to ~1000x the data's spread."""
    from decoding.models.diffloss import DiffLoss
    head = randomize(DiffLoss(4, 16, depth=2, width=64), 0, std=0.2)
    x, z = torch.randn(256, 4), torch.randn(256, 16)
    ref = head.loss(x, z, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = head.loss(x, z, generator=torch.Generator().manual_seed(1))
    assert got.dtype == torch.float32 and torch.allclose(got, ref, rtol=1e-6), (got.item(), ref.item())


def test_last_step_oversampling_and_distillation_terms():
    """`last_step_prob` = 1 trains every row at t = T-1 (the loss is then that step's alone), and the
    distillation term is 0 against the head itself and positive against another head."""
    from decoding.models.diffloss import TRAIN_STEPS, DiffLoss
    head = randomize(DiffLoss(4, 16, depth=2, width=64), 0, std=0.2)
    other = randomize(DiffLoss(4, 16, depth=2, width=64), 1, std=0.2)
    x, z = torch.randn(64, 4), torch.randn(64, 16)
    seen = []
    forward = head.net.forward
    head.net.forward = lambda x_t, t, c: (seen.append(t), forward(x_t, t, c))[1]
    head.loss(x, z, generator=torch.Generator().manual_seed(2), last_step_prob=1.0)
    assert (seen[0] == TRAIN_STEPS - 1).all()
    head.loss(x, z, generator=torch.Generator().manual_seed(2))
    assert len(set(seen[1].tolist())) > 32                     # MAR's uniform t otherwise
    del head.net.forward
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    plain = head.loss(x, z, generator=g())
    assert torch.allclose(head.loss(x, z, generator=g(), teacher=(head, z, 1.0)), plain)
    assert head.loss(x, z, generator=g(), teacher=(other, z, 1.0)) > plain + 1e-3


def test_auxiliary_token_regression_adds_its_weighted_mse():
    """MAR.loss `aux` (training only): the loss grows by weight * MSE(probe(z), masked tokens), linear in the
    weight, and its gradient reaches the transformer (the point of it), not only the probe."""
    m = randomize(MAR(MARArgs(img_size=64, vae_stride=16, encoder_embed_dim=32, encoder_depth=1, encoder_num_heads=2,
                              decoder_embed_dim=32, decoder_depth=1, decoder_num_heads=2, vae_embed_dim=4, class_num=3,
                              buffer_size=2, diffloss_d=1, diffloss_w=16)), 0)
    probe = torch.nn.Linear(32, 4)
    tokens, buf = torch.randn(3, 16, 4), m.buffer(labels=torch.tensor([0, 1, 2]))
    g = lambda: torch.Generator().manual_seed(5)  # noqa: E731
    l0, l1, l2 = (m.loss(tokens, buf, generator=g(), aux=None if w == 0 else (probe, w)) for w in (0, 1.0, 2.0))
    assert l1 > l0 + 1e-3 and torch.allclose(l2 - l0, 2 * (l1 - l0), rtol=1e-4)
    (l1 - l0).backward()
    assert m.decoder_blocks[0].mlp.fc1.weight.grad.abs().sum() > 0


# -- MAR checkpoints as a user meets them: inspect_checkpoint and the driver's checks ------------------------
def test_inspect_checkpoint_identifies_mar_and_kl_vae_files_and_prints_their_settings(public):
    from workflows.inspect_checkpoint import inspect as inspect_file, report
    d = public[0]
    mar = inspect_file(str(d / "target.pth"))
    assert mar["kind"] == "mar" and mar["container"] == "model_ema" and mar["dims"]["encoder_embed_dim"] == 48
    assert mar["settings"].startswith(f"model=mar model.mar_ckpt={d / 'target.pth'} model.vae_ckpt=")
    assert "model.num_heads=" in mar["settings"]                      # width 48 is no preset: heads not in weights
    vae = inspect_file(str(d / "kl16.ckpt"))
    assert vae["kind"] == "kl_vae" and vae["dims"]["embed_dim"] == 4 and vae["settings"].startswith(f"model.vae_ckpt={d / 'kl16.ckpt'}")
    text = report(mar)
    assert "not a LlamaGen" not in text and "MAR (LTH14/mar layout" in text and "load it with: model=mar" in text
    from decoding.mar.family import WEIGHTS
    assert inspect_file(str(WEIGHTS / "mar.safetensors"))["settings"] == f"model=mar model.weights_dir={WEIGHTS}"


def _vae8(path: Path) -> Path:
    vae = randomize(AutoencoderKL(VAEArgs(**{**SMALL_VAE, "embed_dim": 8})), 0, std=0.02)
    torch.save({"model": vae.state_dict()}, path)
    return path


@pytest.mark.parametrize("case", ["no_vae", "odd_width", "vae_channels", "cspd_no_draft"])
def test_driver_refuses_wrong_mar_settings_in_one_line_before_anything_starts(public, tmp_path, case):
    """As for LlamaGen: the checkpoints are checked in the driver (headers, meta device) before Ray starts,
    one line naming the setting and the fix, and nothing is written to out_dir."""
    import subprocess
    import sys
    d = public[0]
    args = {"engine": "mar", "model.mar_ckpt": d / "target.pth", "model.vae_ckpt": d / "kl16.ckpt", "model.num_heads": 4}
    want = {"no_vae": "model.vae_ckpt is not set: a MAR checkpoint needs the KL VAE it was trained on (kl16.ckpt)",
            "odd_width": f"model.mar_ckpt={d / 'target.pth'}: a MAR of width 48 is none of the presets "
                         f"([768, 1024, 1280]): set model.num_heads",
            "vae_channels": f"model.vae_ckpt={tmp_path / 'vae8.ckpt'}: it makes 8-channel latents and "
                            f"model.mar_ckpt={d / 'target.pth'} reads 4-channel tokens",
            "cspd_no_draft": "engine cspd needs a draft MAR and the model has none"}[case]
    if case == "no_vae":
        del args["model.vae_ckpt"]
    elif case == "odd_width":
        del args["model.num_heads"]
    elif case == "vae_channels":
        args["model.vae_ckpt"] = _vae8(tmp_path / "vae8.ckpt")
    else:
        args["engine"] = "cspd"
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "workflows.generate", *(f"{k}={v}" for k, v in args.items()),
                          f"out_dir={out}", "data.limit=1"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1], timeout=300)
    err = res.stderr.strip().splitlines()
    assert res.returncode == 2 and err[-1].startswith("error: ") and want in err[-1], res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "ray" not in res.stderr.lower()
    assert not out.exists() or not any(out.iterdir())


def test_driver_check_passes_good_checkpoints_and_says_whether_there_is_a_draft(public):
    """... and the target's tokens per image (engine.num_iter is checked against them in the driver)."""
    from decoding.mar.family import check
    d = public[0]
    base = dict(mar_ckpt=str(d / "target.pth"), vae_ckpt=str(d / "kl16.ckpt"), num_heads=4)
    assert check(MarConfig(**base)) == {"drafter": False, "seq_len": 16}
    assert check(MarConfig(**base, draft_mar_ckpt=str(d / "draft.pth"))) == {"drafter": True, "seq_len": 16}
    assert check(MarConfig()) == {"drafter": True, "seq_len": 256}     # the shipped models
