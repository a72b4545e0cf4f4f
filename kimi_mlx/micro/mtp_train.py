"""Train one MTP layer for the shipped micro model (`make micro-mtp`), trunk frozen.

The layer is `kimi_mlx.speculative.mtp.MTPLayer` at index 6 (the micro config's layer lists leave it
out, so it is a Gated DSA layer; `is_moe` gives it the latent MoE with 32 MXFP4 experts):
enorm / hnorm / eh_proj, that decoder layer, `shared_head.norm`, with the micro model's
embedding and lm_head (not copied: the loader uses the trunk's when the layer has none).

Training, on random windows of the micro training corpus (`kimi_mlx.micro.corpus`, the
micro trainer's `Sampler`): the frozen micro model gives its post-norm hidden states h_j
and next-token distributions; the MTP reads (h_j, t_{j+1}) and is trained on the
next-next token t_{j+2} with soft labels, KL(micro's distribution at position j+1 ||
MTP's) (temperature 1; Hinton et al. 2015): at temperature 0 a draft is accepted when it
equals micro's argmax, so micro's distribution, not the corpus', is the target (as
`micro.draft` does). Plus the micro trainer's training behaviours, reused: the DSA
indexer's KL (dense warm-up, then sparse), auxiliary-loss-free router balancing, and
MXFP4 QAT for the last 10% of steps. Initialisation: the attention and MoE of micro's
last layer (5, also Gated DSA + MoE), its final norm as `shared_head.norm`, eh_proj =
[0.5 N(0, d^-1/2) | I] (starts as "micro's last layer once more" on h).

Writes, atomically, a COPY of micro with the MTP layer (`num_nextn_predict_layers` 1,
tensors `language_model.model.layers.6.*` added to the last shard) to `--out` (default
`build/micro-mtp`; `kimi_mlx/assets/micro` is never modified), with `mtp_eval.json`:
greedy acceptance (mean accepted drafts per verify step) and tokens/s of `--draft mtp`
against plain greedy decoding for k = 1..3, medians over repeats as `kimi-mlx bench spec`.

Run: `nice python -m kimi_mlx.micro.mtp_train [--out DIR] [--steps N] [--seed S]`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
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

from kimi_mlx.speculative.mtp import MTP, target_forward
from kimi_mlx.micro.corpus import build_corpus
from kimi_mlx.micro.publish import replace_dir
from kimi_mlx.micro.train import ASSET_DIR, Sampler, add_training_arguments, lr_at, token_streams
from kimi_mlx.micro.train_modules import TrainGatedDSA, TrainLatentMoE, _modules, set_phase

OUT_DIR = Path("build") / "micro-mtp"


def build_mtp(teacher, seed: int) -> MTP:
    """An `MTP` of depth 1 with the training subclasses (same parameters), initialised
    from the teacher as the module docstring says."""
    args = teacher.args
    mtp = MTP(args, 1)
    layer = mtp.mtp_layers[0]
    layer.self_attn = TrainGatedDSA(args)
    layer.block_sparse_moe = TrainLatentMoE(args)
    src = teacher.layers[args.num_hidden_layers - 1]
    assert not src.is_kda and layer.is_kda is False, "micro's last layer is Gated DSA"
    new = []
    for name, p in tree_flatten(src.self_attn.parameters()):
        new.append((f"self_attn.{name}", p.astype(mx.float32)))
    moe = src.block_sparse_moe
    for name, p in tree_flatten(moe.parameters()):
        if ".switch_mlp." in f".{name}" or name.startswith("switch_mlp."):
            continue
        new.append((f"block_sparse_moe.{name}", p.astype(mx.float32)))
    for proj in ("gate_proj", "up_proj", "down_proj"):  # MXFP4 experts -> float for training
        q = getattr(moe.switch_mlp, proj)
        w = mx.dequantize(q.weight, q.scales, group_size=q.group_size, bits=q.bits, mode=q.mode)
        new.append((f"block_sparse_moe.switch_mlp.{proj}.weight", w.astype(mx.float32)))
    for norm in ("input_layernorm", "post_attention_layernorm"):
        new.append((f"{norm}.weight", getattr(src, norm).weight.astype(mx.float32)))
    d = args.hidden_size
    rng = np.random.default_rng(seed)
    e_half = 0.5 * rng.normal(0.0, d**-0.5, (d, d))
    new.append(("eh_proj.weight", mx.array(np.concatenate([e_half, np.eye(d)], 1), mx.float32)))
    new += [("enorm.weight", mx.ones((d,))), ("hnorm.weight", mx.ones((d,))),
            ("shared_head.norm.weight", teacher.text.norm.weight.astype(mx.float32))]
    layer.load_weights(new, strict=True)
    mtp.bind(teacher)
    mx.eval(mtp.parameters())
    return mtp


def kd_loss(mtp: MTP, hidden, tokens, teacher_lp):
    """(KL(teacher || MTP) per position + indexer KL, (kd, kl)). hidden [B, T, d] (frozen
    trunk, post-norm), tokens [B, T] the next tokens, teacher_lp [B, T, V] micro's
    log-distribution of the token after those."""
    _, logits = mtp.step(hidden, tokens, None)
    logits = logits.astype(mx.float32)
    lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    kd = (mx.exp(teacher_lp) * (teacher_lp - lp)).sum(axis=-1).mean()
    kl = _modules(mtp, TrainGatedDSA)[0].stash.value
    return kd + kl, (kd, kl)


def train(mtp: MTP, teacher, sampler: Sampler, cfg, log) -> List[Dict]:
    opt = optim.AdamW(learning_rate=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    vg = nn.value_and_grad(mtp, kd_loss)
    moe = _modules(mtp, TrainLatentMoE)[0]
    history, t0, kd_avg = [], time.perf_counter(), None
    for i in range(cfg.steps):
        set_phase(mtp, sparse=i >= cfg.dense_steps, qat=i >= cfg.steps - cfg.qat_steps)
        opt.learning_rate = lr_at(i, cfg.steps, cfg.lr, cfg.warmup)
        inputs, targets = sampler()
        h, t_logits = target_forward(teacher, inputs, None)
        t_lp = t_logits.astype(mx.float32)
        t_lp = t_lp - mx.logsumexp(t_lp, axis=-1, keepdims=True)
        # pairs (h_j, t_{j+1}) -> micro's distribution of t_{j+2} (its output at j + 1)
        h, toks, t_lp = mx.stop_gradient(h[:, :-1]), targets[:, :-1], mx.stop_gradient(t_lp[:, 1:])
        (_, (kd, kl)), grads = vg(mtp, h, toks, t_lp)
        grads, _ = optim.clip_grad_norm(grads, cfg.clip)
        opt.update(mtp, grads)
        load = mx.zeros((moe.num_experts,), mx.float32).at[moe.stash.value.reshape(-1)].add(1.0)
        bias = moe.gate.e_score_correction_bias
        moe.gate.e_score_correction_bias = bias + cfg.bias_step * mx.sign(load.mean() - load)
        mx.eval(kd, kl, mtp.parameters(), opt.state)
        kd_v = kd.item()
        kd_avg = kd_v if kd_avg is None else 0.95 * kd_avg + 0.05 * kd_v
        if i % 20 == 0 or i == cfg.steps - 1:
            el = time.perf_counter() - t0
            log(f"step {i}/{cfg.steps} kd {kd_avg:.3f} indexer-kl {kl.item():.3f} {el:.0f}s")
            history.append({"step": i, "kd": kd_v, "indexer_kl": kl.item(), "seconds": el})
    return history


def write_copy(src: Path, dst: Path, mtp: MTP) -> None:
    """Atomically write src plus the MTP tensors (BF16, MXFP4 experts) to dst: the last
    shard is rewritten with them added, the index and config updated, the rest copied."""
    from kimi_mlx.testing.checkpoints import checkpoint_tensors

    tensors = checkpoint_tensors(mtp, mtp.args, mx.bfloat16)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        out = tmp / "ckpt"
        shutil.copytree(src, out)
        shard = dict(mx.load(str(src / last)))
        shard.update(tensors)
        os.remove(out / last)
        mx.save_safetensors(str(out / last), shard, metadata={"format": "pt"})
        for name, t in tensors.items():
            index["weight_map"][name] = last
            index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + t.nbytes
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        config = json.loads((src / "config.json").read_text())
        config["text_config"]["num_nextn_predict_layers"] = 1
        (out / "config.json").write_text(json.dumps(config, indent=2))
        replace_dir(out, dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def evaluate(ckpt: Path, tokens: int, ks: List[int], repeats: int, log) -> Dict:
    """Greedy acceptance and tokens/s of `--draft mtp` vs plain on held-out prompts."""
    from mlx_lm.generate import generate_step

    from kimi_mlx.checkpoint.loader import load_for_generation
    from kimi_mlx.speculative.mtp import load_mtp, mtp_generate_step
    from kimi_mlx.bench.spec import _gen_time, default_prompts, run_plain
    from kimi_mlx.speculative.loop import SpecStats

    model, _, tok, _ = load_for_generation(str(ckpt))
    mtp = load_mtp(ckpt, model)
    prompts = default_prompts(ckpt, tok, 4)

    def run_mtp(p, k, stats):
        return _gen_time(lambda: mtp_generate_step(p, model, mtp, num_draft_tokens=k,
                                                   max_tokens=tokens, stats=stats))

    plain_out = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=tokens)]
                 for p in prompts]
    run_plain(model, prompts[0], 4)
    run_mtp(prompts[0], max(ks), SpecStats())
    rows = []
    for k in ks:
        same = all([t for t, _, _ in mtp_generate_step(p, model, mtp, num_draft_tokens=k,
                                                      max_tokens=tokens)] == want
                   for p, want in zip(prompts, plain_out))
        plain_tps, spec_tps, stats = [], [], SpecStats()
        for _ in range(repeats):
            tp = n_p = ts = n_s = 0
            for p in prompts:
                dt, n = run_plain(model, p, tokens)
                tp, n_p = tp + dt, n_p + n
                dt, n = run_mtp(p, k, stats)
                ts, n_s = ts + dt, n_s + n
            plain_tps.append(n_p / tp)
            spec_tps.append(n_s / ts)
        row = {"k": k, "mean_accepted": stats.mean_accepted,
               "acceptance_rate": stats.acceptance_rate,
               "plain_tps": statistics.median(plain_tps), "mtp_tps": statistics.median(spec_tps),
               "greedy_equal": same}
        row["speedup"] = row["mtp_tps"] / row["plain_tps"]
        log(json.dumps(row))
        rows.append(row)
    return {"prompts": len(prompts), "tokens": tokens, "repeats": repeats, "rows": rows}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.micro.mtp_train")
    p.add_argument("--teacher", type=Path, default=ASSET_DIR, help="the micro checkpoint")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="folder for the copy with MTP")
    add_training_arguments(p, steps=200, batch=4, seq_len=96, lr=2e-3, warmup=20)
    p.add_argument("--bias-step", type=float, default=1e-3)
    p.add_argument("--eval-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    args.dense_steps = int(0.15 * args.steps)
    args.qat_steps = int(0.10 * args.steps)
    return args


def main(argv=None) -> int:
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.text.tokenizer import KimiTokenizer

    cfg = parse_args(argv)
    t_start = time.perf_counter()
    log = lambda *a: print("[micro-mtp]", *a, file=sys.stderr, flush=True)  # noqa: E731
    teacher, _, _ = load_model(cfg.teacher, verbose=False)
    teacher.eval()
    tok = KimiTokenizer.from_pretrained(cfg.teacher)
    streams = token_streams(tok, build_corpus(), "train")
    mtp = build_mtp(teacher, cfg.seed)
    mtp.train()
    n_params = sum(v.size for _, v in tree_flatten(mtp.parameters()))
    log(f"MTP layer: {n_params} parameters")
    sampler = Sampler(streams, cfg.batch, cfg.seq_len, cfg.seed + 7)
    history = train(mtp, teacher, sampler, cfg, log)
    wall = time.perf_counter() - t_start
    mtp.eval()
    set_phase(mtp, sparse=True, qat=False)
    write_copy(cfg.teacher, cfg.out, mtp)
    log(f"wrote {cfg.out} after {wall / 60:.1f} min of training")
    ev = evaluate(cfg.out, cfg.eval_tokens, [1, 2, 3], cfg.repeats, log)
    info = {"machine": f"{platform.machine()} {os.cpu_count()} cores, MLX {mx.__version__} CPU",
            "parameters": n_params,
            "training": {k: getattr(cfg, k) for k in ("steps", "batch", "seq_len", "lr", "seed",
                                                      "dense_steps", "qat_steps")}
            | {"wall_seconds": wall, "final_kd": history[-1]["kd"], "history": history},
            "eval": ev}
    (cfg.out / "mtp_eval.json").write_text(json.dumps(info, indent=1) + "\n")
    with open(cfg.out / "MODEL_CARD.md", "a", encoding="utf-8") as f:
        f.write(card_section(info))
    log(f"done in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


def card_section(info: Dict) -> str:
    """The MODEL_CARD.md section the copy gets about its MTP layer."""
    t, e = info["training"], info["eval"]
    rows = "\n".join(f"| {r['k']} | {r['mean_accepted']:.2f} | {100 * r['acceptance_rate']:.0f}% "
                     f"| {r['plain_tps']:.1f} | {r['mtp_tps']:.1f} | {r['speedup']:.2f}x |"
                     for r in e["rows"])
    return f"""

## MTP layer (this copy only: `make micro-mtp`)

`num_nextn_predict_layers` 1: `language_model.model.layers.6.*` (enorm, hnorm, eh_proj, a
Gated DSA + latent MoE layer with MXFP4 experts, shared_head.norm; {info['parameters']:,}
parameters), trained with the trunk frozen on micro's next-next-token distribution
(`kimi_mlx/micro/mtp_train.py`): {t['steps']} steps of {t['batch']} x {t['seq_len']}
tokens, {t['wall_seconds'] / 60:.1f} min on {info['machine']}, final KL {t['final_kd']:.3f}.
Use: `kimi-mlx generate --model THIS --draft mtp --num-draft-tokens K`.

Greedy `--draft mtp` against plain greedy decoding ({e['prompts']} held-out prompts,
{e['tokens']} tokens, median of {e['repeats']}; output identical):

| k | accepted per step | of drafted | plain tok/s | mtp tok/s | ratio |
|---|---|---|---|---|---|
{rows}
"""


if __name__ == "__main__":
    sys.exit(main())
