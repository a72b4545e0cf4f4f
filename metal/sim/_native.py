"""Build, cache and call the native parts of metal/sim (g++ + ctypes).

Two kinds of shared library, both cached on disk under `cache_dir()`:

* the runtime (``msim_runtime.h``: fiber scheduler, rendezvous, fault and
  deadlock handling), built once per header version;
* one library per generated kernel translation unit (``metal_sim.h`` + the
  kernel body), keyed by a hash of everything that goes into the compile.

The ctypes structures mirror ``msim_abi.h``; keep them in sync.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from kimi_mlx.metal.sim.errors import MetalSimCompileError

SIM_DIR = Path(__file__).resolve().parent
ABI_VERSION = 4

CXX_FLAGS: Tuple[str, ...] = (
    "-std=c++20",
    "-O2",
    "-fPIC",
    "-shared",
    "-fno-strict-aliasing",
    "-fwrapv",
    "-fno-math-errno",
    "-Wno-attributes",
    "-Wno-unknown-pragmas",
    "-Wno-ignored-attributes",
    "-fmax-errors=20",
)
RUNTIME_FLAGS: Tuple[str, ...] = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-shared",
    "-pthread",
    "-U_FORTIFY_SOURCE",
)


class Uint3(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint32), ("y", ctypes.c_uint32), ("z", ctypes.c_uint32)]


class Buffer(ctypes.Structure):
    """msim_buffer: one kernel argument (pointer to element 0, byte range)."""

    _fields_ = [
        ("ptr", ctypes.c_void_p),
        ("lo", ctypes.c_int64),
        ("hi", ctypes.c_int64),
        ("name", ctypes.c_char_p),
        ("itemsize", ctypes.c_uint32),
        ("writable", ctypes.c_uint32),
    ]


class Launch(ctypes.Structure):
    _fields_ = [
        ("fn", ctypes.c_void_p),
        ("buffers", ctypes.POINTER(Buffer)),
        ("nbuffers", ctypes.c_uint32),
        ("schedule", ctypes.c_uint32),
        ("racecheck", ctypes.c_int),
        ("grid", ctypes.c_uint32 * 3),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("stack_bytes", ctypes.c_uint64),
        ("timeout_s", ctypes.c_double),
        ("poison_threadgroup", ctypes.c_int),
        ("max_threadgroup_bytes", ctypes.c_uint32),
        ("err", ctypes.c_char_p),
        ("err_len", ctypes.c_uint64),
    ]


# msim_dispatch return codes
OK, ERR_OOB, ERR_DEADLOCK, ERR_FAULT, ERR_TIMEOUT, ERR_CONFIG, ERR_KERNEL, ERR_RACE = range(8)
# msim_launch.schedule: thread (and threadgroup) order; >= SCHED_RANDOM: seeded shuffles
SCHED_FORWARD, SCHED_REVERSE, SCHED_RANDOM = 0, 1, 2

# Extra g++ flags of a race-checked kernel library: thread-sanitizer
# instrumentation (our hooks in metal_sim.h, no libtsan) and line tables for
# the source lines of a report.
RACECHECK_FLAGS: Tuple[str, ...] = (
    "-fsanitize=thread",
    "--param=tsan-instrument-func-entry-exit=0",
    "-g1",
)
# clang (KIMI_MLX_SIM_CXX=clang++) spells the function entry/exit switch
# differently; metal_sim.h defines those hooks as no-ops either way.
RACECHECK_FLAGS_CLANG: Tuple[str, ...] = ("-fsanitize=thread", "-g1")


def racecheck_flags() -> Tuple[str, ...]:
    """Compile-step flags of a race-checked kernel library for `compiler()`."""
    return RACECHECK_FLAGS_CLANG if "clang" in _compiler_version().lower() else RACECHECK_FLAGS

_lock = threading.Lock()
_loaded: Dict[str, ctypes.CDLL] = {}
_compiler_id: Optional[str] = None


def cache_dir() -> Path:
    """Directory for compiled libraries: $KIMI_MLX_SIM_CACHE or
    ~/.cache/kimi-mlx/metal-sim. Created on demand."""
    env = os.environ.get("KIMI_MLX_SIM_CACHE")
    d = Path(env) if env else Path.home() / ".cache" / "kimi-mlx" / "metal-sim"
    d.mkdir(parents=True, exist_ok=True)
    return d


def compiler() -> str:
    """The C++ compiler: $KIMI_MLX_SIM_CXX, else g++."""
    return os.environ.get("KIMI_MLX_SIM_CXX", "g++")


def _compiler_version() -> str:
    global _compiler_id
    if _compiler_id is None:
        cxx = compiler()
        if shutil.which(cxx) is None:
            raise MetalSimCompileError(
                "<runtime>",
                f"C++ compiler {cxx!r} not found; metal/sim needs g++ >= 11 "
                "(set KIMI_MLX_SIM_CXX to use another one)",
            )
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _compiler_id = out.stdout.splitlines()[0] if out.stdout else cxx
    return _compiler_id


def _hash(parts: Sequence[str]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:32]


@functools.lru_cache(maxsize=None)
def _header_text(name: str) -> str:
    return (SIM_DIR / name).read_text()


def _compile(kernel: str, key: str, files: Dict[str, str], main: str,
             flags: Sequence[str], compile_only: Sequence[str] = ()) -> Path:
    """Compile `main` (one of `files`) into <cache>/<key>.so unless cached.
    `compile_only` flags go to the compile step alone (then linked in a second
    step), so -fsanitize=thread instruments without linking libtsan."""
    root = cache_dir()
    so = root / f"{key}.so"
    if so.exists():
        return so
    build = Path(tempfile.mkdtemp(prefix="build-", dir=root))
    try:
        for fname, text in files.items():
            (build / fname).write_text(text)
        tmp_so = build / "out.so"
        if compile_only:
            obj = build / "out.o"
            steps = [
                [compiler(), *flags, *compile_only, "-c", f"-I{SIM_DIR}", main, "-o", str(obj)],
                [compiler(), *flags, str(obj), "-o", str(tmp_so)],
            ]
        else:
            steps = [[compiler(), *flags, f"-I{SIM_DIR}", main, "-o", str(tmp_so)]]
        for cmd in steps:
            proc = subprocess.run(cmd, cwd=build, capture_output=True, text=True)
            if proc.returncode != 0:
                raise MetalSimCompileError(kernel, _trim(proc.stderr),
                                           source=files.get(main, ""))
        os.replace(tmp_so, so)  # atomic: concurrent builders are harmless
    finally:
        shutil.rmtree(build, ignore_errors=True)
    return so


def _trim(text: str, max_lines: int = 80) -> str:
    lines = text.rstrip().splitlines()
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


def runtime() -> ctypes.CDLL:
    """The loaded runtime library (built on first use)."""
    src = _header_text("msim_runtime.h")
    abi = _header_text("msim_abi.h")
    flags = RUNTIME_FLAGS
    if os.environ.get("KIMI_MLX_SIM_UCONTEXT", "") not in ("", "0"):
        flags = flags + ("-DMSIM_USE_UCONTEXT",)  # portable (slower) fiber switch
    key = "rt-" + _hash([src, abi, " ".join(flags), _compiler_version()])
    with _lock:
        lib = _loaded.get(key)
        if lib is not None:
            return lib
        so = _compile("<runtime>", key, {"runtime.cpp": '#include "msim_runtime.h"\n'},
                      "runtime.cpp", flags)
        lib = ctypes.CDLL(str(so))
        lib.msim_dispatch.argtypes = [ctypes.POINTER(Launch)]
        lib.msim_dispatch.restype = ctypes.c_int
        lib.msim_abi_version.restype = ctypes.c_int
        if lib.msim_abi_version() != ABI_VERSION:
            raise RuntimeError("metal/sim: runtime ABI mismatch (stale cache?)")
        _loaded[key] = lib
        return lib


def kernel_library(kernel: str, files: Dict[str, str], main: str,
                   extra_flags: Sequence[str] = (),
                   compile_only: Sequence[str] = ()) -> Tuple[ctypes.CDLL, int]:
    """Compile (or load from cache) a kernel translation unit.

    Args:
      kernel: kernel name, for error messages.
      files: file name -> text, written side by side; `main` includes the rest.
      main: the translation unit to compile.
      extra_flags: more g++ flags; compile_only: flags for the compile step
        only (e.g. RACECHECK_FLAGS).
    Returns:
      (library, address of its msim_kernel_run).
    Raises:
      MetalSimCompileError: g++ failed; the message holds its diagnostics.
    """
    flags = tuple(CXX_FLAGS) + tuple(extra_flags)
    key = "k-" + _hash([
        *(f"{k}\n{v}" for k, v in sorted(files.items())),
        _header_text("metal_sim.h"),
        _header_text("msim_abi.h"),
        " ".join(flags),
        " ".join(compile_only),
        _compiler_version(),
    ])
    with _lock:
        lib = _loaded.get(key)
        if lib is None:
            so = _compile(kernel, key, files, main, flags, compile_only)
            lib = ctypes.CDLL(str(so))
            _loaded[key] = lib
    fn = ctypes.cast(lib.msim_kernel_run, ctypes.c_void_p).value
    return lib, int(fn)


def library_path(lib: ctypes.CDLL) -> str:
    """File of a loaded kernel library (for addr2line)."""
    return lib._name


def source_lines(so: str, offsets: Sequence[int]) -> Dict[int, Tuple[str, int]]:
    """Map code offsets in kernel library `so` to (file, line) of the innermost
    frame in kernel text (``*.body.metal`` / ``*.header.metal``), via binutils'
    addr2line and the library's line tables. Offsets it cannot place are left
    out (no addr2line, no line table)."""
    if not offsets or shutil.which("addr2line") is None:
        return {}
    # A return address points after the call; the access is on the call's line.
    args = ["addr2line", "-e", so, "-i", "-a"] + [hex(max(o - 1, 0)) for o in offsets]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    found: Dict[int, Tuple[str, int]] = {}
    fallback: Dict[int, Tuple[str, int]] = {}  # innermost frame, e.g. in metal_sim.h
    current = None
    for line in out.splitlines():
        line = line.strip()
        if line.startswith("0x"):
            current = int(line, 16) + 1
            continue
        if current is None or current in found or ":" not in line:
            continue
        path, _, num = line.rpartition(":")
        num = num.split()[0] if num.split() else ""
        if not num.isdigit() or int(num) == 0:
            continue
        name = os.path.basename(path)
        if name.endswith(".body.metal") or name.endswith(".header.metal"):
            found[current] = (name, int(num))
        else:
            fallback.setdefault(current, (name, int(num)))
    return {**fallback, **found}


def dispatch(fn: int, buffers: Sequence[Buffer], grid: Sequence[int],
             threadgroup: Sequence[int], *, timeout_s: float,
             stack_bytes: int, poison: bool,
             max_threadgroup_bytes: int, schedule: int = SCHED_FORWARD,
             racecheck: bool = False) -> Tuple[int, str]:
    """Run one dispatch; returns (code, message). Releases the GIL.

    `schedule` orders threads and threadgroups (SCHED_*); `racecheck` needs a
    library built with RACECHECK_FLAGS and MSIM_RACECHECK=1."""
    lib = runtime()
    arr = (Buffer * max(1, len(buffers)))(*buffers)
    err = ctypes.create_string_buffer(8192)
    launch = Launch()
    launch.fn = fn
    launch.buffers = arr
    launch.nbuffers = len(buffers)
    launch.schedule = schedule
    launch.racecheck = 1 if racecheck else 0
    launch.grid = (ctypes.c_uint32 * 3)(*grid)
    launch.threadgroup = (ctypes.c_uint32 * 3)(*threadgroup)
    launch.stack_bytes = stack_bytes
    launch.timeout_s = timeout_s
    launch.poison_threadgroup = 1 if poison else 0
    launch.max_threadgroup_bytes = max_threadgroup_bytes
    launch.err = ctypes.cast(err, ctypes.c_char_p)
    launch.err_len = len(err)
    code = lib.msim_dispatch(ctypes.byref(launch))
    return code, err.value.decode(errors="replace")
