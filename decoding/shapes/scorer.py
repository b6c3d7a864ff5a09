"""Reads a 64x64 shapes image back into its attributes (a small CNN with one head per attribute),
so prompt adherence of generated images can be measured against the caption they were asked for."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch
import torch.nn as nn

from decoding.shapes.world import ATTRIBUTES, Scene, parse_caption


@dataclass
class ScorerArgs:
    attributes: dict = field(default_factory=lambda: {k: list(v) for k, v in ATTRIBUTES.items()})
    width: int = 32

    def to_dict(self) -> dict:
        return asdict(self)


class Scorer(nn.Module):
    kind, Args = "scorer", ScorerArgs

    def __init__(self, a: ScorerArgs):
        super().__init__()
        self.args = a
        w = a.width
        chans = [3, w, 2 * w, 2 * w, 4 * w]
        layers = []
        for cin, cout in zip(chans, chans[1:]):
            layers += [nn.Conv2d(cin, cout, 3, stride=2, padding=1), nn.BatchNorm2d(cout), nn.GELU()]
        self.body = nn.Sequential(*layers, nn.Flatten(), nn.Linear(4 * w * 16, 256), nn.GELU())
        self.heads = nn.ModuleDict({k: nn.Linear(256, len(v)) for k, v in a.attributes.items()})

    def forward(self, x: torch.Tensor) -> dict:
        h = self.body(x)
        return {k: head(h) for k, head in self.heads.items()}

    @torch.no_grad()
    def predict(self, images_u8: np.ndarray, chunk: int = 256) -> list[dict]:
        """uint8 [B, 64, 64, 3] -> one {attribute: value} dict per image."""
        out = []
        for i in range(0, len(images_u8), chunk):
            x = torch.from_numpy(np.ascontiguousarray(images_u8[i:i + chunk])).permute(0, 3, 1, 2).float() / 127.5 - 1
            logits = self(x.to(next(self.parameters()).device))
            idx = {k: v.argmax(-1).tolist() for k, v in logits.items()}
            out += [{k: self.args.attributes[k][idx[k][j]] for k in idx} for j in range(len(x))]
        return out


def adherence(predicted: dict, scene: Scene) -> dict:
    """Per-attribute match of a prediction with the scene; `all` is the strict, every-attribute score."""
    wanted = scene.attributes()
    hits = {k: float(predicted[k] == wanted[k]) for k in wanted}
    return {**hits, "all": float(all(hits.values()))}


def score_prompts(scorer: Scorer, images_u8: np.ndarray, prompts: list[str]) -> list[dict | None]:
    """Adherence per image, or None where the prompt is not a shapes caption."""
    preds = scorer.predict(images_u8)
    return [None if (s := parse_caption(p)) is None else adherence(pr, s) for pr, p in zip(preds, prompts)]


def mean_adherence(scores: list[dict | None]) -> dict | None:
    """Per-attribute means (and `all`, the strict score) over the images that have a score."""
    scores = [s for s in scores if s is not None]
    if not scores:
        return None
    return {k: round(float(np.mean([s[k] for s in scores])), 3) for k in scores[0]}
