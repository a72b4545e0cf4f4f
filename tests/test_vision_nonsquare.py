"""Non-square pictures end to end, against independent references: our resize / pad /
patchify (`kimi_mlx.vision.preprocess`) against mlx-vlm 0.7.10's `KimiK3ImageProcessor`,
then our tower + projector against mlx-vlm's `kimi_k3` tower on those patches, on wide
and tall pictures whose merged grids have odd sides and whose sides are exact multiples
of 28 px or one pixel over (the pad rule's edges).

What these catch (each checked by a deliberate mutation when written): height and width
swapped anywhere (grid, patch order, position-embedding resize, RoPE, merge), a wrong
position-embedding interpolation (align_corners, bicubic for bilinear, a transposed
table), and an off-by-one in the pad rule."""

import math

import mlx.core as mx
import numpy as np
import pytest
from PIL import Image

from kimi_mlx.testing.checkpoints import rel_err, tolerance
from kimi_mlx.vision.preprocess import preprocess

from test_vision import _config, _reference  # noqa: E402  (tests/ is on sys.path)

# (width, height): merged grids (h/2 x w/2) with odd sides; sides exact multiples of 28
# px and one pixel over (no pad vs a 27-px strip of pad); wide and tall. (Pictures the
# resize rule shrinks: test_resized_non_square_picture_matches_mlx_vlm.)
SIZES = [
    (300, 200),   # the picture: 308 x 224 padded, grid 16 x 22 (merged 8 x 11)
    (84, 252),    # tall 1:3, exact multiples: grid 18 x 6 (merged 9 x 3), no pad
    (85, 253),    # one px over both: grid 20 x 8 (merged 10 x 4), 27 px of pad each way
    (308, 140),   # wide, exact: grid 10 x 22 (merged 5 x 11)
    (309, 141),   # one px over: grid 12 x 24 (merged 6 x 12)
    (58, 170),    # small tall: grid 14 x 6 (merged 7 x 3)
]


def _noise_picture(w: int, h: int, seed: int) -> Image.Image:
    """Random RGB pixels plus a bright top-left corner block, so that any transposition
    or shift of rows / columns changes the patches."""
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    arr[: h // 3, : w // 5] = (250, 20, 20)
    return Image.fromarray(arr, "RGB")


def _mlx_vlm_processor(**kw):
    from mlx_vlm.models.kimi_k3.processing_kimi_k3 import KimiK3ImageProcessor

    # our preprocess's defaults (MediaProcArgs): the release's media_proc_cfg
    return KimiK3ImageProcessor(patch_size=14, image_mean=(0.5, 0.5, 0.5), image_std=(0.5, 0.5, 0.5),
                                in_patch_limit=kw.get("in_patch_limit", 65536), merge_kernel_size=[2, 2],
                                patch_limit_on_one_side=512, transparent_bg_config=None)


@pytest.fixture(scope="module")
def pair():
    from kimi_mlx.testing.checkpoints import random_vision

    config = _config()
    ours = random_vision(config, seed=11)
    return config, ours, _reference(config, ours)


@pytest.mark.parametrize("size", SIZES, ids=[f"{w}x{h}" for w, h in SIZES])
def test_non_square_picture_matches_mlx_vlm_end_to_end(pair, size):
    """preprocess == mlx-vlm's processor (grid and every pixel), then tower + projector ==
    mlx-vlm's on those patches (project tolerance rule), then the reference's rows in
    our merge order."""
    config, ours, ref = pair
    w, h = size
    img = _noise_picture(w, h, seed=w * 1000 + h)
    mine = preprocess(img)
    theirs = _mlx_vlm_processor()(img)
    grid_thw = [int(v) for v in np.array(theirs["grid_thws"])[0]]
    assert grid_thw == [1, *mine.grid], f"{w}x{h}: our grid {mine.grid}, mlx-vlm's {grid_thw[1:]}"
    gh, gw = mine.grid
    assert (gh, gw) == (2 * math.ceil(h / 28), 2 * math.ceil(w / 28))  # the pad rule by hand
    np.testing.assert_allclose(mine.patches, np.array(theirs["pixel_values"]), rtol=0, atol=2e-7)
    got = ours(mx.array(mine.patches), [mine.grid])
    want = ref(mx.array(mine.patches), [mine.grid])
    assert got.shape == want.shape == (gh * gw // 4, config["text_config"]["hidden_size"])
    widths = [ours.args.vt_hidden_size, ours.args.vt_intermediate_size, 3 * 14 * 14,
              ours.args.merged_size, gh * gw]
    tol = tolerance(ours.args.vt_num_hidden_layers + 1, max(widths))
    err = rel_err(got, want)
    print(f"{w}x{h} grid {gh}x{gw}: rel err {err:.3g}, tol {tol:.3g}")
    assert err <= tol


def test_resized_non_square_picture_matches_mlx_vlm():
    """A picture the rule shrinks (patch limit 1024 here): same new size, pad and pixels
    (Pillow bicubic on both sides) as mlx-vlm's processor, on a wide and a tall one."""
    from kimi_mlx.vision.config import MediaProcArgs

    cfg = MediaProcArgs(in_patch_limit=1024)
    for w, h in ((1400, 420), (401, 1213)):
        img = _noise_picture(w, h, seed=w + h)
        mine = preprocess(img, cfg)
        theirs = _mlx_vlm_processor(in_patch_limit=1024)(img)
        assert [int(v) for v in np.array(theirs["grid_thws"])[0]] == [1, *mine.grid]
        assert mine.grid[0] != mine.grid[1] and mine.grid[0] * mine.grid[1] < (w // 14) * (h // 14)
        np.testing.assert_allclose(mine.patches, np.array(theirs["pixel_values"]), rtol=0, atol=2e-7)
