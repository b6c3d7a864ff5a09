"""LlamaGen checkpoints (issue 12): random-weight files written in every public layout and container load
through model=llamagen_c2i / llamagen_t2i and generate with vanilla, eagle2 and adt_tree; greedy decoding
reproduces LlamaGen's own generation loop token for token (tests/fixtures/llamagen_greedy.json, made by
tests/fixtures/make_llamagen_greedy.py); bad files fail in one line; FLAN-T5 features through a tiny
randomly initialised T5; class-id prompts; the drafter stage for a LlamaGen target; inspect_checkpoint."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from decoding.bundle import Conditions
from decoding.checkpoint import save_module
from decoding.engines import build_engine, engine_config
from decoding.llamagen.bundle import class_ids, compile_forwards
from decoding.llamagen.layouts import describe
from decoding.llamagen.load import LanternDrafter
from decoding.models.drafter import Drafter, DrafterArgs
from decoding.models.gpt import GPT, GPTArgs, causal_mask
from decoding.models.vq import VQArgs, VQModel
from decoding.registry import load_bundle
from tests.conftest import COSTS, REPO
from tests.llamagen_layouts import (drafter_weights, gpt_weights, save, small_c2i, small_t2i, to_hf, vq_weights)

FIXTURE = REPO / "tests" / "fixtures" / "llamagen_greedy.json"
TREE = dict(total_tokens=8, depth=3, width=3, costs=COSTS)   # small trees: the 16-token images finish in a few steps


def one_line(e) -> str:
    text = str(e.value)
    assert "\n" not in text, text
    return text


@pytest.fixture(scope="module")
def c2i_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("llamagen-c2i")
    cfg = small_c2i()
    gpt, vq = gpt_weights(cfg), vq_weights(cfg)
    files = {"gpt": save(gpt, d / "c2i_gpt.pt"), "vq": save(vq, d / "vq_ds16_c2i.pt"), "weights": gpt}
    files["drafter"] = save_module(_drafter(cfg, 2), d / "drafter.safetensors", dtype=torch.float32)
    return d, files


def _drafter(cfg, seed) -> Drafter:
    from decoding.llamagen.config import gpt_args
    m = Drafter(DrafterArgs.for_target(gpt_args(cfg)))
    m.load_state_dict(drafter_weights(cfg, seed))
    return m.eval()


def c2i_cfg(files, **kw):
    d, f = files
    return small_c2i(**{"gpt_ckpt": str(f["gpt"]), "vq_ckpt": str(f["vq"]), **kw})


# -- public layouts and containers ---------------------------------------------------------------------
@pytest.mark.parametrize("container, key", [("model", None), ("ema", "ema"), ("module", None), ("state_dict", None),
                                            ("raw", None), ("safetensors", None)])
def test_every_public_container_loads_the_exact_weights(c2i_files, tmp_path, container, key):
    """DDP {"model", "optimizer", "steps", "args": Namespace}, {"model", "ema"} with model.gpt_weights_key=ema,
    DeepSpeed {"module"}, {"state_dict"}, raw FSDP exports and safetensors; a stray freqs_cis (the
    reference's loaders pop it) is a derived buffer, not a weight."""
    sd = dict(c2i_files[1]["weights"])
    sd["freqs_cis"] = torch.zeros(17, 8, 2)
    path = save(sd, tmp_path / ("gpt.safetensors" if container == "safetensors" else "gpt.pt"), container)
    bundle = load_bundle(replace(c2i_cfg(c2i_files), gpt_ckpt=str(path), gpt_weights_key=key))
    loaded = bundle.gpt.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in c2i_files[1]["weights"].items())
    if container == "ema":   # by default LlamaGen's sampler order: "model" before "ema" (here zeros)
        plain = load_bundle(replace(c2i_cfg(c2i_files), gpt_ckpt=str(path))).gpt
        assert torch.count_nonzero(plain.output.weight) == 0
    assert bundle.gpt.args.model_type == "c2i" and bundle.gpt.output.weight.dtype == torch.float32


def test_c2i_generates_with_vanilla_eagle2_and_adt_tree(c2i_files):
    bundle = load_bundle(c2i_cfg(c2i_files, drafter_ckpt=str(c2i_files[1]["drafter"])))
    assert bundle.sampling.cfg_scale == 4.0 and bundle.sampling.top_k == 2000   # LlamaGen's c2i defaults
    cond = bundle.conditions([3, "7"])
    for name in ("vanilla", "eagle2", "adt_tree"):
        res = build_engine(bundle, engine_config(name, **({} if name == "vanilla" else TREE))).generate(cond, [5, 6])
        assert [r.image.shape for r in res] == [(64, 64, 3)] * 2 and all(len(r.tokens) == 16 for r in res)
        assert all(0 <= t < 128 for r in res for t in r.tokens)
        assert (res[0].draft_forwards > 0) == (name != "vanilla")


def test_eagle_lantern_drafter_layout_and_hf_gpt_layout(c2i_files, tmp_path):
    """An EAGLE/LANTERN drafter directory (pytorch_model.bin in Hugging Face Llama names with its copy of
    the target's embed_tokens, config.json) computes what the same weights do in our layout; LANTERN's
    converted GPT (model.*, lm_head) loads the same weights as LlamaGen's own file."""
    cfg = small_c2i()
    ours = _drafter(cfg, 2)
    d = tmp_path / "lantern-drafter"
    d.mkdir()
    hf = to_hf(ours.state_dict(), 64)
    hf["embed_tokens.weight"] = c2i_files[1]["weights"]["tok_embeddings.weight"].half()
    torch.save(hf, d / "pytorch_model.bin")
    (d / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "rms_norm_eps": 1e-5,
                                               "num_hidden_layers": 1}))
    hf_gpt = save(to_hf(c2i_files[1]["weights"], 64, prefix="model."), tmp_path / "hf_gpt.safetensors", "safetensors")
    bundle = load_bundle(c2i_cfg(c2i_files, drafter_ckpt=str(d), gpt_ckpt=str(hf_gpt)))
    assert all(torch.equal(bundle.gpt.state_dict()[k], v) for k, v in c2i_files[1]["weights"].items())
    drafter = bundle.drafter
    assert isinstance(drafter, LanternDrafter)
    emb, feat = torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    pos = torch.arange(1, 6).expand(2, 5)
    mask = causal_mask(5, None, "cpu").expand(2, -1, -1)
    with torch.no_grad():
        assert torch.allclose(drafter(emb, feat, pos, mask), ours(emb, feat, pos, mask), atol=1e-5)
    r = build_engine(bundle, engine_config("eagle2", **TREE)).generate(bundle.conditions([1]), [0])[0]
    assert len(r.tokens) == 16


def test_lantern_drafter_reads_token_zero_at_condition_rows():
    """LANTERN's input ids are zeros over the caption: a row whose next position is in the condition gets
    the embedding of token 0, the others their own."""
    a = DrafterArgs(dim=32, n_head=2, block_size=4, cls_token_num=3)
    cond_token = torch.randn(32)
    m = LanternDrafter(a, cond_token).eval()
    plain = Drafter(a).eval()
    plain.load_state_dict(m.state_dict())
    emb, feat = torch.randn(1, 6, 32), torch.randn(1, 6, 32)
    pos = torch.arange(1, 7)[None]                                  # rows carry positions 1..6; 1, 2 < L = 3
    mask = causal_mask(6, None, "cpu")
    swapped = emb.clone()
    swapped[:, :2] = cond_token
    with torch.no_grad():
        assert torch.allclose(m(emb, feat, pos, mask), plain(swapped, feat, pos, mask), atol=1e-6)


# -- the reference: LlamaGen's own generation loop -------------------------------------------------------
@pytest.mark.parametrize("family", ["c2i", "c2i_large", "t2i"])
def test_greedy_decoding_reproduces_llamagen_token_for_token(tmp_path, family):
    """c2i_large has LlamaGen's 16,384 codes and 256 tokens: greedy decoding (top-k 1) leaves 16,383 codes of
    zero mass at every draw, so a sampler that draws one of them once in ~1,000 draws fails it."""
    from tests.fixtures.make_llamagen_greedy import C2I, C2I_LARGE, T2I, captions, checksum
    fx = json.loads(FIXTURE.read_text())[family]
    cfg = {"c2i": lambda: small_c2i(**C2I), "c2i_large": lambda: small_c2i(**C2I_LARGE),
           "t2i": lambda: small_t2i(**T2I)}[family]()
    weights = gpt_weights(cfg)
    assert checksum(weights) == pytest.approx(fx["weights_checksum"], rel=1e-12)   # the same random weights
    cfg = replace(cfg, gpt_ckpt=str(save(weights, tmp_path / "gpt.pt")), vq_ckpt=str(save(vq_weights(cfg), tmp_path / "vq.pt")))
    if family != "t2i":
        bundle = load_bundle(cfg)
        cond = bundle.conditions(fx["labels"])
    else:   # the caption features LlamaGen's sampler hands to generate(), without a T5
        from decoding.llamagen.bundle import LlamaGenBundle
        from decoding.llamagen.load import load_gpt, load_vq
        from decoding.llamagen.t2i import SAMPLING
        bundle = LlamaGenBundle("t2i", load_vq(cfg), load_gpt(cfg, torch.float32), None, "cpu", "float32", SAMPLING)
        feats, mask = captions(cfg)
        cond = Conditions(feats, mask.bool(), [])
    for scale, expected in fx["runs"].items():
        engine = build_engine(bundle, engine_config("vanilla", sampling={"top_k": 1, "cfg_scale": float(scale)}))
        with torch.inference_mode():   # the tokens only (generate would also decode the images)
            got = engine.tokens(cond, range(len(expected))).tokens.tolist()
        assert got == expected, f"cfg {scale}"


# -- bad files: one line each ----------------------------------------------------------------------------
def test_corrupted_wrong_family_and_wrong_shape_checkpoints_fail_in_one_line(c2i_files, tmp_path):
    cfg = c2i_cfg(c2i_files)
    gpt_bytes = Path(c2i_files[1]["gpt"]).read_bytes()
    (tmp_path / "truncated.pt").write_bytes(gpt_bytes[: len(gpt_bytes) // 2])
    (tmp_path / "garbage.safetensors").write_bytes(b"\x00" * 64)

    class Evil:
        def __reduce__(self):
            return (eval, ("print('pwned')",))
    torch.save({"model": c2i_files[1]["weights"], "hook": Evil()}, tmp_path / "evil.pt")

    class Blocked:             # a module torch blocks outright: once reported as a corrupted file
        def __reduce__(self):
            return (os.system, ("echo pwned",))
    torch.save({"model": c2i_files[1]["weights"], "hook": Blocked()}, tmp_path / "blocked.pt")
    t2i = save(gpt_weights(small_t2i()), tmp_path / "t2i.pt")
    bigger = save(gpt_weights(small_c2i(n_layer=3, dim=96)), tmp_path / "bigger.pt")

    cases = [(dict(gpt_ckpt=str(tmp_path / "truncated.pt")), r"model.gpt_ckpt=.*truncated.pt: not a readable checkpoint"),
             (dict(vq_ckpt=str(tmp_path / "garbage.safetensors")), r"model.vq_ckpt=.*: not a readable safetensors file"),
             (dict(gpt_ckpt=str(tmp_path / "evil.pt")), r"holds Python objects a weights-only load refuses \((builtins\.)?eval\)"),
             (dict(gpt_ckpt=str(tmp_path / "blocked.pt")), r"holds Python objects a weights-only load refuses "
                                                           r"\((posix|os)\.system\): the safety check"),
             (dict(gpt_ckpt=cfg.vq_ckpt), r"holds a LlamaGen VQ image tokenizer .*not a LlamaGen GPT, class-conditional; "
                                          r"it belongs in model.vq_ckpt="),
             (dict(gpt_ckpt=str(t2i)), r"holds a LlamaGen GPT, text-conditional .*it belongs in model=llamagen_t2i"),
             (dict(vq_ckpt=cfg.gpt_ckpt), r"model.vq_ckpt=.*holds a LlamaGen GPT, class-conditional"),
             (dict(gpt_ckpt=str(bigger)), r"does not fit: unexpected layers.2.attention.wo.weight, .*shape mismatch "
                                          r".*\[11, 96\] \(expected \[11, 64\]\).*set model.dim=96 model.n_layer=3"),
             (dict(num_classes=20), r"shape mismatch cls_embedding.embedding_table.weight \[11, 64\] \(expected \[21, 64\]\)"
                                    r".*set model.num_classes=10"),
             (dict(vq_num_res_blocks=2), r"model.vq_ckpt=.*does not fit: missing decoder.conv_blocks.*set model.vq_num_res_blocks=1"),
             (dict(gpt_ckpt=None), r"model.gpt_ckpt is not set"),
             (dict(gpt_weights_key="ema"), r"has no weights under 'ema'; its entries are \['args', 'model', 'optimizer', 'steps'\]"),
             (dict(gpt_model="GPT-Z", dim=None), r"model.gpt_model='GPT-Z'"),
             (dict(image_size=72), r"model.image_size=72: must be a multiple of the VQ's downsampling \(16\)")]
    for overrides, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            load_bundle(replace(cfg, **overrides))
        one_line(e)
    with pytest.raises(FileNotFoundError, match="model.gpt_ckpt=.*nope.pt: no such file"):
        load_bundle(replace(cfg, gpt_ckpt=str(tmp_path / "nope.pt")))


def _hint(e) -> dict:
    """The settings a load error's hint says to set, as C2IConfig fields ("set model.dim=96 ...; see ...")."""
    import re
    said = one_line(e).split(": set ", 1)[1].split("; see ")[0]
    return {k: int(v) for k, v in re.findall(r"model\.(\w+)=(\d+)", said)}


def test_the_gpt_dims_hint_names_every_setting_it_needs_and_applying_it_loads(c2i_files, tmp_path):
    """A GPT of no preset's dims: the hint names dim, n_layer and n_head (the old one left n_head out, and the
    preset's head count then failed in a line blaming model.n_head, which the user never set). The head count
    comes from the checkpoint where it records one (a RoPE table), else is a guess said to be one; either way
    the settings the hint names load the file."""
    cfg = c2i_cfg(c2i_files)
    sd = gpt_weights(small_c2i(n_layer=3, dim=96, n_head=4))
    plain = save(sd, tmp_path / "plain.pt", "raw")
    rope = save({**sd, "freqs_cis": torch.zeros(1 + 16, 12, 2)}, tmp_path / "rope.pt", "raw")  # 24-wide heads
    for path, heads in ((plain, 2), (rope, 4)):
        with pytest.raises(ValueError, match=r"does not fit: .*set model.dim=96 model.n_layer=3 model.n_head=") as e:
            load_bundle(replace(cfg, gpt_ckpt=str(path)))
        fix = _hint(e)
        assert fix == {"dim": 96, "n_layer": 3, "n_head": heads}
        assert ("assumed" in one_line(e)) == (path == plain)
        assert load_bundle(replace(cfg, gpt_ckpt=str(path), **fix)).gpt.args.n_head == heads
    # the dims alone, with the preset's head count: the line names the setting given and the one to add
    with pytest.raises(ValueError, match=r"^model.dim=100: GPT-B's 12 heads \(model.n_head is not set\) do not split it "
                                         r".*set model.n_head too, e.g. model.n_head=5 \(20-wide heads\)$") as e:
        load_bundle(replace(cfg, gpt_ckpt=str(plain), dim=100, n_layer=3, n_head=None))
    one_line(e)


def test_an_image_size_the_checkpoint_records_is_enforced_and_one_it_does_not_is_said_once(c2i_files, tmp_path, caplog):
    """LlamaGen's GPT weights do not depend on the image size, so a wrong model.image_size loaded silently and
    decoded another grid. Where the checkpoint records it (a RoPE table's rows, saved training args, a LlamaGen
    file name) another size is one line naming model.image_size; where nothing does, a warning says once
    which size is assumed."""
    import logging
    from argparse import Namespace
    from decoding.checkpoint import Checkpoint
    from decoding.llamagen.config import gpt_args
    cfg = c2i_cfg(c2i_files)                                   # 64 px: 4x4 tokens of VQ-16
    sd = c2i_files[1]["weights"]
    rope = save({**sd, "freqs_cis": torch.zeros(1 + 64, 8, 2)}, tmp_path / "rope.pt", "raw")      # an 8x8 grid
    named = save(sd, tmp_path / "c2i_S_128.pt", "raw")
    for path, how in ((rope, "its RoPE table"), (named, "its file name")):
        with pytest.raises(ValueError, match=rf"^model.image_size=64: model.gpt_ckpt={path} was trained at 128 px "
                                             rf"\({how}\): set model.image_size=128$") as e:
            load_bundle(replace(cfg, gpt_ckpt=str(path)))
        assert load_bundle(replace(cfg, gpt_ckpt=str(path), **_hint(e))).gpt.args.grid_size == 8
    caplog.set_level(logging.WARNING, logger="arspec.model")
    quiet = save(sd, tmp_path / "mine.pt", "raw")
    for _ in range(2):
        load_bundle(replace(cfg, gpt_ckpt=str(quiet)))
    said = [r.getMessage() for r in caplog.records if r.name == "arspec.model"]
    assert said == [f"model.image_size=64 assumed: model.gpt_ckpt={quiet} does not record the size it was trained "
                    f"at (no RoPE table or saved args, no size in its name as in c2i_L_384.pt); set model.image_size "
                    f"if it is another"]
    from decoding.llamagen.load import recorded
    with torch.device("meta"):                                 # saved training args, where they are this GPT's
        big = GPT(GPTArgs.from_name("GPT-B", block_size=256)).state_dict()
    ck = Checkpoint(big, "model", ["args", "model"], "torch", {"args": Namespace(gpt_model="GPT-B", image_size=256)})
    rec = recorded(ck, describe(big), gpt_args(small_c2i()), "ckpt.pt")
    assert rec["size"] == (256, "its saved args") and rec["heads"][0] == 12


def test_drafter_for_another_target_or_wrong_embeddings_is_refused(c2i_files, tmp_path):
    other = save_module(_drafter(small_c2i(image_size=128), 2), tmp_path / "d128.safetensors", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"was trained for another target \(block_size 64 \(target: 16\)\).*"
                                         r"stages=\[drafter\] model=llamagen_c2i") as e:
        load_bundle(c2i_cfg(c2i_files, drafter_ckpt=str(other)))
    one_line(e)
    hf = to_hf(_drafter(small_c2i(), 2).state_dict(), 64)
    hf["embed_tokens.weight"] = torch.randn(128, 64)
    torch.save(hf, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="embed_tokens .* are not the target's tok_embeddings") as e:
        load_bundle(c2i_cfg(c2i_files, drafter_ckpt=str(tmp_path / "pytorch_model.bin")))
    one_line(e)
    with pytest.raises(ValueError, match=r"model.drafter_ckpt=.*holds a LlamaGen VQ"):
        load_bundle(c2i_cfg(c2i_files, drafter_ckpt=str(c2i_files[1]["vq"])))


def test_tree_engines_without_a_drafter_name_both_ways_out(c2i_files):
    bundle = load_bundle(c2i_cfg(c2i_files))
    for name in ("eagle2", "adt_tree"):
        with pytest.raises(ValueError, match=r"drafts trees with a drafter, and the model has none: set "
                                             r"engine.total_tokens=0 .*, or use engine=auto, or train one \(python "
                                             r"-m workflows.train stages=\[drafter\]\)") as e:
            build_engine(bundle, engine_config(name))
        one_line(e)
        assert build_engine(bundle, engine_config(name, total_tokens=0)).drafter is None   # chains alone: no drafter


def test_the_job_reports_a_bad_checkpoint_in_one_line(c2i_files, tmp_path):
    (tmp_path / "bad.pt").write_bytes(b"not a checkpoint")
    r = subprocess.run([sys.executable, "-m", "workflows.generate", "model=llamagen_c2i", f"model.gpt_ckpt={tmp_path / 'bad.pt'}",
                        f"model.vq_ckpt={c2i_files[1]['vq']}", "data=imagenet_classes", "data.classes=[1]",
                        f"out_dir={tmp_path / 'out'}"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.gpt_ckpt=") and "not a readable checkpoint" in lines[0]


def test_the_job_refuses_prompts_the_model_cannot_take_before_any_actor_starts(c2i_files, tmp_path):
    """Text prompts for a class-conditional model (a caption file with model=llamagen_c2i): one line from
    the driver's checking pass over the streamed prompts (no weights loaded), not a traceback per prompt
    from the actors."""
    from hydra import compose, initialize_config_dir
    from workflows.config import ConfigError, register, to_object
    from workflows.generate import plan_job, validate
    register()
    f = c2i_files[1]
    good, bad = tmp_path / "good.json", tmp_path / "bad.json"
    good.write_text(json.dumps(["3", 7]))
    bad.write_text(json.dumps(["3", "a red cat"]))

    def config(path, out):
        with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
            cfg = compose("generate", overrides=[
                "model=llamagen_c2i", f"model.gpt_ckpt={f['gpt']}", f"model.vq_ckpt={f['vq']}", "model.dim=64",
                "model.n_layer=2", "model.n_head=4", "model.codebook_size=128", "model.vq_ch=32",
                "model.vq_z_channels=32", "model.vq_num_res_blocks=1", "model.image_size=64", "model.num_classes=10",
                "data=file", f"data.path={path}", f"out_dir={tmp_path / out}"])
        return to_object(cfg)
    c = config(good, "good")
    validate(c)
    assert plan_job(c).stats.pending == 2
    with pytest.raises(ConfigError, match=r"prompt 'a red cat' is not a class id of this model: valid ids are 0..9 "
                       r"\(model.num_classes=10\); fix data.classes") as e:
        plan_job(config(bad, "bad"))
    one_line(e)
    assert not (tmp_path / "bad" / "job.json").exists()     # refused before the out_dir was claimed


# -- presets and the inspector ---------------------------------------------------------------------------
@pytest.mark.parametrize("preset, heads", [("GPT-B", 12), ("GPT-L", 16), ("GPT-XL", 20), ("GPT-XXL", 24), ("GPT-3B", 32)])
def test_presets_are_recognised_from_shapes_alone(preset, heads):
    with torch.device("meta"):   # shapes only: no memory for billions of parameters
        sd = GPT(GPTArgs.from_name(preset, block_size=576)).state_dict()
    d = describe(sd)
    assert (d["kind"], d["preset"], d["n_head"], d["num_classes"], d["vocab_size"], d["ffn_is_llamagen"]) == \
        ("gpt_c2i", preset, heads, 1000, 16384, True)


def test_vq_presets_are_recognised():
    for preset, mult in (("VQ-16", [1, 1, 2, 2, 4]), ("VQ-8", [1, 2, 2, 4])):
        with torch.device("meta"):
            d = describe(VQModel(VQArgs(ch_mult=mult)).state_dict())
        assert (d["kind"], d["preset"], d["codebook_size"], d["codebook_embed_dim"], d["downsample"]) == \
            ("vq", preset, 16384, 8, 2 ** (len(mult) - 1))


def test_inspect_checkpoint_says_what_a_file_is(c2i_files, tmp_path, capsys):
    from workflows.inspect_checkpoint import main
    assert main([str(c2i_files[1]["gpt"]), str(c2i_files[1]["vq"]), str(c2i_files[1]["drafter"])]) == 0
    out = capsys.readouterr().out
    assert "weights under 'model'" in out and "LlamaGen GPT, class-conditional" in out and "10 classes" in out
    assert "saved training args: {'gpt_model': 'GPT-B', 'image_size': 256" in out
    assert "derived buffers ignored: ['quantize.codebook_used']" in out and "preset: VQ-16" in out
    assert f"load it with: model=llamagen_c2i model.gpt_ckpt={c2i_files[1]['gpt']} model.dim=64 model.n_layer=2 " \
           f"model.n_head=1 model.image_size=<the size" in out          # its saved args are another GPT's: not its size
    assert "heads not recorded: LlamaGen's are 64 wide" in out and "image size: not recorded" in out
    assert "EAGLE drafter" in out and f"model.drafter_ckpt={c2i_files[1]['drafter']}" in out
    (tmp_path / "junk.pt").write_bytes(b"junk")
    assert main([str(tmp_path / "junk.pt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a readable checkpoint" in err[0]


# -- conditions: class ids, FLAN-T5 ----------------------------------------------------------------------
def test_class_ids():
    assert class_ids([3, "7", " 9 "], 10) == [3, 7, 9]
    for bad in ("a cat", 10, -1, True, "3.5"):
        with pytest.raises(ValueError, match=r"is not a class id of this model: valid ids are 0..9 \(model.num_classes=10\); "
                                            r"fix data.classes \(data=imagenet_classes\) or the class_id column"):
            class_ids([bad], 10)


def test_prompt_readers_take_class_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from workflows.config import ConfigError, DataConfig
    from workflows.prompts import read_prompts
    (tmp_path / "c.csv").write_text("class_id\n207\n360\n")
    pq.write_table(pa.Table.from_pylist([{"key": "a", "class_id": 207}, {"key": "b", "class_id": 88}]), tmp_path / "c.parquet")
    (tmp_path / "c.json").write_text("[207, 3]")
    assert [r["prompt"] for r in read_prompts(DataConfig(name="file", path=str(tmp_path / "c.csv")))] == ["207", "360"]
    rows = read_prompts(DataConfig(name="file", path=str(tmp_path / "c.parquet"), id_column="key"))
    assert [(r["prompt_id"], r["prompt"]) for r in rows] == [("a", "207"), ("b", "88")]
    assert [r["prompt"] for r in read_prompts(DataConfig(name="file", path=str(tmp_path / "c.json")))] == ["207", "3"]
    rows = read_prompts(DataConfig(name="imagenet_classes", classes=[5, 1], per_class=2))
    assert [(r["prompt_id"], r["prompt"]) for r in rows] == [("class0005-000", "5"), ("class0005-001", "5"),
                                                              ("class0001-000", "1"), ("class0001-001", "1")]
    assert len(read_prompts(DataConfig(name="imagenet_classes"))) == 1000
    for bad, message in ((dict(per_class=0), "data.per_class=0"), (dict(classes=[1, 1]), "distinct class ids"),
                         (dict(classes=[-2]), "got -2")):
        with pytest.raises(ConfigError, match=message):
            read_prompts(DataConfig(name="imagenet_classes", **bad))


def tiny_t5(d: Path, d_model: int = 16) -> Path:
    """A randomly initialised T5 encoder and a word-level tokenizer that appends </s>, saved as a local
    model directory in LlamaGen's layout (pretrained_models/t5-ckpt/flan-t5-xl)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast, T5Config, T5EncoderModel
    words = ["<pad>", "</s>", "<unk>", "a", "red", "cat", "dog", "on", "the", "mat", "blue"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", 1)])
    out = d / "flan-t5-xl"
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>", unk_token="<unk>").save_pretrained(out)
    torch.manual_seed(0)
    T5EncoderModel(T5Config(vocab_size=len(words), d_model=d_model, d_kv=4, d_ff=32, num_layers=1, num_heads=2)).save_pretrained(out)
    return d


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    pytest.importorskip("transformers")
    return tiny_t5(tmp_path_factory.mktemp("t5-ckpt"))


def test_t5_features_are_left_padded_like_llamagen(t5_dir):
    from transformers import T5EncoderModel
    from decoding.llamagen.t5 import T5Features
    t5 = T5Features(t5_dir, 6, "cpu", torch.float32)
    feats, mask = t5(["A red cat ", "the dog on the mat blue blue"])
    assert mask.tolist() == [[False, False, True, True, True, True], [True] * 6]   # 3 words + </s>; truncated
    ref = T5EncoderModel.from_pretrained(t5_dir / "flan-t5-xl").eval()
    with torch.no_grad():   # right-padded ids [a red cat </s> <pad> <pad>], encoded under the mask
        h = ref(input_ids=torch.tensor([[3, 4, 5, 1, 0, 0]]), attention_mask=torch.tensor([[1, 1, 1, 1, 0, 0]])).last_hidden_state
    assert torch.allclose(feats[0, 2:], h[0, :4], atol=1e-6) and torch.count_nonzero(feats[0, :2]) == 0


def test_t2i_generates_from_text_through_t5(t5_dir, tmp_path):
    cfg = small_t2i(cls_token_num=8, t5_path=str(t5_dir))
    sd = gpt_weights(cfg)
    cfg = replace(cfg, gpt_ckpt=str(save(sd, tmp_path / "t2i.pt")), vq_ckpt=str(save(vq_weights(cfg), tmp_path / "vq.pt")),
                  drafter_ckpt=str(save_module(_drafter(cfg, 3), tmp_path / "d.safetensors", dtype=torch.float32)))
    bundle = load_bundle(cfg)
    assert (bundle.sampling.cfg_scale, bundle.sampling.top_k) == (7.5, 1000)       # LlamaGen's t2i defaults
    cond = bundle.conditions(["a red cat", "a blue dog on the mat"])
    assert cond.features.shape == (2, 8, 16) and cond.mask.sum(1).tolist() == [4, 7]
    res = build_engine(bundle, engine_config("vanilla")).generate(cond, [1, 2])
    for name in ("eagle2", "adt_tree"):
        one = bundle.conditions(["a red cat"])
        res += build_engine(bundle, engine_config(name, **TREE)).generate(one, [1])
    assert all(len(r.tokens) == 16 and r.image.shape == (64, 64, 3) for r in res) and res[-1].draft_forwards > 0
    with pytest.raises(ValueError, match="its d_model is 16, the GPT reads model.caption_dim=32") as e:
        load_bundle(replace(cfg, caption_dim=32))
    one_line(e)


def test_t5_missing_extra_or_path_is_one_line(monkeypatch, tmp_path):
    from decoding.llamagen.t5 import T5Features
    with pytest.raises(FileNotFoundError, match=r"model.t5_path=.*: no T5 model there") as e:
        T5Features(tmp_path, 120, "cpu", torch.float32)
    one_line(e)
    with pytest.raises(ValueError, match="model.t5_path is not set"):
        load_bundle(small_t2i(gpt_ckpt="x.pt", vq_ckpt="y.pt"))
    monkeypatch.setitem(sys.modules, "transformers", None)                     # the extra is not installed
    with pytest.raises(ValueError, match=r'needs the optional transformers extra: pip install -e "\.\[t5\]"') as e:
        T5Features(tmp_path, 120, "cpu", torch.float32)
    one_line(e)


# -- the GPU path, as far as a CPU can check it ------------------------------------------------------------
def test_compiled_forwards_trace_whole_and_give_the_same_tokens(c2i_files):
    """model.compile wraps the forwards in torch.compile (dynamic shapes). fullgraph=True: no graph break
    anywhere in a decode step; the `eager` backend checks the trace here without a C++ or GPU compiler."""
    torch._dynamo.reset()
    bundle = load_bundle(c2i_cfg(c2i_files))
    engine = build_engine(bundle, engine_config("vanilla"))
    cond = bundle.conditions([2, 5])
    with torch.inference_mode():
        ref = engine.tokens(cond, [1, 2]).tokens
        compile_forwards(bundle, backend="eager", fullgraph=True)
        assert "forward_embeds" in vars(bundle.gpt)                 # the instance now calls the compiled one
        assert torch.equal(engine.tokens(cond, [1, 2]).tokens, ref)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    torch._dynamo.reset()


def test_bf16_load_keeps_the_rope_table(c2i_files):
    b = load_bundle(c2i_cfg(c2i_files, dtype="bfloat16", drafter_ckpt=str(c2i_files[1]["drafter"])))
    assert b.gpt.output.weight.dtype == b.drafter.fc.weight.dtype == torch.bfloat16 and b.vq.decoder.conv_in.weight.dtype == torch.float32
    ref = load_bundle(c2i_cfg(c2i_files))
    assert b.gpt.rope.dtype == torch.complex64 and torch.equal(b.gpt.rope, ref.gpt.rope)
    assert not any(t.is_meta for t in [*b.gpt.state_dict().values(), b.gpt.rope, b.drafter.rope])


# -- drafter training for a LlamaGen target --------------------------------------------------------------
def test_drafter_stage_trains_one_for_a_c2i_target(c2i_files, tmp_path):
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from workflows.config import register, to_object
    from workflows.training.drafter import conditions_set, train_drafter
    register()
    d, f = c2i_files
    model_args = [f"model.gpt_ckpt={f['gpt']}", f"model.vq_ckpt={f['vq']}", "model.dim=64", "model.n_layer=2",
                  "model.n_head=4", "model.codebook_size=128", "model.vq_ch=32", "model.vq_z_channels=32",
                  "model.vq_num_res_blocks=1", "model.image_size=64", "model.num_classes=10", "model.dtype=float32",
                  "model.device=cpu"]
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = compose("train", overrides=["model=llamagen_c2i", *model_args, "drafter.train_images=4",
                                          "drafter.eval_images=2", "drafter.gen_batch=4", "drafter.steps=3",
                                          "drafter.batch=4", "drafter.log_every=1"])
    model = to_object(cfg.model)
    metrics = train_drafter(cfg.drafter, tmp_path, model=model)
    assert 0 <= metrics["top1"] <= 1 and metrics["feat"] > 0
    trained = load_bundle(replace(model, drafter_ckpt=str(tmp_path / "drafter.safetensors")))
    ids = conditions_set(model, trained, cfg.drafter, 50, 0)
    assert all(isinstance(c, int) and 0 <= c < 10 for c in ids) and len(set(ids)) > 3
    assert trained.drafter.args.block_size == 16
    assert len(build_engine(trained, engine_config("eagle2", **TREE)).generate(trained.conditions([4]), [0])[0].tokens) == 16
    from workflows.config import ConfigError
    t2i_bundle = SimpleNamespace(gpt=SimpleNamespace(args=GPTArgs(model_type="t2i")))
    with pytest.raises(ConfigError, match="drafter.prompts is not set: model=llamagen_t2i"):
        conditions_set(small_t2i(), t2i_bundle, cfg.drafter, 4, 0)
    (tmp_path / "captions.json").write_text(json.dumps(["a red cat", "a dog"]))
    picked = conditions_set(small_t2i(), t2i_bundle, OmegaConf.merge(cfg.drafter, {"prompts": str(tmp_path / "captions.json")}), 6, 0)
    assert len(picked) == 6 and set(picked) <= {"a red cat", "a dog"}


def test_drafter_agreement_reports_what_an_ideal_drafter_would_reach(monkeypatch):
    """Beside the drafter's own agreement, the stage reports the ideal drafter's (the target's own top
    token): a random drafter falls short of it, and one that predicts the target's features exactly
    reaches it, with every top token right."""
    from decoding.sampling import SamplingParams
    from tests.conftest import tiny_bundle
    from workflows.training import drafter as stage
    b = tiny_bundle(vocab=8, grid=4, seed=3)
    b.conditions = lambda ids: Conditions(torch.tensor(ids), None, [])        # class ids, as c2i bundles take
    d = stage.distillation_data(b, [0, 1, 2, 1], seed=0, cfg_scale=2.0, batch=4)
    sampling, L = SamplingParams(cfg_scale=2.0), b.gpt.args.cls_token_num
    random = stage.agreement(b.drafter, b.gpt, d, L, sampling, 2)
    assert 0 < random["target_p_of_draft_top1"] < random["target_p_of_target_top1"] <= 1, random
    exact = lambda drafter, d, idx, L, *a, **k: (d["feat"][idx, L:].float(),) * 2   # noqa: E731
    monkeypatch.setattr(stage, "drafter_forward", exact)
    ideal = stage.agreement(b.drafter, b.gpt, d, L, sampling, 2)
    assert ideal["top1"] == 1.0 and ideal["target_p_of_draft_top1"] == pytest.approx(ideal["target_p_of_target_top1"])
    assert ideal["target_p_of_target_top1"] == pytest.approx(random["target_p_of_target_top1"])


# -- the job, with class ids --------------------------------------------------------------------------------
def test_job_generates_imagenet_classes_with_a_llamagen_checkpoint(ray_cluster, c2i_files, tmp_path):
    import pyarrow.parquet as pq
    from tests.test_job import job
    d, f = c2i_files
    out = tmp_path / "run"
    summary = job("model=llamagen_c2i", f"model.gpt_ckpt={f['gpt']}", f"model.vq_ckpt={f['vq']}", "model.dim=64",
                  "model.n_layer=2", "model.n_head=4", "model.codebook_size=128", "model.vq_ch=32",
                  "model.vq_z_channels=32", "model.vq_num_res_blocks=1", "model.image_size=64", "model.num_classes=10",
                  "model.dtype=float32", "data=imagenet_classes", "data.classes=[3,7]", "data.per_class=2",
                  "cluster.num_actors=1", f"out_dir={out}")
    assert summary["images"] == 4 and summary["errors"] == 0
    df = pq.read_table(out / "images").to_pandas().sort_values("prompt_id")
    assert df.prompt_id.tolist() == ["class0003-000", "class0003-001", "class0007-000", "class0007-001"]
    assert df.prompt.tolist() == ["3", "3", "7", "7"] and set(df.width) == {64} and set(df.model) == {"llamagen_c2i"}


def test_greedy_through_the_job_is_llamagen_s_own_tokens(ray_cluster, tmp_path):
    """The public job, top-k 1, on LlamaGen's codebook size: every image's tokens are the reference code's
    greedy tokens for its class, at CFG 1 and 4 (tests/fixtures/llamagen_greedy.json, c2i_large), and the
    job reports no token of zero target probability."""
    import pyarrow.parquet as pq
    from tests.fixtures.make_llamagen_greedy import C2I_LARGE
    from tests.test_job import job
    fx = json.loads(FIXTURE.read_text())["c2i_large"]
    cfg = small_c2i(**C2I_LARGE)
    gpt, vq = save(gpt_weights(cfg), tmp_path / "c2i_gpt.pt"), save(vq_weights(cfg), tmp_path / "vq_ds16_c2i.pt")
    for scale in ("1.0", "4.0"):
        out = tmp_path / f"cfg{scale}"
        summary = job("model=llamagen_c2i", f"model.gpt_ckpt={gpt}", f"model.vq_ckpt={vq}", "model.dim=64",
                      "model.n_layer=2", "model.n_head=4", f"model.codebook_size={cfg.codebook_size}",
                      "model.vq_ch=32", "model.vq_z_channels=32", "model.vq_num_res_blocks=1",
                      f"model.image_size={cfg.image_size}", "model.num_classes=10", "model.dtype=float32",
                      "data=imagenet_classes", f"data.classes={fx['labels']}", "data.per_class=1",
                      "engine=vanilla", "engine.sampling.top_k=1", f"engine.sampling.cfg_scale={scale}",
                      "cluster.num_actors=1", f"out_dir={out}")
        assert summary["images"] == len(fx["labels"]) and summary["errors"] == 0
        assert summary["invalid_tokens"] == 0
        tok = pq.read_table(out / "tokens", columns=["prompt_id", "token_index", "token_id"]).to_pandas()
        tok = tok.sort_values(["prompt_id", "token_index"])
        for label, expected in zip(fx["labels"], fx["runs"][scale]):
            got = tok[tok.prompt_id == f"class{label:04d}-000"].token_id.tolist()
            assert got == expected, f"class {label}, cfg {scale}"
