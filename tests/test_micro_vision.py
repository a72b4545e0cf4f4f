"""micro-vision's training data: the pictures and the answer format the product parses;
and, when the checkpoint is shipped, its answers on a few held-out pictures."""

from pathlib import Path

import numpy as np
import pytest

from kimi_mlx.micro.vision_train import COLOURS, SHAPES, SIZE, answer, draw, reply_segments
from kimi_mlx.text.chat_format import encode_segments, parse_reply
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
        assert fg.sum() > 150  # radius >= 12: even a star covers more
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


def test_answer_format_parses_as_the_reply_content():
    tok = KimiTokenizer.from_pretrained(MICRO)
    ids = encode_segments(tok, reply_segments(answer("red", "circle")))
    reply = parse_reply(tok.decode(ids))
    assert reply == {"reasoning_content": "", "content": "a red circle", "tool_calls": []}
    assert ids[-1] == tok.special_tokens["<|end_of_msg|>"]
