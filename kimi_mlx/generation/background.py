"""Threads that do admission work (parsing a large body, compiling a schema) at a lower
CPU priority than the threads that decode, so that a request being refused yields the
cores to the replies already streaming.

On Linux a thread has its own nice value: `setpriority(PRIO_PROCESS, tid, n)` with the
thread's kernel id (setpriority(2), "NOTES: ... the nice value is a per-thread
attribute"). Elsewhere (macOS: the call applies to the whole process, or fails for a
thread id) nothing is changed. Raising one's own nice value needs no privilege."""

from __future__ import annotations

import logging
import os
import sys
import threading

__all__ = ["BACKGROUND_NICE", "lower_thread_priority"]

log = logging.getLogger(__name__)

BACKGROUND_NICE = 10  # added to the process's nice value (the kernel caps it at 19)


def lower_thread_priority(step: int = BACKGROUND_NICE) -> bool:
    """Lower the calling thread's CPU priority by `step` nice levels (Linux only; the
    `initializer` of a ThreadPoolExecutor). Returns True when changed; a failure is
    logged at debug level and leaves the thread as it was."""
    if not sys.platform.startswith("linux") or not hasattr(os, "setpriority"):
        return False
    tid = threading.get_native_id()
    try:
        now = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, now + step))
    except OSError as e:
        log.debug("thread %d keeps its priority: %s", tid, e)
        return False
    return True
