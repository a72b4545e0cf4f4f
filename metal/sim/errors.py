"""Exceptions raised by the Metal-on-CPU emulator.

Every error names the kernel (the ``name`` given to ``metal_kernel``) in its
message and in ``.kernel``.
"""

from __future__ import annotations


class MetalSimError(RuntimeError):
    """Base class: something went wrong compiling or running a kernel.

    Attributes:
      kernel: the kernel's name.
      detail: the message without the ``[metal_sim] kernel '...'`` prefix.
    """

    def __init__(self, kernel: str, detail: str):
        self.kernel = kernel
        self.detail = detail
        super().__init__(f"[metal_sim] kernel '{kernel}': {detail}")


class MetalSimCompileError(MetalSimError):
    """g++ rejected the generated source. ``.source`` holds the translation
    unit; the message holds g++'s diagnostics (with the offending body line)."""

    def __init__(self, kernel: str, diagnostics: str, source: str = "", stage: str = "g++"):
        self.diagnostics = diagnostics
        self.source = source
        super().__init__(kernel, f"compile error ({stage}):\n" + diagnostics)


class MetalSimOutOfBoundsError(MetalSimError):
    """A thread read or wrote outside an input/output buffer or a threadgroup
    array (checked mode)."""


class MetalSimDeadlockError(MetalSimError):
    """A threadgroup_barrier was not reached by every thread of a threadgroup
    (or threads waited at different barriers)."""


class MetalSimFaultError(MetalSimError):
    """The kernel crashed (invalid raw pointer, stack overflow, integer
    division by zero); the process survives."""


class MetalSimTimeoutError(MetalSimError):
    """The dispatch ran past its watchdog limit (an infinite loop?)."""


class MetalSimRaceError(MetalSimError):
    """Threads of one threadgroup accessed the same threadgroup memory (or
    device memory written in that threadgroup), at least one writing, with no
    barrier of the right kind between them; or the outputs differ between two
    thread schedules. The message names the kernel, the memory (array/buffer
    and element), both threads and both source lines."""


class MetalSimKernelError(MetalSimError):
    """Any other misuse detected while running (threadgroup memory over the
    limit, inconsistent SIMD-group operation, bad launch configuration)."""
