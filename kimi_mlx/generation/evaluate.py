"""Perplexity and tokens/s of a checkpoint on a UTF-8 text file (`kimi-mlx eval`'s library).

The file is tokenised with the checkpoint's own tokenizer (no special tokens) and cut into
consecutive windows of `--seq-len` + 1 tokens that share one boundary token, so every
token after the first is predicted exactly once, from the context inside its window:

    window i = ids[i*L : i*L + L + 1]; inputs = window[:-1], targets = window[1:]

Perplexity = exp(total negative log-likelihood / predicted tokens): per-token
log-probabilities in float32 from the model's logits, summed exactly (math.fsum).
Tokens/s counts predicted tokens over the forward passes' wall time
(model loading and tokenisation excluded).

`expert_usage` measures the share of routing mass each routed expert gets on a text
(the figure the micro model card reports per domain and the pruner relies on).
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

DEFAULT_SEQ_LEN = 256
DEFAULT_BATCH = 8


@dataclass
class EvalResult:
    """Outcome of `perplexity`: summed NLL (nats), predicted tokens, forward wall seconds."""

    nll: float
    tokens: int
    seconds: float

    @property
    def perplexity(self) -> float:
        """exp(nll / tokens); inf when no token was predicted."""
        return math.exp(self.nll / self.tokens) if self.tokens else float("inf")

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("inf")


def windows(ids: Sequence[int], seq_len: int) -> List[List[int]]:
    """Consecutive windows of up to seq_len + 1 ids overlapping by one id.

    Args:
        ids: token ids.
        seq_len: predicted tokens per window (>= 1).
    Returns:
        Windows of length seq_len + 1, the last one possibly shorter (>= 2 ids); empty
        when len(ids) < 2.
    Raises:
        ValueError: seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out = []
    for start in range(0, max(0, len(ids) - 1), seq_len):
        w = list(ids[start : start + seq_len + 1])
        if len(w) >= 2:
            out.append(w)
    return out


def perplexity(
    model, ids: Sequence[int], seq_len: int = DEFAULT_SEQ_LEN, batch_size: int = DEFAULT_BATCH,
    progress: bool = False,
) -> EvalResult:
    """Perplexity of `model` on token ids, over `windows(ids, seq_len)`.

    Args:
        model: a kimi-mlx `Model` (or any callable tokens [B, L] int32 -> logits
            [B, L, vocab]) in eval mode.
        ids: token ids (at least 2).
        seq_len: window length in predicted tokens.
        batch_size: windows per forward pass (full-length windows only).
        progress: a tqdm bar of predicted tokens on stderr, on a terminal only.
    Returns:
        EvalResult with the summed NLL in nats and the number of predicted tokens.
    Raises:
        ValueError: fewer than 2 ids, or seq_len < 1.
    """
    import mlx.core as mx

    wins = windows(ids, seq_len)
    if not wins:
        raise ValueError(f"need at least 2 tokens to measure perplexity, got {len(ids)}")
    full = [w for w in wins if len(w) == seq_len + 1]
    batches = [full[i : i + batch_size] for i in range(0, len(full), batch_size)]
    batches += [[w] for w in wins if len(w) != seq_len + 1]
    from tqdm import tqdm

    nll, count, seconds = 0.0, 0, 0.0
    bar = tqdm(total=sum(len(w) - 1 for w in wins), desc="measuring", unit="tok",
               file=sys.stderr, leave=False, dynamic_ncols=True, disable=None if progress else True)
    for batch in batches:
        x = mx.array(batch, dtype=mx.int32)
        t0 = time.perf_counter()
        # a quantized cache format (`--kv-bits`) acts only through a cache: give it one
        cache = model.make_cache() if getattr(model, "kv_bits", None) else None
        logits = (model(x[:, :-1], cache) if cache is not None else model(x[:, :-1])).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logp, x[:, 1:, None], axis=-1)
        mx.eval(picked)
        seconds += time.perf_counter() - t0
        # summed in float64: a float32 sum of a few hundred logprobs is off by ~1e-4
        nll -= math.fsum(picked.reshape(-1).tolist())
        count += x.shape[0] * (x.shape[1] - 1)
        bar.update(x.shape[0] * (x.shape[1] - 1))
    bar.close()
    return EvalResult(nll, count, seconds)


def expert_usage(model, ids: Sequence[int], seq_len: int = DEFAULT_SEQ_LEN):
    """Share of routing mass per routed expert, per MoE layer, on token ids.

    Routing mass of expert e in a layer = sum over tokens of the router weight it gets
    when selected (the renormalised top-k weights, so each token gives the layer
    `routed_scaling_factor` in total). Windows as in `perplexity`.

    Returns:
        NumPy float64 [moe layers, num_experts]; each row sums to 1.
    Raises:
        ValueError: the model has no MoE layer, or fewer than 2 ids.
    """
    import mlx.core as mx
    import numpy as np

    from kimi_mlx.model.ffn import LatentMoE

    moes = [m for _, m in model.named_modules() if isinstance(m, LatentMoE)]
    if not moes:
        raise ValueError("the model has no latent MoE layer")
    mass = [mx.zeros((m.gate.weight.shape[0],), mx.float32) for m in moes]

    def recorder(i, m):
        def route(x):
            inds, w = type(m).route(m, x)
            mass[i] = mass[i].at[inds.reshape(-1)].add(w.reshape(-1).astype(mx.float32))
            return inds, w

        return route

    for i, m in enumerate(moes):
        object.__setattr__(m, "route", recorder(i, m))
    try:
        wins = windows(ids, seq_len)
        if not wins:
            raise ValueError(f"need at least 2 tokens, got {len(ids)}")
        for w in wins:
            model(mx.array([w[:-1]], dtype=mx.int32))
            mx.eval(mass)
    finally:
        for m in moes:
            object.__delattr__(m, "route")
    out = np.stack([np.array(a, dtype=np.float64) for a in mass])
    return out / out.sum(axis=1, keepdims=True)


def read_tokens(tokenizer, path, max_tokens: Optional[int] = None) -> List[int]:
    """Token ids of a UTF-8 text file (special-token text encoded as ordinary text).

    Raises:
        FileNotFoundError: no such file, or a folder (the message names the path).
        ValueError: the file is not UTF-8.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file" if not path.exists()
                                else f"--data {path}: not a file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e})") from None
    ids = tokenizer.encode(text)
    return ids[: max_tokens + 1] if max_tokens else ids


def read_texts(path) -> List[str]:
    """The texts of a JSON Lines file, one `{"text": str}` object a line (blank lines
    skipped), for `kimi-mlx eval --per-text`.

    Raises:
        FileNotFoundError: no such file (the message names the path).
        ValueError: a line that is not JSON or has no string "text" (naming file and line).
    """
    import json

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"--data {path}: no such file" if not path.exists()
                                else f"--data {path}: not a file")
    texts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f'{path}:{n}: expected an object {{"text": "..."}}')
        texts.append(obj["text"])
    return texts
