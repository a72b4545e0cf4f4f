"""The micro checkpoint's figures (`eval.json`, MODEL_CARD.md): held-out perplexity of the
trained weights in BF16 and of the shipped MXFP4 checkpoint, by window length, dense vs
sparse attention, and expert usage per domain. Used by `make micro` and `make micro-moe`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from kimi_mlx.micro.corpus import DOMAINS
from kimi_mlx.micro.train_modules import _modules
from kimi_mlx.model.config import ModelArgs
from kimi_mlx.model.dsa import GatedDSA
from kimi_mlx.model.model import Model


def inference_copy(model: Model, args: ModelArgs, dtype=mx.bfloat16) -> Model:
    """A plain inference `Model` with `model`'s weights rounded to `dtype` (float32 kept
    for the tensors the release keeps in F32), run with float32 activations."""
    from kimi_mlx.testing.checkpoints import F32_SUFFIXES

    plain = Model(args)
    weights = [
        (n, p if n.endswith(F32_SUFFIXES) else p.astype(dtype).astype(mx.float32))
        for n, p in tree_flatten(model.parameters())
    ]
    plain.load_weights(weights, strict=True)
    plain.eval()
    plain.activation_dtype = mx.float32
    mx.eval(plain.parameters())
    return plain


def set_index_topk(model: Model, topk: int) -> None:
    """Set every Gated DSA layer's index_topk (a huge value makes the attention dense)."""
    for m in _modules(model, GatedDSA):
        m.index_topk = topk


def measure(model: Model, ids: Dict[str, List[int]], seq_len: int) -> Dict[str, float]:
    """{domain: held-out perplexity} for every domain in `ids`
    (`kimi_mlx.generation.evaluate.perplexity`)."""
    from kimi_mlx.generation.evaluate import perplexity

    return {d: perplexity(model, ids[d], seq_len).perplexity for d in ids}


TEST_TOKENS = 4096  # held-out tokens per domain that tests/test_micro.py measures


def evaluate_all(trained: Model, ckpt: Path, args: ModelArgs, seq_len: int, log=print,
                 max_tokens: Optional[int] = None) -> Dict:
    """Held-out perplexities (BF16 and the shipped MXFP4 checkpoint), by window length,
    dense vs sparse attention, and expert usage per domain: the figures of `eval.json`
    and MODEL_CARD.md. `test_subset` repeats BF16 / MXFP4 on the first TEST_TOKENS
    held-out tokens of each domain, which the tests measure again."""
    from kimi_mlx.generation.evaluate import expert_usage, read_tokens
    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.text.tokenizer import KimiTokenizer

    tok = KimiTokenizer.from_pretrained(ckpt)
    ids = {d: read_tokens(tok, ckpt / "heldout" / f"{d}.txt", max_tokens) for d in DOMAINS}
    sub = {d: ids[d][: TEST_TOKENS + 1] for d in DOMAINS}
    res: Dict[str, Any] = {"uniform": args.vocab_size, "seq_len": seq_len,
                           "heldout_tokens": {d: len(ids[d]) for d in DOMAINS}}
    trained.eval()
    bf16 = inference_copy(trained, args, mx.bfloat16)
    res["bf16"] = measure(bf16, ids, seq_len)
    log(f"bf16 {res['bf16']}")
    shipped, _, _ = load_model(ckpt, verbose=False)
    res["mxfp4"] = measure(shipped, ids, seq_len)
    log(f"mxfp4 {res['mxfp4']}")
    from kimi_mlx.generation.evaluate import perplexity

    r = perplexity(shipped, ids["code"], seq_len)
    res["tokens_per_second"] = r.tokens_per_second
    res["test_subset"] = {"tokens": TEST_TOKENS, "seq_len": seq_len,
                          "bf16": measure(bf16, sub, seq_len), "mxfp4": measure(shipped, sub, seq_len)}

    topk = args.index_topk
    res["by_seq_len"] = {str(topk): measure(shipped, ids, topk), str(seq_len): res["mxfp4"],
                         str(16 * topk): measure(shipped, ids, 16 * topk)}
    set_index_topk(shipped, 1 << 30)
    res["dense_by_seq_len"] = {str(L): measure(shipped, ids, L) for L in (seq_len, 16 * topk)}
    set_index_topk(shipped, topk)
    log(f"by seq len {res['by_seq_len']} dense {res['dense_by_seq_len']}")

    halves, usage, tv_halves = {}, {}, {}
    for d in DOMAINS:
        n = len(ids[d]) // 2
        halves[d] = (expert_usage(shipped, ids[d][:n], seq_len),
                     expert_usage(shipped, ids[d][n:], seq_len))
        usage[d] = 0.5 * (halves[d][0] + halves[d][1])  # equal token counts: the mean
        tv_halves[d] = float(0.5 * np.abs(halves[d][0] - halves[d][1]).sum(axis=1).mean())
    tv = 0.5 * np.abs(usage["code"] - usage["prose"]).sum(axis=1)
    res["experts"] = {
        "share": {d: usage[d].tolist() for d in DOMAINS},
        "tv_code_vs_prose_per_layer": tv.tolist(),
        "tv_code_vs_prose": float(tv.mean()),
        "tv_between_halves": tv_halves,
    }
    log(f"expert TV code vs prose {tv.mean():.3f} (halves {tv_halves})")
    return res


def acceptance(run, prompts: List[List[int]], k: int) -> Dict:
    """Greedy speculative runs of a micro draft: accepted drafts per verify step at k.
    `run(prompt, k, stats)` returns the generator of one run (the draft's own loop:
    `speculative_generate_step`, `block_generate_step`) counting into `stats`, a
    `speculative.loop.SpecStats`. Shared by `make micro-draft` and `make micro-dspark`.

    Returns {"k", "steps", "mean_accepted", "acceptance_rate", "tokens_per_step"}."""
    from kimi_mlx.speculative.loop import SpecStats

    st = SpecStats()
    for p in prompts:
        for _ in run(p, k, st):
            pass
    return {"k": k, "steps": st.steps, "mean_accepted": st.mean_accepted,
            "acceptance_rate": st.acceptance_rate,
            "tokens_per_step": st.emitted / max(st.steps, 1)}


def acceptance_rows(rows: List[Dict]) -> str:
    """The model card's table rows of `acceptance` results: | k | accepted per step | of
    drafted | tokens per target pass |."""
    return "\n".join(f"| {a['k']} | {a['mean_accepted']:.2f} | {100 * a['acceptance_rate']:.0f}% "
                     f"| {a['tokens_per_step']:.2f} |" for a in rows)
