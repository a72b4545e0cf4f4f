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
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Any, Iterator, List, Optional, Sequence

import mlx.core as mx

__all__ = ["metal_kernel", "kernel_mode", "use_sim", "MetalUnavailableError", "DispatchKernel"]

SIM_ENV = "KIMI_MLX_METAL_SIM"

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
    if mx.metal.is_available():
        return "metal"
    return "reference"


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
                self._metal = mx.fast.metal_kernel(**self._spec())
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
