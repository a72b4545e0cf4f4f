"""Tensor parallelism at K3.1's real widths: a 2-rank slice against one process.

`python -m kimi_mlx.testing.tp_real` builds (or takes with `--path`) the real-width
checkpoint slice of `make check-real` (`real_slice.build_real_slice`: KDA layer 2 and
Gated DSA layer 3 at hidden 7168, 96 KDA heads of 128, 96 MLA heads, MXFP4 experts
3584 -> 3072 -> 3584, 8 of them), then:

- runs the two layers in this process and in 2 ranks over MLX's ring backend on
  127.0.0.1 (each rank loading only its slices: KDA heads 48 / 48, MLA heads 48 / 48,
  expert and shared-expert intermediate dims 1536 / 1536 and 3072 / 3072), on the same
  random stage inputs (`check_real.Inputs`): a prefill in chunks past `--index-topk`
  (the indexer's sparse path), then decode steps;
- compares every output with `tolerance()` (depth 2, float32 throughout);
- compares each rank's bytes read by the last decode step (counted from its arrays and
  its router's picks: `step_bytes`) with the planner's `rank_read_bytes`, within 2%;
- compares each rank's bytes read from the shards (`/proc/self/io` rchar, minus config,
  index and headers, plus the bytes of the column slices copied from an mmap, which
  rchar does not see) with the planner's `rank_load_bytes`, within 2%.

Needs about 6 GB of memory (the whole slice here, half of it in each rank) and a few
minutes on 2 busy cores. Exit status 0 when every check passes.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import numpy as np

START, END = 2, 4  # check_real.TP_LAYERS


def run_slice(model, tokens: int, chunk: int, decode: int, seed: int,
              keep: Optional[list] = None) -> List[np.ndarray]:
    """Outputs (float32) of layers [START, END) of `model` on seeded random stage inputs:
    the last prefill chunk's, then each decode step's. `keep`: a list the cache is
    appended to."""
    from kimi_mlx.model.attn_res import Banks
    from kimi_mlx.testing.check_real import Inputs

    args = model.args
    feed = Inputs(args.hidden_size, START, args.attn_res_block_size or 0, seed)
    cache = model.make_cache()
    if keep is not None:
        keep.append(cache)
    outs = []
    for c0 in range(0, tokens, chunk):
        h, raw = feed.next(min(chunk, tokens - c0))
        out, _ = model.text.run_layers(h, Banks.from_stacked(raw, args.rms_norm_eps), cache)
        mx.eval(out)
    outs.append(np.array(out))
    for _ in range(decode):
        h, raw = feed.next(1)
        out, _ = model.text.run_layers(h, Banks.from_stacked(raw, args.rms_norm_eps), cache)
        outs.append(np.array(out))
    return outs


def _set_topk(model, topk: int) -> None:
    model.args.index_topk = topk
    for layer in model.layers:
        if not layer.is_kda:
            layer.self_attn.index_topk = topk


def _metadata_bytes(path: Path) -> int:
    total = (path / "config.json").stat().st_size
    total += (path / "model.safetensors.index.json").stat().st_size
    for shard in path.glob("*.safetensors"):
        with open(shard, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


def worker(a) -> None:
    """One rank: load its slices, run the slice, save outputs and bytes read."""
    import kimi_mlx.model.model  # noqa: F401  (imported before counting bytes read)
    import mlx_lm.utils  # noqa: F401
    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.model import ffn as ffn_mod
    from kimi_mlx.testing.tensor_parallel import read_bytes

    group = mx.distributed.init(backend="ring", strict=True)
    before = read_bytes()
    model, report = load_sharded(a.path, group, start=START, end=END)
    loaded = read_bytes() - before + report["mapped"]  # rchar does not see mmap copies
    _set_topk(model, a.index_topk)
    layer = model.layers[0]
    shapes = {"kda_heads": layer.self_attn.num_heads,
              "mla_heads": model.layers[1].self_attn.num_heads,
              "expert_inter": layer.block_sparse_moe.switch_mlp.gate_proj.weight.shape[-2]}
    t0 = time.perf_counter()
    picks, kept = [], []
    real = ffn_mod.route

    def route(*args, **kw):
        out = real(*args, **kw)
        picks.append(out[0])
        return out

    ffn_mod.route = route
    try:
        outs = run_slice(model, a.tokens, a.chunk, a.decode, a.seed, kept)
    finally:
        ffn_mod.route = real
    seconds = time.perf_counter() - t0
    step, ctx = step_bytes(model, picks, kept[0])
    np.savez(Path(a.out) / f"rank{group.rank()}.npz", loaded=loaded, seconds=seconds,
             step_bytes=step, step_context=ctx, **shapes,
             **{f"out{i}": o for i, o in enumerate(outs)})


def step_bytes(model, picks: List[mx.array], cache) -> tuple:
    """(bytes the last decode step read on this rank, its context), counted from the
    rank's own arrays: every parameter, of the stacked routed experts only the distinct
    ones the step's router picked (`picks`: every `route` call's indices, the last one
    per MoE layer being that step's), each KDA cache's conv and recurrent state, each DSA
    cache's index keys for the whole context and its latent + rope rows for
    min(context, index_topk)."""
    from mlx.utils import tree_flatten

    moe = [l.idx for l in model.layers if "block_sparse_moe" in l]
    last = picks[-len(moe):]
    distinct = {i: len(set(np.array(p).reshape(-1).tolist())) for i, p in zip(moe, last)}
    total = 0.0
    for path, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in path:
            layer = int(path.split(".layers.")[1].split(".")[0])
            total += p.nbytes * distinct[layer] / p.shape[0]
        else:
            total += p.nbytes
    ctx = 0
    for c in cache:
        if hasattr(c, "index_keys"):
            ctx = c.offset
            row = lambda x: x.shape[-1] * x.itemsize
            total += row(c.index_keys) * ctx + (row(c.keys) + row(c.values)) * min(
                ctx, model.args.index_topk)
        else:
            total += c[0].nbytes + c[1].nbytes
    return int(total), ctx


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--path", default=None, help="an existing real slice (default: build one)")
    p.add_argument("--workdir", default=None, help="where to build it (default: a temp dir)")
    p.add_argument("--tokens", type=int, default=96, help="prompt tokens (default 96)")
    p.add_argument("--chunk", type=int, default=48, help="prefill chunk (default 48)")
    p.add_argument("--decode", type=int, default=3, help="decode steps (default 3)")
    p.add_argument("--index-topk", type=int, default=32,
                   help="index_topk for this run (default 32 < the prompt: the sparse path)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--port", type=int, default=None,
                   help="first of 2 ports for the ranks (default: 2 free ones)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a)
        return 0

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.placement.tensor_parallel import rank_load_bytes, rank_read_bytes, tensors_of
    from kimi_mlx.testing.checkpoints import rel_err, tolerance, reduction_length
    from kimi_mlx.testing.real_slice import build_real_slice
    from kimi_mlx.testing.tensor_parallel import run_ranks

    tmp = tempfile.TemporaryDirectory(prefix="kimi-tp-real-", dir=a.workdir)
    work = Path(tmp.name)
    try:
        path = Path(a.path) if a.path else None
        if path is None:
            t0 = time.perf_counter()
            path = build_real_slice(work / "slice", START, END)
            print(f"built the real-width slice in {time.perf_counter() - t0:.0f} s: {path}")
        ok = True
        t0 = time.perf_counter()
        from kimi_mlx.testing.tensor_parallel import free_ports

        ports = [a.port, a.port + 1] if a.port else free_ports(2)
        run_ranks(ports,
                  ["--worker", "--path", str(path), "--tokens", str(a.tokens), "--chunk",
                   str(a.chunk), "--decode", str(a.decode), "--index-topk", str(a.index_topk),
                   "--seed", str(a.seed), "--out", str(work)],
                  work, timeout=1200, module="kimi_mlx.testing.tp_real")
        print(f"2 ranks: {time.perf_counter() - t0:.0f} s")
        ranks = [dict(np.load(work / f"rank{r}.npz")) for r in (0, 1)]
        model, _, _ = load_model(path, START, END, verbose=False)
        _set_topk(model, a.index_topk)
        t0 = time.perf_counter()
        ref = run_slice(model, a.tokens, a.chunk, a.decode, a.seed)
        print(f"one process: {time.perf_counter() - t0:.0f} s")
        args = model.args
        del model
        tol = tolerance(END - START, reduction_length(args, a.tokens + a.decode))
        for r, res in enumerate(ranks):
            print(f"rank {r}: KDA heads {int(res['kda_heads'])} of "
                  f"{args.linear_attn_config['num_heads']}, MLA heads {int(res['mla_heads'])} of "
                  f"{args.num_attention_heads}, expert intermediate {int(res['expert_inter'])} of "
                  f"{args.moe_intermediate_size}")
            for i, want in enumerate(ref):
                err = rel_err(res[f"out{i}"], want)
                what = "prefill" if i == 0 else f"decode {i}"
                good = err < tol
                ok &= good
                print(f"  {what}: rel err {err:.2e} (tolerance {tol:.2e}) {'ok' if good else 'FAIL'}")
        _, tensors = tensors_of(str(path))
        meta = _metadata_bytes(path)
        whole = rank_load_bytes(tensors, args, 1, 0)
        for r, res in enumerate(ranks):
            got = int(res["loaded"]) - meta
            want = rank_load_bytes(tensors, args, 2, r)
            good = abs(got - want) <= 0.02 * want
            ok &= good
            print(f"rank {r}: read {got:,} B of tensors, planner {want:,} B "
                  f"({100 * (got / want - 1):+.2f}%), whole slice {whole:,} B "
                  f"({got / whole:.3f} of it) {'ok' if good else 'FAIL'}")
            ctx = int(res["step_context"])
            got = int(res["step_bytes"])
            want = rank_read_bytes(tensors, args, 2, r, ctx, act_bytes=4, layers=(START, END))
            good = abs(got - want) <= 0.02 * want
            ok &= good
            print(f"rank {r}: one decode step at {ctx} tokens read {got:,} B, planner "
                  f"{want:,} B ({100 * (got / want - 1):+.2f}%) {'ok' if good else 'FAIL'}")
        print("tensor parallel real-width check: " + ("ok" if ok else "FAILED"))
        return 0 if ok else 1
    finally:
        tmp.cleanup()


if __name__ == "__main__":
    raise SystemExit(main())
