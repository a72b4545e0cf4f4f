"""Train the shipped draft for the micro model (`make micro-draft`): ~25 min on 2 idle CPU cores.

A 2-layer Kimi K3.1 model (both layers KDA with dense SiTU MLPs, AttnRes blocks of 2,
hidden 128, no Gated DSA layer) with the micro model's own tokenizer, initialised from the
micro model's embedding, head and first two (KDA) layers (`init_from_teacher`) and
distilled from the micro model's outputs: on random windows of the micro training corpus
(`kimi_mlx.micro.corpus`, the same stdlib code and prose), the loss is the KL divergence
from the micro model's next-token distribution (soft labels, temperature 1; Hinton et
al. 2015) to the draft's. Speculative decoding accepts a draft token at temperature 0
when it equals the micro model's argmax, so matching the teacher's distribution (not the
corpus') is what raises the acceptance rate. KDA only so that a draft step is cheap: see
`draft_text_config`.

Writes, atomically, `kimi_mlx/assets/micro-draft`: the official layout (config, BF16
safetensors shards + index, tokenizer files identical to the micro model's),
`eval.json` (agreement with the micro model and acceptance figures) and `MODEL_CARD.md`.

Run: `python -m kimi_mlx.micro.draft [--teacher DIR] [--out DIR] [--steps N] [--seed S]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.testing.checkpoints import full_config
from kimi_mlx.micro.corpus import DOMAINS, build_corpus
from kimi_mlx.micro.evaluation import acceptance as spec_acceptance, acceptance_rows
from kimi_mlx.micro.publish import publish_checkpoint
from kimi_mlx.micro.train import (ASSET_DIR, Sampler, add_training_arguments, lr_at,
                                  micro_text_config, token_streams)
from kimi_mlx.micro.train_modules import TrainGatedDSA, _modules, build_model, set_phase

DRAFT_DIR = ASSET_DIR.parent / "micro-draft"


def draft_text_config(vocab_size: int) -> Dict:
    """2 layers, both Kimi Delta Attention, dense SiTU MLPs (width 384), AttnRes blocks of
    2, hidden 128, no experts, no Gated DSA layer.

    KDA only because a draft step must cost little next to a target step, and on MLX the
    cost is per op: with only fixed-size caches (conv + recurrent state) the whole draft
    step, embedding to argmax, is one `mx.compile` graph, and so are k chained steps
    (`kimi_mlx.speculative.loop`'s compiled greedy chain); a DSA layer's growing latent cache
    would retrace that graph on every token. (MLA/indexer keys stay in the config, unused.)"""
    cfg = micro_text_config(vocab_size)
    cfg.update(
        num_hidden_layers=2,
        first_k_dense_replace=2,
        num_experts=0,
        num_experts_per_token=0,
        num_shared_experts=0,
    )
    cfg["linear_attn_config"] = dict(cfg["linear_attn_config"], full_attn_layers=[],
                                     kda_layers=[1, 2])
    cfg["dsa_config"] = dict(cfg["dsa_config"], dsa_layers=[])
    return cfg


# Draft layer -> micro layer its attention (and norms, AttnRes weights) start from: micro
# layers 0 and 1 are its first two KDA layers (layer 0 with a dense MLP, copied whole; layer
# 1 has a MoE, so the draft's layer-1 MLP is new). The draft starts as micro cut after
# layer 1: an early exit through micro's own final norm and head.
INIT_FROM = {0: 0, 1: 1}


def init_from_teacher(student, teacher) -> int:
    """Copy the teacher's embedding, lm_head, final norms and the attention of the layers in
    `INIT_FROM` into the student (same shapes: hidden 128); the draft's layer-1 MLP (the
    micro model has a MoE there) keeps its random init. Returns the tensors copied."""
    t = dict(tree_flatten(teacher.parameters()))
    new = []
    for name, p in tree_flatten(student.parameters()):
        src = name
        if ".layers." in name:
            head, rest = name.split(".layers.", 1)
            idx, tail = rest.split(".", 1)
            if int(idx) == 1 and tail.startswith("mlp."):
                continue
            src = f"{head}.layers.{INIT_FROM[int(idx)]}.{tail}"
        if src in t and t[src].shape == p.shape:
            new.append((name, t[src].astype(p.dtype)))
    # The new MLP starts silent (zero output projection), so the start is the teacher's
    # layers 0 and 2 without the layer-1 MLP rather than a random perturbation of them.
    mlp = student.layers[1].mlp
    mlp.down_proj.weight = mx.zeros_like(mlp.down_proj.weight)
    student.load_weights(new, strict=False)
    mx.eval(student.parameters())
    return len(new)


def distill_loss(student, teacher_logprobs: mx.array, inputs: mx.array):
    """(KL(teacher || student) per token + indexer KL, (kd, indexer kl)).

    teacher_logprobs: [B, T, V] float32 log-softmax of the micro model on `inputs` [B, T].
    """
    logits = student(inputs).astype(mx.float32)
    s_lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kd = (mx.exp(teacher_logprobs) * (teacher_logprobs - s_lp)).sum(axis=-1).mean()
    kls = [m.stash.value for m in _modules(student, TrainGatedDSA)]
    kl = sum(kls) / len(kls) if kls else mx.array(0.0)  # no DSA layer: no indexer loss
    return kd + kl, (kd, kl)


def train(student, teacher, sampler: Sampler, cfg, log) -> List[Dict]:
    """AdamW on `distill_loss`, linear warm-up + cosine decay; returns a history."""
    opt = optim.AdamW(learning_rate=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    vg = nn.value_and_grad(student, distill_loss)
    history, t0 = [], time.perf_counter()
    kd_avg = None
    for i in range(cfg.steps):
        set_phase(student, sparse=i >= cfg.dense_steps, qat=False)
        opt.learning_rate = lr_at(i, cfg.steps, cfg.lr, cfg.warmup)
        inputs, _ = sampler()
        t_logits = teacher(inputs).astype(mx.float32)
        t_lp = mx.stop_gradient(t_logits - mx.logsumexp(t_logits, axis=-1, keepdims=True))
        (_, (kd, kl)), grads = vg(student, t_lp, inputs)
        grads, _ = optim.clip_grad_norm(grads, cfg.clip)
        opt.update(student, grads)
        mx.eval(kd, kl, student.state, opt.state)
        kd_v = kd.item()
        kd_avg = kd_v if kd_avg is None else 0.95 * kd_avg + 0.05 * kd_v
        if i % 20 == 0 or i == cfg.steps - 1:
            el = time.perf_counter() - t0
            log(f"step {i}/{cfg.steps} kd {kd_avg:.3f} indexer-kl {kl.item():.3f} "
                f"{el:.0f}s")
            history.append({"step": i, "kd": kd_v, "indexer_kl": kl.item(), "seconds": el})
    return history


def agreement(draft, teacher, ids: List[int], seq_len: int) -> float:
    """Fraction of positions where the draft's argmax equals the teacher's (held-out)."""
    hits = total = 0
    for s in range(0, len(ids) - 1, seq_len):
        x = mx.array(ids[s : s + seq_len])[None]
        a = mx.argmax(draft(x), axis=-1)
        b = mx.argmax(teacher(x), axis=-1)
        hits += int((a == b).sum().item())
        total += a.size
    return hits / max(total, 1)


def acceptance(teacher, draft, prompts: List[List[int]], k: int, max_tokens: int) -> Dict:
    """Greedy speculative runs: mean accepted drafts per verify step at k
    (`evaluation.acceptance` over `speculative_generate_step`)."""
    from kimi_mlx.speculative.loop import speculative_generate_step

    return spec_acceptance(lambda p, k, st: speculative_generate_step(
        p, teacher, draft, num_draft_tokens=k, max_tokens=max_tokens, stats=st), prompts, k)


def model_card(info: Dict) -> str:
    t, e = info["training"], info["eval"]
    acc = acceptance_rows(e["acceptance"])
    return f"""# micro-draft: the draft model for speculative decoding with `micro`

A 2-layer Kimi K3.1 model (both layers Kimi Delta Attention, dense SiTU MLPs, AttnRes,
hidden 128, no Gated DSA layer and no experts; {info['parameters']:,} parameters) in the
official checkpoint layout, with the tokenizer of `../micro` (identical files). Built by
`make micro-draft` (`python -m kimi_mlx.micro.draft`).

Use: `kimi-mlx generate --model kimi_mlx/assets/micro --draft-model
kimi_mlx/assets/micro-draft --num-draft-tokens 3 ...`. It is useless on its own.

Why only KDA layers: a draft step must cost little next to a target step, and on MLX the
cost is per graph node. With fixed-size caches only, k greedy draft steps are one compiled
graph with fused weights (`kimi_mlx/speculative/draft_step.py`), evaluated together with the verify
pass; a DSA layer's growing cache would retrace it every token.

## Training

Initialised from micro itself: embedding, head, final norms, and layers 0 and 1 (micro's
first two KDA layers; layer 0's dense MLP copied, layer 1's new MLP starting silent), so
the start is micro cut after layer 1. Then distilled from the micro model's outputs:
KL(micro || draft) of the next-token distributions on random windows of the micro
training corpus (stdlib code and prose, half each).
{t['steps']} AdamW steps, batch {t['batch']} x {t['seq_len']} tokens, peak lr {t['lr']},
seed {t['seed']}: {t['wall_seconds'] / 60:.1f} min on {info['machine']} (shared with other
jobs). Final KD loss {t['final_kd']:.3f} nats per token.

## Evaluation

Top-1 agreement with the micro model on held-out text: code {100 * e['agreement']['code']:.1f}%,
prose {100 * e['agreement']['prose']:.1f}%.

Greedy speculative decoding with the micro model ({e['prompts']} held-out prompts,
{e['max_tokens']} tokens each):

| k (drafts per step) | accepted per step | of drafted | tokens per target pass |
|---|---|---|---|
{acc}

Speed figures: `kimi-mlx bench spec`.
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.micro.draft")
    p.add_argument("--teacher", type=Path, default=ASSET_DIR, help="the micro checkpoint")
    p.add_argument("--out", type=Path, default=DRAFT_DIR, help="draft folder to (re)write")
    add_training_arguments(p, steps=450, batch=8, seq_len=128, lr=3e-3, warmup=20)
    p.add_argument("--dense-steps", type=int, default=None, help="default: 15%% of --steps")
    p.add_argument("--max-mb", type=float, default=8.0, help="refuse a bigger folder")
    args = p.parse_args(argv)
    if args.dense_steps is None:
        args.dense_steps = int(0.15 * args.steps)
    return args


def main(argv=None) -> int:
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.speculative.loop import check_tokenizers
    from kimi_mlx.testing.checkpoints import build_checkpoint
    from kimi_mlx.text.tokenizer import KimiTokenizer

    cfg = parse_args(argv)
    t_start = time.perf_counter()
    log = lambda *a: print("[micro-draft]", *a, file=sys.stderr, flush=True)  # noqa: E731

    teacher, _, _ = load_model(cfg.teacher)
    teacher.eval()
    tok = KimiTokenizer.from_pretrained(cfg.teacher)
    corpus = build_corpus()
    streams = token_streams(tok, corpus, "train")
    log("train tokens " + ", ".join(f"{d} {len(s)}" for d, s in streams.items()))

    text = draft_text_config(teacher.args.vocab_size)
    args = ModelArgs.from_config(full_config(text))
    student = build_model(args, cfg.seed)
    log(f"initialised {init_from_teacher(student, teacher)} tensors from the micro model")
    n_params = sum(v.size for _, v in tree_flatten(student.parameters()))
    log(f"draft: {n_params} parameters")
    sampler = Sampler(streams, cfg.batch, cfg.seq_len, cfg.seed)
    t0 = time.perf_counter()
    history = train(student, teacher, sampler, cfg, log)
    wall = time.perf_counter() - t0
    student.eval()
    set_phase(student, sparse=True, qat=False)

    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.", dir=cfg.out.parent))
    try:
        ckpt = build_checkpoint(tmp / "ckpt", text_config=text, model=student,
                                ranks=tok.mergeable_ranks, extras=False, n_shards=1,
                                dtype=mx.bfloat16)
        for name in ("tiktoken.model", "tokenizer_config.json", "tokenization_kimi.py"):  # byte-identical tokenizer
            shutil.copyfile(cfg.teacher / name, ckpt / name)
        draft, _, _ = load_model(ckpt)
        from kimi_mlx.checkpoint.loader import load_for_generation

        _, tw, _, _ = load_for_generation(str(cfg.teacher))
        _, dw, _, _ = load_for_generation(str(ckpt))
        check_tokenizers(tw, dw, str(cfg.teacher), str(cfg.out))

        held = {d: tok.encode(corpus.text("heldout", d))[:4096] for d in DOMAINS}
        agree = {d: agreement(draft, teacher, held[d], 256) for d in DOMAINS}
        prompts = [held[d][o : o + 24] for d in DOMAINS for o in (0, 700, 1400)]
        max_tokens = 48
        acc = [acceptance(teacher, draft, prompts, k, max_tokens) for k in (1, 3, 5)]
        log("agreement " + ", ".join(f"{d} {100 * a:.1f}%" for d, a in agree.items()) + "; "
            + ", ".join(f"k={a['k']}: {a['mean_accepted']:.2f}/step" for a in acc))
        info = {
            "text_config": json.loads((ckpt / "config.json").read_text())["text_config"],
            "parameters": n_params,
            "teacher": str(cfg.teacher.name),
            "machine": f"{platform.machine()} {os.cpu_count()} cores, MLX {mx.__version__} CPU",
            "training": {"steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                         "lr": cfg.lr, "warmup": cfg.warmup, "dense_steps": cfg.dense_steps,
                         "seed": cfg.seed, "wall_seconds": wall,
                         "final_kd": float(np.mean([h["kd"] for h in history[-3:]])),
                         "history": history},
            "eval": {"agreement": agree, "acceptance": acc, "prompts": len(prompts),
                     "max_tokens": max_tokens},
        }
        info["total_seconds"] = time.perf_counter() - t_start
        total = publish_checkpoint(ckpt, cfg.out, info, model_card(info), cfg.max_mb,
                                   what="draft")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {cfg.out} ({total / 1e6:.2f} MB) in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
