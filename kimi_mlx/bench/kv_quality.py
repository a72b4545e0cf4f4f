"""`make bench-kv` (quality): the 8-bit DSA caches (`--kv-bits 8`) against the BF16 cache
on the micro checkpoint with its sparse path active (index_topk 64), on held-out text
(kimi_mlx/assets/micro/heldout), in one run.

The baseline: K3.1's cache is BF16; micro computes in float32 on this machine, so every
format here runs the same float32 model with its DSA cache written as K3.1 writes it
(`bf16_cache`): the latent, rope and index values rounded to BF16 when written (the
baseline, "bf16"), and the 8-bit formats quantize those BF16 values with BF16 scales and
biases, as `mx.quantize` does on K3.1's BF16 activations. The comparisons are 8-bit
against that BF16 cache, never against float32.

- perplexity at 1k, 4k and 16k tokens of context (gate: within +1% of BF16): each window
  prefilled in chunks through a cache, so later chunks attend to the stored cache;
- DSA top-k agreement per (query, DSA layer) of a 4k-token chunked prefill (gate: >= 99%
  equal), exact AND outside near-ties: a differing pair is a near-tie when every swapped
  key's BF16 index score is within the 8-bit error bound of the k-th score, the bound
  derived from each key's group scale and bias (`score_bounds`,
  model/cache.py `dequantize_error_bound`). Two ways: "same queries" (the BF16 run's
  queries scored against its keys and against the same keys quantized: the indexer's own
  sensitivity, where the bound is rigorous) and "own run" (each format's whole prefill,
  where later layers' queries drift too, judged by the same key bound);
- greedy continuations of 50 held-out prompts, 64 tokens (gate: >= 90% the same), the
  first difference of the others, and whether the BF16 top-2 logit gap there was below
  the bound: the 99th percentile of how much the 8-bit cache moved the BF16 top-2 gap at
  every position where the two runs had the same prefix (measured, `GAP_QUANTILE`);
- a 4-turn conversation through the one-process server with the prompt cache kept
  between turns (the multi-turn failure mode of FP8 caches elsewhere): both servers get
  the BF16 server's history, so each turn's reply is compared on the same prompt; the
  first differing token and the BF16 top-2 gap there.

Also the format's error on the keys micro writes (affine 8-bit per group size, FP8 e4m3
with a scale per 128 values, affine 4-bit) and the bytes per token of each format for
K3.1 (placement/layer_bytes.py `kv_token_bytes`). Micro's latent is 64 values and its
index key 32, so group 64 and 128 are the same format on micro (one group per vector;
`group_for`); the bench measures such formats once and says so.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

MICRO = Path(__file__).resolve().parents[1] / "assets" / "micro"
CHUNK = 1024  # prefill chunk (tokens)
GAP_QUANTILE = 99  # percentile of the 8-bit cache's top-2 gap moves taken as the bound


@contextlib.contextmanager
def bf16_cache():
    """Within: every DSA cache (one sequence or a batch, here or in an in-process server)
    stores what it is given rounded to BF16 (an 8-bit cache quantizes the BF16 values,
    its scales and biases then BF16) and hands back float32, as a BF16 model's cache
    would round on write while micro computes in float32."""
    from kimi_mlx.model import cache as cache_mod

    real = cache_mod._append_all

    def append(cache, pos, latent, k_pe, k_idx, **kw):
        bf = mx.bfloat16
        out = real(cache, pos, latent.astype(bf), k_pe.astype(bf), k_idx.astype(bf), **kw)
        if out is None:  # an append without fetch (the packed read of an 8-bit cache)
            return None
        return tuple(a.astype(latent.dtype) for a in out)

    cache_mod._append_all = append
    try:
        yield
    finally:
        cache_mod._append_all = real


def heldout_ids(model_dir: Path = MICRO) -> List[int]:
    """The held-out prose then code, tokenized (about 60k tokens)."""
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(model_dir)
    ids: List[int] = []
    for name in ("prose.txt", "code.txt"):
        ids += tok.encode((model_dir / "heldout" / name).read_text())
    return ids


def window_nll(model, ids: Sequence[int], chunk: int = CHUNK):
    """(summed NLL in nats, predicted tokens) of ids[1:] given the previous tokens, the
    window prefilled in chunks through one cache of the model's format."""
    cache = model.make_cache()
    nll, n = 0.0, 0
    x = mx.array(list(ids), dtype=mx.int32)[None]
    for s0 in range(0, x.shape[1] - 1, chunk):
        inp = x[:, s0 : min(s0 + chunk, x.shape[1] - 1)]
        tgt = x[:, s0 + 1 : s0 + 1 + inp.shape[1]]
        logits = model(inp, cache).astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(lp, tgt[..., None], axis=-1)
        mx.eval(picked, [c.state for c in cache])
        nll -= float(np.asarray(picked, dtype=np.float64).sum())
        n += tgt.shape[1]
    return nll, n


def perplexities(model, ids: Sequence[int], contexts: Sequence[int], windows: Dict[int, int],
                 formats) -> List[Dict]:
    """Per context: perplexity of each format over `windows[c]` windows of c+1 tokens."""
    rows = []
    for c in contexts:
        k = max(1, min(windows.get(c, 1), (len(ids) - 1) // (c + 1)))
        row = {"context": c, "windows": k}
        for name, bits, group in formats:
            model.set_kv_quant(bits, group)
            nll = n = 0
            for w in range(k):
                a, b = window_nll(model, ids[w * (c + 1) : (w + 1) * (c + 1)])
                nll, n = nll + a, n + b
            row[name] = math.exp(nll / n)
        rows.append(row)
    model.set_kv_quant(None)
    return rows


def quantize_keys(k: np.ndarray, bits: int, group: int) -> Tuple[np.ndarray, np.ndarray]:
    """(dequantized, per-value error bound) of keys [.., D] (float32, BF16-exact) kept as
    the cache keeps them: BF16 values through `mx.quantize(bits, group_for(D, group))`."""
    from kimi_mlx.model.cache import dequantize, dequantize_error_bound, group_for

    x = mx.array(k).astype(mx.bfloat16)
    q = mx.quantize(x, group_size=group_for(k.shape[-1], group), bits=bits)
    return (np.asarray(dequantize(q, bits).astype(mx.float32)),
            np.asarray(dequantize_error_bound(q, bits)))


def score_bounds(q_idx: np.ndarray, w: np.ndarray, k_idx: np.ndarray,
                 k_err: np.ndarray, offset: int) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scores [L, S] float64, bound [L, S], likely [L, S]) for one sequence's indexer:
    scores I[t, s] = sum_h w[t,h] relu(q[t,h] . k[s]) (-inf past the causal limit) and
    how far a key error of at most k_err [S, D] per value can move them, plus float32
    rounding tol (`index_scores64`):

    - bound (worst case, relu 1-Lipschitz): sum_h |w[t,h]| sum_d |q[t,h,d]| k_err[s,d] + tol;
    - likely (3 sigma, the errors independent and uniform within +-k_err, Higham's
      probabilistic rounding analysis): 3 sum_h |w[t,h]| sqrt(sum_d q[t,h,d]^2
      k_err[s,d]^2 / 3) + tol.

    q_idx [L, Hi, D], w [L, Hi], k_idx [S, D] float32."""
    from kimi_mlx.testing.real_oracles import index_scores64

    scores, tol = index_scores64(q_idx[None], w[None], k_idx[None], offset)
    q = q_idx.astype(np.float64)
    e = k_err.astype(np.float64)
    L, Hi, D = q.shape
    aw = np.abs(w.astype(np.float64))[..., None]
    worst = (np.abs(q).reshape(L * Hi, D) @ e.T).reshape(L, Hi, -1)
    var = ((q * q).reshape(L * Hi, D) @ (e * e / 3.0).T).reshape(L, Hi, -1)
    return (scores[0], (aw * worst).sum(1) + tol[0],
            3.0 * (aw * np.sqrt(var)).sum(1) + tol[0])


def classify_topk(ref: np.ndarray, got: np.ndarray, scores: np.ndarray,
                  bound: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """(equal [L], near_tie [L]) for selected sets ref / got [L, k] (any order) of rows
    whose reference scores are `scores` [L, S] with per-key bounds `bound` [L, S].

    A differing row is a near-tie when every swapped key j (in one set, not the other)
    has |I[j] - I_k| <= bound[j] + max(bound over the swapped keys and the k-th), I_k the
    k-th largest reference score: a key a dropped for a key b needs I[a] - I[b] <=
    bound[a] + bound[b], and I_k lies between them."""
    L = ref.shape[0]
    equal = np.zeros(L, bool)
    tie = np.zeros(L, bool)
    for t in range(L):
        diff = np.setxor1d(ref[t], got[t])
        if not len(diff):
            equal[t] = True
            continue
        row = scores[t]
        kth_pos = ref[t][np.argmin(row[ref[t]])]
        kth = row[kth_pos]
        worst = max(bound[t, diff].max(), bound[t, kth_pos])
        tie[t] = bool(np.all(np.abs(row[diff] - kth) <= bound[t, diff] + worst))
    return equal, tie


def topk_agreement(model, ids: Sequence[int], context: int, formats,
                   index_only: Sequence[Tuple[str, int, int]] = ()) -> Dict[str, Dict]:
    """DSA top-k agreement with the BF16 cache over a `context`-token chunked prefill,
    per (query past index_topk, DSA layer) pair.

    formats: [(name, bits, group)], the first the BF16 baseline (bits None). For each
    8-bit one: "same queries" (the baseline run's queries against its keys quantized
    like that format's index keys) and "own run" (the format's own prefill); index_only:
    further [(name, bits, group)] index-key formats measured the "same queries" way only
    (4-bit). Returns {name: {"same_q": {...}, "own": {...}}} with pairs, exact-equal
    share, near-tie shares by the worst-case and the 3-sigma bound (`score_bounds`,
    `classify_topk`), mean overlap."""
    from kimi_mlx.model import dsa as dsa_mod

    topk = model.args.index_topk
    real = dsa_mod.dsa_prefill_indices
    quant = [(n, b, g) for n, b, g in formats[1:]] + list(index_only)
    calls: Dict[str, List] = {}
    same_q: Dict[str, List] = {n: [] for n, _, _ in quant}

    for name, bits, group in formats:
        got: List = []

        def record(q_idx, w, k_idx, k, offset, starts=None, base=(name == formats[0][0])):
            idx = real(q_idx, w, k_idx, k, offset, starts=starts)
            pos = offset + np.arange(idx.shape[1])
            keep = pos >= topk  # earlier queries select every key they may see
            if keep.any():
                sel = np.asarray(idx[0])[keep]
                if not base:
                    got.append(sel)
                    return idx
                qn, wn = np.asarray(q_idx[0])[keep], np.asarray(w[0])[keep]
                kn = np.asarray(k_idx[0])
                off = int(pos[keep][0])
                got.append((sel, qn, wn, kn, off))
                for qname, qb, qg in quant:
                    kq, err = quantize_keys(kn, qb, qg)
                    alt = np.asarray(real(q_idx, w, mx.array(kq)[None], k, offset,
                                          starts=starts)[0])[keep]
                    same_q[qname].append((sel, alt, *score_bounds(qn, wn, kn, err, off)))
            return idx

        dsa_mod.dsa_prefill_indices = record
        try:
            model.set_kv_quant(bits, group)
            window_nll(model, ids[: context + 1])
        finally:
            dsa_mod.dsa_prefill_indices = real
        calls[name] = got
    model.set_kv_quant(None)

    def summary(rows):
        eq = np.concatenate([r[0] for r in rows])
        tie = np.concatenate([r[1] for r in rows])
        likely = np.concatenate([r[2] for r in rows])
        ov = np.concatenate([r[3] for r in rows])
        return {"pairs": int(eq.size), "equal": float(eq.mean()), "tie": float(tie.mean()),
                "likely_tie": float(likely.mean()), "overlap": float(ov.mean())}

    def judge(sel, alt, sc, bd, likely):
        eq, tie = classify_topk(sel, alt, sc, bd)
        _, ltie = classify_topk(sel, alt, sc, likely)
        ov = np.array([len(np.intersect1d(a, b)) / a.shape[0] for a, b in zip(sel, alt)])
        # how crowded the boundary is: the k-th minus the (k+1)-th score, against the
        # bounds at the k-th key
        rows = np.arange(sc.shape[0])
        order = np.argsort(-np.where(np.isfinite(sc), sc, -np.inf), axis=1)
        kth, nxt = order[:, topk - 1], order[:, topk]
        gaps.append(np.stack([sc[rows, kth] - sc[rows, nxt], bd[rows, kth], likely[rows, kth]]))
        return eq, tie, ltie, ov

    out: Dict[str, Dict] = {}
    for qname, qb, qg in quant:
        gaps: List[np.ndarray] = []
        out[qname] = {"same_q": summary([judge(*r) for r in same_q[qname]])}
        g = np.concatenate(gaps, axis=1)
        out[qname]["same_q"]["boundary"] = tuple(float(np.median(v)) for v in g)
    base = calls[formats[0][0]]
    for name, bits, group in formats[1:]:
        gaps = []
        rows = []
        for (sel, qn, wn, kn, off), alt in zip(base, calls[name]):
            _, err = quantize_keys(kn, bits, group)
            rows.append(judge(sel, alt, *score_bounds(qn, wn, kn, err, off)))
        out[name]["own"] = summary(rows)
    return out


def greedy_run(model, prompt: Sequence[int], n: int, watch: Optional[Sequence] = None):
    """Greedy tokens of `prompt`, n of them, and per step the log-probabilities of the
    top two tokens (or of the `watch` [(a, b)] token pairs per step, as far as given)."""
    from mlx_lm.generate import generate_step

    toks, pairs = [], []
    for i, ((t, lp), _) in enumerate(zip(generate_step(mx.array(list(prompt)), model,
                                                       max_tokens=n), range(n))):
        toks.append(int(t))
        if watch is not None:
            if i < len(watch):
                a, b = watch[i]
                pairs.append((a, b, float(lp[a]), float(lp[b])))
        else:
            top = np.argpartition(-np.asarray(lp.astype(mx.float32)), 2)[:2]
            a, b = sorted(top.tolist(), key=lambda j: -float(lp[j]))
            pairs.append((a, b, float(lp[a]), float(lp[b])))
    return toks, pairs


def continuations(model, ids: Sequence[int], prompts: int, length: int, tokens: int,
                  formats) -> Dict[str, Dict]:
    """Greedy continuations of `prompts` held-out windows of `length` tokens (spread over
    the text), `tokens` each, per 8-bit format against the first (BF16) format: prompts
    the same, and for the others the first differing step, the BF16 top-2 gap there
    (nats) and whether it was below the bound (the GAP_QUANTILE percentile of how much
    the format moved the BF16 top-2 gap at the steps where both had the same prefix)."""
    step = max(1, (len(ids) - length) // prompts)
    windows = [ids[i * step : i * step + length] for i in range(prompts)]
    name0, bits0, group0 = formats[0]
    model.set_kv_quant(bits0, group0)
    ref = [greedy_run(model, w, tokens) for w in windows]
    out = {}
    for name, bits, group in formats[1:]:
        model.set_kv_quant(bits, group)
        moves, firsts = [], []
        for w, (rt, rp) in zip(windows, ref):
            gt, gp = greedy_run(model, w, tokens, [(a, b) for a, b, _, _ in rp])
            d = next((i for i, (x, y) in enumerate(zip(gt, rt)) if x != y), None)
            upto = len(gp) if d is None else d
            moves += [abs((la - lb) - (ra - rb)) for (_, _, la, lb), (_, _, ra, rb)
                      in zip(gp[:upto], rp[:upto])]
            if d is not None:
                gap = rp[d][2] - rp[d][3]
                firsts.append((d, gap, abs((gp[d][2] - gp[d][3]) - gap)))
        bound = float(np.percentile(moves, GAP_QUANTILE)) if moves else 0.0
        out[name] = {"prompts": prompts, "same": prompts - len(firsts), "bound": bound,
                     "max_move": float(max(moves or [0.0])),
                     "first_diff": [(d, g, m, g <= bound) for d, g, m in sorted(firsts)]}
    model.set_kv_quant(None)
    return out


TURNS = [
    "Explain what the Python Software Foundation License allows.",
    "Who is allowed to copy and distribute the software, and under which conditions?",
    "Now write a short Python function that counts the words in a text file.",
    "Summarise our whole conversation in two sentences.",
]


def _chat(url: str, msgs, max_tokens: int):
    import httpx

    r = httpx.post(f"{url}/v1/chat/completions", timeout=600, json={
        "model": "micro", "messages": msgs, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": True, "top_logprobs": 2})
    r.raise_for_status()
    ch = r.json()["choices"][0]
    m = ch["message"]
    toks = [(t["token"], [(x["token"], x["logprob"]) for x in t["top_logprobs"]])
            for t in (ch.get("logprobs") or {}).get("content") or []]
    return m, toks


def server_turns(formats, turns: Sequence[str] = TURNS, max_tokens: int = 64):
    """A greedy 4-turn chat through the one-process server on micro per format, the
    prompt cache kept between turns; the first format's (BF16) replies make the history
    every server sees, so each turn is compared on the same prompt. Returns {name:
    {"turns": [None (same) or (first differing token, BF16 top-2 gap there)], "hits"}}."""
    from kimi_mlx.testing.servers import served

    name0, bits0, group0 = formats[0]
    with served(str(MICRO), kv=(bits0, group0), prompt_cache_bytes=256 << 20) as (srv, svc):
        msgs, ref = [], []
        for text in turns:
            msgs.append({"role": "user", "content": text})
            m, toks = _chat(srv.url, msgs, max_tokens)
            msgs.append({"role": "assistant", "content": m.get("content") or
                         (m.get("reasoning_content") or "")})
            ref.append((list(msgs[:-1]), toks))
        hits0 = svc.engine.prompt_cache.hits
    out = {name0: {"hits": hits0}}
    for name, bits, group in formats[1:]:
        with served(str(MICRO), kv=(bits, group), prompt_cache_bytes=256 << 20) as (srv, svc):
            res = []
            for prompt, rtoks in ref:
                _, toks = _chat(srv.url, prompt, max_tokens)
                d = next((i for i, (a, b) in enumerate(zip(toks, rtoks)) if a[0] != b[0]),
                         None if len(toks) == len(rtoks) else min(len(toks), len(rtoks)))
                if d is None or d >= len(rtoks):
                    res.append(None if d is None else (d, None))
                else:
                    tl = rtoks[d][1]
                    res.append((d, tl[0][1] - tl[1][1] if len(tl) > 1 else None))
            out[name] = {"turns": res, "hits": svc.engine.prompt_cache.hits}
    return out


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to FP8 e4m3fn (OCP: 3 mantissa bits, exponents -6..8, subnormals down to
    2^-9, largest 448), ties to even, saturating at +-448."""
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))
    step = 2.0 ** (e - 3)
    return (np.sign(x) * np.minimum(np.round(a / step) * step, 448.0)).astype(np.float32)


def format_errors(model, ids: Sequence[int], n: int = 2048) -> Dict[str, Dict]:
    """Error of the keys micro's DSA layers write for `n` held-out tokens (rounded to
    BF16, as the cache stores them), relative to their RMS: MLX affine 8-bit per group
    size and 4-bit (BF16 scales), and FP8 e4m3 with one scale per 128 values (max |x| /
    448, as vLLM / SGLang keep DeepSeek-V3.2's latent), emulated in NumPy (`e4m3`)."""
    from kimi_mlx.model.cache import DSACache

    model.set_kv_quant(None)
    cache = model.make_cache()
    model(mx.array(list(ids[:n]))[None], cache)
    keys = {"latent": [], "index": []}
    for c in cache:
        if isinstance(c, DSACache):
            keys["latent"].append(np.asarray(c.keys[..., : c.offset, :].astype(mx.float32)))
            keys["index"].append(np.asarray(c.index_keys[..., : c.offset, :].astype(mx.float32)))
    out: Dict[str, Dict] = {}
    for part, arrs in keys.items():
        x = np.concatenate([a.reshape(-1, a.shape[-1]) for a in arrs])
        x = np.asarray(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
        rms = float(np.sqrt((x ** 2).mean()))
        res = {}
        for bits, g in ((8, 32), (8, 64), (8, 128), (4, 32)):
            y, _ = quantize_keys(x, bits, g)
            res[f"affine{bits} g{g}"] = (np.abs(y - x).mean() / rms, np.abs(y - x).max() / rms)
        b = min(128, x.shape[-1])
        xb = x.reshape(x.shape[0], -1, b)
        scale = np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-12) / 448.0
        y = (e4m3(xb / scale) * scale).reshape(x.shape)
        res["fp8 e4m3 /128"] = (np.abs(y - x).mean() / rms, np.abs(y - x).max() / rms)
        out[part] = res
    return out


def token_bytes_k31(bits: Optional[int], group: int, index_bits: Optional[int] = None) -> int:
    """Cache bytes per token per Gated DSA layer of K3.1 (512 latent, 64 rope, 128 index
    values, BF16 otherwise) in a format; index_bits: the index key's own width (None:
    as the latent, 16: BF16, 4: affine 4-bit with BF16 scales and biases)."""
    from kimi_mlx.placement.layer_bytes import kv_token_bytes

    ib = bits if index_bits is None else index_bits
    lat = kv_token_bytes(512, 2, bits, group)
    if ib == 16:  # BF16 index keys
        idx = 128 * 2
    elif ib in (None, 8):
        idx = kv_token_bytes(128, 2, ib, group)
    else:  # 4-bit index keys (not a --kv-bits option): packed + a scale and bias per group
        idx = 128 * ib // 8 + 2 * (128 // group) * 2
    return lat + 64 * 2 + idx


def distinct_formats(model, groups: Sequence[int]) -> List[Tuple[str, int, int, List[int]]]:
    """8-bit formats that differ on this model: [(name, 8, group, same-as groups)] (a
    group larger than a vector is the whole vector: `group_for`)."""
    from kimi_mlx.model.cache import group_for

    a = model.args
    seen: Dict[Tuple[int, int], List[int]] = {}
    for g in groups:
        seen.setdefault((group_for(a.kv_lora_rank, g), group_for(a.index_head_dim, g)), []).append(g)
    return [(f"8-bit g{gs[0]}", 8, gs[0], gs) for gs in seen.values()]


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096,16384",
                   help="perplexity contexts in tokens (default 1024,4096,16384)")
    p.add_argument("--prompts", type=int, default=50, help="greedy prompts (default 50)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens (default 64)")
    p.add_argument("--group-sizes", default="32,64,128",
                   help="8-bit group sizes to measure (default 32,64,128)")
    p.add_argument("--topk-context", type=int, default=4096,
                   help="tokens of the top-k prefill (default 4096)")
    p.add_argument("--parts", default="format,topk,greedy,server,ppl",
                   help="which measurements (default all: format,topk,greedy,server,ppl)")
    a = p.parse_args(argv)
    parts = set(a.parts.split(","))
    from kimi_mlx.checkpoint.loader import load_model

    model, _, _ = load_model(MICRO, verbose=False)
    ids = heldout_ids()
    groups = [int(g) for g in a.group_sizes.split(",") if g]
    quant = distinct_formats(model, groups)
    formats = [("bf16", None, 64)] + [(n, b, g) for n, b, g, _ in quant]
    print(f"micro ({model.args.num_hidden_layers} layers, index_topk {model.args.index_topk}, "
          f"latent {model.args.kv_lora_rank}, index key {model.args.index_head_dim}), "
          f"{len(ids)} held-out tokens; float32 model, cache written in BF16 (the baseline "
          f"'bf16'); load average {os.getloadavg()[0]:.2f}")
    for n, _, g, gs in quant:
        if len(gs) > 1:
            print(f"  {n} stands for groups {', '.join(map(str, gs))}: the same format on micro")
    print("\nK3.1 cache bytes per token per DSA layer (BF16 1408; target <= 0.56x = 788):")
    for label, args in [("8-bit g32", (8, 32)), ("8-bit g64", (8, 64)), ("8-bit g128", (8, 128)),
                        ("8-bit latent g128, BF16 index", (8, 128, 16)),
                        ("8-bit latent g64, 4-bit index g64", (8, 64, 4)),
                        ("8-bit latent g32, 4-bit index g32", (8, 32, 4))]:
        b = token_bytes_k31(*args)
        print(f"  {label:36s} {b:5d} B  {b / 1408:.3f}x")
    t0 = time.time()

    with bf16_cache():
        if "format" in parts:
            errs = format_errors(model, ids)
            print("\nformat: error of the keys micro writes (BF16), mean / max, relative to "
                  "their RMS")
            for part, res in errs.items():
                print(f"  {part:7s} " + "   ".join(f"{k}: {m:.4f} / {x:.3f}"
                                                  for k, (m, x) in res.items()), flush=True)

        if "topk" in parts:
            idx_g = formats[1][2]
            agree = topk_agreement(model, ids, a.topk_context, formats,
                                   index_only=[(f"4-bit index g{idx_g}", 4, idx_g)])
            print(f"\nDSA top-k ({model.args.index_topk}) sets against the BF16 cache's, per "
                  f"(query, DSA layer) of a {a.topk_context}-token prefill (gate: >= 99% equal); near-tie: every "
                  "swapped key within the 8-bit bound of the k-th score", flush=True)
            for name, r in agree.items():
                for how, label in (("same_q", "same queries"), ("own", "own run")):
                    if how in r:
                        x = r[how]
                        print(f"  {name} ({label}): {x['equal'] * 100:.2f}% of {x['pairs']} "
                              f"equal; equal outside near-ties {(x['equal'] + x['tie']) * 100:.2f}%"
                              f" (worst-case bound), {(x['equal'] + x['likely_tie']) * 100:.2f}%"
                              f" (3-sigma bound); mean overlap {x['overlap'] * 100:.2f}%",
                              flush=True)
                        if "boundary" in x:
                            print("      medians: k-th minus (k+1)-th BF16 score {:.4f}, bound "
                                  "{:.4f}, 3-sigma bound {:.4f}".format(*x["boundary"]))

        if "greedy" in parts:
            cont = continuations(model, ids, a.prompts, 128, a.tokens, formats)
            print(f"\ngreedy continuations, {a.prompts} held-out prompts x {a.tokens} tokens "
                  "(gate: >= 90% the same as BF16)")
            for name, r in cont.items():
                ties = sum(1 for *_, below in r["first_diff"] if below)
                print(f"  {name}: {r['same']}/{r['prompts']} the same "
                      f"({r['same'] / r['prompts'] * 100:.0f}%); bound (p{GAP_QUANTILE} of the "
                      f"top-2 gap moves) {r['bound']:.4f} nats (max {r['max_move']:.4f}); "
                      f"{ties}/{len(r['first_diff'])} differences at a BF16 gap below it, "
                      f"{r['same'] + ties}/{r['prompts']} the same outside near-ties",
                      flush=True)
                for d, g, m, below in r["first_diff"]:
                    print(f"     first difference at token {d}: BF16 top-2 gap {g:.4f}, "
                          f"moved {m:.4f}{' (below bound)' if below else ''}")

        if "server" in parts:
            print("\n4-turn conversation through the server, prompt cache kept between turns, "
                  "64 tokens a turn, every server given the BF16 server's history")
            res = server_turns(formats)
            for name, bits, group in formats[1:]:
                r = res[name]
                cells = []
                for i, t in enumerate(r["turns"]):
                    if t is None:
                        cells.append(f"turn {i + 1} same")
                    else:
                        gap = "" if t[1] is None else f" (BF16 top-2 gap {t[1]:.4f})"
                        cells.append(f"turn {i + 1} differs at token {t[0]}{gap}")
                print(f"  {name}: " + ", ".join(cells) + f" (cache hits {r['hits']}; BF16 "
                      f"server {res[formats[0][0]]['hits']})", flush=True)

        if "ppl" in parts:
            contexts = [int(c) for c in a.contexts.split(",") if c]
            print("\nperplexity (chunked prefill through the cache; gate: <= +1% of BF16)")
            print(f"{'context':>8s} {'windows':>8s} " + " ".join(f"{n:>18s}" for n, _, _ in formats))
            for c in contexts:
                r = perplexities(model, ids, [c], {1024: 4, 4096: 2, 16384: 1}, formats)[0]
                cells = [f"{r[formats[0][0]]:18.4f}"] + [
                    f"{r[n]:9.4f} ({(r[n] / r[formats[0][0]] - 1) * 100:+.3f}%)"
                    for n, _, _ in formats[1:]]
                print(f"{r['context']:8d} {r['windows']:8d} " + " ".join(cells), flush=True)
    print(f"\n({time.time() - t0:.0f} s; load average {os.getloadavg()[0]:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
