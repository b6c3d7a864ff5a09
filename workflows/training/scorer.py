"""Stage `scorer`: train the attribute classifier on fresh renders and on their VQ reconstructions,
so it reads generated images (which carry tokenizer artefacts) as well as clean ones."""
from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn.functional as F

from decoding.checkpoint import save_module
from decoding.shapes.scorer import Scorer, ScorerArgs, adherence
from workflows.training.common import render_pool, run_steps, to_float
from workflows.training.stages import load_stage

log = logging.getLogger("arspec.train")


@torch.no_grad()
def reconstruct(vq, images_u8: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    out = []
    for i in range(0, len(images_u8), chunk):
        x = to_float(images_u8[i:i + chunk])
        g = vq.args.downsample
        rec = vq.decode_code(vq.encode(x), [len(x), vq.args.codebook_embed_dim, x.shape[2] // g, x.shape[3] // g])
        out.append(((rec.clamp(-1, 1) + 1) * 127.5).round().byte().permute(0, 2, 3, 1))
    return torch.cat(out)


def accuracy(scorer: Scorer, images_u8: torch.Tensor, scenes) -> dict:
    scorer.eval()
    scores = [adherence(p, s) for p, s in zip(scorer.predict(images_u8.numpy()), scenes)]
    scorer.train()
    return {k: float(np.mean([s[k] for s in scores])) for k in scores[0]}


def train_scorer(cfg, out_dir) -> dict:
    torch.manual_seed(cfg.seed)
    vq = load_stage(out_dir, "vq").eval()
    scorer = Scorer(ScorerArgs(width=cfg.width))
    scenes, clean = render_pool(cfg.train_images, seed=cfg.seed + 10)
    images = torch.cat([clean, reconstruct(vq, clean)])
    scenes = scenes + scenes
    labels = {k: torch.tensor([v.index(s.attributes()[k]) for s in scenes]) for k, v in scorer.args.attributes.items()}
    gen = torch.Generator().manual_seed(cfg.seed)

    def step(_):
        b = torch.randint(len(images), (cfg.batch,), generator=gen)
        x = to_float(images[b])
        x = x + cfg.noise * torch.randn(x.shape, generator=gen)
        logits = scorer(x)
        loss = sum(F.cross_entropy(logits[k], labels[k][b]) for k in logits)
        return loss, {}

    stats = run_steps("scorer", scorer.parameters(), step, cfg.steps, cfg.lr, weight_decay=0.01,
                      log_every=cfg.log_every)
    ev_scenes, ev_clean = render_pool(cfg.eval_images, seed=cfg.seed + 11)
    metrics = {"fresh_render": accuracy(scorer, ev_clean, ev_scenes),
               "vq_reconstruction": accuracy(scorer, reconstruct(vq, ev_clean), ev_scenes)}
    log.info(f"[scorer] held-out accuracy {metrics}")
    scorer.eval()
    save_module(scorer, out_dir / "scorer.safetensors", metrics=metrics)
    return {**stats, **metrics}
