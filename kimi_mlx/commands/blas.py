"""Full BLAS speed however `kimi-mlx` is started (Linux only).

MLX's Linux CPU wheel links a slow reference BLAS; Debian's OpenBLAS
(`libopenblas0-pthread`, `/usr/lib/<triplet>/openblas-pthread/libblas.so.3`) exports the
same symbols and is about 9x faster for matmul (`kimi-mlx eval` on micro: ~3x end to
end). The dynamic loader only honours `LD_PRELOAD` at process start, so when the library
exists and is not preloaded, `kimi-mlx` re-executes itself once (`os.execve`, same
interpreter and command line, `sys.orig_argv`) with it added to `LD_PRELOAD`. The Makefile
sets the same preload for `make` targets.

Never on macOS (MLX uses Accelerate there). `KIMI_MLX_NO_BLAS_PRELOAD=1` turns it off;
`KIMI_MLX_BLAS_REEXEC` marks the re-executed process so that it can never loop.
"""

from __future__ import annotations

import glob
import os
import sys
from typing import Mapping, Optional

OPT_OUT = "KIMI_MLX_NO_BLAS_PRELOAD"
MARKER = "KIMI_MLX_BLAS_REEXEC"
PATTERN = "/usr/lib/*/openblas-pthread/libblas.so.3"

__all__ = ["MARKER", "OPT_OUT", "blas_in_use", "ensure_fast_blas", "openblas_path", "preload_env"]


def openblas_path() -> Optional[str]:
    """Debian's pthread OpenBLAS `libblas.so.3`, or None where it is not installed."""
    found = sorted(glob.glob(PATTERN))
    return found[0] if found else None


def preload_env(environ: Mapping[str, str], platform: str = sys.platform) -> Optional[dict]:
    """The environment to re-execute with, or None when no re-exec is wanted: not Linux,
    opted out (`KIMI_MLX_NO_BLAS_PRELOAD` set to anything but ''/0), already re-executed,
    no OpenBLAS installed, or an OpenBLAS already in `LD_PRELOAD` (space- or
    colon-separated, as ld.so reads it). The library is appended after what is there."""
    if not platform.startswith("linux"):
        return None
    if environ.get(OPT_OUT, "") not in ("", "0") or environ.get(MARKER):
        return None
    lib = openblas_path()
    if lib is None:
        return None
    current = environ.get("LD_PRELOAD", "")
    entries = [e for e in current.replace(" ", ":").split(":") if e]
    if any("openblas" in e for e in entries):
        return None
    env = dict(environ)
    env["LD_PRELOAD"] = ":".join(entries + [lib])
    env[MARKER] = "1"
    return env


def ensure_fast_blas() -> None:
    """Re-execute this process with OpenBLAS preloaded when `preload_env` says so; returns
    (and the command goes on as it is) when it does not or when the exec fails."""
    env = preload_env(os.environ)
    argv = getattr(sys, "orig_argv", None)
    if env is None or not argv or not sys.executable:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, [sys.executable] + list(argv[1:]), env)
    except OSError:
        return


def blas_in_use() -> str:
    """Which BLAS this process has mapped, for `kimi-mlx --version`: the OpenBLAS path
    when one is loaded, otherwise what the platform links (Accelerate on macOS, MLX's
    bundled reference BLAS on Linux)."""
    if sys.platform == "darwin":
        return "Accelerate"
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "openblas" in path:
                    return f"OpenBLAS ({path})"
    except OSError:
        pass
    if openblas_path() is None:
        return "reference BLAS (slow: install libopenblas0-pthread)"
    why = f"{OPT_OUT} is set" if os.environ.get(OPT_OUT, "") not in ("", "0") else "not preloaded"
    return f"reference BLAS (slow: OpenBLAS is installed, {why})"
