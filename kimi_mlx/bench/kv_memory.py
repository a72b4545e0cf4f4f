"""`make bench-kv` (memory and speed): the 8-bit DSA caches (`--kv-bits 8`) against the
model-dtype (BF16) cache, in one run:

- cache bytes per token at K3.1's shapes (24 Gated DSA layers x latent 512, rope 64,
  index key 128), counted from caches filled with real arrays (target <= 0.56x BF16);
- at 4k and 16k tokens of context, on a mid-size random K3.1 whose DSA layers have
  K3.1's cache shapes (`kimi_mlx.bench.model.bench_text_config` with latent 512, rope 64,
  index key 128, index_topk 512; BF16 weights and activations, MXFP4 experts), each
  format measured in the same process: the context filled with random cache entries up
  to its last prefill chunk (`fill_dsa`; a real prefill of 16k tokens takes hours on a
  busy 2-core CPU), that chunk (512 tokens, `--chunk`) a real prefill, and its peak; the
  peak of a decode step (the cache plus what a step allocates; weights left out of both);
  at the longest context, decode tokens/s. The 8-bit cache is also decoded the way it
  was read before the Gated DSA layer read it packed
  (`kimi_mlx.testing.dsa_reference.dequantize_everything`: the whole cache dequantized
  every step), the "8-bit, whole" column;
- mlx-lm's own `--kv-bits 8` (`generate_step(kv_bits=8)`) on its `kimi_k3` with the same
  weights: whether it runs, and its peak where it does.

index_topk is 512 here (K3.1's is 2048): the cache, the decode step's read of every index
key and the selected rows' dequantization do not depend on it beyond the 512 vs 2048
rows a step gathers, and the prefill's per-query gather is 4x cheaper, which keeps the
16k rows to minutes on a busy 2-core CPU. On a machine without a GPU the speeds are the
reference ops' (metal/dsa.py), not the Metal kernels'.
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence

import mlx.core as mx

K31_DSA_LAYERS, K31_LATENT, K31_ROPE, K31_INDEX = 24, 512, 64, 128


def bytes_per_token(kv_bits: Optional[int], group: int = 64, tokens: int = 256,
                    dtype=mx.bfloat16) -> float:
    """Bytes one token takes in one K3.1 DSA layer's cache of this format, counted from
    the arrays a cache holds after `tokens` tokens (snapshot arrays: exactly `tokens`)."""
    from kimi_mlx.model.cache import DSACache, snapshot, snapshot_nbytes

    c = DSACache(kv_bits, group)
    r = mx.random.normal
    c.update_and_fetch_all(r((1, 1, tokens, K31_LATENT)).astype(dtype),
                           r((1, 1, tokens, K31_ROPE)).astype(dtype),
                           r((1, 1, tokens, K31_INDEX)).astype(dtype))
    return snapshot_nbytes(snapshot([c])) / tokens


def kv_bench_config(index_topk: int = 512) -> dict:
    """`bench_text_config` with K3.1's DSA cache shapes (latent 512, rope 64, index key
    128), 4 attention heads and the given index_topk."""
    from kimi_mlx.bench.model import bench_text_config

    cfg = bench_text_config()
    cfg.update(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=4,
               num_key_value_heads=4)
    cfg["dsa_config"] = dict(cfg["dsa_config"], index_head_dim=128, index_topk=index_topk)
    return cfg


def _decode(model, cache, y, steps: int):
    """(peak bytes above the active memory before it, tokens/s) of `steps` greedy steps
    (the peak over the first step alone when steps is 0: then tokens/s is None)."""
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    y = mx.argmax(model(y, cache)[:, -1:], axis=-1)
    mx.eval(y)
    peak = mx.get_peak_memory() - before
    if not steps:
        return peak, None
    t0 = time.perf_counter()
    for _ in range(steps):
        y = mx.argmax(model(y, cache)[:, -1:], axis=-1)
        mx.eval(y)
    return peak, steps / (time.perf_counter() - t0)


def fill_dsa(model, cache, tokens: int, step: int = 2048) -> None:
    """Write `tokens` positions of random Gated DSA cache entries (latent, rope key and
    index key ~ N(0, 1) in the model's activation dtype, as the layer's norms give them)
    into every DSA layer's cache through the cache's own write (`append_all`: an 8-bit
    cache quantizes them), `step` positions at a time, each evaluated before the next;
    the KDA states stay empty."""
    from kimi_mlx.model.cache import DSACache

    dtype = getattr(model, "activation_dtype", None) or mx.bfloat16
    args = model.args
    dims = (args.kv_lora_rank, args.qk_rope_head_dim, args.index_head_dim)
    for i, c in enumerate(c for c in cache if isinstance(c, DSACache)):
        for s0 in range(0, tokens, step):
            m = min(step, tokens - s0)
            keys = mx.random.split(mx.random.key(i * 100003 + s0), 3)
            c.append_all(*(mx.random.normal((1, 1, m, d), key=k).astype(dtype)
                           for d, k in zip(dims, keys)))
            mx.eval([a for a in c.state if isinstance(a, mx.array)])


def peak_and_speed(load: Callable, n: int, decode: int, step: int = 2048,
                   whole: bool = False) -> Dict:
    """One format at n tokens of context, the first n - step of them random cache entries
    (`fill_dsa`) and the last `step` a real prefill of random tokens: `prefill_peak`
    (bytes above the weights and the filled cache while that chunk runs: the chunk that
    sees the longest context is the costliest), `cache_bytes`, `decode_peak` (bytes above the
    weights and the cache while one decode step runs, plus the cache: what decoding at
    this context holds), `decode_tps` over `decode` greedy steps (0: not timed); with
    `whole` the same two decode figures again with the cache dequantized whole every
    step (`dequantize_everything`), as `whole_peak` / `whole_tps`."""
    from kimi_mlx.bench.model import cache_bytes, prefill
    from kimi_mlx.testing.dsa_reference import dequantize_everything

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    model = load()
    mx.eval(model.parameters())
    weights = mx.get_active_memory() - base
    cache = model.make_cache()
    fill_dsa(model, cache, n - step, step)
    gc.collect()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    tokens = mx.random.randint(0, 256, (1, step), key=mx.random.key(n))
    logits = prefill(model, tokens, cache, step)
    y = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(y)
    row = {"prompt": n, "weights": weights, "prefill_peak": mx.get_peak_memory() - before,
           "cache_bytes": cache_bytes(cache)}
    del logits
    peak, tps = _decode(model, cache, y, decode)
    row.update(decode_peak=peak + row["cache_bytes"], decode_tps=tps)
    if whole:
        with dequantize_everything():
            peak, tps = _decode(model, cache, y, decode)
        row.update(whole_peak=peak + cache_bytes(cache), whole_tps=tps)
    del model, cache
    gc.collect()
    mx.clear_cache()
    return row


def mlx_lm_kv8(path: Path, n: int = 64) -> str:
    """Whether mlx-lm's `generate_step(kv_bits=8)` runs on its kimi_k3 with our weights:
    'runs' or 'crashes: <error>'."""
    from mlx_lm.generate import generate_step

    from kimi_mlx.bench.model import load_mlx_lm_k3

    try:
        model = load_mlx_lm_k3(path)
        prompt = mx.random.randint(0, 256, (n,), key=mx.random.key(1))
        for (_, _), _ in zip(generate_step(prompt, model, max_tokens=4, kv_bits=8,
                                           kv_group_size=64, quantized_kv_start=0), range(4)):
            pass
        return "runs"
    except Exception as e:  # noqa: BLE001 - the bench reports what mlx-lm raises
        return f"crashes: {type(e).__name__}: {str(e).splitlines()[0][:160]}"


def _load_line() -> str:
    one, five, _ = os.getloadavg()
    return f"load average {one:.2f} (1 min) {five:.2f} (5 min) on {os.cpu_count()} CPUs"


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="4096,16384", help="prompt lengths (default 4096,16384)")
    p.add_argument("--decode", type=int, default=4, help="decode steps timed at the longest")
    p.add_argument("--chunk", type=int, default=512,
                   help="the real prefill chunk at the end of the context (tokens)")
    p.add_argument("--index-topk", type=int, default=512, help="the bench model's index_topk")
    a = p.parse_args(argv)
    print(f"start: {_load_line()}")
    print("cache bytes per token, K3.1 shapes (one DSA layer; x24 for the model)")
    bf = bytes_per_token(None)
    print(f"  {'BF16':14s} {bf:7.0f} B/layer {bf * K31_DSA_LAYERS:8.0f} B/token  1.000x")
    for g in (32, 64, 128):
        b = bytes_per_token(8, g)
        print(f"  {'8-bit g' + str(g):14s} {b:7.0f} B/layer {b * K31_DSA_LAYERS:8.0f} B/token  "
              f"{b / bf:.3f}x{'  (target <= 0.56x)' if g == 128 else ''}")
    # FP8 as the GPU engines keep DeepSeek-V3.2 (for comparison, not built)
    fp8 = K31_LATENT + 4 * (K31_LATENT // 128) + 2 * K31_ROPE + K31_INDEX + 4
    print(f"  {'(FP8 e4m3)':14s} {fp8:7.0f} B/layer {fp8 * K31_DSA_LAYERS:8.0f} B/token  "
          f"{fp8 / bf:.3f}x  (vLLM/SGLang layout: fp32 scale per 128, BF16 rope)")

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.testing.checkpoints import build_checkpoint

    prompts = [int(x) for x in a.prompts.split(",") if x]
    mb = 1e6
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "ckpt", kv_bench_config(a.index_topk), seed=0)

        def loader(bits):
            def load():
                m = load_model(path, verbose=False, activation_dtype=mx.bfloat16)[0]
                m.set_kv_quant(bits, 64)
                return m
            return load

        print(f"\nmid-size K3.1 with K3.1's cache shapes (2 DSA layers of 8, index_topk "
              f"{a.index_topk}, BF16 activations): the context filled with random cache "
              f"entries, then its last {a.chunk} tokens a real prefill chunk; MB above the "
              "weights. prefill peak = that chunk's allocations above the cache; decode peak "
              "= cache + one step's allocations; '8-bit, whole' = the 8-bit cache "
              "dequantized whole every step (the read before the packed one)")
        print(f"{'prompt':>7s} {'cache MB BF16/8-bit':>20s} {'prefill peak BF16/8-bit':>24s} "
              f"{'decode peak BF16 / 8-bit / 8-bit,whole':>40s}", flush=True)
        last = {}
        for n in prompts:  # each row as soon as it is measured
            steps = a.decode if n == max(prompts) else 0
            r0 = peak_and_speed(loader(None), n, steps, a.chunk)
            r1 = peak_and_speed(loader(8), n, steps, a.chunk, whole=True)
            last = {"bf16": r0, "kv8": r1}
            print(f"{n:7d} {r0['cache_bytes'] / mb:9.1f}/{r1['cache_bytes'] / mb:.1f} "
                  f"({r1['cache_bytes'] / r0['cache_bytes']:.2f}x) "
                  f"{r0['prefill_peak'] / mb:9.1f}/{r1['prefill_peak'] / mb:.1f} "
                  f"({r1['prefill_peak'] / r0['prefill_peak']:.2f}x) "
                  f"{r0['decode_peak'] / mb:9.1f} / {r1['decode_peak'] / mb:.1f} "
                  f"({r1['decode_peak'] / r0['decode_peak']:.2f}x) / "
                  f"{r1['whole_peak'] / mb:.1f} ({r1['whole_peak'] / r0['decode_peak']:.2f}x)",
                  flush=True)
        print(f"weights: {last['bf16']['weights'] / mb:.1f} MB (left out above)")
        r0, r1 = last["bf16"], last["kv8"]
        if r0.get("decode_tps"):
            where = "Metal" if mx.metal.is_available() else "CPU, reference ops"
            print(f"decode at {r0['prompt']} ({a.decode} steps, {where}): BF16 "
                  f"{r0['decode_tps']:.2f} tok/s, 8-bit {r1['decode_tps']:.2f} tok/s "
                  f"({r1['decode_tps'] / r0['decode_tps']:.2f}x), 8-bit whole "
                  f"{r1['whole_tps']:.2f} tok/s ({r1['whole_tps'] / r0['decode_tps']:.2f}x)",
                  flush=True)
        print(f"\nmlx-lm kimi_k3 --kv-bits 8: {mlx_lm_kv8(path)}")
    print(f"end: {_load_line()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
