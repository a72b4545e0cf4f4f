"""Kernel signatures the way ``mx.fast.metal_kernel`` writes them, and their
C++ translation for the emulator.

MLX (``mlx/fast.cpp`` + ``mlx/backend/metal/custom_kernel.cpp``, 0.32) turns
``(name, input_names, output_names, source, header)`` plus a call's inputs,
template arguments and output dtypes into one Metal source:

* ``header``, then ``template <typename InT, int K, bool B>`` when template
  arguments are given (dtype -> ``typename``, int -> ``int``, bool -> ``bool``);
* ``[[kernel]] void custom_kernel_<name>[_<template hash>]_<in types>_<out types>(``;
* per input, buffer index in order: ``const device T* x`` (``const constant``
  when the array has fewer than 8 elements; ``&`` instead of ``*`` for a 0-d
  array, which is what python scalars become), followed, only for inputs
  with ndim > 0 whose name + suffix occurs in the body, by
  ``const constant int* x_shape``, ``const constant int64_t* x_strides``,
  ``const constant int& x_ndim``;
* per output ``device T* y`` (``device atomic<T>*`` with atomic_outputs);
* every thread attribute whose name occurs in the body (plain substring
  search, in MLX's fixed order), e.g. ``uint3 thread_position_in_grid
  [[thread_position_in_grid]]``;
* the body, ``}``, and an explicit instantiation for templates.

`metal_source()` reproduces that text exactly (for ``verbose=True`` and error
messages). `cpp_translation_unit()` emits the same signature as a C++ function
template over metal_sim.h types, with the body and header included as files
(so g++ diagnostics point at ``<kernel>.body.metal:<line>``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple, Union

import mlx.core as mx

from kimi_mlx.metal.sim.errors import MetalSimCompileError

# Inputs with fewer elements than this go to the constant address space.
MAX_CONSTANT_ARRAY_SIZE = 8

# MLX's get_type_string (mlx/backend/common/compiled.cpp).
_TYPE_STRING = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}
_UNSUPPORTED_SIM = {mx.complex64}

# (name, type) in the order MLX checks them (mlx/fast.cpp metal_attributes).
METAL_ATTRIBUTES: Tuple[Tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)
# Field of msim_thread_attrs holding each attribute.
_ATTR_FIELD = {"grid_size": "threads_per_grid"}

TemplateValue = Union[bool, int, mx.Dtype]


def type_string(dtype: mx.Dtype) -> str:
    """Metal type name MLX uses for `dtype` (e.g. float16 -> "float16_t").

    Raises:
      ValueError: dtype MLX cannot put in a kernel signature (float64).
    """
    try:
        return _TYPE_STRING[dtype]
    except KeyError:
        raise ValueError(f"[metal_kernel] Unsupported compilation type {dtype}")


@dataclass(frozen=True)
class ArgInfo:
    """What the signature needs to know about one input array."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int

    @property
    def location(self) -> str:
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"


@dataclass(frozen=True)
class ShapeInfo:
    """Which of <name>_shape/_strides/_ndim the body mentions."""

    shape: bool
    strides: bool
    ndim: bool


def shape_infos(source: str, input_names: Sequence[str]) -> List[ShapeInfo]:
    """MLX's substring test for <name>_shape/_strides/_ndim in the body."""
    return [
        ShapeInfo(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source)
        for n in input_names
    ]


def attributes(source: str) -> List[Tuple[str, str]]:
    """Thread attributes the body mentions (substring test), MLX order."""
    return [(a, t) for a, t in METAL_ATTRIBUTES if a in source]


def normalize_template(template) -> List[Tuple[str, TemplateValue]]:
    """Check template arguments as MLX's binding does (bool before int).

    Raises:
      ValueError: a value that is not a Dtype, int or bool.
    """
    out: List[Tuple[str, TemplateValue]] = []
    for item in template or []:
        name, value = item
        if isinstance(value, bool) or isinstance(value, int) or isinstance(value, mx.Dtype):
            out.append((str(name), value))
        else:
            raise ValueError(
                "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, "
                "`int` or `bool`."
            )
    return out


def _template_value_metal(v: TemplateValue) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"  # std::ostream << bool
    if isinstance(v, int):
        return str(v)
    return type_string(v)


def _template_param_type(v: TemplateValue) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    return "typename"


def kernel_name(name: str, template: Sequence[Tuple[str, TemplateValue]],
                inputs: Sequence[ArgInfo], output_dtypes: Sequence[mx.Dtype]) -> str:
    """MLX's host name: custom_kernel_<name>[_<template hash>]_<types>."""
    kname = "custom_kernel_" + name
    if template:
        tdef = "<" + ", ".join(_template_value_metal(v) for _, v in template) + ">"
        thash = re.sub(r"<|>|(, )", "_", tdef)[:-1]
        kname += "_" + thash
    for a in inputs:
        kname += "_" + type_string(a.dtype)
        if a.ndim == 0:
            kname += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for d in output_dtypes:
        kname += "_" + type_string(d)
    return kname


def metal_source(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str, inputs: Sequence[ArgInfo],
                 output_dtypes: Sequence[mx.Dtype],
                 template: Sequence[Tuple[str, TemplateValue]],
                 atomic_outputs: bool = False) -> str:
    """The Metal source MLX would compile for this call (its exact text)."""
    kname = kernel_name(name, template, inputs, output_dtypes)
    infos = shape_infos(source, input_names)
    attrs = attributes(source)
    s = header
    if template:
        s += "template <"
        s += ", ".join(f"{_template_param_type(v)} {n}" for n, v in template)
        s += ">\n"
    s += "[[kernel]] void " + kname + "(\n"
    index = 0
    for a, info in zip(inputs, infos):
        ref = "&" if a.ndim == 0 else "*"
        s += f"  const {a.location} {type_string(a.dtype)}{ref} {a.name} [[buffer({index})]],\n"
        index += 1
        if a.ndim > 0:
            if info.shape:
                s += f"  const constant int* {a.name}_shape [[buffer({index})]],\n"
                index += 1
            if info.strides:
                s += f"  const constant int64_t* {a.name}_strides [[buffer({index})]],\n"
                index += 1
            if info.ndim:
                s += f"  const constant int& {a.name}_ndim [[buffer({index})]],\n"
                index += 1
    for oname, dtype in zip(output_names, output_dtypes):
        t = type_string(dtype)
        if atomic_outputs:
            t = f"atomic<{t}>"
        s += f"  device {t}* {oname} [[buffer({index})]]"
        # (MLX compares the buffer index, shape buffers included, with
        # #inputs + #outputs - 1 here; reproduced as is.)
        if index < len(inputs) + len(output_names) - 1 or attrs:
            s += ",\n"
        else:
            s += ") {\n"
        index += 1
    for i, (attr, atype) in enumerate(attrs):
        s += f"  {atype} {attr} [[{attr}]]"
        s += ",\n" if i < len(attrs) - 1 else ") {\n"
    s += source
    s += "\n}\n"
    if template:
        tdef = kname + "<" + ", ".join(_template_value_metal(v) for _, v in template) + ">"
        s += f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
    return s


# --------------------------------------------------------------- translation

_TYPE_RE = (
    r"[A-Za-z_]\w*(?:\s*::\s*[A-Za-z_]\w*)*"
    r"(?:\s*<[^<>;{}()]*(?:<[^<>;{}()]*>[^<>;{}()]*)*>)?"
)
_METAL_INCLUDE_RE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[^\n]*", re.M)
_HALF_LITERAL_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_PTR_CAST_RE = re.compile(
    r"\b(?:reinterpret_cast|static_cast)\s*<(\s*(?:const\s+)?(?:device|constant)\b[^<>;]*"
    r"(?:<[^<>;]*>[^<>;]*)*\*\s*)>"
)
_ADDR_PTR_RE = re.compile(
    r"\b(?:(const)\s+)?(device|constant)\s+(?:(const)\s+)?(" + _TYPE_RE + r")\s*\*(?!\s*\*)"
)
# `constant` is read-only in Metal: it becomes `const` (merged with a `const`
# already there), after checked mode has turned constant pointers into dptr.
_CONSTANT_RE = re.compile(r"\b(?:const\s+)?constant\b(?:\s+const\b)?")
_TG_DECL_RE = re.compile(
    r"\bthreadgroup\s+(" + _TYPE_RE + r")\s+([A-Za-z_]\w*)\s*((?:\[[^\[\];]+\]\s*)*);"
)


_COMMENT_RE = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_TG_KEYWORD_RE = re.compile(r"\bthreadgroup\b(?!_)")


class TranslationError(ValueError):
    """Kernel text the emulator cannot translate faithfully (e.g. a
    threadgroup declaration form it does not recognise)."""


def _blank_comments(text: str) -> str:
    """`text` with comments replaced by spaces (offsets and newlines kept)."""
    return _COMMENT_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def _check_threadgroup_leftovers(text: str, where: str) -> None:
    """Every `threadgroup` left after translation must qualify a pointer or a
    reference; anything else would silently become per-thread storage."""
    code = _blank_comments(text)
    for m in _TG_KEYWORD_RE.finditer(code):
        tail = code[m.end(): m.end() + 300]
        stop = re.search(r"[;,(){}=]", tail)
        seg = tail[: stop.start()] if stop else tail
        if "*" in seg or "&" in seg:
            continue
        line_no = code.count("\n", 0, m.start()) + 1
        line = text.splitlines()[line_no - 1].strip()
        raise TranslationError(
            f"{where}:{line_no}: unsupported threadgroup declaration `{line}`; metal/sim "
            "understands `threadgroup T name[N]...;` (one variable per declaration) and "
            "threadgroup pointers/references"
        )


def _keep_lines(repl):
    """Wrap a re.sub replacement so the replaced text keeps its line count."""

    def f(m):
        return repl(m) + "\n" * m.group(0).count("\n")

    return f


class _Translator:
    def __init__(self, checked: bool):
        self.checked = checked
        self.tg_slot = 0

    def translate(self, text: str, where: str) -> str:
        text = _METAL_INCLUDE_RE.sub(lambda m: "// (metal/sim) " + m.group(0).strip(), text)
        text = _HALF_LITERAL_RE.sub(lambda m: f"((half)({m.group(1)}))", text)
        text = _TG_DECL_RE.sub(_keep_lines(self._tg_decl), text)
        _check_threadgroup_leftovers(text, where)
        if self.checked:
            text = _PTR_CAST_RE.sub(_keep_lines(lambda m: f"::msim::ptr_cast<{m.group(1)}>"), text)
            text = _ADDR_PTR_RE.sub(_keep_lines(self._addr_ptr), text)
        text = _CONSTANT_RE.sub(_keep_lines(lambda m: "const"), text)
        return text

    def _addr_ptr(self, m) -> str:
        const = "const " if (m.group(1) or m.group(3) or m.group(2) == "constant") else ""
        t = re.sub(r"\s+", " ", m.group(4)).strip()
        return f"::msim::dptr<{const}{t}> "

    def _tg_decl(self, m) -> str:
        t = re.sub(r"\s+", " ", m.group(1)).strip()
        name = m.group(2)
        dims = re.sub(r"\s+", "", m.group(3))
        slot = self.tg_slot
        self.tg_slot += 1
        alias = f"__msim_tg{slot}_t"
        decl = f"using {alias} = {t}{dims}; "
        if dims and self.checked:
            return decl + f'auto {name} = ::msim::tg_array_decl<{alias}>({slot}, "{name}");'
        return decl + f'auto& {name} = ::msim::tg_var<{alias}>({slot}, "{name}");'


@dataclass
class Translation:
    """Files of one generated kernel: {file name: text}, and the main file."""

    files: Dict[str, str]
    main: str
    stem: str


def _stem(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "kernel"


def _cpp_template_value(v: TemplateValue) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    return type_string(v)


def cpp_translation_unit(name: str, input_names: Sequence[str], output_names: Sequence[str],
                         source: str, header: str, inputs: Sequence[ArgInfo],
                         output_dtypes: Sequence[mx.Dtype],
                         template: Sequence[Tuple[str, TemplateValue]],
                         atomic_outputs: bool, checked: bool,
                         racecheck: bool = False) -> Translation:
    """C++ for the emulator: same parameters, order and names as
    `metal_source`, with metal_sim.h types (bounds-checked pointers when
    `checked`), plus ``msim_kernel_run`` which binds runtime buffers and thread
    attributes to them. `racecheck` defines the access hooks of the race
    checker (compile with ``_native.RACECHECK_FLAGS``).

    Raises:
      NotImplementedError: a dtype the emulator cannot represent (complex64).
      MetalSimCompileError: body/header text the emulator cannot translate.
    """
    for a in inputs:
        if a.dtype in _UNSUPPORTED_SIM:
            raise NotImplementedError(f"metal/sim: {a.dtype} inputs are not supported")
    for d in output_dtypes:
        if d in _UNSUPPORTED_SIM:
            raise NotImplementedError(f"metal/sim: {d} outputs are not supported")
    stem = _stem(name)
    tr = _Translator(checked)
    files: Dict[str, str] = {}
    body_file = f"{stem}.body.metal"
    header_file = f"{stem}.header.metal"
    try:
        header_t = tr.translate(header, header_file) if header else ""
        body_t = tr.translate(source, body_file)
    except TranslationError as e:
        raise MetalSimCompileError(name, str(e), stage="metal/sim translation") from None
    files[body_file] = body_t + "\n"
    infos = shape_infos(source, input_names)
    attrs = attributes(source)

    params: List[str] = []
    args: List[str] = []
    b = 0
    for a, info in zip(inputs, infos):
        t = type_string(a.dtype)
        if a.ndim == 0:
            params.append(f"const {t}& {a.name}")
            args.append(f"::msim::arg_ref<{t}>(B[{b}])")
        else:
            params.append(f"::msim::arg_ptr_t<const {t}> {a.name}")
            args.append(f"::msim::arg_ptr<const {t}>(B[{b}])")
        b += 1
        if a.ndim > 0:
            if info.shape:
                params.append(f"::msim::arg_ptr_t<const int> {a.name}_shape")
                args.append(f"::msim::arg_ptr<const int>(B[{b}])")
                b += 1
            if info.strides:
                params.append(f"::msim::arg_ptr_t<const int64_t> {a.name}_strides")
                args.append(f"::msim::arg_ptr<const int64_t>(B[{b}])")
                b += 1
            if info.ndim:
                params.append(f"const int& {a.name}_ndim")
                args.append(f"::msim::arg_ref<int>(B[{b}])")
                b += 1
    for oname, dtype in zip(output_names, output_dtypes):
        t = type_string(dtype)
        if atomic_outputs:
            t = f"metal::atomic<{t}>"
        params.append(f"::msim::arg_ptr_t<{t}> {oname}")
        args.append(f"::msim::arg_ptr<{t}>(B[{b}])")
        b += 1
    for attr, atype in attrs:
        params.append(f"{atype} {attr}")
        field = _ATTR_FIELD.get(attr, attr)
        if atype == "uint3":
            args.append(f"uint3(A->{field}.x, A->{field}.y, A->{field}.z)")
        else:
            args.append(f"A->{field}")

    lines = [
        f"// metal/sim translation of mx.fast.metal_kernel '{name}'",
        f"#define MSIM_CHECKED {1 if checked else 0}",
        f"#define MSIM_RACECHECK {1 if racecheck else 0}",
        '#include "metal_sim.h"',
    ]
    if header:
        files[header_file] = header_t + "\n"
        lines.append(f'#include "{header_file}"')
    if template:
        lines.append(
            "template <" + ", ".join(f"{_template_param_type(v)} {n}" for n, v in template) + ">"
        )
    lines.append("void msim_kernel(")
    lines.append(",\n".join("    " + p for p in params) + ") {")
    lines.append(f'#include "{body_file}"')
    lines.append("}")
    targs = ""
    if template:
        targs = "<" + ", ".join(_cpp_template_value(v) for _, v in template) + ">"
    lines.append('extern "C" int msim_kernel_abi_version(void) { return MSIM_ABI_VERSION; }')
    lines.append(
        'extern "C" void msim_kernel_run(const msim_api* api, '
        "const msim_thread_attrs* A, const msim_buffer* B) {"
    )
    lines.append("  (void)A; (void)B;")
    lines.append("  ::msim::g_api = api;")
    lines.append(f"  msim_kernel{targs}(")
    lines.append(",\n".join("      " + x for x in args) + ");")
    lines.append("}")
    main = f"{stem}.cpp"
    files[main] = "\n".join(lines) + "\n"
    return Translation(files=files, main=main, stem=stem)
