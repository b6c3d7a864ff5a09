"""Stage `drafter`: train the EAGLE drafter by self-distillation from the shipped target.

Data: the target generates images for random shapes captions (vanilla, CFG on); both of its streams
(cond and uncond) are then replayed with teacher forcing to get its features. The drafter sees the
pairs (e_{p+1}, f_p) with uniform noise on f_p and learns f_{p+1}: SmoothL1 on the feature plus 0.1 x
soft cross-entropy against the target's next-token distribution through the target's frozen head.
"""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from decoding.checkpoint import save_module
from decoding.engines.vanilla import Vanilla, VanillaConfig
from decoding.models.drafter import Drafter, DrafterArgs
from decoding.models.gpt import causal_mask
from decoding.registry import load_bundle
from decoding.sampling import SamplingParams, cfg_combine
from decoding.shapes.family import ShapesConfig
from decoding.shapes.world import sample_scenes
from workflows.training.common import run_steps

log = logging.getLogger("arspec.train")


@torch.no_grad()
def distillation_data(bundle, n: int, seed: int, cfg_scale: float, batch: int) -> dict:
    """Target generations and, per stream, the target's input embeddings and features.
    Rows 0..n-1 are the cond streams, rows n..2n-1 the uncond streams of the same images."""
    gpt, engine = bundle.gpt, Vanilla(bundle, VanillaConfig(sampling=SamplingParams(cfg_scale=cfg_scale)))
    captions = [s.caption for s in sample_scenes(n, seed)]
    streams = {name: {"tokens": [], "emb": [], "feat": [], "mask": []} for name in ("cond", "uncond")}
    for i in range(0, n, batch):
        chunk = captions[i:i + batch]
        cond = bundle.conditions(chunk)
        res = engine.generate(cond, [seed * 1_000_003 + i + j for j in range(len(chunk))])
        tokens = torch.from_numpy(np.stack([r.tokens for r in res]))
        for name, drop in (("cond", False), ("uncond", True)):
            cond_emb = gpt.embed_condition(cond.features, torch.full((len(chunk),), drop))
            _, f = gpt.forward_train(cond_emb, tokens, cond_mask=cond.mask)
            s = streams[name]
            s["tokens"].append(tokens), s["mask"].append(cond.mask), s["feat"].append(f.half())
            s["emb"].append(torch.cat([cond_emb, gpt.embed_tokens(tokens[:, :-1])], 1).half())
        log.info(f"[drafter] distillation data {min(i + batch, n)}/{n} images")
    return {k: torch.cat(streams["cond"][k] + streams["uncond"][k]) for k in streams["cond"]}


def drafter_forward(drafter: Drafter, d: dict, idx: torch.Tensor, L: int, noise: float = 0.0, gen=None):
    """Teacher-forced drafter over sequences idx. Returns (predicted f_{p+1}, true f_{p+1}) for p >= L-1."""
    emb, feat, mask = d["emb"][idx].float(), d["feat"][idx].float(), d["mask"][idx]
    B, T, _ = feat.shape
    x_feat = feat[:, :-1]
    if noise:
        x_feat = x_feat + (torch.rand(x_feat.shape, generator=gen) * 2 - 1) * noise
    pos = torch.arange(1, T, device=feat.device).expand(B, T - 1)
    pred = drafter(emb[:, 1:], x_feat, pos, causal_mask(T - 1, mask, feat.device))
    return pred[:, L - 1:], feat[:, L:]


@torch.no_grad()
def agreement(drafter, gpt, d: dict, L: int, cfg_scale: float, k: int) -> dict:
    """Teacher-forced agreement with the target on held-out sequences (CFG-combined next-token argmax)."""
    pred, true = drafter_forward(drafter, d, torch.arange(len(d["tokens"])), L)  # [cond; uncond]
    sp = SamplingParams(cfg_scale=cfg_scale)
    q = cfg_combine(gpt.logits(pred), sp)
    p = cfg_combine(gpt.logits(true), sp)
    target_top = p.argmax(-1)
    return {"top1": (q.argmax(-1) == target_top).float().mean().item(),
            f"top{k}": (q.topk(k, -1).indices == target_top[..., None]).any(-1).float().mean().item(),
            "target_p_of_draft_top1": p.softmax(-1).gather(-1, q.argmax(-1, keepdim=True)).mean().item()}


def train_drafter(cfg, out_dir) -> dict:
    torch.manual_seed(cfg.seed)
    bundle = load_bundle(ShapesConfig(weights_dir=str(out_dir), device="cpu", dtype="float32"))
    gpt = bundle.gpt.requires_grad_(False)
    L = gpt.args.cls_token_num
    train = distillation_data(bundle, cfg.train_images, cfg.seed, cfg.cfg_scale, cfg.gen_batch)
    held_out = distillation_data(bundle, cfg.eval_images, cfg.seed + 1, cfg.cfg_scale, cfg.gen_batch)
    drafter = Drafter(DrafterArgs.for_target(gpt.args, n_layer=cfg.n_layer))
    gen = torch.Generator().manual_seed(cfg.seed)

    def step(_):
        idx = torch.randint(len(train["tokens"]), (cfg.batch,), generator=gen)
        pred, true = drafter_forward(drafter, train, idx, L, cfg.feature_noise, gen)
        feat_loss = F.smooth_l1_loss(pred, true)
        target = gpt.logits(true).softmax(-1)
        ce = -(target * gpt.logits(pred).log_softmax(-1)).sum(-1).mean()
        return feat_loss + cfg.ce_weight * ce, {"feat": feat_loss.item(), "ce": ce.item()}

    stats = run_steps("drafter", drafter.parameters(), step, cfg.steps, cfg.lr, weight_decay=0.0,
                      log_every=cfg.log_every)
    drafter.eval()
    metrics = agreement(drafter, gpt, held_out, L, cfg.cfg_scale, cfg.top_k_report)
    log.info(f"[drafter] held-out agreement with the target {metrics}")
    save_module(drafter, out_dir / "drafter.safetensors", metrics=metrics)
    return {**stats, **metrics}
