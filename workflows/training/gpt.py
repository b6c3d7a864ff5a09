"""Stage `gpt`: train the shapes text encoder and the t2i target GPT jointly on VQ tokens of rendered
scenes, with condition dropout so classifier-free guidance works.

`python -m workflows.training.gpt [WEIGHTS_DIR]` prints the caption-choice accuracy of trained weights
(see `caption_choice`)."""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from decoding.checkpoint import save_module
from decoding.models.gpt import GPT, GPTArgs
from decoding.models.text import TextArgs, TextEncoder, build_vocab
from decoding.shapes.world import ATTRIBUTES, Scene
from workflows.training.common import render_pool, run_steps, to_float
from workflows.training.stages import load_stage

log = logging.getLogger("arspec.train")


def shapes_vocab() -> list[str]:
    phrases = [p for values in ATTRIBUTES.values() for p in values] + ["a on speckled background"]
    return build_vocab(phrases)


@torch.no_grad()
def tokenize_pool(vq, images_u8: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    vq.eval()
    return torch.cat([vq.encode(to_float(images_u8[i:i + chunk])) for i in range(0, len(images_u8), chunk)])


def train_gpt(cfg, out_dir) -> dict:
    torch.manual_seed(cfg.seed)
    vq = load_stage(out_dir, "vq")
    text_args = TextArgs(vocab=shapes_vocab(), max_len=cfg.text_len, dim=cfg.text_dim)
    text = TextEncoder(text_args)
    grid = 64 // vq.args.downsample
    args = GPTArgs(dim=cfg.dim, n_layer=cfg.n_layer, n_head=cfg.n_head, vocab_size=vq.args.codebook_size,
                   block_size=grid * grid, model_type="t2i", caption_dim=cfg.text_dim,
                   cls_token_num=cfg.text_len, class_dropout_prob=cfg.cond_dropout, abs_pos_embed=cfg.abs_pos_embed,
                   cond_rope=cfg.cond_rope)
    gpt = GPT(args)
    if cfg.resume:  # continue from the gpt/text weights already in out_dir (same architecture)
        gpt.load_state_dict(load_stage(out_dir, "gpt").state_dict())
        text.load_state_dict(load_stage(out_dir, "text").state_dict())
        log.info(f"[gpt] resuming from {out_dir / 'gpt.safetensors'}")
    log.info(f"[gpt] {sum(p.numel() for p in gpt.parameters()) / 1e6:.2f}M parameters, {args.block_size} tokens/image")

    def pool(n, seed):
        scenes, images = render_pool(n, seed)
        ids, mask, _ = text.tokenize([s.caption for s in scenes])
        return tokenize_pool(vq, images), ids, mask, scenes

    tokens, ids, mask, _ = pool(cfg.train_images, cfg.seed)
    ev_tokens, ev_ids, ev_mask, ev_scenes = pool(cfg.eval_images, cfg.seed + 1)
    log.info(f"[gpt] tokenized {len(tokens)} training images")
    gen = torch.Generator().manual_seed(cfg.seed)

    def loss_on(t, i, m, drop):
        cond = gpt.embed_condition(text(i, m), drop)
        logits, _ = gpt.forward_train(cond, t, cond_mask=m)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), t.reshape(-1))

    def step(_):
        b = torch.randint(len(tokens), (cfg.batch,), generator=gen)
        drop = torch.rand(cfg.batch, generator=gen) < cfg.cond_dropout
        return loss_on(tokens[b], ids[b], mask[b], drop), {}

    stats = run_steps("gpt", list(gpt.parameters()) + list(text.parameters()), step, cfg.steps, cfg.lr,
                      weight_decay=cfg.weight_decay, warmup=cfg.warmup, log_every=cfg.log_every)
    gpt.eval(), text.eval()
    with torch.no_grad():
        no_drop = torch.zeros(len(ev_tokens), dtype=torch.bool)
        ev = {"eval_nats_per_token": loss_on(ev_tokens, ev_ids, ev_mask, no_drop).item(),
              "eval_uncond_nats_per_token": loss_on(ev_tokens, ev_ids, ev_mask, ~no_drop).item()}
    ev["eval_caption_choice"] = caption_choice(gpt, text, ev_scenes[:96], ev_tokens[:96])
    log.info(f"[gpt] held-out {ev}")
    save_module(text, out_dir / "text.safetensors")
    save_module(gpt, out_dir / "gpt.safetensors", metrics=ev)
    return {**stats, **ev}


@torch.no_grad()
def caption_choice(gpt, text, scenes: list[Scene], tokens: torch.Tensor, attrs=("shape", "position")) -> dict:
    """How often the true caption makes a held-out render's tokens the most likely, against the same caption
    with one attribute swapped for each other value: whether the model reads that word at all. Faster
    and steadier than scoring generations; chance is 1/4 for shape and 1/5 for position."""
    gpt.eval(), text.eval()
    out = {}
    for attr in attrs:
        right = 0
        for scene, t in zip(scenes, tokens):
            taken = {scene.colour, scene.background} - {getattr(scene, attr)}  # a scene's two colours differ
            values = [v for v in ATTRIBUTES[attr] if v not in taken]
            ids, mask, _ = text.tokenize([dataclasses.replace(scene, **{attr: v}).caption for v in values])
            cond = gpt.embed_condition(text(ids, mask), torch.zeros(len(values), dtype=torch.bool))
            logits, _ = gpt.forward_train(cond, t[None].expand(len(values), -1), cond_mask=mask)
            logp = torch.log_softmax(logits.float(), -1).gather(-1, t[None, :, None].expand(len(values), -1, 1))
            right += values[int(logp.sum((1, 2)).argmax())] == getattr(scene, attr)
        out[attr] = round(right / len(scenes), 3)
    return out


if __name__ == "__main__":
    from decoding.shapes.family import WEIGHTS
    d = Path(sys.argv[1]) if len(sys.argv) > 1 else WEIGHTS
    scenes, images = render_pool(96, 12345)
    vq, gpt, text = (load_stage(d, k) for k in ("vq", "gpt", "text"))
    print(json.dumps(caption_choice(gpt, text, scenes, tokenize_pool(vq, images))))
