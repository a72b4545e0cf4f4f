"""The MoonViT3d tower and patchmergerv2 projector against mlx-vlm 0.7.10's `kimi_k3`
vision code (an independent MLX port, a dev dependency), on random weights in the
official layout, within the project's tolerance rule; plus the loader and the pieces
that have closed forms (2x2-mean position resize, RoPE layout, merge order)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from kimi_mlx.checkpoint.loader import CheckpointError, load_model, load_vision
from kimi_mlx.testing.checkpoints import (build_checkpoint, full_config, random_vision, rel_err,
                                          tiny_text_config, tiny_vision_config, tolerance)
from kimi_mlx.vision.config import VisionArgs, VisionConfigError
from kimi_mlx.vision.tower import VisionModel, interpolation_matrix, rope_angles


def _config(**vision):
    return full_config(tiny_text_config(), tiny_vision_config(**vision))


def _reference(config, ours: VisionModel):
    """mlx-vlm 0.7.10's tower + projector with our weights (the patch projection in MLX's
    OHWI conv layout, as its sanitize does)."""
    from mlx_vlm.models.kimi_k3 import config as vcfg
    from mlx_vlm.models.kimi_k3.kimi_k3 import KimiK3MultiModalProjector
    from mlx_vlm.models.kimi_k3.vision import VisionModel as RefTower

    vc = vcfg.VisionConfig.from_dict(config["vision_config"])
    tc = vcfg.TextConfig.from_dict(config["text_config"])
    mc = vcfg.ModelConfig(text_config=tc, vision_config=vc)
    tower, proj = RefTower(vc), KimiK3MultiModalProjector(mc)
    w = dict(tree_flatten(ours.parameters()))
    tw = [(k[len("vision_tower."):], v) for k, v in w.items() if k.startswith("vision_tower.")]
    tw = [(k, v.transpose(0, 2, 3, 1) if k == "patch_embed.proj.weight" else v) for k, v in tw]
    tower.load_weights(tw, strict=True)
    proj.load_weights([(k[len("mm_projector."):], v) for k, v in w.items()
                       if k.startswith("mm_projector.")], strict=True)

    def run(patches, grids):
        feats = tower(patches.transpose(0, 2, 3, 1), grid_thws=[[1, h, w_] for h, w_ in grids])
        return proj(feats)
    return run


def _patches(grids, seed, pad=None):
    """Random normalised pixels in [-1, 1] as patches [L, 3, 14, 14]; `pad` = (rows, cols)
    of pixels at the bottom / right of each image set to -1 (black zero padding)."""
    rng = np.random.default_rng(seed)
    out = []
    for h, w in grids:
        img = rng.uniform(-1, 1, (h * 14, w * 14, 3)).astype(np.float32)
        if pad:
            img[h * 14 - pad[0]:, :] = -1.0
            img[:, w * 14 - pad[1]:] = -1.0
        p = img.reshape(h, 14, w, 14, 3).transpose(0, 2, 4, 1, 3).reshape(-1, 3, 14, 14)
        out.append(p)
    return mx.array(np.concatenate(out))


def _tol(args: VisionArgs, grids) -> float:
    widths = [args.vt_hidden_size, args.vt_intermediate_size, args.qkv_size, 3 * 14 * 14,
              args.merged_size] + [h * w for h, w in grids]
    return tolerance(args.vt_num_hidden_layers + 1, max(widths))


@pytest.fixture(scope="module")
def pair():
    config = _config()
    ours = random_vision(config, seed=3)
    return config, ours, _reference(config, ours)


@pytest.mark.parametrize("grids,pad", [
    ([(64, 64)], None),              # 896 x 896: the stored 64 x 64 grid, no resize
    ([(32, 32)], None),              # 448 x 448: bilinear resize 64 -> 32
    ([(22, 36)], (8, 4)),            # 500 x 300 padded to 504 x 308
    ([(32, 32), (22, 36)], (8, 4)),  # two images in one request
    ([(70, 20)], None),              # 980 x 280: rows upsampled past the 64 grid
])
def test_tower_matches_mlx_vlm(pair, grids, pad):
    config, ours, ref = pair
    patches = _patches(grids, seed=len(grids) + grids[0][0], pad=pad)
    got = ours(patches, grids)
    want = ref(patches, grids)
    n_tokens = sum(h * w for h, w in grids) // 4
    assert got.shape == want.shape == (n_tokens, config["text_config"]["hidden_size"])
    err = rel_err(got, want)
    tol = _tol(ours.args, grids)
    print(f"grids {grids}: rel err {err:.3g} (max abs {mx.abs(got - want).max().item():.3g}), tol {tol:.3g}")
    assert err <= tol


def test_two_images_do_not_attend_to_each_other(pair):
    """Block-diagonal attention: each image's rows equal that image run alone."""
    _, ours, _ = pair
    grids = [(32, 32), (22, 36)]
    both = ours(_patches(grids, 5), grids)
    a = ours(_patches(grids, 5)[: 32 * 32], grids[:1])
    b = ours(_patches(grids, 5)[32 * 32:], grids[1:])
    tol = _tol(ours.args, grids)
    assert rel_err(both[:256], a) <= tol and rel_err(both[256:], b) <= tol


def test_bilinear_halving_is_the_2x2_mean():
    R = interpolation_matrix(64, 32, "bilinear")
    x = np.random.default_rng(0).normal(size=64)
    np.testing.assert_allclose(R @ x, x.reshape(32, 2).mean(axis=1), rtol=0, atol=1e-12)
    assert np.array_equal(interpolation_matrix(64, 64, "bicubic"), np.eye(64))
    # bicubic taps weigh to 1 and differ from bilinear's on a non-trivial resize
    B = interpolation_matrix(64, 22, "bicubic")
    np.testing.assert_allclose(B.sum(axis=1), 1.0, atol=1e-12)
    assert np.abs(B - interpolation_matrix(64, 22, "bilinear")).max() > 1e-3


def test_pos_emb_mode_is_read_from_config(pair):
    config, ours, _ = pair
    bicubic = VisionModel(VisionArgs.from_config(_config(pos_emb_interpolation_mode="bicubic")))
    bicubic.load_weights(list(tree_flatten(ours.parameters())))
    grids = [(22, 36)]
    assert rel_err(bicubic(_patches(grids, 1), grids), ours(_patches(grids, 1), grids)) > 1e-3
    absent = dict(config["vision_config"])
    del absent["pos_emb_interpolation_mode"]
    assert VisionArgs.from_config({**config, "vision_config": absent}).pos_emb_interpolation_mode == "bilinear"
    with pytest.raises(VisionConfigError, match="pos_emb_interpolation_mode"):
        VisionArgs.from_config(_config(pos_emb_interpolation_mode="nearest"))


def test_rope_angles_put_width_first():
    a = np.array(rope_angles(8, 2, 3))  # 2 rows x 3 cols, hd 8: frequencies 1, 10000^-0.5
    f1 = 10000 ** -0.5
    # token (row 1, col 2) -> [x f0, y f0, x f1, y f1]
    np.testing.assert_allclose(a[1 * 3 + 2], [2, 1, 2 * f1, 1 * f1], rtol=1e-6)


def test_load_vision_from_checkpoint(tmp_path):
    path = build_checkpoint(tmp_path / "v", vision=tiny_vision_config(), seed=4)
    model = load_vision(path)
    ref = random_vision(json.loads((path / "config.json").read_text()), seed=4)
    # BF16 on disk: our loaded weights are the reference's rounded to bf16
    for (k, a), (k2, b) in zip(sorted(tree_flatten(model.parameters())),
                               sorted(tree_flatten(ref.parameters()))):
        assert k == k2 and mx.array_equal(a, b.astype(mx.bfloat16).astype(a.dtype)), k
    # the text loader still skips them
    _, _, report = load_model(path)
    assert report.skipped.get("vision", 0) == len(tree_flatten(model.parameters()))


def test_load_vision_errors(tmp_path, tiny_ckpt):
    text_only = build_checkpoint(tmp_path / "t", extras=False)
    with pytest.raises(CheckpointError, match="has no vision weights"):
        load_vision(text_only)
    with pytest.raises(CheckpointError, match=r"vision tensor vision_tower\.patch_embed\.proj\.weight is .* \[16, 3, 14, 14\], expected"):
        load_vision(tiny_ckpt)  # stand-in vision tensors of no real tower
    path = build_checkpoint(tmp_path / "v", vision=tiny_vision_config(), seed=4)
    cfg = json.loads((path / "config.json").read_text())
    cfg["vision_config"]["vt_hidden_size"] = 48
    cfg["vision_config"]["mm_hidden_size"] = 48
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"vision tensor vision_tower\.\S+ is .*expected"):
        load_vision(path)


def test_query_blocks_give_the_same_attention(pair, monkeypatch):
    """Attention in query blocks (how large images stay in memory) equals one block."""
    from kimi_mlx.vision import tower

    _, ours, _ = pair
    grids = [(22, 36)]
    whole = ours(_patches(grids, 9), grids)
    monkeypatch.setattr(tower, "SCORE_BUDGET", 2 * 22 * 36 * 50)  # blocks of 50 queries
    blocked = ours(_patches(grids, 9), grids)
    assert rel_err(blocked, whole) <= _tol(ours.args, grids)


def test_k31_config_gives_the_spec_parameter_counts():
    """The shipped K3.1 config (published K3 vision_config keys): tower 401,214,464 and
    projector 46,144,512 parameters (K31_SPEC.md section 7), and the planner's bytes."""
    from pathlib import Path

    from kimi_mlx.placement.layer_bytes import model_bytes_from_config

    path = Path(__file__).parents[1] / "kimi_mlx/assets/official/Kimi-K3.1-Pro/config.json"
    config = json.loads(path.read_text())
    model = VisionModel(VisionArgs.from_config(config))  # parameters stay unevaluated
    count = lambda m: sum(v.size for _, v in tree_flatten(m.parameters()))
    assert count(model.vision_tower) == 401_214_464
    assert count(model.mm_projector) == 46_144_512
    assert model.args.merged_size == 4096 and model.args.head_dim == 128
    assert model_bytes_from_config(config).not_loaded["vision"] == 2 * (401_214_464 + 46_144_512)
