"""`make bench-kv` (memory and speed): the 8-bit DSA caches (`--kv-bits 8`) against the
model-dtype (BF16) cache, in one run:

- cache bytes per token at K3.1's shapes (24 Gated DSA layers x latent 512, rope 64,
  index key 128), counted from caches filled with real arrays (target <= 0.56x BF16);
- peak memory of a chunked prefill plus one decode step at 4k and 16k tokens, and decode
  tokens/s at 16k, on a mid-size random K3.1 whose DSA layers have K3.1's cache shapes
  (`kimi_mlx.bench.model.bench_text_config` with latent 512, rope 64, index key 128;
  BF16 weights, MXFP4 experts), each format measured in the same process;
- mlx-lm's own `--kv-bits 8` (`generate_step(kv_bits=8)`) on its `kimi_k3` with the same
  weights: whether it runs, and its peak where it does.

On a machine without a GPU the decode speed is that of the reference path, which
dequantizes the whole 8-bit cache on every step (the Metal kernels read it packed).
"""

from __future__ import annotations

import argparse
import gc
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


def kv_bench_config() -> dict:
    """`bench_text_config` with K3.1's DSA cache shapes (latent 512, rope 64, index key
    128) and 4 attention heads."""
    from kimi_mlx.bench.model import bench_text_config

    cfg = bench_text_config()
    cfg.update(kv_lora_rank=512, qk_rope_head_dim=64, num_attention_heads=4,
               num_key_value_heads=4)
    cfg["dsa_config"] = dict(cfg["dsa_config"], index_head_dim=128)
    return cfg


def peak_and_speed(load: Callable, n: int, decode: int, step: int = 2048) -> Dict:
    """Peak bytes (weights included) of a chunked prefill of n random tokens plus one
    decode step; cache bytes; then decode tokens/s over `decode` greedy steps."""
    from kimi_mlx.bench.model import cache_bytes, prefill

    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load()
    tokens = mx.random.randint(0, 256, (1, n), key=mx.random.key(n))
    cache = model.make_cache()
    logits = prefill(model, tokens, cache, step)
    y = mx.argmax(logits[:, -1:], axis=-1)
    y = mx.argmax(model(y, cache)[:, -1:], axis=-1)
    mx.eval(y)
    peak = mx.get_peak_memory() - base
    row = {"prompt": n, "peak_bytes": peak, "cache_bytes": cache_bytes(cache)}
    if decode:
        t0 = time.perf_counter()
        for _ in range(decode):
            y = mx.argmax(model(y, cache)[:, -1:], axis=-1)
            mx.eval(y)
        row["decode_tps"] = decode / (time.perf_counter() - t0)
    del model, cache, logits
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


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompts", default="4096,16384", help="prompt lengths (default 4096,16384)")
    p.add_argument("--decode", type=int, default=16, help="decode steps timed at the longest")
    a = p.parse_args(argv)
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
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "ckpt", kv_bench_config(), seed=0)

        def loader(bits):
            def load():
                m = load_model(path, verbose=False)[0]
                m.set_kv_quant(bits, 64)
                return m
            return load

        print(f"\nmid-size K3.1 with K3.1's cache shapes ({path.name}; 2 DSA layers), chunked "
              "prefill (2048) + 1 decode step; weights included")
        print(f"{'prompt':>7s} {'BF16 peak MB':>13s} {'8-bit peak MB':>14s} {'ratio':>6s} "
              f"{'BF16 cache MB':>14s} {'8-bit cache MB':>15s}", flush=True)
        for n in prompts:  # each row as soon as it is measured
            r0, r1 = (peak_and_speed(loader(bits), n, a.decode if n == max(prompts) else 0)
                      for bits in (None, 8))
            print(f"{n:7d} {r0['peak_bytes'] / 1e6:13.1f} {r1['peak_bytes'] / 1e6:14.1f} "
                  f"{r1['peak_bytes'] / r0['peak_bytes']:5.3f}x {r0['cache_bytes'] / 1e6:14.1f} "
                  f"{r1['cache_bytes'] / 1e6:15.1f}", flush=True)
        if "decode_tps" in r0:
            print(f"decode at {r0['prompt']}: BF16 {r0['decode_tps']:.2f} tok/s, 8-bit "
                  f"{r1['decode_tps']:.2f} tok/s ({r1['decode_tps'] / r0['decode_tps']:.2f}x; "
                  f"{'reference path' if not mx.metal.is_available() else 'Metal'})", flush=True)
        print(f"\nmlx-lm kimi_k3 --kv-bits 8: {mlx_lm_kv8(path)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
