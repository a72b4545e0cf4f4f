"""`make check-real`'s kernel checks (`kimi_mlx.testing.check_real`, step 4): decode step 1
repeated in float32 with the kernels the model dispatches itself (in the emulator) against
the same step with the reference ops, and each Metal kernel run on the real slice's inputs
(KDA decode / prefill, the DSA index top-k, sparse MLA decode) against its reference
(`kimi_mlx.testing.real_oracles`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np

from kimi_mlx.testing import real_oracles as ora
from kimi_mlx.testing.check_report import Report, tap


def _snapshot(c):
    """Copies of a cache's arrays (a KVCache updates its buffers in place)."""
    if hasattr(c, "index_keys"):
        return ("dsa", c.keys + 0, c.values + 0, c.index_keys + 0, c.offset)
    return ("kda", c[0] + 0, c[1] + 0)


def _restore(model, snaps, dtype):
    """Fresh caches holding the snapshot's arrays in `dtype` (KDA state stays float32)."""
    caches = model.make_cache()
    for c, s in zip(caches, snaps):
        if s[0] == "dsa":
            c.keys, c.values, c.index_keys = (a.astype(dtype) for a in s[1:4])
            c.offset = s[4]
        else:
            c[0], c[1] = s[1].astype(dtype), s[2]
    return caches


# A decode step in float32 through the kernels vs through the reference ops: both compute
# the same math in float32 in different orders. The longest reduction in the step is the
# 12288-wide o_proj / KDA output (the rest are shorter: 7168, 6144, 3584, 2048 keys), so a
# value moves by at most n u = 12288 x 2^-24 = 7.3e-4 of the magnitude it sums; taken
# relative to the largest output value.
F32_STEP_RTOL = 12288 * ora.U32


def through_kernels(report: Report, model, first, eps: float) -> None:
    """Repeat decode step 1 from the same caches in float32, once with the reference ops
    and once with the kernels dispatched in the emulator (the model's own dispatch:
    kda_decode, dsa_index_topk, sparse_mla_decode), and compare the stage outputs. Judged
    only when both pick the same experts (a near-tie router flip changes the output)."""
    from kimi_mlx.model import ffn as ffn_mod
    from kimi_mlx.model.attn_res import Banks
    from kimi_mlx.metal.dispatch import use_sim

    h, raw, snaps = first
    h = h.astype(mx.float32)
    raw = None if raw is None else raw.astype(mx.float32)
    outs, routes = [], []
    with report.phase("emulator: decode step 1 in float32 through the model's dispatch"):
        for sim in (False, True):
            caches = _restore(model, snaps, mx.float32)
            picked: List[np.ndarray] = []
            with contextlib.ExitStack() as ctx:
                if sim:
                    ctx.enter_context(use_sim())
                ctx.enter_context(tap(ffn_mod, "route", lambda a, o: picked.append(np.array(o[0]))))
                out, _ = model.text.run_layers(h, Banks.from_stacked(raw, eps), caches)
                mx.eval(out)
            outs.append(ora.f64(out))
            routes.append(picked)
    same = len(routes[0]) == len(routes[1]) and all(
        np.array_equal(np.sort(a, axis=-1), np.sort(b, axis=-1)) for a, b in zip(*routes))
    ref, got = outs
    err, scale = float(np.abs(got - ref).max()), float(np.abs(ref).max())
    name = "decode step (float32), kernels vs reference ops"
    if not np.all(np.isfinite(got)):
        report.fail(name, "non-finite output")
    elif same:
        report.check(name, f"max err {err:.2e}", f"max |ref| {scale:.2e}",
                     f"{F32_STEP_RTOL * scale:.2e} (12288 u)", err <= F32_STEP_RTOL * scale)
    else:
        report.info(name, f"max err {err:.2e}", f"max |ref| {scale:.2e}",
                    "not judged: the router picked other experts (near tie)")


def run_kernels(report: Report, opts, kda_prefill, index_blocks, decode, heads) -> None:
    """Each kernel in the emulator on inputs taken from the run, judged (with its
    reference op alongside) against the float64 oracles of `real_oracles`."""
    if decode["kda"]:
        check_kda_decode(report, decode["kda"][0][0])
    if kda_prefill:
        check_kda_prefill(report, kda_prefill, len(heads))
    elif decode["kda"]:  # KDA layers decoded, but no prefill call was seen
        report.fail("kda_prefill capture", "kimi_mlx.model.kda.kda_forward was not seen in prefill")
    rows = [dict(q_idx=a["q_idx"], weights=a["weights"], k_idx=a["k_idx"], topk=a["topk"],
                 offset=a["offset"], ref_idx=None) for a, _ in decode["dsa"]]
    if rows or index_blocks:
        check_index_topk(report, rows + list(index_blocks))
    if decode["dsa"]:
        check_sparse_mla_decode(report, decode["dsa"][0][0])


def _f32(x) -> mx.array:
    return mx.array(np.asarray(x, dtype=np.float32))


def check_kda_decode(report: Report, a: Dict[str, Any]) -> None:
    """kda_decode on all heads for one token from the state after the prompt."""
    from kimi_mlx.metal import kda as kda_ops
    from kimi_mlx.metal import kernels
    from kimi_mlx.metal.dispatch import use_sim

    with report.phase("emulator: kda_decode (all heads)"):
        ins = [_f32(a[k]) for k in ("q", "k", "v", "a", "b", "A_log", "dt_bias", "state")]
        H = ins[0].shape[2]
        ins[5], ins[6] = ins[5].reshape(H), ins[6].reshape(H, -1)
        lb, scale = a["lower_bound"], a["scale"]
        q, k, g, beta = ora.kda_prepare64(ins[0], ins[1], ins[3], ins[4], ins[5], ins[6], lb, scale)
        want = ora.kda_recurrence64(q, k, ins[2], g, beta, ins[7])
        with use_sim():
            y, s = kernels.kda_decode(*ins, lower_bound=lb, scale=scale)
            mx.eval(y, s)
        y_ref, _ = kda_ops.kda_decode(*ins, lower_bound=lb, scale=scale)
    shape = f"[1, 1, {H}, {ins[0].shape[-1]}]"
    report.error_check(f"kda_decode kernel {shape}: output",
                       *ora.max_excess(y, want["o"], want["o_tol"]))
    report.error_check("kda_decode kernel: state",
                       *ora.max_excess(s, want["state"], want["state_tol"]))
    report.error_check("kda_decode reference op: output",
                       *ora.max_excess(y_ref, want["o"], want["o_tol"]))


def check_kda_prefill(report: Report, p: Dict[str, Any], n_heads: int) -> None:
    """kda_prefill on some heads for a stretch of tokens from a real incoming state."""
    from kimi_mlx.metal import kda as kda_ops
    from kimi_mlx.metal import kernels
    from kimi_mlx.metal.dispatch import use_sim

    T = p["q"].shape[1]
    with report.phase(f"emulator: kda_prefill ({n_heads} heads x {T} tokens)"):
        q, k, g, beta = kda_ops.kda_prepare(
            _f32(p["q"]), _f32(p["k"]), _f32(p["a"]), _f32(p["b"]), _f32(p["A_log"]),
            _f32(p["dt_bias"]), p["lower_bound"], p["scale"])
        v, state = _f32(p["v"]), _f32(p["state"])
        C = 16  # the kernel's and kda_chunked's chunk: in-chunk products add C (log2 C + 2)
        want = ora.kda_recurrence64(q, k, v, g, beta, state,
                                    extra_terms=16 + C * (int(np.log2(C)) + 2))
        with use_sim():
            y, s = kernels.kda_prefill(q, k, v, g, beta, state)
            mx.eval(y, s)
        y_chunked, _ = kda_ops.kda_chunked(q, k, v, g, beta, state)
    shape = f"[1, {T}, {n_heads}, {q.shape[-1]}]"
    report.error_check(f"kda_prefill kernel {shape}: output",
                       *ora.max_excess(y, want["o"], want["o_tol"]))
    report.error_check("kda_prefill kernel: state",
                       *ora.max_excess(s, want["state"], want["state_tol"]))
    report.error_check("kda_chunked reference op: output",
                       *ora.max_excess(y_chunked, want["o"], want["o_tol"]))
    report.error_check("model's prefill (reference) output",
                       *ora.max_excess(_f32(p["ref_o"]), want["o"], want["o_tol"]))


def check_index_topk(report: Report, rows: List[Dict[str, Any]]) -> None:
    """dsa_index_topk on the decode query and the sparse prefill blocks: the selected
    sets may differ from the float64 top-k only at ties within float32 rounding."""
    from kimi_mlx.metal import dsa as dsa_ops
    from kimi_mlx.metal import kernels
    from kimi_mlx.metal.dispatch import use_sim

    n_q = sum(r["q_idx"].shape[1] for r in rows)
    S = max(r["k_idx"].shape[1] for r in rows)
    kern = {"rows": 0, "bad_rows": 0, "swaps": 0, "worst": 0.0}
    ref = dict(kern)
    with report.phase(f"emulator: dsa_index_topk ({n_q} queries, up to {S} keys)"):
        for r in rows:
            ins = (_f32(r["q_idx"]), _f32(r["weights"]), _f32(r["k_idx"]), r["topk"], r["offset"])
            scores, tol = ora.index_scores64(r["q_idx"], r["weights"], r["k_idx"], r["offset"])
            with use_sim():
                idx = np.array(kernels.dsa_index_topk(*ins))
            ref_idx = r["ref_idx"]
            if ref_idx is None:
                ref_idx = np.array(dsa_ops.dsa_index_topk(*ins))
            for acc, got in ((kern, idx), (ref, ref_idx)):
                rep = ora.selection_report(got, scores, tol, r["topk"])
                for key in ("rows", "bad_rows", "swaps"):
                    acc[key] += rep[key]
                acc["worst"] = max(acc["worst"], rep["worst"])
    for label, acc in (("dsa_index_topk kernel", kern), ("dsa_index_topk reference op", ref)):
        report.check(f"{label}: top-{rows[0]['topk']} sets",
                     f"{acc['rows']} rows, {acc['swaps']} swaps", "float64 top-k",
                     f"ties only ({acc['worst']:.2f} of 2x bound)",
                     acc["bad_rows"] == 0 and acc["worst"] <= 1.0)


def check_sparse_mla_decode(report: Report, a: Dict[str, Any]) -> None:
    """sparse_mla_decode on all heads for the decode query over the float64 top-k rows."""
    from kimi_mlx.metal import dsa as dsa_ops
    from kimi_mlx.metal import kernels
    from kimi_mlx.metal.dispatch import use_sim

    with report.phase("emulator: sparse_mla_decode (all heads)"):
        scores = ora.index_scores64(a["q_idx"], a["weights"], a["k_idx"], a["offset"])[0]
        K = int(min(a["topk"], np.isfinite(scores).sum()))
        sel = np.argsort(-scores[0, 0], kind="stable")[:K].astype(np.int32)[None]
        ql, qp = _f32(a["q_lat"]), _f32(a["q_pe"])
        lat, kp = _f32(a["latent"][:, 0]), _f32(a["k_pe"][:, 0])
        want = ora.sparse_mla_decode64(ql, qp, lat, kp, sel, a["scale"])
        with use_sim():
            o = kernels.sparse_mla_decode(ql, qp, lat, kp, mx.array(sel), a["scale"])
            mx.eval(o)
        o_ref = dsa_ops.sparse_mla_decode(ql, qp, lat, kp, mx.array(sel), a["scale"])
    shape = f"H {ql.shape[1]}, R {ql.shape[-1]}, K {K} of S {lat.shape[1]}"
    report.error_check(f"sparse_mla_decode kernel ({shape})",
                       *ora.max_excess(o, want["o"], want["tol"]))
    report.error_check("sparse_mla_decode reference op",
                       *ora.max_excess(o_ref, want["o"], want["tol"]))
