"""`metal_kernel`: mx.fast.metal_kernel's API, run by the CPU emulator."""

from __future__ import annotations

import ctypes
import os
import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from kimi_mlx.metal.sim import _native
from kimi_mlx.metal.sim.errors import (
    MetalSimDeadlockError,
    MetalSimError,
    MetalSimFaultError,
    MetalSimKernelError,
    MetalSimOutOfBoundsError,
    MetalSimRaceError,
    MetalSimTimeoutError,
)
from kimi_mlx.metal.sim.signature import (
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
    _native.ERR_RACE: MetalSimRaceError,
}

_PC_RE = re.compile(r"\{\{pc:(0x[0-9a-fA-F]+|\?[^}]*)\}\}")


def _schedule_name(k: int) -> str:
    if k == _native.SCHED_FORWARD:
        return "forward"
    if k == _native.SCHED_REVERSE:
        return "reverse"
    return f"random (seed {k - _native.SCHED_RANDOM})"


def _schedule_code(i: int) -> int:
    """The i-th schedule of a call: forward, reverse, then seeded shuffles."""
    return i if i < _native.SCHED_RANDOM else _native.SCHED_RANDOM + i - 2

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


def _buffer(arr: np.ndarray, name: str, keep: list, writable: bool = False) -> _native.Buffer:
    """msim_buffer for a numpy array: pointer to element 0 and the byte range
    its elements span (strides may be zero or negative)."""
    keep.append(arr)
    if arr.size == 0:
        return _native.Buffer(arr.ctypes.data, 0, 0, name.encode(), arr.itemsize, int(writable))
    lo = hi = 0
    for n, s in zip(arr.shape, arr.strides):
        ext = s * (n - 1)
        if ext < 0:
            lo += ext
        else:
            hi += ext
    return _native.Buffer(arr.ctypes.data, lo, hi + arr.itemsize, name.encode(), arr.itemsize,
                          int(writable))


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
      racecheck: the race checker is on (see ``metal/sim/__init__.py``).
      schedules: thread schedules per call (forward, reverse, then seeded
        shuffles); outputs must agree bit for bit across them.
      timeout_s: watchdog per dispatch (<= 0: none).
    """

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Optional[dict] = None,
                 *, checked: Optional[bool] = None, timeout_s: Optional[float] = None,
                 stack_kb: Optional[int] = None, racecheck: Optional[bool] = None,
                 schedules: Optional[int] = None):
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
        self.racecheck = (_env_flag("KIMI_MLX_SIM_RACECHECK", True) if racecheck is None
                          else bool(racecheck))
        if schedules is None:
            schedules = int(os.environ.get("KIMI_MLX_SIM_SCHEDULES", "2") or 2)
        if schedules < 1:
            raise ValueError(f"[metal_sim] schedules must be >= 1, got {schedules}")
        self.schedules = int(schedules)
        if timeout_s is None:
            timeout_s = float(os.environ.get("KIMI_MLX_SIM_TIMEOUT", "300"))
        self.timeout_s = timeout_s
        if stack_kb is None:
            stack_kb = int(os.environ.get("KIMI_MLX_SIM_STACK_KB", "256"))
        self.stack_kb = stack_kb
        self._libs: Dict[tuple, Tuple[ctypes.CDLL, int]] = {}
        self._so: Dict[int, str] = {}  # entry address -> library file

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
          MetalSimRaceError: a data race (racecheck), or outputs that differ
            between thread schedules.
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

        first: List[np.ndarray] = []
        for oname, shape, dtype in zip(self.output_names, output_shapes, out_dtypes):
            shape = tuple(int(s) for s in shape)
            if init_value is not None:
                o = np.array(_np_view(mx.full(shape, init_value, dtype=dtype)))
            else:
                o = np.empty(shape, dtype=_np_dtype(dtype))
                if self.checked:
                    o.reshape(-1).view(np.uint8).fill(0xFF)
            first.append(o)
        # Every schedule starts from the same output bytes.
        initial = [o.copy() for o in first] if self.schedules > 1 else []

        # MLX: group_dims = min(threadgroup, grid) per dimension.
        eff_tg = tuple(max(1, min(t, g)) for t, g in zip(tg3, grid3))
        outs: List[np.ndarray] = []
        for i in range(self.schedules):
            sched = _schedule_code(i)
            run = first if i == 0 else [o.copy() for o in initial]
            run_buffers = list(buffers) + [_buffer(o, n, keep, writable=True)
                                           for o, n in zip(run, self.output_names)]
            code, msg = _native.dispatch(
                fn, run_buffers, grid3, eff_tg, timeout_s=self.timeout_s,
                stack_bytes=self.stack_kb * 1024, poison=self.checked,
                max_threadgroup_bytes=MAX_THREADGROUP_BYTES, schedule=sched,
                racecheck=self.racecheck)
            if code != _native.OK:
                if code == _native.ERR_RACE:
                    msg = self._source_lines(fn, msg)
                if i > 0:
                    msg += f" (thread schedule: {_schedule_name(sched)})"
                raise self._fail(_ERRORS.get(code, MetalSimKernelError), msg)
            if i == 0:
                outs = run
            else:
                self._same_outputs(outs, run, sched)

        results = []
        for o, dtype in zip(outs, out_dtypes):
            if dtype in _NP_STORAGE:
                results.append(mx.array(o).view(dtype))
            else:
                results.append(mx.array(o))
        return results

    def _same_outputs(self, want: Sequence[np.ndarray], got: Sequence[np.ndarray],
                      sched: int) -> None:
        """Outputs of the forward schedule vs another one, bit for bit."""
        for name, a, b in zip(self.output_names, want, got):
            if a.size == 0:
                continue
            av = a.reshape(-1).view(np.uint8).reshape(a.size, a.itemsize)
            bv = b.reshape(-1).view(np.uint8).reshape(b.size, b.itemsize)
            bad = np.flatnonzero((av != bv).any(axis=1))
            if bad.size == 0:
                continue
            flat = int(bad[0])
            idx = tuple(int(x) for x in np.unravel_index(flat, a.shape))
            raise self._fail(MetalSimRaceError, (
                f"the result depends on the thread order: output '{name}' element {idx} is "
                f"{a.reshape(-1)[flat]!r} with threads in forward order and "
                f"{b.reshape(-1)[flat]!r} in the {_schedule_name(sched)} schedule "
                f"({bad.size} elements differ): a data race the access checker does not see "
                "(atomics, another threadgroup's output) or atomics whose result depends on "
                "their order"))

    def _source_lines(self, fn: int, msg: str) -> str:
        """Replace the runtime's {{pc:0x...}} code offsets with source lines."""
        so = self._so.get(fn)
        offsets = [int(m.group(1), 16) for m in _PC_RE.finditer(msg)
                   if m.group(1).startswith("0x")]
        lines = _native.source_lines(so, offsets) if so else {}
        texts = {"body": self.source.splitlines(), "header": self.header.splitlines()}

        def place(m) -> str:
            tok = m.group(1)
            if not tok.startswith("0x") or int(tok, 16) not in lines:
                return f"<code offset {tok}{' in ' + so if so else ''}>"
            file, line = lines[int(tok, 16)]
            part = "header" if file.endswith(".header.metal") else "body"
            text = texts[part]
            code = text[line - 1].strip() if 0 < line <= len(text) else ""
            return f"{file}:{line} `{code}`" if code else f"{file}:{line}"

        return _PC_RE.sub(place, msg)

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
            self.racecheck,
        )
        hit = self._libs.get(key)
        if hit is None:
            tu = cpp_translation_unit(self.name, self.input_names, self.output_names,
                                      self.source, self.header, infos, out_dtypes, tmpl,
                                      self.atomic_outputs, self.checked, self.racecheck)
            flags = _native.racecheck_flags() if self.racecheck else ()
            hit = _native.kernel_library(self.name, tu.files, tu.main, compile_only=flags)
            self._libs[key] = hit
            self._so[hit[1]] = _native.library_path(hit[0])
        return hit[1]


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Optional[dict] = None,
                 *, checked: Optional[bool] = None, timeout_s: Optional[float] = None,
                 racecheck: Optional[bool] = None, schedules: Optional[int] = None
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
      racecheck: report data races on threadgroup memory and on device memory
        written within a threadgroup; default from $KIMI_MLX_SIM_RACECHECK
        (on unless "0").
      schedules: thread schedules per call (1: forward only; 2: forward and
        reverse; more: seeded shuffles too), whose outputs must agree bit for
        bit; default $KIMI_MLX_SIM_SCHEDULES or 2.
    Returns:
      SimKernel, callable as ``kernel(inputs=..., template=..., grid=...,
      threadgroup=..., output_shapes=..., output_dtypes=..., init_value=None)``.
    Raises:
      ValueError: no outputs, bad compile_options.
    """
    return SimKernel(name, input_names, output_names, source, header, ensure_row_contiguous,
                     atomic_outputs, compile_options, checked=checked, timeout_s=timeout_s,
                     racecheck=racecheck, schedules=schedules)
