"""`make bench-kv` (quality): the 8-bit DSA caches (`--kv-bits 8`) against the model-dtype
cache on the micro checkpoint with its sparse path active (index_topk 64), on held-out
text (kimi_mlx/assets/micro/heldout), in one run:

- perplexity at 1k, 4k and 16k tokens of context (gate: within +1% of the model-dtype
  cache): each window is prefilled in chunks through a cache, so the 8-bit cache is what
  later chunks attend to, exactly as a long conversation reads it;
- DSA top-k agreement: per (query, DSA layer) of a 4k-token prefill, whether the 64 keys
  the indexer selects are the same set (gate: >= 99%), plus the mean overlap;
- greedy continuations of 50 held-out prompts, 64 tokens each (gate: the same tokens in
  >= 90% of prompts), and where the first difference comes in the others;
- a 4-turn conversation through the one-process server with the prompt cache kept
  between turns (each turn restored from the previous turns' snapshots: the multi-turn
  failure mode of FP8 caches elsewhere), each turn's reply against the model-dtype
  server's.

Also the format choice: the mean and max error of the latent and index keys written by
MLX affine 8-bit (a scale and bias per group) and by FP8 e4m3 with one scale per 128
values (the GPU engines' format, emulated in NumPy), on the keys micro really writes.
Micro is float32, so the model-dtype figures are float32 ones.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

MICRO = Path(__file__).resolve().parents[1] / "assets" / "micro"
CHUNK = 1024  # prefill chunk (tokens)


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


def topk_agreement(model, ids: Sequence[int], context: int, formats) -> Dict[str, Dict]:
    """Share of (query, DSA layer) pairs whose selected key set equals the first
    format's, over a `context`-token chunked prefill (queries past index_topk only), and
    the mean overlap of the sets."""
    from kimi_mlx.model import dsa as dsa_mod

    topk = model.args.index_topk
    real = dsa_mod.dsa_prefill_indices
    picks: Dict[str, List[np.ndarray]] = {}
    for name, bits, group in formats:
        got: List[np.ndarray] = []

        def record(q_idx, w, k_idx, k, offset, starts=None):
            idx = real(q_idx, w, k_idx, k, offset, starts=starts)
            pos = offset + np.arange(idx.shape[1])
            keep = pos >= topk  # earlier queries select every key they may see
            if keep.any():
                got.append(np.sort(np.asarray(idx[0]), axis=-1)[keep])
            return idx

        dsa_mod.dsa_prefill_indices = record
        try:
            model.set_kv_quant(bits, group)
            window_nll(model, ids[: context + 1])
        finally:
            dsa_mod.dsa_prefill_indices = real
        picks[name] = got
    model.set_kv_quant(None)
    ref_name = formats[0][0]
    ref = np.concatenate(picks[ref_name])
    out = {}
    for name, _, _ in formats[1:]:
        mine = np.concatenate(picks[name])
        same = (mine == ref).all(axis=-1)
        overlap = np.mean([len(np.intersect1d(a, b)) / a.shape[0] for a, b in zip(mine, ref)])
        out[name] = {"pairs": int(same.size), "equal": float(same.mean()),
                     "overlap": float(overlap)}
    return out


def greedy_tokens(model, prompt: Sequence[int], n: int) -> List[int]:
    from mlx_lm.generate import generate_step

    return [int(t) for (t, _), _ in zip(generate_step(mx.array(list(prompt)), model,
                                                      max_tokens=n), range(n))]


def continuations(model, ids: Sequence[int], prompts: int, length: int, tokens: int,
                  formats) -> Dict[str, Dict]:
    """Greedy continuations of `prompts` held-out windows of `length` tokens (spread over
    the text), `tokens` each: per format, the prompts whose tokens equal the first
    format's and the first differing positions of the others."""
    step = max(1, (len(ids) - length) // prompts)
    windows = [ids[i * step : i * step + length] for i in range(prompts)]
    runs = {}
    for name, bits, group in formats:
        model.set_kv_quant(bits, group)
        runs[name] = [greedy_tokens(model, w, tokens) for w in windows]
    model.set_kv_quant(None)
    ref = runs[formats[0][0]]
    out = {}
    for name, _, _ in formats[1:]:
        firsts = []
        for a, b in zip(runs[name], ref):
            if a != b:
                firsts.append(next(i for i, (x, y) in enumerate(zip(a, b)) if x != y))
        out[name] = {"prompts": prompts, "same": prompts - len(firsts), "first_diff": firsts}
    return out


TURNS = [
    "Explain what the Python Software Foundation License allows.",
    "Who is allowed to copy and distribute the software, and under which conditions?",
    "Now write a short Python function that counts the words in a text file.",
    "Summarise our whole conversation in two sentences.",
]


def server_turns(kv, turns: Sequence[str] = TURNS, max_tokens: int = 64) -> List[str]:
    """Replies (reasoning then content) of a greedy 4-turn chat through the one-process
    server on micro with cache format `kv`, the prompt cache kept between turns."""
    import httpx

    from kimi_mlx.testing.servers import served

    with served(str(MICRO), kv=kv, prompt_cache_bytes=256 << 20) as (srv, svc):
        msgs, replies = [], []
        for text in turns:
            msgs.append({"role": "user", "content": text})
            r = httpx.post(f"{srv.url}/v1/chat/completions", timeout=600, json={
                "model": "micro", "messages": msgs, "max_tokens": max_tokens,
                "temperature": 0})
            r.raise_for_status()
            m = r.json()["choices"][0]["message"]
            reply = (m.get("reasoning_content") or "") + (m.get("content") or "")
            msgs.append({"role": "assistant", "content": m.get("content") or reply})
            replies.append(reply)
        hits = svc.engine.prompt_cache.hits
    return replies, hits


def e4m3(x: np.ndarray) -> np.ndarray:
    """Round to FP8 e4m3fn (OCP: 3 mantissa bits, exponents -6..8, subnormals down to
    2^-9, largest 448), ties to even, saturating at +-448."""
    a = np.minimum(np.abs(x).astype(np.float64), 448.0)
    e = np.floor(np.log2(np.maximum(a, 2.0 ** -6)))
    step = 2.0 ** (e - 3)
    return (np.sign(x) * np.minimum(np.round(a / step) * step, 448.0)).astype(np.float32)


def format_errors(model, ids: Sequence[int], n: int = 2048) -> Dict[str, Dict]:
    """Error of the keys micro's DSA layers write for `n` held-out tokens, relative to
    their RMS: MLX affine 8-bit (group 64 and 128) and FP8 e4m3 with one scale per 128
    values (max |x| / 448, as vLLM / SGLang keep DeepSeek-V3.2's latent), emulated in
    NumPy (`e4m3`)."""
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
        rms = float(np.sqrt((x ** 2).mean()))
        res = {}
        for g in (64, 128):
            gg = min(g, x.shape[-1])
            q = mx.quantize(mx.array(x), group_size=gg, bits=8)
            y = np.asarray(mx.dequantize(*q, group_size=gg, bits=8))
            res[f"affine8 g{g}"] = (np.abs(y - x).mean() / rms, np.abs(y - x).max() / rms)
        b = min(128, x.shape[-1])
        xb = x.reshape(x.shape[0], -1, b)
        scale = np.maximum(np.abs(xb).max(-1, keepdims=True), 1e-12) / 448.0
        y = (e4m3(xb / scale) * scale).reshape(x.shape)
        res["fp8 e4m3 /128"] = (np.abs(y - x).mean() / rms, np.abs(y - x).max() / rms)
        out[part] = res
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--contexts", default="1024,4096,16384",
                   help="perplexity contexts in tokens (default 1024,4096,16384)")
    p.add_argument("--prompts", type=int, default=50, help="greedy prompts (default 50)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens (default 64)")
    p.add_argument("--group-sizes", default="64,128",
                   help="8-bit group sizes to measure (default 64,128)")
    p.add_argument("--no-server", action="store_true", help="skip the 4-turn server replay")
    a = p.parse_args(argv)
    from kimi_mlx.checkpoint.loader import load_model

    model, _, _ = load_model(MICRO, verbose=False)
    ids = heldout_ids()
    groups = [int(g) for g in a.group_sizes.split(",") if g]
    formats = [("fp32", None, 64)] + [(f"8-bit g{g}", 8, g) for g in groups]
    print(f"micro ({model.args.num_hidden_layers} layers, index_topk {model.args.index_topk}), "
          f"{len(ids)} held-out tokens; model dtype float32")
    t0 = time.time()

    errs = format_errors(model, ids)
    print("\nformat: error of the keys micro writes, mean / max, relative to their RMS")
    for part, res in errs.items():
        print(f"  {part:7s} " + "   ".join(f"{k}: {m:.4f} / {x:.3f}" for k, (m, x) in res.items()),
              flush=True)

    agree = topk_agreement(model, ids, 4096, formats)
    print("\nDSA top-k (64) sets equal to fp32's, per (query, DSA layer) of a 4k prefill "
          "(gate: >= 99%)", flush=True)
    for name, r in agree.items():
        print(f"  {name}: {r['equal'] * 100:.2f}% of {r['pairs']} pairs equal, mean overlap "
              f"{r['overlap'] * 100:.2f}%", flush=True)

    cont = continuations(model, ids, a.prompts, 128, a.tokens, formats)
    print(f"\ngreedy continuations, {a.prompts} held-out prompts x {a.tokens} tokens "
          "(gate: >= 90% the same)")
    for name, r in cont.items():
        print(f"  {name}: {r['same']}/{r['prompts']} the same "
              f"({r['same'] / r['prompts'] * 100:.0f}%); first difference at "
              f"{sorted(r['first_diff']) or '-'}", flush=True)

    if not a.no_server:
        print("\n4-turn conversation through the server, prompt cache kept between turns, "
              "64 tokens a turn")
        ref, ref_hits = server_turns((None, 64))
        for name, bits, group in formats[1:]:
            got, hits = server_turns((bits, group))
            same = []
            for r, g in zip(ref, got):
                d = next((i for i, (x, y) in enumerate(zip(r, g)) if x != y),
                         None if len(r) == len(g) else min(len(r), len(g)))
                same.append("same" if d is None else f"differs at char {d}")
            print(f"  {name}: " + ", ".join(f"turn {i + 1} {s}" for i, s in enumerate(same))
                  + f" (cache hits {hits}; fp32 server {ref_hits})", flush=True)

    contexts = [int(c) for c in a.contexts.split(",") if c]
    print("\nperplexity (chunked prefill through the cache; gate: <= +1% of fp32)")
    print(f"{'context':>8s} {'windows':>8s} " + " ".join(f"{n:>16s}" for n, _, _ in formats))
    for c in contexts:
        r = perplexities(model, ids, [c], {1024: 4, 4096: 2, 16384: 1}, formats)[0]
        cells = [f"{r[formats[0][0]]:16.4f}"] + [
            f"{r[n]:9.4f} ({(r[n] / r[formats[0][0]] - 1) * 100:+.2f}%)" for n, _, _ in formats[1:]]
        print(f"{r['context']:8d} {r['windows']:8d} " + " ".join(cells), flush=True)
    print(f"\n({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
