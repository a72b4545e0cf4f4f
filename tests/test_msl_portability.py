"""Our kernel sources are portable to Apple's Metal compiler, and the emulator writes the
kernel signature the installed MLX writes.

- The MSL lint (metal/sim/lint.py) flags, with its line, each construct Metal refuses
  but g++ (and so the emulator) accepts, in small synthetic bodies; it flags nothing in
  legal code that looks like it (products, bitwise and, address-of, casts with an
  address space, words in comments and strings).
- Every `.metal` source of ours, every kernel source string in our Python, and the full
  source MLX would compile for each kernel call of the device check pass it.
- The kernel source `mx.fast.metal_kernel` generates (captured from the installed MLX:
  without Metal it still writes it while `mx.export_function` traces, and prints it with
  verbose=True) equals what metal/sim/signature.py assumes, for a probe pinned to the
  MLX 0.32 format and for every kernel call of the device check. A new MLX that changes
  the format fails here, loudly.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

from kimi_mlx.metal import kernels
from kimi_mlx.metal.sim import lint
from kimi_mlx.metal.sim import metal_kernel as sim_metal_kernel

REPO = Path(__file__).resolve().parent.parent
METAL_DIR = REPO / "metal"
PRODUCT_DIRS = ("kimi_mlx", "metal", "cluster", "prune")


def _rules_lines(findings):
    return [(f.rule, f.line) for f in findings]


# ------------------------------------------------------------ forbidden constructs

# (rule, body, line of the construct). Each body is otherwise legal MSL.
FORBIDDEN = [
    ("double", "uint i = thread_position_in_grid.x;\ndouble acc = 0;\nout[i] = acc;", 2),
    ("double", "uint i = thread_position_in_grid.x;\nfloat x = 1.0f;\n"
               "long double acc = x;\nout[i] = acc;", 3),
    ("recursion", "uint i = thread_position_in_grid.x;\nout[i] = fib(i);", 2,
     "int fib(int n) {\n  return n < 2 ? n : fib(n - 1) + fib(n - 2);\n}\n"),
    ("recursion", "out[0] = ping(3);", 3,
     "int pong(int n);\nint ping(int n) {\n  return n == 0 ? 0 : pong(n - 1);\n}\n"
     "int pong(int n) {\n  return ping(n);\n}\n"),
    ("function-pointer", "uint i = thread_position_in_grid.x;\n"
                         "float (*op)(float) = metal::exp;\nout[i] = op(inp[i]);", 2),
    ("function-pointer", "using op_t = float (*)(float);\nout[0] = 1.0f;", 1),
    ("dynamic-allocation", "uint i = thread_position_in_grid.x;\n"
                           "device float* tmp = new float[4];\nout[i] = tmp[0];", 2),
    ("dynamic-allocation", "uint i = thread_position_in_grid.x;\n"
                           "device float* tmp = (device float*) malloc(16);\nout[i] = tmp[0];", 2),
    ("address-space", "uint i = thread_position_in_grid.x;\nconst float* row = inp + i;\n"
                      "out[i] = row[0];", 2),
    ("address-space", "out[0] = first(inp);", 1,
     "float first(const float* x) { return x[0]; }\n"),
    ("address-space", "out[0] = take(out[1]);", 1,
     "float take(const float& x) { return x; }\n"),
    ("address-space", "uint i = thread_position_in_grid.x;\n"
                      "auto p = reinterpret_cast<const float*>(inp);\nout[i] = p[i];", 2),
    ("atomic-type", "threadgroup atomic<half> acc;\nout[0] = 0;", 1),
    ("atomic-type", "uint i = thread_position_in_grid.x;\nthreadgroup atomic_ulong big;\n"
                    "out[i] = 0;", 2),
    ("exceptions", "uint i = thread_position_in_grid.x;\nif (i > 4) {\n  throw 1;\n}\n"
                   "out[i] = 0;", 3),
    ("virtual", "out[0] = 0;", 2, "struct Op {\n  virtual float f(float x) { return x; }\n};\n"),
    ("derived-class", "out[0] = 0;", 2, "struct Base { float a; };\nstruct Op : Base { float b; };\n"),
    ("goto", "uint i = thread_position_in_grid.x;\nif (i > 4) goto done;\nout[i] = 1;\n"
             "done:\nout[i] += 0;", 2),
    ("lambda", "uint i = thread_position_in_grid.x;\nauto sq = [](float x) { return x * x; };\n"
               "out[i] = sq(inp[i]);", 2),
    ("storage-class", "uint i = thread_position_in_grid.x;\nregister float x = inp[i];\n"
                      "out[i] = x;", 2),
    ("rtti", "out[0] = 0;\nauto t = typeid(out);", 2),
    ("std-library", "uint i = thread_position_in_grid.x;\nout[i] = std::max(inp[i], 0.0f);", 2),
    ("std-library", "out[0] = 0;", 1, "#include <cmath>\n"),
]


def _split(case):
    rule, body, line = case[:3]
    header = case[3] if len(case) > 3 else ""
    return rule, body, line, header


@pytest.mark.parametrize("case", FORBIDDEN, ids=[f"{c[0]}-{i}" for i, c in enumerate(FORBIDDEN)])
def test_each_forbidden_construct_is_flagged_with_its_line(case):
    rule, body, line, header = _split(case)
    text = header if header else body
    findings = lint.lint(text, "synthetic")
    if header:  # the construct is in the header; the body is clean
        assert lint.lint(body) == [] or rule == "recursion"
    assert _rules_lines(findings) == [(rule, line)], [str(f) for f in findings]
    assert str(findings[0]).startswith(f"synthetic:{line}: [{rule}]")


def test_every_rule_has_a_synthetic_case():
    assert {c[0] for c in FORBIDDEN} == set(lint.RULES)


LEGAL = r"""
// comments may say double, new, goto, std::vector, float* p, virtual and throw
#include <metal_simdgroup>
template <typename T, int N>
METAL_FUNC float dot_row(const device T* x, thread const float& scale, uint n) {
  float acc = 0.0f;
  for (uint d = 0; d < n; ++d) {
    acc += static_cast<float>(x[d]) * scale;   // a product next to a cast
  }
  return acc * float(N);
}
struct Pair { float a; float b; };
inline float twice(float x) { return 2.0f * x; }
// kernel-like body
const uint i = thread_position_in_grid.x;
threadgroup float tile[32][4];
threadgroup atomic_uint hist[256];
device atomic<float>* acc_out = reinterpret_cast<device atomic<float>*>(out);
threadgroup float* trow = &tile[i % 32][0];
const device float* row = inp + i * 4;
float s0 = tile[0][0];
thread float& first = s0;
uint bits = as_type<uint>(inp[i]) & 0x7fffffffu;
float scaled = sizeof(float) * 2 + float(bits & 255u) * twice(1.0f);
float prod = inp[i] * inp[i + 1];
Pair p = {prod, scaled};
atomic_fetch_add_explicit(&hist[bits & 255u], 1u, metal::memory_order_relaxed);
metal::threadgroup_barrier(metal::mem_flags::mem_threadgroup);
out[i] = dot_row<float, 4>(row, first, 4) + p.a + trow[0] > 0.0f ? 1.0f : 0.0f;
const char* note = "new double std::x";
"""


def test_legal_code_that_looks_forbidden_is_not_flagged():
    findings = lint.lint(LEGAL.replace('const char* note = "new double std::x";',
                                       'constant char* note = "new double std::x";'))
    assert findings == [], [str(f) for f in findings]
    # and the one line left unqualified on purpose is found, at its line
    line = LEGAL.splitlines().index('const char* note = "new double std::x";') + 1
    assert _rules_lines(lint.lint(LEGAL)) == [("address-space", line)]


# ------------------------------------------------------------------- our sources


def _product_python():
    for d in PRODUCT_DIRS:
        yield from sorted((REPO / d).rglob("*.py"))


def test_our_metal_sources_pass_the_lint():
    files = sorted(METAL_DIR.glob("*.metal"))
    # every kernel the dispatcher builds comes from one of these files
    assert {spec[0] for spec in kernels.SPECS.values()} == {f.name for f in files}
    findings = lint.lint_all(files)
    assert findings == [], "\n".join(map(str, findings))


def test_our_python_kernel_strings_pass_the_lint():
    findings = lint.lint_all(_product_python())
    assert findings == [], "\n".join(map(str, findings))


def test_python_kernel_strings_are_found_with_their_file_lines(tmp_path):
    src = tmp_path / "k.py"
    src.write_text(textwrap.dedent('''\
        import mlx.core as mx

        BODY = """
            uint i = thread_position_in_grid.x;
            double x = inp[i];
            out[i] = x;
        """

        k = mx.fast.metal_kernel(name="k", input_names=["inp"], output_names=["out"],
                                 source=BODY)
        h = mx.fast.metal_kernel("h", ["inp"], ["out"], "out[0] = inp[0];",
                                 "float f(float* p) { return p[0]; }")
        '''))
    findings = lint.lint_python(src)
    assert [(f.rule, f.line) for f in findings] == [("double", 5), ("address-space", 12)]
    assert [f.where.rsplit(" ", 1)[1] for f in findings] == ["source", "header"]


def test_lint_sees_the_recursion_the_emulator_accepts():
    """tests/test_metal_sim.py builds a recursive kernel helper on purpose (the
    emulator's stack-overflow test): g++ compiles it, Metal would refuse it."""
    findings = lint.lint_python(REPO / "tests" / "test_metal_sim.py")
    assert [f.rule for f in findings] == ["recursion"]
    assert "rec -> rec" in findings[0].message


# ------------------------------------------------ the source MLX compiles, per call

_CAPTURE = r"""
import json, os, sys
import mlx.core as mx
from kimi_mlx.metal import dispatch, dsa, kda, kernels
from kimi_mlx.metal.sim import metal_kernel as sim_metal_kernel

out_dir = sys.argv[1]
calls = []


def build(spec):
    sim = sim_metal_kernel(**spec)
    real = mx.fast.metal_kernel(**spec)

    def run(**kw):
        inputs = kw["inputs"]
        arrays = [x for x in inputs if isinstance(x, mx.array)]

        def traced(*arrs):
            it = iter(arrs)
            ins = [next(it) if isinstance(x, mx.array) else x for x in inputs]
            return real(inputs=ins, output_shapes=kw["output_shapes"],
                        output_dtypes=kw["output_dtypes"], grid=kw["grid"],
                        threadgroup=kw["threadgroup"], template=kw.get("template"),
                        verbose=True)

        sys.stdout.flush()
        mx.export_function(os.path.join(out_dir, "k%d.mlxfn" % len(calls)), traced, *arrays)
        sys.stdout.flush()
        calls.append([spec["name"],
                      sim.metal_source(inputs, kw["output_dtypes"], kw.get("template"))])
        return sim(**kw)

    return run


dispatch._metal_available = lambda: True
dispatch._build_metal = build
for name in kernels.SPECS:
    kernels.KERNELS[name] = kernels.build_kernel(name)
result = {name: dispatch.run_check(name) for name in dispatch.KERNEL_NAMES}
with open(os.path.join(out_dir, "sim.json"), "w") as f:
    json.dump({"calls": calls, "result": result}, f)
"""

_GENERATED = re.compile(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```\n", re.S)


def _mlx_generated(stdout: str):
    return [(m.group(1), m.group(2)) for m in _GENERATED.finditer(stdout)]


@pytest.fixture(scope="module")
def captured(tmp_path_factory):
    """Every kernel call of the device check: the source the installed MLX generates
    (printed while mx.export_function traces the call) and metal/sim's version of it."""
    out = tmp_path_factory.mktemp("mlx_sources")
    env = dict(os.environ)
    env.pop("KIMI_MLX_METAL_SIM", None)
    env.pop("KIMI_MLX_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _CAPTURE, str(out)], capture_output=True,
                          text=True, env=env, timeout=600, cwd=str(REPO))
    assert proc.returncode == 0, proc.stderr[-4000:]
    sim = json.loads((out / "sim.json").read_text())
    return _mlx_generated(proc.stdout), sim


def test_signature_matches_mlx_for_every_kernel_call_of_the_check(captured):
    generated, sim = captured
    assert sim["result"] == {n: None for n in selfcheck_names()}  # the check passed
    names = {n for n, _ in sim["calls"]}
    assert names == set(kernels.SPECS), names  # every DispatchKernel was called
    assert len(generated) == len(sim["calls"])
    for (mlx_name, mlx_src), (name, sim_src) in zip(generated, sim["calls"]):
        assert mlx_name == name
        assert sim_src == mlx_src, (
            f"MLX {mx.__version__} generates a different source for kernel {name} than "
            f"metal/sim/signature.py assumes:\n--- MLX\n{mlx_src}\n--- metal/sim\n{sim_src}")


def test_full_sources_of_every_kernel_call_pass_the_lint(captured):
    generated, _ = captured
    for name, src in generated:
        findings = lint.lint(src, f"generated {name}")
        assert findings == [], "\n".join(map(str, findings))


def selfcheck_names():
    from kimi_mlx.metal.dispatch import KERNEL_NAMES

    return KERNEL_NAMES


# The format of MLX 0.32 (mlx/backend/common/metal_kernel.cpp write_signature): header;
# template line; kernel name with template hash and per-input type tags (s = scalar,
# c = constant); inputs with `constant` under 8 elements, `&` for scalars, _shape after
# its array when the body names it; outputs; thread attributes in MLX's order; body;
# explicit instantiation.
PINNED_MLX = "0.32"
PROBE = dict(name="probe", input_names=["x", "n", "c"], output_names=["y"],
             source="uint i = thread_position_in_grid.x;\n"
                    "y[i] = x[i] * T(n) + c[0] + x_shape[0] + simdgroup_index_in_threadgroup;",
             header="// probe header\n")
# x has 8 elements (device), c 7 (constant): the two sides of MLX's constant-size limit.
PROBE_CALL = dict(template=[("T", mx.float32), ("K", 4), ("B", True)], grid=(8, 1, 1),
                  threadgroup=(8, 1, 1), output_shapes=[(8,)], output_dtypes=[mx.float32])
PROBE_SOURCE = """\
// probe header
template <typename T, int K, bool B>
[[kernel]] void custom_kernel_probe__float_4_1_float_int32_ts_floatc_float(
  const device float* x [[buffer(0)]],
  const constant int* x_shape [[buffer(1)]],
  const constant int32_t& n [[buffer(2)]],
  const constant float* c [[buffer(3)]],
  device float* y [[buffer(4)]],
  uint simdgroup_index_in_threadgroup [[simdgroup_index_in_threadgroup]],
  uint3 thread_position_in_grid [[thread_position_in_grid]]) {
uint i = thread_position_in_grid.x;
y[i] = x[i] * T(n) + c[0] + x_shape[0] + simdgroup_index_in_threadgroup;
}

template [[host_name("custom_kernel_probe__float_4_1_float_int32_ts_floatc_float")]] \
[[kernel]] decltype(custom_kernel_probe__float_4_1_float_int32_ts_floatc_float<float, 4, 1>) \
custom_kernel_probe__float_4_1_float_int32_ts_floatc_float<float, 4, 1>;
"""

_PROBE_SCRIPT = r"""
import sys
import mlx.core as mx
spec, call = {spec!r}, {call!r}
call["template"] = [(n, getattr(mx, v[3:]) if isinstance(v, str) else v)
                    for n, v in call["template"]]
call["output_dtypes"] = [getattr(mx, d[3:]) for d in call["output_dtypes"]]
k = mx.fast.metal_kernel(**spec)
f = lambda x, c: k(inputs=[x, 3, c], verbose=True, **call)
mx.export_function(sys.argv[1], f, mx.ones((8,)), mx.ones((7,)))
"""


def _dtype_name(d):
    return "mx." + str(d).split(".")[-1]


def test_mlx_kernel_signature_format_is_pinned(tmp_path):
    call = dict(PROBE_CALL)
    call["template"] = [(n, _dtype_name(v) if isinstance(v, mx.Dtype) else v)
                        for n, v in PROBE_CALL["template"]]
    call["output_dtypes"] = [_dtype_name(d) for d in PROBE_CALL["output_dtypes"]]
    script = _PROBE_SCRIPT.format(spec=PROBE, call=call)
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "probe.mlxfn")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    generated = _mlx_generated(proc.stdout)
    assert len(generated) == 1, proc.stdout
    assert generated[0][1] == PROBE_SOURCE, (
        f"MLX {mx.__version__} writes mx.fast.metal_kernel sources differently from the "
        f"MLX {PINNED_MLX} format that metal/sim/signature.py reproduces: update "
        f"signature.py (and this pin) to the new format.\n--- MLX now\n{generated[0][1]}")
    # metal/sim writes the pinned text too
    sim = sim_metal_kernel(**PROBE)
    assert sim.metal_source([mx.ones((8,)), 3, mx.ones((7,))], PROBE_CALL["output_dtypes"],
                            PROBE_CALL["template"]) == PROBE_SOURCE
