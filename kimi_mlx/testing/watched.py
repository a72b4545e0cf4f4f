"""(tests, benches) Run a module as a child that never outlives its parent:
`python -m kimi_mlx.testing.watched MODULE [ARGS...]` runs `python -m MODULE ARGS...` in
this process after two things every long-lived child of a harness needs
(`kimi_mlx.lifetime`):

- SIGTERM and SIGHUP stop it cleanly (`exit_on_signals`: `Stopped` in the main thread, so
  the module's `finally` blocks run; then exit 0 at once, as a tensor rank does, because
  interpreter exit can block on MLX's ring threads);
- it ends when the process that started it is gone (`watch_parent_from_env`: the starter
  put its pid in the environment with `lifetime.child_env`), even when the starter was
  SIGKILLed and ran no clean-up of its own.

`testing.tensor_parallel.run_ranks` starts every loopback rank through it, whatever the
rank's module (the tests' own rank scripts included), so `kimi-mlx bench tensor` and the
tensor tests leave no rank behind.
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Optional, Sequence


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run `argv[0]` as `__main__` with `argv[1:]` as its arguments (module doc); returns
    0 after a SIGTERM / SIGHUP stop, else what the module exits with (SystemExit passes
    through). Exits 2 naming the usage without a module."""
    from kimi_mlx.lifetime import Stopped, exit_on_signals, watch_parent_from_env

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print("usage: python -m kimi_mlx.testing.watched MODULE [ARGS...]", file=sys.stderr)
        return 2
    exit_on_signals()
    watch_parent_from_env()
    module = argv[0]
    sys.argv = [module] + argv[1:]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except Stopped as e:
        print(f"{module} (pid {os.getpid()}): stopped ({e})", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
