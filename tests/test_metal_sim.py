"""metal/sim: the Metal-on-CPU emulator and the kernel/sim/reference dispatcher.

Validation strategy (DESIGN.md, "Testing without Macs"): kernels that others
have run on real Macs (mlx-lm's gated-delta and Kimi K3 AttnRes kernels) are
run in the emulator with exactly the arguments mlx-lm's own wrapper passes, and
must match mlx-lm's pure-MLX reference ops; small hand kernels pin each
emulated feature against NumPy; broken kernels must fail with a clear error,
never a crash or a hang.
"""

from __future__ import annotations

import ast
import inspect
import re
import threading
import types

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.metal import dispatch
from kimi_mlx.metal import sim
from kimi_mlx.metal.sim import _native


@pytest.fixture(scope="module", autouse=True)
def _private_cache(tmp_path_factory):
    """Compile into a fresh cache: the tests exercise the compile path too."""
    mp = pytest.MonkeyPatch()
    mp.setenv("KIMI_MLX_SIM_CACHE", str(tmp_path_factory.mktemp("metal-sim-cache")))
    mp.delenv("KIMI_MLX_SIM_CHECKED", raising=False)
    yield
    mp.undo()


def _f32(a) -> np.ndarray:
    return np.array(a.astype(mx.float32))


def assert_close(out, ref, rtol=1e-4):
    """max |out - ref| <= rtol * max |ref| (plus a hair for all-zero refs)."""
    out, ref = _f32(out), _f32(ref)
    assert out.shape == ref.shape
    err = float(np.max(np.abs(out - ref))) if out.size else 0.0
    scale = float(np.max(np.abs(ref))) if ref.size else 0.0
    assert err <= rtol * scale + 1e-30, f"max abs err {err} vs max |ref| {scale}"


def run_guarded(fn, timeout=60.0):
    """Call fn() in a thread; fail (instead of hanging the suite) if it does
    not return in `timeout` seconds. Returns fn's result or re-raises."""
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            box["error"] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout}s (hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ------------------------------------------------------------- mlx-lm kernels


class _SimMx:
    """Stands in for `mx` inside an mlx-lm model module: Metal "available",
    kernels built by the emulator, the GPU as default device, everything else
    the real mlx.core. So the module's own wrapper code runs unchanged and
    passes its kernels exactly the arguments it would on a Mac."""

    def __init__(self):
        self.metal = types.SimpleNamespace(is_available=lambda: True)
        self.fast = types.SimpleNamespace(metal_kernel=sim.metal_kernel)

    def default_device(self):
        return mx.gpu

    def __getattr__(self, name):
        return getattr(mx, name)


@pytest.fixture(scope="module")
def gdn():
    """mlx_lm.models.gated_delta with its kernels built by the emulator."""
    import mlx_lm.models.gated_delta as gd

    mp = pytest.MonkeyPatch()
    mp.setattr(gd, "mx", _SimMx())
    mp.setattr(gd, "_gated_delta_kernel", gd._make_gated_delta_kernel(False, False))
    mp.setattr(gd, "_gated_delta_kernel_masked", gd._make_gated_delta_kernel(True, False))
    mp.setattr(gd, "_gated_delta_kernel_vec", gd._make_gated_delta_kernel(False, True))
    mp.setattr(gd, "_gated_delta_kernel_vec_masked", gd._make_gated_delta_kernel(True, True))
    mp.setattr(gd, "_gated_delta_kernel_xtree", gd._make_gated_delta_kernel_xtree())
    mp.setattr(gd, "_gated_delta_kernel_packed", gd._make_gated_delta_packed_kernel())
    mp.setattr(gd, "_ENABLE_GDN_PACKED", True)
    sim_mx = gd.mx
    mp.setattr(gd, "mx", mx)  # reference ops run with the real module
    yield types.SimpleNamespace(module=gd, sim_mx=sim_mx, patch=mp)
    mp.undo()


def _gdn_inputs(B, T, Hk, Hv, Dk, Dv, vectorized=False, masked=False, dtype=mx.float32, seed=0):
    mx.random.seed(seed)
    q = (mx.random.normal((B, T, Hk, Dk)) * 0.3).astype(dtype)
    k = (mx.random.normal((B, T, Hk, Dk)) * 0.3).astype(dtype)
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    gshape = (B, T, Hv, Dk) if vectorized else (B, T, Hv)
    g = mx.random.uniform(0.7, 1.0, gshape)
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.2
    mask = None
    if masked:
        mask = mx.random.uniform(shape=(B, T)) > 0.3
        mask[:, 0] = True
    return q, k, v, g, beta, state, mask


def _check_gdn(gdn, fn, inputs):
    q, k, v, g, beta, state, mask = inputs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gdn.module, "mx", gdn.sim_mx)
        y, s = fn(q, k, v, g, beta, state, mask)
    y_ref, s_ref = gdn.module.gated_delta_ops(q, k, v, g, beta, state, mask)
    if mask is not None:
        # The kernel writes 0 for masked steps; the reference computes them
        # anyway and only keeps the state. Compare where it is defined.
        keep = np.array(mask)[:, :, None, None]
        assert np.all(np.where(keep, 0.0, _f32(y)) == 0.0)
        y = mx.array(np.where(keep, _f32(y), 0.0))
        y_ref = mx.array(np.where(keep, _f32(y_ref), 0.0))
    rtol = 1e-4 if q.dtype == mx.float32 else 2e-2
    assert_close(y, y_ref, rtol)
    assert_close(s, s_ref, 1e-4 if q.dtype == mx.float32 else 2e-2)


@pytest.mark.parametrize(
    "B,T,Hk,Hv,Dk,Dv,vectorized,masked",
    [
        (2, 5, 2, 4, 64, 16, False, False),  # GQA, T not a power of two
        (1, 1, 1, 2, 32, 8, False, False),  # decode step
        (2, 3, 1, 2, 32, 12, False, True),  # padding mask
        (2, 5, 2, 2, 64, 8, True, False),  # per-channel (vector) gate
        (2, 3, 1, 2, 32, 8, True, True),
    ],
)
def test_gated_delta_kernel_matches_reference(gdn, B, T, Hk, Hv, Dk, Dv, vectorized, masked):
    inputs = _gdn_inputs(B, T, Hk, Hv, Dk, Dv, vectorized, masked)
    _check_gdn(gdn, gdn.module.gated_delta_kernel_unpacked, inputs)


def test_gated_delta_packed_and_xtree_kernels(gdn):
    """Dk=128 scalar-gate prefill takes the packed kernel (8 rows per
    SIMD-group, shuffle_xor tree); the xtree comparator must agree too."""
    inputs = _gdn_inputs(2, 3, 1, 2, 128, 16)
    _check_gdn(gdn, gdn.module.gated_delta_kernel, inputs)
    _check_gdn(gdn, gdn.module.gated_delta_kernel_xtree, inputs)


def test_gated_delta_bf16_inputs(gdn):
    _check_gdn(gdn, gdn.module.gated_delta_kernel_unpacked,
               _gdn_inputs(1, 4, 1, 2, 32, 8, dtype=mx.bfloat16))


@pytest.mark.parametrize("lower_bound,masked", [(None, False), (-5.0, False), (-5.0, True)])
def test_gated_delta_update_end_to_end(gdn, lower_bound, masked):
    """mlx-lm's public entry point, gates computed by it (incl. the
    lower-bound gate), kernel path vs use_kernel=False."""
    gd = gdn.module
    B, T, Hk, Hv, Dk, Dv = 2, 3, 1, 2, 32, 8
    mx.random.seed(3)
    q = mx.random.normal((B, T, Hk, Dk)) * 0.3
    k = mx.random.normal((B, T, Hk, Dk)) * 0.3
    v = mx.random.normal((B, T, Hv, Dv))
    a = mx.random.normal((B, T, Hv))
    b = mx.random.normal((B, T, Hv))
    A_log = mx.random.normal((Hv,)) * 0.1
    dt_bias = mx.random.normal((Hv,)) * 0.1
    mask = (mx.random.uniform(shape=(B, T)) > 0.3) if masked else None
    if mask is not None:
        mask[:, 0] = True
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gd, "mx", gdn.sim_mx)
        y, s = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, None, mask,
                                     lower_bound=lower_bound)
    y_ref, s_ref = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, None, mask,
                                         use_kernel=False, lower_bound=lower_bound)
    if mask is not None:
        keep = np.array(mask)[:, :, None, None]
        y = mx.array(np.where(keep, _f32(y), 0.0))
        y_ref = mx.array(np.where(keep, _f32(y_ref), 0.0))
    assert_close(y, y_ref)
    assert_close(s, s_ref)


@pytest.fixture(scope="module")
def attn_res():
    """mlx_lm.models.kimi_k3 with `_attn_res_kernel` built by the emulator from
    the module's own `mx.fast.metal_kernel(...)` statement."""
    import mlx_lm.models.kimi_k3 as kk

    tree = ast.parse(inspect.getsource(kk))
    stmt = [
        n for n in tree.body
        if isinstance(n, ast.Assign)
        and any(getattr(t, "id", None) == "_attn_res_kernel" for t in n.targets)
    ]
    assert len(stmt) == 1, "mlx-lm's kimi_k3 no longer defines _attn_res_kernel"
    namespace = dict(vars(kk))
    namespace["mx"] = _SimMx()
    exec(compile(ast.Module(stmt, []), kk.__file__, "exec"), namespace)
    kernel = namespace["_attn_res_kernel"]
    assert isinstance(kernel, sim.SimKernel)
    return types.SimpleNamespace(module=kk, kernel=kernel)


@pytest.mark.parametrize(
    "K,B,T,D,dtype",
    [(1, 1, 1, 64, mx.float32), (3, 2, 3, 200, mx.float32), (2, 1, 2, 700, mx.bfloat16)],
)
def test_attn_res_kernel_matches_reference(attn_res, K, B, T, D, dtype):
    kk = attn_res.module
    mx.random.seed(K * 100 + D)
    blocks = kk.ResidualBlocks(1e-6)
    for _ in range(K):
        blocks.append(mx.random.normal((B, T, D)).astype(dtype))
    partial = mx.random.normal((B, T, D)).astype(dtype)
    w_eff = mx.random.normal((D,)) * 0.2
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kk, "_attn_res_kernel", attn_res.kernel)
        mp.setattr(kk, "mx", _SimMx())
        out = kk._attn_res_mix(blocks, partial, w_eff, 1e-6)
    ref = kk._attn_res_combine(blocks.raw, blocks.inv_rms, partial, w_eff, 1e-6)
    assert out.dtype == dtype and out.shape == partial.shape
    assert_close(out, ref, 1e-4 if dtype == mx.float32 else 1e-2)


# --------------------------------------------------------------- hand kernels

SIMD_OPS = """
    uint gid = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float x = inp[gid];
    o_sum[gid] = simd_sum(x);
    o_max[gid] = simd_max(x);
    o_min[gid] = simd_min(x);
    o_pex[gid] = simd_prefix_exclusive_sum(x);
    o_pin[gid] = simd_prefix_inclusive_sum(x);
    o_shuf[gid] = simd_shuffle(x, (lane + 3) % 32);
    o_xor[gid] = simd_shuffle_xor(x, 5);
    o_down[gid] = simd_shuffle_down(x, 2);
    o_up[gid] = simd_shuffle_up(x, 3);
    o_bcast[gid] = simd_broadcast(x, 7);
    o_vote[gid] = float(simd_all(x > -100.0f)) + 2.0f * float(simd_any(x > 40.0f))
        + 4.0f * float(simd_ballot(x > 0.0f).any());
    float d = -1.0f;
    if (lane < 16) {
      d = simd_sum(x);  // divergent: the 16 active lanes only
    }
    o_div[gid] = d;
    o_quad[gid] = quad_sum(x) + 1000.0f * quad_shuffle(x, 3);
"""
SIMD_OUTS = ["o_sum", "o_max", "o_min", "o_pex", "o_pin", "o_shuf", "o_xor", "o_down",
             "o_up", "o_bcast", "o_vote", "o_div", "o_quad"]


def _simd_expected(x: np.ndarray):
    exp = {k: np.zeros_like(x) for k in SIMD_OUTS}
    for base in range(0, len(x), 32):
        s = x[base:base + 32]
        n = len(s)
        lanes = np.arange(n)
        exp["o_sum"][base:base + n] = s.sum()
        exp["o_max"][base:base + n] = s.max()
        exp["o_min"][base:base + n] = s.min()
        exp["o_pex"][base:base + n] = np.cumsum(s) - s
        exp["o_pin"][base:base + n] = np.cumsum(s)
        exp["o_shuf"][base:base + n] = s[(lanes + 3) % 32]
        exp["o_xor"][base:base + n] = s[lanes ^ 5]
        exp["o_down"][base:base + n] = np.where(lanes + 2 < 32, s[np.minimum(lanes + 2, 31)], s)
        exp["o_up"][base:base + n] = np.where(lanes >= 3, s[np.maximum(lanes - 3, 0)], s)
        exp["o_bcast"][base:base + n] = s[7]
        exp["o_vote"][base:base + n] = (1.0 * np.all(s > -100) + 2.0 * np.any(s > 40)
                                        + 4.0 * np.any(s > 0))
        exp["o_div"][base:base + n] = np.where(lanes < 16, s[:16].sum(), -1.0)
        quads = s.reshape(-1, 4)
        exp["o_quad"][base:base + n] = np.repeat(quads.sum(1) + 1000.0 * quads[:, 3], 4)
    return exp


def test_simd_group_functions():
    k = sim.metal_kernel("simd_ops", ["inp"], SIMD_OUTS, SIMD_OPS)
    x = np.random.default_rng(0).integers(-50, 50, 128).astype(np.float32)
    outs = k(inputs=[mx.array(x)], grid=(128, 1, 1), threadgroup=(64, 1, 1),
             output_shapes=[x.shape] * len(SIMD_OUTS), output_dtypes=[mx.float32] * len(SIMD_OUTS))
    exp = _simd_expected(x)
    for name, o in zip(SIMD_OUTS, outs):
        np.testing.assert_array_equal(np.array(o), exp[name], err_msg=name)


def test_simd_reductions_in_partial_simdgroup():
    """grid 80, threadgroup 64: the edge threadgroup has 16 threads, so its
    SIMD-group has 16 lanes; reductions cover exactly those."""
    src = """
        uint gid = thread_position_in_grid.x;
        o_sum[gid] = simd_sum(inp[gid]);
        o_max[gid] = simd_max(inp[gid]);
        o_tpt[gid] = threads_per_threadgroup.x;
    """
    k = sim.metal_kernel("simd_partial", ["inp"], ["o_sum", "o_max", "o_tpt"], src)
    x = np.arange(80, dtype=np.float32)
    s, m, tpt = k(inputs=[mx.array(x)], grid=(80, 1, 1), threadgroup=(64, 1, 1),
                  output_shapes=[(80,)] * 3, output_dtypes=[mx.float32, mx.float32, mx.uint32])
    groups = [x[0:32], x[32:64], x[64:80]]
    np.testing.assert_array_equal(np.array(s), np.concatenate([np.full(len(g), g.sum()) for g in groups]))
    np.testing.assert_array_equal(np.array(m), np.concatenate([np.full(len(g), g.max()) for g in groups]))
    np.testing.assert_array_equal(np.array(tpt), [64] * 64 + [16] * 16)


def test_threadgroup_memory_barriers_and_templates():
    src = """
        uint tid = thread_position_in_threadgroup.x;
        uint gid = thread_position_in_grid.x;
        threadgroup float shm[TG];
        threadgroup float tile[2][TG];
        shm[tid] = static_cast<float>(inp[gid]);
        tile[1][TG - 1 - tid] = static_cast<float>(inp[gid]);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        rev[gid] = static_cast<T>(tile[1][tid] * (NEG ? -1.0f : 1.0f));
        for (uint s = TG / 2; s > 0; s >>= 1) {
          if (tid < s) {
            shm[tid] += shm[tid + s];
          }
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (tid == 0) {
          total[threadgroup_position_in_grid.x] = static_cast<T>(shm[0]);
        }
    """
    k = sim.metal_kernel("tg_reduce", ["inp"], ["total", "rev"], src)
    x = np.random.default_rng(1).integers(-8, 8, 256).astype(np.float16)
    for neg, dtype in [(False, mx.float32), (True, mx.float16)]:
        total, rev = k(inputs=[mx.array(x)], template=[("T", dtype), ("TG", 64), ("NEG", neg)],
                       grid=(256, 1, 1), threadgroup=(64, 1, 1),
                       output_shapes=[(4,), (256,)], output_dtypes=[dtype, dtype])
        assert total.dtype == dtype
        np.testing.assert_array_equal(_f32(total), x.astype(np.float32).reshape(4, 64).sum(1))
        sign = -1.0 if neg else 1.0
        np.testing.assert_array_equal(_f32(rev), sign * x.astype(np.float32).reshape(4, 64)[:, ::-1].ravel())


def test_shape_strides_and_non_contiguous_input():
    """MLX's documented elem_to_loc pattern on a transposed input."""
    src = """
        uint elem = thread_position_in_grid.x;
        uint loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
        out[elem] = inp[loc];
        if (elem == 0) {
          info[0] = inp_ndim;
          info[1] = inp_shape[0];
          info[2] = inp_strides[0];
        }
    """
    a = mx.arange(24, dtype=mx.float32).reshape(4, 6).T  # shape (6, 4), strides (1, 6)
    for contiguous in (False, True):
        k = sim.metal_kernel("strided", ["inp"], ["out", "info"], src,
                             ensure_row_contiguous=contiguous)
        out, info = k(inputs=[a], grid=(24, 1, 1), threadgroup=(32, 1, 1),
                      output_shapes=[(6, 4), (3,)], output_dtypes=[mx.float32, mx.int32])
        np.testing.assert_array_equal(np.array(out), np.array(a))
        assert list(np.array(info)) == [2, 6, 4 if contiguous else 1]


def test_scalar_and_small_inputs_signature():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = inp[i] * f + n + (flag ? 100.0f : 0.0f) + s + small[i % 4];
    """
    k = sim.metal_kernel("scalars", ["inp", "n", "f", "flag", "s", "small"], ["out"], src)
    inp = mx.arange(10, dtype=mx.float32)
    small = mx.array([1.0, 2.0, 3.0, 4.0])
    args = [inp, 3, 0.5, True, mx.array(2.0), small]
    (out,) = k(inputs=args, grid=(10, 1, 1), threadgroup=(8, 1, 1),
               output_shapes=[(10,)], output_dtypes=[mx.float32])
    i = np.arange(10)
    np.testing.assert_allclose(np.array(out), i * 0.5 + 3 + 100 + 2 + (i % 4 + 1))
    text = k.metal_source(args, [mx.float32])
    assert "[[kernel]] void custom_kernel_scalars_float_int32_ts_floats_bools_floats_floatc_float(" in text
    for line in ["  const device float* inp [[buffer(0)]],",
                 "  const constant int32_t& n [[buffer(1)]],",
                 "  const constant float& f [[buffer(2)]],",
                 "  const constant bool& flag [[buffer(3)]],",
                 "  const constant float& s [[buffer(4)]],",
                 "  const constant float* small [[buffer(5)]],",
                 "  device float* out [[buffer(6)]],",
                 "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {"]:
        assert line in text.splitlines(), line


def test_metal_source_matches_mlx_layout():
    """Template, shape/strides/ndim buffers, attribute order, instantiation."""
    src = "uint e = thread_position_in_grid.x; out[e] = inp[e] * inp_shape[0] + " \
          "thread_index_in_simdgroup + simdgroup_index_in_threadgroup;"
    k = sim.SimKernel("lay", ["inp"], ["out"], src, header="// hdr\n")
    text = k.metal_source([mx.zeros((16,), mx.float16)], [mx.float16],
                          template=[("T", mx.float16), ("K", 3), ("B", True)])
    name = "custom_kernel_lay__float16_t_3_1_float16_t_float16_t"
    assert text == (
        "// hdr\n"
        "template <typename T, int K, bool B>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* inp [[buffer(0)]],\n"
        "  const constant int* inp_shape [[buffer(1)]],\n"
        "  device float16_t* out [[buffer(2)]],\n"
        "  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],\n"
        "  uint thread_index_in_simdgroup [[thread_index_in_simdgroup]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{src}\n}}\n"
        f'\ntemplate [[host_name("{name}")]] [[kernel]] decltype({name}<float16_t, 3, 1>) '
        f"{name}<float16_t, 3, 1>;\n"
    )


def test_bf16_and_half_in_and_out():
    src = """
        uint i = thread_position_in_grid.x;
        float p = static_cast<float>(a[i]) * static_cast<float>(b[i]);
        out_bf[i] = static_cast<bfloat16_t>(p);
        out_h[i] = static_cast<half>(p);
        half hh = b[i] * b[i];  // half arithmetic, rounded per operation
        out_hh[i] = hh;
        bfloat16_t bb = a[i] * a[i];  // bf16 * bf16 -> bf16
        out_bb[i] = bb;
    """
    k = sim.metal_kernel("bf16_half", ["a", "b"], ["out_bf", "out_h", "out_hh", "out_bb"], src)
    mx.random.seed(4)
    a = (mx.random.normal((100,)) * 3).astype(mx.bfloat16)
    b = (mx.random.normal((100,)) * 3).astype(mx.float16)
    out_bf, out_h, out_hh, out_bb = k(
        inputs=[a, b], grid=(100, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[(100,)] * 4,
        output_dtypes=[mx.bfloat16, mx.float16, mx.float16, mx.bfloat16])
    p = a.astype(mx.float32) * b.astype(mx.float32)
    assert out_bf.dtype == mx.bfloat16 and out_h.dtype == mx.float16
    assert mx.array_equal(out_bf, p.astype(mx.bfloat16)).item()
    assert mx.array_equal(out_h, p.astype(mx.float16)).item()
    assert mx.array_equal(out_hh, b * b).item()
    assert mx.array_equal(out_bb, a * a).item()


def test_vectors_swizzles_and_math():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(inp[4 * i], inp[4 * i + 1], inp[4 * i + 2], inp[4 * i + 3]);
        float2 s = v.xy + v.zw;
        float4 w = float4(s, v.wz) * 2.0f;
        half4 h = half4(v);
        out[i] = dot(w, float4(1.0f)) + float4(w.yxzw).x + float(h.w) * 0.0f
            + metal::max(metal::precise::exp(0.0f), metal::fast::rsqrt(4.0f))
            + metal::clamp(v.x, -1.0f, 1.0f) + select(0.0f, 1.0f, isnan(NAN));
    """
    k = sim.metal_kernel("vec_math", ["inp"], ["out"], src)
    x = np.random.default_rng(2).normal(size=(8, 4)).astype(np.float32)
    (out,) = k(inputs=[mx.array(x.ravel())], grid=(8, 1, 1), threadgroup=(8, 1, 1),
               output_shapes=[(8,)], output_dtypes=[mx.float32])
    X, Y, Z, W = x.T
    exp = 2 * (X + Z + Y + W + W + Z) + 2 * (Y + W) + 1.0 + np.clip(X, -1, 1) + 1.0
    np.testing.assert_allclose(np.array(out), exp, rtol=1e-5, atol=1e-5)


def test_atomic_outputs_and_init_value():
    src = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&hist[bins[i]], 1, memory_order_relaxed);
    """
    k = sim.metal_kernel("histogram", ["bins"], ["hist"], src, atomic_outputs=True)
    bins = np.random.default_rng(3).integers(0, 10, 500).astype(np.int32)
    (hist,) = k(inputs=[mx.array(bins)], grid=(500, 1, 1), threadgroup=(128, 1, 1),
                output_shapes=[(10,)], output_dtypes=[mx.int32], init_value=0)
    np.testing.assert_array_equal(np.array(hist), np.bincount(bins, minlength=10))
    (hist,) = k(inputs=[mx.array(bins)], grid=(500, 1, 1), threadgroup=(128, 1, 1),
                output_shapes=[(10,)], output_dtypes=[mx.int32], init_value=7)
    np.testing.assert_array_equal(np.array(hist), np.bincount(bins, minlength=10) + 7)


def test_simdgroup_matrix_multiply():
    src = """
        simdgroup_float8x8 a, b, c;
        simdgroup_load(a, A, 8);
        simdgroup_load(b, B, 8, ulong2(0, 0), true);
        c = make_filled_simdgroup_matrix<float, 8, 8>(1.0f);
        simdgroup_multiply_accumulate(c, a, b, c);
        simdgroup_store(c, C, 8);
    """
    k = sim.metal_kernel("sgmm", ["A", "B"], ["C"], src)
    rng = np.random.default_rng(5)
    A = rng.normal(size=(8, 8)).astype(np.float32)
    B = rng.normal(size=(8, 8)).astype(np.float32)
    (C,) = k(inputs=[mx.array(A), mx.array(B)], grid=(32, 1, 1), threadgroup=(32, 1, 1),
             output_shapes=[(8, 8)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(C), A @ B.T + 1.0, rtol=1e-5, atol=1e-5)


HELPER_HEADER = """
#include <metal_stdlib>
using namespace metal;

constant float kOffset = 0.25f;

template <typename T>
METAL_FUNC float load_scaled(const device T* x, uint i, constant float& s) {
  return static_cast<float>(x[i]) * s + kOffset;
}

inline void store2(device float* y, uint i, float2 v [[maybe_unused]]) {
  y[2 * i] = v.x;
  y[2 * i + 1] = v.y;
}
"""

HELPER_BODY = """
    uint i = thread_position_in_grid.x;
    const device uint32_t* bits = reinterpret_cast<const device uint32_t*>(inp);
    float a = load_scaled(inp, i, scale);
    float b = as_type<float>(bits[i]) + 1.0h;
    store2(out, i, float2(a, b));
"""


@pytest.mark.parametrize("checked", [True, False])
def test_header_helpers_address_spaces_and_casts(checked):
    """Helpers taking device/constant pointers and references, a
    reinterpret_cast between buffer types, a half literal, <metal_stdlib>."""
    k = sim.metal_kernel("helpers", ["inp", "scale"], ["out"], HELPER_BODY,
                         header=HELPER_HEADER, checked=checked)
    x = np.arange(6, dtype=np.float32)
    (out,) = k(inputs=[mx.array(x), 3.0], grid=(6, 1, 1), threadgroup=(8, 1, 1),
               output_shapes=[(12,)], output_dtypes=[mx.float32])
    np.testing.assert_allclose(np.array(out).reshape(6, 2), np.stack([x * 3 + 0.25, x + 1], 1))


# ----------------------------------------------------------- broken kernels


def test_out_of_bounds_write_is_reported():
    k = sim.metal_kernel("off_by_one", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i + 1] = inp[i];
    """)
    with pytest.raises(sim.MetalSimOutOfBoundsError) as ei:
        k(inputs=[mx.zeros((64,))], grid=(64, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(64,)], output_dtypes=[mx.float32])
    msg = str(ei.value)
    assert "off_by_one" in msg and "'out'" in msg and "element 64" in msg
    assert "thread_position_in_grid=(63,0,0)" in msg


def test_threadgroup_array_out_of_bounds_is_reported():
    k = sim.metal_kernel("tg_oob", ["inp"], ["out"], """
        uint tid = thread_position_in_threadgroup.x;
        threadgroup float shm[32];
        shm[tid + 1] = inp[tid];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[tid] = shm[tid];
    """)
    with pytest.raises(sim.MetalSimOutOfBoundsError, match=r"tg_oob.*'shm'.*element 32"):
        k(inputs=[mx.zeros((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
          output_shapes=[(32,)], output_dtypes=[mx.float32])


def test_divergent_barrier_is_reported_not_hung():
    k = sim.metal_kernel("bad_barrier", ["inp"], ["out"], """
        uint tid = thread_position_in_threadgroup.x;
        threadgroup float shm[32];
        if (tid < 16) {
          shm[tid] = inp[tid];
          threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[tid] = inp[tid];
    """)
    with pytest.raises(sim.MetalSimDeadlockError) as ei:
        run_guarded(lambda: k(inputs=[mx.zeros((32,))], grid=(32, 1, 1),
                              threadgroup=(32, 1, 1), output_shapes=[(32,)],
                              output_dtypes=[mx.float32]))
    msg = str(ei.value)
    assert "bad_barrier" in msg and "bad_barrier.body.metal:6" in msg
    assert "16 of 32 threads wait there" in msg


def test_compile_error_shows_gxx_diagnostic():
    k = sim.metal_kernel("typo", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = inp[i] + undefined_name;
    """)
    with pytest.raises(sim.MetalSimCompileError) as ei:
        k(inputs=[mx.zeros((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
          output_shapes=[(4,)], output_dtypes=[mx.float32])
    msg = str(ei.value)
    assert "typo" in msg and "error:" in msg and "undefined_name" in msg
    assert "typo.body.metal:3:" in msg
    assert "out[i] = inp[i] + undefined_name;" in msg  # the source line itself


def test_untranslatable_threadgroup_declaration_is_refused():
    """Rather than silently giving each thread its own copy."""
    k = sim.metal_kernel("two_in_one", ["inp"], ["out"], """
        threadgroup float a[4], b[4];  // two variables in one declaration
        out[0] = inp[0];
    """)
    with pytest.raises(sim.MetalSimCompileError, match=r"(?s)two_in_one.*translation.*two_in_one.body.metal:2"):
        k(inputs=[mx.zeros((4,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
          output_shapes=[(1,)], output_dtypes=[mx.float32])


def test_crash_and_infinite_loop_do_not_kill_the_process():
    fpe = sim.metal_kernel("div_zero", ["inp", "z"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = float(int(i) / z);
    """)
    with pytest.raises(sim.MetalSimFaultError, match="div_zero.*division by zero"):
        fpe(inputs=[mx.zeros((4,)), 0], grid=(4, 1, 1), threadgroup=(4, 1, 1),
            output_shapes=[(4,)], output_dtypes=[mx.float32])
    spin = sim.metal_kernel("spin", ["z"], ["out"], """
        volatile int x = 0;
        while (z == 0) { x = x + 1; }
        out[thread_position_in_grid.x] = x;
    """, timeout_s=0.5)
    with pytest.raises(sim.MetalSimTimeoutError, match="spin"):
        run_guarded(lambda: spin(inputs=[0], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                                 output_shapes=[(4,)], output_dtypes=[mx.float32]))
    deep = sim.metal_kernel("deep_recursion", ["n"], ["out"], """
        out[thread_position_in_grid.x] = rec(n);
    """, header="""
        int rec(int n) {
          volatile char buf[512];
          buf[0] = (char)n;
          return n == 0 ? 0 : rec(n - 1) + buf[0];
        }
    """)
    with pytest.raises(sim.MetalSimFaultError, match="deep_recursion.*stack overflow"):
        deep(inputs=[1 << 20], grid=(2, 1, 1), threadgroup=(2, 1, 1),
             output_shapes=[(2,)], output_dtypes=[mx.int32])
    # and the emulator still works afterwards
    ok = sim.metal_kernel("after", ["inp"], ["out"],
                          "uint i = thread_position_in_grid.x; out[i] = simd_sum(inp[i]);")
    (out,) = ok(inputs=[mx.ones((32,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(32,)], output_dtypes=[mx.float32])
    assert np.all(np.array(out) == 32)


def test_call_argument_errors_match_mlx():
    k = sim.metal_kernel("args", ["a", "b"], ["out"], "out[0] = a[0] + b[0];")
    with pytest.raises(ValueError, match="Expected `inputs` to have size 2 but got size 1"):
        k(inputs=[mx.zeros((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1),
          output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="maximum allowed threads per threadgroup"):
        k(inputs=[mx.zeros((1,)), mx.zeros((1,))], grid=(2048, 1, 1), threadgroup=(2048, 1, 1),
          output_shapes=[(1,)], output_dtypes=[mx.float32])
    with pytest.raises(ValueError, match="Must specify at least one output"):
        sim.metal_kernel("none", ["a"], [], "")


# ---------------------------------------------------------- race checker

def _run1(k, n=64, tg=64, inputs=None, out_shape=None, init_value=None):
    x = mx.arange(n).astype(mx.float32) if inputs is None else inputs
    (out,) = k(inputs=[x], grid=(n, 1, 1), threadgroup=(tg, 1, 1),
               output_shapes=[out_shape or (n,)], output_dtypes=[mx.float32],
               init_value=init_value)
    return np.array(out)


EXCHANGE = """
    uint tid = thread_position_in_threadgroup.x;
    threadgroup float shm[64];
    shm[tid] = inp[thread_position_in_grid.x];
    BARRIER
    out[thread_position_in_grid.x] = shm[PARTNER];
"""


@pytest.mark.parametrize("barrier,partner,race", [
    ("threadgroup_barrier(mem_flags::mem_threadgroup);", "63 - tid", False),
    ("threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);", "63 - tid",
     False),
    ("", "63 - tid", True),
    ("threadgroup_barrier(mem_flags::mem_none);", "63 - tid", True),  # execution only
    ("threadgroup_barrier(mem_flags::mem_device);", "63 - tid", True),  # wrong memory
    # a SIMD-group barrier orders its own SIMD-group's threads, no one else's
    ("simdgroup_barrier(mem_flags::mem_threadgroup);", "(tid & 32) + 31 - (tid & 31)", False),
    ("simdgroup_barrier(mem_flags::mem_threadgroup);", "63 - tid", True),
    ("simdgroup_barrier(mem_flags::mem_device);", "(tid & 32) + 31 - (tid & 31)", True),
])
def test_race_checker_on_threadgroup_memory(barrier, partner, race):
    """Each thread writes its slot, then reads a partner's: a race unless a barrier of
    the right kind (and scope) separates the write and the read."""
    src = EXCHANGE.replace("BARRIER", barrier).replace("PARTNER", partner)
    k = sim.metal_kernel("exchange", ["inp"], ["out"], src)
    if not race:
        out = _run1(k, n=128)
        tid = np.arange(128) % 64
        want = eval(partner.replace("&", "&"), {"tid": tid}) + (np.arange(128) // 64) * 64
        np.testing.assert_array_equal(out, want.astype(np.float32))
        return
    with pytest.raises(sim.MetalSimRaceError) as ei:
        _run1(k, n=128)
    msg = str(ei.value)
    assert "kernel 'exchange'" in msg and "threadgroup array 'shm'" in msg
    assert "in threadgroup (0,0,0)" in msg
    # both threads, both source lines with their text
    assert msg.count("thread_position_in_threadgroup=") == 2
    assert "exchange.body.metal:4 `shm[tid] = inp[thread_position_in_grid.x];`" in msg
    assert "exchange.body.metal:6 `out[thread_position_in_grid.x] = shm[" in msg


def test_race_checker_on_device_memory_written_in_the_threadgroup():
    """Device memory written by one thread and read by another within a threadgroup needs
    threadgroup_barrier(mem_device); inputs and other threadgroups' data are not tracked."""
    src = """
        uint i = thread_position_in_grid.x;
        scratch[i] = inp[i] * 2.0f;
        BARRIER
        uint base = i - thread_position_in_threadgroup.x;
        out[i] = scratch[base + (threads_per_threadgroup.x - 1 - thread_position_in_threadgroup.x)];
    """
    x = mx.arange(96).astype(mx.float32)
    for barrier, race in [("threadgroup_barrier(mem_flags::mem_device);", False),
                          ("threadgroup_barrier(mem_flags::mem_threadgroup);", True),
                          ("", True)]:
        k = sim.metal_kernel("dev_exchange", ["inp"], ["scratch", "out"],
                             src.replace("BARRIER", barrier))

        def call():
            return k(inputs=[x], grid=(96, 1, 1), threadgroup=(32, 1, 1),
                     output_shapes=[(96,), (96,)], output_dtypes=[mx.float32] * 2)

        if not race:
            _, out = call()
            np.testing.assert_array_equal(np.array(out),
                                          2.0 * np.arange(96).reshape(3, 32)[:, ::-1].ravel())
            continue
        with pytest.raises(sim.MetalSimRaceError,
                           match=r"dev_exchange.*device buffer 'scratch' \(element \d+\)"):
            call()


def test_race_checker_write_after_read_with_many_readers():
    """Every thread reads shm[0]; then thread 5 overwrites it without a barrier."""
    src = """
        uint tid = thread_position_in_threadgroup.x;
        threadgroup float shm[1];
        if (tid == 0) { shm[0] = 1.0f; }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float v = shm[0];
        if (tid == 5) { shm[0] = 2.0f; }
        out[tid] = v;
    """
    k = sim.metal_kernel("war", ["inp"], ["out"], src)
    with pytest.raises(sim.MetalSimRaceError) as ei:
        _run1(k)
    msg = str(ei.value)
    assert "write-after-read" in msg and "'shm'" in msg
    # a reader other than the writer, then the writer
    assert re.search(r"thread (\d+) \(.*reads it at war\.body\.metal:6 `float v = shm\[0\];`",
                     msg).group(1) != "5"
    assert re.search(r"thread 5 \(.*?\)\) writes it at war\.body\.metal:7 "
                     r"`if \(tid == 5\) \{ shm\[0\] = 2\.0f; \}`", msg)


def test_same_value_stores_are_not_a_race_different_values_are():
    """Every thread storing the same value (e.g. zeroing an element) is harmless on the
    GPU; different values written without a barrier are a write-write race."""
    same = sim.metal_kernel("same_store", ["inp"], ["out"], """
        threadgroup float shm[1];
        uint tid = thread_position_in_threadgroup.x;
        shm[0] = 3.0f;
        if (tid > 1) { out[tid] = 0.0f; }
        out[0] = 7.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid == 1) { out[1] = shm[0]; }
    """)
    out = _run1(same, n=32, tg=32)
    assert out[0] == 7.0 and out[1] == 3.0
    differ = sim.metal_kernel("differ_store", ["inp"], ["out"], """
        threadgroup float shm[1];
        shm[0] = float(thread_position_in_threadgroup.x);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[thread_position_in_grid.x] = shm[0];
    """)
    with pytest.raises(sim.MetalSimRaceError, match=r"write-write, different values.*'shm'"):
        _run1(differ, n=32, tg=32)


def test_result_that_depends_on_thread_order_is_reported():
    """Races the access checker cannot see (atomics, another threadgroup's output) show as
    outputs that differ between the forward and the reverse schedule."""
    last = sim.metal_kernel("last_writer", ["inp"], ["out"], """
        uint tid = thread_position_in_threadgroup.x;
        threadgroup atomic_uint who[1];
        atomic_store_explicit(&who[0], tid, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[tid] = float(atomic_load_explicit(&who[0], memory_order_relaxed));
    """)
    with pytest.raises(sim.MetalSimRaceError, match=r"last_writer.*depends on the thread order.*"
                                                   r"output 'out'.*reverse schedule"):
        _run1(last, n=32, tg=32)
    # one schedule, checker off: the emulator runs it (threads in order: the last one wins)
    quiet = sim.metal_kernel("last_writer", ["inp"], ["out"], last.source, schedules=1,
                             racecheck=False)
    assert np.all(_run1(quiet, n=32, tg=32) == 31.0)
    # threadgroup 1 reads what threadgroup 0 wrote: threadgroups run in reverse, too
    cross = sim.metal_kernel("cross_group", ["inp"], ["out"], """
        uint i = thread_position_in_grid.x;
        out[i] = 1.0f;
        if (i == 32) { out[i] = out[0] + 1.0f; }
    """)
    with pytest.raises(sim.MetalSimRaceError, match=r"cross_group.*output 'out' element \(32,\)"):
        _run1(cross, n=64, tg=32, init_value=0.0)


def test_seeded_random_schedules_agree_for_a_correct_kernel():
    src = EXCHANGE.replace("BARRIER", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    k = sim.metal_kernel("exchange4", ["inp"], ["out"], src.replace("PARTNER", "63 - tid"),
                         schedules=4)
    out = _run1(k, n=128)
    np.testing.assert_array_equal(out, (63 - np.arange(128) % 64 + np.arange(128) // 64 * 64))


# ------------------------------------------------------------------ caching


def test_compiled_kernels_are_cached_on_disk(monkeypatch, tmp_path):
    monkeypatch.setenv("KIMI_MLX_SIM_CACHE", str(tmp_path))
    src = "uint i = thread_position_in_grid.x; out[i] = inp[i] * 2.0f;"
    call = dict(inputs=[mx.ones((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                output_shapes=[(4,)], output_dtypes=[mx.float32])
    sim.metal_kernel("cached", ["inp"], ["out"], src)(**call)
    assert sim.cache_dir() == tmp_path
    libs = sorted(p.name for p in tmp_path.glob("k-*.so"))
    assert len(libs) == 1

    # A new process (no libraries loaded) reuses the .so: g++ never runs.
    monkeypatch.setattr(_native, "_loaded",
                        {k: v for k, v in _native._loaded.items() if k.startswith("rt-")})
    monkeypatch.setattr(_native.subprocess, "run",
                        lambda *a, **kw: pytest.fail("g++ ran for a cached kernel"))
    (out,) = sim.metal_kernel("cached", ["inp"], ["out"], src)(**call)
    assert np.all(np.array(out) == 2.0)
    monkeypatch.undo()
    monkeypatch.setenv("KIMI_MLX_SIM_CACHE", str(tmp_path))
    # Another body (or header, or flags) is another library.
    sim.metal_kernel("cached", ["inp"], ["out"], src.replace("2.0f", "3.0f"))(**call)
    assert len(list(tmp_path.glob("k-*.so"))) == 2


# ----------------------------------------------------------------- dispatch


def test_kernel_mode_and_dispatch(monkeypatch):
    monkeypatch.delenv(dispatch.SIM_ENV, raising=False)
    k = dispatch.metal_kernel("disp", ["inp"], ["out"],
                              "uint i = thread_position_in_grid.x; out[i] = inp[i] + 1.0f;")
    call = dict(inputs=[mx.zeros((4,))], grid=(4, 1, 1), threadgroup=(4, 1, 1),
                output_shapes=[(4,)], output_dtypes=[mx.float32])
    expected_default = "metal" if mx.metal.is_available() else "reference"
    assert dispatch.kernel_mode() == expected_default
    if expected_default == "reference":
        with pytest.raises(dispatch.MetalUnavailableError, match="disp.*reference op"):
            k(**call)
    with dispatch.use_sim():
        assert dispatch.kernel_mode() == "sim"
        with dispatch.use_sim():
            assert dispatch.kernel_mode() == "sim"
        assert dispatch.kernel_mode() == "sim"
        (out,) = k(**call)
        assert np.all(np.array(out) == 1.0)
    assert dispatch.kernel_mode() == expected_default
    monkeypatch.setenv(dispatch.SIM_ENV, "1")
    assert dispatch.kernel_mode() == "sim"
    monkeypatch.setenv(dispatch.SIM_ENV, "0")
    assert dispatch.kernel_mode() == expected_default
