"""Train the shipped micro Kimi K3.1 checkpoint (`make micro`): MLX on the CPU, ~25 min on 2 cores.

What it does, in order (all deterministic for a given `--seed` and interpreter):

1. Corpus: Python stdlib sources (code) and the stdlib's documentation text (prose), with
   a held-out split per domain (`kimi_mlx.micro.corpus`).
2. Tokenizer: byte-level BPE (`kimi_mlx.text.bpe`, 4096 ranks) plus Kimi's 256 special tokens,
   written as `tiktoken.model` + `tokenizer_config.json` like the release.
3. Model: our own `kimi_mlx.model.model.Model` (the code that runs the real checkpoint) at micro
   size (`micro_text_config`): 6 layers, layer 0 dense, four KDA layers, two Gated DSA
   layers, AttnRes blocks of 2, latent MoE with 32 routed experts top-4 plus a shared
   expert, SiTU, NoPE MLA. Trained in float32 with AdamW on sequences of `--seq-len` tokens.
   Three training-only behaviours are added by subclasses whose parameters are exactly the
   inference modules' (so the exported names and shapes are the model's own):
   * DSA indexer (DeepSeek-V3.2): for the first `--dense-steps` the main attention is dense
     causal and the indexer learns KL(p_attn || softmax(I)) over all causal keys, p_attn
     the main attention summed over heads and L1-normalised (no gradient); afterwards the
     main attention uses the indexer's top-`index_topk` keys exactly as inference does and
     the KL is taken over the selected keys. The indexer reads detached inputs, so it gets
     only the KL gradient and the language model only the LM gradient.
   * Router: auxiliary-loss-free balancing (DeepSeek-V3): after each step every layer's
     `e_score_correction_bias` moves by +-`--bias-step` toward equal expert load.
   * MXFP4 quantization-aware training for the last `--qat-steps`: routed-expert weights
     are fake-quantized (mx.quantize / mx.dequantize, mode "mxfp4") with a
     straight-through estimator, so the exported MXFP4 experts are what was trained.
4. Export with `kimi_mlx.testing.checkpoints.build_checkpoint` (official layout: BF16 non-expert
   weights, MXFP4 `weight_packed` / `weight_scale` experts, 3 shards + index, config,
   tokenizer files), the held-out and calibration text files, `eval.json` and
   `MODEL_CARD.md`, into `kimi_mlx/assets/micro` (replaced atomically).

The training-only modules are `kimi_mlx.micro.train_modules`, the figures
`kimi_mlx.micro.evaluation`, the atomic publishing `kimi_mlx.micro.publish` (shared with the
other micro trainers).

Run: `python -m kimi_mlx.micro.train [--out DIR] [--steps N] [--seed S]`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.model import Model
from kimi_mlx.testing.checkpoints import full_config, tiny_text_config
from kimi_mlx.micro.corpus import DOMAINS, Corpus, build_corpus
# the training-only model, the evaluation and the publishing steps have their own modules
from kimi_mlx.micro.evaluation import evaluate_all
from kimi_mlx.micro.publish import dir_bytes, publish_checkpoint
from kimi_mlx.micro.train_modules import TrainGatedDSA, TrainLatentMoE, _modules, build_model, set_phase
# names the tests import from here
from kimi_mlx.micro.train_modules import FakeQuantSwitchLinear, dsa_train_forward, mxfp4_roundtrip  # noqa: F401

ASSET_DIR = Path(__file__).resolve().parent.parent / "assets" / "micro"
VOCAB_RANKS = 4096  # ordinary BPE tokens; 256 Kimi special tokens follow them


# ----------------------------------------------------------------------------- config


def micro_text_config(vocab_size: int = VOCAB_RANKS + 256) -> Dict[str, Any]:
    """The micro model's text config (official key names).

    6 layers: 0-based 2 and 5 Gated DSA (1-indexed `full_attn_layers` [3, 6]), 0, 1, 3, 4
    KDA; layer 0 dense SiTU MLP, layers 1-5 latent MoE (32 experts top-4 + 1 shared,
    latent 64, expert width 96); AttnRes blocks of 2 layers; hidden 128; MLA 4 heads
    (nope 32 + rope 16, v 32, q/kv latent 64); indexer 4 heads x 32, index_topk 64 (a
    quarter of the training length, so training and long prompts take the sparse path).
    """
    return tiny_text_config(
        vocab_size=vocab_size,
        hidden_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=384,
        max_position_embeddings=4096,
        attn_res_block_size=2,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        num_experts=32,
        num_experts_per_token=4,
        num_shared_experts=1,
        moe_intermediate_size=96,
        routed_expert_hidden_size=64,
        routed_scaling_factor=1.0,
        linear_attn_config={
            "num_heads": 4,
            "head_dim": 32,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [3, 6],
            "kda_layers": [1, 2, 4, 5],
        },
        dsa_config={"index_n_heads": 4, "index_head_dim": 32, "index_topk": 64},
    )


# ------------------------------------------------------------------------------ train


def _entropy(p: mx.array) -> mx.array:
    return -(p * mx.log(p + 1e-9)).sum(axis=-1)


def sequence_expert_mi(logits: mx.array, temperature: float = 1.0) -> mx.array:
    """Mutual information (nats) between a batch row and the expert it routes to.

    logits: [B, T, E] router logits; p = softmax(logits / temperature) per token (a low
    temperature gives the term a useful gradient while the router is still near its
    small random init, where softmax(logits) is almost uniform). With r_b the mean of p
    over row b's tokens and g the mean of the r_b: MI = H(g) - mean_b H(r_b). High when
    each row uses few experts and different rows use different ones (the expert/task MI
    loss of Mod-Squad, Chen et al. 2023, with the row, not a label, as the task), so
    maximising it makes experts specialise by what a sequence is about while keeping the
    batch's overall use spread (no collapse onto a handful for everything).
    """
    p = mx.softmax(logits.astype(mx.float32) / temperature, axis=-1)
    rows = p.mean(axis=1)  # [B, E]
    return _entropy(rows.mean(axis=0)) - _entropy(rows).mean()


def loss_fn(model: Model, inputs: mx.array, targets: mx.array, mi_weight: float = 0.0,
            mi_temperature: float = 1.0):
    """(LM cross-entropy + mean indexer KL - mi_weight * mean router MI,
    (ce, kl, expert load [moe layers, E], per-row load [moe layers, B, E], mean MI))."""
    logits = model(inputs)
    ce = nn.losses.cross_entropy(logits, targets, reduction="mean")
    kls = [m.stash.value for m in _modules(model, TrainGatedDSA)]
    kl = sum(kls) / len(kls)
    loads, row_loads, mis = [], [], []
    for m in _modules(model, TrainLatentMoE):
        inds = m.stash.value
        B = inds.shape[0]
        onehot = (inds.reshape(B, -1)[..., None] == mx.arange(m.num_experts)).astype(mx.float32)
        row_loads.append(onehot.sum(axis=1))  # [B, E]
        loads.append(row_loads[-1].sum(axis=0))
        mis.append(sequence_expert_mi(m.logits.value, mi_temperature))
    mi = sum(mis) / len(mis)
    loss = ce + kl - mi_weight * mi if mi_weight else ce + kl
    return loss, (ce, kl, mx.stack(loads), mx.stack(row_loads), mi)


class Sampler:
    """Deterministic batches: half code, half prose, random windows of seq_len + 1 tokens.

    With `memorize` (ids of a short training text) each prose row comes from it instead
    with probability `memorize_rate`, so the model learns that text by heart.
    """

    def __init__(self, streams: Dict[str, np.ndarray], batch: int, seq_len: int, seed: int,
                 memorize: Optional[np.ndarray] = None, memorize_rate: float = 0.0):
        self.streams = streams
        self.domains = tuple(streams)  # rows cycle over the domains in this order
        self.batch, self.seq_len = batch, seq_len
        self.memorize, self.memorize_rate = memorize, memorize_rate
        self.rng = np.random.default_rng(seed + 1)

    def __call__(self) -> Tuple[mx.array, mx.array]:
        rows = []
        for j in range(self.batch):
            domain = self.domains[j % len(self.domains)]
            s = self.streams[domain]
            if domain == "prose" and self.memorize is not None:
                if self.rng.random() < self.memorize_rate:
                    s = self.memorize
            o = int(self.rng.integers(0, len(s) - self.seq_len - 1))
            rows.append(s[o : o + self.seq_len + 1])
        x = mx.array(np.stack(rows).astype(np.int32))
        return x[:, :-1], x[:, 1:]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    """Linear warm-up then cosine decay to `floor * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def make_step(model: Model, opt: optim.Optimizer, bias_step: float, clip: float,
              mi_weight: float = 0.0, mi_temperature: float = 1.0):
    """One training step: (inputs, targets) -> (ce, kl, load [moe layers, E],
    per-row load [moe layers, B, E], router MI); `mi_weight` see `loss_fn`.

    Not `mx.compile`d: on the CPU backend the step is bound by transcendental elementwise
    ops (exp / sigmoid / tanh), which compiling does not speed up.
    """
    value_and_grad = nn.value_and_grad(model, loss_fn)
    moes = _modules(model, TrainLatentMoE)

    def step(inputs, targets):
        (_, (ce, kl, loads, row_loads, mi)), grads = value_and_grad(
            model, inputs, targets, mi_weight, mi_temperature)
        grads, _ = optim.clip_grad_norm(grads, clip)
        opt.update(model, grads)
        for m, load in zip(moes, loads):
            bias = m.gate.e_score_correction_bias
            m.gate.e_score_correction_bias = bias + bias_step * mx.sign(load.mean() - load)
        return ce, kl, loads, row_loads, mi

    return step


def train(model: Model, sampler: Sampler, cfg: argparse.Namespace, log=print) -> List[Dict]:
    """Run `cfg.steps` optimizer steps; returns a history of logged points."""
    from tqdm import tqdm

    opt = optim.AdamW(learning_rate=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    history = []
    phase = None
    mi_weight = getattr(cfg, "router_mi", 0.0)
    step_fn = make_step(model, opt, cfg.bias_step, cfg.clip, mi_weight,
                        getattr(cfg, "router_mi_temperature", 1.0))
    domains = sampler.domains
    dom_load = None  # [domains, moe layers, E] selections since the last log
    t0 = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="train", unit="step", dynamic_ncols=True,
               mininterval=2.0, file=sys.stderr)
    ce_avg = kl_avg = None
    for i in bar:
        sparse = i >= cfg.dense_steps
        qat = i >= cfg.steps - cfg.qat_steps
        if (sparse, qat) != phase:
            phase = (sparse, qat)
            set_phase(model, sparse, qat)
        opt.learning_rate = lr_at(i, cfg.steps, cfg.lr, cfg.warmup)
        inputs, targets = sampler()
        ce, kl, loads, row_loads, mi = step_fn(inputs, targets)
        mx.eval(ce, kl, loads, row_loads, mi, model.state, opt.state)
        ce, kl, mi = ce.item(), kl.item(), mi.item()
        rl = np.array(row_loads)  # [L, B, E]; row j is domains[j % len(domains)]
        per = np.stack([rl[:, j::len(domains)].sum(axis=1) for j in range(len(domains))])
        dom_load = per if dom_load is None else dom_load + per
        ce_avg = ce if ce_avg is None else 0.95 * ce_avg + 0.05 * ce
        kl_avg = kl if kl_avg is None else 0.95 * kl_avg + 0.05 * kl
        if i % 10 == 0 or i == cfg.steps - 1:
            load = np.array(loads)
            imbalance = float((load.max(axis=1) / load.mean(axis=1)).mean())
            bar.set_postfix(ce=f"{ce_avg:.3f}", ppl=f"{math.exp(ce_avg):.1f}",
                            kl=f"{kl_avg:.3f}", maxload=f"{imbalance:.2f}",
                            phase=("sparse" if sparse else "dense") + ("+qat" if qat else ""))
            # share of each domain's expert selections (since the last log) carried by its
            # 16 most-selected experts, per MoE layer: the specialisation being trained for
            sh = dom_load / np.maximum(dom_load.sum(axis=-1, keepdims=True), 1)
            best = np.sort(sh, axis=-1)[..., ::-1][..., : sh.shape[-1] // 2].sum(axis=-1)
            dom_load = None
            history.append({"step": i, "ce": ce, "kl": kl, "max_over_mean_load": imbalance,
                            "router_mi": mi, "best_half_selections": {
                                d: [round(float(v), 3) for v in best[k]] for k, d in enumerate(domains)},
                            "lr": float(opt.learning_rate), "seconds": time.perf_counter() - t0})
            if mi_weight:
                log(f"step {i} ce {ce_avg:.3f} mi {mi:.3f} best-half selections " + "; ".join(
                    f"{d} " + " ".join(f"{v:.2f}" for v in best[k]) for k, d in enumerate(domains)))
    bar.close()
    return history


# ------------------------------------------------------------------------------ data


def train_tokenizer(corpus: Corpus, vocab_ranks: int = VOCAB_RANKS) -> Dict[bytes, int]:
    """Byte-level BPE ranks learned from the training split of both domains."""
    from kimi_mlx.text.bpe import train_bpe

    docs = [d.text for domain in corpus.domains for d in corpus.train[domain]]
    return train_bpe(docs, vocab_ranks)


def token_streams(tokenizer, corpus: Corpus, split: str = "train") -> Dict[str, np.ndarray]:
    """{domain: int32 ids of the split's joined text} (`Corpus.text`)."""
    return {d: np.array(tokenizer.encode(corpus.text(split, d)), dtype=np.int32)
            for d in corpus.domains}


MEMORIZE_SOURCE = "LICENSE.txt"


def memorize_text(corpus: Corpus) -> str:
    """The training-split blocks of the stdlib's LICENSE.txt, joined: the text the model
    is shown more often so that it knows it by heart (the greedy-generation test)."""
    from kimi_mlx.micro.corpus import SEPARATOR

    docs = [d.text for d in corpus.train["prose"] if d.source.startswith(MEMORIZE_SOURCE + "#")]
    return SEPARATOR.join(docs)


def _take_docs(docs, budget: int) -> str:
    """Whole documents, in order, while they fit in `budget` UTF-8 bytes, joined."""
    from kimi_mlx.micro.corpus import SEPARATOR

    out, n = [], 0
    for d in docs:
        size = len(d.text.encode("utf-8")) + len(SEPARATOR)
        if n + size <= budget:
            out.append(d.text)
            n += size
    return SEPARATOR.join(out)


def write_text_assets(out: Path, corpus: Corpus, heldout_bytes: int, calib_bytes: int) -> Dict:
    """heldout/{code,prose}.txt (held-out split) and calib/{code,prose}.txt (train split).

    Returns {"heldout": {domain: bytes}, "calib": {domain: bytes}}.
    """
    sizes: Dict[str, Dict[str, int]] = {"heldout": {}, "calib": {}}
    for sub, split, budget in (("heldout", "heldout", heldout_bytes), ("calib", "train", calib_bytes)):
        (out / sub).mkdir(parents=True, exist_ok=True)
        for d in corpus.domains:
            text = _take_docs(getattr(corpus, split)[d], budget)
            (out / sub / f"{d}.txt").write_text(text, encoding="utf-8")
            sizes[sub][d] = len(text.encode("utf-8"))
    return sizes


# ---------------------------------------------------------------------------- export


def model_card(info: Dict) -> str:
    """MODEL_CARD.md text from the run's figures (`info` as written to eval.json)."""
    ev, c, t = info["eval"], info["corpus"], info["training"]
    text = info["text_config"]
    lin, dsa = text["linear_attn_config"], text["dsa_config"]

    def row(name, figs):
        return f"| {name} | {figs['code']:.2f} | {figs['prose']:.2f} |"

    cs = c["stats"]
    lines = [
        "# kimi-mlx micro: a trained Kimi K3.1-architecture checkpoint",
        "",
        "A {:.1f}M-parameter model of the Kimi K3.1 architecture, trained from scratch on the CPU by "
        "`make micro` (`python -m kimi_mlx.micro.train`) on Python standard-library code and "
        "the standard library's documentation text. It exists so that generation, evaluation "
        "and pruning can be checked on a model that has learned real text, in the official "
        "file layout. It is not chat-tuned: use `--ignore-chat-template`.".format(info["parameters"] / 1e6),
        "",
        "## Architecture (config.json `text_config`)",
        "",
        "| item | value |",
        "|---|---|",
        f"| layers | {text['num_hidden_layers']}: KDA {[i - 1 for i in lin['kda_layers']]}, "
        f"Gated DSA {[i - 1 for i in lin['full_attn_layers']]} (0-based); layer 0 dense SiTU MLP "
        f"(width {text['intermediate_size']}), the rest latent MoE |",
        f"| hidden / vocab | {text['hidden_size']} / {text['vocab_size']} "
        f"({info['tokenizer']['ranks']} BPE ranks + 256 Kimi special tokens) |",
        f"| AttnRes block size | {text['attn_res_block_size']} |",
        f"| KDA | {lin['num_heads']} heads x {lin['head_dim']}, conv {lin['short_conv_kernel_size']}, "
        f"gate lower bound {lin['gate_lower_bound']} |",
        f"| Gated MLA | {text['num_attention_heads']} heads, nope {text['qk_nope_head_dim']} + rope "
        f"{text['qk_rope_head_dim']} (NoPE), v {text['v_head_dim']}, q/kv latent "
        f"{text['q_lora_rank']}/{text['kv_lora_rank']}, output gate |",
        f"| DSA indexer | {dsa['index_n_heads']} heads x {dsa['index_head_dim']}, "
        f"index_topk {dsa['index_topk']} (training length {t['seq_len']}) |",
        f"| MoE | {text['num_experts']} routed experts top-{text['num_experts_per_token']} "
        f"(width {text['moe_intermediate_size']}, latent {text['routed_expert_hidden_size']}), "
        f"{text['num_shared_experts']} shared expert, sigmoid router + correction bias, "
        f"routed_scaling_factor {text['routed_scaling_factor']} |",
        f"| activation | SiTU (beta {text['activation_situ_beta']}, linear beta "
        f"{text['activation_situ_linear_beta']}) |",
        f"| files | BF16 non-expert weights (F32 KDA conv / A_log / dt_bias, router bias), MXFP4 "
        f"`weight_packed` / `weight_scale` routed experts, 3 shards + index, "
        f"`tiktoken.model` + `tokenizer_config.json`; {info['checkpoint_bytes'] / 1e6:.2f} MB in total |",
        "",
        "## Corpus",
        "",
        f"Read from the Python {c['python_version']} standard library at build time "
        f"(`kimi_mlx/micro/corpus.py`); corpus fingerprint `{c['fingerprint'][:16]}`. A "
        "different Python version reads a different corpus and trains a different model.",
        "",
        "| domain | source | train | held out |",
        "|---|---|---|---|",
        f"| code | stdlib `.py` sources (no tests, no `encodings/`, files <= 100 kB), "
        f"held out by file | {cs['train']['code']['documents']} files, "
        f"{cs['train']['code']['bytes'] / 1e6:.2f} MB, {c['train_tokens']['code']} tokens | "
        f"{cs['heldout']['code']['documents']} files, {cs['heldout']['code']['bytes'] / 1e6:.2f} MB |",
        f"| prose | `pydoc_data/topics.py` documentation, `LICENSE.txt`, IDLE texts, "
        f"`email/architecture.rst`, held out by paragraph block | "
        f"{cs['train']['prose']['documents']} blocks, {cs['train']['prose']['bytes'] / 1e6:.2f} MB, "
        f"{c['train_tokens']['prose']} tokens | {cs['heldout']['prose']['documents']} blocks, "
        f"{cs['heldout']['prose']['bytes'] / 1e6:.2f} MB |",
        "",
        f"Shipped beside the weights: `heldout/{{code,prose}}.txt` (held-out text, "
        f"{ev['heldout_tokens']['code']} and {ev['heldout_tokens']['prose']} tokens) and "
        f"`calib/{{code,prose}}.txt` (from the training split, for pruning calibration).",
        "",
        "## Training",
        "",
        f"{t['steps']} AdamW steps (peak lr {t['lr']}, warm-up {t['warmup']}, cosine to 10 %, "
        f"weight decay {t['weight_decay']}, clip {t['clip']}) of {t['batch']} x {t['seq_len']} "
        f"tokens (half code, half prose): {t['tokens'] / 1e6:.2f}M tokens, float32, seed "
        f"{t['seed']}, {t['wall_seconds'] / 60:.1f} min of training on "
        f"{info['machine']}; `make micro` took {info['total_seconds'] / 60:.1f} min in all.",
        "",
        f"- DSA indexer (DeepSeek-V3.2): steps 0-{t['dense_steps'] - 1} dense attention with "
        "the indexer trained by KL(main attention summed over heads || softmax(indexer "
        f"scores)); steps {t['dense_steps']}- sparse top-{dsa['index_topk']} attention, KL "
        "on the selected keys; the indexer reads detached inputs.",
        f"- Router: auxiliary-loss-free balancing, correction bias step {t['bias_step']}.",
        f"- Learned by heart on purpose: each prose row is drawn with probability "
        f"{t['memorize']['rate']:.3f} from the training part of the stdlib `LICENSE.txt` "
        f"({t['memorize']['tokens']} tokens, ~{t['memorize']['exposures']:.0f} passes), so that "
        "a greedy-generation test can check whole continuations token for token.",
        f"- MXFP4 quantization-aware training (straight-through) of the routed experts in the "
        f"last {t['qat_steps']} steps.",
        f"- Final training loss (mean of the last logged steps): {t['final_ce']:.3f} nats/token "
        f"(perplexity {math.exp(t['final_ce']):.1f}).",
        "",
        "## Held-out perplexity",
        "",
        f"`kimi-mlx eval --data heldout/<domain>.txt --seq-len {ev['seq_len']}` "
        "(windows of that many predicted tokens). A uniform model scores the vocabulary size, "
        f"{ev['uniform']}.",
        "",
        "| weights | code | prose |",
        "|---|---|---|",
        row("BF16 (all weights)", ev["bf16"]),
        row("shipped: BF16 + MXFP4 experts", ev["mxfp4"]),
        "",
        "MXFP4 vs BF16: code {:+.2f} %, prose {:+.2f} %. Evaluation speed on the training "
        "machine: {:.0f} tokens/s (windows of {}, batch 8, float32 activations).".format(
            100 * (ev["mxfp4"]["code"] / ev["bf16"]["code"] - 1),
            100 * (ev["mxfp4"]["prose"] / ev["bf16"]["prose"] - 1),
            ev.get("tokens_per_second", float("nan")), ev["seq_len"]),
        "",
        f"By window length (shipped weights; index_topk {dsa['index_topk']}, so windows of "
        f"{dsa['index_topk']} are dense and longer ones use the indexer's top-k):",
        "",
        "| window | code | prose | code, dense attention | prose, dense attention |",
        "|---|---|---|---|---|",
    ]
    for L, figs in ev["by_seq_len"].items():
        dense = ev["dense_by_seq_len"].get(L)
        extra = f"{dense['code']:.2f} | {dense['prose']:.2f}" if dense else "= sparse | = sparse"
        lines.append(f"| {L} | {figs['code']:.2f} | {figs['prose']:.2f} | {extra} |")
    ex = ev["experts"]
    lines += [
        "",
        "## Expert specialisation",
        "",
        "Share of routing mass per routed expert (router weight summed over tokens), per MoE "
        "layer, on the held-out text. Total variation distance between the code and prose "
        "shares, averaged over layers: **{:.3f}** (per layer {}); between the two halves of "
        "the same domain: code {:.3f}, prose {:.3f}.".format(
            ex["tv_code_vs_prose"], ", ".join(f"{v:.3f}" for v in ex["tv_code_vs_prose_per_layer"]),
            ex["tv_between_halves"]["code"], ex["tv_between_halves"]["prose"]),
        "",
        "## Reproduce",
        "",
        "`make micro` rebuilds this folder from the same seed; on the same Python version, "
        "MLX version and machine type it writes the same tensors (the corpus fingerprint "
        "above must match). `eval.json` holds every figure of this card.",
        "",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------- main


def add_training_arguments(p: argparse.ArgumentParser, *, steps: int, batch: int, seq_len: int,
                           lr: float, warmup: int) -> None:
    """The options every AdamW micro trainer shares (`make micro`, `micro-moe`,
    `micro-draft`, `micro-mtp`), with that trainer's defaults: --seed, --steps, --batch,
    --seq-len, --lr (peak), --warmup (steps), --weight-decay 0.01, --clip 1.0 (global
    gradient norm)."""
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq-len", type=int, default=seq_len)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=1.0)


def parse_args(argv=None, defaults: Optional[Dict[str, Any]] = None,
               prog: str = "python -m kimi_mlx.micro.train",
               description: str = __doc__.splitlines()[0]) -> argparse.Namespace:
    """Training options; `defaults` overrides the micro model's defaults (`make micro-moe`
    uses the same trainer with its own: `kimi_mlx.micro.moe`)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--out", type=Path, default=ASSET_DIR, help="checkpoint folder to (re)write")
    add_training_arguments(p, steps=700, batch=8, seq_len=256, lr=3e-3, warmup=40)
    p.add_argument("--bias-step", type=float, default=1e-3)
    p.add_argument("--dense-steps", type=int, default=None, help="default: 15%% of --steps")
    p.add_argument("--qat-steps", type=int, default=None, help="default: 10%% of --steps")
    p.add_argument("--memorize-rate", type=float, default=0.2,
                   help="probability that a prose row is drawn from the training part of "
                        "LICENSE.txt (learned by heart for the generation test)")
    p.add_argument("--router-std", type=float, default=0.02, help="router weight init std")
    p.add_argument("--router-mi", type=float, default=0.0,
                   help="weight of the row/expert mutual-information bonus on the router "
                        "(`sequence_expert_mi`); 0 = off (micro)")
    p.add_argument("--router-mi-temperature", type=float, default=1.0,
                   help="softmax temperature of the router logits in the MI bonus")
    p.add_argument("--vocab", type=int, default=VOCAB_RANKS, help="BPE ranks (specials excluded)")
    p.add_argument("--heldout-bytes", type=int, default=120_000)
    p.add_argument("--calib-bytes", type=int, default=32_000)
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="measure only the first N held-out tokens per domain (default: all)")
    p.add_argument("--max-mb", type=float, default=25.0, help="refuse a bigger checkpoint folder")
    p.add_argument("--tokenizer-from", type=Path, default=None,
                   help="reuse this checkpoint's tokenizer instead of training BPE ranks")
    p.add_argument("--domains", default=",".join(DOMAINS),
                   help="corpus domains, comma-separated (kimi_mlx.micro.corpus.ALL_DOMAINS)")
    if defaults:
        p.set_defaults(**defaults)
    args = p.parse_args(argv)
    args.domains = tuple(d.strip() for d in args.domains.split(",") if d.strip())
    if args.dense_steps is None:
        args.dense_steps = int(0.15 * args.steps)
    if args.qat_steps is None:
        args.qat_steps = int(0.10 * args.steps)
    return args


def main(argv=None, *, cfg: Optional[argparse.Namespace] = None, evaluate=None, card=None,
         tag: str = "micro") -> int:
    """Train, evaluate and publish. `cfg` (from `parse_args`) replaces argv; `evaluate`
    (default `evaluate_all`) and `card` (default `model_card`) let `make micro-moe` reuse
    the whole run with its own figures and card."""
    from kimi_mlx.testing.checkpoints import build_checkpoint
    from kimi_mlx.text.tokenizer import KimiTokenizer, kimi_special_tokens

    cfg = cfg if cfg is not None else parse_args(argv)
    evaluate = evaluate or evaluate_all
    card = card or model_card
    t_start = time.perf_counter()
    log = lambda *a: print(f"[{tag}]", *a, file=sys.stderr, flush=True)  # noqa: E731

    corpus = build_corpus(domains=cfg.domains)
    log(f"corpus: Python {corpus.python_version}, fingerprint {corpus.fingerprint[:16]}")
    if cfg.tokenizer_from is not None:  # reuse another checkpoint's BPE ranks
        ranks = dict(KimiTokenizer.from_pretrained(cfg.tokenizer_from).mergeable_ranks)
    else:
        ranks = train_tokenizer(corpus, cfg.vocab)
    specials = kimi_special_tokens(len(ranks))
    tok = KimiTokenizer(ranks, specials)
    streams = token_streams(tok, corpus, "train")
    log(f"tokenizer: {len(ranks)} ranks; train tokens " + ", ".join(f"{d} {len(s)}" for d, s in streams.items()))

    text = micro_text_config(len(ranks) + len(specials))
    args = ModelArgs.from_config(full_config(text))
    model = build_model(args, cfg.seed, cfg.router_std)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    log(f"model: {n_params} parameters")

    t0 = time.perf_counter()
    memo_text = memorize_text(corpus)
    memo = np.array(tok.encode(memo_text), dtype=np.int32)
    sampler = Sampler(streams, cfg.batch, cfg.seq_len, cfg.seed, memo, cfg.memorize_rate)
    history = train(model, sampler, cfg, log)
    wall = time.perf_counter() - t0
    log(f"trained {cfg.steps} steps in {wall / 60:.1f} min")

    model.eval()
    set_phase(model, sparse=True, qat=False)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.out.name}.", dir=cfg.out.parent))
    try:
        ckpt = build_checkpoint(tmp / "ckpt", text_config=text, model=model, ranks=ranks,
                                extras=False, dtype=mx.bfloat16)
        text_sizes = write_text_assets(ckpt, corpus, cfg.heldout_bytes, cfg.calib_bytes)
        ckpt_bytes = dir_bytes(ckpt)
        results = evaluate(model, ckpt, args, cfg.seq_len, log, cfg.eval_tokens)
        final_ce = float(np.mean([h["ce"] for h in history[-5:]]))
        info = {
            "text_config": json.loads((ckpt / "config.json").read_text())["text_config"],
            "parameters": n_params,
            "checkpoint_bytes": ckpt_bytes,
            "machine": f"{platform.machine()} {os.cpu_count()} cores, MLX {mx.__version__} CPU",
            "tokenizer": {"ranks": len(ranks), "special": len(specials),
                          "from": str(cfg.tokenizer_from) if cfg.tokenizer_from else None},
            "corpus": {"python_version": corpus.python_version, "fingerprint": corpus.fingerprint,
                       "stats": corpus.stats(), "train_tokens": {d: int(len(s)) for d, s in streams.items()},
                       "shipped_text_bytes": text_sizes},
            "training": {"steps": cfg.steps, "batch": cfg.batch, "seq_len": cfg.seq_len,
                         "tokens": cfg.steps * cfg.batch * cfg.seq_len, "lr": cfg.lr,
                         "warmup": cfg.warmup, "weight_decay": cfg.weight_decay, "clip": cfg.clip,
                         "bias_step": cfg.bias_step, "dense_steps": cfg.dense_steps,
                         "domains": list(cfg.domains), "router_std": cfg.router_std,
                         "router_mi": cfg.router_mi,
                         "router_mi_temperature": cfg.router_mi_temperature,
                         "qat_steps": cfg.qat_steps, "seed": cfg.seed, "wall_seconds": wall,
                         "memorize": {"source": MEMORIZE_SOURCE + " (training-split blocks)",
                                      "tokens": int(len(memo)), "rate": cfg.memorize_rate,
                                      "exposures": cfg.steps * cfg.batch / len(DOMAINS)
                                      * cfg.memorize_rate * cfg.seq_len / len(memo)},
                         "final_ce": final_ce, "history": history},
            "eval": results,
        }
        info["total_seconds"] = time.perf_counter() - t_start
        total = publish_checkpoint(ckpt, cfg.out, info, card(info), cfg.max_mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log(f"wrote {cfg.out} ({total / 1e6:.2f} MB) in {(time.perf_counter() - t_start) / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
