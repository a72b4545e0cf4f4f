"""`make bench`: kimi-mlx against mlx-lm's `kimi_k3` on the same weights, in one run.

Both models read the same official-layout checkpoint (a mid-size random config, BF16 with
MXFP4 experts, 32k context). Prompts are prefilled in chunks of `PREFILL_STEP` tokens, as
mlx-lm's `generate_step` (prefill_step_size) does for `mlx_lm.generate` and for our
`generate` and `chat`. Reported against mlx-lm measured in the same process:

- speed: prefill and decode tokens/s at one prompt length (higher is better);
- memory: peak bytes for prompts of 1k, 4k and 16k tokens (lower is better). Past
  `index_topk` (2048) our Gated DSA attends to 2048 selected keys per query while mlx-lm's
  K3 attends densely, so the outputs differ there; the memory targets are: at 4k our peak
  <= mlx-lm's, and from 4k to 16k ours grows by at most the cache the extra tokens add
  (+10%): peak = weights + cache + a term set by the prefill chunk, not by the prompt.
"""

from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Sequence

import mlx.core as mx
import mlx.nn as nn

from kimi_mlx.testing.checkpoints import build_checkpoint, tiny_text_config


PREFILL_STEP = 2048  # mlx-lm generate_step's prefill_step_size default
MEMORY_PROMPTS = (1024, 4096, 16384)


def bench_text_config() -> dict:
    """A mid-size K3.1 config: 8 layers (2 Gated DSA), hidden 1024, 32 experts top-4,
    index_topk 2048, 32k context."""
    return tiny_text_config(
        max_position_embeddings=32768,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=2048,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        num_experts=32,
        num_experts_per_token=4,
        moe_intermediate_size=256,
        routed_expert_hidden_size=512,
        attn_res_block_size=4,
        vocab_size=4096,
        linear_attn_config={
            "num_heads": 8,
            "head_dim": 64,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
            "gate_lower_bound": -5.0,
            "full_attn_layers": [4, 8],
            "kda_layers": [1, 2, 3, 5, 6, 7],
        },
        dsa_config={"index_n_heads": 4, "index_head_dim": 64, "index_topk": 2048},
    )


def load_mlx_lm_k3(path: Path):
    """mlx-lm's kimi_k3 from our checkpoint (indexer tensors dropped: K3 has none)."""
    import json

    from mlx_lm.models import kimi_k3

    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "kimi_k3"
    model = kimi_k3.Model(kimi_k3.ModelArgs.from_dict(copy.deepcopy(cfg)))
    weights = {}
    for f in sorted(path.glob("model-*.safetensors")):
        weights.update(mx.load(str(f)))
    weights = model.sanitize({k: v for k, v in weights.items() if ".indexer." not in k})
    nn.quantize(model, group_size=32, bits=4, mode="mxfp4",
                class_predicate=lambda p, m: f"{p}.scales" in weights)
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model


def prefill(model, tokens: mx.array, cache: List, step: int = PREFILL_STEP) -> mx.array:
    """Prefill `tokens` [1, L] in chunks of `step` tokens (each evaluated before the next,
    as mlx-lm's generate_step does); returns the last chunk's logits."""
    for s0 in range(0, tokens.shape[1], step):
        logits = model(tokens[:, s0 : s0 + step], cache)
        mx.eval(logits, [c.state for c in cache])
    return logits


def run_once(model, tokens: mx.array, decode_steps: int):
    """One chunked prefill of `tokens` [1, L] then `decode_steps` greedy steps; returns
    (prefill seconds, decode seconds)."""
    cache = model.make_cache()
    t0 = time.perf_counter()
    logits = prefill(model, tokens, cache)
    t1 = time.perf_counter()
    y = mx.argmax(logits[:, -1:], axis=-1)
    for _ in range(decode_steps):
        y = mx.argmax(model(y, cache)[:, -1:], axis=-1)
        mx.eval(y)
    return t1 - t0, time.perf_counter() - t1


def peak_memory(load: Callable, tokens: mx.array, decode_steps: int) -> float:
    """Peak bytes allocated by loading a model and running it once, alone in memory."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    model = load()
    run_once(model, tokens, decode_steps)
    peak = mx.get_peak_memory() - base
    del model
    gc.collect()
    mx.clear_cache()
    return float(peak)


def cache_bytes(cache: List) -> int:
    """Bytes held by a model's cache list (mlx-lm caches and our DSACache)."""
    total = 0
    for c in cache:
        n = getattr(c, "nbytes", None)
        if n is None:
            n = sum(a.nbytes for a in c.state if a is not None)
        total += int(n)
    return total


def memory_rows(load: Callable, prompts: Sequence[int], step: int = PREFILL_STEP) -> List[Dict]:
    """Peak memory of a chunked prefill plus one decode step for each prompt length, the
    model loaded once: [{'prompt', 'peak_bytes', 'weights_bytes', 'cache_bytes'}].
    Peaks count from before the model was loaded (weights included)."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    model = load()
    weights = mx.get_active_memory() - base
    rows = []
    for n in prompts:
        tokens = mx.random.randint(0, 256, (1, n), key=mx.random.key(n))
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        cache = model.make_cache()
        logits = prefill(model, tokens, cache, step)
        mx.eval(model(mx.argmax(logits[:, -1:], axis=-1), cache))
        rows.append({"prompt": n, "peak_bytes": mx.get_peak_memory() - base,
                     "weights_bytes": weights, "cache_bytes": cache_bytes(cache)})
        del cache, logits
    del model
    gc.collect()
    mx.clear_cache()
    return rows


def memory_compare(path: Path, prompts: Sequence[int] = MEMORY_PROMPTS,
                   step: int = PREFILL_STEP) -> Dict:
    """`memory_rows` for mlx-lm's kimi_k3 and for kimi-mlx on the checkpoint at `path`,
    one after the other in this process, and the two targets (see the module doc)."""
    from kimi_mlx.checkpoint.loader import load_model

    out = {"mlx-lm": memory_rows(lambda: load_mlx_lm_k3(path), prompts, step),
           "kimi-mlx": memory_rows(lambda: load_model(path, verbose=False)[0], prompts, step)}
    ours = {r["prompt"]: r for r in out["kimi-mlx"]}
    ref = {r["prompt"]: r for r in out["mlx-lm"]}
    checks = {}
    if 4096 in ours:
        checks["4k: ours <= mlx-lm"] = ours[4096]["peak_bytes"] <= ref[4096]["peak_bytes"]
    if 4096 in ours and 16384 in ours:
        grew = ours[16384]["peak_bytes"] - ours[4096]["peak_bytes"]
        cache = ours[16384]["cache_bytes"] - ours[4096]["cache_bytes"]
        checks["4k->16k: growth <= 1.1 x cache growth"] = grew <= 1.1 * cache
        out["growth"] = {"peak": grew, "cache": cache}
    out["targets"] = checks
    return out


def print_memory(res: Dict, step: int) -> None:
    print(f"peak memory, chunked prefill ({step}-token chunks) + 1 decode step, "
          f"model loaded once (weights included)")
    print(f"{'prompt':>7s} {'mlx-lm MB':>10s} {'kimi-mlx MB':>12s} {'ratio':>6s} "
          f"{'our cache MB':>13s} {'our weights MB':>15s}")
    for a, b in zip(res["mlx-lm"], res["kimi-mlx"]):
        print(f"{b['prompt']:7d} {a['peak_bytes'] / 1e6:10.1f} {b['peak_bytes'] / 1e6:12.1f} "
              f"{b['peak_bytes'] / a['peak_bytes']:5.2f}x {b['cache_bytes'] / 1e6:13.1f} "
              f"{b['weights_bytes'] / 1e6:15.1f}")
    if "growth" in res:
        g = res["growth"]
        print(f"kimi-mlx 4k -> 16k: peak +{g['peak'] / 1e6:.1f} MB, "
              f"cache +{g['cache'] / 1e6:.1f} MB")
    for name, ok in res["targets"].items():
        print(f"target {name}: {'met' if ok else 'MISSED'}")


def compare(prompt_len: int = 512, decode_steps: int = 32, repeats: int = 3) -> Dict:
    """Both models in this process: peak memory one at a time, then speed interleaved
    (A, B, A, B, ...; best of `repeats`) so machine load hits both alike.

    Returns {'kimi-mlx': {...}, 'mlx-lm': {...}, 'ratio': {...}}.
    """
    from kimi_mlx.checkpoint.loader import load_model

    tokens = mx.random.randint(0, 256, (1, prompt_len))
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint(Path(tmp) / "bench", text_config=bench_text_config(), seed=0)
        loaders: Dict[str, Callable] = {
            "mlx-lm": lambda: load_mlx_lm_k3(path),
            "kimi-mlx": lambda: load_model(path, verbose=False)[0],
        }
        results = {n: {"peak_bytes": peak_memory(f, tokens, decode_steps)} for n, f in loaders.items()}
        models = {n: f() for n, f in loaders.items()}
    for name, model in models.items():  # warm-up: compile, allocator
        run_once(model, tokens[:, :16], 2)
    for name in models:
        results[name].update(prefill_tps=0.0, decode_tps=0.0)
    for _ in range(repeats):
        for name, model in models.items():
            pre, dec = run_once(model, tokens, decode_steps)
            r = results[name]
            r["prefill_tps"] = max(r["prefill_tps"], prompt_len / pre)
            r["decode_tps"] = max(r["decode_tps"], decode_steps / dec)
    ours, ref = results["kimi-mlx"], results["mlx-lm"]
    results["ratio"] = {
        "prefill": ours["prefill_tps"] / ref["prefill_tps"],
        "decode": ours["decode_tps"] / ref["decode_tps"],
        "peak_memory": ours["peak_bytes"] / ref["peak_bytes"],
    }
    return results


def print_table(results: Dict, prompt_len: int, decode_steps: int) -> None:
    print(f"model vs mlx-lm kimi_k3 (same weights, batch 1, prompt {prompt_len}, "
          f"decode {decode_steps}, device {mx.default_device()})")
    print(f"{'':10s} {'prefill tok/s':>14s} {'decode tok/s':>13s} {'peak MB':>9s}")
    for name in ("mlx-lm", "kimi-mlx"):
        r = results[name]
        print(f"{name:10s} {r['prefill_tps']:14.1f} {r['decode_tps']:13.1f} "
              f"{r['peak_bytes'] / 1e6:9.1f}")
    q = results["ratio"]
    print(f"{'ratio':10s} {q['prefill']:14.2f}x {q['decode']:12.2f}x {q['peak_memory']:8.2f}x"
          "   (targets: >= 1.0x, >= 1.0x, <= 1.10x)")


def _lengths(text: str) -> List[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts, got {text!r}")
    if any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"token counts must be >= 1, got {text!r}")
    return vals


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.bench.model")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens for the speed rows")
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--memory-prompts", type=_lengths, default=list(MEMORY_PROMPTS),
                   help="prompt lengths for the peak-memory rows (default 1024,4096,16384; "
                        "empty: skip)")
    p.add_argument("--prefill-step", type=int, default=PREFILL_STEP,
                   help=f"prefill chunk in tokens (default {PREFILL_STEP}, as mlx-lm)")
    a = p.parse_args(argv)
    if a.prefill_step < 1:
        p.error("--prefill-step must be >= 1")
    print_table(compare(a.prompt, a.decode, a.repeats), a.prompt, a.decode)
    if a.memory_prompts:
        print()
        with tempfile.TemporaryDirectory() as tmp:
            path = build_checkpoint(Path(tmp) / "bench", text_config=bench_text_config(), seed=0)
            print_memory(memory_compare(path, a.memory_prompts, a.prefill_step), a.prefill_step)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
