"""metal/sim: run mx.fast.metal_kernel bodies on the CPU (tests without Macs).

``metal_kernel(name, input_names, output_names, source, header="", ...)``
takes exactly what ``mx.fast.metal_kernel`` takes and returns a callable with
the same call signature (``inputs``, ``template``, ``grid``, ``threadgroup``,
``output_shapes``, ``output_dtypes``, ``init_value``). A call

1. builds the signature MLX would (see ``signature.py``: buffer order,
   ``constant`` for inputs under 8 elements, ``&`` for scalars,
   ``<name>_shape/_strides/_ndim`` and thread attributes when the body names
   them, template parameters) and its C++ translation over ``metal_sim.h``;
2. compiles it with g++ (-O2, C++20; with the race checker also
   ``-fsanitize=thread -g1``, linked without libtsan), cached under ``cache_dir()``
   (``$KIMI_MLX_SIM_CACHE`` or ``~/.cache/kimi-mlx/metal-sim``) by a hash of
   the generated sources, the headers, the flags and the compiler version;
3. runs every threadgroup of the grid (the grid counts threads, as MLX's
   ``dispatchThreads``; edge threadgroups are partial; the threadgroup is
   clamped to the grid per dimension as MLX does). Threads of a threadgroup
   are fibers: ``threadgroup_barrier`` and the SIMD-group functions
   rendezvous, ``threadgroup T x[N];`` is one object per threadgroup;
4. does it again under a second thread schedule (``schedules``, default 2:
   threads and threadgroups in forward, then reverse order; more: seeded
   shuffles) and requires the outputs to agree bit for bit.

Race checker (``racecheck``, default on; ``$KIMI_MLX_SIM_RACECHECK=0`` turns it
off, ``$KIMI_MLX_SIM_SCHEDULES=1`` runs one schedule). The kernel library is
built with g++'s ``-fsanitize=thread`` instrumentation, whose per-access hooks
metal_sim.h defines (no ThreadSanitizer runtime): every load and store of
threadgroup memory and of the output buffers reaches the runtime, which keeps,
per threadgroup and per byte, the last writer and up to two readers with the
barrier epoch of each access. ``threadgroup_barrier(mem_threadgroup)`` orders
threadgroup memory, ``threadgroup_barrier(mem_device)`` device memory,
``mem_none`` nothing; ``simdgroup_barrier`` with those flags orders accesses
within its SIMD-group only. Two accesses to the same byte by different threads
of a threadgroup, at least one a store, with no such barrier between them are
reported as ``MetalSimRaceError`` naming the kernel, the threadgroup array or
buffer and element, both threads and both source lines (binutils' addr2line
on the library's line tables), as CUDA's racecheck does; the verdict does not
depend on the order the emulator ran them in. Not reported: stores of the
same value by several threads (harmless on the GPU), accesses through atomic
functions, device memory shared between threadgroups and inputs; a race of
those kinds usually shows as outputs that differ between schedules, which is
reported too (also for atomics whose result depends on their order, e.g.
float atomic adds: pass ``schedules=1`` for such a kernel).

Errors are Python exceptions naming the kernel (``errors.py``): compile
errors carry g++'s diagnostics with the body line; in checked mode (default)
any device-buffer or threadgroup-array access out of bounds is reported with
the buffer, index and thread; a barrier not reached by every thread of the
threadgroup is a deadlock error, not a hang; faults (raw pointers, stack
overflow, integer division by zero) and a watchdog timeout
(``$KIMI_MLX_SIM_TIMEOUT``, default 300 s) do not take the process down.

How the emulator differs from an Apple GPU (by design or as a limitation):

* Threads run one at a time. Barriers and SIMD-group functions synchronise;
  other inter-thread communication through memory without a barrier (a data
  race on the GPU) sees whatever order the scheduler produced (reported by
  the race checker), and device memory is coherent across threadgroups
  (threadgroups run in order x, y, z, or reversed / shuffled).
  SIMD-group functions do not order memory for the race checker (Metal
  requires simdgroup_barrier); a simdgroup_barrier reached by only some lanes
  of a SIMD-group counts for all of them.
* SIMD-groups are 32 lanes in thread_index_in_threadgroup order. The active
  lanes of a SIMD-group function are the lanes of that SIMD-group blocked at
  the same call site (divergent branches behave as on the GPU); reading an
  inactive lane with a shuffle returns the caller's own value (undefined on
  the GPU). simd_sum & co. combine lanes in pairwise-tree order (the order of
  an xor-1,2,4,8,16 butterfly); prefix sums add in lane order.
* A threadgroup_barrier must be reached by every thread (finishing early
  counts as not reaching it) at the same call site; otherwise DeadlockError.
  A "call site" is a source position: a SIMD-group function inside a header
  helper has one site however many places call the helper.
* Checked mode flags every out-of-bounds read, including speculative reads
  whose value a kernel then discards (harmless on most GPUs, undefined in
  Metal); ``checked=False`` runs such kernels unchecked.
* Math is IEEE single precision through libm (no fast-math approximations,
  whatever ``compile_options`` say); ``half`` is ``_Float16`` rounded after
  every operation; ``bfloat16_t`` follows MLX's bf16.h (round-to-nearest-even,
  bf16 op bf16 -> bf16, bf16 op float -> float). Unsuffixed floating literals
  are double in C++ (more precise than Metal, never less).
* Without init_value, outputs start as 0xFF bytes (NaN, -1) in checked mode,
  so a kernel that forgets to write an element shows it.
* Not emulated: textures, imageblocks, function constants, ``complex64_t``,
  simdgroup matrices other than 8x8, swizzles of swizzles (``v.xy.x``), and
  template helpers that deduce their type from a checked threadgroup array
  (pass ``&arr[0]`` or use ``checked=False``). Integer division by zero traps
  (FaultError) where the GPU returns an unspecified value. Threadgroup memory
  is limited to 32 KiB, threadgroups to 1024 threads.
* Speed: a few million SIMD-group operations per second on one core (x86-64
  Linux uses an assembly fiber switch; elsewhere, or with
  ``KIMI_MLX_SIM_UCONTEXT=1``, ucontext, about 8x slower). The race checker
  costs a call per memory access (a table update per byte of threadgroup
  memory and outputs) and each extra schedule a full run. Keep test shapes
  small.
"""

from kimi_mlx.metal.sim._native import cache_dir
from kimi_mlx.metal.sim.errors import (
    MetalSimCompileError,
    MetalSimDeadlockError,
    MetalSimError,
    MetalSimFaultError,
    MetalSimKernelError,
    MetalSimOutOfBoundsError,
    MetalSimRaceError,
    MetalSimTimeoutError,
)
from kimi_mlx.metal.sim.kernel import SimKernel, metal_kernel

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
    "MetalSimRaceError",
]
