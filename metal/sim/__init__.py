"""metal/sim: run mx.fast.metal_kernel bodies on the CPU (tests without Macs).

``metal_kernel(name, input_names, output_names, source, header="", ...)``
takes exactly what ``mx.fast.metal_kernel`` takes and returns a callable with
the same call signature. The call builds the signature MLX would generate,
translates it to C++ over ``metal_sim.h`` (Metal types, math, SIMD-group and
threadgroup semantics), compiles it with g++ (cached on disk), and runs every
threadgroup of the grid, each thread a fiber, so barriers and SIMD-group
functions rendezvous as on the GPU.
"""

from .errors import (
    MetalSimCompileError,
    MetalSimDeadlockError,
    MetalSimError,
    MetalSimFaultError,
    MetalSimKernelError,
    MetalSimOutOfBoundsError,
    MetalSimTimeoutError,
)
from .kernel import SimKernel, metal_kernel
from ._native import cache_dir

__all__ = [
    "metal_kernel",
    "SimKernel",
    "cache_dir",
    "MetalSimError",
    "MetalSimCompileError",
    "MetalSimOutOfBoundsError",
    "MetalSimDeadlockError",
    "MetalSimFaultError",
    "MetalSimTimeoutError",
    "MetalSimKernelError",
]
