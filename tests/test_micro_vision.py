"""micro-vision's training data: the pictures and the answer format the product parses;
and the shipped checkpoint's greedy answers, through `kimi-mlx generate --image`, on
pictures drawn here by a drawing of the test's own (not the trainer's `draw`)."""

import math
from pathlib import Path

import numpy as np
import pytest

from kimi_mlx.commands.main import main
from kimi_mlx.micro.vision_train import (ASPECT_BUCKETS, COLOURS, SHAPES, SIDES, SIZE, SIZE_BUCKETS, answer,
                                        bucket_of, draw, fast_preprocess, grid_of, heldout_sizes,
                                        reply_segments, sample_size, sizes_in_cell)
from kimi_mlx.vision.preprocess import preprocess
from kimi_mlx.text.chat_format import encode_segments
from kimi_mlx.text.reply_parse import parse_reply
from kimi_mlx.text.tokenizer import KimiTokenizer

ASSET = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-vision"
MICRO = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro"


@pytest.mark.parametrize("shape", SHAPES)
def test_pictures_show_one_filled_shape_on_a_light_background(shape):
    rng = np.random.default_rng(0)
    for colour, rgb in COLOURS.items():
        img = np.asarray(draw(shape, colour, rng))
        assert img.shape == (SIZE, SIZE, 3)
        fg = (img == rgb).all(axis=-1)
        assert fg.sum() > 300  # radius >= 18: even a star covers more
        assert (img[~fg] >= 225).all()  # the rest is the light background (no antialiasing)
        ys, xs = np.nonzero(fg)
        assert ys.min() >= 0 and xs.max() < SIZE


def test_shapes_differ_in_how_much_of_their_box_they_fill():
    """circle pi/4 of its box, square 1, triangle ~1/2, star well under 1/2."""
    rng = np.random.default_rng(1)
    fill = {}
    for shape in SHAPES:
        img = np.asarray(draw(shape, "blue", rng))
        fg = (img == COLOURS["blue"]).all(axis=-1)
        ys, xs = np.nonzero(fg)
        fill[shape] = fg.sum() / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
    assert fill["square"] > 0.95 and 0.7 < fill["circle"] < 0.85
    assert 0.4 < fill["triangle"] < 0.6 and fill["star"] < 0.45


def test_training_sizes_cover_the_range_and_batch_by_grid():
    """Sizes 56-448 px a side, aspect 1:3-3:1, small ones more often; a grid's cell
    holds only sizes of that grid (by `preprocess`, the release's rule, not `grid_of`);
    `fast_preprocess` gives `preprocess`'s patches bit for bit on non-square pictures."""
    rng = np.random.default_rng(5)
    sizes = [sample_size(rng) for _ in range(3000)]
    w, h = np.array(sizes).T
    assert w.min() >= SIDES[0] and h.min() >= SIDES[0] and max(w.max(), h.max()) <= SIDES[1]
    ratio = w / h
    assert ratio.min() >= 1 / 3 and ratio.max() <= 3 and ratio.min() < 0.4 and ratio.max() > 2.5
    assert (np.maximum(w, h) < 224).mean() > 0.5  # small pictures (cheap) come more often
    for grid in [(4, 4), (10, 22), (32, 12), (6, 18)]:
        for cw, ch in sizes_in_cell(grid, 4, rng):
            img = draw("triangle", "green", rng, (cw, ch))
            want, got = preprocess(img), fast_preprocess(img)
            assert want.grid == got.grid == grid == grid_of(cw, ch), (cw, ch)
            assert np.array_equal(want.patches, got.patches)


def test_heldout_pictures_fill_every_bucket():
    sizes = heldout_sizes(120, np.random.default_rng(10000))
    counts = {}
    for w, h in sizes:
        for b in bucket_of(w, h):
            counts[b] = counts.get(b, 0) + 1
    # picture i: size bucket i % 3, aspect bucket (i // 3) % 3 (i // 3 runs 0..39)
    want = {name: 40 for name, _, _ in SIZE_BUCKETS}
    want.update(zip((name for name, _, _ in ASPECT_BUCKETS), (42, 39, 39)))
    assert counts == want
    assert bucket_of(300, 200) == ("224-448", "near square") and bucket_of(84, 252) == ("224-448", "tall 1:3-1:1.5")


def test_answer_format_parses_as_the_reply_content():
    tok = KimiTokenizer.from_pretrained(MICRO)
    ids = encode_segments(tok, reply_segments(answer("red", "circle")))
    reply = parse_reply(tok.decode(ids))
    assert reply == {"reasoning_content": "", "content": "a red circle", "tool_calls": []}
    assert ids[-1] == tok.special_tokens["<|end_of_msg|>"]


def _own_picture(shape, rgb, rng):
    """A SIZE x SIZE picture drawn independently of the trainer: light background, one
    filled shape of outer radius 20-40 px (a regular polygon / star by its circumradius,
    a circle, or a square of half side 0.8 r) at a random place fully inside."""
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIZE, SIZE), tuple(int(v) for v in rng.integers(230, 256, 3)))
    d = ImageDraw.Draw(im)
    r = float(rng.uniform(20, 40))
    cx, cy = (float(v) for v in rng.uniform(r + 1, SIZE - r - 1, 2))
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=rgb)
    elif shape == "square":
        d.rectangle([cx - 0.8 * r, cy - 0.8 * r, cx + 0.8 * r, cy + 0.8 * r], fill=rgb)
    else:  # equilateral triangle, or a five-pointed star with inner radius 0.42 r; point up
        k = 3 if shape == "triangle" else 10
        rad = [r if i % 2 == 0 or shape == "triangle" else 0.42 * r for i in range(k)]
        d.polygon([(cx + rad[i] * math.sin(2 * math.pi * i / k), cy - rad[i] * math.cos(2 * math.pi * i / k))
                   for i in range(k)], fill=rgb)
    return im


@pytest.mark.skipif(not (ASSET / "config.json").exists(), reason="micro-vision not shipped")
def test_shipped_model_names_colour_and_shape(tmp_path, capsys, monkeypatch):
    """24 pictures (each colour 4 times, each shape 6 times, fixed seed): at least 22
    greedy replies name both the colour and the shape (the card measures 97.5 % on the
    trainer's 120 held-out pictures). Each is a whole `kimi-mlx generate --image` run;
    the checkpoint is read from disk by the first and then reused (generation never
    changes the loaded model)."""
    import kimi_mlx.commands.generate as generate_command

    loaded, load = {}, generate_command.load_for_generation

    def load_once(spec, progress=False):
        if spec not in loaded:
            loaded[spec] = load(spec, progress=progress)
        return loaded[spec]

    monkeypatch.setattr(generate_command, "load_for_generation", load_once)
    rng = np.random.default_rng(2026)
    pairs = [(c, s) for c in COLOURS for s in SHAPES]
    right, replies = 0, []
    for i in rng.permutation(len(pairs)):
        colour, shape = pairs[i]
        path = tmp_path / f"{colour}-{shape}.png"
        _own_picture(shape, COLOURS[colour], rng).save(path)
        code = main(["generate", "--model", str(ASSET), "--image", str(path), "--prompt",
                     "What is in the image?", "--temp", "0", "--max-tokens", "24", "--verbose", "false"])
        out = capsys.readouterr()
        assert code == 0, out.err
        words = out.out.lower().replace(".", " ").split()
        right += colour in words and shape in words
        replies.append(f"{colour} {shape}: {out.out.strip()!r}")
    assert len(loaded) == 1
    assert right >= 22, "\n".join(replies)
