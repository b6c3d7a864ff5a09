"""Shared fixtures: tiny random-weight models for unit checks, one Ray instance for the whole run."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))

from decoding.bundle import SHAPES_DIR, Conditions, ModelBundle  # noqa: E402
from decoding.models.drafter import Drafter, DrafterArgs  # noqa: E402
from decoding.models.gpt import GPT, GPTArgs  # noqa: E402
from decoding.models.vq import VQArgs, VQModel  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


def tiny_bundle(vocab=4, grid=2, dim=32, n_layer=2, std=0.5, seed=0, model_type="c2i") -> ModelBundle:
    """Random GPT + drafter over a tiny vocabulary and grid: short sequences whose exact distribution
    can be enumerated. Large init std makes the distributions far from uniform."""
    torch.manual_seed(seed)
    vq = VQModel(VQArgs(codebook_size=vocab, codebook_embed_dim=4, ch=32, ch_mult=[1], z_channels=32,
                        num_res_blocks=1))
    a = GPTArgs(dim=dim, n_layer=n_layer, n_head=2, vocab_size=vocab, block_size=grid * grid, num_classes=3,
                model_type=model_type, caption_dim=8, cls_token_num=1 if model_type == "c2i" else 3)
    gpt, drafter = GPT(a), Drafter(DrafterArgs.for_target(a))
    for p in list(gpt.parameters()) + list(drafter.parameters()):
        torch.nn.init.normal_(p, std=std)
    return ModelBundle("tiny", vq.eval(), gpt.eval(), drafter=drafter.eval(), dtype="float32")


def labels(n: int, label: int = 1) -> Conditions:
    return Conditions(torch.full((n,), label, dtype=torch.long), None, [])


@pytest.fixture(scope="session")
def tiny():
    return tiny_bundle()


def shipped(*names) -> bool:
    return all((SHAPES_DIR / f"{n}.safetensors").exists() for n in names)


@pytest.fixture(scope="session")
def ray_session():
    """One local Ray for every test that needs it (started on first use)."""
    import ray
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
