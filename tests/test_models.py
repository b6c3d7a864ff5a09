"""Model stack: LlamaGen key layout, 2D RoPE, cached vs uncached decoding, tree-masked blocks and KV
compaction, checkpoints, the text encoder and the sampling filters."""
from __future__ import annotations

import pickle

import pytest
import torch

from decoding.bundle import cast
from decoding.checkpoint import load_module, read_state_dict, save_module
from decoding.engines.base import CachedModel, visible
from decoding.models import packed
from decoding.models.gpt import GPT, GPTArgs, causal_mask, rope_table_2d
from decoding.models.packed import pack_linears
from tests.conftest import COSTS
from decoding.models.text import TextArgs, TextEncoder, build_vocab
from decoding.models.vq import VQArgs, VQModel
from decoding.sampling import NEUTRAL, SamplingParams, filtered_probs


def t2i(seed=0, **kw):
    torch.manual_seed(seed)
    a = GPTArgs(dim=48, n_layer=2, n_head=3, vocab_size=16, block_size=16, model_type="t2i", caption_dim=8,
                cls_token_num=4, **kw)
    m = GPT(a).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def test_gpt_keys_follow_llamagen():
    m = GPT(GPTArgs(dim=64, n_layer=2, n_head=4, vocab_size=32, block_size=16, model_type="t2i", caption_dim=24,
                    cls_token_num=5))
    sd = m.state_dict()
    expected = {"tok_embeddings.weight": (32, 64), "layers.0.attention.wqkv.weight": (192, 64),
                "layers.1.attention.wo.weight": (64, 64), "layers.0.feed_forward.w1.weight": (256, 64),
                "layers.0.feed_forward.w2.weight": (64, 256), "layers.0.feed_forward.w3.weight": (256, 64),
                "layers.0.attention_norm.weight": (64,), "layers.0.ffn_norm.weight": (64,), "norm.weight": (64,),
                "output.weight": (32, 64), "cls_embedding.cap_proj.fc1.weight": (64, 24),
                "cls_embedding.cap_proj.fc2.weight": (64, 64), "cls_embedding.uncond_embedding": (5, 24)}
    for k, shape in expected.items():
        assert tuple(sd[k].shape) == shape, k
    c2i = GPT(GPTArgs.from_name("GPT-B", vocab_size=64, block_size=16, num_classes=10)).state_dict()
    assert tuple(c2i["cls_embedding.embedding_table.weight"].shape) == (11, 768)  # + null class
    assert len([k for k in c2i if k.endswith("wqkv.weight")]) == 12


def test_ffn_width_is_llamagen_find_multiple():
    assert GPT(GPTArgs(dim=768, n_layer=1, n_head=12)).layers[0].feed_forward.w1.out_features == 2048
    assert GPT(GPTArgs(dim=256, n_layer=1, n_head=4)).layers[0].feed_forward.w1.out_features == 768


def test_vq_keys_and_codes():
    vq = VQModel(VQArgs(codebook_size=32, codebook_embed_dim=8, ch=32, ch_mult=[1, 2], z_channels=32,
                        num_res_blocks=1)).eval()
    keys = vq.state_dict().keys()
    for k in ("encoder.conv_in.weight", "encoder.conv_blocks.0.res.0.conv1.weight", "encoder.conv_blocks.0.downsample.conv.weight",
              "encoder.conv_blocks.1.attn.0.q.weight", "encoder.mid.1.proj_out.weight", "decoder.conv_blocks.0.res.1.norm2.weight",
              "decoder.conv_blocks.0.upsample.conv.weight", "quant_conv.weight", "post_quant_conv.weight",
              "quantize.embedding.weight", "encoder.conv_blocks.1.res.0.nin_shortcut.weight"):
        assert k in keys, k
    x = torch.rand(2, 3, 16, 16) * 2 - 1
    idx = vq.encode(x)
    assert idx.shape == (2, 64) and idx.max() < 32
    out = vq.decode_code(idx, [2, 8, 8, 8])
    assert out.shape == (2, 3, 16, 16)


def test_rope_condition_rows_are_zero_and_cells_follow_rows_and_columns():
    table = rope_table_2d(grid_size=4, head_dim=16, base=10000.0, cls_token_num=3)
    assert table.shape == (3 + 16, 8, 2)
    assert torch.count_nonzero(table[:3]) == 0          # cos = sin = 0: q and k vanish at condition slots
    kept = rope_table_2d(grid_size=4, head_dim=16, base=10000.0, cls_token_num=3, cond_rope="identity")
    assert torch.equal(kept[:3, :, 0], torch.ones(3, 8)) and torch.count_nonzero(kept[:3, :, 1]) == 0
    assert torch.equal(kept[3:], table[3:])
    with pytest.raises(ValueError, match="cond_rope='none'"):
        rope_table_2d(grid_size=4, head_dim=16, base=10000.0, cls_token_num=3, cond_rope="none")
    f = 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8)
    r, c = 2, 3
    angles = torch.cat([r * f, c * f])
    assert torch.allclose(table[3 + r * 4 + c, :, 0], angles.cos(), atol=1e-6)
    assert torch.allclose(table[3 + r * 4 + c, :, 1], angles.sin(), atol=1e-6)


def _prefix(m, B=2):
    L = m.args.cls_token_num
    feats = torch.randn(B, L, 8)
    mask = torch.ones(B, L, dtype=torch.bool)
    mask[0, 0] = False  # a left-padded caption
    return m.embed_condition(feats), mask


@pytest.mark.parametrize("abs_pos, cond_rope", [(False, "zero"), (True, "identity")])
@torch.no_grad()
def test_cached_decoding_matches_full_forward(abs_pos, cond_rope):
    m = t2i(abs_pos_embed=abs_pos, cond_rope=cond_rope)
    emb, mask = _prefix(m)
    tokens = torch.randint(0, 16, (2, 16))
    full_logits, _ = m.forward_train(emb, tokens, cond_mask=mask)
    L, S = m.args.cls_token_num, 4 + 16
    cache = CachedModel(m, 2, S, torch.float32)
    pos = torch.arange(L).expand(2, L)
    pre = torch.zeros(2, L, S, dtype=torch.bool)
    pre[:, :, :L] = causal_mask(L, mask, "cpu")
    f = m.forward_embeds(emb, pos, pre, pos)
    cache.valid[:, :L] = mask
    step_logits = [m.logits(f[:, -1])]
    for i in range(15):
        slots = torch.full((2, 1), L + i)
        f = m.forward_embeds(m.embed_tokens(tokens[:, i:i + 1]), slots, visible(cache.valid, slots[..., None]), slots)
        cache.commit(slots)
        step_logits.append(m.logits(f[:, 0]))
    assert torch.allclose(torch.stack(step_logits, 1), full_logits, atol=1e-4)


@pytest.mark.parametrize("abs_pos, cond_rope", [(False, "zero"), (True, "identity")])
@torch.no_grad()
def test_tree_block_and_compaction_match_sequential_decoding(abs_pos, cond_rope):
    """A tree [root, a, b (child of a), c (sibling of a)] in one masked forward gives each node the
    features of its own path; after compacting the path root->a->b, decoding continues as if the
    path had been decoded token by token."""
    m = t2i(seed=1, abs_pos_embed=abs_pos, cond_rope=cond_rope)
    emb, mask = _prefix(m, B=1)
    L, S = 4, 4 + 16 + 8
    prefix_tokens = torch.randint(0, 16, (1, 3))
    root, a, b, c, nxt = 5, 7, 9, 11, 3
    path = torch.cat([prefix_tokens, torch.tensor([[root, a, b, nxt]])], 1)
    ref_logits, _ = m.forward_train(emb, torch.cat([path, torch.zeros(1, 16 - path.shape[1], dtype=torch.long)], 1),
                                    cond_mask=mask)

    cache = CachedModel(m, 1, S, torch.float32)
    pos = torch.arange(L)[None]
    pre = torch.zeros(1, L, S, dtype=torch.bool)
    pre[:, :, :L] = causal_mask(L, mask, "cpu")
    m.forward_embeds(emb, pos, pre, pos)
    cache.valid[:, :L] = mask
    for i in range(3):
        s = torch.tensor([[L + i]])
        m.forward_embeds(m.embed_tokens(prefix_tokens[:, i:i + 1]), s, visible(cache.valid, s[..., None]), s)
        cache.commit(s)
    P = L + 3                                            # root position = slot
    block = torch.tensor([[root, a, b, c]])
    slots = P + torch.arange(4)[None]
    pos = P + torch.tensor([[0, 1, 2, 1]])               # depths 0, 1, 2, 1
    see = torch.tensor([[[P, P, P], [P + 1, P, P + 1], [P + 2, P + 1, P], [P + 3, P, P + 3]]])
    f = m.forward_embeds(m.embed_tokens(block), pos, visible(cache.valid, see), slots)
    tree_logits = m.logits(f)[0]
    # token index of root = 3 -> its logits predict token 4 (= ref_logits[:, 4])
    assert torch.allclose(tree_logits[0], ref_logits[0, 4], atol=1e-4)
    assert torch.allclose(tree_logits[1], ref_logits[0, 5], atol=1e-4)
    assert torch.allclose(tree_logits[2], ref_logits[0, 6], atol=1e-4)
    # compaction: root stays, a at P+1 stays, b from P+2 stays; make it non-trivial: accept root->c instead
    cache.move(torch.tensor([[P, P + 3]]), torch.tensor([[P, P + 1]]))
    cache.commit(torch.tensor([[P, P + 1]]))
    s = torch.tensor([[P + 2]])
    f = m.forward_embeds(m.embed_tokens(torch.tensor([[nxt]])), s, visible(cache.valid, s[..., None]), s)
    alt = torch.cat([prefix_tokens, torch.tensor([[root, c, nxt]])], 1)
    alt_ref, _ = m.forward_train(emb, torch.cat([alt, torch.zeros(1, 16 - alt.shape[1], dtype=torch.long)], 1),
                                 cond_mask=mask)
    assert torch.allclose(m.logits(f)[0, 0], alt_ref[0, 6], atol=1e-4)


@torch.no_grad()
def test_bf16_bundle_computes_what_the_fp32_one_does(tiny_weights):
    """The bundle casts the transformers to bf16 once; RoPE tables are complex and must survive it."""
    from decoding.engines import build_engine, engine_config
    from decoding.registry import load_bundle
    from decoding.shapes.family import ShapesConfig
    b32, b16 = (load_bundle(ShapesConfig(weights_dir=str(tiny_weights), device="cpu", dtype=d)) for d in ("float32", "bfloat16"))
    assert b16.gpt.output.weight.dtype == torch.bfloat16 and b16.gpt.rope.dtype == torch.complex64
    assert torch.equal(b16.gpt.rope, b32.gpt.rope) and torch.equal(b16.drafter.rope, b32.drafter.rope)
    # bf16 linears are packed for oneDNN once (models/packed.py); fp32 ones stay plain
    assert isinstance(b16.drafter.fc, packed.PackedLinear) == isinstance(b16.gpt.output, packed.PackedLinear) == packed.available()
    assert type(b32.gpt.output) is torch.nn.Linear
    prompts = ["a red circle in the center", "a small blue star"]
    tokens = torch.randint(0, 16, (2, 16), generator=torch.Generator().manual_seed(0))
    probs = []
    for b in (b32, b16):
        c = b.conditions(prompts)
        logits, _ = b.gpt.forward_train(b.gpt.embed_condition(c.features), tokens, cond_mask=c.mask)
        probs.append(logits.softmax(-1))
    assert (probs[0] - probs[1]).abs().max() < 0.05
    for name in ("vanilla", "eagle2"):  # the engines run end to end in bf16
        tree = dict(total_tokens=6, depth=3, width=2, costs=COSTS) if name != "vanilla" else {}
        r = build_engine(b16, engine_config(name, sampling={"cfg_scale": 2.0}, **tree)).generate(
            b16.conditions(prompts), [1, 2])
        assert r[0].image.shape == (8, 8, 3) and len(r[1].tokens) == 16


@pytest.mark.skipif(not packed.available(), reason="no oneDNN bf16 path on this torch and CPU")
def test_packed_bf16_linears_compute_what_plain_ones_do_and_follow_their_weights():
    """A bf16 model's linear layers packed for oneDNN (models/packed.py) give the plain bf16 results bit
    for bit, at every row count a step has; a weight changed in place is packed again, copies pack their
    own, and autograd (training) takes the plain path."""
    import copy

    m = cast(t2i(), torch.bfloat16)
    ref = copy.deepcopy(m)
    pack_linears(m)
    assert isinstance(m.output, packed.PackedLinear) and isinstance(m.layers[0].feed_forward.w2, packed.PackedLinear)
    assert set(m.state_dict()) == set(ref.state_dict())
    lin, plain = m.layers[0].attention.wqkv, ref.layers[0].attention.wqkv
    with torch.inference_mode():
        for rows in (1, 2, 16, 34, 272):
            x = torch.randn(rows, 48).to(torch.bfloat16)
            assert torch.equal(lin(x), plain(x)), rows
        x = torch.randn(3, 5, 48).to(torch.bfloat16)
        assert torch.equal(m.output(x), ref.output(x)) and lin._packed.weight is not None
    with torch.no_grad():
        lin.weight.mul_(2)
        plain.weight.mul_(2)
    with torch.inference_mode():
        assert torch.equal(lin(x), plain(x))                              # packed again from the new weight
    twin = copy.deepcopy(m)                                              # oneDNN tensors cannot be copied
    with torch.inference_mode():
        assert twin.layers[0].attention.wqkv._packed.weight is None and torch.equal(twin.output(x), ref.output(x))
    x = torch.randn(3, 5, 48).to(torch.bfloat16).requires_grad_()
    y = lin(x)
    y.float().sum().backward()                                           # no grad through the packed op
    assert x.grad is not None and lin.weight.grad is not None


def test_checkpoints_round_trip_and_refuse_pickled_code(tmp_path):
    m = t2i()
    path = save_module(m, tmp_path / "gpt.safetensors", dtype=torch.float32)
    back = load_module(path, GPT)
    for k, v in m.state_dict().items():
        assert torch.equal(v, back.state_dict()[k]), k
    torch.save({"model": m.state_dict()}, tmp_path / "ckpt.pt")
    assert set(read_state_dict(tmp_path / "ckpt.pt")) == set(m.state_dict())

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"model": Evil()}, f)
    with pytest.raises(pickle.UnpicklingError):
        read_state_dict(tmp_path / "evil.pt")
    with pytest.raises(FileNotFoundError, match="checkpoint not found"):
        read_state_dict(tmp_path / "missing.pt")


def test_text_encoder_maps_unknown_words_and_left_pads():
    vocab = build_vocab(["a red circle", "on a blue background"])
    enc = TextEncoder(TextArgs(vocab=vocab, max_len=6, dim=16, n_layer=1, n_head=2)).eval()
    ids, mask, unknown = enc.tokenize(["A red CIRCLE!", "a purple dragon, flying", "", "word " * 20])
    assert mask[0].tolist() == [False, False, False, True, True, True]
    assert ids[0, 3:].tolist() == [vocab.index("a"), vocab.index("red"), vocab.index("circle")]
    assert unknown == [0, 3, 1, 6]                      # '' encodes as a single <unk>; long text is truncated
    feats, m, _ = enc.encode(["a red circle"])
    assert feats.shape == (1, 6, 16) and torch.isfinite(feats).all()


def test_filters():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = lambda **kw: SamplingParams(**kw).over(NEUTRAL)  # noqa: E731
    p = filtered_probs(logits, params(top_k=2))
    assert p[0, 2:].sum() == 0 and torch.allclose(p[0, :2], torch.tensor([2.0, 1.0]).softmax(0))
    full = logits.softmax(-1)[0]
    p = filtered_probs(logits, params(top_p=0.7))   # 0.644 < 0.7: keep the token that crosses it
    assert (p[0] > 0).tolist() == [True, True, False, False]
    assert torch.allclose(p[0, :2], full[:2] / full[:2].sum())
    assert filtered_probs(logits, params(temperature=0)).tolist() == [[1.0, 0.0, 0.0, 0.0]]
    hot = filtered_probs(logits, params(temperature=2.0))
    assert torch.allclose(hot, (logits / 2).softmax(-1))
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


def test_model_dtype_and_device_are_refused_in_one_line_before_anything_loads():
    """Every family's config: a dtype or device torch would refuse only in the actors (a KeyError, a
    RuntimeError after the actors started) is one line naming the setting and its choices."""
    from decoding.registry import families
    for fam in families().values():
        with pytest.raises(ValueError, match=r"^model.dtype='float8': choose one of auto, float32, bfloat16, float16$"):
            fam.config(dtype="float8")
        with pytest.raises(ValueError, match=r"^model.device='mps': use auto, cpu, cuda or cuda:N$"):
            fam.config(device="mps")
        assert fam.config(device="cuda:1", dtype="float16").device == "cuda:1"   # whether it exists: the actors'
