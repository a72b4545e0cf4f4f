"""Process lifetimes for the cluster's processes: `kimi_mlx.lifetime`, re-exported here
(it moved below the server so that the one-process `kimi-mlx server` watches its parent
the same way; this name stays for the cluster's modules and their docs)."""

from kimi_mlx.lifetime import (PARENT_ENV, PARENT_POLL_S, STOP_TIMEOUT, Stopped, child_env,
                               exit_on_signals, stop_process, watch_parent,
                               watch_parent_from_env)

__all__ = ["STOP_TIMEOUT", "PARENT_ENV", "PARENT_POLL_S", "stop_process", "exit_on_signals",
           "Stopped", "watch_parent", "watch_parent_from_env", "child_env"]
