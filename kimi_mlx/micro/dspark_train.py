"""Train the shipped DSpark block drafter for the micro model (`make micro-dspark`): about
30 minutes on 2 quiet CPU cores (about 4 of them generating and capturing micro's outputs).

A DSpark drafter in the released layout (`kimi_mlx.speculative.block_drafter`): two
Qwen3-style layers (hidden 128 = micro's, 4 heads of 32), the low-rank Markov head (rank
32), block of 8 proposals, `mask_token_id` = micro's `<|reserved_token_4104|>`, reading
all six of micro's layers (`target_layer_ids`); the embedding and lm_head are micro's
own (not stored, as in the released drafters).

Data: micro's own outputs. Windows of the micro training corpus (`kimi_mlx.micro.corpus`,
stdlib code and prose) are used as prompts and continued greedily by micro; micro then
runs over each whole sequence once to capture its hidden states at those layers. Labels
of the continuation are micro's argmax, which is exactly what greedy verification
accepts. Training (DFlash / DSpark recipe): per sequence, `--anchors` distinct anchors a
in the continuation; the block [t_a, mask x (k-1)] (k drawn in 2..8 per step, so that every
k drafts well) at positions a.. attends to the context of positions < a (the target's
hiddens there) and predicts t_{a+1..a+k}; all blocks of a step run in one masked forward
(`block_logits`); the Markov term is teacher-forced with the true previous token;
loss: half cross-entropy against micro's greedy tokens, half against micro's distribution
(soft labels), weighted 0.8^i at block position i (the later positions matter less: they
are only reached when every earlier one is accepted).
Only the drafter trains; micro is frozen.

Copy-heavy text (`--copy-share`): that share of the sequences starts from a prompt that
quotes itself (`copy_prompts`: a span of training code or prose, a blank line, the span's
first part again), so micro's continuation copies, as on prompts that repeat earlier
lines; their anchors lie in the continuation too. Block lengths 1..8. `--init-from`
continues an earlier drafter and `--max-minutes` bounds the training time on a shared
machine (the cosine schedule follows whichever of steps and minutes runs out first).
The shipped drafter is the defaults' run (no copy-heavy text). Continuing it for 400
steps with `--copy-share 0.3` (`make micro-dspark-copy`, 28 min of training on 2 busy
cores) raised held-out copy acceptance (k = 4: 1.31 -> 1.37 per step) but lowered code
(1.23 -> 1.16) and prose (1.26 -> 1.18), so it was not shipped.
The card and eval.json compare the drafter with micro-draft per k on held-out code,
prose and copy prompts the drafter never saw (`kimi_mlx.micro.dspark_eval`).

Writes, atomically, `kimi_mlx/assets/micro-dspark`: config.json, model.safetensors
(BF16), eval.json (acceptance), MODEL_CARD.md.

Run: `python -m kimi_mlx.micro.dspark_train [--out DIR] [--steps N] [--seed S]
[--copy-share F] [--init-from DIR] [--max-minutes M]`.
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
from typing import Dict, List, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.micro.evaluation import acceptance as spec_acceptance, acceptance_rows
from kimi_mlx.micro.publish import publish_checkpoint
from kimi_mlx.micro.train import ASSET_DIR

OUT_DIR = ASSET_DIR.parent / "micro-dspark"
MASK_TOKEN = 4104  # <|reserved_token_4104|> in micro's tokenizer
LAYER_IDS = [0, 1, 2, 3, 4, 5]


def drafter_config(target_args, proposals: int = 8, rank: int = 32) -> Dict:
    """The config.json, in the released DSpark layout."""
    return {
        "architectures": ["DSparkDraftModel"], "model_type": "qwen3",
        "hidden_size": target_args.hidden_size, "intermediate_size": 384,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "head_dim": 32, "vocab_size": target_args.vocab_size, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "max_position_embeddings": 4096, "hidden_act": "silu",
        "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "dflash_config": {"projector_type": "dspark", "block_size": proposals,
                          "mask_token_id": MASK_TOKEN, "target_layer_ids": LAYER_IDS,
                          "num_target_layers": target_args.num_hidden_layers,
                          "markov_rank": rank, "markov_head_type": "vanilla",
                          "sample_from_anchor": True, "enable_confidence_head": False},
    }


def greedy_sequences(model, prompts: np.ndarray, new: int) -> np.ndarray:
    """prompts [B, P] int32 continued by `new` greedy tokens of micro -> [B, P + new]."""
    cache = model.make_cache()
    logits = model(mx.array(prompts), cache=cache)[:, -1]
    out = [mx.argmax(logits, axis=-1)]
    for _ in range(new - 1):
        logits = model(out[-1][:, None], cache=cache)[:, -1]
        out.append(mx.argmax(logits, axis=-1))
        mx.async_eval(out[-1])
    gen = np.array(mx.stack(out, axis=1)).astype(np.int32)
    return np.concatenate([prompts, gen], axis=1)


def copy_prompts(stream: np.ndarray, n: int, rng: np.random.Generator, length: int,
                 sep: List[int]) -> np.ndarray:
    """n copy-heavy prompts [n, length] int32 from a training token stream: a span, `sep`
    (a blank line), then the span's first part again, so that the continuation is the
    rest of the quote (what `bench.spec.copy_prompts` asks of held-out code, and what code
    that repeats its own lines asks in general). The span is 2/3 of the prompt's free
    length, its quoted part the rest; both start at a random offset of `stream`."""
    span = (length - len(sep)) * 2 // 3
    quote = length - len(sep) - span
    out = []
    for _ in range(n):
        o = int(rng.integers(0, len(stream) - span))
        s = stream[o : o + span]
        out.append(np.concatenate([s, np.asarray(sep, np.int32), s[:quote]]))
    return np.stack(out).astype(np.int32)


def captured(model, seqs: np.ndarray, batch: int = 32):
    """micro over whole sequences [N, T]: (hiddens at LAYER_IDS [N, T, n * d] float16,
    next-token log-probabilities [N, T, V] float16)."""
    from kimi_mlx.speculative.block_loop import target_forward

    hs, lps = [], []
    for s in range(0, len(seqs), batch):
        logits, h = target_forward(model, mx.array(seqs[s : s + batch]), None, LAYER_IDS)
        logits = logits.astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        hs.append(np.array(h.astype(mx.float16)))
        lps.append(np.array(lp.astype(mx.float16)))
    return np.concatenate(hs), np.concatenate(lps)


def block_logits(drafter, hidden: mx.array, tokens: mx.array, anchors: mx.array, k: int
                 ) -> Tuple[mx.array, mx.array]:
    """All blocks of a batch in one forward (the DFlash training layout): row b's
    anchors anchors[b] [A] int32, each a block [t_a, mask x (k-1)] at positions a.. that
    sees the context < a (the target's hiddens there) and itself.

    hidden [B, T, n d] float32, tokens [B, T] int32 -> (logits [B * A, k, V] float32 of
    t_{a+1..a+k} before the Markov term, row index [B * A] of each block). The same
    numbers as `BlockDrafter.base_logits` after `add_context` of the first a positions
    (tests/test_block_drafter.py)."""
    B, T = tokens.shape
    A = anchors.shape[1]
    rows = mx.repeat(mx.arange(B), A)
    a = anchors.reshape(-1)
    ctx = drafter.context(hidden)
    kv = []
    for layer in drafter.layers:
        kk, vv = layer.self_attn.kv(ctx, drafter._rope, 0)
        kv.append((kk[rows], vv[rows]))
    see = mx.arange(T)[None, :] < a[:, None]  # [B * A, T]
    x = drafter.block_inputs(tokens.reshape(-1)[rows * T + a], k)
    h = drafter.block_hidden(x, kv, a, ctx_mask=see)
    if not drafter.config.sample_from_anchor:
        h = h[:, 1:]
    return drafter.logits(h).astype(mx.float32), rows


def block_loss(drafter, hidden: mx.array, tokens: mx.array, teacher: mx.array,
               anchors: mx.array, k: int, weights: mx.array):
    """Mean over the blocks at `anchors` [B, A] (k proposals each, `block_logits`) of the
    0.8^i-weighted cross-entropy, half against the tokens (micro's greedy choices), half
    against micro's distribution (soft labels, Hinton et al. 2015); the Markov term is
    teacher-forced with the true previous token.

    hidden [B, T, n d] float32, tokens [B, T] int32, teacher [B, T, V] float32 log-probs
    of the token after each position; the block at anchor a predicts tokens[a + 1 .. a + k]."""
    B, T = tokens.shape
    logits, rows = block_logits(drafter, hidden, tokens, anchors, k)
    pos = anchors.reshape(-1)[:, None] + mx.arange(k)[None, :]  # [R, k]: a .. a + k - 1
    flat = rows[:, None] * T + pos
    prev = tokens.reshape(-1)[flat]
    logits = logits + drafter.markov_head(prev).astype(mx.float32)
    lq = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    hard = nn.losses.cross_entropy(logits, tokens.reshape(-1)[flat + 1])  # [R, k]
    soft = -(mx.exp(teacher.reshape(B * T, -1)[flat]) * lq).sum(axis=-1)
    w = weights[:k]
    return (((0.5 * hard + 0.5 * soft) * w).sum(axis=-1) / w.sum()).mean()


def acceptance(model, drafter, prompts: List[List[int]], k: int, max_tokens: int) -> Dict:
    """Greedy speculative runs with the drafter: accepted drafts per verify step at k
    (`evaluation.acceptance` over `block_generate_step`)."""
    from kimi_mlx.speculative.block_loop import BlockDraft, block_generate_step

    return spec_acceptance(lambda p, k, st: block_generate_step(
        p, model, BlockDraft(drafter), num_draft_tokens=k, max_tokens=max_tokens, stats=st),
        prompts, k)


def model_card(info: Dict) -> str:
    t, e = info["training"], info["eval"]
    acc = acceptance_rows(e["acceptance"])
    share = t.get("copy_share", 0.0)
    copy = (f"{t['prompt_len']} tokens; {100 * share:.0f}% of them copy-heavy: a span of "
            "code or prose, a blank line and the span's first part again, so micro's "
            "continuation quotes it" if share else f"{t['prompt_len']} tokens")
    base = t.get("base")
    init = ("" if not t.get("init_from") else
            f"\nContinued from an earlier micro-dspark ({t['init_from']}"
            + (f": {base['sequences']} sequences of plain corpus windows, {base['steps']} "
               f"steps at peak lr {base['lr']}, {base['wall_seconds'] / 60:.0f} min" if base else "")
            + ") by the run below.")
    held = ""
    if e.get("heldout"):
        from kimi_mlx.micro.dspark_eval import table

        held = f"""
Against micro-draft on held-out text (`python -m kimi_mlx.micro.dspark_eval`: 4 prompts
a workload from micro's `heldout/` files, {e['max_tokens']} tokens each; copy = a block of
held-out code and its first half again), drafts accepted per verify step:

{table(e["heldout"])}
"""
    return f"""# micro-dspark: a DSpark block drafter for `micro`

The released DSpark drafter format (config.json with `dflash_config`, safetensors; read
by `kimi_mlx.speculative.block_drafter`, the same layout mlx-vlm 0.7.10 loads) at micro's
scale: {info['config']['num_hidden_layers']} Qwen3-style layers, hidden {info['config']['hidden_size']}, Markov rank
{info['config']['dflash_config']['markov_rank']}, blocks of
{info['config']['dflash_config']['block_size']} proposals, reading micro's layers
{LAYER_IDS}; {info['parameters']:,} parameters of its own (embedding and lm_head are
micro's). Built by `make micro-dspark` (`python -m kimi_mlx.micro.dspark_train`).

Use: `kimi-mlx generate --model kimi_mlx/assets/micro --draft-model
kimi_mlx/assets/micro-dspark --num-draft-tokens 4 ...` (one process).

## Training

On micro's own outputs: {t['sequences']} corpus windows of the training split
({copy}) continued greedily by micro to {t['seq_len']} tokens; micro's hiddens captured once.{init}
{t['steps']} AdamW steps, batch {t['batch']} sequences x {t['anchors']} anchors, peak lr
{t['lr']}, seed {t['seed']}: {t['wall_seconds'] / 60:.1f} min on {info['machine']},
{info['total_seconds'] / 60:.1f} min in all (generation and capture included). Final loss {t['final_loss']:.3f}.

## Evaluation

Greedy speculative decoding with micro ({e['prompts']} held-out prompts, {e['max_tokens']}
tokens each):

| k (drafts per step) | accepted per step | of drafted | tokens per target pass |
|---|---|---|---|
{acc}
{held}
Speed figures: `kimi-mlx bench spec` (its "block" draft; `--block-draft` for another).
"""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.micro.dspark_train")
    p.add_argument("--teacher", type=Path, default=ASSET_DIR, help="the micro checkpoint")
    p.add_argument("--out", type=Path, default=OUT_DIR, help="drafter folder to (re)write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sequences", type=int, default=2048)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=160)
    p.add_argument("--steps", type=int, default=2500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--anchors", type=int, default=16,
                   help="distinct anchors (blocks) per sequence per step")
    p.add_argument("--lr", type=float, default=4e-3)
    p.add_argument("--copy-share", type=float, default=0.0,
                   help="share of the sequences whose prompt quotes itself (`copy_prompts`)")
    p.add_argument("--init-from", type=Path,
                   help="start from this drafter folder's weights (fine-tune) instead of random")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="training wall-time budget: the cosine schedule runs on the larger of "
                        "steps done / --steps and minutes spent / this, and training ends at 1 "
                        "(for a shared machine whose speed is not known beforehand)")
    p.add_argument("--max-mb", type=float, default=4.0, help="refuse a bigger folder")
    return p.parse_args(argv)


def main(argv=None) -> int:
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.micro.corpus import DOMAINS, build_corpus
    from kimi_mlx.micro.train import token_streams
    from kimi_mlx.speculative.block_drafter import (BlockDrafter, load_block_drafter,
                                                    read_block_config)
    from kimi_mlx.text.tokenizer import KimiTokenizer

    cfg = parse_args(argv)
    t_start = time.perf_counter()
    log = lambda *a: print("[micro-dspark]", *a, file=sys.stderr, flush=True)  # noqa: E731
    rng = np.random.default_rng(cfg.seed)
    mx.random.seed(cfg.seed)

    model, _, _ = load_model(cfg.teacher)
    model.eval()
    tok = KimiTokenizer.from_pretrained(cfg.teacher)
    corpus = build_corpus()
    streams = token_streams(tok, corpus, "train")
    n_copy = int(round(cfg.copy_share * cfg.sequences))
    prompts = []
    for i in range(cfg.sequences - n_copy):
        s = streams[DOMAINS[i % len(DOMAINS)]]
        o = int(rng.integers(0, len(s) - cfg.prompt_len))
        prompts.append(s[o : o + cfg.prompt_len])
    new = cfg.seq_len - cfg.prompt_len
    seqs = [greedy_sequences(model, np.stack(prompts[s : s + 128]), new)
            for s in range(0, len(prompts), 128)]
    starts = [cfg.prompt_len] * len(prompts)  # first position of micro's continuation
    if n_copy:
        # copy-heavy sequences: prompts of 3 x prompt_len tokens that quote themselves
        # (half code, half prose), continued to seq_len
        clen = min(3 * cfg.prompt_len, cfg.seq_len - 32)
        sep = tok.encode("\n\n")
        n_code = n_copy // 2
        cp = np.concatenate([copy_prompts(streams["code"], n_code, rng, clen, sep),
                             copy_prompts(streams["prose"], n_copy - n_code, rng, clen, sep)])
        seqs += [greedy_sequences(model, cp[s : s + 128], cfg.seq_len - clen)
                 for s in range(0, n_copy, 128)]
        starts += [clen] * n_copy
    seqs = np.concatenate(seqs)
    starts = np.asarray(starts)
    hid, tlp = captured(model, seqs)
    log(f"{len(seqs)} sequences of {seqs.shape[1]} tokens generated and captured "
        f"({time.perf_counter() - t_start:.0f}s)")

    config = drafter_config(model.args)
    bc = read_block_config(config)
    drafter = BlockDrafter(bc).bind_target(model)
    base = None
    if cfg.init_from:
        drafter.load_weights([(n, v.astype(mx.float32)) for n, v in
                              mx.load(str(cfg.init_from / "model.safetensors")).items()])
        log(f"starting from {cfg.init_from}")
        if (cfg.init_from / "eval.json").is_file():  # its own training, for the card
            base = json.loads((cfg.init_from / "eval.json").read_text()).get("training")
            base = {k: v for k, v in (base or {}).items() if k not in ("history", "base")} or None
    n_params = sum(v.size for _, v in tree_flatten(drafter.parameters()))
    k = bc.proposals
    weights = mx.array(0.8 ** np.arange(k), mx.float32)
    opt = optim.AdamW(learning_rate=cfg.lr, betas=(0.9, 0.95), weight_decay=0.01)
    vg = nn.value_and_grad(drafter, block_loss)
    t0, history, avg = time.perf_counter(), [], None
    budget = cfg.max_minutes * 60 if cfg.max_minutes else float("inf")
    steps_done = 0
    for i in range(cfg.steps):
        progress = max(i / cfg.steps, (time.perf_counter() - t0) / budget)
        if progress >= 1:
            log(f"time budget of {cfg.max_minutes:g} min spent at step {i}")
            break
        opt.learning_rate = cfg.lr * min(1.0, (i + 1) / 30) * 0.5 * (1 + np.cos(np.pi * progress))
        rows = rng.integers(0, len(seqs), cfg.batch)
        # one block length a step, 1..k: inference drafts blocks of any k <= the block;
        # anchors inside micro's own continuation of each row's prompt
        kb = int(rng.integers(1, k + 1))
        anchors = np.stack([rng.choice(np.arange(starts[r], seqs.shape[1] - kb), cfg.anchors,
                                       replace=False) for r in rows]).astype(np.int32)
        h = mx.array(hid[rows]).astype(mx.float32)
        t = mx.array(seqs[rows])
        lp = mx.array(tlp[rows]).astype(mx.float32)
        loss, grads = vg(drafter, h, t, lp, mx.array(anchors), kb, weights)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        opt.update(drafter, grads)
        mx.eval(loss, drafter.parameters(), opt.state)
        avg = loss.item() if avg is None else 0.95 * avg + 0.05 * loss.item()
        steps_done = i + 1
        if i % 50 == 0 or i == cfg.steps - 1:
            el = time.perf_counter() - t0
            log(f"step {i}/{cfg.steps} loss {avg:.3f} {el:.0f}s")
            history.append({"step": i, "loss": avg, "seconds": el})
    wall = time.perf_counter() - t0

    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.", dir=cfg.out.parent))
    try:
        ck = tmp / "ckpt"
        ck.mkdir()
        (ck / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        own = {n: v.astype(mx.bfloat16) for n, v in tree_flatten(drafter.parameters())}
        mx.save_safetensors(str(ck / "model.safetensors"), own, metadata={"format": "mlx"})
        loaded = load_block_drafter(ck, target=model)
        held = {d: tok.encode(corpus.text("heldout", d))[:4096] for d in DOMAINS}
        eval_prompts = [held[d][o : o + 24] for d in DOMAINS for o in (0, 700, 1400)]
        max_tokens = 48
        acc = [acceptance(model, loaded, eval_prompts, kk, max_tokens) for kk in (2, 3, 4, 6, 8)]
        log(", ".join(f"k={a['k']}: {a['mean_accepted']:.2f}/step" for a in acc))
        from kimi_mlx.micro import dspark_eval

        runs = {"micro-dspark": dspark_eval.block_run(model, loaded, max_tokens)}
        draft_dir = cfg.teacher.parent / "micro-draft"
        if (draft_dir / "config.json").is_file():
            runs["micro-draft"] = dspark_eval.model_run(model, load_model(draft_dir)[0], max_tokens)
        heldout = dspark_eval.per_k(runs, dspark_eval.heldout_prompts(cfg.teacher, tok))
        log("held-out, accepted per verify step:\n" + dspark_eval.table(heldout))
        info = {
            "config": config, "parameters": n_params, "teacher": cfg.teacher.name,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, MLX {mx.__version__} CPU",
            "training": {"sequences": cfg.sequences, "prompt_len": cfg.prompt_len,
                         "seq_len": cfg.seq_len, "steps": steps_done, "batch": cfg.batch,
                         "anchors": cfg.anchors, "lr": cfg.lr, "seed": cfg.seed,
                         "copy_share": cfg.copy_share,
                         "init_from": str(cfg.init_from) if cfg.init_from else None,
                         "base": base,
                         "wall_seconds": wall, "final_loss": avg, "history": history},
            "eval": {"acceptance": acc, "prompts": len(eval_prompts), "max_tokens": max_tokens,
                     "heldout": heldout},
        }
        info["total_seconds"] = time.perf_counter() - t_start
        total = publish_checkpoint(ck, cfg.out, info, model_card(info), cfg.max_mb, what="drafter")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {cfg.out} ({total / 1e6:.2f} MB) in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
