"""Our Metal kernels are checked on the device before first use and fall back to their
reference ops when they fail (metal/dispatch.py `kernel_enabled`, metal/selfcheck.py).

The device is faked: `dispatch._metal_available` says Metal is there and
`dispatch._build_metal` hands out kernel callables: the emulator's build of the real
kernel (a passing device), or one that fails to build, returns wrong values or raises at
launch. Outputs are compared with the reference ops called directly.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kimi_mlx.metal import dispatch, kernels, selfcheck
from kimi_mlx.metal import dsa as dsa_ref
from kimi_mlx.metal import kda as kda_ref
from kimi_mlx.metal.dispatch import KERNEL_NAMES, KERNELS_ENV, SIM_ENV, use_sim
from kimi_mlx.metal.sim import metal_kernel as sim_metal_kernel
from kimi_mlx.testing.checkpoints import tolerance as project_tolerance

# The DispatchKernels behind each checked kernel (sparse_mla_decode is two).
PARTS = {
    "kda_decode": ("kda_decode",),
    "kda_prefill": ("kda_prefill",),
    "dsa_index_topk": ("dsa_index_topk",),
    "sparse_mla_decode": ("sparse_mla_partial", "sparse_mla_combine"),
    "dsa_index_topk_q": ("dsa_index_topk_q",),
    "sparse_mla_decode_q": ("sparse_mla_partial_q", "sparse_mla_combine_q"),
}
KERNEL_OF = {part: name for name, parts in PARTS.items() for part in parts}


class FakeDevice:
    """`dispatch._build_metal` stand-in: per DispatchKernel name a behaviour,
    "pass" (the emulator runs the real source), "build" (raises when built, as
    mx.fast.metal_kernel / the Metal compiler would), "wrong" (runs, perturbed
    outputs), "launch" (raises when called). Counts builds and calls."""

    def __init__(self, behaviour):
        self.behaviour = behaviour
        self.calls = {}
        self.builds = {}

    def __call__(self, spec):
        name = spec["name"]
        self.builds[name] = self.builds.get(name, 0) + 1
        how = self.behaviour(name)
        if how == "build":
            raise RuntimeError(f"Unable to build metal library from source\n"
                               f"program_source:12:5: error: use of undeclared identifier "
                               f"'frobnicate' in custom_kernel_{name}")
        sim = sim_metal_kernel(**spec)

        def run(**kwargs):
            self.calls[name] = self.calls.get(name, 0) + 1
            if how == "launch":
                raise RuntimeError(f"[metal::Device] Unable to load kernel custom_kernel_{name}")
            outs = sim(**kwargs)
            if how == "wrong":
                outs = [mx.where(o >= 0, o ^ 1, o) if o.dtype == mx.int32 else o * 1.01 + 0.01
                        for o in outs]
            return outs

        return run


@pytest.fixture
def device(monkeypatch):
    """Install a FakeDevice: device(behaviour) with behaviour(kernel part) -> str."""
    monkeypatch.delenv(SIM_ENV, raising=False)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(dispatch, "_metal_available", lambda: True)
    # Fresh DispatchKernels: nothing built before this test.
    for name in kernels.SPECS:
        monkeypatch.setitem(kernels.KERNELS, name, kernels.build_kernel(name))
    dispatch.reset_kernel_checks()

    def install(behaviour):
        fake = FakeDevice(behaviour)
        monkeypatch.setattr(dispatch, "_build_metal", fake)
        return fake

    yield install
    dispatch.reset_kernel_checks()


# ----------------------------------------------------------------- inputs and references


def _kda_inputs(T, seed=0, B=2, H=2, Dk=32, Dv=16):
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    q, k, a, v = f(B, T, H, Dk), f(B, T, H, Dk), f(B, T, H, Dk), f(B, T, H, Dv)
    b = f(B, T, H)
    A_log = mx.array(np.log(rng.uniform(1, 16, H)).astype(np.float32))
    dt_bias = f(H, Dk) * 0.5
    state = f(B, H, Dv, Dk) * 0.3
    return q, k, v, a, b, A_log, dt_bias, state


def _dsa_inputs(seed=1, B=2, L=4, S=12, Hi=2, Di=16):
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((B, L, Hi, Di)).astype(np.float32))
    w = mx.array(rng.uniform(0.1, 1, (B, L, Hi)).astype(np.float32))
    kx = mx.array(rng.standard_normal((B, S, Di)).astype(np.float32))
    return q, w, kx


def _mla_inputs(seed=2, B=2, H=2, R=32, P=16, S=12):
    rng = np.random.default_rng(seed)
    f = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    return f(B, H, 1, R), f(B, H, 1, P), f(B, 1, S, R), f(B, 1, S, P)


def run_dispatch_points():
    """Call every dispatch function that can pick a kernel; returns their outputs
    together with the reference ops' outputs for the same inputs (called directly)."""
    q, k, v, a, b, A_log, dt_bias, state = _kda_inputs(1)
    got = {"kda_decode": kda_ref.kda_forward(q, k, v, a, b, A_log, dt_bias, state, -5.0)}
    want = {"kda_decode": kda_ref.kda_decode(q, k, v, a, b, A_log, dt_bias, state, -5.0)}

    q, k, v, a, b, A_log, dt_bias, state = _kda_inputs(20, seed=3)
    qn, kn, g, beta = kda_ref.kda_prepare(q, k, a, b, A_log, dt_bias, -5.0, 32**-0.5)
    got["kda_prefill"] = kda_ref.kda_update(qn, kn, v, g, beta, state)
    want["kda_prefill"] = kda_ref.kda_chunked(qn, kn, v, g, beta, state)  # T > 8

    qi, w, kx = _dsa_inputs()
    got["dsa_index_topk"] = dsa_ref.dsa_prefill_indices(qi, w, kx, 5, 8)
    want["dsa_index_topk"] = dsa_ref.dsa_index_topk(qi, w, kx, 5, 8)

    q_lat, q_pe, latent, k_pe = _mla_inputs()
    qi, w, kx = _dsa_inputs(seed=4, L=1)
    scale = 48**-0.5
    got["sparse_mla_decode"] = dsa_ref.dsa_sparse_decode(
        q_lat, q_pe, latent, k_pe, scale, qi, w, kx, 5, 11)
    idx = dsa_ref.dsa_index_topk(qi, w, kx, 5, 11)
    want["sparse_mla_decode"] = dsa_ref.sparse_mla_decode(
        q_lat, q_pe, latent[:, 0], k_pe[:, 0], idx[:, 0], scale)

    # the same over an 8-bit cache (mx.quantize, group 32): latent and index keys
    qi, w, kx = _dsa_inputs(Di=32)
    kq = mx.quantize(kx, group_size=32, bits=8)
    got["dsa_index_topk_q"] = dsa_ref.dsa_prefill_indices_quantized(qi, w, kq, 5, 8,
                                                                    group_size=32)
    want["dsa_index_topk_q"] = dsa_ref.dsa_index_topk_q_reference(qi, w, kq, 5, 8,
                                                                  group_size=32)
    qi, w, kx = _dsa_inputs(seed=4, L=1, Di=32)
    kq = mx.quantize(kx, group_size=32, bits=8)
    lat = mx.quantize(latent, group_size=32, bits=8)
    got["sparse_mla_decode_q"] = dsa_ref.dsa_sparse_decode_quantized(
        q_lat, q_pe, lat, k_pe, scale, qi, w, kq, 5, 11, group_size=32)
    idx = dsa_ref.dsa_index_topk_q_reference(qi, w, kq, 5, 11, group_size=32)
    want["sparse_mla_decode_q"] = dsa_ref.sparse_mla_decode_q_reference(
        q_lat, q_pe, [p[:, 0] for p in lat], k_pe[:, 0], idx[:, 0], scale, group_size=32)
    mx.eval(got, want)
    return got, want


def _flat(x):
    return list(x) if isinstance(x, tuple) else [x]


def assert_reference_output(got, want, name, exact=True):
    """The fallen-back dispatch gives the reference op's output: the same ops, so equal
    bit for bit, except the sparse decode, whose fallback is the dense masked form of the
    same math, and (exact=False) where another, passing kernel takes part (both within
    the project's tolerance)."""
    for g, w in zip(_flat(got), _flat(want)):
        if name.startswith("sparse_mla_decode") or not exact:
            err = selfcheck.rel_err(g, w)
            assert err <= project_tolerance(1, 48), f"{name}: rel err {err}"
        else:
            assert np.array_equal(np.array(g), np.array(w)), name


def _warnings(caplog):
    return [r for r in caplog.records
            if r.levelno == logging.WARNING and r.name == "kimi_mlx.metal.dispatch"]


# ---------------------------------------------------------------------- failure kinds


@pytest.mark.parametrize("kind", ["build", "wrong", "launch"])
def test_failing_kernel_falls_back_warns_once_gives_reference_output(device, caplog, kind):
    fake = device(lambda part: kind)
    caplog.set_level(logging.WARNING, logger="kimi_mlx.metal.dispatch")
    for _ in range(2):  # a second round: no new check, no new warning, no kernel call
        got, want = run_dispatch_points()
        for name in KERNEL_NAMES:
            assert_reference_output(got[name], want[name], name)
    warns = _warnings(caplog)
    assert sorted(KERNEL_OF.get(w.args[0], w.args[0]) for w in warns) == sorted(KERNEL_NAMES)
    for w in warns:
        line = w.getMessage()
        assert "\n" not in line
        assert f"MLX {mx.__version__}" in line and "macOS" in line
        name = w.args[0]
        assert line.startswith(f"Metal kernel {name} disabled")
        if kind == "build":
            assert "RuntimeError: Unable to build metal library" in line and "frobnicate" in line
        elif kind == "launch":
            assert "RuntimeError: [metal::Device] Unable to load kernel" in line
        else:
            assert ("differs from the reference op" in line or "selected scores" in line
                    or "selects" in line), line
    status = dispatch.kernel_status()
    assert set(status) == set(KERNEL_NAMES) and all(s != "ok" for s in status.values())
    # the broken kernels ran in their check only (the first part of each kernel)
    if kind != "build":
        assert all(n == 1 for n in fake.calls.values()), fake.calls


@pytest.mark.parametrize("broken", KERNEL_NAMES)
def test_one_failing_kernel_falls_back_alone(device, caplog, broken):
    fake = device(lambda part: "wrong" if KERNEL_OF[part] == broken else "pass")
    caplog.set_level(logging.WARNING, logger="kimi_mlx.metal.dispatch")
    got, want = run_dispatch_points()
    status = dispatch.kernel_status()
    assert status[broken] != "ok"
    assert all(status[n] == "ok" for n in status if n != broken)
    assert [w.args[0] for w in _warnings(caplog)] == [broken]
    # The broken kernel's dispatch point gives the reference op's output (kda_forward
    # without its decode kernel goes on to kda_update, whose prefill kernel passes).
    assert_reference_output(got[broken], want[broken], broken, exact=broken != "kda_decode")
    # A passing kernel is used: called in its check and again for the real call.
    for name in status:
        if name != broken:
            assert fake.calls.get(PARTS[name][0], 0) >= 2, (name, fake.calls)


def test_passing_kernels_are_used_after_their_check(device, caplog):
    fake = device(lambda part: "pass")
    caplog.set_level(logging.WARNING, logger="kimi_mlx.metal.dispatch")
    got, want = run_dispatch_points()
    assert dispatch.kernel_status() == {n: "ok" for n in KERNEL_NAMES}
    assert not _warnings(caplog)
    for parts in PARTS.values():
        for part in parts:
            assert fake.builds[part] == 1 and fake.calls[part] >= 2, (part, fake.calls)
    for name in KERNEL_NAMES:  # kernel outputs, close to the reference
        if name.startswith("dsa_index_topk"):
            continue
        for g, w in zip(_flat(got[name]), _flat(want[name])):
            assert selfcheck.rel_err(g, w) <= 1e-5, name
    calls = dict(fake.calls)
    run_dispatch_points()  # no second check
    for part, n in calls.items():
        assert fake.calls[part] > n


def test_real_mlx_without_metal_backend_falls_back(monkeypatch, caplog):
    """Metal claimed but the real mx.fast.metal_kernel: MLX's own launch error
    ("No Metal back-end" on this Linux machine) makes every kernel fall back."""
    if mx.metal.is_available():
        pytest.skip("a real Metal device is here")
    monkeypatch.delenv(SIM_ENV, raising=False)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    monkeypatch.setattr(dispatch, "_metal_available", lambda: True)
    for name in kernels.SPECS:
        monkeypatch.setitem(kernels.KERNELS, name, kernels.build_kernel(name))
    dispatch.reset_kernel_checks()
    caplog.set_level(logging.WARNING, logger="kimi_mlx.metal.dispatch")
    try:
        got, want = run_dispatch_points()
    finally:
        status = dispatch.kernel_status()
        dispatch.reset_kernel_checks()
    for name in KERNEL_NAMES:
        assert_reference_output(got[name], want[name], name)
        assert "No Metal back-end" in status[name]
    assert len(_warnings(caplog)) == len(KERNEL_NAMES)


# ------------------------------------------------------------------------ the setting


def test_setting_reference_never_uses_a_kernel(device, monkeypatch, caplog):
    fake = device(lambda part: "pass")
    monkeypatch.setenv(KERNELS_ENV, "reference")
    got, want = run_dispatch_points()
    assert fake.builds == {} and fake.calls == {}
    assert dispatch.kernel_status() == {}
    for name in KERNEL_NAMES:
        assert_reference_output(got[name], want[name], name)
    with use_sim():  # the emulator too
        assert not any(dispatch.kernel_enabled(n) for n in KERNEL_NAMES)


def test_setting_metal_trusts_the_kernels(device, monkeypatch, caplog):
    fake = device(lambda part: "wrong")
    monkeypatch.setenv(KERNELS_ENV, "METAL")
    caplog.set_level(logging.WARNING, logger="kimi_mlx.metal.dispatch")
    got, want = run_dispatch_points()
    assert dispatch.kernel_status() == {} and not _warnings(caplog)
    # the (wrong) kernels were used, once each: no check ran
    assert fake.calls["kda_decode"] == 1 and fake.calls["sparse_mla_partial"] == 1
    assert selfcheck.rel_err(got["kda_decode"][0], want["kda_decode"][0]) > 1e-3


@pytest.mark.parametrize("value", ["", "auto", " Auto "])
def test_setting_auto_checks_then_uses(device, monkeypatch, value):
    fake = device(lambda part: "pass")
    monkeypatch.setenv(KERNELS_ENV, value)
    assert dispatch.kernels_setting() == "auto"
    assert dispatch.check_kernels(["kda_decode"]) == {"kda_decode": "ok"}
    checked = fake.calls["kda_decode"]  # the check ran it (once per gate form)
    assert checked >= 1 and set(fake.calls) == {"kda_decode"}
    assert dispatch.kernel_enabled("kda_decode")
    assert fake.calls["kda_decode"] == checked  # checked once per process


@pytest.mark.parametrize("value", ["gpu", "on", "1", "sim"])
def test_setting_unknown_is_a_clear_error(device, monkeypatch, value):
    device(lambda part: "pass")
    monkeypatch.setenv(KERNELS_ENV, value)
    with pytest.raises(ValueError, match=rf"KIMI_MLX_KERNELS='{value}'.*auto, metal, reference"):
        dispatch.kernel_enabled("kda_decode")
    with pytest.raises(ValueError, match="KIMI_MLX_KERNELS"):
        run_dispatch_points()


def test_emulator_and_no_device_run_no_check(monkeypatch):
    monkeypatch.delenv(KERNELS_ENV, raising=False)
    dispatch.reset_kernel_checks()
    with use_sim():
        assert all(dispatch.kernel_enabled(n) for n in KERNEL_NAMES)
    monkeypatch.setattr(dispatch, "_metal_available", lambda: False)
    monkeypatch.delenv(SIM_ENV, raising=False)
    assert not any(dispatch.kernel_enabled(n) for n in KERNEL_NAMES)
    assert dispatch.kernel_status() == {}
    with pytest.raises(ValueError, match="unknown kernel"):
        dispatch.kernel_enabled("kda_decoder")


def test_every_kernel_has_a_registered_check():
    # registered by kimi_mlx.metal.kda / dsa (imported above), one per kernel name
    assert set(dispatch._checks) == set(KERNEL_NAMES)


# ------------------------------------------------------------ the check's own cases


def test_tolerance_is_the_project_rule():
    for depth, n in ((1, 32), (1, 48), (6, 128), (69, 12288)):
        assert selfcheck.tolerance(depth, n) == project_tolerance(depth, n)


def test_edge_cases_are_in_the_check_inputs():
    # KDA prefill: the prompt crosses a chunk boundary at the chunk the wrapper uses
    T, chunk = selfcheck.EDGE_CASES["kda_prefill"]()
    C, _, _ = kernels._prefill_tiling(64, 32, chunk)
    assert C == chunk and T > C and T % C != 0

    # DSA top-k: exact ties cut by top-k, rows with fewer allowed keys than top-k, a row
    # with none; counted on scores computed here with NumPy
    q, w, kx, S, shape, starts = selfcheck.EDGE_CASES["dsa_index_topk"]()
    q, w, kx = (np.array(x, dtype=np.float64) for x in (q, w, kx))
    topk, offset = shape["topk"], shape["offset"]
    cut_in_tie = fewer = none = 0
    for b in range(shape["B"]):
        for l in range(shape["L"]):
            allowed = [s for s in range(S) if starts[b] <= s <= offset + l]
            sc = sorted((float((w[b, l] * np.maximum(q[b, l] @ kx[b, s], 0)).sum())
                         for s in allowed), reverse=True)
            if len(allowed) < topk:
                fewer += 1
                none += not allowed
            elif len(allowed) > topk and sc[topk - 1] == sc[topk]:
                cut_in_tie += 1
    assert cut_in_tie >= 3 and fewer >= 2 and none >= 1, (cut_in_tie, fewer, none)

    # sparse MLA: a row with fewer valid keys than top-k, a row with none, an index = S
    q_lat, q_pe, latent, k_pe, indices, shape = selfcheck.EDGE_CASES["sparse_mla_decode"]()
    S, K = latent.shape[1], indices.shape[1]
    valid = [[0 <= i < S for i in row] for row in indices.tolist()]
    assert any(0 < sum(r) < K for r in valid) and any(sum(r) == 0 for r in valid)
    assert S in sum(indices.tolist(), [])
    assert shape["splits"] > 1


def test_topk_comparison_is_robust_to_ties_and_catches_wrong_sets():
    inf = -math.inf
    scores = [3.0, 1.0, 3.0, 2.0, 2.0, inf]
    assert selfcheck.topk_mismatch([0, 2, 3], [2, 0, 4], scores, 1e-6) is None  # tie 3 / 4
    assert selfcheck.topk_mismatch([0, 2, 1], [2, 0, 4], scores, 1e-6)  # 1.0 is not 2.0
    assert selfcheck.topk_mismatch([0, 2, -1], [2, 0, 4], scores, 1e-6)  # too few
    assert selfcheck.topk_mismatch([0, 2, 5], [2, 0, 4], scores, 1e-6)  # not allowed
    assert selfcheck.topk_mismatch([0, 0, 3], [2, 0, 4], scores, 1e-6)  # twice


def test_real_kernels_pass_the_check_in_the_emulator():
    with use_sim():
        results = {n: dispatch.run_check(n) for n in KERNEL_NAMES}
    assert results == {n: None for n in KERNEL_NAMES}


def _plant(name, pattern, replacement):
    def transform(src):
        assert src.count(pattern) == 1, pattern
        return src.replace(pattern, replacement)

    return name, transform


# Bugs planted in the real sources, one per kernel, on the paths the edge cases take.
PLANTED = [
    # the l2norm eps dropped: NaN only for a zero-norm row
    ("kda_decode", _plant("kda_decode", "metal::rsqrt(qq + eps)", "metal::rsqrt(qq)")),
    # the decay to the chunk's end read one token early (the state carried across chunks)
    ("kda_prefill", _plant("kda_prefill", "const float gend = sgc[C - 1][d];",
                           "const float gend = sgc[C - 2][d];")),
    # a batch row's last padding key taken as real: only a row whose first key is > 0
    ("dsa_index_topk", _plant("dsa_index_topk", "metal::min(start[bi], limit)",
                              "metal::min(start[bi] - 1, limit)")),
    # the first split dropped in the merge
    ("sparse_mla_decode", _plant("sparse_mla_combine",
                                 "for (int sp = 0; sp < NSPLIT; ++sp) {\n    const uint prow",
                                 "for (int sp = 1; sp < NSPLIT; ++sp) {\n    const uint prow")),
]


@pytest.mark.parametrize("name,planted", PLANTED, ids=[p[0] for p in PLANTED])
def test_check_catches_a_planted_bug_in_the_real_source(monkeypatch, name, planted):
    part, transform = planted
    monkeypatch.setitem(kernels.KERNELS, part, kernels.build_kernel(part, transform))
    with use_sim():
        error = dispatch.run_check(name)
    assert error is not None, name


# ------------------------------------------------------------------------ at load


MICRO = Path(__file__).resolve().parent.parent / "kimi_mlx" / "assets" / "micro"


def test_load_runs_the_checks_before_the_first_forward(device):
    from kimi_mlx.checkpoint.loader import load_model

    fake = device(lambda part: "wrong" if part == "dsa_index_topk" else "pass")
    load_model(MICRO, verbose=False)
    status = dispatch.kernel_status()
    assert set(status) == set(KERNEL_NAMES)
    assert [n for n, s in status.items() if s != "ok"] == ["dsa_index_topk"]
    assert fake.calls["dsa_index_topk"] == 1  # its check only


def test_load_refuses_an_unknown_setting(monkeypatch):
    from kimi_mlx.checkpoint.loader import load_model

    monkeypatch.setenv(KERNELS_ENV, "fast")
    with pytest.raises(ValueError, match="KIMI_MLX_KERNELS='fast'"):
        load_model(MICRO, verbose=False)
