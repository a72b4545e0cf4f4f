"""`make micro-vision`: a micro checkpoint that really sees, trained on synthetic pictures.

Each picture is one filled shape (circle, square, triangle, star) in one of six colours
(red, green, blue, yellow, purple, orange) at a random position and size on a plain
light background (`draw`). Asked "What is in the image?" through the K3.1 chat encoding
(any thinking effort), the model is trained to answer with an empty think block and the
response "a COLOUR SHAPE".

The checkpoint is the shipped micro text model (lightly tuned: its non-expert weights;
the MXFP4 experts and the F32 KDA / router tensors stay as they are) plus a small MoonViT3d
tower and patchmergerv2 projector (`VISION_CONFIG`: 2 blocks, hidden 64) in the official
layout (`vision_config`, `vision_tower.*`, `mm_projector.*`, BF16), with the release's
preprocessing settings unchanged (patch 14, merge 2 x 2, the same patch limits) in
`preprocessor_config.json`. Pictures are 112 x 112 pixels (the resize rule keeps them
as they are): 8 x 8 patches, 16 image tokens.

Training (CPU, float32), staged as LLaVA-style models are:
- stage 1 trains the tower and projector alone with colour and shape heads on the mean
  of the projector rows (no language model; batched over same-size pictures by
  `features_batched`, checked against `VisionModel` at start). Shape is learnt late:
  with warm-up and cosine decay the shape accuracy sits near 45% for ~400 steps of 64
  pictures, then climbs to >95% within ~200 more;
- stage 2 freezes the tower and trains the projector and the text model's non-expert
  weights on the answer tokens (cross-entropy on the reply only), through the real
  prompt (DSA indexer selection as at inference; its top-k indices carry no gradient).
(Training tower, projector and text model jointly from the start left shape at chance.)
The result is evaluated on held-out pictures by greedy generation through the same path
as `kimi-mlx generate --image`, and written with its accuracy into `MODEL_CARD.md` and
`eval.json`.
"""

from __future__ import annotations

import argparse
import json
import math
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

COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220),
           "yellow": (235, 200, 30), "purple": (140, 60, 180), "orange": (245, 140, 30)}
SHAPES = ("circle", "square", "triangle", "star")
SIZE = 112
RADIUS = (18.0, 42.0)  # px, the shape's outer radius
QUESTION = "What is in the image?"
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


def draw(shape: str, colour: str, rng: np.random.Generator):
    """An RGB SIZE x SIZE Pillow picture: a light plain background (each channel
    225..255) and one filled `shape` of `colour`, outer radius in RADIUS px, centred at
    least one radius from each edge. Raises ValueError for an unknown shape."""
    from PIL import Image, ImageDraw

    bg = tuple(int(v) for v in rng.integers(225, 256, 3))
    im = Image.new("RGB", (SIZE, SIZE), bg)
    d = ImageDraw.Draw(im)
    r = rng.uniform(*RADIUS)
    cx, cy = rng.uniform(r, SIZE - r), rng.uniform(r, SIZE - r)
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


def answer(colour: str, shape: str) -> str:
    return f"a {colour} {shape}"


def reply_segments(text: str):
    """The assistant turn after the generation prompt: empty think, `text`, end."""
    from kimi_mlx.text.chat_format import CLOSE, END_OF_MSG, OPEN, SEP

    return [(True, CLOSE), (False, "think"), (True, SEP), (True, OPEN), (False, "response"),
            (True, SEP), (False, text), (True, CLOSE), (False, "response"), (True, SEP),
            (True, CLOSE), (False, "message"), (True, SEP), (True, END_OF_MSG)]


class VLM(nn.Module):
    def __init__(self, lm, vis):
        super().__init__()
        self.lm, self.vis = lm, vis


def pictures(n: int, rng: np.random.Generator):
    """n random pictures preprocessed as at inference: patches [n, L, 3, 14, 14] float32,
    the (shared) grid, colour and shape indices [n] int32, and the ProcessedImages."""
    from kimi_mlx.vision.preprocess import preprocess

    ims, yc, ys = [], [], []
    for _ in range(n):
        colour, shape = sample(rng)
        ims.append(preprocess(draw(shape, colour, rng)))
        yc.append(list(COLOURS).index(colour))
        ys.append(SHAPES.index(shape))
    return (np.stack([im.patches for im in ims]), ims[0].grid, np.array(yc, np.int32),
            np.array(ys, np.int32), ims)


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
    """Max |features_batched - VisionModel| on 3 pictures; raises RuntimeError over 1e-4."""
    P, grid, _, _, _ = pictures(3, np.random.default_rng(seed))
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


class _Heads(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.colour = nn.Linear(d, len(COLOURS))
        self.shape = nn.Linear(d, len(SHAPES))


def pretrain_tower(vis, steps: int, batch: int, lr: float, seed: int, log, pool: int = 4096,
                   eval_n: int = 512) -> Dict:
    """Stage 1: tower and projector with colour and shape heads (dropped afterwards) on
    the mean projector row; AdamW (weight decay 0.01), 50 warm-up steps then cosine decay
    to lr/20; a pool of `pool` pictures redrawn after each pass. Returns the held-out
    (seed + 1) head accuracies {"colour", "shape", "both"}."""
    from functools import partial

    d = vis.args.text_hidden_size
    m = VLM(_Heads(d), vis)
    rng = np.random.default_rng(seed)
    P, grid, yc, ys, _ = pictures(pool, rng)
    Pt, _, yct, yst, _ = pictures(eval_n, np.random.default_rng(seed + 1))

    def loss(m, patches, yc, ys):
        f = features_batched(m.vis, patches, grid).mean(axis=1)
        return (nn.losses.cross_entropy(m.lm.colour(f), yc, reduction="mean")
                + nn.losses.cross_entropy(m.lm.shape(f), ys, reduction="mean"))

    vg = nn.value_and_grad(m, loss)
    warm = max(1, min(50, steps // 4))
    sched = optim.join_schedules([optim.linear_schedule(lr / 100, lr, warm),
                                  optim.cosine_decay(lr, max(1, steps - warm), lr / 20)], [warm])
    opt = optim.AdamW(learning_rate=sched, weight_decay=0.01)
    state = [m.state, opt.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step_fn(patches, yc, ys):
        val, g = vg(m, patches, yc, ys)
        opt.update(m, g)
        return val

    def accuracy():
        f = features_batched(vis, mx.array(Pt), grid).mean(axis=1)
        c = np.array(m.lm.colour(f).argmax(-1)) == yct
        s = np.array(m.lm.shape(f).argmax(-1)) == yst
        return {"colour": float(c.mean()), "shape": float(s.mean()), "both": float((c & s).mean())}

    order, at, t0 = rng.permutation(pool), 0, time.time()
    for step in range(steps):
        if at + batch > pool:
            P, grid, yc, ys, _ = pictures(pool, rng)
            order, at = rng.permutation(pool), 0
        idx = order[at:at + batch]
        at += batch
        val = step_fn(mx.array(P[idx]), mx.array(yc[idx]), mx.array(ys[idx]))
        mx.eval(val, m.parameters(), opt.state)
        if step % 100 == 0 or step == steps - 1:
            acc = accuracy()
            log(f"tower step {step}: loss {val.item():.3f}, held-out colour {acc['colour']:.1%} "
                f"shape {acc['shape']:.1%} ({time.time() - t0:.0f} s)")
    return acc


def _batch(tok, rng, n: int):
    """n training prompts with their replies: patches [n, L, 3, p, p], the grid, ids,
    next-token targets and the reply mask [n, T]."""
    from kimi_mlx.generation.request import build_prompt
    from kimi_mlx.text.chat_format import encode_segments

    P, grid, yc, ys, ims = pictures(n, rng)
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
                 pad: int, log) -> List[float]:
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
    rng = np.random.default_rng(seed)
    losses, t0 = [], time.time()
    for step in range(steps):
        val, g = vg(m, *_batch(tok, rng, batch))
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
    """Greedy answers to held-out pictures through the `generate --image` path (our
    loader, `Vision`, the chat encoding, mlx-lm's stream_generate with input embeddings);
    a picture counts when the reply names both its colour and its shape."""
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
    right = colour_ok = shape_ok = 0
    examples = []
    for i in range(n):
        colour, shape = sample(rng)
        im = preprocess(draw(shape, colour, rng))
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
        if i < 8:
            examples.append({"picture": answer(colour, shape), "reply": content})
    info = {"heldout_pictures": n, "seed": seed, "both_right": right / n,
            "colour_right": colour_ok / n, "shape_right": shape_ok / n, "examples": examples}
    log(f"held-out: both {right}/{n}, colour {colour_ok}/{n}, shape {shape_ok}/{n}")
    return info


def model_card(info: Dict) -> str:
    ex = "\n".join(f"| {e['picture']} | {e['reply']} |" for e in info["eval"]["examples"])
    t = info["train"]
    return f"""# kimi-mlx micro-vision: a micro checkpoint that sees shapes and colours

`kimi_mlx/assets/micro` (the shipped 5.1M-parameter K3.1-architecture text model) with a
small MoonViT3d vision tower and patchmergerv2 projector, trained by `make micro-vision`
(`python -m kimi_mlx.micro.vision_train`) so that, shown one synthetic picture and asked
"{QUESTION}", it names the colour and the shape.

```
kimi-mlx generate --model kimi_mlx/assets/micro-vision --image PICTURE.png --prompt "{QUESTION}"
```

## Files

Official layout: `config.json` with `vision_config` (2 blocks, hidden 64, 4 heads x 16,
MLP 128, position grid 64 x 64, patch 14, merge 2 x 2, projector 256 -> 256 -> 128),
`vision_tower.*` / `mm_projector.*` BF16 tensors in the last shard, `preprocessor_config.json`
with the release's `media_proc_cfg` (patch 14, merge 2, in_patch_limit 65536,
patch_limit_on_one_side 512, mean = std = 0.5, chessboard alpha background).

## Data

Pictures of {SIZE} x {SIZE} px (8 x 8 patches, 16 image tokens; the release's resize rule
keeps them as they are): one filled shape ({", ".join(SHAPES)}) in one of six colours
({", ".join(COLOURS)}) at a random position, outer radius {RADIUS[0]:g}-{RADIUS[1]:g} px, on a plain light background (each channel 225-255). Prompt: the K3.1
chat encoding with a random thinking effort, the picture, then "{QUESTION}"; answer: an
empty think block and the response "a COLOUR SHAPE".

## Training

Staged, as LLaVA-style models are (training everything jointly from the start left
shape at chance):

- stage 1: tower and projector alone with colour / shape linear heads on the mean
  projector row (heads dropped afterwards), {t['tower_steps']} steps of {t['tower_batch']} pictures,
  AdamW lr {t['tower_lr']} (50 warm-up steps, cosine decay to 1/20, weight decay 0.01),
  {t['stage1_minutes']:.1f} min. Colour is learnt in ~100 steps; shape sits near 45% for
  ~400 steps, then climbs. Head accuracy on {512} held-out pictures at the end: colour
  {100 * t['tower_heldout']['colour']:.1f} %, shape {100 * t['tower_heldout']['shape']:.1f} %;
- stage 2: tower frozen; projector and the text model's non-expert weights (the MXFP4
  experts, KDA conv / A_log / dt_bias and router biases frozen) on the answer tokens
  (cross-entropy on the reply only), {t['answer_steps']} steps of {t['answer_batch']} prompts
  (AdamW, lr projector {t['lr_vis']}, text {t['lr_lm']}, cosine decay to 1/10), sparse DSA as
  at inference; final loss {t['final_loss']:.4f} (mean of the last 10 steps);
- float32 on the CPU, seed {t['seed']}, {t['minutes']:.1f} min of training in all on
  {t['machine']} (2 cores shared with other jobs, niced); the held-out evaluation below
  took {info['eval']['minutes']:.1f} min more.

## Accuracy (held-out pictures, greedy, thinking effort max)

| measure | value |
|---|---|
| pictures | {info['eval']['heldout_pictures']} (seed {info['eval']['seed']}, not drawn in training) |
| colour and shape both right | **{100 * info['eval']['both_right']:.1f} %** |
| colour right | {100 * info['eval']['colour_right']:.1f} % |
| shape right | {100 * info['eval']['shape_right']:.1f} % |

| picture | reply |
|---|---|
{ex}

The text model in this folder is a tuned copy of `micro` (its non-expert weights, for
this one question): it is not a general assistant, and its code / prose continuations
differ from `micro`'s. `kimi_mlx/assets/micro` itself is unchanged.
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.micro.vision_train")
    p.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "assets" / "micro"))
    p.add_argument("--out", default="build/micro-vision")
    p.add_argument("--tower-steps", type=int, default=1000)
    p.add_argument("--tower-batch", type=int, default=64)
    p.add_argument("--tower-lr", type=float, default=2e-3)
    p.add_argument("--answer-steps", type=int, default=200)
    p.add_argument("--answer-batch", type=int, default=8)
    p.add_argument("--lr-vis", type=float, default=1e-3)
    p.add_argument("--lr-lm", type=float, default=5e-4)
    p.add_argument("--eval-pictures", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> int:
    import platform

    import kimi_mlx.model.dsa as dsa_mod
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.micro.train import publish_checkpoint
    from kimi_mlx.text.tokenizer import KimiTokenizer
    from kimi_mlx.vision.config import VisionArgs
    from kimi_mlx.vision.tower import VisionModel

    cfg = parse_args(argv)
    log = lambda m: print(f"[micro-vision] {m}", file=sys.stderr, flush=True)  # noqa: E731
    src, out = Path(cfg.src), Path(cfg.out)
    t0 = time.time()
    mx.random.seed(cfg.seed)
    lm, config, _ = load_model(src, verbose=False)
    lm.update(tree_map(lambda x: x.astype(mx.float32) if mx.issubdtype(x.dtype, mx.floating) else x,
                       lm.parameters()))
    tok = KimiTokenizer.from_pretrained(src)
    pad = tok.special_tokens["<|media_pad|>"]
    vcfg = dict(VISION_CONFIG, text_hidden_size=config["text_config"]["hidden_size"])
    vis = VisionModel(VisionArgs.from_config({"vision_config": vcfg, "text_config": config["text_config"]}))
    init_tower(vis, cfg.seed)
    log(f"batched tower forward vs VisionModel: max |diff| {check_batched(vis, cfg.seed + 7):.2e}")
    heads = pretrain_tower(vis, cfg.tower_steps, cfg.tower_batch, cfg.tower_lr, cfg.seed, log)
    t1 = time.time()
    real = dsa_mod.dsa_prefill_indices  # selection as at inference, without a gradient
    dsa_mod.dsa_prefill_indices = lambda *a, **k: mx.stop_gradient(real(*a, **k))
    try:
        losses = train_answer(lm, vis, tok, cfg.answer_steps, cfg.answer_batch, cfg.lr_lm, cfg.lr_vis,
                              cfg.seed + 2, pad, log)
    finally:
        dsa_mod.dsa_prefill_indices = real
    minutes = (time.time() - t0) / 60
    log(f"trained in {minutes:.1f} min (stage 1 {(t1 - t0) / 60:.1f}, stage 2 {(time.time() - t1) / 60:.1f})")
    tmp = Path(tempfile.mkdtemp(prefix=".micro-vision.", dir=out.parent if out.parent.exists() else None))
    shutil.rmtree(tmp)
    write_checkpoint(src, tmp, lm, vis)
    t_eval = time.time()
    info = {"train": {"tower_steps": cfg.tower_steps, "tower_batch": cfg.tower_batch,
                      "tower_lr": cfg.tower_lr, "tower_heldout": heads,
                      "stage1_minutes": (t1 - t0) / 60, "answer_steps": cfg.answer_steps,
                      "answer_batch": cfg.answer_batch, "lr_vis": cfg.lr_vis, "lr_lm": cfg.lr_lm,
                      "final_loss": float(np.mean(losses[-10:])), "seed": cfg.seed,
                      "minutes": minutes, "machine": f"{platform.machine()} CPU, MLX {mx.__version__}"},
            "eval": evaluate(tmp, cfg.eval_pictures, seed=10_000 + cfg.seed, log=log)}
    info["eval"]["minutes"] = (time.time() - t_eval) / 60
    out.parent.mkdir(parents=True, exist_ok=True)
    publish_checkpoint(tmp, out, info, model_card(info), max_mb=20, what="micro-vision")
    log(f"wrote {out} ({info['eval']['both_right']:.1%} both right)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
