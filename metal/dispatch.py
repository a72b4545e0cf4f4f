"""The one place that decides: Metal kernel, CPU emulator of it, or reference op.

Model code builds its kernels with `metal_kernel` (same arguments as
``mx.fast.metal_kernel``) and asks `kernel_mode()` whether to call them::

    _kernel = metal_kernel("attnres_mix", [...], ["out"], source=SRC)

    def attn_res_mix(...):
        if kernel_mode() == "reference":
            return attn_res_mix_reference(...)
        return _kernel(inputs=[...], template=[...], grid=..., ...)[0]

Modes, decided at call time (so kernels can be built at import time):

* ``"sim"``: the emulator (``kimi_mlx.metal.sim``) was asked for, with the
  environment variable ``KIMI_MLX_METAL_SIM=1`` or inside `use_sim()` (tests).
  An explicit request wins even where Metal exists.
* ``"metal"``: ``mx.metal.is_available()``: ``mx.fast.metal_kernel``.
* ``"reference"``: neither; calling a kernel raises `MetalUnavailableError`.

Which of our kernels the dispatch functions (``kimi_mlx.metal.kda`` / ``dsa``) use is a
second, per-kernel decision, `kernel_enabled(name)`, ruled by ``KIMI_MLX_KERNELS``:

* ``auto`` (default): on Metal, each kernel is first checked on the device against its
  reference op (``kimi_mlx.metal.selfcheck``: small shapes with its edge cases, the
  project's tolerance rule); a compile error, launch error or mismatch makes that kernel
  fall back to its reference op for the rest of the process, with one warning line.
* ``metal``: use the kernels on Metal without the check (trust them).
* ``reference``: never use a kernel (Metal or emulator); the reference ops run.

In the emulator (mode "sim", an explicit request made by tests) ``auto`` and ``metal``
use the kernels unchecked: a fallback there would hide a kernel bug from the tests.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import re
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import mlx.core as mx

__all__ = ["metal_kernel", "kernel_mode", "use_sim", "MetalUnavailableError", "DispatchKernel",
           "kernel_enabled", "kernels_setting", "kernel_status", "check_kernels",
           "register_check", "run_check", "reset_kernel_checks", "KERNEL_NAMES", "KERNELS_ENV"]

logger = logging.getLogger(__name__)

SIM_ENV = "KIMI_MLX_METAL_SIM"
KERNELS_ENV = "KIMI_MLX_KERNELS"
KERNELS_SETTINGS = ("auto", "metal", "reference")
# Every kernel the dispatch functions can choose (a wrapper in kimi_mlx.metal.kernels).
KERNEL_NAMES = ("kda_decode", "kda_prefill", "dsa_index_topk", "sparse_mla_decode",
                "dsa_index_topk_q", "sparse_mla_decode_q")

_sim_depth = 0
_sim_lock = threading.Lock()


class MetalUnavailableError(RuntimeError):
    """A kernel was called where neither Metal nor the emulator is enabled."""


def _sim_requested() -> bool:
    if _sim_depth > 0:
        return True
    return os.environ.get(SIM_ENV, "").lower() in ("1", "true", "yes", "on")


def kernel_mode() -> str:
    """How kernels run here and now.

    Returns:
      "sim" if the emulator is requested (KIMI_MLX_METAL_SIM=1 or inside
      `use_sim()`), else "metal" if ``mx.metal.is_available()``, else
      "reference" (use the pure-MLX reference op).
    """
    if _sim_requested():
        return "sim"
    if _metal_available():
        return "metal"
    return "reference"


def _metal_available() -> bool:
    """``mx.metal.is_available()`` (a seam: tests fake a Metal device here)."""
    return mx.metal.is_available()


def _build_metal(spec: dict):
    """``mx.fast.metal_kernel(**spec)`` (a seam: tests inject kernel callables here)."""
    return mx.fast.metal_kernel(**spec)


@contextlib.contextmanager
def use_sim() -> Iterator[None]:
    """Run kernels in the CPU emulator inside this block (process-wide,
    nestable; tests use it)."""
    global _sim_depth
    with _sim_lock:
        _sim_depth += 1
    try:
        yield
    finally:
        with _sim_lock:
            _sim_depth -= 1


class DispatchKernel:
    """A kernel callable with ``mx.fast.metal_kernel``'s call signature that
    runs on Metal or in the emulator according to `kernel_mode()` at each
    call. The Metal and emulator kernels are built on first use."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False, compile_options: Optional[dict] = None):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self._metal = None
        self._sim = None

    def __repr__(self) -> str:
        return f"DispatchKernel({self.name!r}, mode={kernel_mode()!r})"

    def _spec(self) -> dict:
        spec = dict(
            name=self.name,
            input_names=self.input_names,
            output_names=self.output_names,
            source=self.source,
            header=self.header,
            ensure_row_contiguous=self.ensure_row_contiguous,
            atomic_outputs=self.atomic_outputs,
        )
        if self.compile_options is not None:
            spec["compile_options"] = self.compile_options
        return spec

    def sim_kernel(self):
        """The emulator kernel (kimi_mlx.metal.sim.SimKernel), built once."""
        if self._sim is None:
            from kimi_mlx.metal.sim import metal_kernel as sim_metal_kernel

            self._sim = sim_metal_kernel(**self._spec())
        return self._sim

    def __call__(self, *, inputs: Sequence[Any], output_shapes: Sequence[Sequence[int]],
                 output_dtypes: Sequence[mx.Dtype], grid: Sequence[int],
                 threadgroup: Sequence[int], template: Optional[Sequence[tuple]] = None,
                 init_value: Optional[float] = None, verbose: bool = False,
                 stream: Any = None) -> List[mx.array]:
        """Run the kernel (arguments as ``mx.fast.metal_kernel``'s callable).

        Returns:
          list of mx.array, one per output name.
        Raises:
          MetalUnavailableError: kernel_mode() is "reference".
          kimi_mlx.metal.sim.MetalSimError: in "sim" mode, the kernel failed
            to compile or misbehaved (out of bounds, barrier deadlock, ...).
        """
        kwargs = dict(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                      grid=grid, threadgroup=threadgroup, template=template,
                      init_value=init_value, verbose=verbose)
        mode = kernel_mode()
        if mode == "sim":
            return self.sim_kernel()(**kwargs, stream=stream)
        if mode == "metal":
            if self._metal is None:
                self._metal = _build_metal(self._spec())
            if stream is not None:
                kwargs["stream"] = stream
            return self._metal(**kwargs)
        raise MetalUnavailableError(
            f"kernel '{self.name}': no Metal back-end here (mx.metal.is_available() is False) "
            f"and the emulator is off; call the pure-MLX reference op instead (check "
            f"kimi_mlx.metal.dispatch.kernel_mode() == 'reference'), or set {SIM_ENV}=1 / use "
            f"kimi_mlx.metal.dispatch.use_sim() to run this kernel in the CPU emulator."
        )


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False,
                 compile_options: Optional[dict] = None) -> DispatchKernel:
    """Like ``mx.fast.metal_kernel`` (same arguments), but the result runs on
    Metal, in the emulator, or refuses, per `kernel_mode()` at call time.

    Raises:
      ValueError: no output names.
    """
    return DispatchKernel(name, input_names, output_names, source, header,
                          ensure_row_contiguous, atomic_outputs, compile_options)


# ------------------------------------------------------------ per-kernel choice and check

_status: Dict[str, str] = {}  # kernel name -> "ok" or the error that made it fall back
_check_lock = threading.RLock()
# kernel name -> its device check (registered by kimi_mlx.metal.kda / dsa, beside the
# dispatch functions that ask for the kernel, from the cases in kimi_mlx.metal.selfcheck)
_checks: Dict[str, Callable[[], Optional[str]]] = {}


def register_check(name: str, check: Callable[[], Optional[str]]) -> None:
    """Register the device check of kernel `name` (one of KERNEL_NAMES): a callable that
    runs the kernel on its check cases and returns None if it agrees with its reference
    op, else one line saying how not; exceptions it raises count as build or launch
    failures (`run_check`).

    Raises:
      ValueError: a name not in KERNEL_NAMES.
    """
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNEL_NAMES)}")
    _checks[name] = check


def run_check(name: str) -> Optional[str]:
    """Run kernel `name`'s registered device check once, here and now (whatever the
    mode: tests run it in the emulator), without caching or warnings.

    Returns:
      None if it passed, else one line: the mismatch, or "build or launch failed:
      <exception type>: <message>" for an exception from building or running the kernel.
    Raises:
      KeyError: no check registered for `name` (its module, kimi_mlx.metal.kda or
      kimi_mlx.metal.dsa, registers it when imported).
    """
    if name not in _checks:
        raise KeyError(f"no device check registered for kernel {name!r} "
                       f"(kimi_mlx.metal.kda / kimi_mlx.metal.dsa register them)")
    try:
        return _checks[name]()
    except Exception as e:  # noqa: BLE001 - a compile or launch error is a verdict
        return f"build or launch failed: {type(e).__name__}: {e}"


def kernels_setting() -> str:
    """The ``KIMI_MLX_KERNELS`` setting: "auto" (default, also for an empty value),
    "metal" or "reference" (case-insensitive).

    Raises:
      ValueError: any other value, naming the variable and the allowed values.
    """
    raw = os.environ.get(KERNELS_ENV, "")
    value = raw.strip().lower() or "auto"
    if value not in KERNELS_SETTINGS:
        raise ValueError(
            f"{KERNELS_ENV}={raw!r} is not a known setting; use one of "
            f"{', '.join(KERNELS_SETTINGS)} (auto: check each Metal kernel on the device "
            f"and fall back to its reference op if it fails; metal: use the kernels "
            f"unchecked; reference: never use the kernels)")
    return value


def _platform_line() -> str:
    mac = platform.mac_ver()[0] or "none"
    return f"MLX {mx.__version__}, macOS {mac}"


def _one_line(text: str, limit: int = 400) -> str:
    text = re.sub(r"\s+", " ", text).strip()
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_one(name: str) -> str:
    """Run the device check of `name` once (caller holds the lock); record and return
    its status, warning once when it fails."""
    try:
        error = run_check(name)
    except KeyError as e:  # nothing to check with: do not trust the kernel unchecked
        error = str(e)
    if error is None:
        _status[name] = "ok"
        logger.debug("Metal kernel %s passed its device check", name)
    else:
        _status[name] = error
        logger.warning(
            "Metal kernel %s disabled, using its reference op for this process "
            "(%s): %s", name, _platform_line(), _one_line(error))
        logger.debug("Metal kernel %s check failure in full: %s", name, error)
    return _status[name]


def kernel_enabled(name: str) -> bool:
    """Whether the dispatch functions should call kernel `name` (one of KERNEL_NAMES)
    here and now, instead of its reference op.

    "reference" mode (no Metal, no emulator) or KIMI_MLX_KERNELS=reference: False.
    Emulator: True. Metal with KIMI_MLX_KERNELS=metal: True. Metal with auto: the
    kernel's device check runs the first time it is asked for in this process
    (`run_check`); True only if it passed.

    Raises:
      ValueError: an unknown KIMI_MLX_KERNELS value, or a name not in KERNEL_NAMES.
    """
    if name not in KERNEL_NAMES:
        raise ValueError(f"unknown kernel {name!r}; known: {', '.join(KERNEL_NAMES)}")
    setting = kernels_setting()
    mode = kernel_mode()
    if mode == "reference" or setting == "reference":
        return False
    if mode == "sim" or setting == "metal":
        return True
    status = _status.get(name)
    if status is None:
        with _check_lock:
            status = _status.get(name) or _check_one(name)
    return status == "ok"


def check_kernels(names: Sequence[str] = KERNEL_NAMES) -> Dict[str, str]:
    """Run the device checks now (e.g. at model load, so the first forward does not pay
    for them) where `kernel_enabled` would run them: Metal and KIMI_MLX_KERNELS=auto.
    Elsewhere nothing runs.

    Returns:
      `kernel_status()` after the checks.
    Raises:
      ValueError: an unknown KIMI_MLX_KERNELS value or kernel name.
    """
    for name in names:
        kernel_enabled(name)
    return kernel_status()


def kernel_status() -> Dict[str, str]:
    """{kernel name: "ok" | the error that made it fall back} for the kernels checked
    so far in this process (for diagnostics; unchecked kernels are absent)."""
    return dict(_status)


def reset_kernel_checks() -> None:
    """Forget every check result, so the next use checks again (tests)."""
    with _check_lock:
        _status.clear()
