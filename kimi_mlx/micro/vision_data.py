"""micro-vision's pictures: the synthetic task (one shape of one colour on a plain
background, drawn at any size and aspect), its answer and reply segments, and the sizes of
the training and held-out pictures with their (size, aspect) buckets. Used by the trainer
(`kimi_mlx.micro.vision_train`), its evaluation, benches and tests that need a picture.
"""

from __future__ import annotations

import math
from typing import List, Tuple

import numpy as np

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (235, 200, 30), "purple": (140, 60, 180), "orange": (245, 140, 30)}
SHAPES = ("circle", "square", "triangle", "star")
SIZE = 112  # px, the default picture side (the demo's picture)
SIDES = (56, 448)  # px, the range of either side of a training / held-out picture
MAX_ASPECT = 3.0  # long side / short side at most
RADIUS = (18 / 112, 42 / 112)  # the shape's outer radius as a fraction of the short side
MERGE_PX = 28  # patch 14 x merge 2: grids come in steps of 28 px
# Held-out buckets: the long side in px, and width / height.
SIZE_BUCKETS = (("56-111", 56, 111), ("112-223", 112, 223), ("224-448", 224, 448))
ASPECT_BUCKETS = (("tall 1:3-1:1.5", 1 / 3, 1 / 1.5), ("near square", 1 / 1.5, 1.5),
                  ("wide 1.5:1-3:1", 1.5, 3.0))
QUESTION = "What is in the image?"


def draw(shape: str, colour: str, rng: np.random.Generator, size: Tuple[int, int] = (SIZE, SIZE)):
    """An RGB Pillow picture of `size` (width, height) px: a light plain background (each
    channel 225..255) and one filled `shape` of `colour`, outer radius RADIUS times the
    short side, centred at least one radius from each edge. Raises ValueError for an
    unknown shape."""
    from PIL import Image, ImageDraw

    W, H = size
    bg = tuple(int(v) for v in rng.integers(225, 256, 3))
    im = Image.new("RGB", (W, H), bg)
    d = ImageDraw.Draw(im)
    r = rng.uniform(RADIUS[0] * min(W, H), RADIUS[1] * min(W, H))
    cx, cy = rng.uniform(r, W - r), rng.uniform(r, H - r)
    c = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=c)
    elif shape == "square":
        h = r * 0.85
        d.rectangle([cx - h, cy - h, cx + h, cy + h], fill=c)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r * 0.95, cy + r * 0.75), (cx + r * 0.95, cy + r * 0.75)], fill=c)
    elif shape == "star":
        pts = [(cx + (r if k % 2 == 0 else r * 0.45) * math.cos(-math.pi / 2 + k * math.pi / 5),
                cy + (r if k % 2 == 0 else r * 0.45) * math.sin(-math.pi / 2 + k * math.pi / 5))
               for k in range(10)]
        d.polygon(pts, fill=c)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return im


def sample(rng: np.random.Generator) -> Tuple[str, str]:
    """A random (colour, shape) pair, uniform over the 24."""
    return list(COLOURS)[rng.integers(len(COLOURS))], SHAPES[rng.integers(len(SHAPES))]


def sample_size(rng: np.random.Generator) -> Tuple[int, int]:
    """A random (width, height) in px: each side log-uniform over SIDES (so small
    pictures, cheap to train on, come more often), long / short side at most MAX_ASPECT."""
    lo, hi = np.log(SIDES[0]), np.log(SIDES[1])
    while True:
        w, h = (int(round(v)) for v in np.exp(rng.uniform(lo, hi, 2)))
        if max(w, h) <= MAX_ASPECT * min(w, h):
            return w, h


def grid_of(width: int, height: int) -> Tuple[int, int]:
    """The (h, w) patch grid of a picture within SIDES: the resize rule keeps it as it
    is (never upscales; under the patch limits), the pad rule rounds each side up to 28 px."""
    return (2 * -(-height // MERGE_PX), 2 * -(-width // MERGE_PX))


def sizes_in_cell(grid: Tuple[int, int], n: int, rng: np.random.Generator) -> List[Tuple[int, int]]:
    """n random (width, height) within SIDES and MAX_ASPECT whose grid is `grid`: the
    pictures of one batch (batches are bucketed by grid, so the tower runs them at once)."""
    gh, gw = grid

    def side(g):
        return max(SIDES[0], MERGE_PX * (g // 2 - 1) + 1), min(SIDES[1], MERGE_PX * g // 2)

    (wlo, whi), (hlo, hhi) = side(gw), side(gh)
    out = []
    while len(out) < n:
        w, h = int(rng.integers(wlo, whi + 1)), int(rng.integers(hlo, hhi + 1))
        if max(w, h) <= MAX_ASPECT * min(w, h) or (wlo == whi and hlo == hhi):
            out.append((w, h))
    return out


def answer(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def reply_segments(text: str):
    """The assistant turn after the generation prompt: empty think, `text`, end."""
    from kimi_mlx.text.chat_format import CLOSE, END_OF_MSG, OPEN, SEP

    return [(True, CLOSE), (False, "think"), (True, SEP), (True, OPEN), (False, "response"),
            (True, SEP), (False, text), (True, CLOSE), (False, "response"), (True, SEP),
            (True, CLOSE), (False, "message"), (True, SEP), (True, END_OF_MSG)]


def bucket_of(width: int, height: int) -> Tuple[str, str]:
    """(size bucket, aspect bucket) names of a picture (SIZE_BUCKETS by the long side,
    ASPECT_BUCKETS by width / height; the edges go to the squarer bucket)."""
    long_side, ratio = max(width, height), width / height
    size = next(name for name, lo, hi in SIZE_BUCKETS if lo <= long_side <= hi)
    aspect = next((name for name, lo, hi in ASPECT_BUCKETS[1:2] if lo <= ratio <= hi), None) or \
        next(name for name, lo, hi in ASPECT_BUCKETS if lo <= ratio <= hi)
    return size, aspect


def heldout_sizes(n: int, rng: np.random.Generator) -> List[Tuple[int, int]]:
    """n (width, height) stratified over the 3 x 3 (size, aspect) buckets in turn
    (picture i in size bucket i % 3, aspect bucket (i // 3) % 3): within a bucket the long
    side is uniform over its range and the aspect log-uniform over its range, short side
    at least SIDES[0]."""
    out = []
    for i in range(n):
        _, lo, hi = SIZE_BUCKETS[i % 3]
        _, alo, ahi = ASPECT_BUCKETS[(i // 3) % 3]
        while True:
            long_side = int(rng.integers(lo, hi + 1))
            ratio = float(np.exp(rng.uniform(np.log(alo), np.log(ahi))))
            w, h = (long_side, round(long_side / ratio)) if ratio >= 1 else (round(long_side * ratio), long_side)
            if min(w, h) >= SIDES[0] and bucket_of(w, h) == (SIZE_BUCKETS[i % 3][0], ASPECT_BUCKETS[(i // 3) % 3][0]):
                out.append((w, h))
                break
    return out
