"""`make check-real`'s report and taps: one line per check (value, reference, tolerance,
result), phases timed in wall and CPU seconds, and `tap`, which records what a module's
function saw during a run. Shared by `kimi_mlx.testing.check_real` and
`kimi_mlx.testing.check_kernels`.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import mlx.core as mx
import numpy as np

MB = 1e6

# ------------------------------------------------------------------------- report


def cpu_seconds() -> float:
    """CPU seconds used so far by this process (all threads) and its finished children
    (the emulator's compiler): on a busy machine, wall time says little; CPU time over
    the cores available bounds what an idle machine needs."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass
class Line:
    name: str
    value: str
    reference: str
    tolerance: str
    ok: Optional[bool]  # None: information only


@dataclass
class Report:
    """Checks and timings, printed as one table."""

    lines: List[Line] = field(default_factory=list)
    times: List[tuple] = field(default_factory=list)

    def check(self, name: str, value: str, reference: str, tolerance: str, ok: bool) -> bool:
        self.lines.append(Line(name, value, reference, tolerance, bool(ok)))
        self._echo(self.lines[-1])
        return ok

    def info(self, name: str, value: str, reference: str = "", note: str = "") -> None:
        self.lines.append(Line(name, value, reference, note, None))
        self._echo(self.lines[-1])

    def fail(self, name: str, why: str) -> None:
        self.check(name, why, "", "", False)

    def bytes_check(self, name: str, got: float, want: float, rel: float) -> bool:
        ok = abs(got - want) <= rel * want
        return self.check(name, f"{got / MB:,.1f} MB", f"{want / MB:,.1f} MB (plan)",
                          f"±{rel:.0%} ({(got - want) / want:+.1%})", ok)

    def error_check(self, name: str, err: float, tol: float, ratio: float) -> bool:
        return self.check(name, f"max err {err:.2e}", "float64 oracle",
                          f"{tol:.2e} ({ratio:.3f} of it)", ratio <= 1.0)

    @contextlib.contextmanager
    def phase(self, name: str):
        t0, c0 = time.perf_counter(), cpu_seconds()
        print(f"-- {name} ...", flush=True)
        try:
            yield
        finally:
            self.times.append((name, time.perf_counter() - t0, cpu_seconds() - c0))
            print(f"   {name}: {self.times[-1][1]:.1f} s (CPU {self.times[-1][2]:.1f} s)",
                  flush=True)

    @property
    def ok(self) -> bool:
        return all(l.ok is not False for l in self.lines)

    @staticmethod
    def _echo(l: Line) -> None:
        mark = "info" if l.ok is None else ("ok" if l.ok else "FAIL")
        print(f"   [{mark}] {l.name}: {l.value} | {l.reference} | {l.tolerance}", flush=True)

    def print(self, total_s: float) -> None:
        w = max(len(l.name) for l in self.lines) if self.lines else 10
        print("\ncheck-real report")
        print(f"{'check':{w}s}  {'value':>22s}  {'reference':>24s}  {'tolerance':>26s}  result")
        for l in self.lines:
            mark = "info" if l.ok is None else ("ok" if l.ok else "FAIL")
            print(f"{l.name:{w}s}  {l.value:>22s}  {l.reference:>24s}  {l.tolerance:>26s}  {mark}")
        print("\ntime (wall / CPU): " + ", ".join(f"{n} {s:.1f} / {c:.1f} s"
                                                  for n, s, c in self.times)
              + f"; total {total_s:.1f} / {cpu_seconds():.1f} s")
        fails = sum(1 for l in self.lines if l.ok is False)
        checks = sum(1 for l in self.lines if l.ok is not None)
        print(f"{checks - fails}/{checks} checks passed" + ("" if not fails else f", {fails} FAILED"))


# --------------------------------------------------------------------------- taps


@contextlib.contextmanager
def tap(module, name: str, record: Callable[[Dict[str, Any], Any], None]):
    """Call `record(bound arguments, result)` after each call of `module.name`.

    The model looks its dispatch functions up as module globals at call time, so
    replacing the global sees every call. Raises AttributeError (naming the function)
    when the module no longer has it, so a rename in the model cannot silently skip a check.
    """
    orig = getattr(module, name, None)
    if orig is None:
        raise AttributeError(f"{module.__name__}.{name}: not found (renamed? update check_real)")
    sig = inspect.signature(orig)

    def wrapper(*args, **kwargs):
        out = orig(*args, **kwargs)
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        record(dict(bound.arguments), out)
        return out

    setattr(module, name, wrapper)
    try:
        yield
    finally:
        setattr(module, name, orig)


def _np(a) -> np.ndarray:
    """mx array -> float32 (or integer) NumPy copy; other values unchanged."""
    if isinstance(a, mx.array):
        return np.array(a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a)
    return a
