"""micro-vision's MODEL_CARD.md: the per-bucket accuracy table, the run's lineage (the
`--init-from` chain it continues) and the card text, from the figures of eval.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict, List, Optional

from kimi_mlx.micro.vision_data import (ASPECT_BUCKETS, COLOURS, MAX_ASPECT, QUESTION, RADIUS, SHAPES,
                                        SIDES, SIZE_BUCKETS)


def bucket_table(ev: Dict) -> str:
    """The per-bucket accuracy of `evaluate`'s result as a Markdown table."""
    rows = ["| bucket | pictures | colour and shape right |", "|---|---|---|"]
    for kind, names in (("long side px", SIZE_BUCKETS), ("aspect w:h", ASPECT_BUCKETS)):
        for name, _, _ in names:
            b = ev["buckets"].get(name)
            if b:
                rows.append(f"| {kind} {name} | {b['pictures']} | {b['right']} / {b['pictures']} "
                            f"({100 * b['both_right']:.1f} %) |")
    rows.append(f"| all | {ev['heldout_pictures']} | {100 * ev['both_right']:.1f} % |")
    return "\n".join(rows)


ROOT_NOTE = ("the first micro-vision, trained from scratch by this script on 112 x 112 squares only"
             " (1000 stage-1 steps of 64 pictures, 200 stage-2 steps of 8 prompts, 29.7 min), which"
             " named 95.8 % of held-out 112 x 112 pictures but failed on other sizes (a 300 x 200"
             " picture: 1 in 10)")


def lineage_of(init_from: Optional[str]) -> List[Dict]:
    """The runs `init_from` descends from, oldest first, each {"name", "tower_steps",
    "answer_steps", "minutes", "both_right"} (from its eval.json; {"root": True} for the
    112 x 112 micro-vision, which predates eval.json lineages). [] from scratch."""
    if not init_from:
        return []
    f = Path(init_from) / "eval.json"
    if not f.is_file():
        return [{"name": Path(init_from).name, "root": True}]
    info = json.loads(f.read_text())
    t, ev = info.get("train", {}), info.get("eval", {})
    prior = t.get("lineage") or ([{"name": "micro-vision", "root": True}] if t.get("init_from") else [])
    return prior + [{"name": Path(init_from).name, "tower_steps": t.get("tower_steps"),
                     "answer_steps": t.get("answer_steps"), "minutes": t.get("minutes"),
                     "both_right": ev.get("both_right")}]


def init_note(t: Dict) -> str:
    """The model card's sentences on `--init-from` (empty for a run from scratch)."""
    if not t.get("init_from"):
        return ""
    runs = t.get("lineage") or [{"root": True}]
    steps = []
    for r in runs:
        if r.get("root"):
            steps.append(ROOT_NOTE)
        else:
            steps.append(f"{r['tower_steps']} stage-1 and {r['answer_steps']} stage-2 steps over all"
                         f" sizes ({r['minutes']:.1f} min), {100 * r['both_right']:.1f} % of the"
                         f" held-out pictures below")
    chain = "; then ".join(steps)
    return (f" This run is the last of a chain, each run started from the one before with"
            f" `--init-from` (this one from `{t['init_from']}`): {chain}. Both stages below"
            f" continue the last one's weights (a fresh tower needs ~1000 stage-1 steps before"
            f" shape is learnt at all, and 1500 of them from scratch gave 59.8 % head shape).")


def heads_text(t: Dict) -> str:
    """Stage 1's held-out head accuracies for the model card ("none" when skipped)."""
    h = t.get("tower_heldout")
    if not h:
        return "none (stage 1 skipped: --tower-steps 0)"
    return f"colour {100 * h['colour']:.1f} %, shape {100 * h['shape']:.1f} %"


def pool_text(t: Dict) -> str:
    """The model card's words for stage 1's pooling (`--tower-pool`)."""
    if t.get("tower_pool", "mean") == "mean":
        return "the mean projector row"
    return "the per-channel max of the projector rows"


def model_card(info: Dict) -> str:
    """MODEL_CARD.md text from the run's figures (`info` as written to eval.json)."""
    ev, t = info["eval"], info["train"]
    ex = "\n".join(f"| {e['picture']} | {e['size']} | {' '.join(e['reply'].split()).replace('|', '/')} |"
                   for e in ev["examples"])
    return f"""# kimi-mlx micro-vision: a micro checkpoint that sees shapes and colours

`kimi_mlx/assets/micro` (the shipped 5.1M-parameter K3.1-architecture text model) with a
small MoonViT3d vision tower and patchmergerv2 projector, trained by `make micro-vision`
(`python -m kimi_mlx.micro.vision_train`) so that, shown one synthetic picture of any size
from {SIDES[0]} to {SIDES[1]} px a side and any aspect ratio from 1:{MAX_ASPECT:g} to {MAX_ASPECT:g}:1,
and asked "{QUESTION}", it names the colour and the shape.

```
kimi-mlx generate --model kimi_mlx/assets/micro-vision --image PICTURE.png --prompt "{QUESTION}"
make eval-micro-vision   # the held-out table below, recomputed
```

## Files

Official layout: `config.json` with `vision_config` (2 blocks, hidden 64, 4 heads x 16,
MLP 128, position grid 64 x 64 (bilinear resize to each picture's grid), patch 14,
merge 2 x 2, projector 256 -> 256 -> 128), `vision_tower.*` / `mm_projector.*` BF16
tensors in the last shard, `preprocessor_config.json` with the release's `media_proc_cfg`
(patch 14, merge 2, in_patch_limit 65536, patch_limit_on_one_side 512, mean = std = 0.5,
chessboard alpha background).

## Data

Pictures of W x H px, each side log-uniform over {SIDES[0]}-{SIDES[1]} px (small pictures come
more often), long / short side at most {MAX_ASPECT:g}; K3.1's resize and pad rule
(`kimi_mlx/vision/preprocess.py`) keeps such a picture as it is and pads it with black at
the bottom and right to multiples of 28 px: grids from 4 x 4 to 32 x 32 patches, 4 to 256
image tokens. One filled shape ({", ".join(SHAPES)}) in one of six colours
({", ".join(COLOURS)}) at a random position, outer radius {RADIUS[0]:.3f}-{RADIUS[1]:.3f} of the
short side, on a plain light background (each channel 225-255). Prompt: the K3.1 chat
encoding with a random thinking effort, the picture, then "{QUESTION}"; answer: an empty
think block and the response "a COLOUR SHAPE".

## Training

Staged, as LLaVA-style models are (training everything jointly from the start left
shape at chance).{init_note(t)} Batches are bucketed by grid (every picture of a step has one grid,
so the tower runs them at once): a step draws a size as above, then pictures of that
grid, as many as fit the step's patch / token budget.

- stage 1: tower and projector alone with colour / shape linear heads on {pool_text(t)}
  (heads dropped afterwards), {t['tower_steps']} steps of about
  {t['tower_patches']} patches (4 to 96 pictures), AdamW lr {t['tower_lr']} (50 warm-up steps,
  cosine decay to 1/20, weight decay 0.01), {t['stage1_minutes']:.1f} min. Head accuracy on
  {8 * t['tower_eval_grids']} held-out pictures ({t['tower_eval_grids']} grids) at the end: {heads_text(t)};
- stage 2: tower frozen; projector and the text model's non-expert weights (the MXFP4
  experts, KDA conv / A_log / dt_bias and router biases frozen) on the answer tokens
  (cross-entropy on the reply only), {t['answer_steps']} steps of about {t['answer_tokens']} image
  tokens (2 to {t['answer_batch']} prompts) (AdamW, lr projector {t['lr_vis']}, text {t['lr_lm']},
  cosine decay to 1/10), sparse DSA as at inference; final loss {t['final_loss']:.4f} (mean
  of the last 10 steps);
- float32 on the CPU, seed {t['seed']}, {t['minutes']:.1f} min of training in all on
  {t['machine']} ({t.get('cores', 2)} cores); the held-out evaluation below
  took {ev['minutes']:.1f} min more.

## Accuracy (held-out pictures, greedy, thinking effort max)

{ev['heldout_pictures']} pictures drawn with seed {ev['seed']} (not drawn in training), stratified
over 3 size buckets (long side) x 3 aspect buckets (width : height); colour right
{100 * ev['colour_right']:.1f} %, shape right {100 * ev['shape_right']:.1f} %.

{bucket_table(ev)}

| picture | W x H | reply |
|---|---|---|
{ex}

The text model in this folder is a tuned copy of `micro` (its non-expert weights, for
this one question): it is not a general assistant, and its code / prose continuations
differ from `micro`'s. `kimi_mlx/assets/micro` itself is unchanged.
"""
