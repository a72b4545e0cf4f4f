"""A node hosting a tensor-parallel rank: the `StartRank` request checked, the rank's process
(`python -m kimi_mlx.cluster.tensor.rank`) started with its host / device file, watched
(exit, SIGSTOP, an OOM kill) and stopped when the head's lease ends (SIGTERM, SIGKILL only
after `net.lifetime.STOP_TIMEOUT`; it also ends itself when this node's process is gone)."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Optional

import mlx.core as mx

from kimi_mlx.cluster.net.lifetime import STOP_TIMEOUT, child_env, stop_process
from kimi_mlx.cluster.net.ranks import TensorSetupError, available_backends, process_stopped
from kimi_mlx.model.cache import KV_DEFAULT_GROUP

log = logging.getLogger(__name__)


def check_rank_request(r, node_id: str) -> None:
    """Refuse (TensorSetupError naming the node) a rank this node cannot run."""
    from kimi_mlx.model.cache import KV_DEFAULT_GROUP, check_kv_quant

    try:
        check_kv_quant(r.kv_bits or None, r.kv_group_size or KV_DEFAULT_GROUP)
    except ValueError as e:
        raise TensorSetupError(f"node {node_id}: {e}") from None
    if r.backend not in available_backends():
        raise TensorSetupError(f"node {node_id}: its MLX ({mx.__version__}) has no {r.backend!r} "
                               f"backend (has: {', '.join(available_backends()) or 'none'})")
    try:
        hosts = json.loads(r.hosts)
    except ValueError as e:
        raise TensorSetupError(f"node {node_id}: host list is not JSON ({e})")
    if r.backend == "jaccl":  # jaccl.hosts_payload: {"devices": N x N, "coordinator"}
        hosts = hosts.get("devices") if isinstance(hosts, dict) else None
    if not (isinstance(hosts, list) and len(hosts) == r.size and 0 < r.rank < r.size):
        raise TensorSetupError(f"node {node_id}: rank {r.rank} of {r.size} with a host list of "
                               f"{len(hosts) if isinstance(hosts, list) else 'no'} entries")


class RankProcess:
    """One rank process on a node, started with its host file; `state()` says whether it
    still runs; `kill(why)` ends it (always call it; safe from several threads).

    A SIGKILL this node did not send (it sends one only from `kill`, when the head's lease
    ends and the rank did not exit within `stop_timeout` s of SIGTERM) is reported as
    such, with the rank's peak resident memory and the memory the machine had left: the
    signature of the kernel's OOM killer (see `dmesg`), or of another process's kill by
    pid.

    `cache_bytes`, `cache_dir`, `cache_disk_bytes`: the node's `cluster serve --cache-bytes /
    --prompt-cache-dir / --prompt-cache-disk-bytes`, handed to the rank's prompt cache.
    `plan`: (tokens per sequence, sequences) the rank's wired memory is planned for (the
    head's `RankRequest.planned_tokens` / `planned_sequences`; 0: the trained context /
    one sequence).
    """

    def __init__(self, model_path, rank: int, size: int, backend: str, hosts: str, node_id: str,
                 cache_bytes: Optional[int] = None, cache_dir=None, cache_disk_bytes: int = 0,
                 stop_timeout: float = STOP_TIMEOUT, plan=(0, 0), kv=(None, None)):
        self.rank, self.node_id, self.stop_timeout = rank, node_id, stop_timeout
        if backend == "jaccl":  # MLX_RANK, MLX_JACCL_COORDINATOR, MLX_IBV_DEVICES
            from kimi_mlx.cluster.net.jaccl import rank_env

            group_env, self.hostfile = rank_env(hosts, rank)
            env = dict(os.environ, **group_env)
        else:
            fd, self.hostfile = tempfile.mkstemp(prefix="kimi-mlx-hosts-", suffix=".json")
            with os.fdopen(fd, "w") as f:
                f.write(hosts)
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=self.hostfile)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kimi_mlx.cluster.tensor.rank", "--model", str(model_path),
             "--backend", backend, "--name", node_id,
             "--kv-bits", str(kv[0] or 0), "--kv-group-size", str(kv[1] or KV_DEFAULT_GROUP)]
            + ([] if cache_bytes is None else ["--cache-bytes", str(cache_bytes)])
            + ([] if cache_dir is None else ["--prompt-cache-dir", str(cache_dir),
                                             "--prompt-cache-disk-bytes", str(cache_disk_bytes)])
            + ["--planned-tokens", str(int(plan[0])), "--planned-sequences", str(int(plan[1]))],
            env=child_env(env), stdin=subprocess.DEVNULL)
        self._stopped_seen = 0
        self._lock = threading.Lock()
        self.killed_by_node: Optional[str] = None  # why this node killed it, once it did
        self.peak_rss = 0  # bytes (Linux VmHWM), sampled by state()

    def state(self) -> Optional[str]:
        """None while it runs; else what happened ("exited with status 1", "was killed by
        SIGKILL", "is stopped (SIGSTOP): it blocks the group's collectives")."""
        code = self.proc.poll()
        if code is not None:
            if code < 0:
                why = f"was killed by {signal.Signals(-code).name}"
                if -code == signal.SIGKILL and self.killed_by_node is None:
                    why += (f" (not sent by its node; peak resident memory "
                            f"{self.peak_rss / 2**20:.0f} MiB, {_mem_available()} available "
                            "now: the kernel's OOM killer, see dmesg, or another process)")
                return why
            return "finished" if code == 0 else f"exited with status {code}"
        self.peak_rss = max(self.peak_rss, _peak_rss(self.proc.pid))
        self._stopped_seen = self._stopped_seen + 1 if process_stopped(self.proc.pid) else 0
        if self._stopped_seen >= 2:  # seen twice in a row, not a passing state
            return "is stopped (SIGSTOP): it blocks the group's collectives"
        return None

    def kill(self, why: str = "its lease ended") -> None:
        """Stop the rank (if it still runs): SIGTERM, its clean exit (0) awaited up to
        `stop_timeout` s, SIGKILL only then (`net.lifetime.stop_process`); reap it, remove
        its host file. The lock keeps two callers (the lease's end callback and the RPC's
        own exit) from both signalling: the second would signal a reaped pid, which may
        be another process."""
        with self._lock:
            if self.proc.poll() is None:
                self.killed_by_node = why
                log.info("rank %d on node %s: stopping it (%s)", self.rank, self.node_id, why)
                stop_process(self.proc, self.stop_timeout,
                             f"rank {self.rank} on node {self.node_id}")
            try:
                os.unlink(self.hostfile)
            except OSError:
                pass


def _peak_rss(pid: int) -> int:
    """Peak resident bytes of `pid` (Linux /proc VmHWM; 0 elsewhere or when unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _mem_available() -> str:
    """The machine's MemAvailable as text ("? MiB" when unknown)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return f"{int(line.split()[1]) // 1024} MiB"
    except (OSError, ValueError, IndexError):
        pass
    return "? MiB"
