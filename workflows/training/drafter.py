"""Stage `drafter`: train an EAGLE drafter for a target by self-distillation, for any model family:
`python -m workflows.train stages=[drafter]` (the shipped shapes target) or
`python -m workflows.train stages=[drafter] model=llamagen_c2i model.gpt_ckpt=... model.vq_ckpt=... out_dir=...`.

Data: the target generates images (vanilla, CFG on, the family's sampling defaults unless
drafter.cfg_scale is set) for conditions drawn from the family's prompt set: random shapes captions,
random class ids for c2i, or the captions / class ids of drafter.prompts (a prompt file, any format the
job reads; t2i needs one). Both of its streams (cond and uncond) are then replayed with teacher forcing
to get its features. The drafter sees the pairs (e_{p+1}, f_p) with uniform noise on f_p and learns
f_{p+1}: SmoothL1 on the feature plus 0.1 x soft cross-entropy against the target's next-token
distribution through the target's frozen head. Generation and training run on the model's device (a
GPU when there is one: model.device=auto).
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
from decoding.shapes.world import sample_scenes
from workflows.config import ConfigError
from workflows.training.common import run_steps

log = logging.getLogger("arspec.train")


def conditions_set(model, bundle, cfg, n: int, seed: int) -> list:
    """n prompts (captions or class ids) to distil on, drawn with `seed`."""
    gen = torch.Generator().manual_seed(seed)
    if cfg.get("prompts"):
        from workflows.config import DataConfig
        from workflows.prompts import read_prompts
        pool = [r["prompt"] for r in read_prompts(DataConfig(name="file", path=cfg.prompts))]
        if not pool:
            raise ConfigError(f"drafter.prompts={cfg.prompts}: holds no prompts")
        return [pool[i] for i in torch.randint(len(pool), (n,), generator=gen).tolist()]
    if model.name == "shapes":
        return [s.caption for s in sample_scenes(n, seed)]
    a = bundle.gpt.args
    if a.model_type == "c2i":
        return torch.randint(a.num_classes, (n,), generator=gen).tolist()
    raise ConfigError(f"drafter.prompts is not set: model={model.name} distils its drafter on captions from a "
                      f"prompt file (e.g. drafter.prompts=../shared/data/coco2017_val_longest_captions.json)")


@torch.no_grad()
def distillation_data(bundle, prompts: list, seed: int, cfg_scale, batch: int) -> dict:
    """Target generations and, per stream, the target's input embeddings and features (fp16, on the host).
    Rows 0..n-1 are the cond streams, rows n..2n-1 the uncond streams of the same images."""
    gpt = bundle.gpt
    engine = Vanilla(bundle, VanillaConfig(sampling=SamplingParams(cfg_scale=cfg_scale)))
    streams = {name: {"tokens": [], "emb": [], "feat": [], "mask": []} for name in ("cond", "uncond")}
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        cond = bundle.conditions(chunk)
        res = engine.generate(cond, [seed * 1_000_003 + i + j for j in range(len(chunk))])
        tokens = torch.from_numpy(np.stack([r.tokens for r in res])).to(bundle.device)
        mask = cond.mask if cond.mask is not None else \
            torch.ones(len(chunk), gpt.args.cls_token_num, dtype=torch.bool, device=bundle.device)
        for name, drop in (("cond", False), ("uncond", True)):
            cond_emb = gpt.embed_condition(cond.features, torch.full((len(chunk),), drop, device=bundle.device))
            _, f = gpt.forward_train(cond_emb, tokens, cond_mask=mask)
            s = streams[name]
            s["tokens"].append(tokens.cpu()), s["mask"].append(mask.cpu()), s["feat"].append(f.half().cpu())
            s["emb"].append(torch.cat([cond_emb, gpt.embed_tokens(tokens[:, :-1])], 1).half().cpu())
        log.info(f"[drafter] distillation data {min(i + batch, len(prompts))}/{len(prompts)} images")
    return {k: torch.cat(streams["cond"][k] + streams["uncond"][k]) for k in streams["cond"]}


def drafter_forward(drafter: Drafter, d: dict, idx: torch.Tensor, L: int, noise: float = 0.0, gen=None):
    """Teacher-forced drafter over sequences idx. Returns (predicted f_{p+1}, true f_{p+1}) for p >= L-1."""
    dev = drafter.fc.weight.device
    emb, feat, mask = d["emb"][idx].float().to(dev), d["feat"][idx].float().to(dev), d["mask"][idx].to(dev)
    B, T, _ = feat.shape
    x_feat = feat[:, :-1]
    if noise:
        x_feat = x_feat + ((torch.rand(x_feat.shape, generator=gen) * 2 - 1) * noise).to(dev)
    pos = torch.arange(1, T, device=dev).expand(B, T - 1)
    pred = drafter(emb[:, 1:], x_feat, pos, causal_mask(T - 1, mask, dev))
    return pred[:, L - 1:], feat[:, L:]


def head(gpt, x: torch.Tensor) -> torch.Tensor:
    """The target's frozen output head on features of any dtype."""
    return gpt.logits(x.to(gpt.output.weight.dtype))


@torch.no_grad()
def agreement(drafter, gpt, d: dict, L: int, sampling: SamplingParams, k: int, chunk: int = 16) -> dict:
    """Teacher-forced agreement with the target on held-out sequences (CFG-combined next-token argmax).
    target_p_of_draft_top1 is the chance the target draws the drafter's top token (a one-node tree's
    acceptance); target_p_of_target_top1 is that chance for an ideal drafter (the target's own top
    token), the most any drafter could reach (the shipped shapes drafter's: docs/measurements.md)."""
    n = len(d["tokens"]) // 2                              # rows [cond; uncond] of n images
    hits = {"top1": [], f"top{k}": [], "target_p_of_draft_top1": [], "target_p_of_target_top1": []}
    for i in range(0, n, chunk):
        idx = torch.cat([torch.arange(i, min(i + chunk, n)), n + torch.arange(i, min(i + chunk, n))])
        pred, true = drafter_forward(drafter, d, idx, L)
        q, p = (cfg_combine(head(gpt, x), sampling) for x in (pred, true))
        target_top = p.argmax(-1)
        hits["top1"].append((q.argmax(-1) == target_top).float().flatten())
        hits[f"top{k}"].append((q.topk(k, -1).indices == target_top[..., None]).any(-1).float().flatten())
        pt = p.softmax(-1)
        hits["target_p_of_draft_top1"].append(pt.gather(-1, q.argmax(-1, keepdim=True)).flatten())
        hits["target_p_of_target_top1"].append(pt.amax(-1).flatten())
    return {name: torch.cat(v).mean().item() for name, v in hits.items()}


def load_target(model, out_dir):
    """The target bundle: the shapes one being trained in out_dir (fp32 on the CPU, as the other
    stages), or the model config's checkpoints on its own device and dtype."""
    if model.name == "shapes":
        from decoding.shapes.family import ShapesConfig
        return load_bundle(ShapesConfig(weights_dir=str(out_dir), device="cpu", dtype="float32"))
    try:
        return load_bundle(model)
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None


def train_drafter(cfg, out_dir, model=None) -> dict:
    from decoding.shapes.family import ShapesConfig
    model = model or ShapesConfig()
    torch.manual_seed(cfg.seed)
    bundle = load_target(model, out_dir)
    gpt = bundle.gpt.requires_grad_(False)
    L, dev = gpt.args.cls_token_num, bundle.device
    sampling = SamplingParams(cfg_scale=cfg.cfg_scale).over(bundle.sampling)
    train = distillation_data(bundle, conditions_set(model, bundle, cfg, cfg.train_images, cfg.seed),
                              cfg.seed, sampling.cfg_scale, cfg.gen_batch)
    held_out = distillation_data(bundle, conditions_set(model, bundle, cfg, cfg.eval_images, cfg.seed + 1),
                                 cfg.seed + 1, sampling.cfg_scale, cfg.gen_batch)
    drafter = Drafter(DrafterArgs.for_target(gpt.args, n_layer=cfg.n_layer)).to(dev)
    gen = torch.Generator().manual_seed(cfg.seed)

    def step(_):
        idx = torch.randint(len(train["tokens"]), (cfg.batch,), generator=gen)
        pred, true = drafter_forward(drafter, train, idx, L, cfg.feature_noise, gen)
        feat_loss = F.smooth_l1_loss(pred, true)
        target = head(gpt, true).softmax(-1)
        ce = -(target * head(gpt, pred).log_softmax(-1)).sum(-1).mean()
        return feat_loss + cfg.ce_weight * ce, {"feat": feat_loss.item(), "ce": ce.item()}

    stats = run_steps("drafter", drafter.parameters(), step, cfg.steps, cfg.lr, weight_decay=0.0,
                      log_every=cfg.log_every, device=dev.type)
    drafter.eval()
    metrics = agreement(drafter, gpt, held_out, L, sampling, cfg.top_k_report)
    log.info(f"[drafter] held-out agreement with the target {metrics}")
    target = {k: getattr(model, k) for k in ("name", "gpt_ckpt", "gpt_model", "image_size") if hasattr(model, k)}
    path = save_module(drafter.cpu(), out_dir / "drafter.safetensors", metrics=metrics, target=target)
    if model.name != "shapes":
        log.info(f"[drafter] use it with model={model.name} model.drafter_ckpt={path}")
    return {**stats, **metrics}
