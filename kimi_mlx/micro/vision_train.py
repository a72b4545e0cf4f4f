"""`make micro-vision`: a micro checkpoint that really sees, trained on synthetic pictures.

Each picture is one filled shape (circle, square, triangle, star) in one of six colours
(red, green, blue, yellow, purple, orange) at a random position and size on a plain
light background (`draw`), of any size from 56 to 448 px a side and any aspect ratio
from 1:3 to 3:1 (`sample_size`: each side log-uniform, so small pictures come more
often). Asked "What is in the image?" through the K3.1 chat encoding (any thinking
effort), the model is trained to answer with an empty think block and the response
"a COLOUR SHAPE".

The checkpoint is the shipped micro text model (lightly tuned: its non-expert weights;
the MXFP4 experts and the F32 KDA / router tensors stay as they are) plus a small MoonViT3d
tower and patchmergerv2 projector (`VISION_CONFIG`: 2 blocks, hidden 64) in the official
layout (`vision_config`, `vision_tower.*`, `mm_projector.*`, BF16), with the release's
preprocessing settings unchanged (patch 14, merge 2 x 2, the same patch limits) in
`preprocessor_config.json`. K3.1's resize rule keeps every such picture as it is; the
pad rule pads it at the bottom and right to multiples of 28 px: grids of 4 x 4 to
32 x 32 patches, 4 to 256 image tokens.

Training (CPU, float32), staged as LLaVA-style models are, in batches bucketed by grid
(`grid_batch`: one grid per step, as many pictures as fit a patch / token budget, so the
tower runs a step's pictures at once):
- stage 1 trains the tower and projector alone with colour and shape heads on the mean
  of the projector rows (no language model; batched by `features_batched`, checked
  against `VisionModel` at start). From a fresh tower on 112 x 112 squares, shape is
  learnt late: the shape accuracy sits near 45% for ~400 steps of 64 pictures, then
  climbs to >95% within ~200 more;
- stage 2 freezes the tower and trains the projector and the text model's non-expert
  weights on the answer tokens (cross-entropy on the reply only), through the real
  prompt (DSA indexer selection as at inference; its top-k indices carry no gradient).
(Training tower, projector and text model jointly from the start left shape at chance.)
`--init-from CKPT` starts both stages from an earlier micro-vision (the shipped one is the
last of a chain of such runs from the 112 x 112 one, which its MODEL_CARD.md lists from the
`lineage` each run writes into eval.json).
The result is evaluated on 120 held-out pictures (another seed, stratified over 3 size x
3 aspect buckets) by greedy generation through the same path as `kimi-mlx generate
--image`, and written with its per-bucket accuracy into `MODEL_CARD.md` and `eval.json`;
`--eval-only CKPT` (`make eval-micro-vision`) prints that table for a checkpoint.

The pictures and their sizes are `kimi_mlx.micro.vision_data`; the card is
`kimi_mlx.micro.vision_card`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map

# the pictures (tests, benches and the Makefile import them from here too) and the card
from kimi_mlx.micro.vision_card import bucket_table, lineage_of, model_card
from kimi_mlx.micro.vision_data import (ASPECT_BUCKETS, COLOURS, QUESTION, SHAPES, SIZE, SIZE_BUCKETS,
                                        answer, bucket_of, draw, grid_of, heldout_sizes, reply_segments,
                                        sample, sample_size, sizes_in_cell)
from kimi_mlx.micro.vision_data import SIDES  # noqa: F401  (tests import it from here)

VISION_CONFIG = {
    "patch_size": 14, "init_pos_emb_height": 64, "init_pos_emb_width": 64, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "pos_emb_interpolation_mode": "bilinear",
    "vt_num_attention_heads": 4, "vt_num_hidden_layers": 2, "vt_hidden_size": 64,
    "vt_intermediate_size": 128, "qkv_hidden_size": 64, "norm_type": "rmsnorm", "mlp_type": "mlp2",
    "activation_func": "gelu_pytorch_tanh", "attn_bias": False, "linear_bias": False,
    "patch_embed_proj_bias": False, "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "mm_projector_type": "patchmergerv2", "mm_hidden_size": 64, "projector_hidden_act": "gelu",
    "projector_ln_eps": 1e-5,
}
MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": [2, 2], "in_patch_limit": 65536,
                  "patch_limit_on_one_side": 512, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5],
                  "transparent_bg_config": {"pattern": "chessboard", "chessboard_square_size": 8,
                                            "chessboard_square_on_top_left": True,
                                            "chessboard_white_value": 255,
                                            "chessboard_gray_value": 180},
                  "transparent_bg_fill_stage": "after_resize"}
F32_KEEP = ("A_log", "dt_bias", "conv1d.weight", "e_score_correction_bias", "o_norm.weight")


class VLM(nn.Module):
    def __init__(self, lm, vis):
        super().__init__()
        self.lm, self.vis = lm, vis


_LUT = None


def fast_preprocess(img):
    """`preprocess` for an RGB picture the resize rule keeps as it is (every picture
    within SIDES): the same pad and the same float32 values, looked up per byte (the
    normalisation of each of the 256 byte values computed as `preprocess` does) instead
    of computed per pixel. Raises ValueError for a picture the rule would resize."""
    from kimi_mlx.vision.preprocess import ProcessedImage, resize_plan

    global _LUT
    if _LUT is None:
        v = np.arange(256, dtype=np.uint8)[:, None]
        _LUT = ((v.astype(np.float64) / 255.0 - np.array(MEDIA_PROC_CFG["image_mean"]))
                / np.array(MEDIA_PROC_CFG["image_std"])).astype(np.float32)[:, 0]
    W, H = img.size
    new_w, new_h, pad_w, pad_h = resize_plan(W, H)
    if (new_w, new_h) != (W, H) or img.mode != "RGB":
        raise ValueError(f"fast_preprocess: a {img.mode} {W}x{H} picture would be resized to {new_w}x{new_h}")
    rgb = np.zeros((H + pad_h, W + pad_w, 3), np.uint8)
    rgb[:H, :W] = np.asarray(img)
    p = MEDIA_PROC_CFG["patch_size"]
    gh, gw = rgb.shape[0] // p, rgb.shape[1] // p
    x = _LUT[rgb.reshape(gh, p, gw, p, 3).transpose(0, 2, 4, 1, 3)].reshape(gh * gw, 3, p, p)
    return ProcessedImage(x, (gh, gw), W, H, (gh // 2) * (gw // 2))


def pictures(n: int, rng: np.random.Generator, sizes=None):
    """n random pictures preprocessed as at inference: patches [n, L, 3, 14, 14] float32,
    the (shared) grid, colour and shape indices [n] int32, and the ProcessedImages.
    `sizes`: n (width, height) of one grid (`sizes_in_cell`); default SIZE x SIZE.
    Pictures are preprocessed by `fast_preprocess` (equal to `preprocess`, checked by
    `check_batched`). Raises ValueError when the sizes do not share a grid."""
    ims, yc, ys = [], [], []
    for i in range(n):
        colour, shape = sample(rng)
        ims.append(fast_preprocess(draw(shape, colour, rng, sizes[i] if sizes else (SIZE, SIZE))))
        yc.append(list(COLOURS).index(colour))
        ys.append(SHAPES.index(shape))
    if len({im.grid for im in ims}) != 1:
        raise ValueError(f"pictures of sizes {sizes} have different grids")
    return (np.stack([im.patches for im in ims]), ims[0].grid, np.array(yc, np.int32),
            np.array(ys, np.int32), ims)


def grid_batch(rng: np.random.Generator, patch_budget: int, lo: int, hi: int):
    """One bucketed batch: a grid drawn as `sample_size` draws a picture, then
    clip(patch_budget // patches, lo, hi) pictures of that grid (`pictures`)."""
    w, h = sample_size(rng)
    grid = grid_of(w, h)
    n = int(np.clip(patch_budget // (grid[0] * grid[1]), lo, hi))
    return pictures(n, rng, sizes_in_cell(grid, n, rng))


def features_batched(vis, patches: mx.array, grid: Tuple[int, int], tower_only: bool = False) -> mx.array:
    """`VisionModel`'s forward for B pictures of one grid at once (the tower's own forward
    loops over images for its block-diagonal attention; same weights, same operations).

    patches [B, h*w, 3, p, p] float32 -> projector rows [B, h*w/4, text hidden], or with
    `tower_only` the merged tower features [B * h*w/4, 4, D]."""
    from kimi_mlx.vision.tower import rope_angles

    tw, (h, w) = vis.vision_tower, grid
    B, L = patches.shape[:2]
    kh, kw = tw.args.merge_kernel_size
    W = tw.patch_embed.proj.weight
    x = patches.reshape(B, L, -1) @ W.reshape(W.shape[0], -1).T + tw.patch_embed.pos_emb.for_grid(h, w)
    ang = rope_angles(tw.args.head_dim, h, w, tw.args.rope_theta)
    cos, sin = mx.cos(ang)[None, :, None], mx.sin(ang)[None, :, None]
    for blk in tw.encoder.blocks:
        H, hd = blk.heads, blk.head_dim
        qkv = blk.wqkv(blk.norm0(x)).reshape(B, L, 3, H, hd)

        def rope(t):
            t = t.reshape(B, L, H, hd // 2, 2)
            a, b = t[..., 0], t[..., 1]
            return mx.stack([a * cos - b * sin, a * sin + b * cos], -1).reshape(B, L, H, hd).transpose(0, 2, 1, 3)

        o = mx.fast.scaled_dot_product_attention(rope(qkv[:, :, 0]), rope(qkv[:, :, 1]),
                                                 qkv[:, :, 2].transpose(0, 2, 1, 3), scale=hd ** -0.5)
        x = x + blk.wo(o.transpose(0, 2, 1, 3).reshape(B, L, -1))
        x = x + blk.mlp(blk.norm1(x))
    x = tw.encoder.final_layernorm(x)
    x = x.reshape(B, h // kh, kh, w // kw, kw, -1).transpose(0, 1, 3, 2, 4, 5)
    x = x.reshape(B * (h // kh) * (w // kw), kh * kw, -1)
    if tower_only:
        return x
    return vis.mm_projector(x).reshape(B, (h // kh) * (w // kw), -1)


def check_batched(vis, seed: int) -> float:
    """Max |features_batched - VisionModel| on 3 wide pictures; raises RuntimeError over
    1e-4, or when `fast_preprocess` differs from `preprocess` on them."""
    from kimi_mlx.vision.preprocess import preprocess

    rng = np.random.default_rng(seed)
    sizes = sizes_in_cell((10, 22), 3, rng)
    P, grid, _, _, _ = pictures(3, np.random.default_rng(seed), sizes)
    for i, (w, h) in enumerate(sizes):
        want = preprocess(draw("star", "red", np.random.default_rng(i), (w, h)))
        got = fast_preprocess(draw("star", "red", np.random.default_rng(i), (w, h)))
        if want.grid != got.grid or not np.array_equal(want.patches, got.patches):
            raise RuntimeError(f"fast_preprocess differs from preprocess on a {w}x{h} picture")
    ref = vis(mx.array(P.reshape(-1, *P.shape[2:])), [grid] * 3)
    got = features_batched(vis, mx.array(P), grid).reshape(ref.shape)
    err = float(mx.abs(ref - got).max())
    if err > 1e-4:
        raise RuntimeError(f"features_batched differs from VisionModel by {err}")
    return err


def init_tower(vis, seed: int) -> None:
    """A fresh tower's patch projection N(0, (3 p p)^-1/2) and position grid N(0, 0.02)
    (the module's zeros would start every patch and position alike)."""
    rng = np.random.default_rng(seed)
    pe = vis.vision_tower.patch_embed
    w = pe.proj.weight
    pe.proj.weight = mx.array(rng.normal(0, (w.size // w.shape[0]) ** -0.5, w.shape).astype(np.float32))
    pe.pos_emb.weight = mx.array(rng.normal(0, 0.02, pe.pos_emb.weight.shape).astype(np.float32))


def _pool(rows: mx.array, pool: str) -> mx.array:
    """Projector rows [B, N, d] -> [B, d] for the stage-1 heads: their mean, or their
    per-channel max ("max": only the rows over the shape need to carry it)."""
    if pool == "max":
        return rows.max(axis=1)
    if pool == "mean":
        return rows.mean(axis=1)
    raise ValueError(f"stage-1 pool: expected 'mean' or 'max', got {pool!r}")


class _Heads(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.colour = nn.Linear(d, len(COLOURS))
        self.shape = nn.Linear(d, len(SHAPES))


def pretrain_tower(vis, steps: int, patch_budget: int, lr: float, seed: int, log,
                   eval_batches: int = 32, pooling: str = "mean") -> Dict:
    """Stage 1: tower and projector with colour and shape heads (dropped afterwards) on
    the projector rows pooled by `pooling` (`_pool`: "mean" or "max"); AdamW (weight
    decay 0.01), 50 warm-up steps then cosine decay to lr/20. Each step is one grid (`grid_batch`): about `patch_budget` patches, 4 to
    96 pictures. Returns the held-out (seed + 1, `eval_batches` grids of 8 pictures) head
    accuracies {"colour", "shape", "both"}."""
    d = vis.args.text_hidden_size
    m = VLM(_Heads(d), vis)
    rng = np.random.default_rng(seed)
    erng = np.random.default_rng(seed + 1)
    held = [grid_batch(erng, 0, 8, 8)[:4] for _ in range(eval_batches)]

    def loss(m, patches, grid, yc, ys):
        f = _pool(features_batched(m.vis, patches, grid), pooling)
        return (nn.losses.cross_entropy(m.lm.colour(f), yc, reduction="mean")
                + nn.losses.cross_entropy(m.lm.shape(f), ys, reduction="mean"))

    vg = nn.value_and_grad(m, loss)
    warm = max(1, min(50, steps // 4))
    sched = optim.join_schedules([optim.linear_schedule(lr / 100, lr, warm),
                                  optim.cosine_decay(lr, max(1, steps - warm), lr / 20)], [warm])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01)

    def step_fn(patches, grid, yc, ys):  # not compiled: each of ~150 grids would compile anew
        val, g = vg(m, patches, grid, yc, ys)
        opt.update(m, g)
        return val

    def accuracy():
        c_ok, s_ok, both, n = 0, 0, 0, 0
        for Pt, grid, yct, yst in held:
            f = _pool(features_batched(vis, mx.array(Pt), grid), pooling)
            c = np.array(m.lm.colour(f).argmax(-1)) == yct
            s = np.array(m.lm.shape(f).argmax(-1)) == yst
            c_ok, s_ok, both, n = c_ok + c.sum(), s_ok + s.sum(), both + (c & s).sum(), n + len(c)
        return {"colour": float(c_ok / n), "shape": float(s_ok / n), "both": float(both / n)}

    from concurrent.futures import ThreadPoolExecutor

    t0, seen, patches_seen = time.time(), 0, 0
    pool = ThreadPoolExecutor(1)  # draws the next batch while this one trains (one at a time: same rng order)
    nxt = pool.submit(grid_batch, rng, patch_budget, 4, 96)
    for step in range(steps):
        P, grid, yc, ys, _ = nxt.result()
        if step + 1 < steps:
            nxt = pool.submit(grid_batch, rng, patch_budget, 4, 96)
        val = step_fn(mx.array(P), grid, mx.array(yc), mx.array(ys))
        mx.eval(val, m.parameters(), opt.state)
        seen, patches_seen = seen + len(yc), patches_seen + P.shape[0] * P.shape[1]
        if step % 10 == 0:
            log(f"tower step {step}: loss {val.item():.3f} ({time.time() - t0:.0f} s)")
        if (step + 1) % 100 == 0 or step == steps - 1:
            acc = accuracy()
            log(f"tower step {step}: loss {val.item():.3f}, held-out colour {acc['colour']:.1%} "
                f"shape {acc['shape']:.1%} ({seen} pictures, {patches_seen} patches, "
                f"{time.time() - t0:.0f} s)")
    return acc


def _batch(tok, rng, n: int, token_budget: int):
    """Up to n training prompts of one grid with their replies (`grid_batch`: about
    `token_budget` image tokens, 2 to n prompts): patches [b, L, 3, p, p], the grid, ids,
    next-token targets and the reply mask [b, T]."""
    from kimi_mlx.generation.request import build_prompt
    from kimi_mlx.text.chat_format import encode_segments

    P, grid, yc, ys, ims = grid_batch(rng, 4 * token_budget, 2, n)
    n = len(yc)
    rows = []
    for im, c, s in zip(ims, yc, ys):
        effort = ("low", "high", "max")[rng.integers(3)]
        prompt = build_prompt(tok, QUESTION, None, False, effort, [im])
        rows.append((prompt, encode_segments(tok, reply_segments(answer(list(COLOURS)[c], SHAPES[s])))))
    L = max(len(p) + len(t) for p, t in rows)
    ids = np.full((n, L), 0, np.int32)
    tgt = np.zeros((n, L), np.int32)
    mask = np.zeros((n, L), np.float32)
    for b, (p, t) in enumerate(rows):
        seq = p + t
        ids[b, :len(seq)] = seq
        tgt[b, :len(seq) - 1] = seq[1:]
        mask[b, len(p) - 1:len(seq) - 1] = 1
    return mx.array(P), grid, mx.array(ids), mx.array(tgt), mx.array(mask)


def train_answer(lm, vis, tok, steps: int, batch: int, lr_lm: float, lr_vis: float, seed: int,
                 pad: int, log, token_budget: int = 384) -> List[float]:
    """Stage 2: the tower frozen; projector (lr_vis) and the text model's non-expert
    weights (lr_lm) on the answer tokens through the real prompt, AdamW with cosine
    decay to 1/10. Returns the per-step losses."""
    lm.freeze()
    lm.unfreeze()
    lm.apply_to_modules(lambda k, m: m.freeze() if "scales" in m else None)  # MXFP4 experts
    lm.apply_to_modules(lambda k, m: m.freeze(keys=[n for n in m if isinstance(m[n], mx.array)
                                                    and f"{k}.{n}".endswith(F32_KEEP)]))
    proj = vis.mm_projector
    m = VLM(lm, proj)

    def loss(m, patches, grid, ids, tgt, mask):
        merged = mx.stop_gradient(features_batched(vis, patches, grid, tower_only=True))
        feats = m.vis(merged)
        emb = m.lm.embed_with_media(ids, feats, pad)
        logits = m.lm(ids, input_embeddings=emb)
        ce = nn.losses.cross_entropy(logits, tgt, reduction="none")
        return (ce * mask).sum() / mask.sum()

    vg = nn.value_and_grad(m, loss)
    opt_v = optim.AdamW(learning_rate=optim.cosine_decay(lr_vis, steps, lr_vis / 10), weight_decay=0.0)
    opt_l = optim.AdamW(learning_rate=optim.cosine_decay(lr_lm, steps, lr_lm / 10), weight_decay=0.0)
    from concurrent.futures import ThreadPoolExecutor

    rng = np.random.default_rng(seed)
    losses, t0 = [], time.time()
    pool = ThreadPoolExecutor(1)  # the next batch is drawn while this one trains
    nxt = pool.submit(_batch, tok, rng, batch, token_budget)
    for step in range(steps):
        data = nxt.result()
        if step + 1 < steps:
            nxt = pool.submit(_batch, tok, rng, batch, token_budget)
        val, g = vg(m, *data)
        g, _ = optim.clip_grad_norm(g, 1.0)
        opt_v.update(m.vis, g["vis"])
        opt_l.update(m.lm, g["lm"])
        mx.eval(m.parameters(), opt_v.state, opt_l.state, val)
        losses.append(val.item())
        if step % 10 == 0 or step == steps - 1:
            log(f"answer step {step}: loss {val.item():.3f} ({time.time() - t0:.0f} s)")
    return losses


def write_checkpoint(src: Path, out: Path, lm, vis) -> None:
    """`src` (micro) with the tuned non-expert text weights and the vision tensors, BF16
    (F32 kept where the release keeps it), in the official layout, into a new folder `out`."""
    from kimi_mlx.checkpoint.shards import weight_map
    from kimi_mlx.testing.checkpoints import write_safetensors_sharded

    wm = weight_map(src)
    files = {}
    for shard in sorted(set(wm.values())):
        files.update(mx.load(str(src / shard)))
    tuned = dict(tree_flatten(lm.parameters()))
    for name in list(files):
        if name in tuned and not name.endswith(F32_KEEP) and tuned[name].shape == files[name].shape \
                and mx.issubdtype(files[name].dtype, mx.floating):
            files[name] = tuned[name].astype(files[name].dtype)
    shards = sorted(set(wm.values()))
    plan = {n: shards.index(wm[n]) + 1 for n in wm}
    for name, w in tree_flatten(vis.parameters()):
        files[name] = w.astype(mx.bfloat16)
        plan[name] = len(shards)
    out.mkdir(parents=True)
    write_safetensors_sharded(files, plan, out, len(shards))
    config = json.loads((src / "config.json").read_text())
    config["vision_config"] = dict(VISION_CONFIG, text_hidden_size=config["text_config"]["hidden_size"])
    from kimi_mlx.text.tokenizer import KimiTokenizer

    config["media_placeholder_token_id"] = KimiTokenizer.from_pretrained(src).special_tokens["<|media_pad|>"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "preprocessor_config.json").write_text(json.dumps({"media_proc_cfg": MEDIA_PROC_CFG}, indent=2) + "\n")
    for f in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)


def evaluate(ckpt: Path, n: int, seed: int, max_tokens: int = 24, log=print) -> Dict:
    """Greedy answers to n held-out pictures (`heldout_sizes`, drawn with `seed`) through
    the `generate --image` path (our loader, `Vision`, the chat encoding, mlx-lm's
    stream_generate with input embeddings); a picture counts when the reply names both
    its colour and its shape. Returns overall and per-bucket fractions and examples."""
    from mlx_lm.generate import stream_generate
    from mlx_lm.sample_utils import make_sampler

    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.generation.images import Vision, media_pad_id, prompt_embeddings
    from kimi_mlx.generation.request import build_prompt
    from kimi_mlx.text.reply_parse import parse_reply
    from kimi_mlx.vision.preprocess import preprocess

    model, wrapper, tok, config = load_for_generation(str(ckpt))
    vision = Vision(ckpt)
    pad = media_pad_id(tok, config)
    rng = np.random.default_rng(seed)
    sizes = heldout_sizes(n, rng)
    right = colour_ok = shape_ok = 0
    buckets: Dict[str, List[int]] = {}
    examples = []
    for i, (w, h) in enumerate(sizes):
        colour, shape = sample(rng)
        im = preprocess(draw(shape, colour, rng, (w, h)))
        ids = build_prompt(tok, QUESTION, None, False, "max", [im])
        emb = prompt_embeddings(model, vision, ids, [im], pad)
        text = "".join(r.text for r in stream_generate(model, wrapper, ids, max_tokens=max_tokens,
                                                        sampler=make_sampler(0.0), input_embeddings=emb))
        content = parse_reply(text)["content"].lower()
        words = content.replace(".", " ").split()
        c, s = colour in words, shape in words
        colour_ok += c
        shape_ok += s
        right += c and s
        for b in bucket_of(w, h):
            buckets.setdefault(b, [0, 0])
            buckets[b][0] += int(c and s)
            buckets[b][1] += 1
        if i < 9:
            examples.append({"picture": answer(colour, shape), "size": f"{w}x{h}", "reply": content})
    order = [b[0] for b in SIZE_BUCKETS + ASPECT_BUCKETS]
    info = {"heldout_pictures": n, "seed": seed, "both_right": right / n,
            "colour_right": colour_ok / n, "shape_right": shape_ok / n,
            "buckets": {b: {"right": buckets[b][0], "pictures": buckets[b][1],
                            "both_right": buckets[b][0] / buckets[b][1]} for b in order if b in buckets},
            "examples": examples}
    log(f"held-out: both {right}/{n}, colour {colour_ok}/{n}, shape {shape_ok}/{n}")
    return info


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.micro.vision_train")
    p.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "assets" / "micro"))
    p.add_argument("--out", default="build/micro-vision")
    p.add_argument("--tower-steps", type=int, default=1000)
    p.add_argument("--tower-patches", type=int, default=3072,
                   help="patches per stage-1 step (pictures of one grid, 4 to 96 of them)")
    p.add_argument("--tower-lr", type=float, default=2e-3)
    p.add_argument("--tower-pool", choices=("max", "mean"), default="mean",
                   help="stage-1 heads read the mean (default) or the per-channel max of the projector "
                        "rows (max, 1500 steps: 100 %% head shape but 30 %% end to end after stage 2)")
    p.add_argument("--tower-eval-grids", type=int, default=32, help="stage-1 held-out grids of 8 pictures")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="start from CKPT's tower, projector and tuned text weights (a micro-vision, "
                        "e.g. one trained on fewer sizes) instead of a fresh tower and micro's text")
    p.add_argument("--tower-from", default=None,
                   help="skip stage 1: the tower / projector saved by an earlier run (OUT.stage1.safetensors)")
    p.add_argument("--answer-steps", type=int, default=200)
    p.add_argument("--answer-batch", type=int, default=8)
    p.add_argument("--answer-tokens", type=int, default=384,
                   help="image tokens per stage-2 step (prompts of one grid, 2 to --answer-batch)")
    p.add_argument("--lr-vis", type=float, default=1e-3)
    p.add_argument("--lr-lm", type=float, default=5e-4)
    p.add_argument("--eval-pictures", type=int, default=120)
    p.add_argument("--eval-only", default=None, metavar="CKPT",
                   help="only evaluate CKPT on the held-out pictures and print the bucket table")
    p.add_argument("--seed", type=int, default=0, help="training seed (init, pictures)")
    p.add_argument("--eval-seed", type=int, default=10_000, help="held-out pictures' seed")
    return p.parse_args(argv)


def main(argv=None) -> int:
    import platform

    import kimi_mlx.model.dsa as dsa_mod
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.micro.publish import publish_checkpoint
    from kimi_mlx.text.tokenizer import KimiTokenizer
    from kimi_mlx.vision.config import VisionArgs
    from kimi_mlx.vision.tower import VisionModel

    cfg = parse_args(argv)
    log = lambda m: print(f"[micro-vision] {m}", file=sys.stderr, flush=True)  # noqa: E731
    if cfg.eval_only:
        t = time.time()
        ev = evaluate(Path(cfg.eval_only), cfg.eval_pictures, seed=cfg.eval_seed, log=log)
        print(bucket_table(ev))
        print(f"({cfg.eval_pictures} pictures, seed {cfg.eval_seed}, {(time.time() - t) / 60:.1f} min)")
        return 0
    src, out = Path(cfg.src), Path(cfg.out)
    t0 = time.time()
    mx.random.seed(cfg.seed)
    lm, config, _ = load_model(Path(cfg.init_from) if cfg.init_from else src, verbose=False)
    lm.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
                       lm.parameters()))
    tok = KimiTokenizer.from_pretrained(src)
    pad = tok.special_tokens["<|media_pad|>"]
    vcfg = dict(VISION_CONFIG, text_hidden_size=config["text_config"]["hidden_size"])
    vis = VisionModel(VisionArgs.from_config({"vision_config": vcfg, "text_config": config["text_config"]}))
    init_tower(vis, cfg.seed)
    if cfg.init_from:
        from kimi_mlx.checkpoint.loader import load_vision

        vis.update(load_vision(cfg.init_from, dtype=mx.float32).parameters())
        log(f"tower, projector and text weights from {cfg.init_from}")
    log(f"batched tower forward vs VisionModel: max |diff| {check_batched(vis, cfg.seed + 7):.2e}")
    stage1 = Path(str(out) + ".stage1.safetensors")
    if cfg.tower_from:
        vis.load_weights(cfg.tower_from)
        saved = json.loads(Path(cfg.tower_from + ".json").read_text())
        heads, stage1_min = saved["heads"], saved["minutes"]
        t0 -= stage1_min * 60
        log(f"stage 1 from {cfg.tower_from} ({stage1_min:.1f} min when trained)")
    elif cfg.tower_steps == 0:  # stage 2 only, on --init-from's tower
        heads, stage1_min = None, 0.0
    else:
        heads = pretrain_tower(vis, cfg.tower_steps, cfg.tower_patches, cfg.tower_lr, cfg.seed, log,
                               eval_batches=cfg.tower_eval_grids, pooling=cfg.tower_pool)
        stage1_min = (time.time() - t0) / 60
        stage1.parent.mkdir(parents=True, exist_ok=True)
        vis.save_weights(str(stage1))
        Path(str(stage1) + ".json").write_text(json.dumps({"heads": heads, "minutes": stage1_min}))
    t1 = time.time()
    real = dsa_mod.dsa_prefill_indices  # selection as at inference, without a gradient
    dsa_mod.dsa_prefill_indices = lambda *a, **k: mx.stop_gradient(real(*a, **k))
    try:
        losses = train_answer(lm, vis, tok, cfg.answer_steps, cfg.answer_batch, cfg.lr_lm, cfg.lr_vis,
                              cfg.seed + 2, pad, log, cfg.answer_tokens)
    finally:
        dsa_mod.dsa_prefill_indices = real
    minutes = (time.time() - t0) / 60
    log(f"trained in {minutes:.1f} min (stage 1 {stage1_min:.1f}, stage 2 {(time.time() - t1) / 60:.1f})")
    tmp = Path(tempfile.mkdtemp(prefix=".micro-vision.", dir=out.parent if out.parent.exists() else None))
    shutil.rmtree(tmp)
    write_checkpoint(src, tmp, lm, vis)
    t_eval = time.time()
    info = {"train": {"init_from": cfg.init_from and Path(cfg.init_from).name,
                      "lineage": lineage_of(cfg.init_from),
                      "tower_steps": cfg.tower_steps, "tower_eval_grids": cfg.tower_eval_grids, "tower_patches": cfg.tower_patches,
                      "tower_lr": cfg.tower_lr, "tower_pool": cfg.tower_pool, "tower_heldout": heads,
                      "stage1_minutes": stage1_min, "answer_steps": cfg.answer_steps,
                      "answer_batch": cfg.answer_batch, "answer_tokens": cfg.answer_tokens,
                      "lr_vis": cfg.lr_vis, "lr_lm": cfg.lr_lm,
                      "final_loss": float(np.mean(losses[-10:])), "seed": cfg.seed,
                      "minutes": minutes, "machine": f"{platform.machine()} CPU, MLX {mx.__version__}",
                      "cores": os.cpu_count()},
            "eval": evaluate(tmp, cfg.eval_pictures, seed=cfg.eval_seed, log=log)}
    info["eval"]["minutes"] = (time.time() - t_eval) / 60
    (Path(str(out) + ".eval.json")).write_text(json.dumps(info, indent=1) + "\n")
    print(bucket_table(info["eval"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        card = model_card(info)
    except Exception as e:  # the figures are in OUT.eval.json; the card can be redone
        log(f"model card failed: {e!r}")
        card = "(see eval.json)\n"
    publish_checkpoint(tmp, out, info, card, max_mb=20, what="micro-vision")
    log(f"wrote {out} ({info['eval']['both_right']:.1%} both right)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
