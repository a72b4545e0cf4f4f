"""Metal kernels for KDA and Gated DSA: the `.metal` bodies beside this file, built with
`kimi_mlx.metal.dispatch.metal_kernel` (real Metal on a Mac, the CPU emulator under
`use_sim()` / KIMI_MLX_METAL_SIM=1), and wrappers with the signatures of their pure-MLX
reference ops:

| kernel (this module)  | source                    | reference op                                  |
|-----------------------|---------------------------|-----------------------------------------------|
| `kda_decode`          | kda_decode.metal          | `kimi_mlx.metal.kda.kda_decode`               |
| `kda_prefill`         | kda_prefill.metal         | `kimi_mlx.metal.kda.kda_chunked` (and `kda_recurrent`) |
| `dsa_index_topk`      | dsa_index_topk.metal      | `kimi_mlx.metal.dsa.dsa_index_topk`           |
| `sparse_mla_decode`   | sparse_mla_decode.metal   | `kimi_mlx.metal.dsa.sparse_mla_decode`        |
| `dsa_index_topk_q`    | dsa_index_topk.metal      | `kimi_mlx.metal.dsa.dsa_index_topk_q_reference` |
| `sparse_mla_decode_q` | sparse_mla_decode.metal   | `kimi_mlx.metal.dsa.sparse_mla_decode_q_reference` |

The `_q` kernels read an affine-quantized cache (MLX's `mx.quantize` format: packed uint32
words, a scale and a bias per group of values, `quantized_parts`) and dequantize it in the
kernel; the BF16 kernels are unchanged beside them.

Model code does not call these directly: the dispatch functions in `kda.py` / `dsa.py`
(`kda_forward`, `kda_update`, `dsa_select`, `dsa_sparse_decode`) pick kernel or reference
by `kernel_mode()`. Calling a wrapper in "reference" mode raises MetalUnavailableError.

`.metal` file format: a leading comment, then sections opened by a line `// @kernel NAME`
(the body mx.fast.metal_kernel takes; `// @kernel NAME1 NAME2` gives one body to two
kernels, built and checked separately) or `// @header` (text placed before every kernel of
that file). Sizes that change from call to call (T, S, offset, K) are scalar inputs, never
template values, so one compiled pipeline serves every step.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx

from kimi_mlx.metal.dispatch import DispatchKernel, metal_kernel

__all__ = [
    "kda_decode",
    "kda_prefill",
    "dsa_index_topk",
    "sparse_mla_decode",
    "dsa_index_topk_q",
    "sparse_mla_decode_q",
    "quantized_parts",
    "QUANT_BITS",
    "QUANT_GROUP_SIZES",
    "KERNELS",
    "SPECS",
    "load_sources",
    "build_kernel",
]

_DIR = Path(__file__).resolve().parent
_SECTION = re.compile(r"^//\s*@(kernel\s+(\w+(?:[ \t]+\w+)*)|header)\s*$", re.M)

# kernel name -> (file, input names, output names)
SPECS: Dict[str, Tuple[str, Sequence[str], Sequence[str]]] = {
    "kda_decode": (
        "kda_decode.metal",
        ["q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in", "T", "lower_bound",
         "scale", "eps"],
        ["y", "state_out"],
    ),
    "kda_prefill": (
        "kda_prefill.metal",
        ["q", "k", "v", "g", "beta", "state_in", "T"],
        ["y", "state_out"],
    ),
    "dsa_index_topk": (
        "dsa_index_topk.metal",
        ["q", "w", "kx", "start", "S", "L", "offset", "K"],
        ["idx", "scores"],
    ),
    "sparse_mla_partial": (
        "sparse_mla_decode.metal",
        ["q_lat", "q_pe", "latent", "k_pe", "sel", "S", "K", "NSPLIT", "scale"],
        ["part_o", "part_ml"],
    ),
    "sparse_mla_combine": (
        "sparse_mla_decode.metal",
        ["part_o", "part_ml", "NSPLIT"],
        ["out"],
    ),
    "dsa_index_topk_q": (
        "dsa_index_topk.metal",
        ["q", "w", "kx_w", "kx_s", "kx_b", "start", "S", "L", "offset", "K"],
        ["idx", "scores"],
    ),
    "sparse_mla_partial_q": (
        "sparse_mla_decode.metal",
        ["q_lat", "q_pe", "latent_w", "latent_s", "latent_b", "k_pe", "sel", "S", "K",
         "NSPLIT", "scale"],
        ["part_o", "part_ml"],
    ),
    "sparse_mla_combine_q": (
        "sparse_mla_decode.metal",
        ["part_o", "part_ml", "NSPLIT"],
        ["out"],
    ),
}

MAX_THREADGROUP_BYTES = 32768


def load_sources(file: str) -> Dict[str, str]:
    """Sections of a `.metal` file beside this module: {"header": text, NAME: body, ...}.

    Raises:
        FileNotFoundError: no such file. ValueError: a file without `// @kernel` sections.
    """
    text = (_DIR / file).read_text()
    out: Dict[str, str] = {"header": ""}
    marks = list(_SECTION.finditer(text))
    if not any(m.group(2) for m in marks):
        raise ValueError(f"{file}: no `// @kernel NAME` section")
    for m, nxt in zip(marks, marks[1:] + [None]):
        body = text[m.end() : nxt.start() if nxt is not None else len(text)]
        if m.group(2):
            for name in m.group(2).split():
                out[name] = body
        else:
            out["header"] += body
    return out


def build_kernel(name: str, transform: Optional[Callable[[str], str]] = None) -> DispatchKernel:
    """The DispatchKernel for `name` (a key of SPECS), its body optionally rewritten by
    `transform` (tests use this to plant a bug and check that it is caught)."""
    file, inputs, outputs = SPECS[name]
    src = load_sources(file)
    body = src[name] if transform is None else transform(src[name])
    return metal_kernel(name, list(inputs), list(outputs), source=body, header=src["header"])


# Built once at import (cheap: nothing compiles until the first call). Tests may swap
# entries (monkeypatch.setitem) for a deliberately broken build.
KERNELS: Dict[str, DispatchKernel] = {name: build_kernel(name) for name in SPECS}


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


# ------------------------------------------------------------------------------- KDA


def kda_decode(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    a: mx.array,
    b: mx.array,
    A_log: mx.array,
    dt_bias: mx.array,
    state: Optional[mx.array] = None,
    lower_bound: Optional[float] = -5.0,
    scale: Optional[float] = None,
    eps: float = 1e-6,
) -> Tuple[mx.array, mx.array]:
    """Fused KDA step(s) for all heads in one dispatch (kernel for `kda.kda_decode`).

    Args:
        q, k: [B, T, H, Dk] raw streams (after conv + SiLU, before the L2 norm); T is
            usually 1 (decode), any T >= 1 works (tokens run one after another).
        v: [B, T, H, Dv].
        a: [B, T, H, Dk] raw gate input f_b(f_a(x)).
        b: [B, T, H] beta logits (b_proj x).
        A_log: [H] or [H, 1]; dt_bias: [H, Dk] or [H * Dk] (float32 in the checkpoint).
        state: [B, H, Dv, Dk] float32 or None (zeros).
        lower_bound: K3's gate_lower_bound (g = lb * sigmoid(e^A_log (a + dt_bias)));
            None selects the softplus gate g = -e^A_log softplus(a + dt_bias).
        scale: readout scale folded into q (default Dk^-1/2); eps: added to sum(x^2).
    Returns:
        (o [B, T, H, Dv] in v's dtype, state [B, H, Dv, Dk] float32).
    Raises:
        ValueError: inconsistent shapes. MetalUnavailableError: kernel_mode() == "reference".
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    _check(k.shape == q.shape and a.shape == q.shape, "kda_decode: q, k, a must share a shape")
    _check(v.shape[:3] == (B, T, H) and b.shape == (B, T, H), "kda_decode: v / b shape")
    _check(A_log.size == H and dt_bias.size == H * Dk, "kda_decode: A_log [H], dt_bias [H, Dk]")
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    _check(state.shape == (B, H, Dv, Dk), f"kda_decode: state must be {(B, H, Dv, Dk)}")
    if scale is None:
        scale = Dk**-0.5
    y, s = KERNELS["kda_decode"](
        inputs=[q, k, v, a, b, A_log.reshape(H).astype(mx.float32),
                dt_bias.reshape(H * Dk).astype(mx.float32), state.astype(mx.float32), T,
                float(lower_bound if lower_bound is not None else 0.0), float(scale),
                float(eps)],
        template=[("OutT", v.dtype), ("Dk", Dk), ("Dv", Dv), ("H", H),
                  ("GATE", 0 if lower_bound is not None else 1)],
        grid=(32, Dv, B * H),
        threadgroup=(32, 4, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dv, Dk)],
        output_dtypes=[v.dtype, mx.float32],
    )
    return y, s


def _prefill_tiling(Dk: int, Dv: int, chunk: int) -> Tuple[int, int, int]:
    """(C, NSG, CPS): chunk that fits threadgroup memory, SIMD-groups per threadgroup,
    value columns per SIMD-group."""
    C = chunk
    while C > 1 and 4 * (3 * C * Dk + 3 * C * C + Dk + C) > MAX_THREADGROUP_BYTES:
        C //= 2
    _check(4 * (3 * C * Dk + 3 * C * C + Dk + C) <= MAX_THREADGROUP_BYTES,
           f"kda_prefill: head_dim {Dk} does not fit threadgroup memory")
    NSG = 4
    CPS = max(1, min(4, math.ceil(Dv / NSG)))
    return C, NSG, CPS


def kda_prefill(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: Optional[mx.array] = None,
    chunk: int = 16,
) -> Tuple[mx.array, mx.array]:
    """Chunked KDA over a prompt of any length (kernel for `kda.kda_chunked`).

    Args:
        q, k: [B, T, H, Dk], L2-normalised (q also scaled by Dk^-1/2).
        v: [B, T, H, Dv].
        g: [B, T, H, Dk] float32 log decay (`kda_gate`); any gate, no lower bound needed.
        beta: [B, T, H] in (0, 1).
        state: [B, H, Dv, Dk] float32 or None (zeros): the state carried in.
        chunk: tokens per chunk (1..32; halved until the chunk fits 32 KiB of threadgroup
            memory, e.g. 16 at Dk=128).
    Returns:
        (o [B, T, H, Dv] in v's dtype, final state [B, H, Dv, Dk] float32).
    Raises:
        ValueError: inconsistent shapes, chunk outside 1..32.
        MetalUnavailableError: kernel_mode() == "reference".
    """
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    _check(k.shape == q.shape and g.shape == q.shape, "kda_prefill: q, k, g must share a shape")
    _check(v.shape[:3] == (B, T, H) and beta.shape == (B, T, H), "kda_prefill: v / beta shape")
    _check(1 <= chunk <= 32, "kda_prefill: chunk must be in 1..32")
    if state is None:
        state = mx.zeros((B, H, Dv, Dk), dtype=mx.float32)
    _check(state.shape == (B, H, Dv, Dk), f"kda_prefill: state must be {(B, H, Dv, Dk)}")
    C, NSG, CPS = _prefill_tiling(Dk, Dv, chunk)
    nblk = math.ceil(Dv / (NSG * CPS))
    y, s = KERNELS["kda_prefill"](
        inputs=[q, k, v, g.astype(mx.float32), beta, state.astype(mx.float32), T],
        template=[("OutT", v.dtype), ("Dk", Dk), ("Dv", Dv), ("H", H), ("C", C),
                  ("NSG", NSG), ("CPS", CPS)],
        grid=(32, NSG * nblk, B * H),
        threadgroup=(32, NSG, 1),
        output_shapes=[(B, T, H, Dv), (B, H, Dv, Dk)],
        output_dtypes=[v.dtype, mx.float32],
    )
    return y, s


# ------------------------------------------------------------------------------- DSA


def dsa_index_topk(
    q_idx: mx.array, weights: mx.array, k_idx: mx.array, topk: int, offset: int,
    starts: Optional[mx.array] = None,
) -> mx.array:
    """Indexer top-k per query row (kernel for `dsa.dsa_index_topk`).

    Args:
        q_idx: [B, L, Hi, Di] index queries; weights: [B, L, Hi] head weights;
        k_idx: [B, S, Di] cached index keys; topk: index_topk (>= 1);
        offset: position of the first query (query l sees keys s <= offset + l).
        starts: [B] int, first allowed key of each batch row (its left padding), or None
            for 0: query l of row b sees keys starts[b] <= s <= offset + l.
    Returns:
        [B, L, min(topk, S)] int32, a top-k set of each row's allowed keys (order free;
        ties broken towards lower positions). A row with fewer allowed keys than that
        lists all of them, then -1.
    Raises:
        ValueError: inconsistent shapes, topk < 1, Hi * Di too large for threadgroup
        memory. MetalUnavailableError: kernel_mode() == "reference".
    """
    B, L, Hi, Di = q_idx.shape
    S = k_idx.shape[1]
    _check(weights.shape == (B, L, Hi), "dsa_index_topk: weights must be [B, L, Hi]")
    _check(k_idx.shape == (B, S, Di), "dsa_index_topk: k_idx must be [B, S, Di]")
    _check(topk >= 1 and S >= 1, "dsa_index_topk: topk and S must be >= 1")
    starts = mx.zeros((B,), mx.int32) if starts is None else starts.astype(mx.int32)
    _check(starts.shape == (B,), "dsa_index_topk: starts must be [B]")
    NT = 256
    _check(4 * (Hi * Di + Hi + 256 + 2 * NT // 32 + 2) <= MAX_THREADGROUP_BYTES,
           "dsa_index_topk: Hi * Di too large for threadgroup memory")
    K = min(topk, S)
    idx, _ = KERNELS["dsa_index_topk"](
        inputs=[q_idx, weights, k_idx, starts, S, L, int(offset), K],
        template=[("Hi", Hi), ("Di", Di), ("NT", NT)],
        grid=(NT, L, B),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, L, K), (B, L, S)],
        output_dtypes=[mx.int32, mx.float32],
    )
    return idx


def _splits(K: int) -> int:
    """Split-K partitions: about 128 selected rows per threadgroup, at most 32."""
    return max(1, min(32, math.ceil(K / 128)))


def sparse_mla_decode(
    q_lat: mx.array,
    q_pe: mx.array,
    latent: mx.array,
    k_pe: mx.array,
    indices: mx.array,
    scale: float,
    *,
    splits: Optional[int] = None,
) -> mx.array:
    """Absorbed-MLA decode over the selected rows only (kernel for `dsa.sparse_mla_decode`).

    Args:
        q_lat: [B, H, 1, R] absorbed queries (q_nope . W_UK); q_pe: [B, H, 1, P].
        latent: [B, S, R] latent cache; k_pe: [B, S, P] rope-key cache (shared by heads).
        indices: [B, K] int32 selected positions; entries outside [0, S) are skipped.
        scale: softmax scale ((nope + rope)^-1/2 in K3).
        splits: split-K partitions (keyword-only tuning knob; default about K / 128).
    Returns:
        [B, H, 1, R] in q_lat's dtype: softmax(scale (q_lat c_s + q_pe kpe_s)) over the
        valid selected s, times c_s; zeros for a row with no valid index.
    Raises:
        ValueError: inconsistent shapes. MetalUnavailableError: kernel_mode() == "reference".
    """
    B, H, one, R = q_lat.shape
    P = q_pe.shape[-1]
    S = latent.shape[1]
    K = indices.shape[-1]
    _check(one == 1 and q_pe.shape == (B, H, 1, P), "sparse_mla_decode: one query per row")
    _check(latent.shape == (B, S, R) and k_pe.shape == (B, S, P),
           "sparse_mla_decode: latent [B, S, R], k_pe [B, S, P]")
    _check(indices.shape == (B, K) and K >= 1, "sparse_mla_decode: indices must be [B, K]")
    nsplit = _splits(K) if splits is None else max(1, min(int(splits), K))
    return _split_decode("sparse_mla_partial", "sparse_mla_combine",
                         [q_lat, q_pe, latent, k_pe], [("H", H), ("R", R), ("P", P)],
                         indices, S, K, nsplit, scale, q_lat.dtype, B, H, R)


def _split_decode(partial: str, combine: str, data, template, indices, S, K, nsplit, scale,
                  out_dtype, B, H, R):
    """One sparse-MLA decode as its two dispatches (the BF16 and the quantized-cache
    variants share it): `partial` scores `nsplit` slices of each row's K selected keys
    into per-split outputs and (max, sum) pairs; `combine` merges the splits into
    [B, H, 1, R] of `out_dtype`. `data`: the kernel's cache/query inputs before the
    indices; `template`: `partial`'s template parameters."""
    HG = min(H, 4)
    part_o, part_ml = KERNELS[partial](
        inputs=[*data, indices.astype(mx.int32), S, K, nsplit, float(scale)],
        template=template,
        grid=(32, H, B * nsplit),
        threadgroup=(32, HG, 1),
        output_shapes=[(B, nsplit, H, R), (B, nsplit, H, 2)],
        output_dtypes=[mx.float32, mx.float32],
    )
    (out,) = KERNELS[combine](
        inputs=[part_o, part_ml, nsplit],
        template=[("OutT", out_dtype), ("H", H), ("R", R)],
        grid=(32, H, B),
        threadgroup=(32, HG, 1),
        output_shapes=[(B, H, 1, R)],
        output_dtypes=[out_dtype],
    )
    return out


# ------------------------------------------------------- DSA over a quantized cache

QUANT_BITS = (4, 8)  # widths whose values never straddle a uint32 word
QUANT_GROUP_SIZES = (32, 64, 128)  # what mx.quantize accepts


def quantized_parts(what: str, parts: Sequence[mx.array], group_size: int, bits: int,
                    lead: Tuple[int, ...]) -> Tuple[mx.array, mx.array, mx.array, int]:
    """Check one affine-quantized cache tensor (MLX's `mx.quantize(x, group_size, bits)`
    along the last axis) and return it flattened to the kernels' layout.

    Args:
        what: the tensor's name for error messages ("latent", "index keys").
        parts: (packed uint32 [*lead, D * bits / 32], scales [*lead, D / group_size],
            biases [*lead, D / group_size]); value d of a row is
            scales[d // group_size] * ((packed[d // (32 / bits)] >> (bits * (d % (32 / bits))))
            & (2^bits - 1)) + biases[d // group_size].
        group_size: 32, 64 or 128; bits: 4 or 8.
        lead: the expected leading shape (e.g. (B, S)).
    Returns:
        (packed, scales, biases, D) with the leading shape `lead` (contiguous).
    Raises:
        ValueError: not three arrays, a packed dtype other than uint32, bits or group size
        not supported, shapes that disagree with each other, with `lead` or with D.
    """
    if len(parts) != 3:
        raise ValueError(f"{what}: expected (packed, scales, biases), got {len(parts)} arrays")
    w, s, b = parts
    if bits not in QUANT_BITS:
        raise ValueError(f"{what}: bits={bits} not supported by the kernels (use "
                         f"{' or '.join(map(str, QUANT_BITS))})")
    if group_size not in QUANT_GROUP_SIZES:
        raise ValueError(f"{what}: group_size={group_size} not one of "
                         f"{', '.join(map(str, QUANT_GROUP_SIZES))}")
    if w.dtype != mx.uint32:
        raise ValueError(f"{what}: packed values must be uint32 (mx.quantize), got {w.dtype}")
    D = w.shape[-1] * 32 // bits
    if (tuple(w.shape[:-1]) != tuple(lead) or tuple(s.shape) != tuple(b.shape)
            or tuple(s.shape) != (*lead, D // group_size) or D % group_size):
        raise ValueError(
            f"{what}: packed {tuple(w.shape)}, scales {tuple(s.shape)}, biases "
            f"{tuple(b.shape)} do not describe rows of {D} values quantized with "
            f"group_size={group_size}, bits={bits} over leading shape {tuple(lead)} "
            f"(expected scales and biases {(*lead, D // group_size)})")
    return w, s, b, D


def dsa_index_topk_q(
    q_idx: mx.array, weights: mx.array, k_idx: Sequence[mx.array], topk: int, offset: int,
    starts: Optional[mx.array] = None, *, group_size: int = 64, bits: int = 8,
) -> mx.array:
    """Indexer top-k per query row over quantized index keys (kernel for
    `dsa.dsa_index_topk_q_reference`): `dsa_index_topk` with the keys dequantized in the
    kernel.

    Args:
        q_idx: [B, L, Hi, Di]; weights: [B, L, Hi]; topk, offset, starts: as
            `dsa_index_topk`.
        k_idx: (packed uint32 [B, S, Di * bits / 32], scales [B, S, Di / group_size],
            biases [B, S, Di / group_size]), `mx.quantize` of the [B, S, Di] keys.
        group_size: 32, 64 or 128; bits: 4 or 8.
    Returns:
        [B, L, min(topk, S)] int32, as `dsa_index_topk`.
    Raises:
        ValueError: inconsistent shapes or an unsupported format (`quantized_parts`).
        MetalUnavailableError: kernel_mode() == "reference".
    """
    B, L, Hi, Di = q_idx.shape
    _check(len(k_idx) == 3, "dsa_index_topk_q: k_idx must be (packed, scales, biases)")
    S = k_idx[0].shape[1] if k_idx[0].ndim == 3 else -1
    kw, ks, kb, D = quantized_parts("dsa_index_topk_q: index keys", k_idx, group_size, bits,
                                    (B, S))
    _check(D == Di, f"dsa_index_topk_q: keys hold {D} values a row, queries {Di}")
    _check(weights.shape == (B, L, Hi), "dsa_index_topk_q: weights must be [B, L, Hi]")
    _check(topk >= 1 and S >= 1, "dsa_index_topk_q: topk and S must be >= 1")
    starts = mx.zeros((B,), mx.int32) if starts is None else starts.astype(mx.int32)
    _check(starts.shape == (B,), "dsa_index_topk_q: starts must be [B]")
    NT = 256
    _check(4 * (Hi * Di + Hi + 256 + 2 * NT // 32 + 2) <= MAX_THREADGROUP_BYTES,
           "dsa_index_topk_q: Hi * Di too large for threadgroup memory")
    K = min(topk, S)
    idx, _ = KERNELS["dsa_index_topk_q"](
        inputs=[q_idx, weights, kw, ks, kb, starts, S, L, int(offset), K],
        template=[("Hi", Hi), ("Di", Di), ("NT", NT), ("BITS", bits), ("GS", group_size)],
        grid=(NT, L, B),
        threadgroup=(NT, 1, 1),
        output_shapes=[(B, L, K), (B, L, S)],
        output_dtypes=[mx.int32, mx.float32],
    )
    return idx


def sparse_mla_decode_q(
    q_lat: mx.array,
    q_pe: mx.array,
    latent: Sequence[mx.array],
    k_pe: mx.array,
    indices: mx.array,
    scale: float,
    *,
    group_size: int = 64,
    bits: int = 8,
    splits: Optional[int] = None,
) -> mx.array:
    """Absorbed-MLA decode over the selected rows of a quantized latent cache (kernel for
    `dsa.sparse_mla_decode_q_reference`): `sparse_mla_decode` with the latent rows
    dequantized in the kernel; the rope keys are unquantized.

    Args:
        q_lat: [B, H, 1, R]; q_pe: [B, H, 1, P]; k_pe: [B, S, P]; indices: [B, K] int32
            (outside [0, S) skipped); scale: softmax scale.
        latent: (packed uint32 [B, S, R * bits / 32], scales [B, S, R / group_size],
            biases [B, S, R / group_size]), `mx.quantize` of the [B, S, R] latent.
        group_size: 32, 64 or 128; bits: 4 or 8; splits: as `sparse_mla_decode`.
    Returns:
        [B, H, 1, R] in q_lat's dtype.
    Raises:
        ValueError: inconsistent shapes or an unsupported format (`quantized_parts`).
        MetalUnavailableError: kernel_mode() == "reference".
    """
    B, H, one, R = q_lat.shape
    P = q_pe.shape[-1]
    S = k_pe.shape[1]
    K = indices.shape[-1]
    _check(one == 1 and q_pe.shape == (B, H, 1, P), "sparse_mla_decode_q: one query per row")
    _check(k_pe.shape == (B, S, P), "sparse_mla_decode_q: k_pe must be [B, S, P]")
    lw, ls, lb, D = quantized_parts("sparse_mla_decode_q: latent", latent, group_size, bits,
                                    (B, S))
    _check(D == R, f"sparse_mla_decode_q: latent rows hold {D} values, q_lat {R}")
    _check(indices.shape == (B, K) and K >= 1, "sparse_mla_decode_q: indices must be [B, K]")
    nsplit = _splits(K) if splits is None else max(1, min(int(splits), K))
    return _split_decode("sparse_mla_partial_q", "sparse_mla_combine_q",
                         [q_lat, q_pe, lw, ls, lb, k_pe],
                         [("H", H), ("R", R), ("P", P), ("BITS", bits), ("GS", group_size)],
                         indices, S, K, nsplit, scale, q_lat.dtype, B, H, R)
