"""`kimi-mlx bench`: `kernels` (our Metal kernels vs their pure-MLX reference ops vs
mlx-lm's gated-delta kernel, at the real model's decode and prefill shapes) and `model`
(kimi-mlx vs mlx-lm's kimi_k3 end to end: `kimi_mlx.bench.model`).

Off Apple GPUs only the reference ops can run: the kernel columns then say that the Metal
figures need a Mac. The chunked-KDA-vs-per-token-loop ratio (the reference ops' own
speed-up, target >= 10x at 4,096 tokens, head_dim 128) is measured everywhere.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Callable, Dict, List, Optional

import mlx.core as mx

# The real model (K31_SPEC.md section 1): KDA 96 heads x 128; MLA 96 heads, latent 512,
# rope 64; indexer 32 heads x 128, top-k 2048.
KDA_HEADS, KDA_DIM = 96, 128
MLA_HEADS, MLA_RANK, MLA_ROPE, MLA_SCALE = 96, 512, 64, (128 + 64) ** -0.5
IDX_HEADS, IDX_DIM, IDX_TOPK = 32, 128, 2048


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="what", metavar="WHAT")
    k = sub.add_parser("kernels", help="kernels vs reference ops vs mlx-lm (Metal needs a Mac)",
                       description="Our Metal kernels vs their pure-MLX reference ops vs "
                       "mlx-lm's gated-delta kernel at the real model's decode and prefill "
                       "shapes (kernel figures need a Mac), and the chunked-vs-loop KDA "
                       "reference ratio.")
    k.add_argument("--tokens", type=int, default=4096,
                   help="prompt length for the chunked-vs-loop KDA ratio (default 4096)")
    k.add_argument("--heads", type=int, default=8,
                   help="KDA heads for the chunked-vs-loop ratio (default 8; head_dim is 128)")
    k.add_argument("--prefill", type=int, default=None,
                   help="prompt length for the real-shape prefill rows (default 2048 on a "
                        "Mac, 512 elsewhere)")
    k.add_argument("--context", type=int, default=32768,
                   help="cached tokens for the DSA decode rows (default 32768)")
    k.add_argument("--repeats", type=int, default=3, help="best of N timed runs (default 3)")
    m = sub.add_parser("model", help="kimi-mlx vs mlx-lm kimi_k3 on the same weights")
    m.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    m.add_argument("--decode", type=int, default=32, help="decode steps (default 32)")
    m.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    s = sub.add_parser("spec", help="speculative (draft model, n-gram) vs plain decoding tokens/s",
                       description="Speculative decoding (greedy) against plain decoding in "
                       "one process: mean accepted drafts per verify step and tokens/s for "
                       "each k, plus the KDA rollback cost at K3.1's size "
                       "(kimi_mlx.bench.spec); then the same through 3 stage processes on "
                       "loopback (kimi_mlx.cluster.bench.spec).")
    s.add_argument("--model", default=None, help="target (default: the shipped micro model)")
    s.add_argument("--draft-model", default=None,
                   help="draft (default: the shipped micro-draft)")
    s.add_argument("--block-draft", default=None,
                   help="DFlash / DSpark block drafter (default: the shipped micro-dspark)")
    s.add_argument("--drafts", default="model,block,ngram",
                   help="drafts to measure: model (--draft-model), block (--block-draft; "
                        "through the stages too), ngram (prompt lookup, --draft ngram); default "
                        "model,block,ngram")
    s.add_argument("--workloads", default="ordinary,copy",
                   help="ordinary (held-out code and prose), copy (a block of source code "
                        "followed by its first half again, to be continued); default both")
    s.add_argument("--tokens", type=int, default=48, help="tokens per generation (default 48)")
    s.add_argument("--ks", default="1,2,3,4,5,6",
                   help="draft counts, auto for --num-draft-tokens auto (one process only; "
                        "default 1,2,3,4,5,6)")
    s.add_argument("--ngram-ks", default="2,3,4,5,6,7,8",
                   help="draft counts for the n-gram draft (default 2,3,4,5,6,7,8)")
    s.add_argument("--ngram-max", type=int, default=None,
                   help="the n-gram draft's longest n-gram (default: --draft ngram's)")
    s.add_argument("--ngram-min", type=int, default=None,
                   help="the n-gram draft's shortest n-gram (default: --draft ngram's)")
    s.add_argument("--copy-tokens", type=int, default=128,
                   help="tokens per generation on the copy workload (default 128: about the "
                        "rest of the second copy)")
    s.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    s.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default 5)")
    s.add_argument("--stages", type=int, default=3,
                   help="then the same k values through this many loopback stage processes, "
                        "the draft on the head (kimi_mlx.cluster.bench.spec; 0 = skip; "
                        "default 3)")
    s.add_argument("--stage-prompts", type=int, default=2,
                   help="prompts for the pipeline rows (default 2)")
    s.add_argument("--stage-repeats", type=int, default=1,
                   help="interleaved rounds for the pipeline rows (default 1)")
    t = sub.add_parser("tensor", help="2-rank tensor parallelism (ring, loopback) vs one process",
                       description="Per decode step: collectives and their time against the "
                       "bare all_sum floor, bytes loaded / read per rank, tokens/s 2 ranks vs "
                       "one process (kimi_mlx.bench.tensor).")
    t.add_argument("--model", default=None, help="checkpoint (default: the shipped micro model)")
    t.add_argument("--prompt", type=int, default=64, help="prompt tokens (default 64)")
    t.add_argument("--decode", type=int, default=32, help="decode steps (default 32)")
    t.add_argument("--port", type=int, default=45900,
                   help="first of 2 loopback ports for the ring (default 45900)")
    t.add_argument("--repeats", type=int, default=3, help="timed runs per side (default 3)")
    h = sub.add_parser("hop", help="the pipeline's own cost: ms per hop, 2-stage pipelined "
                       "prefill, beside each stage's real compute",
                       description="Null stage processes on loopback (the real service, "
                       "transport and wire code, no model compute): ms per hop at decode beside "
                       "its floors (bare gRPC and TCP messages, bare gRPC relay hops), "
                       "2-stage pipelined vs sequential prefill with a sleep standing for "
                       "compute, and the real model's per-stage compute time "
                       "(kimi_mlx.cluster.bench.hop).")
    h.add_argument("--model", default=None, help="checkpoint (default: a mid-size random one)")
    h.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    v = sub.add_parser("server", help="server throughput: 1/4/8 concurrent clients vs one "
                       "at a time (make bench-server)",
                       description="Aggregate generation tokens/s and time to first token "
                       "for 1, 4 and 8 concurrent HTTP clients, one process and a 3-stage "
                       "loopback cluster (kimi_mlx.bench.server).")
    v.add_argument("--model", default=None, help="checkpoint (default: the shipped micro model)")
    v.add_argument("--requests", type=int, default=8, help="requests per measurement (default 8)")
    v.add_argument("--max-tokens", type=int, default=32, help="tokens per request (default 32)")
    v.add_argument("--concurrency", type=int, default=8, help="--max-concurrency (default 8)")
    v.add_argument("--rounds", type=int, default=3, help="interleaved rounds (default 3)")
    v.add_argument("--skip-cluster", action="store_true", help="only the single process")
    r = sub.add_parser("routing", help="distinct routed experts per layer for a block of n "
                       "tokens, from a MoE checkpoint's routing (writes the curve the verify "
                       "cost model reads)",
                       description="Observes micro-moe's (or --model's) routing on its own "
                       "corpus and writes kimi_mlx/assets/expert_union.json: mean distinct "
                       "experts per layer for blocks of n = 1..16 consecutive tokens, and the "
                       "effective-pool fit kimi-mlx plan scales to K3.1 "
                       "(kimi_mlx.bench.routing).")
    r.add_argument("--model", default=None, help="MoE checkpoint (default: the shipped micro-moe)")
    r.add_argument("--chunk", type=int, default=256, help="tokens per chunk (default 256)")
    r.add_argument("--chunks", type=int, default=24, help="chunks in all (default 24)")
    r.add_argument("--out", default=None,
                   help="where to write (default kimi_mlx/assets/expert_union.json)")
    r.add_argument("--no-write", action="store_true", help="print only")
    g = sub.add_parser("grammar", help="structured output: grammar mask time per token on "
                       "K3.1's 163,840-token vocabulary, batch 1 and 8",
                       description="llguidance's mask and the whole logits processor per "
                       "token for a json_schema reply and a forced tool call "
                       "(kimi_mlx.bench.grammar).")
    g.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    g.add_argument("--clients", type=int, default=0,
                   help="also N concurrent clients on the micro server, with and without a schema")


def run(args: argparse.Namespace) -> int:
    """`kimi-mlx bench WHAT`; returns the exit status. SIGTERM and SIGHUP stop it as
    Ctrl-C does (`lifetime.exit_on_signals`): the processes a bench started (stages,
    ranks, servers) are stopped and its temporary folders removed by their `finally`s,
    then it exits 128 + the signal (130 for SIGINT)."""
    from kimi_mlx.lifetime import Stopped, exit_on_signals

    restore = exit_on_signals()
    try:
        return _run(args)
    except Stopped as e:
        print(f"kimi-mlx bench {args.what}: stopped ({e})", flush=True)
        return 128 + e.signum
    except KeyboardInterrupt:
        print(f"kimi-mlx bench {args.what}: stopped (SIGINT)", flush=True)
        return 130
    finally:
        restore()


def _run(args: argparse.Namespace) -> int:
    if args.what == "model":
        from kimi_mlx.bench.model import main

        return main(["--prompt", str(args.prompt), "--decode", str(args.decode),
                     "--repeats", str(args.repeats)])
    if args.what == "spec":
        from kimi_mlx.bench.spec import main as spec_main

        from kimi_mlx.speculative.auto_k import parse_num_draft_tokens

        try:
            ks = [parse_num_draft_tokens(k) for k in args.ks.split(",")]
            nks = [parse_num_draft_tokens(k) for k in args.ngram_ks.split(",")]
        except ValueError as e:
            print(f"kimi-mlx bench spec: --ks / --ngram-ks: {e}")
            return 2
        more = dict(drafts=args.drafts.split(","), workloads=args.workloads.split(","),
                    ngram_ks=nks,
                    copy_tokens=args.copy_tokens)
        if args.ngram_max is not None or args.ngram_min is not None:
            from kimi_mlx.speculative.ngram import DEFAULT_NGRAM_MAX, DEFAULT_NGRAM_MIN

            more["ngram"] = (args.ngram_max or DEFAULT_NGRAM_MAX,
                             args.ngram_min or DEFAULT_NGRAM_MIN)
        rc = spec_main(args.model, args.draft_model, args.tokens, ks, args.repeats,
                       args.prompts, block=args.block_draft, **more)
        if rc or args.stages < 1:
            return rc
        from kimi_mlx.cluster.bench.spec import main as pipeline_main

        print()
        fixed = [k for k in ks if isinstance(k, int)]  # the pipeline rows: fixed k only
        more["ngram_ks"] = [k for k in more["ngram_ks"] if isinstance(k, int)] or fixed
        if not fixed or not more["drafts"]:
            return rc
        return pipeline_main(args.model, args.draft_model, args.tokens, fixed,
                             args.stage_repeats, args.stage_prompts, args.stages,
                             block=args.block_draft, **more)
    if args.what == "tensor":
        from kimi_mlx.bench.tensor import main as tensor_main

        return tensor_main(args.model, args.prompt, args.decode, args.port, args.repeats)
    if args.what == "hop":
        from kimi_mlx.cluster.bench.hop import main as hop_main

        return hop_main((["--model", args.model] if args.model else [])
                        + ["--repeats", str(args.repeats)])
    if args.what == "server":
        from kimi_mlx.bench.server import main as server_main

        return server_main((["--model", args.model] if args.model else [])
                           + ["--requests", str(args.requests), "--max-tokens",
                              str(args.max_tokens), "--concurrency", str(args.concurrency),
                              "--rounds", str(args.rounds)]
                           + (["--skip-cluster"] if args.skip_cluster else []))
    if args.what == "routing":
        from kimi_mlx.bench.routing import main as routing_main

        return routing_main((["--model", args.model] if args.model else [])
                            + ["--chunk", str(args.chunk), "--chunks", str(args.chunks)]
                            + (["--out", args.out] if args.out else [])
                            + (["--no-write"] if args.no_write else []))
    if args.what == "grammar":
        from kimi_mlx.bench.grammar import main as grammar_main

        return grammar_main(["--batches", args.batches, "--clients", str(args.clients)])
    if args.what == "kernels":
        on_mac = mx.metal.is_available()
        prefill = args.prefill or (2048 if on_mac else 512)
        ratio = chunked_vs_loop(args.tokens, args.heads, KDA_DIM, args.repeats)
        rows = kernel_rows(prefill, args.context, args.repeats, on_mac)
        print_kernels(ratio, rows, on_mac)
        return 0
    print("usage: kimi-mlx bench {kernels,model,spec,tensor,hop,server,routing,grammar} [options]  (see kimi-mlx bench -h)")
    return 2


# ------------------------------------------------------------------------- timing


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Best wall-clock seconds of `repeats` evaluated calls after `warmup` calls."""
    for _ in range(warmup):
        mx.eval(fn())
    best = math.inf
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        mx.eval(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def _rel(a: mx.array, b: mx.array) -> float:
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.abs(a - b).max() / mx.maximum(mx.abs(b).max(), 1e-30)).item()


# ---------------------------------------------------------------------- inputs


def _kda_inputs(B: int, T: int, H: int, D: int, dtype, seed: int = 0):
    """Raw streams, prepared streams and a state at KDA's shapes (K3 gate, lower bound -5)."""
    from kimi_mlx.metal.kda import kda_prepare

    mx.random.seed(seed)
    raw = dict(
        q=mx.random.normal((B, T, H, D)).astype(dtype),
        k=mx.random.normal((B, T, H, D)).astype(dtype),
        v=mx.random.normal((B, T, H, D)).astype(dtype),
        a=mx.random.normal((B, T, H, D)).astype(dtype),
        b=mx.random.normal((B, T, H)).astype(dtype),
        A_log=mx.log(mx.random.uniform(1.0, 16.0, (H,))),
        dt_bias=mx.random.normal((H, D)) * 0.5,
    )
    q, k, g, beta = kda_prepare(raw["q"], raw["k"], raw["a"], raw["b"], raw["A_log"],
                                raw["dt_bias"], -5.0, D**-0.5)
    state = mx.random.normal((B, H, D, D)) * 0.1
    mx.eval(raw, q, k, g, beta, state)
    return raw, (q, k, raw["v"], g, beta), state


# ----------------------------------------------------------- chunked vs loop ratio


def chunked_vs_loop(T: int, H: int, D: int, repeats: int) -> Dict:
    """Reference ops only: `kda_chunked` vs the per-token `kda_recurrent` on one prompt of T
    tokens (float32, batch 1). Returns seconds, speed-up and max relative differences."""
    from kimi_mlx.metal.kda import kda_chunked, kda_recurrent

    _, (q, k, v, g, beta), _ = _kda_inputs(1, T, H, D, mx.float32, seed=1)
    # Compile/warm both on a short prefix, then time the loop once (it is the slow one).
    mx.eval(kda_recurrent(q[:, :4], k[:, :4], v[:, :4], g[:, :4], beta[:, :4]))
    t_chunk = best_time(lambda: kda_chunked(q, k, v, g, beta), repeats)
    t0 = time.perf_counter()
    y_loop, s_loop = kda_recurrent(q, k, v, g, beta)
    mx.eval(y_loop, s_loop)
    t_loop = time.perf_counter() - t0
    y, s = kda_chunked(q, k, v, g, beta)
    return dict(T=T, H=H, D=D, loop_s=t_loop, chunked_s=t_chunk, speedup=t_loop / t_chunk,
                rel_y=_rel(y, y_loop), rel_state=_rel(s, s_loop))


# -------------------------------------------------------------- real-shape rows


def _row(name: str, shape: str, ref: Callable, kernel: Optional[Callable],
         mlx_lm: Optional[Callable], repeats: int, check: Optional[Callable] = None) -> Dict:
    r = dict(name=name, shape=shape, ref_ms=best_time(ref, repeats) * 1e3)
    r["kernel_ms"] = best_time(kernel, repeats) * 1e3 if kernel is not None else None
    r["mlx_lm_ms"] = best_time(mlx_lm, repeats) * 1e3 if mlx_lm is not None else None
    r["rel_err"] = check() if (check is not None and kernel is not None) else None
    return r


def kernel_rows(prefill: int, context: int, repeats: int, on_mac: bool) -> List[Dict]:
    """Decode and prefill rows at the real model's head shapes (batch 1): reference op
    always; our kernel and mlx-lm's gated-delta kernel on Metal only. Activations bf16 on
    a Mac, float32 elsewhere (as the model runs there); KDA state float32."""
    from mlx_lm.models import gated_delta as gd

    from kimi_mlx.metal import dsa as dsa_ref
    from kimi_mlx.metal import kda as kda_ref
    from kimi_mlx.metal import kernels

    dtype = mx.bfloat16 if on_mac else mx.float32
    rows = []
    H, D = KDA_HEADS, KDA_DIM

    # KDA decode: one token, raw streams in (fused kernel) vs the prepared-ops reference.
    raw, prep, state = _kda_inputs(1, 1, H, D, dtype)
    raw_args = (raw["q"], raw["k"], raw["v"], raw["a"], raw["b"], raw["A_log"], raw["dt_bias"])
    q, k, v, g, beta = prep
    decay = mx.exp(g)
    rows.append(_row(
        "kda_decode", f"1 token, {H} heads x {D}",
        lambda: kda_ref.kda_decode(*raw_args, state),
        (lambda: kernels.kda_decode(*raw_args, state)) if on_mac else None,
        (lambda: gd.gated_delta_kernel(q, k, v, decay, beta, state)) if on_mac
        else (lambda: gd.gated_delta_ops(q, k, v, decay, beta, state)),
        repeats,
        lambda: _rel(kernels.kda_decode(*raw_args, state)[1], kda_ref.kda_decode(*raw_args, state)[1]),
    ))

    # KDA prefill: prepared streams, chunked reference vs the chunked kernel.
    _, prep, state = _kda_inputs(1, prefill, H, D, dtype, seed=2)
    q, k, v, g, beta = prep
    decay = mx.exp(g)
    rows.append(_row(
        "kda_prefill", f"{prefill} tokens, {H} heads x {D}",
        lambda: kda_ref.kda_chunked(q, k, v, g, beta, state),
        (lambda: kernels.kda_prefill(q, k, v, g, beta, state)) if on_mac else None,
        (lambda: gd.gated_delta_kernel(q, k, v, decay, beta, state)) if on_mac else None,
        repeats,
        lambda: _rel(kernels.kda_prefill(q, k, v, g, beta, state)[0],
                     kda_ref.kda_chunked(q, k, v, g, beta, state)[0]),
    ))

    # Indexer top-k: decode (one query, long context) and prefill (a prompt against itself).
    mx.random.seed(3)
    for name, L, S in (("dsa_index_topk", 1, context), ("dsa_index_topk", prefill, prefill)):
        qi = mx.random.normal((1, L, IDX_HEADS, IDX_DIM)).astype(dtype)
        wi = mx.random.normal((1, L, IDX_HEADS)).astype(dtype)
        ki = mx.random.normal((1, S, IDX_DIM)).astype(dtype)
        off = S - L
        mx.eval(qi, wi, ki)
        rows.append(_row(
            name, f"{L} quer{'y' if L == 1 else 'ies'} x {S} keys, {IDX_HEADS} x {IDX_DIM}, "
                  f"top {IDX_TOPK}",
            lambda qi=qi, wi=wi, ki=ki, off=off: dsa_ref.dsa_index_topk(qi, wi, ki, IDX_TOPK, off),
            (lambda qi=qi, wi=wi, ki=ki, off=off: kernels.dsa_index_topk(qi, wi, ki, IDX_TOPK, off))
            if on_mac else None,
            None, repeats,
        ))

    # Sparse MLA decode over the selected rows.
    mx.random.seed(4)
    K = min(IDX_TOPK, context)
    q_lat = mx.random.normal((1, MLA_HEADS, 1, MLA_RANK)).astype(dtype)
    q_pe = mx.random.normal((1, MLA_HEADS, 1, MLA_ROPE)).astype(dtype)
    latent = mx.random.normal((1, context, MLA_RANK)).astype(dtype)
    k_pe = mx.random.normal((1, context, MLA_ROPE)).astype(dtype)
    sel = mx.random.permutation(context)[:K].astype(mx.int32)[None]
    mx.eval(q_lat, q_pe, latent, k_pe, sel)
    args = (q_lat, q_pe, latent, k_pe, sel, MLA_SCALE)
    rows.append(_row(
        "sparse_mla_decode", f"{K} of {context} rows, {MLA_HEADS} heads, latent {MLA_RANK}",
        lambda: dsa_ref.sparse_mla_decode(*args),
        (lambda: kernels.sparse_mla_decode(*args)) if on_mac else None,
        None, repeats,
        lambda: _rel(kernels.sparse_mla_decode(*args), dsa_ref.sparse_mla_decode(*args)),
    ))
    return rows


# ------------------------------------------------------------------------ output


def print_kernels(ratio: Dict, rows: List[Dict], on_mac: bool) -> None:
    dev = mx.default_device()
    print(f"kernels (device {dev}; "
          + ("Metal kernels on the GPU" if on_mac else
             "no Metal here: kernel figures need a Mac, reference ops only") + ")")
    ok = "meets" if ratio["speedup"] >= 10 else "BELOW"
    print(f"KDA chunked reference vs per-token loop, {ratio['T']} tokens x {ratio['H']} heads x "
          f"head_dim {ratio['D']} (float32): loop {ratio['loop_s']:.2f} s, chunked "
          f"{ratio['chunked_s']:.3f} s, speed-up {ratio['speedup']:.1f}x ({ok} target >= 10x); "
          f"same output: max rel diff y {ratio['rel_y']:.1e}, state {ratio['rel_state']:.1e}")
    mlx_col = "mlx-lm gdn ms" if on_mac else "mlx-lm ops ms"
    print(f"{'op':18s} {'shape':48s} {'reference ms':>12s} {'kernel ms':>10s} "
          f"{mlx_col:>13s} {'kernel/ref':>10s}")
    for r in rows:
        ker = f"{r['kernel_ms']:10.3f}" if r["kernel_ms"] is not None else f"{'(Mac)':>10s}"
        mlx = f"{r['mlx_lm_ms']:13.3f}" if r["mlx_lm_ms"] is not None else f"{'-':>13s}"
        speed = (f"{r['ref_ms'] / r['kernel_ms']:9.2f}x" if r["kernel_ms"] else f"{'-':>10s}")
        line = f"{r['name']:18s} {r['shape']:48s} {r['ref_ms']:12.3f} {ker} {mlx} {speed}"
        if r["rel_err"] is not None:
            line += f"  (max rel err {r['rel_err']:.1e})"
        print(line)
    if not on_mac:
        print("mlx-lm ops = mlx_lm.models.gated_delta.gated_delta_ops (its CPU reference) at "
              "the KDA decode shape; run `kimi-mlx bench kernels` on a Mac for the Metal "
              "kernels and mlx-lm's gated-delta kernel.")
