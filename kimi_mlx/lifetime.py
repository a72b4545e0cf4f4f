"""Process lifetimes: stops that let a process free its memory, and children that never
outlive their parent.

Shared by every process kind: the cluster's (stages, ranks, `cluster server`, through
`cluster.net.lifetime`, which re-exports this module) and the one-process `kimi-mlx
server` (which may not import the cluster). It imports nothing of this package.

Why SIGTERM first. A process ended by SIGKILL runs no clean-up of its own, and on a Mac
MLX's wired memory of a killed process was reported held until reboot (oMLX #2184);
queued prompt-cache writes are lost too. So every process holding model memory (a node's
rank, rank 0's child, a stage) is stopped by `stop_process`: SIGTERM (with SIGCONT, so
that a stopped process can act on it), a bounded wait for its clean exit (status 0: each
handles SIGTERM, `exit_on_signals`), and SIGKILL only after that bound, for a process
that ignores SIGTERM or is stuck inside a collective.

Why a parent watch. A command that starts processes (`kimi-mlx bench spec`'s stages, a
node's ranks, the test harnesses' clusters) ends them when it stops, including on
SIGTERM / SIGHUP (`exit_on_signals` makes those a normal exit, so its `finally` blocks
run). When it is killed outright, each child ends itself: `watch_parent` polls the
parent's pid (the child is given it: `PARENT_ENV`) and sends SIGTERM to its own process
once the parent is gone (`kimi-mlx server` and `cluster server` too: started by a
harness that named itself, they stop as on SIGTERM). Linux's PR_SET_PDEATHSIG is not used
for these children: it fires when the *thread* that started the child ends (prctl(2)),
and nodes start ranks from gRPC worker threads; a poll every `PARENT_POLL_S` works the
same on Linux and macOS.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Callable, Optional

log = logging.getLogger(__name__)

__all__ = ["STOP_TIMEOUT", "PARENT_ENV", "stop_process", "exit_on_signals", "Stopped",
           "watch_parent", "watch_parent_from_env", "child_env"]

STOP_TIMEOUT = 10.0  # seconds a process gets to exit after SIGTERM before SIGKILL
PARENT_ENV = "KIMI_MLX_PARENT_PID"  # the pid a child watches (`watch_parent_from_env`)
PARENT_POLL_S = 0.5


def stop_process(proc: subprocess.Popen, timeout: float = STOP_TIMEOUT, what: str = "",
                 group: bool = False) -> Optional[int]:
    """Stop `proc`: SIGTERM (and SIGCONT), wait up to `timeout` s, then SIGKILL (logged,
    naming `what`), and reap it. `group`: signal its process group (a child started with
    `start_new_session`). Returns its exit status (0: a clean stop; -9: it had to be
    killed), or the status it had already. Safe to repeat."""
    if proc.poll() is not None:
        return proc.returncode

    def send(sig):
        try:
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)
        except (ProcessLookupError, PermissionError):
            pass

    send(signal.SIGTERM)
    send(signal.SIGCONT)  # a stopped process acts on SIGTERM only once it runs
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        log.warning("%s (pid %d) did not exit within %.0f s of SIGTERM: SIGKILL",
                    what or "process", proc.pid, timeout)
    send(signal.SIGKILL)
    try:
        return proc.wait(10)
    except subprocess.TimeoutExpired:
        log.error("%s (pid %d) did not end after SIGKILL", what or "process", proc.pid)
        return None


class Stopped(BaseException):
    """Raised in the main thread by `exit_on_signals`' handler: SIGTERM / SIGHUP asked this
    process to stop (a BaseException, as KeyboardInterrupt: `except Exception` keeps
    out of its way)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


def exit_on_signals() -> Callable[[], None]:
    """Make SIGTERM and SIGHUP raise `Stopped` in the main thread (so `finally` blocks run
    and the caller can exit 0), as SIGINT raises KeyboardInterrupt. Returns a function
    that puts the previous handlers back. Nothing (a no-op returned) outside the main
    thread, where Python cannot set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if hasattr(signal, "SIGHUP") else [])
    previous = {s: signal.signal(s, _raise_stopped) for s in sigs}

    def restore():
        for s, h in previous.items():
            signal.signal(s, h)

    return restore


def watch_parent(parent: int, grace: float = STOP_TIMEOUT, poll: float = PARENT_POLL_S,
                 on_gone: Optional[Callable[[], None]] = None) -> Optional[threading.Thread]:
    """End this process once process `parent` is gone: `on_gone()` (if given: clean-up that
    must happen however the process then ends, e.g. removing files it was handed), SIGTERM
    to itself (its clean stop), then after `grace` s without exiting os._exit(1). Returns
    the watching thread (a daemon), or None for `parent` 0. Exits at once when `parent`
    is already gone."""
    if not parent:
        return None

    def gone() -> bool:
        return os.getppid() != parent

    def end():
        log.warning("parent process %d is gone: stopping", parent)
        if on_gone is not None:  # first: a process without a SIGTERM handler dies at once
            on_gone()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except OSError:
            pass
        time.sleep(grace)
        os._exit(1)

    if gone():
        if on_gone is not None:
            on_gone()
        os._exit(1)

    def run():
        while not gone():
            time.sleep(poll)
        end()

    t = threading.Thread(target=run, daemon=True, name="kimi-mlx-parent-watch")
    t.start()
    return t


def watch_parent_from_env(**kw) -> Optional[threading.Thread]:
    """`watch_parent` of the pid in `PARENT_ENV` (set by whoever started this process with
    `child_env`), if any; the variable is removed so that this process's own children do
    not inherit it."""
    raw = os.environ.pop(PARENT_ENV, "")
    try:
        parent = int(raw) if raw else 0
    except ValueError:
        parent = 0
    return watch_parent(parent, **kw)


def child_env(env: Optional[dict] = None) -> dict:
    """`env` (default: this process's environment) with `PARENT_ENV` set to this pid: a
    child that calls `watch_parent_from_env` then ends when this process is gone."""
    return dict(os.environ if env is None else env, **{PARENT_ENV: str(os.getpid())})
