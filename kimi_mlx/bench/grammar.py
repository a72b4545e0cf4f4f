"""`kimi-mlx bench grammar`: what structured output costs per token on K3.1's vocabulary.

Builds a 163,840-token tokenizer in the release's file layout (256 byte tokens, 163,328
text-like multi-byte tokens drawn from letters, digits, JSON punctuation and spaces, then
K3's 256 special tokens at 163584..163839), loads it with our `KimiTokenizer`, and
compiles a request's grammar with `generation.constrain` (a json_schema response and a
forced tool call). It then walks a valid reply token by token, as the engines do, and
reports per generated token:

* mask: llguidance's bitmask computation for the next token (`compute_bitmask`);
* processor: the whole logits processor (mask, unpack to a bool vector, `mx.where` on
  [1, 163840] float32 logits, evaluated);
* at batch 8: eight sequences' processors one after another (what the batched engine's
  step runs), per step, and llguidance's parallel executor filling the 8 masks at once.

With `--clients N` it also serves the shipped micro model (batched, N at a time) and
reports aggregate generated tokens/s for N concurrent json_schema requests against the
same requests without the schema (interleaved rounds, median): the grammar's cost in
the batched engine's step.

Median and mean over the reply's tokens (the first step, which warms llguidance's lexer
caches, is in the mean). The tokenizer's one-off conversion and the grammar's compile
time are printed too. Synthetic tokens are not K3.1's, but the mask's cost scales with the
vocabulary's size and its token trie, which this reproduces at full size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from typing import List, Optional

REAL_VOCAB, REAL_FIRST_SPECIAL = 163840, 163584

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
    "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
REPLY = {"name": "Ada Lovelace, the first programmer", "age": 36,
         "tags": ["mathematics", "poetry", "analytical engine"], "ok": True}
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}


def full_size_ranks(seed: int = 0) -> dict:
    """{token bytes: rank} for 163,584 ordinary tokens: the 256 bytes, then distinct
    text-like strings of 2-12 characters (half with a leading space)."""
    rng = random.Random(seed)
    ranks = {bytes([i]): i for i in range(256)}
    alpha = ("etaoinshrdlucmfwypvbgkjqxz" * 4 + "ETAOINSHRDLU" + "0123456789"
             + '{}[]":,._-/\\()' + "      \n")
    while len(ranks) < REAL_FIRST_SPECIAL:
        n = rng.choice([2, 2, 3, 3, 4, 4, 5, 6, 7, 8, 10, 12])
        s = ("" if rng.random() < .5 else " ") + "".join(rng.choice(alpha) for _ in range(n))
        ranks.setdefault(s.encode(), len(ranks))
    return ranks


def full_size_tokenizer(folder: str):
    """Our `KimiTokenizer` over `full_size_ranks`, written to `folder` first."""
    from kimi_mlx.text.tokenizer import KimiTokenizer, kimi_special_tokens, write_tokenizer_files

    write_tokenizer_files(folder, full_size_ranks(), kimi_special_tokens(REAL_FIRST_SPECIAL))
    return KimiTokenizer.from_pretrained(folder)


def _stats(xs: List[float]) -> str:
    return f"median {statistics.median(xs) * 1e6:8.0f} us   mean {statistics.fmean(xs) * 1e6:8.0f} us"


def measure(tok, kind: str, batch: int) -> dict:
    """Per-token times of one reply walked through `batch` processors of one grammar."""
    import mlx.core as mx
    import numpy as np

    from kimi_mlx.generation.constrain import build_constraint, grammar_tokenizer

    t = time.perf_counter()
    grammar_tokenizer(tok)
    t_tok = time.perf_counter() - t
    prompt = tok.encode("<|open|>think<|sep|>", allow_special=True)
    if kind == "json":
        text = (f"x<|close|>think<|sep|><|open|>response<|sep|>{json.dumps(REPLY)}"
                "<|close|>response<|sep|><|close|>message<|sep|>")
        kw = {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA,
                                                                         "strict": True}}}
    else:
        args = json.dumps({"city": "San Francisco", "unit": "c"})
        text = ('x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool="get_weather" '
                'index="1"<|sep|><|open|>json type="object"<|sep|>' + args
                + "<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|>"
                "<|close|>message<|sep|>")
        kw = {"tools": [TOOL], "tool_choice": "required"}
    t = time.perf_counter()
    c = build_constraint(tok, prompt, think_budget=None, **kw)
    procs = [c.processor() for _ in range(batch)]
    t_compile = time.perf_counter() - t
    ids = tok.encode(text, allow_special=True)
    logits = mx.random.normal((1, REAL_VOCAB))
    mx.eval(logits)
    history = [prompt[-1]]
    masks, steps, par = [], [], []
    import llguidance
    import llguidance.numpy as lnp

    executor = llguidance.LLExecutor()
    bitmask = lnp.allocate_token_bitmask(batch, c.tokenizer.vocab_size)
    for tid in ids:
        hist = mx.array(history)
        t = time.perf_counter()
        outs = [p(hist, logits) for p in procs]
        mx.eval(outs)
        steps.append(time.perf_counter() - t)
        if procs[0].matcher is not None and not procs[0].done:
            t = time.perf_counter()
            procs[0].matcher.compute_bitmask()
            masks.append(time.perf_counter() - t)
            t = time.perf_counter()
            lnp.fill_next_token_bitmask_par(executor, [(p.matcher, i) for i, p in enumerate(procs)],
                                            bitmask)
            par.append(time.perf_counter() - t)
        assert bool(np.array(outs[0][0, tid]) > -1e30), f"token {tid} refused"
        history.append(tid)
    return dict(kind=kind, batch=batch, tokens=len(masks), t_tok=t_tok, t_compile=t_compile,
                mask=masks, step=steps[-len(masks):], par=par)


def server_cost(clients: int, rounds: int = 3, max_tokens: int = 48) -> tuple:
    """(median tokens/s constrained, median tokens/s free) for `clients` concurrent chat
    requests on the micro model's batched server, interleaved over `rounds`."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from kimi_mlx.generation.generate import default_model
    from kimi_mlx.testing.servers import served

    schema = {"type": "object", "properties": {
        "name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "tags"]}
    with served(str(default_model()), max_concurrency=clients) as (srv, _svc):
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", timeout=600, max_retries=0)

        def one(i, enforce):
            kw = {"response_format": {"type": "json_schema", "json_schema": {
                "name": "o", "schema": schema}}} if enforce else {}
            r = client.chat.completions.create(
                model="micro", messages=[{"role": "user", "content": f"Record {i}."}],
                max_tokens=max_tokens, temperature=0.9, seed=i,
                extra_body={"thinking_budget": 0}, **kw)
            return r.usage.completion_tokens

        def rate(enforce):
            t = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                n = sum(pool.map(lambda i: one(i, enforce), range(clients)))
            return n / (time.perf_counter() - t)

        rate(True), rate(False)  # warm-up
        on, off = [], []
        for _ in range(rounds):
            on.append(rate(True))
            off.append(rate(False))
    return statistics.median(on), statistics.median(off)


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kimi-mlx bench grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--clients", type=int, default=0,
                   help="also measure N concurrent clients on the micro server (0 = skip)")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        tok = full_size_tokenizer(d)
        print(f"tokenizer: {len(tok)} tokens, loaded in {time.perf_counter() - t:.1f} s")
        for kind in ("json", "tool"):
            for b in (int(x) for x in args.batches.split(",")):
                r = measure(tok, kind, b)
                print(f"{kind:4s} batch {b}: {r['tokens']} constrained tokens; llguidance tokenizer "
                      f"{r['t_tok']:.2f} s (once per model), grammar compile + {b} matchers "
                      f"{r['t_compile'] * 1e3:.1f} ms")
                print(f"    mask, one sequence         {_stats(r['mask'])}")
                print(f"    processors, whole step     {_stats(r['step'])}")
                if b > 1:
                    print(f"    {b} masks, parallel executor {_stats(r['par'])}")
    if args.clients:
        on, off = server_cost(args.clients)
        print(f"micro server, {args.clients} clients: {on:.1f} tok/s with json_schema, "
              f"{off:.1f} tok/s without ({on / off:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
