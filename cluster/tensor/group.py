"""Tensor parallelism through the cluster (issue 21): one MLX distributed group over the
head and the nodes, started through the authenticated gRPC control plane (no ssh, no
hand-written host file).

Roles. The head (`cluster launch --parallel tensor`) is rank 0: it holds a shard like
every rank (`kimi_mlx.checkpoint.ranged.load_sharded`, from its own copy of the
checkpoint, which `cluster launch` needs anyway) and runs the request path: tokenizer,
sampling, streaming. Node i of the accepted nodes is rank i + 1: its `cluster serve`
runs the rank as a child process (`python -m kimi_mlx.cluster.tensor`, started by the
`StartRank` RPC with MLX_RANK / MLX_HOSTFILE set), which loads its slices of the
checkpoint the node finds by fingerprint in its own models folder.

Rank 0 runs the request loop (mlx-lm's `generate_step`, or a speculative loop with the
draft on rank 0) over a stand-in model that sends every forward pass to the other ranks
as a command (`cluster.tensor_step`): they run the same passes on their shards in the
same order, and only rank 0 decides anything. An EXIT command ends the followers
(exit 0).

Host list: rank 0 listens on a free port of the head's address towards the first node;
node ranks on the node's serve port + `RANK_PORT_OFFSET`. Backend: `ring` (TCP); JACCL
needs a host list with every pair's RDMA device, which is not written yet.

Faults. A killed rank makes the ring's collectives raise on every other rank ("[ring]
connection to a peer was lost", ~10 ms); a stopped (SIGSTOP) rank blocks them with no
timeout. Either way its node sees it (exit status, or the process state "stopped") and
ends its `StartRank` stream with an ERROR naming node and rank; the head's watch
(`TensorGroup`) then cancels every rank's stream (each node kills its rank when the
stream ends) and ends the head's process with that message, since rank 0's own thread
may be blocked inside a collective. A node that stops answering (no heartbeat within
`peer_timeout`) is treated the same way.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx

log = logging.getLogger("kimi_mlx.cluster.tensor")

RANK_PORT_OFFSET = 1  # a node's rank listens on its serve port + 1
BACKENDS = ("ring", "jaccl")


class TensorSetupError(RuntimeError):
    """A group that cannot be formed (names the node and what it lacks)."""


def available_backends() -> List[str]:
    """MLX distributed backends this install can join (of `BACKENDS`)."""
    return [b for b in BACKENDS if mx.distributed.is_available(backend=b)]


def choose_backend(backends: Dict[str, Sequence[str]], forced: Optional[str] = None,
                   reports: Optional[Sequence["jaccl.NodeReport"]] = None) -> str:
    """The backend for a group of these ranks ({name: backends its MLX has}; `reports`:
    each rank's `jaccl.NodeReport`, same order): `forced`, or (None / "auto") `jaccl`
    when the reports show every pair of Macs cabled with RDMA on and jaccl in every MLX
    (`jaccl.choose`), else `ring` (TCP).

    Raises TensorSetupError naming the ranks that lack the backend, and for a forced
    `jaccl`, the nodes that cannot join and why (no RDMA, a pair not cabled, ...).
    """
    from kimi_mlx.cluster.net import jaccl

    want = None if forced in (None, "auto") else forced
    if want is None:
        want = "ring"
        if reports and all("jaccl" in b for b in backends.values()):
            want = jaccl.choose(reports)[0]
    missing = [f"{name} (has: {', '.join(b) or 'no distributed backend'})"
               for name, b in backends.items() if want not in b]
    if missing:
        raise TensorSetupError(f"cannot form a {want} group: its backend is missing on "
                               + "; ".join(missing))
    if want == "jaccl":
        if not reports:
            raise TensorSetupError("cannot form a jaccl group: the nodes sent no RDMA report")
        try:
            jaccl.device_matrix(reports)
        except jaccl.JacclError as e:
            raise TensorSetupError(str(e)) from None
    return want


def hosts_json(addresses: Sequence[Tuple[str, int]]) -> str:
    """The ring backend's host list as `mlx.launch` writes it: one ["ip:port"] per rank."""
    return json.dumps([[f"{h}:{p}"] for h, p in addresses])


def local_address_towards(host: str) -> str:
    """This machine's IPv4 address on the route to `host` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def free_port(host: str) -> int:
    """A TCP port free on `host` now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _remove_group_files() -> None:
    """Remove the host / device file the node wrote for this rank (MLX has read it in
    `init`), so none is left in the temp folder when the node itself is killed later."""
    for var in ("MLX_HOSTFILE", "MLX_IBV_DEVICES"):
        path = os.environ.get(var, "")
        if os.path.basename(path).startswith(("kimi-mlx-hosts-", "kimi-mlx-ibv-")):
            try:
                os.unlink(path)
            except OSError:
                pass


def rank_main(argv: Optional[Sequence[str]] = None) -> int:
    """A node's rank process (`python -m kimi_mlx.cluster.tensor --model PATH`, with
    MLX_RANK / MLX_HOSTFILE set): join the group, load this rank's slices, follow rank 0."""
    p = argparse.ArgumentParser(description="one tensor-parallel rank of a kimi-mlx cluster")
    p.add_argument("--model", required=True)
    p.add_argument("--backend", default="ring", choices=BACKENDS)
    p.add_argument("--name", default="", help="node name for messages")
    a = p.parse_args(argv)
    who = f"rank {os.environ.get('MLX_RANK', '?')}" + (f" on node {a.name}" if a.name else "")
    from kimi_mlx.checkpoint.ranged import load_sharded

    from kimi_mlx.cluster.tensor.step import follow_commands

    try:
        group = mx.distributed.init(backend=a.backend, strict=True)
        _remove_group_files()
        print(f"[tensor] {who}: joined a {a.backend} group of {group.size()}", file=sys.stderr,
              flush=True)
        model, _ = load_sharded(a.model, group)
        print(f"[tensor] {who}: loaded its slices of {a.model}", file=sys.stderr, flush=True)
        n = follow_commands(model, group)
    except Exception as e:  # a lost peer, a bad checkpoint: say who, exit non-zero
        print(f"[tensor] {who}: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"[tensor] {who}: done after {n} request(s)", file=sys.stderr, flush=True)
    return 0


# -- node side: one rank process and its lease ------------------------------------------------

def process_stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP / SIGTSTP): /proc on Linux, ps elsewhere."""
    try:
        if sys.platform.startswith("linux"):
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
        out = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                             text=True, timeout=2).stdout.strip()
        return out.startswith("T")
    except (OSError, IndexError, subprocess.SubprocessError):
        return False


def check_rank_request(r, node_id: str) -> None:
    """Refuse (TensorSetupError naming the node) a rank this node cannot run."""
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
    ends) is reported as such, with the rank's peak resident memory and the memory the
    machine had left: the signature of the kernel's OOM killer (see `dmesg`), or of another
    process's kill by pid.
    """

    def __init__(self, model_path, rank: int, size: int, backend: str, hosts: str, node_id: str):
        self.rank, self.node_id = rank, node_id
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
            [sys.executable, "-m", "kimi_mlx.cluster.tensor.group", "--model", str(model_path),
             "--backend", backend, "--name", node_id], env=env, stdin=subprocess.DEVNULL)
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
        """SIGKILL the rank (if it still runs), reap it, remove its host file. The lock
        keeps two callers (the lease's end callback and the RPC's own exit) from both
        signalling: the second would signal a reaped pid, which may be another process."""
        with self._lock:
            if self.proc.poll() is None:
                self.killed_by_node = why
                log.info("rank %d on node %s: killing it (%s)", self.rank, self.node_id, why)
                self.proc.kill()
                self.proc.wait()
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


# -- head side: the group's watch -------------------------------------------------------------

class TensorGroup:
    """The head's leases on the node ranks (one `StartRank` stream each).

    `start(...)` opens the streams and returns once every node has started its rank (or
    raises TensorSetupError naming the node that refused). A watch thread per stream
    calls `fail(reason)` on an ERROR event, a broken stream or `peer_timeout` seconds
    without a heartbeat: it cancels every stream (the nodes kill their ranks), prints the
    reason and ends this process with status 1 (`exit`; tests may replace it).
    """

    def __init__(self, peer_timeout: float = 5.0, exit=None):
        self.peer_timeout = peer_timeout
        self.exit = exit or (lambda code: os._exit(code))
        self.calls: List = []
        self.closing = False
        self.failed: Optional[str] = None
        self.names: List[str] = []
        self.finished: set = set()  # nodes whose rank exited 0 (after the last request)
        self._lock = threading.Lock()
        self._reported = threading.Event()  # the failure was printed
        self.stubs: Dict[str, object] = {}  # node name -> its control-plane stub (probes)

    def start(self, stubs: Sequence[Tuple[str, object]], requests: Sequence) -> "TensorGroup":
        from kimi_mlx.cluster.net import stage_pb2 as pb

        started = [threading.Event() for _ in stubs]
        refused: List[str] = []
        self.names = [name for name, _ in stubs]
        for k, ((name, stub), req) in enumerate(zip(stubs, requests)):
            call = stub.StartRank(req)
            self.calls.append(call)
            self.stubs[name] = stub
            threading.Thread(target=self._watch, args=(name, call, started[k], refused),
                             daemon=True).start()
        deadline = time.monotonic() + max(self.peer_timeout + 5, 30.0)  # a loaded node starts slowly
        for ev in started:
            ev.wait(max(0.0, deadline - time.monotonic()))
        if refused or not all(e.is_set() for e in started):
            self.close()
            late = [n for (n, _), e in zip(stubs, started) if not e.is_set()]
            raise TensorSetupError("; ".join(refused) or
                                   f"node(s) {', '.join(late)} did not start their rank")
        return self

    def _watch(self, name: str, call, started: threading.Event, refused: List[str]) -> None:
        import grpc

        from kimi_mlx.cluster.net import stage_pb2 as pb

        last = [time.monotonic()]
        timer = threading.Thread(target=self._heartbeats, args=(name, last), daemon=True)
        try:
            for ev in call:
                last[0] = time.monotonic()
                if ev.kind == pb.Event.CLOSED:  # the rank finished after the last request
                    self.finished.add(name)
                    return
                if ev.kind == pb.Event.ERROR:
                    if not started.is_set():
                        refused.append(ev.message)
                        started.set()
                        return
                    self.fail(ev.message)
                    return
                if not started.is_set():
                    started.set()
                    timer.start()
            if not self.closing:
                self.fail(f"node {name} ended its rank's lease")
        except grpc.RpcError as e:
            if self.closing:
                return
            why = f"node {name}: {e.details() if hasattr(e, 'details') else e}"
            if not started.is_set():
                refused.append(why)
                started.set()
            else:
                self.fail(why)

    def _heartbeats(self, name: str, last: List[float]) -> None:
        """Fail the group when node `name` is silent for `peer_timeout` s AND does not
        answer a Health call within `peer_timeout` s more.

        The probe is what keeps a loaded machine from tearing down a healthy group: on a
        machine at load 10+ a node's 1 s heartbeats (or this head's reading of them) were
        seen to stall for over 5 s while the node and its rank were fine (the rank was
        then killed when this head cancelled its lease). A rank that dies or is stopped
        does not depend on this: its node reports it by an ERROR event within ~0.5 s. A
        node that is really gone fails the probe (connection refused at once, or silence):
        detected within 2 x peer_timeout."""
        from kimi_mlx.cluster.net import stage_pb2 as pb

        while not self.closing:
            time.sleep(0.2)
            silent = time.monotonic() - last[0]
            if silent <= self.peer_timeout or self.closing:
                continue
            stub = self.stubs.get(name)
            try:
                if stub is None:
                    raise RuntimeError("no stub to ask")
                stub.Health(pb.HealthRequest(), timeout=self.peer_timeout)
            except Exception as e:  # grpc.RpcError, or anything the probe raised
                if not self.closing:
                    why = e.details() if hasattr(e, "details") else e
                    self.fail(f"node {name} stopped answering (no heartbeat in {silent:.1f} s, "
                              f"and its Health call failed: {why})")
                return
            log.warning("node %s: no heartbeat for %.1f s but it answers Health (a loaded "
                        "machine?); the group carries on", name, silent)
            last[0] = time.monotonic()

    def fail(self, reason: str) -> None:
        """Tear the group down: cancel every rank's lease, say why, end this process
        (`exit`). A second caller (e.g. rank 0's thread, whose collective raised because
        the watch's teardown killed a peer) waits until the first has said why, so that
        its own exit cannot cut the message off."""
        with self._lock:
            first = self.failed is None and not self.closing
            if first:
                self.failed = reason
        if not first:
            if self.failed is not None:
                self._reported.wait(10)
            return
        try:
            sys.stdout.flush()  # the text streamed so far (os._exit flushes nothing)
        except (OSError, ValueError):
            pass
        print(f"\n[cluster] tensor group torn down: {reason}", file=sys.stderr, flush=True)
        self._reported.set()
        self.close()
        self.exit(1)

    def finish(self, timeout: float = 5.0) -> None:
        """After the last (empty) request: wait up to `timeout` s for every rank to exit
        on its own, then `close`."""
        deadline = time.monotonic() + timeout
        while set(self.names) - self.finished and time.monotonic() < deadline:
            time.sleep(0.02)
        self.close()

    def close(self) -> None:
        """End every lease (the nodes kill their ranks)."""
        self.closing = True
        for c in self.calls:
            c.cancel()


if __name__ == "__main__":
    sys.exit(rank_main())
