"""`make bench`: kimi-mlx against mlx-lm's `kimi_k3` on the same weights, in one run.

Both models read the same official-layout checkpoint (a mid-size random config, BF16 with
MXFP4 experts). mlx-lm's K3 has no indexer, so prompts stay within `index_topk` (where
K3.1 equals K3, "dense-equivalent"). Reported as ratios against mlx-lm measured in the same
process: prefill and decode tokens/s (higher is better) and peak memory (lower is better).
"""

from __future__ import annotations

import argparse
import copy
import gc
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict

import mlx.core as mx
import mlx.nn as nn

from .testing import build_checkpoint, tiny_text_config


def bench_text_config() -> dict:
    """A mid-size K3.1 config: 8 layers (2 Gated DSA), hidden 1024, 32 experts top-4."""
    return tiny_text_config(
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


def run_once(model, tokens: mx.array, decode_steps: int):
    """One prefill of `tokens` [1, L] then `decode_steps` greedy steps; returns seconds."""
    cache = model.make_cache()
    t0 = time.perf_counter()
    logits = model(tokens, cache)
    mx.eval(logits, [c.state for c in cache])
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


def compare(prompt_len: int = 512, decode_steps: int = 32, repeats: int = 3) -> Dict:
    """Both models in this process: peak memory one at a time, then speed interleaved
    (A, B, A, B, ...; best of `repeats`) so machine load hits both alike.

    Returns {'kimi-mlx': {...}, 'mlx-lm': {...}, 'ratio': {...}}.
    """
    from .loader import load_model

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.bench")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    print_table(compare(a.prompt, a.decode, a.repeats), a.prompt, a.decode)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
