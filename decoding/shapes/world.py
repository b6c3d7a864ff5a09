"""The built-in "shapes" world: procedural captioned images with known ground truth.

A scene is one shape (circle, square, triangle, star) of a colour and size at one of five positions, on a
flat or speckled background. Flat backgrounds are easy regions for a draft tree, object edges and speckle
are hard ones; captions come from a small grammar so prompt adherence can be scored exactly. Speckle
shades about a third of the cells of a 4-pixel lattice (one token of a 16x16 tokenizer), each cell
lighter or darker than the ground: a token there has three likely values (~0.9 nats), real ambiguity
that a model can still learn, where pixel-level noise would be mostly unlearnable entropy.

    >>> scene = Scene.sample(np.random.default_rng(0))
    >>> scene.caption
    'a small green star at the top right on a speckled purple background'
    >>> render(scene).shape
    (64, 64, 3)
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image, ImageDraw

SIZE = 64
SHAPES = ("circle", "square", "triangle", "star")
COLOURS = {
    "red": (220, 40, 40), "orange": (245, 140, 30), "yellow": (240, 220, 50), "green": (50, 170, 70),
    "blue": (40, 80, 220), "purple": (140, 60, 190), "white": (240, 240, 240), "black": (25, 25, 25),
}
SIZES = {"small": 9.0, "large": 17.0}  # radius in pixels
POSITIONS = {
    "in the center": (32, 32), "at the top left": (20, 20), "at the top right": (44, 20),
    "at the bottom left": (20, 44), "at the bottom right": (44, 44),
}
TEXTURES = ("plain", "speckled")
ATTRIBUTES = {"shape": SHAPES, "colour": tuple(COLOURS), "size": tuple(SIZES),
              "position": tuple(POSITIONS), "background": tuple(COLOURS), "texture": TEXTURES}
SUPERSAMPLE = 4
CELL = 4                # speckle lattice: one dot per 4x4 cell at most (one VQ token at 16x16)
SPECKLE_DENSITY = 0.35


@dataclass(frozen=True)
class Scene:
    shape: str
    colour: str
    size: str
    position: str
    background: str
    texture: str = "plain"
    jitter_seed: int = 0  # small position/size jitter, so object edges carry real uncertainty

    def __post_init__(self):
        for name, values in ATTRIBUTES.items():
            if getattr(self, name) not in values:
                raise ValueError(f"scene.{name}={getattr(self, name)!r}: choose one of {values}")
        if self.colour == self.background:
            raise ValueError(f"scene colour and background are both {self.colour!r}: pick two different colours")

    @property
    def caption(self) -> str:
        texture = "speckled " if self.texture == "speckled" else ""
        return f"a {self.size} {self.colour} {self.shape} {self.position} on a {texture}{self.background} background"

    @property
    def split(self) -> str:
        return "textured" if self.texture == "speckled" else "flat"

    def attributes(self) -> dict:
        d = asdict(self)
        d.pop("jitter_seed")
        return d

    @classmethod
    def sample(cls, rng: np.random.Generator, texture: str | None = None) -> "Scene":
        colour, background = rng.choice(len(COLOURS), size=2, replace=False)
        names = list(COLOURS)
        return cls(
            shape=SHAPES[rng.integers(len(SHAPES))], colour=names[colour],
            size=list(SIZES)[rng.integers(len(SIZES))], position=list(POSITIONS)[rng.integers(len(POSITIONS))],
            background=names[background], texture=texture or TEXTURES[rng.integers(len(TEXTURES))],
            jitter_seed=int(rng.integers(2**31)),
        )


_CAPTION = re.compile(
    r"a (?P<size>\w+) (?P<colour>\w+) (?P<shape>\w+) (?P<position>in the center|at the \w+ \w+)"
    r" on a (?P<texture>speckled )?(?P<background>\w+) background")


def parse_caption(caption: str) -> Scene | None:
    """The scene a shapes caption describes, or None for any other text (a real-world prompt)."""
    m = _CAPTION.fullmatch(" ".join(caption.lower().split()).rstrip("."))
    if m is None:
        return None
    d = m.groupdict()
    d["texture"] = "speckled" if d["texture"] else "plain"
    try:
        return Scene(**d)
    except ValueError:
        return None


def _shade(rgb, amount: int):
    return tuple(int(np.clip(c + amount, 0, 255)) for c in rgb)


def _polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        s = r * 0.85
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":
        return [(cx + r * np.cos(a), cy - r * np.sin(a)) for a in np.pi / 2 + np.arange(3) * 2 * np.pi / 3]
    if shape == "star":
        radii = np.where(np.arange(10) % 2 == 0, r, r * 0.45)
        angles = np.pi / 2 + np.arange(10) * np.pi / 5
        return [(cx + q * np.cos(a), cy - q * np.sin(a)) for q, a in zip(radii, angles)]
    raise ValueError(shape)


def render(scene: Scene) -> np.ndarray:
    """uint8 [64, 64, 3]. Deterministic in the scene (jitter and speckle come from jitter_seed)."""
    rng = np.random.default_rng(scene.jitter_seed)
    k = SUPERSAMPLE
    bg = COLOURS[scene.background]
    img = np.empty((SIZE, SIZE, 3), np.uint8)
    img[:] = bg
    if scene.texture == "speckled":  # about a third of the cells of a 4-pixel lattice, lighter or darker
        n = SIZE // CELL
        dots = rng.random((n, n)) < SPECKLE_DENSITY
        sign = np.where(rng.random((n, n)) < 0.5, -1, 1)
        if sum(bg) < 120:
            sign[:] = 1
        elif sum(bg) > 660:
            sign[:] = -1
        for s in (-1, 1):
            img[np.kron(dots & (sign == s), np.ones((CELL, CELL), bool))] = _shade(bg, 70 * s)
    canvas = Image.fromarray(img).resize((SIZE * k, SIZE * k), Image.NEAREST)
    draw = ImageDraw.Draw(canvas)
    cx, cy = POSITIONS[scene.position]
    cx, cy = (cx + rng.uniform(-2, 2)) * k, (cy + rng.uniform(-2, 2)) * k
    r = SIZES[scene.size] * rng.uniform(0.92, 1.08) * k
    fill = COLOURS[scene.colour]
    if scene.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(_polygon(scene.shape, cx, cy, r), fill=fill)
    return np.asarray(canvas.resize((SIZE, SIZE), Image.BOX))


def builtin_prompts(n: int = 96, seed: int = 0) -> list[dict]:
    """The job's default data: n captions, half flat and half speckled, each with a stable id."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        scene = Scene.sample(rng, texture=TEXTURES[i % 2])
        out.append({"prompt_id": f"shapes-{i:04d}", "prompt": scene.caption, "split": scene.split})
    return out


def sample_scenes(n: int, seed: int) -> list[Scene]:
    rng = np.random.default_rng(seed)
    return [Scene.sample(rng) for _ in range(n)]
