"""`make bench` (cluster part): three stage processes on loopback against one process.

Prints, from one run on the same checkpoint:

- decode: ms per token in one process (mlx-lm `generate_step`) and through the 3-stage
  pipeline, and the difference per hop (3 hops per step: stage 0 -> 1 -> 2 -> head;
  plus the token going into stage 0: 4 messages). Target: under 1 ms per hop.
- prefill: prompt tokens/s through the same 3 stages with chunks sent back to back
  (pipelined: stage i works on chunk c while stage i + 1 works on chunk c - 1) against
  one chunk at a time (sequential: each chunk clears the last stage before the next is
  sent), and in one process for reference. Target: pipelined >= 2x sequential.

Each stage stands for one Mac, so by default each stage process gets one BLAS thread
(`--stage-threads`); on a machine with fewer cores than stages the pipelined figure is
bounded by the cores, not by the pipeline (printed with the result).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _threads_env(n: int) -> dict:
    return {"OPENBLAS_NUM_THREADS": str(n), "OMP_NUM_THREADS": str(n)}


def main(argv=None) -> int:
    """Run the cluster bench (see the module doc); prints the figures."""
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.cluster.bench.pipeline", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: a mid-size random one, built)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=128)
    p.add_argument("--decode-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stage-threads", type=int, default=1,
                   help="BLAS threads per process (each stage stands for one Mac); 0 = library default")
    args = p.parse_args(argv)
    if args.stage_threads and os.environ.get("OPENBLAS_NUM_THREADS") != str(args.stage_threads):
        # BLAS reads its thread count at load time: re-run with it set (same for the head,
        # whose one-process figures are the reference).
        os.execve(sys.executable, [sys.executable, "-m", "kimi_mlx.cluster.bench.pipeline"] + sys.argv[1:],
                  dict(os.environ, **_threads_env(args.stage_threads)))
    from kimi_mlx.cluster.net.lifetime import Stopped, exit_on_signals

    exit_on_signals()  # SIGTERM / SIGHUP: the stages stopped and the folder removed
    try:
        with tempfile.TemporaryDirectory(prefix="kimi-mlx-cluster-bench-") as tmp:
            return _run(args, Path(tmp))
    except Stopped as e:
        print(f"cluster bench: stopped ({e})", flush=True)
        return 128 + e.signum


def _run(args, tmp: Path) -> int:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    from kimi_mlx.checkpoint.loader import load_model

    from kimi_mlx.cluster.head.pipeline import Pipeline
    from kimi_mlx.cluster.net.session import prefill_chunks

    from kimi_mlx.cluster.net.nodes import check_nodes

    from kimi_mlx.cluster.head.plan import plan_stages
    from kimi_mlx.sampling import Sampling
    from kimi_mlx.testing.cluster import LocalCluster
    from kimi_mlx.cluster.head.transport import GrpcTransport

    if args.model:
        ckpt = Path(args.model)
    else:
        from kimi_mlx.bench.model import bench_text_config
        from kimi_mlx.testing.checkpoints import build_checkpoint

        ckpt = build_checkpoint(tmp / "bench", text_config=bench_text_config(), seed=0)
    env = _threads_env(args.stage_threads) if args.stage_threads else None
    cluster = LocalCluster(tmp, 3, prefix="bench", ckpt=ckpt, env=env)
    secret, fp = cluster.secret, cluster.fp
    t = GrpcTransport(secret, peer_timeout=30)
    try:
        nodes = cluster.nodes()
        accepted, rejected = check_nodes(nodes, t.stub_for, fp)
        if rejected:
            raise RuntimeError(rejected)
        plan, stages = plan_stages(ckpt, [n for n, _ in accepted], args.prompt_tokens + 256)
        if len(stages) < 3:  # a model small enough for one node: split it evenly
            from kimi_mlx.model.config import ModelArgs, read_config

            from kimi_mlx.cluster.head.transport import StageAssignment

            L = ModelArgs.from_config(read_config(ckpt)).num_hidden_layers
            cut = [0, L // 3, 2 * L // 3, L]
            stages = [StageAssignment(nodes_[0], cut[i], cut[i + 1])
                      for i, nodes_ in enumerate([[n] for n, _ in accepted])]
        t.load(fp, stages, "float32", "float32")
        single, _, _ = load_model(ckpt, verbose=False)
        vocab = single.args.vocab_size
        pipe = Pipeline(t, prefill_chunk=args.chunk)
        print(f"kimi-mlx cluster bench: {ckpt.name} ({single.args.num_hidden_layers} layers, "
              f"hidden {single.args.hidden_size}), 3 stage processes on loopback "
              f"{[f'[{s.start},{s.end})' for s in stages]}, float32 activations, "
              f"{args.stage_threads or 'default'} BLAS thread(s) per process, "
              f"{os.cpu_count()} CPU cores")

        # -- decode -------------------------------------------------------------------
        prompt = [(13 * i + 7) % (vocab - 300) + 1 for i in range(16)]
        n = args.decode_tokens

        def per_token(gen) -> float:
            stamps = []
            for _ in range(n):
                next(gen)
                stamps.append(time.perf_counter())
            gen.close()
            gaps = [b - a for a, b in zip(stamps[1:], stamps[2:])]
            return statistics.median(gaps)

        one, three = [], []
        for r in range(args.repeats + 1):  # the first round warms up (compile, caches)
            a = per_token(generate_step(mx.array(prompt), single, max_tokens=n))
            b = per_token(pipe.generate(prompt, Sampling(), n))
            if r:
                one.append(a)
                three.append(b)
        d_one, d_three = statistics.median(one), statistics.median(three)
        hops = 3
        added = (d_three - d_one) * 1e3
        print(f"decode: one process {d_one * 1e3:.2f} ms/token, 3-stage pipeline "
              f"{d_three * 1e3:.2f} ms/token: +{added:.2f} ms per step = "
              f"+{added / hops:.2f} ms per hop ({hops} hops, {hops + 1} messages per step; "
              f"target < 1 ms per hop: {'met' if added / hops < 1 else 'NOT met'})")

        # -- prefill ------------------------------------------------------------------
        P = args.prompt_tokens
        long_prompt = [(31 * i + 11) % (vocab - 300) + 1 for i in range(P + 1)]

        def ttft(pipelined: bool) -> float:
            t0 = time.perf_counter()
            next(pipe.generate(long_prompt, Sampling(), 1, pipelined=pipelined))
            return time.perf_counter() - t0

        def one_process() -> float:
            cache = single.make_cache()
            t0 = time.perf_counter()
            for off, k in prefill_chunks(P + 1, args.chunk):
                single(mx.array([long_prompt[off:off + k]]), cache)
                mx.eval([c.state for c in cache])
            return time.perf_counter() - t0

        seq_t, pip_t, one_t = [], [], []
        for r in range(args.repeats + 1):
            s, q, o = ttft(False), ttft(True), one_process()
            if r:
                seq_t.append(s)
                pip_t.append(q)
                one_t.append(o)
        s, q, o = (statistics.median(x) for x in (seq_t, pip_t, one_t))
        speedup = s / q
        print(f"prefill ({P} tokens, chunks of {args.chunk}): one process {P / o:.0f} tokens/s; "
              f"3 stages sequential {P / s:.0f} tokens/s, pipelined {P / q:.0f} tokens/s: "
              f"{speedup:.2f}x (target >= 2x: {'met' if speedup >= 2 else 'NOT met'})")
        cores = os.cpu_count() or 1
        if cores < 3:
            print(f"note: {cores} CPU core(s) for 3 stages: pipelining cannot exceed {cores}x here "
                  "(on a cluster each stage has its own Mac)")
        return 0
    finally:
        t.shutdown()
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
