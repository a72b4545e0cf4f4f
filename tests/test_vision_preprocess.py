"""Image preprocessing against hand computations of the release's rule: sizes, patch
counts, pixel values, padding, alpha on the chessboard, formats, and bounded work."""

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image

from kimi_mlx.vision.preprocess import (ImageError, load_and_preprocess, open_image, preprocess,
                                        resize_plan, token_count)


def _png(arr, mode=None) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr, mode).save(buf, "PNG")
    return buf.getvalue()


def _norm(u8):
    return (u8.astype(np.float64) / 255.0 - 0.5) / 0.5


def _unpatch(patches, grid):
    """[gh*gw, 3, 14, 14] -> [gh*14, gw*14, 3] (inverse of the row-major patchify)."""
    gh, gw = grid
    return patches.reshape(gh, gw, 3, 14, 14).transpose(0, 3, 1, 4, 2).reshape(gh * 14, gw * 14, 3)


# (W, H) -> (resized W, H, pad W, H, tokens), worked by hand from
# scale = min(1, sqrt(65536 / ((W//14)(H//14))), 7168/W, 7168/H):
HAND = {
    (448, 448): (448, 448, 0, 0, 256),          # spec: 1024 patches, 256 tokens
    (896, 896): (896, 896, 0, 0, 1024),         # 64 x 64 grid
    (500, 300): (500, 300, 4, 8, 198),          # 504 x 308 -> 36 x 22 patches -> 18 x 11
    (20, 10): (20, 10, 8, 18, 1),               # tiny: one 28 x 28 token
    (3000, 3000): (3000, 3000, 24, 24, 11664),  # 214^2 = 45796 patches <= 65536: no resize
    (4000, 3000): (4000, 3000, 4, 24, 15444),   # s1 = sqrt(65536 / (285*214)) = 1.037
    # s1 = 256 / 1428 -> int(20000 * 0.179272) = 3585 = 28*128 + 1 -> pad 27 -> 129^2 tokens
    (20000, 20000): (3585, 3585, 27, 27, 16641),
    (8000, 600): (7168, 537, 0, 23, 5120),      # side limit 7168 / 8000 = 0.896
}


@pytest.mark.parametrize("size", sorted(HAND))
def test_resize_rule(size):
    new_w, new_h, pad_w, pad_h, tokens = HAND[size]
    assert resize_plan(*size) == (new_w, new_h, pad_w, pad_h)
    assert token_count(*size) == tokens


def test_pixels_no_resize_with_padding():
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (300, 500, 3), dtype=np.uint8)
    out = load_and_preprocess(_png(img))
    assert out.grid == (22, 36) and out.patches.shape == (22 * 36, 3, 14, 14)
    assert (out.width, out.height, out.num_tokens) == (500, 300, 198)
    assert out.patches.dtype == np.float32
    full = _unpatch(out.patches, out.grid)
    np.testing.assert_array_equal(full[:300, :500], _norm(img).astype(np.float32))
    assert (full[300:] == -1.0).all() and (full[:, 500:] == -1.0).all()
    # patch 37 = row 1, column 1, channel-first
    np.testing.assert_array_equal(out.patches[37], _norm(img[14:28, 14:28]).astype(np.float32).transpose(2, 0, 1))


def test_pixels_after_bicubic_resize():
    rng = np.random.default_rng(1)
    img = rng.integers(0, 256, (100, 8000, 3), dtype=np.uint8)
    out = load_and_preprocess(_png(img))
    # scale 7168 / 8000 = 0.896: 7168 x int(89.6) = 89, padded to 112: 8 x 512 patches
    assert out.grid == (8, 512) and out.num_tokens == 1024  # resized, never 8000 px wide
    want = np.asarray(Image.fromarray(img).resize((7168, 89), Image.Resampling.BICUBIC))
    full = _unpatch(out.patches, out.grid)
    np.testing.assert_array_equal(full[:89], _norm(want).astype(np.float32))
    assert (full[89:] == -1.0).all()


def test_alpha_is_composited_on_the_chessboard():
    rgba = np.zeros((28, 56, 4), np.uint8)
    rgba[..., 0] = 200
    rgba[..., 1] = 10
    rgba[..., 2] = 90
    rgba[:, 28:42, 3] = 255          # opaque band
    rgba[:, 42:, 3] = 100            # partial alpha
    out = load_and_preprocess(_png(rgba, "RGBA"))
    got = np.rint((_unpatch(out.patches, out.grid) + 1) * 127.5).astype(int)
    board = np.where(((np.arange(28)[:, None] // 8) + (np.arange(56)[None] // 8)) % 2 == 0, 255, 180)
    # transparent: the board (white at the top-left 8 x 8, grey beside it)
    np.testing.assert_array_equal(got[:, :28, 0], board[:, :28])
    assert got[0, 0, 0] == 255 and got[0, 8, 0] == 180 and got[8, 0, 0] == 180 and got[8, 8, 0] == 255
    # opaque: the colour
    assert (got[:, 28:42] == [200, 10, 90]).all()
    # partial: floor(a rgb + (1 - a) board) (float32 in the release: within one level)
    a = 100 / 255
    for c, v in enumerate([200, 10, 90]):
        want = np.floor(a * v + (1 - a) * board[:, 42:])
        assert np.abs(got[:, 42:, c] - want).max() <= 1


def test_palette_transparency_counts_as_alpha():
    p = Image.new("P", (28, 28), 0)
    p.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    p.paste(1, (14, 0, 28, 28))
    buf = io.BytesIO()
    p.save(buf, "PNG", transparency=0)
    got = np.rint((_unpatch(load_and_preprocess(buf.getvalue()).patches, (2, 2)) + 1) * 127.5)
    assert (got[0, 0] == 255).all() and (got[0, 8] == 180).all()  # transparent red -> board
    assert (got[:, 14:] == [0, 0, 255]).all()


@pytest.mark.parametrize("fmt", ["JPEG", "WEBP"])
def test_jpeg_and_webp_decode(fmt):
    img = np.random.default_rng(2).integers(0, 256, (56, 84, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, fmt, **({"lossless": True} if fmt == "WEBP" else {"quality": 90}))
    decoded = np.asarray(Image.open(io.BytesIO(buf.getvalue())).convert("RGB"))
    if fmt == "WEBP":
        np.testing.assert_array_equal(decoded, img)
    out = load_and_preprocess(buf.getvalue())
    np.testing.assert_array_equal(_unpatch(out.patches, out.grid), _norm(decoded).astype(np.float32))


def test_gif_first_frame():
    frames = [Image.new("RGB", (28, 28), c) for c in ((255, 0, 0), (0, 255, 0))]
    buf = io.BytesIO()
    frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
    got = np.rint((load_and_preprocess(buf.getvalue()).patches + 1) * 127.5)
    assert (got[:, 0] == 255).all() and (got[:, 1] == 0).all()


def _png_header_only(w, h) -> bytes:
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


def test_decompression_bomb_refused_unread():
    with pytest.raises(ImageError, match=r"bomb.png: 100000x100000 = 10000000000 pixels is over the limit"):
        open_image(_png_header_only(100000, 100000), name="bomb.png")
    with pytest.raises(ImageError, match="over the limit of 5000"):
        open_image(_png(np.zeros((100, 100, 3), np.uint8)), max_pixels=5000)


def test_bad_files_are_named(tmp_path):
    with pytest.raises(ImageError, match="nope.png: cannot read"):
        load_and_preprocess(tmp_path / "nope.png")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(ImageError, match="x.txt: not an image"):
        load_and_preprocess(tmp_path / "x.txt")
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, "BMP")
    with pytest.raises(ImageError, match="unsupported image format BMP"):
        load_and_preprocess(bmp.getvalue())
    with pytest.raises(ImageError, match="corrupt or truncated PNG"):
        noise = np.random.default_rng(3).integers(0, 256, (64, 64, 3), dtype=np.uint8)
        load_and_preprocess(_png(noise)[:4000])
