"""Stage `vq`: train the VQ tokenizer on rendered shapes (L1 + L2 reconstruction, codebook and
commitment losses, dead codes restarted from encoder outputs)."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from decoding.checkpoint import save_module
from decoding.models.vq import VQArgs, VQModel
from workflows.training.common import render_pool, run_steps, to_float

log = logging.getLogger("arspec.train")


def psnr(x: torch.Tensor, y: torch.Tensor) -> float:
    """PSNR in dB between float images in [-1, 1] (computed on the [0, 255] scale)."""
    mse = F.mse_loss((x.clamp(-1, 1) + 1) * 127.5, (y + 1) * 127.5).item()
    return 10 * torch.log10(torch.tensor(255.0**2 / mse)).item()


@torch.no_grad()
def evaluate(vq: VQModel, images_u8: torch.Tensor) -> dict:
    vq.eval()
    recs, used = [], set()
    for i in range(0, len(images_u8), 64):
        x = to_float(images_u8[i:i + 64])
        idx = vq.encode(x)
        g = vq.args.downsample
        shape = [len(x), vq.args.codebook_embed_dim, x.shape[2] // g, x.shape[3] // g]
        recs.append(vq.decode_code(idx, shape))
        used |= set(idx.flatten().tolist())
    vq.train()
    return {"psnr_db": psnr(torch.cat(recs), to_float(images_u8)), "codes_used": len(used)}


def train_vq(cfg, out_dir) -> dict:
    torch.manual_seed(cfg.seed)
    args = VQArgs(codebook_size=cfg.codebook_size, codebook_embed_dim=cfg.codebook_dim, ch=cfg.ch,
                  ch_mult=list(cfg.ch_mult), z_channels=cfg.z_channels, num_res_blocks=cfg.num_res_blocks)
    vq = VQModel(args)
    _, train = render_pool(cfg.train_images, seed=cfg.seed)
    _, held_out = render_pool(cfg.eval_images, seed=cfg.seed + 1)
    usage = torch.zeros(args.codebook_size)
    gen = torch.Generator().manual_seed(cfg.seed)

    def step(i):
        x = to_float(train[torch.randint(len(train), (cfg.batch,), generator=gen)])
        if cfg.crop:  # random crops (multiples of the token size): same convolutions, a fraction of the cost
            g = args.downsample
            r, c = (int(v) * g for v in torch.randint(0, (x.shape[2] - cfg.crop) // g + 1, (2,), generator=gen))
            x = x[:, :, r:r + cfg.crop, c:c + cfg.crop]
        if i and i % cfg.restart_every == 0:  # dead codes -> random current latents
            dead = (usage == 0).nonzero().flatten()
            if len(dead):
                with torch.no_grad():
                    z = F.normalize(vq.encode_pre(x).float().reshape(-1, args.codebook_embed_dim), dim=-1)
                    vq.quantize.embedding.weight[dead] = z[torch.randint(len(z), (len(dead),), generator=gen)]
            usage.zero_()
        rec, vq_loss, idx = vq.forward_train(x)
        usage.index_add_(0, idx.flatten(), torch.ones(idx.numel()))
        rec = rec.float()
        rec_loss = (rec - x).abs().mean() + F.mse_loss(rec, x)
        return rec_loss + vq_loss, {"rec": rec_loss.item()}

    stats = run_steps("vq", vq.parameters(), step, cfg.steps, cfg.lr, log_every=cfg.log_every)
    metrics = evaluate(vq, held_out)
    log.info(f"[vq] held-out PSNR {metrics['psnr_db']:.2f} dB, {metrics['codes_used']}/{args.codebook_size} codes used")
    save_module(vq, out_dir / "vq.safetensors", metrics=metrics)
    return {**stats, **metrics}


def finetune_decoder(cfg, out_dir) -> dict:
    """Stage `vq_decoder`: the crop-trained decoder, tuned on whole images with the encoder and the
    codebook frozen (codes do not change, so a GPT trained on them stays valid). Whole images fix
    what crops cannot teach: global colour statistics and the image border."""
    from workflows.training.stages import load_stage
    torch.manual_seed(cfg.seed)
    vq = load_stage(out_dir, "vq").train()
    for m in (vq.encoder, vq.quant_conv, vq.quantize):
        m.requires_grad_(False)
    _, train = render_pool(cfg.train_images, seed=cfg.seed + 2)
    _, held_out = render_pool(cfg.eval_images, seed=cfg.seed + 1)
    gen = torch.Generator().manual_seed(cfg.seed)
    before = evaluate(vq, held_out)

    def step(_):
        x = to_float(train[torch.randint(len(train), (cfg.batch,), generator=gen)])
        with torch.no_grad():
            idx = vq.encode(x)
        g = vq.args.downsample
        rec = vq.decode_code(idx, [len(x), vq.args.codebook_embed_dim, x.shape[2] // g, x.shape[3] // g])
        loss = (rec - x).abs().mean() + F.mse_loss(rec, x)
        return loss, {}

    stats = run_steps("vq_decoder", [p for p in vq.parameters() if p.requires_grad], step, cfg.steps, cfg.lr,
                      log_every=cfg.log_every)
    metrics = evaluate(vq, held_out)
    log.info(f"[vq_decoder] held-out PSNR {before['psnr_db']:.2f} -> {metrics['psnr_db']:.2f} dB")
    save_module(vq, out_dir / "vq.safetensors", metrics=metrics)
    return {**stats, "psnr_before_db": before["psnr_db"], **metrics}
