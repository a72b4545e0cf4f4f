"""`make check-real`: Kimi K3.1 Pro at its real widths, checked on this machine.

Builds a slice of the real model (`kimi_mlx.testing.real_slice.build_real_slice`: layers [2, 4)
= one KDA layer and one Gated DSA layer at hidden 7168, 96 KDA heads of 128, MLA ranks
1536 / 512, 32 indexer heads of 128, index_topk 2048; 8 routed MXFP4 experts at their
real widths, 1 per token) in a temporary folder, loads it as a pipeline stage would
(`loader.load_model(start=2, end=4)`), and then:

1. prefills index_topk + 64 tokens in chunks with the reference ops (float32 activations,
   as the loader picks on a CPU), so the last chunk takes the sparse path (indexer top-k
   of 2048 out of more keys), then decodes a few tokens in BF16 from BF16 caches (what
   a Mac holds) through the sparse decode path;
2. runs each Metal kernel in the emulator at these widths on inputs taken from that run
   (kda_decode on all 96 heads with the state after the prompt, kda_prefill on some heads
   for a shorter stretch starting from a real state, dsa_index_topk on the decode query
   and the sparse prefill chunk's queries, sparse_mla_decode over the 2048 selected
   rows), and judges kernel and reference op alike against float64 NumPy oracles
   (`real_oracles`) with float32 rounding bounds; top-k sets may differ only at ties
   within rounding;
3. compares what the run used with what the planner (`placement.layer_bytes`, the numbers
   `kimi-mlx plan` places stages with) predicts for these layers: weights in memory,
   cache bytes at the final context, peak memory while decoding, and bytes read by one
   decode step (counted from the arrays the step touched: every weight but the experts
   the router did not pick, the index keys, the latent rows the indexer selected, the KDA
   states), each within 10%; and the prefill chunk's buffers against the headroom the
   planner keeps free on every stage (2 GiB at least);
4. repeats decode step 1 in float32 with the kernels dispatched by the model itself in
   the emulator, against the same step with the reference ops (`testing.check_kernels`).

Prints one line per check (value, reference, tolerance, result) and the time of each
phase; exits 1 if any check fails. The slice is deleted afterwards (unless --slice
names an existing one). Memory: about 2.4 GB of weights plus up to 2 GB of prefill buffers.
Each phase reports wall and CPU seconds: on a shared machine the CPU seconds, over the
cores available, say what an idle machine needs.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx
import numpy as np

from kimi_mlx.testing import real_oracles as ora
from kimi_mlx.testing.check_kernels import _snapshot, run_kernels, through_kernels
from kimi_mlx.testing.check_report import MB, Report, _np, tap  # noqa: F401  (tests: check_real.tap)


# --------------------------------------------------------------------------- run


def _cache_to(caches, dtype) -> None:
    """Cast activation-dtype cache entries (KDA conv state, DSA latent / rope / index keys)
    to `dtype`; the KDA recurrent state stays float32 (K31_SPEC.md s.4)."""
    for c in caches:
        if hasattr(c, "index_keys"):
            c.keys, c.values = c.keys.astype(dtype), c.values.astype(dtype)
            c.index_keys = c.index_keys.astype(dtype)
        else:
            c[0] = c[0].astype(dtype)
    mx.eval([_cache_arrays(c) for c in caches])


def _cache_arrays(c) -> List[mx.array]:
    if hasattr(c, "index_keys"):
        return [c.keys, c.values, c.index_keys]
    return [c[0], c[1]]


def _cache_used_bytes(c) -> int:
    """Bytes a cache holds for its tokens (DSA: offset rows; KDA: both states)."""
    if hasattr(c, "index_keys"):
        row = sum(a.shape[-1] * a.itemsize for a in (c.keys, c.values, c.index_keys))
        return c.offset * row
    return c[0].nbytes + c[1].nbytes


def _layer_of(name: str) -> Optional[int]:
    m = re.search(r"\.layers\.(\d+)\.", name)
    return int(m.group(1)) if m else None


class Inputs:
    """Random stage inputs: the partial sum h [1, L, D] and the banked AttnRes states
    [K, 1, L, D] a stage starting at layer `start` receives (K = ceil(start / block))."""

    def __init__(self, hidden: int, start: int, block: int, seed: int):
        self.hidden = hidden
        self.banks = -(-start // block) if block else 0
        self.rng = np.random.default_rng(seed)

    def next(self, n: int, dtype=mx.float32):
        h = self.rng.standard_normal((1, n, self.hidden), dtype=np.float32)
        raw = self.rng.standard_normal((self.banks, 1, n, self.hidden), dtype=np.float32)
        return mx.array(h).astype(dtype), (mx.array(raw).astype(dtype) if self.banks else None)


@dataclass
class Run:
    """What the phases of one check-real run hand to each other."""

    model: Any
    planned: list  # placement.layer_bytes.LayerBytes of the slice's layers
    caches: list
    feed: Inputs
    n_prompt: int
    heads: np.ndarray  # KDA heads the emulated kda_prefill runs on
    kda_prefill: Dict[str, Any] = field(default_factory=dict)
    index_blocks: List[Dict[str, Any]] = field(default_factory=list)
    decode: Dict[str, list] = field(default_factory=lambda: {"kda": [], "dsa": [], "route": []})
    first: Any = None  # (h, banks, cache snapshot) of decode step 1
    decode_peak: int = 0

    @property
    def eps(self) -> float:
        return self.model.args.rms_norm_eps

    @property
    def kda_layers(self) -> list:
        return [l for l in self.model.layers if l.is_kda]


def run_check(path: Path, start: int, end: int, opts, report: Report) -> None:
    """All checks on the slice at `path` (layers [start, end)), into `report`."""
    run = load_slice(path, start, end, opts, report)
    prefill(run, opts, report)
    decode(run, opts, report)
    planner_checks(run, opts, report)
    through_kernels(report, run.model, run.first, run.eps)
    run_kernels(report, opts, run.kda_prefill, run.index_blocks, run.decode, run.heads)


def load_slice(path: Path, start: int, end: int, opts, report: Report) -> Run:
    """Load layers [start, end) as a pipeline stage does; check the weights against the plan."""
    from kimi_mlx.placement.layer_bytes import model_bytes_from_config
    from kimi_mlx.checkpoint.loader import load_model

    config = json.loads((path / "config.json").read_text())
    if opts.index_topk:
        config["text_config"]["dsa_config"]["index_topk"] = opts.index_topk
        report.info("index_topk", f"{opts.index_topk}", "", "overridden: a development run")
    planned = list(model_bytes_from_config(config, str(path / "config.json")).layers[start:end])
    report.info("layers", f"[{start}, {end}): " + ", ".join(f"{l.index} {l.kind}" for l in planned))
    with report.phase("load"):
        gc.collect()
        mx.clear_cache()
        base = mx.get_active_memory()
        model, _, load = load_model(path, start, end, verbose=False)
        mx.clear_cache()
        weights = mx.get_active_memory() - base
    plan_w = sum(l.weight_bytes for l in planned)
    report.bytes_check("weights in memory after load", weights, plan_w, opts.tolerance)
    report.bytes_check("weight bytes read from shards", load.bytes_loaded, plan_w, opts.tolerance)
    args = model.args
    if opts.index_topk:
        args.index_topk = opts.index_topk
        for layer in model.layers:
            if not layer.is_kda:
                layer.self_attn.index_topk = opts.index_topk
    n_prompt = opts.prompt_tokens or args.index_topk + 64
    if n_prompt <= args.index_topk:
        report.fail("prompt length", f"{n_prompt} <= index_topk {args.index_topk}: no sparse path")
    H = args.linear_attn_config["num_heads"]
    heads = np.unique(np.linspace(0, H - 1, min(opts.kda_prefill_heads, H)).round().astype(int))
    feed = Inputs(args.hidden_size, start, args.attn_res_block_size or 0, opts.seed)
    return Run(model, planned, model.make_cache(), feed, n_prompt, heads)


def prefill(run: Run, opts, report: Report) -> None:
    """Prefill in chunks with the reference ops (float32 activations); keep the kernel
    inputs of one KDA stretch and of every sparse-prefill indexer block."""
    from kimi_mlx.model import dsa as dsa_mod
    from kimi_mlx.model import kda as kda_mod
    from kimi_mlx.model.attn_res import Banks
    from kimi_mlx.placement.planner import StagePlanner

    H = run.model.args.linear_attn_config["num_heads"]
    n_kda = max(len(run.kda_layers), 1)
    want_chunk = 1 if run.n_prompt > opts.chunk else 0  # a chunk that starts from a real state
    calls = [0]

    def keep_kda(a, out):
        chunk_no, calls[0] = calls[0] // n_kda, calls[0] + 1
        if run.kda_prefill or chunk_no != want_chunk:
            return
        T, sel = opts.kda_prefill_tokens, mx.array(run.heads)
        p = run.kda_prefill
        for k in ("q", "k", "v", "a", "b"):
            p[k] = _np(a[k][:, :T][:, :, sel])
        Dk = a["q"].shape[-1]
        p["A_log"] = _np(a["A_log"].reshape(-1))[run.heads]
        p["dt_bias"] = _np(a["dt_bias"].reshape(H, Dk))[run.heads]
        p["state"] = _np(a["state"][:, sel])
        p["lower_bound"], p["scale"] = a["lower_bound"], a["scale"]
        p["ref_o"] = _np(out[0][:, :T][:, :, sel])

    def keep_index_block(a, out):
        run.index_blocks.append({"q_idx": _np(a["q_idx"]), "weights": _np(a["weights"]),
                                 "k_idx": _np(a["k_idx"]), "topk": a["topk"],
                                 "offset": a["offset"], "ref_idx": _np(out)})

    with report.phase(f"prefill {run.n_prompt} tokens (chunks of {opts.chunk})"):
        gc.collect()
        mx.clear_cache()
        mx.reset_peak_memory()
        t0 = time.perf_counter()
        with tap(kda_mod, "kda_forward", keep_kda), \
                tap(dsa_mod, "dsa_prefill_indices", keep_index_block):
            for c0 in range(0, run.n_prompt, opts.chunk):
                h, raw = run.feed.next(min(opts.chunk, run.n_prompt - c0))
                out, _ = run.model.text.run_layers(h, Banks.from_stacked(raw, run.eps), run.caches)
                mx.eval(out, [_cache_arrays(c) for c in run.caches])
                del out, h, raw
        seconds = time.perf_counter() - t0
        peak = mx.get_peak_memory()
        gc.collect()
        mx.clear_cache()
        after = mx.get_active_memory()  # weights + float32 caches
    report.info("prefill speed", f"{run.n_prompt / seconds:.1f} tok/s", f"{seconds:.1f} s")
    if not run.index_blocks:
        report.fail("sparse prefill path taken", "dsa.dsa_prefill_indices never called")
    # The planner keeps at least `min_headroom_bytes` free per stage for activations and
    # prefill buffers (kimi_mlx/placement/planner.py); a prefill chunk's buffers must fit in it. On
    # this CPU they include float32 copies of BF16 weights, which a Mac does not make.
    headroom = StagePlanner().min_headroom_bytes
    report.check(f"prefill buffers (chunks of {opts.chunk})", f"{(peak - after) / MB:,.1f} MB",
                 f"{headroom / MB:,.1f} MB headroom", "<= planner's minimum headroom",
                 peak - after <= headroom)
    report.info("prefill peak memory", f"{peak / MB:,.1f} MB", f"{after / MB:,.1f} MB after",
                "weights + float32 caches + buffers")


def decode(run: Run, opts, report: Report) -> None:
    """Decode in BF16 from BF16 caches (what a Mac holds); keep step 1's kernel inputs,
    router choices and a snapshot of the caches before it; measure the peak memory."""
    _cache_to(run.caches, mx.bfloat16)
    gc.collect()
    mx.clear_cache()
    mx.reset_peak_memory()
    rec = run.decode
    t0 = time.perf_counter()
    with report.phase(f"decode {opts.decode_tokens} tokens (BF16)"):
        _decode_steps(run, opts, rec)
    seconds = time.perf_counter() - t0
    run.decode_peak = mx.get_peak_memory()
    report.info("decode speed (BF16)", f"{opts.decode_tokens / seconds:.2f} tok/s",
                f"{seconds:.1f} s")
    n_moe = sum(1 for l in run.model.layers if "block_sparse_moe" in l)
    n_dsa = sum(1 for l in run.model.layers if not l.is_kda)
    if (len(rec["kda"]), len(rec["dsa"]), len(rec["route"])) != (len(run.kda_layers), n_dsa, n_moe):
        report.fail("decode taps", f"kda {len(rec['kda'])}, dsa {len(rec['dsa'])}, "
                    f"route {len(rec['route'])} calls seen")


def _decode_steps(run: Run, opts, rec: Dict[str, list]) -> None:
    from kimi_mlx.model import dsa as dsa_mod
    from kimi_mlx.model import ffn as ffn_mod
    from kimi_mlx.model import kda as kda_mod
    from kimi_mlx.model.attn_res import Banks

    for step in range(opts.decode_tokens):
        h, raw = run.feed.next(1, mx.bfloat16)
        with contextlib.ExitStack() as ctx:
            if step == 0:
                run.first = (h, raw, [_snapshot(c) for c in run.caches])
                # The compiled KDA decode graph is traced once, so a tap would only see
                # placeholders: run step 1 uncompiled (train mode changes nothing else).
                for l in run.kda_layers:
                    l.self_attn.train()
                ctx.callback(lambda: [l.self_attn.eval() for l in run.kda_layers])
                ctx.enter_context(tap(kda_mod, "kda_forward", lambda a, o: rec["kda"].append(
                    ({k: _np(v) for k, v in a.items()}, _np(o[0])))))
                ctx.enter_context(tap(dsa_mod, "dsa_sparse_decode", lambda a, o: rec["dsa"].append(
                    ({k: _np(v) for k, v in a.items()}, _np(o)))))
                ctx.enter_context(tap(ffn_mod, "route", lambda a, o: rec["route"].append(
                    np.array(o[0]))))
            out, _ = run.model.text.run_layers(h, Banks.from_stacked(raw, run.eps), run.caches)
            mx.eval(out, [_cache_arrays(c) for c in run.caches])
        del out


def planner_checks(run: Run, opts, report: Report) -> None:
    """Cache bytes, decode peak memory and bytes read by decode step 1 vs the planner."""
    from mlx.utils import tree_flatten

    context = run.n_prompt + opts.decode_tokens
    context1 = run.n_prompt + 1  # context of decode step 1 (the one counted below)
    planned, caches = run.planned, run.caches
    plan_cache = sum(l.cache_bytes(context) for l in planned)
    used = sum(_cache_used_bytes(c) for c in caches)
    alloc = sum(sum(a.nbytes for a in _cache_arrays(c)) for c in caches)
    report.bytes_check(f"cache bytes at {context} tokens", used, plan_cache, opts.tolerance)
    report.info("cache bytes allocated", f"{alloc / MB:,.2f} MB",
                f"{plan_cache / MB:,.2f} MB (plan)", "KVCache grows in steps of 256 tokens")
    plan_resident = sum(l.resident_bytes(context) for l in planned)
    report.bytes_check("peak memory while decoding", run.decode_peak, plan_resident,
                       opts.tolerance)

    # Bytes read by decode step 1, counted from what it touched: every weight but the
    # experts the router did not pick; every index key; the latent + rope rows the indexer
    # selected; the KDA conv and recurrent states.
    moe_layers = [l.idx for l in run.model.layers if "block_sparse_moe" in l]
    picked = {i: len(np.unique(inds)) for i, inds in zip(moe_layers, run.decode["route"])}
    read = 0.0
    for name, arr in tree_flatten(run.model.parameters()):
        if ".switch_mlp." in name:
            read += arr.nbytes * picked.get(_layer_of(name), arr.shape[0]) / arr.shape[0]
        else:
            read += arr.nbytes
    dsa_calls = iter(run.decode["dsa"])
    for c in caches:
        if not hasattr(c, "index_keys"):
            read += c[0].nbytes + c[1].nbytes
            continue
        a, _ = next(dsa_calls, (None, None))
        if a is None:
            continue
        scores = ora.index_scores64(a["q_idx"], a["weights"], a["k_idx"], a["offset"])[0]
        n_sel = int(min(a["topk"], np.isfinite(scores).sum()))
        read += context1 * c.index_keys.shape[-1] * c.index_keys.itemsize
        read += n_sel * (c.keys.shape[-1] * c.keys.itemsize + c.values.shape[-1] * c.values.itemsize)
    plan_read = sum(l.read_bytes(context1) for l in planned)
    report.bytes_check(f"bytes read by one decode step at {context1}", read, plan_read,
                       opts.tolerance)


# ---------------------------------------------------------------------- tensor parallel


TP_LAYERS = (2, 4)  # kimi_mlx.testing.tp_real's START, END (not imported: it imports this)


def tensor_check(path: Path, start: int, end: int, opts, report: Report, workdir: str) -> None:
    """`python -m kimi_mlx.testing.tp_real` on this slice, in its own process (this one's
    model and buffers are not in the way, and it starts its ranks itself): 2 ranks vs
    one process, bytes loaded and read per decode step vs the planner. Its lines are
    printed as it runs; its exit status is one check here."""
    import subprocess

    from kimi_mlx.lifetime import child_env

    if (start, end) != TP_LAYERS:
        report.info("tensor parallel", "skipped", f"tp_real runs layers {list(TP_LAYERS)}, "
                    f"not [{start}, {end})")
        return
    with report.phase("tensor parallel: 2 ranks vs one process"):
        sys.stdout.flush()  # this process's lines before the child's
        try:
            # through `testing.watched`: it (and so its ranks) ends with this process
            rc = subprocess.run([sys.executable, "-m", "kimi_mlx.testing.watched",
                                 "kimi_mlx.testing.tp_real", "--path", str(path), "--workdir",
                                 workdir, "--seed", str(opts.seed)],
                                timeout=1800, env=child_env()).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    report.check("tensor parallel (2 ranks, layers sliced 48/48 heads)", "ok" if rc == 0 else
                 f"FAILED ({rc})", "one process; planner bytes", "tolerance(); 2%", rc == 0)


# ---------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimi_mlx.testing.check_real",
        description="Check K3.1 Pro's real widths on this machine: a real-width checkpoint "
        "slice through prefill past index_topk and decode (reference ops), the Metal "
        "kernels in the emulator, and the planner's memory and bytes-read predictions.")
    p.add_argument("--slice", type=Path, default=None,
                   help="use this slice folder (from kimi_mlx.testing.real_slice.build_real_slice) "
                   "instead of building one in a temporary folder; it is not deleted")
    p.add_argument("--layers", default="2:4",
                   help="layer range START:END, 0-based (default 2:4: KDA layer 2, DSA layer 3)")
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer (default 8)")
    p.add_argument("--experts-per-token", type=int, default=1,
                   help="default 1: MLX's CPU MXFP4 gather-matmul is several times slower "
                   "per FLOP than its float32 matmul, and each expert per token adds about "
                   "a fifth to the prefill")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length (default index_topk + 64, so the sparse path runs)")
    p.add_argument("--chunk", type=int, default=256,
                   help="prefill chunk in tokens (default 256: at 512 the Gated DSA layer's "
                   "dense-path buffers near 2048 keys reach the planner's 2 GiB headroom)")
    p.add_argument("--decode-tokens", type=int, default=3, help="default 3")
    p.add_argument("--kda-prefill-heads", type=int, default=24,
                   help="KDA heads the emulated kda_prefill runs on (default 24 of 96)")
    p.add_argument("--kda-prefill-tokens", type=int, default=64, help="default 64")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="allowed relative difference from the planner (default 0.10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tensor", action="store_true",
                   help="then split the same slice across 2 tensor-parallel ranks (MLX ring on "
                   "127.0.0.1) against one process, with each rank's bytes loaded and read "
                   "per decode step against the planner (kimi_mlx.testing.tp_real; `make "
                   "check-real` passes this)")
    p.add_argument("--index-topk", type=int, default=None, help=argparse.SUPPRESS)  # dev runs
    return p


def main(argv=None) -> int:
    opts = build_parser().parse_args(argv)
    try:
        start, end = (int(x) for x in opts.layers.split(":"))
    except ValueError:
        print(f"--layers: expected START:END, got {opts.layers!r}", file=sys.stderr)
        return 2
    report = Report()
    t0 = time.perf_counter()
    # A CI timeout sends SIGTERM: exit through the `with` so the 2.4 GB slice is removed.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        with tempfile.TemporaryDirectory(prefix="kimi-check-real-") as tmp:
            path = opts.slice
            if path is None:
                from kimi_mlx.testing.real_slice import build_real_slice

                with report.phase(f"build slice, layers [{start}, {end})"):
                    path = build_real_slice(Path(tmp) / "slice", start, end, opts.experts,
                                            opts.experts_per_token, opts.seed)
                    size = sum(f.stat().st_size for f in path.iterdir())
                report.info("slice on disk", f"{size / MB:,.1f} MB", str(path))
            run_check(Path(path), start, end, opts, report)
            if opts.tensor:
                tensor_check(Path(path), start, end, opts, report, tmp)
    finally:
        signal.signal(signal.SIGTERM, previous)
    report.print(time.perf_counter() - t0)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
