"""`metal_kernel`: mx.fast.metal_kernel's API, run by the CPU emulator."""

from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import _native
from .errors import (
    MetalSimDeadlockError,
    MetalSimError,
    MetalSimFaultError,
    MetalSimKernelError,
    MetalSimOutOfBoundsError,
    MetalSimTimeoutError,
)
from .signature import (
    ArgInfo,
    cpp_translation_unit,
    metal_source,
    normalize_template,
    shape_infos,
    type_string,
)

# Largest threadgroup Apple GPUs run, and their threadgroup memory.
MAX_THREADS_PER_THREADGROUP = 1024
MAX_THREADGROUP_BYTES = 32768

_ERRORS = {
    _native.ERR_OOB: MetalSimOutOfBoundsError,
    _native.ERR_DEADLOCK: MetalSimDeadlockError,
    _native.ERR_FAULT: MetalSimFaultError,
    _native.ERR_TIMEOUT: MetalSimTimeoutError,
    _native.ERR_CONFIG: MetalSimKernelError,
    _native.ERR_KERNEL: MetalSimKernelError,
}

# numpy stand-ins for dtypes numpy lacks (same size, bits copied).
_NP_STORAGE = {mx.bfloat16: (np.uint16, mx.uint16)}


def _env_flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or v == "":
        return default
    return v.lower() not in ("0", "false", "no", "off")


def _to_array(x: Any) -> mx.array:
    """MLX's to_array for kernel inputs: python bool/int/float -> 0-d
    bool/int32/float32 arrays, arrays as they are."""
    if isinstance(x, mx.array):
        return x
    if isinstance(x, bool):
        return mx.array(x, dtype=mx.bool_)
    if isinstance(x, int):
        return mx.array(x, dtype=mx.int32)
    if isinstance(x, float):
        return mx.array(x, dtype=mx.float32)
    return mx.array(x)


def _np_view(a: mx.array) -> np.ndarray:
    """Zero-copy numpy view of an evaluated MLX array (strides kept)."""
    if a.dtype in _NP_STORAGE:
        return np.asarray(a.view(_NP_STORAGE[a.dtype][1]))
    return np.asarray(a)


_NP_DTYPE = {
    mx.bool_: np.bool_, mx.uint8: np.uint8, mx.uint16: np.uint16, mx.uint32: np.uint32,
    mx.uint64: np.uint64, mx.int8: np.int8, mx.int16: np.int16, mx.int32: np.int32,
    mx.int64: np.int64, mx.float16: np.float16, mx.float32: np.float32,
    mx.bfloat16: np.uint16,
}


def _np_dtype(dtype: mx.Dtype):
    try:
        return _NP_DTYPE[dtype]
    except KeyError:
        raise NotImplementedError(f"metal/sim: {dtype} outputs are not supported")


def _buffer(arr: np.ndarray, name: str, keep: list) -> _native.Buffer:
    """msim_buffer for a numpy array: pointer to element 0 and the byte range
    its elements span (strides may be zero or negative)."""
    keep.append(arr)
    if arr.size == 0:
        return _native.Buffer(arr.ctypes.data, 0, 0, name.encode())
    lo = hi = 0
    for n, s in zip(arr.shape, arr.strides):
        ext = s * (n - 1)
        if ext < 0:
            lo += ext
        else:
            hi += ext
    return _native.Buffer(arr.ctypes.data, lo, hi + arr.itemsize, name.encode())


def _dims3(v: Sequence[int], what: str) -> Tuple[int, int, int]:
    t = tuple(int(x) for x in v)
    if len(t) != 3:
        raise ValueError(f"[metal_kernel] `{what}` must have 3 dimensions, got {len(t)}.")
    if any(x < 0 for x in t):
        raise ValueError(f"[metal_kernel] `{what}` dimensions must be non-negative, got {t}.")
    return t  # type: ignore[return-value]


class SimKernel:
    """A kernel made by `metal_kernel`; call it like mx.fast.metal_kernel's
    result. Instances are cheap; compiled code is cached per call signature
    (template values, input dtypes/ranks/size class, output dtypes) in memory
    and on disk.

    Attributes:
      name, input_names, output_names, source, header, ensure_row_contiguous,
      atomic_outputs: as given.
      checked: bounds-checked device buffers and threadgroup arrays.
      timeout_s: watchdog per dispatch (<= 0: none).
    """

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Optional[dict] = None,
                 *, checked: Optional[bool] = None, timeout_s: Optional[float] = None,
                 stack_kb: Optional[int] = None):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        if compile_options is not None:
            if not isinstance(compile_options, dict):
                raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
            for k, v in compile_options.items():
                if k != "math_mode":
                    raise ValueError(f"[metal_kernel] Unknown compile option `{k}`.")
                if v not in ("safe", "relaxed", "fast"):
                    raise ValueError(
                        "[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'."
                    )
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self.checked = _env_flag("KIMI_MLX_SIM_CHECKED", True) if checked is None else checked
        if timeout_s is None:
            timeout_s = float(os.environ.get("KIMI_MLX_SIM_TIMEOUT", "300"))
        self.timeout_s = timeout_s
        if stack_kb is None:
            stack_kb = int(os.environ.get("KIMI_MLX_SIM_STACK_KB", "256"))
        self.stack_kb = stack_kb
        self._libs: Dict[tuple, Tuple[ctypes.CDLL, int]] = {}

    def __repr__(self) -> str:
        return f"SimKernel({self.name!r}, inputs={self.input_names}, outputs={self.output_names})"

    def _fail(self, exc: type, detail: str) -> MetalSimError:
        return exc(self.name, detail)

    def __call__(self, *, inputs: Sequence[Any], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[mx.Dtype], grid: Sequence[int],
                 threadgroup: Sequence[int], template: Optional[Sequence[tuple]] = None,
                 init_value: Optional[float] = None, verbose: bool = False,
                 stream: Any = None) -> List[mx.array]:
        """Run the kernel over `grid` threads in `threadgroup`-sized groups.

        Args:
          inputs: one per input name: mx.array (any dtype but float64 and
            complex64) or python bool/int/float (0-d bool/int32/float32).
          output_shapes: one shape per output name.
          output_dtypes: one dtype per output name.
          grid: (x, y, z) in threads, as mx.fast.metal_kernel (dispatchThreads);
            edge threadgroups are partial.
          threadgroup: (x, y, z), clamped to the grid per dimension as MLX
            does; at most 1024 threads.
          template: [(name, Dtype | int | bool)] template parameters.
          init_value: fill outputs with this first; otherwise outputs start
            as 0xFF bytes (NaN for floats) in checked mode, undefined if not.
          verbose: print the Metal source MLX would compile.
          stream: ignored (the emulator runs on the CPU, synchronously).
        Returns:
          list of mx.array, one per output, row-contiguous, given shapes/dtypes.
        Raises:
          ValueError: wrong argument counts, bad grid/threadgroup/template.
          MetalSimCompileError: g++ rejected the kernel.
          MetalSimOutOfBoundsError, MetalSimDeadlockError, MetalSimFaultError,
          MetalSimTimeoutError, MetalSimKernelError: the kernel misbehaved.
        """
        if len(inputs) != len(self.input_names):
            raise ValueError(
                f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                f"but got size {len(inputs)}."
            )
        if len(output_shapes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_shapes` to have size {len(self.output_names)} "
                f"but got size {len(output_shapes)}."
            )
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(
                f"[metal_kernel] Expected `output_dtypes` to have size {len(self.output_names)} "
                f"but got size {len(output_dtypes)}."
            )
        grid3 = _dims3(grid, "grid")
        tg3 = _dims3(threadgroup, "threadgroup")
        tg_size = tg3[0] * tg3[1] * tg3[2]
        if tg_size > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"Thread group size ({tg_size}) is greater than  the maximum allowed threads "
                f"per threadgroup ({MAX_THREADS_PER_THREADGROUP})."
            )
        if tg_size == 0:
            raise ValueError(f"[metal_kernel] threadgroup dimensions must be positive, got {tg3}.")
        tmpl = normalize_template(template)
        arrays = [_to_array(x) for x in inputs]
        mx.eval(arrays)
        infos = [ArgInfo(n, a.dtype, a.ndim, a.size) for n, a in zip(self.input_names, arrays)]
        out_dtypes = list(output_dtypes)
        for d in out_dtypes:
            type_string(d)

        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n"
                  + metal_source(self.name, self.input_names, self.output_names, self.source,
                                 self.header, infos, out_dtypes, tmpl, self.atomic_outputs)
                  + "\n```")

        fn = self._compiled(infos, out_dtypes, tmpl)

        keep: list = []
        buffers: List[_native.Buffer] = []
        sinfos = shape_infos(self.source, self.input_names)
        for name, a, info in zip(self.input_names, arrays, sinfos):
            view = _np_view(a)
            if self.ensure_row_contiguous:
                view = np.ascontiguousarray(view)
            buffers.append(_buffer(view, name, keep))
            if a.ndim > 0:
                if info.shape:
                    buffers.append(_buffer(np.array(a.shape, dtype=np.int32), name + "_shape", keep))
                if info.strides:
                    st = [s // view.itemsize for s in view.strides]
                    buffers.append(_buffer(np.array(st, dtype=np.int64), name + "_strides", keep))
                if info.ndim:
                    buffers.append(_buffer(np.array(a.ndim, dtype=np.int32), name + "_ndim", keep))

        outs: List[np.ndarray] = []
        for oname, shape, dtype in zip(self.output_names, output_shapes, out_dtypes):
            shape = tuple(int(s) for s in shape)
            if init_value is not None:
                o = np.array(_np_view(mx.full(shape, init_value, dtype=dtype)))
            else:
                o = np.empty(shape, dtype=_np_dtype(dtype))
                if self.checked:
                    o.reshape(-1).view(np.uint8).fill(0xFF)
            outs.append(o)
            buffers.append(_buffer(o, oname, keep))

        # MLX: group_dims = min(threadgroup, grid) per dimension.
        eff_tg = tuple(max(1, min(t, g)) for t, g in zip(tg3, grid3))
        code, msg = _native.dispatch(
            fn, buffers, grid3, eff_tg, timeout_s=self.timeout_s,
            stack_bytes=self.stack_kb * 1024, poison=self.checked,
            max_threadgroup_bytes=MAX_THREADGROUP_BYTES)
        if code != _native.OK:
            raise self._fail(_ERRORS.get(code, MetalSimKernelError), msg)

        results = []
        for o, dtype in zip(outs, out_dtypes):
            if dtype in _NP_STORAGE:
                results.append(mx.array(o).view(dtype))
            else:
                results.append(mx.array(o))
        return results

    def metal_source(self, inputs: Sequence[Any], output_dtypes: Sequence[mx.Dtype],
                     template: Optional[Sequence[tuple]] = None) -> str:
        """The Metal source mx.fast.metal_kernel would generate for a call
        with these inputs/template/output dtypes (what ``verbose=True`` prints)."""
        arrays = [_to_array(x) for x in inputs]
        infos = [ArgInfo(n, a.dtype, a.ndim, a.size) for n, a in zip(self.input_names, arrays)]
        return metal_source(self.name, self.input_names, self.output_names, self.source,
                            self.header, infos, list(output_dtypes),
                            normalize_template(template), self.atomic_outputs)

    def _compiled(self, infos: Sequence[ArgInfo], out_dtypes: Sequence[mx.Dtype],
                  tmpl: Sequence[tuple]) -> int:
        key = (
            tuple((i.dtype, i.ndim == 0, i.size < 8) for i in infos),
            tuple(out_dtypes),
            tuple((n, type(v).__name__, str(v)) for n, v in tmpl),
            self.checked,
        )
        hit = self._libs.get(key)
        if hit is None:
            tu = cpp_translation_unit(self.name, self.input_names, self.output_names,
                                      self.source, self.header, infos, out_dtypes, tmpl,
                                      self.atomic_outputs, self.checked)
            hit = _native.kernel_library(self.name, tu.files, tu.main)
            self._libs[key] = hit
        return hit[1]


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Optional[dict] = None,
                 *, checked: Optional[bool] = None, timeout_s: Optional[float] = None
                 ) -> SimKernel:
    """Emulator counterpart of ``mx.fast.metal_kernel`` (same arguments).

    Args:
      name: kernel name (used in errors and MLX's host name).
      input_names / output_names: parameter names, in buffer order.
      source: the kernel body (Metal), exactly as given to MLX.
      header: code placed before the kernel (helpers, includes).
      ensure_row_contiguous: copy non-row-contiguous inputs first (MLX default).
      atomic_outputs: outputs become ``device atomic<T>*``.
      compile_options: accepted and checked as MLX does ({"math_mode": ...});
        the emulator always computes with IEEE float semantics.
      checked: bounds-check device buffers and threadgroup arrays; default
        from $KIMI_MLX_SIM_CHECKED (on unless "0").
      timeout_s: watchdog per dispatch; default $KIMI_MLX_SIM_TIMEOUT or 300.
    Returns:
      SimKernel, callable as ``kernel(inputs=..., template=..., grid=...,
      threadgroup=..., output_shapes=..., output_dtypes=..., init_value=None)``.
    Raises:
      ValueError: no outputs, bad compile_options.
    """
    return SimKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                     atomic_outputs, compile_options, checked=checked, timeout_s=timeout_s)
