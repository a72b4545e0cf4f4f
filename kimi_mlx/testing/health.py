"""(tests, benches) Wait for a server child to be ready: one `wait_healthy` for every harness
and fixture that starts `kimi-mlx server` / `cluster server` as a process.

Both servers answer GET /health with 200 once the model is loaded (503 before, and while
a cluster is degraded: `server.app`, `cluster.server`); a server that dies while loading
must fail the wait at once, saying why, instead of after the whole deadline.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Optional, Union

__all__ = ["wait_healthy"]

Output = Union[Path, str, Callable[[], str], None]
TAIL_CHARS = 3000


def _tail(proc, output: Output) -> str:
    """The last TAIL_CHARS characters of the server's output: `output` (a log file or a
    function returning the text so far), else its stderr pipe once it has exited."""
    text = ""
    try:
        if callable(output):
            text = output()
        elif output is not None:
            text = Path(output).read_text(errors="replace")
        elif proc is not None and proc.poll() is not None and getattr(proc, "stderr", None):
            got = proc.stderr.read()  # the process is gone: read() ends
            text = got.decode(errors="replace") if isinstance(got, bytes) else (got or "")
    except (OSError, ValueError):  # a closed pipe, a removed log
        pass
    return text[-TAIL_CHARS:]


def _status(url: str, timeout: float) -> Union[int, str]:
    """GET `url`: its HTTP status, or what went wrong (str) when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except urllib.error.HTTPError as e:  # 503 while loading
        return e.code
    except (OSError, ValueError) as e:  # refused, reset, timed out
        return f"{type(e).__name__}: {e}"


def wait_healthy(url: str, deadline_s: float, proc=None, output: Output = None,
                 poll_s: float = 0.2) -> float:
    """Poll `url`/health until it answers 200.

    Args:
        url: the server's base URL ("http://127.0.0.1:PORT"; a URL already ending in
            "/health" is polled as it is).
        deadline_s: seconds to wait at most.
        proc: the server's `subprocess.Popen` (None: not ours to watch, e.g. a grandchild):
            when it exits first, the wait fails at once.
        output: where its output goes, for the error's tail: a log file, or a function
            returning the text so far (default: its stderr pipe, read once it exited).
        poll_s: seconds between polls.
    Returns:
        seconds it took.
    Raises:
        RuntimeError: the process exited first (naming the url, its exit status and the
            tail of its output), or `deadline_s` passed (naming the url, the last status
            or connection error, and the tail of its output).
    """
    health = url if url.rstrip("/").endswith("/health") else url.rstrip("/") + "/health"
    t0 = time.monotonic()
    end = t0 + deadline_s
    last: Union[int, str] = "no answer yet"
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{health}: the server process (pid {proc.pid}) exited with "
                               f"status {proc.returncode} before answering 200; its output "
                               f"ends:\n{_tail(proc, output)}")
        last = _status(health, max(0.5, min(5.0, end - time.monotonic())))
        if last == 200:
            return time.monotonic() - t0
        if time.monotonic() >= end:
            tail = _tail(proc, output)
            raise RuntimeError(f"{health} did not answer 200 within {deadline_s:g} s (last: "
                               f"{last})" + (f"; the server's output ends:\n{tail}" if tail
                                             else ""))
        time.sleep(poll_s)
