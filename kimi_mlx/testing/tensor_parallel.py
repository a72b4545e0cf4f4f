"""Tensor-parallel ranks on loopback for tests and benches: MLX's `ring` backend between
processes on 127.0.0.1, set up the way `mlx.launch` does (`MLX_RANK`, and `MLX_HOSTFILE`
naming a JSON list with one ["ip:port"] list per rank).

`run_ranks` starts the ranks with a hard timeout and always kills them; each rank runs
`python -m kimi_mlx.testing.tensor_parallel` (this module's `main`): join the group, load
the checkpoint (whole then `shard`, or only its slices with `--ranged`), generate greedily
for each prompt through mlx-lm's `generate_step`, recording every step's logits, and
write them with its loaded byte count to `<out>/rank<r>.npz`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from kimi_mlx.testing.ports import free_ports  # noqa: F401  (re-exported: the tensor tests import it from here)


def read_bytes() -> int:
    """Bytes this process has read through read(2)/pread(2) so far (`rchar` of
    /proc/self/io, page cache hits included: what a rank asked the files for)."""
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line")


def greedy(model, prompt: Sequence[int], max_tokens: int, prefill_step: int = 2048):
    """Greedy tokens and each step's logits through mlx-lm's `generate_step`.

    Returns (tokens [max_tokens] int, logits [max_tokens, vocab] float32 numpy): row i
    is the distribution token i was chosen from (the prompt's last position first).
    """
    from mlx_lm.generate import generate_step

    rows: List[mx.array] = []

    def record(tokens, logits):
        rows.append(logits.astype(mx.float32))
        return logits

    tokens = []
    for tok, _ in generate_step(mx.array(list(prompt)), model, max_tokens=max_tokens,
                                sampler=lambda lp: mx.argmax(lp, axis=-1),
                                logits_processors=[record], prefill_step_size=prefill_step):
        tokens.append(int(tok))
    logits = np.concatenate([np.array(r).reshape(1, -1) for r in rows[: len(tokens)]])
    return np.array(tokens), logits


def speculative_greedy(model, draft, prompt: Sequence[int], max_tokens: int, k: int):
    """Greedy speculative decoding (`kimi_mlx.speculative.loop`): (tokens [max_tokens],
    logprobs [max_tokens, vocab] float32 numpy, drafts accepted)."""
    from kimi_mlx.speculative.loop import speculative_generate_step

    tokens, rows, accepted = [], [], 0
    for tok, lp, from_draft in speculative_generate_step(
            list(prompt), model, draft, num_draft_tokens=k, max_tokens=max_tokens):
        tokens.append(int(tok))
        rows.append(np.array(lp.astype(mx.float32)).reshape(1, -1))
        accepted += bool(from_draft)
    return np.array(tokens), np.concatenate(rows), accepted


def step_read_bytes(model, prompt: Sequence[int]) -> Tuple[int, int]:
    """(bytes one greedy decode step after `prompt` reads on this rank, context), counted
    from the model's own arrays, not from the planner's arithmetic: every parameter's
    nbytes, of the routed experts only the ones the step's router picked, one embedding
    row; each KDA cache's conv and recurrent state; each DSA cache's index keys for the
    whole context and its latent + rope rows for min(context, index_topk)."""
    from mlx.utils import tree_flatten

    from kimi_mlx.model import ffn as ffn_mod
    from kimi_mlx.model.cache import DSACache

    cache = model.make_cache()
    mx.eval(model(mx.array([list(prompt)]), cache))
    picked: List[mx.array] = []
    real = ffn_mod.route

    def route(*a, **kw):
        out = real(*a, **kw)
        picked.append(out[0])
        return out

    ffn_mod.route = route
    try:
        mx.eval(model(mx.array([[int(prompt[-1])]]), cache))
    finally:
        ffn_mod.route = real
    moe = [l.idx for l in model.layers if "block_sparse_moe" in l]
    distinct = {i: len(set(np.array(p).reshape(-1).tolist())) for i, p in zip(moe, picked)}
    total = 0.0
    for path, p in tree_flatten(model.parameters()):
        if ".switch_mlp." in path:
            layer = int(path.split(".layers.")[1].split(".")[0])
            total += p.nbytes * distinct[layer] / p.shape[0]
        elif "embed_tokens" in path:
            total += p.nbytes / p.shape[0]
        else:
            total += p.nbytes
    ctx = 0
    for c in cache:
        if isinstance(c, DSACache):
            ctx = c.offset
            row = lambda a: a.shape[-1] * a.itemsize
            attended = min(ctx, model.args.index_topk)
            total += row(c.index_keys) * ctx + (row(c.keys) + row(c.values)) * attended
        else:
            total += c[0].nbytes + c[1].nbytes
    return int(total), ctx


def decode_tokens_per_s(model, prompt: Sequence[int], steps: int) -> float:
    """Greedy decode tokens/s after the prompt's prefill (mlx-lm's `generate_step`; the
    prefill and the first token excluded)."""
    from mlx_lm.generate import generate_step

    t0 = None
    n = 0
    for tok, _ in generate_step(mx.array(list(prompt)), model, max_tokens=steps + 1,
                                sampler=lambda lp: mx.argmax(lp, axis=-1)):
        int(tok)
        if t0 is None:
            t0 = time.perf_counter()
        else:
            n += 1
    return n / (time.perf_counter() - t0)


def count_collectives(model, prompt: Sequence[int]) -> Dict[str, float]:
    """Collectives one decode step issues ({"all_sum": n, "all_gather": m, "seconds": s}):
    the step is run uncompiled with `mx.distributed`'s functions counted, each one
    evaluated on its own (its input first) so that `seconds` is the time spent inside
    the collectives: the transfer plus the wait for the slower rank."""
    cache = model.make_cache()
    mx.eval(model(mx.array([list(prompt)]), cache))
    counts = {"all_sum": 0, "all_gather": 0}
    real = {k: getattr(mx.distributed, k) for k in counts}
    counts["seconds"] = 0.0

    def counted(name):
        def f(x, *a, **kw):
            counts[name] += 1
            mx.eval(x)
            t = time.perf_counter()
            out = real[name](x, *a, **kw)
            mx.eval(out)
            counts["seconds"] += time.perf_counter() - t
            return out
        return f

    mx.disable_compile()
    try:
        for k in counts:
            setattr(mx.distributed, k, counted(k))
        mx.eval(model(mx.array([[int(prompt[-1])]]), cache))
    finally:
        for k, f in real.items():
            setattr(mx.distributed, k, f)
        mx.enable_compile()
    return counts


def all_sum_floor(group, width: int, repeats: int = 50) -> float:
    """Seconds per bare all_sum of one decode token's activations [1, 1, width] float32
    (median of `repeats`), measured on this group."""
    x = mx.ones((1, 1, width), mx.float32)
    mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def write_hostfile(path: Path, ports: Sequence[int], host: str = "127.0.0.1") -> Path:
    """The ring backend's host list: one ["host:port"] entry per rank."""
    path.write_text(json.dumps([[f"{host}:{p}"] for p in ports]))
    return path


def run_ranks(ports: Sequence[int], args: Sequence[str], workdir: Path,
              timeout: float = 120.0, env: Optional[Dict[str, str]] = None,
              module: str = "kimi_mlx.testing.tensor_parallel") -> List[str]:
    """Run `python -m module` (this one's `main` by default) once per port (rank =
    position) with `args`; wait for all.

    Every process is stopped (SIGTERM, SIGKILL after 10 s) at `timeout` seconds or when
    the first one fails (a ring
    peer that never starts blocks the others forever). Each runs through
    `testing.watched`: SIGTERM / SIGHUP stop it cleanly, and it ends by itself when this
    process is gone (killed before its `finally` ran). Returns each rank's combined
    stdout/stderr. Raises RuntimeError naming the rank that failed or timed out, with
    its output's tail.
    """
    from kimi_mlx.lifetime import child_env

    hostfile = write_hostfile(workdir / "hosts.json", ports)
    procs, logs = [], []
    for rank in range(len(ports)):
        e = dict(os.environ, **(env or {}), MLX_RANK=str(rank), MLX_HOSTFILE=str(hostfile))
        log = open(workdir / f"rank{rank}.log", "w+b")
        logs.append(log)
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "kimi_mlx.testing.watched", module, *args],
            stdout=log, stderr=subprocess.STDOUT, env=child_env(e)))
    deadline = time.monotonic() + timeout
    failed = None
    try:
        while any(p.poll() is None for p in procs):
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if bad:
                failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
                break
            if time.monotonic() > deadline:
                failed = f"ranks still running after {timeout:.0f} s"
                break
            time.sleep(0.05)
        else:
            bad = [r for r, p in enumerate(procs) if p.returncode != 0]
            if bad:
                failed = f"rank {bad[0]} exited with {procs[bad[0]].returncode}"
    finally:
        from kimi_mlx.cluster.net.lifetime import stop_process

        for p in procs:  # SIGTERM first; SIGKILL only after the bound
            stop_process(p, 10.0, "a loopback tensor rank")
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read().decode(errors="replace"))
        log.close()
    if failed:
        tails = "\n".join(f"--- rank {r}\n{o[-3000:]}" for r, o in enumerate(outs))
        raise RuntimeError(f"{failed}\n{tails}")
    return outs


def load_tensor_parallel(model_dir, group, ranged: bool = False, lm_head: Optional[bool] = None):
    """(model, bytes read) for this rank: the whole checkpoint then `shard`, or with
    `ranged` only this rank's slices (`kimi_mlx.checkpoint.ranged.load_sharded`).

    Bytes read: `read_bytes()` around the load, after the modules it imports are
    imported (so it counts checkpoint files: tensors, index, headers, config), plus, for
    a ranged load, the bytes it copied out of an mmap of the files (column slices whose
    gaps are too wide to read through: `ranged.plan_slice`; rchar does not see those)."""
    import mlx_lm.utils  # noqa: F401  (quantize_like imports it on first use)
    import kimi_mlx.model.model  # noqa: F401  (the loaders import it on first use)

    from kimi_mlx.checkpoint.loader import load_model
    from kimi_mlx.checkpoint.ranged import load_sharded

    before = read_bytes()
    mapped = 0
    if ranged:
        model, report = load_sharded(model_dir, group, lm_head=lm_head)
        mapped = report["mapped"]
    else:
        model, _, _ = load_model(model_dir, verbose=False)
        model.shard(group, lm_head=lm_head)
        mx.eval(model.parameters())
    return model, read_bytes() - before + mapped


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompts", required=True, help="JSON list of token id lists")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--prefill-step", type=int, default=2048)
    p.add_argument("--ranged", action="store_true", help="read only this rank's slices")
    p.add_argument("--out", required=True, help="folder for rank<r>.npz")
    p.add_argument("--draft", default=None,
                   help="speculative decoding with this draft, replicated on every rank "
                        "(each rank drafts the same tokens from the same inputs)")
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--repeats", type=int, default=3, help="(bench) timed decode runs")
    p.add_argument("--read-bytes", action="store_true",
                   help="also count the bytes one decode step after the first prompt reads")
    p.add_argument("--bench-decode", type=int, default=0,
                   help="(bench) instead of generating: decode tokens/s over N steps after "
                        "the first prompt, collectives per step, the bare all_sum floor")
    p.add_argument("--plant-error", action="store_true",
                   help="(tests) the last rank reverses its first KDA layer's dt_bias slice")
    p.add_argument("--kv-bits", type=int, default=0, help="8: 8-bit DSA caches (`--kv-bits`)")
    a = p.parse_args(argv)
    group = mx.distributed.init(backend="ring", strict=True)
    print(f"rank {group.rank()} joined", flush=True)  # past the ring's init (harness tests)
    model, loaded = load_tensor_parallel(a.model, group, ranged=a.ranged)
    model.set_kv_quant(a.kv_bits or None)
    if a.plant_error and group.rank() == group.size() - 1:
        attn = next(l.self_attn for l in model.layers if l.is_kda)
        attn.dt_bias = attn.dt_bias[::-1]
    res: Dict[str, np.ndarray] = {"loaded_bytes": np.array(loaded)}
    if a.bench_decode:
        prompt = json.loads(a.prompts)[0]
        counts = count_collectives(model, prompt)
        hidden = model.args.hidden_size
        res.update(
            tokens_per_s=np.array([decode_tokens_per_s(model, prompt, a.bench_decode)
                                   for _ in range(a.repeats)]),
            all_sums=np.array(counts["all_sum"]), all_gathers=np.array(counts["all_gather"]),
            collective_s=np.array(counts["seconds"]),
            floor_s=np.array(all_sum_floor(group, hidden)))
        res["step_read_bytes"], res["step_context"] = map(np.array, step_read_bytes(model, prompt))
        np.savez(Path(a.out) / f"rank{group.rank()}.npz", **res)
        return
    t0 = time.perf_counter()
    draft = None
    if a.draft:
        from kimi_mlx.checkpoint.loader import load_model

        draft, _, _ = load_model(a.draft, verbose=False)
    for i, prompt in enumerate(json.loads(a.prompts)):
        if draft is not None:
            toks, logits, acc = speculative_greedy(model, draft, prompt, a.max_tokens,
                                                   a.num_draft)
            res[f"accepted{i}"] = np.array(acc)
        else:
            toks, logits = greedy(model, prompt, a.max_tokens, a.prefill_step)
        res[f"tokens{i}"], res[f"logits{i}"] = toks, logits
    res["seconds"] = np.array(time.perf_counter() - t0)
    if a.read_bytes:
        read, ctx = step_read_bytes(model, json.loads(a.prompts)[0])
        res["step_read_bytes"], res["step_context"] = np.array(read), np.array(ctx)
    np.savez(Path(a.out) / f"rank{group.rank()}.npz", **res)


if __name__ == "__main__":
    main()
