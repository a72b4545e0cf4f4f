"""The one thread that runs a stage process's MLX work.

MLX (0.32) keeps per-thread state: each thread's default streams and its `mx.compile`
cache. The thread that made it must release it with `mx.clear_streams()` before it ends;
otherwise C++ thread-exit handlers release it, and when that happens while the interpreter
shuts down they take the GIL from a dead thread state and the process aborts
("terminate called without an active exception", SIGABRT; the MLX maintainers' advice in
ml-explore/mlx#4373 and #4327: call `mx.clear_streams()` at the end of every thread).
gRPC's handler threads belong to the server's pool and end when it does, out of our
hands, so a stage runs no MLX on them: session setup, chunks and loads are submitted
here, and `stop()` clears this thread's streams before it ends.

Work runs one item at a time in arrival order. That is how one device runs a stage's
layers anyway; sessions interleave chunk by chunk (no session waits for another one to
finish), and in a pipeline stage i computes one session while stage i + 1 computes
another.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import CancelledError, Future
from typing import Any, Callable, Optional

import mlx.core as mx

log = logging.getLogger(__name__)


class ComputeStopped(RuntimeError):
    """Work submitted after (or cancelled by) `ComputeThread.stop()`."""


class ComputeThread:
    """A daemon thread that runs submitted callables in order (see the module doc).

    Args:
        name: thread name (shows in `kill -USR1` stack dumps).
    """

    def __init__(self, name: str = "mlx"):
        self._q: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args) -> Future:
        """Queue `fn(*args)`; returns its Future. Raises ComputeStopped after `stop()`."""
        f: Future = Future()
        with self._lock:
            if self._stopped:
                raise ComputeStopped("the stage is stopping")
            self._q.put((f, fn, args))
        return f

    def call(self, fn: Callable[..., Any], *args, timeout: Optional[float] = None):
        """Run `fn(*args)` on the thread and return its result (re-raises its exception).

        Raises:
            ComputeStopped: stopped before it ran. TimeoutError: not done in `timeout` s.
        """
        try:
            return self.submit(fn, *args).result(timeout)
        except CancelledError:
            raise ComputeStopped("the stage is stopping") from None

    def _loop(self) -> None:
        try:
            while True:
                item = self._q.get()
                if item is None:
                    return
                f, fn, args = item
                if not f.set_running_or_notify_cancel():
                    continue
                try:
                    f.set_result(fn(*args))
                except BaseException as e:  # handed to the caller
                    f.set_exception(e)
        finally:
            mx.clear_streams()

    def stop(self, timeout: float = 10.0) -> bool:
        """Cancel queued work, let the running item finish, clear this thread's MLX
        streams and end the thread. Returns whether it ended within `timeout` seconds."""
        with self._lock:
            if not self._stopped:
                self._stopped = True
                while True:
                    try:
                        item = self._q.get_nowait()
                    except queue.Empty:
                        break
                    if item is not None:
                        item[0].cancel()
                self._q.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("MLX work still running after %.0f s of shutdown", timeout)
            return False
        return True
