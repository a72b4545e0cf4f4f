"""Rank 0 of a server's tensor group in a child process, so that the group can be formed
again after a rank is lost (MLX cannot form a second group in one process).

Why a child. MLX keeps the distributed group it formed for the whole life of the process:
`mx.distributed.init` caches it per backend in a function-local static map
(`mlx/distributed/distributed.cpp`, `init`: "Already initialized so return the group"),
and the ring backend has no `split`. Checked with MLX 0.32 and two local processes: after
rank 1 was killed, a second `init(backend="ring")` with a new host file in rank 0's
process returned at once with the dead group, and its first all_sum raised "[ring]
connection to a peer was lost" (the new rank 1 was never connected). So a server that
must form a new group without restarting cannot hold rank 0 itself. `cluster server
--parallel tensor` therefore runs rank 0's share (its slices of the checkpoint, its
caches, its part of every collective) in this child, one per group, and keeps the
request path (tokenizer, sampling, drafts, stop rules, streaming) in the server process,
which never joins an MLX group. A lost group is ended by killing the child (and the
nodes' ranks, through their leases); a new group gets a new child, whose fresh process
and fresh listening port no rank of the old group can reach (the fence against a rank
that was stopped and resumes). The alternative, re-executing the whole server, would drop
the HTTP listener and every waiting client.

Protocol over a socket pair (`multiprocessing.connection.Connection` framing): the
process starts before its group is known (one is kept ready while a group serves, the
spare: `start_spare`) and first gets the group's settings (b"C" + JSON, `relay_main`);
then the server sends one command [op, keep, flags, T, ids...] (int32, `tensor.step`'s ops),
followed for a MEDIA prefill chunk by [pad id, n, hidden] (int32) and the image rows
(float32 [n, hidden], the server's vision tower ran them); the child broadcasts it to the
group (`step.command`), does its own share (`step._Runner`, as `follow_commands` on the
other ranks, the MEDIA rows broadcast as `step._media` does) and answers b"O" + a header
+ the logits bytes (when the command asked for them), b"N" + the positions restored (a
RESTORE: the child ran `prompt_cache.agree_restore` on its store), or b"E" + a message
(the group is then broken: the child answers so until the server kills it or closes the
socket, then exits 1). On start it answers b"R" + JSON {"size": the group size,
"cache_bytes": its snapshot store's bound (0: none), "disk": whether it has a disk tier}
once it joined the group, loaded its slices and made its store (or b"E" + why). Logits
keep their dtype (bfloat16 travels as its bits).

Prompt cache: rank 0's shard of the snapshots lives in this child (its
`KeyedSnapshotCache`, `prompt_cache.make_store` from the server's --cache-bytes,
--prompt-cache-dir and --prompt-cache-disk-bytes, in the disk folder of
`prompt_cache.rank_fingerprint`); the server keeps the index of prefixes
(`net.cache_index.HeadCacheIndex`). A new group's child starts with an empty memory store
and reuses the disk folder (same fingerprint for the same group size; the dead child's
folder lock went with its process). On EXIT the child finishes its queued disk writes
before it answers.

Cost per forward pass: one round trip on a local socket plus a copy of the logits
([T, vocab] of the model dtype).

Idle: when no command came for `PARK_AFTER` s the child parks the group (`wire.park`): the
other ranks then sleep on the doorbell instead of spinning in MLX's ring `all_sum`, and
the child itself sleeps in `recv` on the server's socket; the next command wakes them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import List, Optional, Sequence

log = logging.getLogger(__name__)

__all__ = ["Rank0Process", "relay_main"]

# every rank 0 process is started from this one thread, which lives as long as the server:
# the child's PR_SET_PDEATHSIG fires when the thread that started it ends (`_die_with_parent`)
_SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kimi-mlx-rank0-spawner")

# seconds without a command after which rank 0's child parks the group (`wire.park`):
# longer than any gap between the commands of one request or batch step
# (KIMI_MLX_TENSOR_PARK_AFTER=inf: never, the ranks then wait in `all_sum` as before)
PARK_AFTER = float(os.environ.get("KIMI_MLX_TENSOR_PARK_AFTER", "0.25"))


def _encode_command(op: int, tokens: Sequence[int], keep: int, flags: int,
                    media=None, capture: Optional[Sequence[int]] = None) -> bytes:
    """[op, keep, flags, T, ids...] int32, then with `media` (pad id, rows [n, hidden], an
    mx array) [pad, n, hidden] int32 and the rows as float32 bytes, or with `capture` (a
    HIDDEN command: the layers whose hidden states rank 0 returns) [n, layer ids...]."""
    ids = [int(t) for t in tokens]
    buf = struct.pack(f"<4i{len(ids)}i", op, keep, flags, len(ids), *ids)
    if capture is not None:
        cap = [int(i) for i in capture]
        return buf + struct.pack(f"<i{len(cap)}i", len(cap), *cap)
    if media is None:
        return buf
    import mlx.core as mx
    import numpy as np

    pad, rows = media
    rows = np.asarray(rows.astype(mx.float32), dtype=np.float32)
    if rows.ndim != 2:
        raise ValueError(f"image rows for rank 0 must be [n, hidden], got shape {rows.shape}")
    return buf + struct.pack("<3i", int(pad), *rows.shape) + rows.tobytes()


def _decode_command(buf: bytes):
    """(op, ids, keep, flags, media, capture): `media` (pad id, rows float32 [n, hidden])
    or None; `capture` (layer ids, a HIDDEN command) or None."""
    from kimi_mlx.cluster.tensor.step import HIDDEN, OP_FORWARD

    op, keep, flags, T = struct.unpack_from("<4i", buf)
    ids = list(struct.unpack_from(f"<{T}i", buf, 16))
    at, media = 16 + 4 * T, None
    if flags & HIDDEN and op == OP_FORWARD:
        (n,) = struct.unpack_from("<i", buf, at)
        return op, ids, keep, flags, None, list(struct.unpack_from(f"<{n}i", buf, at + 4))
    if len(buf) > at:
        import mlx.core as mx
        import numpy as np

        pad, n, hidden = struct.unpack_from("<3i", buf, at)
        raw = memoryview(buf)[at + 12:]
        if len(raw) != 4 * n * hidden:
            raise ValueError(f"image rows of {len(raw)} bytes, expected {n} x {hidden} float32")
        media = (pad, mx.array(np.frombuffer(raw, np.float32).reshape(n, hidden)))
    return op, ids, keep, flags, media, None


def _encode_pair(out, hid) -> bytes:
    """b"H" + length of `_encode_array(out)` + it + `_encode_array(hid)` (a HIDDEN reply)."""
    a = _encode_array(out)
    return b"H" + struct.pack("<I", len(a)) + a + _encode_array(hid)


def _decode_reply(reply: bytes):
    """What the child answered: positions restored (b"N"), an array or None (b"O"), or
    (logits or None, hiddens) (b"H")."""
    if reply[:1] == b"N":
        return int(reply[1:])
    if reply[:1] == b"H":
        (n,) = struct.unpack_from("<I", reply, 1)
        return _decode_array(reply[5:5 + n]), _decode_array(reply[5 + n:])
    return _decode_array(reply)


def _encode_array(x) -> bytes:
    """b"O" + header length + JSON {dtype, shape} + raw bytes of mx array `x` (or b"O")."""
    import mlx.core as mx
    import numpy as np

    if x is None:
        return b"O"
    name = str(x.dtype).rsplit(".", 1)[-1]
    raw = np.array(x.view(mx.uint16) if x.dtype == mx.bfloat16 else x).tobytes()
    head = json.dumps({"dtype": name, "shape": list(x.shape)}).encode()
    return b"O" + struct.pack("<I", len(head)) + head + raw


def _decode_array(buf: bytes):
    import mlx.core as mx
    import numpy as np

    if len(buf) == 1:
        return None
    (n,) = struct.unpack_from("<I", buf, 1)
    head = json.loads(buf[5:5 + n])
    raw = memoryview(buf)[5 + n:]
    if head["dtype"] == "bfloat16":
        return mx.array(np.frombuffer(raw, np.uint16).reshape(head["shape"])).view(mx.bfloat16)
    return mx.array(np.frombuffer(raw, np.dtype(head["dtype"])).reshape(head["shape"]))


def _anonymous_file(data: bytes) -> int:
    """A readable fd (at offset 0) of a file holding `data` that no path names: a memfd on
    Linux, else a temporary file removed at once. Given to rank 0's process as
    MLX_HOSTFILE=/dev/fd/N, it cannot be left behind by a server that dies."""
    import tempfile

    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kimi-mlx-hosts")  # close-on-exec: pass_fds makes it inheritable
    else:
        fd, path = tempfile.mkstemp(prefix="kimi-mlx-hosts-", suffix=".json")
        os.unlink(path)
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


def _spawn():
    """(Popen, Connection): a new rank 0 process (`relay_main`), which imports what rank 0
    needs and then waits on the socket for its group's settings (`Rank0Process`)."""
    from multiprocessing.connection import Connection

    mine, theirs = socket.socketpair()
    conn = Connection(os.dup(mine.fileno()))
    mine.close()
    argv = [sys.executable, "-m", "kimi_mlx.cluster.tensor.relay", "--fd", str(theirs.fileno()),
            "--parent", str(os.getpid())]
    try:
        proc = _SPAWNER.submit(subprocess.Popen, argv, stdin=subprocess.DEVNULL,
                               pass_fds=(theirs.fileno(),)).result()
    except BaseException:
        conn.close()
        raise
    finally:
        theirs.close()
    return proc, conn


def _close(proc, conn) -> None:
    """Stop and reap a rank 0 process that never joined a group; close its socket. The
    closed socket ends it (exit 0 once it waits for its settings, `relay_main`, also
    when it still imports: SIGTERM then may come before its handler is set); SIGTERM
    after `net.lifetime.STOP_TIMEOUT`, SIGKILL only after that bound again."""
    from kimi_mlx.cluster.net.lifetime import STOP_TIMEOUT, stop_process

    try:
        conn.close()
    except OSError:
        pass
    try:
        proc.wait(STOP_TIMEOUT)
    except subprocess.TimeoutExpired:
        stop_process(proc, what="rank 0's spare process")


# the spare: one rank 0 process started while the group serves, its imports done (Python,
# MLX, mlx-lm: 1-3 s of CPU on a loaded machine), so that the next group's rank 0 joins at
# once. Why it matters: in MLX's ring backend the node's rank connects to rank 0 first and
# retries a refused connection after 1, 2, 4, 8 s (`mlx/distributed/utils.cpp`,
# `TCPSocket::connect`, 5 attempts from 1000 ms, doubling); a rank 0 that imports slower
# than the node's rank cost 1-3 s there at load 4-6, and 7 s or more under heavier load.
_spare_lock = threading.Lock()
_spare = None  # (Popen, Connection) or None


def start_spare() -> None:
    """Start the spare rank 0 process (above) unless one waits already."""
    global _spare
    with _spare_lock:
        if _spare is not None and _spare[0].poll() is None:
            return
        old, _spare = _spare, _spawn()
    if old is not None:
        _close(*old)


def _take_spare():
    """(Popen, Connection) of the spare when it still runs, else of a new process."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        if spare[0].poll() is None:
            return spare
        _close(*spare)
    return _spawn()


def stop_spare() -> None:
    """Kill the spare (the server stops); safe to repeat."""
    global _spare
    with _spare_lock:
        spare, _spare = _spare, None
    if spare is not None:
        _close(*spare)


class _RelayRunner:
    """The server's stand-in for rank 0's `step._Runner`: the child did the work when the
    command went out (`Rank0Process.relay_command`); `forward` returns the logits it sent
    back, `restore` the positions it restored."""

    def __init__(self, rank0: "Rank0Process"):
        self.rank0 = rank0

    def begin(self) -> None:
        pass

    def restore(self, keys, group=None) -> int:
        return int(self.rank0.last or 0)

    def snapshot(self, key: str) -> None:
        pass

    def forward(self, ids, keep, flags, group=None, media=None, capture=None):
        return self.rank0.last  # (logits or None, hiddens) after a HIDDEN command

    def end(self, keep: int) -> None:
        pass


class ChildStore:
    """What the server knows of rank 0's snapshot store in the child: `max_bytes` (its
    bound) and `disk` (True when it has a disk tier, else None; `prefill.open_request`
    then offers the policy's prefixes to a restarted server)."""

    def __init__(self, max_bytes: int, disk: bool):
        self.max_bytes, self.disk = int(max_bytes), (True if disk else None)


class Rank0Process:
    """Rank 0 of one tensor group, run by a child process (module doc); passed to
    `tensor.step` in place of an MLX group (`rank()`, `size()`, `relay_command`,
    `make_runner`).

    Args:
        model_dir: the checkpoint folder (rank 0 loads its slices from it).
        backend: "ring" or "jaccl". env: the group's environment for rank 0 (MLX_RANK,
            MLX_HOSTFILE or the jaccl variables); a host file named there is removed by
            the child once read.
        epoch: the group's number in this server (for messages).
        hosts: the ring's host list (JSON), handed over as MLX_HOSTFILE=/dev/fd/N of a
            file no path names (`_anonymous_file`), so that none is left on disk.
        store: rank 0's prompt cache settings (None: no prompt cache): a dict with
            "cache_bytes" (int bytes, None: `prompt_cache.default_cache_bytes` in the
            child), "cache_dir" (the disk tier's folder or None) and "disk_bytes" (int).
            After `wait_ready`, `store` is a `ChildStore` (or None: the child has none).
        plan: (tokens per sequence, sequences) its wired memory is planned for
            (`rank.wire_rank`; 0: the trained context / one sequence).
        cancelled / timeout: give up (RuntimeError) when `cancelled()` or after `timeout` s
            while the process imports (the constructor returns once it has its settings).
    Raises RuntimeError naming the child's failure or its exit (also from `wait_ready`).
    """

    def __init__(self, model_dir, backend: str, env: dict, epoch: int = 0,
                 hosts: Optional[str] = None, store: Optional[dict] = None,
                 cancelled=lambda: False, timeout: float = 120.0, plan=(0, 0), kv=(None, None)):
        self.epoch = epoch
        config = {"model": str(model_dir), "backend": backend, "env": dict(env), "hosts": hosts,
                  "cache_bytes": 0, "cache_dir": None, "disk_bytes": 0, "plan": list(plan),
                  "kv_bits": kv[0], "kv_group_size": kv[1]}
        if store is not None:
            config.update(cache_bytes=store.get("cache_bytes"), cache_dir=(
                None if store.get("cache_dir") is None else str(store["cache_dir"])),
                disk_bytes=int(store.get("disk_bytes") or 0))
        msg = b"C" + json.dumps(config).encode()
        # the spare started ahead of need (`start_spare`), else a new process; either way
        # this returns once it has imported (b"I") and has the settings, so that it joins
        # at once: the other ranks, started after this, find it listening
        self.proc, self.conn = _take_spare()
        deadline, fresh = time.monotonic() + timeout, False
        while True:
            try:
                while not self.conn.poll(0.05):
                    if self.proc.poll() is not None:
                        raise EOFError
                    if cancelled() or time.monotonic() > deadline:
                        _close(self.proc, self.conn)
                        raise RuntimeError("rank 0 (this head's rank process): " + (
                            "cancelled" if cancelled() else f"not started after {timeout:.0f} s"))
                if self.conn.recv_bytes() != b"I":
                    raise EOFError
                self.conn.send_bytes(msg)
                break
            except (EOFError, OSError):  # it ended before taking the settings
                _close(self.proc, self.conn)
                if fresh:
                    raise RuntimeError(f"rank 0 (this head's rank process) ended before it "
                                       f"started (exit status {self.proc.returncode})") from None
                fresh = True  # the spare was gone: once more with a new process
                self.proc, self.conn = _spawn()
        self._size = 0
        self.store: Optional[ChildStore] = None  # rank 0's snapshot store (`wait_ready`)
        self.last = None  # the logits of the last command (None when it asked for none;
        # the positions restored after a RESTORE)
        self.broken: Optional[str] = None
        self.killed = False  # this server killed it (`kill`)
        self._stopped_seen = 0
        self._lock = threading.Lock()

    # -- as an MLX group for tensor.step ------------------------------------------------
    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size

    def make_runner(self, model) -> _RelayRunner:
        return _RelayRunner(self)

    def relay_command(self, op: int, tokens: Sequence[int] = (), keep: int = -1, flags: int = 0,
                      media=None, capture=None):
        """Have the child send command `op` to the group and do its share (`media`: the
        (pad id, rows [n, hidden]) of a MEDIA chunk); returns (op, ids, keep, flags) as
        `step.command`, the logits or positions restored in `last` ((logits or None,
        hiddens [1, T, n * hidden]) for a HIDDEN command with `capture`, the layer ids).
        RuntimeError when the group broke or the child is gone."""
        from kimi_mlx.cluster.tensor.step import HIDDEN, MEDIA

        if self.broken:
            raise RuntimeError(self.broken)
        buf = _encode_command(op, tokens, keep, flags, media if flags & MEDIA else None,
                              capture if flags & HIDDEN else None)
        try:
            self.conn.send_bytes(buf)
            reply = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            self.broken = self._gone(e)
            raise RuntimeError(self.broken) from None
        if reply[:1] == b"E":
            self.broken = reply[1:].decode(errors="replace")
            raise RuntimeError(self.broken)
        self.last = _decode_reply(reply)
        return op, [int(t) for t in tokens], keep, flags

    # -- lifetime ---------------------------------------------------------------------
    def wait_ready(self, timeout: float, cancelled=lambda: False) -> "Rank0Process":
        """Wait (up to `timeout` s, or until `cancelled()`) until the child joined the
        group and loaded its slices. RuntimeError (the child killed) otherwise."""
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.1):
            if self.proc.poll() is not None or cancelled() or time.monotonic() > deadline:
                code = self.proc.returncode
                why = ("cancelled" if cancelled() else f"exited with status {code}"
                       if code is not None else f"not ready after {timeout:.0f} s")
                self.kill()
                raise RuntimeError(f"rank 0 (this head's rank process): {why}")
        try:
            reply = self.conn.recv_bytes()
        except (EOFError, OSError) as e:
            self.kill()
            raise RuntimeError(self._gone(e)) from None
        if reply[:1] != b"R":
            self.kill()
            why = reply[1:].decode(errors="replace")
            raise RuntimeError(f"rank 0 (this head's rank process): {why}")
        info = json.loads(reply[1:])
        self._size = int(info["size"])
        if info.get("cache_bytes"):
            self.store = ChildStore(info["cache_bytes"], info.get("disk", False))
        return self

    def _gone(self, e) -> str:
        code = self.proc.poll()
        how = f"exit status {code}" if code is not None else str(e)
        return f"rank 0 (this head's rank process) ended ({how})"

    def alive(self) -> bool:
        return self.proc.poll() is None

    def state(self) -> Optional[str]:
        """None while it runs or after this server killed it; else how it ended on its
        own ("was killed by SIGKILL", "exited with status 1") or that it is stopped
        (SIGSTOP, seen on two calls in a row, as a node sees its rank)."""
        from kimi_mlx.cluster.net.ranks import process_stopped

        code = self.proc.poll()
        if self.killed:
            return None
        if code is None:
            self._stopped_seen = self._stopped_seen + 1 if process_stopped(self.proc.pid) else 0
            if self._stopped_seen >= 2:
                return "is stopped (SIGSTOP): it blocks the group's collectives"
            return None
        if code < 0:
            import signal

            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def kill(self, timeout: Optional[float] = None) -> None:
        """Stop the child (if it runs): SIGTERM, its clean exit awaited up to `timeout` s
        (default `net.lifetime.STOP_TIMEOUT`), SIGKILL only then; reap it, close the
        socket; safe to repeat."""
        from kimi_mlx.cluster.net.lifetime import STOP_TIMEOUT, stop_process

        with self._lock:
            if self.proc.poll() is None:
                self.killed = True
                stop_process(self.proc, STOP_TIMEOUT if timeout is None else timeout,
                             "rank 0's process")
            try:
                self.conn.close()
            except OSError:
                pass

    def finish(self, timeout: float = 5.0) -> None:
        """EXIT the group (the child exits 0 after sending it), then reap the child."""
        try:
            self.relay_command(0)
            self.proc.wait(timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            log.warning("ending the tensor group: %s", e)
        self.kill()


def _die_with_parent(parent: int) -> None:
    """End this process as soon as the server `parent` that started it is gone, so that a
    killed server (or one ended by SIGTERM, after which its clean-up does not run) leaves
    no rank 0 behind. On Linux the kernel does it (prctl PR_SET_PDEATHSIG: it fires when
    the *thread* that started this process ends, so the server starts every rank 0 from
    one thread that lives as long as it does, `_SPAWNER`): SIGKILL until the group is
    joined, because MLX holds the GIL inside `mx.distributed.init`, which waits for its
    peers without a timeout, so no handler or thread of ours runs meanwhile; SIGTERM once
    it is (`_pdeathsig`, a clean stop). Elsewhere a thread polls the parent pid
    (`net.lifetime.watch_parent`, effective once `init` returned): the host file removed,
    then SIGTERM to this process, then exit 1 after its bound."""
    import signal

    from kimi_mlx.cluster.net.lifetime import watch_parent
    from kimi_mlx.cluster.tensor.rank import _remove_group_files

    _pdeathsig(signal.SIGKILL)
    watch_parent(parent, on_gone=_remove_group_files)


def _pdeathsig(sig: int) -> None:
    """Linux: have the kernel send `sig` to this process when its parent thread ends."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(sig))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _broken(conn, why: str) -> int:
    """The group broke (a peer lost): say so, then answer every further command with the
    same and wait for the server to kill this process or close the socket (exit 1).
    Staying alive keeps the cause clear: a rank 0 process that ends by itself is a fault
    of its own (`Rank0Process.state`), not the consequence of another rank's."""
    msg = b"E" + why.encode()
    while True:
        try:
            conn.send_bytes(msg)
            conn.recv_bytes()
        except (EOFError, OSError):
            return 1


def _close_store(store) -> None:
    """Finish rank 0's queued disk writes (and release its folder)."""
    if store is not None and store.disk is not None:
        try:
            store.attach_disk(None)
        except Exception as e:  # noqa: BLE001 - the memory cache goes with the process
            print(f"[tensor] rank 0: closing the prompt cache's disk tier: {e}",
                  file=sys.stderr, flush=True)


def relay_main(argv: Optional[List[str]] = None) -> int:
    """The child (`python -m kimi_mlx.cluster.tensor.relay --fd N --parent PID`): import,
    wait for the group's settings (b"C" + JSON {model, backend, env: rank 0's group
    environment, hosts: the ring's host list or null, cache_bytes, cache_dir, disk_bytes};
    the spare waits here while the group serves), join, load rank 0's slices, then relay
    the server's commands until EXIT (0), a broken group (1) or the server's end (0, also
    when it closes the socket before the settings came)."""
    from multiprocessing.connection import Connection

    p = argparse.ArgumentParser(description="rank 0 of a kimi-mlx server's tensor group")
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--parent", type=int, default=0, help="the server's pid")
    a = p.parse_args(argv)
    from kimi_mlx.cluster.net.lifetime import Stopped, exit_on_signals

    exit_on_signals()  # SIGTERM / SIGHUP: a clean stop (`Stopped`, exit 0)
    if a.parent:
        _die_with_parent(a.parent)
    conn = Connection(a.fd)
    held: dict = {}  # the store, once made: its queued disk writes finish on a stop
    try:
        return _relay(a, conn, held)
    except Stopped as e:
        print(f"[tensor] rank 0 (this head's rank process, pid {os.getpid()}): stopped ({e})",
              file=sys.stderr, flush=True)
        _close_store(held.get("store"))
        return 0


def _relay(a, conn, held: dict) -> int:
    """`relay_main` after its arguments: import, wait for the settings, join, serve."""
    import mlx.core as mx

    from kimi_mlx.checkpoint.ranged import load_sharded
    from kimi_mlx.cluster.tensor.rank import _remove_group_files, wire_rank
    from kimi_mlx.cluster.tensor.prompt_cache import decode_keys, make_store, rank_fingerprint
    from kimi_mlx.cluster.tensor.rows import ROW_OPS, RowCaches
    from kimi_mlx.cluster.tensor.step import (OP_BEGIN, OP_END, OP_EXIT, OP_FORWARD,
                                              OP_RESTORE, OP_SNAPSHOT, _Runner, command)
    from kimi_mlx.cluster.tensor.wire import park
    from kimi_mlx.model.cache import KV_DEFAULT_GROUP

    # imported: say so, wait for the group's settings (this process may be the spare)
    try:
        conn.send_bytes(b"I")
        buf = conn.recv_bytes()
    except (EOFError, OSError):
        return 0  # the server stopped (or dropped the spare)
    if buf[:1] != b"C":
        return 1
    cfg = json.loads(buf[1:])
    os.environ.update({str(k): str(v) for k, v in cfg["env"].items()})
    hosts_fd = None
    if cfg.get("hosts") is not None:  # a file no path names (`_anonymous_file`)
        hosts_fd = _anonymous_file(cfg["hosts"].encode())
        os.environ["MLX_HOSTFILE"] = f"/dev/fd/{hosts_fd}"
    a.model, a.backend = cfg["model"], cfg["backend"]
    # rank 0's address in the group, where the other ranks reach its doorbell (`wire.park`)
    host = (os.environ.get("MLX_JACCL_COORDINATOR", "") if cfg.get("hosts") is None
            else str(json.loads(cfg["hosts"])[0][0])).rsplit(":", 1)[0]
    a.cache_bytes = cfg.get("cache_bytes")
    a.prompt_cache_dir = cfg.get("cache_dir")
    a.prompt_cache_disk_bytes = int(cfg.get("disk_bytes") or 0)
    t0 = time.monotonic()
    try:
        try:
            group = mx.distributed.init(backend=a.backend, strict=True)
        finally:  # read by now (MLX holds the GIL in init: the parent watch waits for it)
            _remove_group_files()
            if hosts_fd is not None:
                os.close(hosts_fd)
        if a.parent:  # joined: from now on a server gone stops this process cleanly
            import signal

            _pdeathsig(signal.SIGTERM)
        t1 = time.monotonic()
        wire_rank(a.model, group, "rank 0 (this head's rank process)", *cfg.get("plan", (0, 0)),
                  kv=(cfg.get("kv_bits"), cfg.get("kv_group_size") or KV_DEFAULT_GROUP))
        model, _ = load_sharded(a.model, group)
        model.set_kv_quant(cfg.get("kv_bits") or None,
                           int(cfg.get("kv_group_size") or KV_DEFAULT_GROUP))
        fp = (rank_fingerprint(a.model, model, 0, group.size())
              if a.prompt_cache_dir is not None else None)
        store = held["store"] = make_store(a.cache_bytes, a.prompt_cache_dir,
                                           a.prompt_cache_disk_bytes, fp,
                                           "rank 0 (this head's rank process)")
        print(f"[tensor] rank 0 (this head's rank process, pid {os.getpid()}): joined a "
              f"{a.backend} group of {group.size()} in {t1 - t0:.1f} s, loaded its slices in "
              f"{time.monotonic() - t1:.1f} s", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - said to the server, which names it
        conn.send_bytes(b"E" + f"rank 0 (this head's rank process): {e}".encode())
        return 1
    info = {"size": group.size(), "cache_bytes": store.max_bytes if store is not None else 0,
            "disk": store is not None and store.disk is not None}
    conn.send_bytes(b"R" + json.dumps(info).encode())
    runner = _Runner(model, store, 0)
    rows = RowCaches(model, store, 0)  # the batched rows (`tensor.rows`)
    while True:
        try:
            if host and PARK_AFTER != float("inf") and not conn.poll(PARK_AFTER):
                park(group, host)  # idle: the other ranks sleep until the next command
            buf = conn.recv_bytes()
        except (EOFError, OSError):
            _close_store(store)
            return 0  # the server closed the group without EXIT (it is going away)
        except RuntimeError as e:  # the PARK's broadcast failed (a peer lost): broken
            return _broken(conn, f"rank 0 (this head's rank process): {e}")
        op, ids, keep, flags, media, capture = _decode_command(buf)
        try:
            command(group, op, ids, keep, flags)
            reply = None
            if op in ROW_OPS:
                out = rows.apply(op, ids, flags, group, media)
                reply = b"N" + str(out).encode() if isinstance(out, int) else _encode_array(out)
            elif op == OP_BEGIN:
                runner.begin()
            elif op == OP_RESTORE:
                reply = b"N" + str(runner.restore(decode_keys(ids), group)).encode()
            elif op == OP_SNAPSHOT:
                runner.snapshot(decode_keys(ids)[0])
            elif op == OP_FORWARD:
                if capture is not None:
                    reply = _encode_pair(*runner.forward(ids, keep, flags, group, media,
                                                         capture=capture))
                else:
                    reply = _encode_array(runner.forward(ids, keep, flags, group, media))
            elif op == OP_END:
                runner.end(keep)
            elif op == OP_EXIT:
                _close_store(store)  # queued disk writes done before the server goes on
            else:
                raise RuntimeError(f"unknown command {op}")
            reply = reply or _encode_array(None)
        except Exception as e:  # noqa: BLE001 - a lost peer: the group is broken
            return _broken(conn, f"rank 0 (this head's rank process): {e}")
        conn.send_bytes(reply)
        if op == OP_EXIT:
            return 0


if __name__ == "__main__":
    # as the nodes' ranks: once a ring group was joined, interpreter exit can block on
    # the backend's threads
    code = relay_main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
