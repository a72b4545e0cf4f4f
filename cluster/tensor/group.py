"""Tensor parallelism through the cluster: one MLX distributed group over the
head and the nodes, started through the authenticated gRPC control plane (no ssh, no
hand-written host file).

Roles. The head (`cluster launch --parallel tensor`) is rank 0: it holds a shard like
every rank (`kimi_mlx.checkpoint.ranged.load_sharded`, from its own copy of the
checkpoint, which `cluster launch` needs anyway) and runs the request path: tokenizer,
sampling, streaming. Node i of the accepted nodes is rank i + 1: its `cluster serve`
runs the rank as a child process (`python -m kimi_mlx.cluster.tensor.rank`, started by the
`StartRank` RPC with MLX_RANK / MLX_HOSTFILE set), which loads its slices of the
checkpoint the node finds by fingerprint in its own models folder.

Rank 0 runs the request loop (mlx-lm's `generate_step`, or a speculative loop with the
draft on rank 0) over a stand-in model that sends every forward pass to the other ranks
as a command (`tensor.step`): they run the same passes on their shards in the
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

import json
import logging
import os
import socket
import sys
import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple

from kimi_mlx.cluster.net.ranks import TensorSetupError

log = logging.getLogger(__name__)

__all__ = ["TensorSetupError", "choose_backend", "hosts_json", "local_address_towards",
           "free_port", "TensorGroup"]

def choose_backend(backends: Dict[str, Sequence[str]], forced: Optional[str] = None,
                   reports: Optional[Sequence["jaccl.NodeReport"]] = None) -> str:
    """The backend for a group of these ranks ({name: backends its MLX has}; `reports`:
    each rank's `net.jaccl.NodeReport`, same order): `forced`, or (None / "auto") `jaccl`
    when the reports show every pair of Macs cabled with RDMA on and jaccl in every MLX
    (`net.jaccl.choose`), else `ring` (TCP).

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


# -- head side: the group's watch -------------------------------------------------------------

RANK0_STOP_S = 5.0  # seconds rank 0's child gets to exit after SIGTERM when a group closes

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
        self.nodes: Dict[str, object] = {}  # node name -> its NodeInfo (set by form_group)
        self.failed_node: Optional[str] = None  # the node `fail` named (None: rank 0 / unknown)
        self.rank0 = None  # a `tensor.relay.Rank0Process` (the server's groups), killed by `close`

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
                    self.fail(ev.message, name)
                    return
                if not started.is_set():
                    started.set()
                    timer.start()
            if not self.closing:
                self.fail(f"node {name} ended its rank's lease", name)
        except grpc.RpcError as e:
            if self.closing:
                return
            why = f"node {name}: {e.details() if hasattr(e, 'details') else e}"
            if not started.is_set():
                refused.append(why)
                started.set()
            else:
                self.fail(why, name)

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
                              f"and its Health call failed: {why})", name)
                return
            log.warning("node %s: no heartbeat for %.1f s but it answers Health (a loaded "
                        "machine?); the group carries on", name, silent)
            last[0] = time.monotonic()

    def fail(self, reason: str, node: Optional[str] = None) -> None:
        """Tear the group down: cancel every rank's lease, kill rank 0's process (when it
        is a child), say why, end this process (`exit`; the server's engine replaces it).
        `node`: the node whose rank or connection failed (`failed_node`). A second caller
        (e.g. rank 0's thread, whose collective raised because the watch's teardown killed
        a peer) waits until the first has said why, so that its own exit cannot cut the
        message off."""
        with self._lock:
            first = self.failed is None and not self.closing
            if first:
                self.failed, self.failed_node = reason, node
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
        """End every lease (the nodes stop their ranks) and stop rank 0's child process
        (SIGTERM; SIGKILL after `RANK0_STOP_S`: a child stuck in a collective of a broken
        group cannot act on SIGTERM, and the next group waits for this teardown)."""
        self.closing = True
        for c in self.calls:
            c.cancel()
        if self.rank0 is not None:
            self.rank0.kill(RANK0_STOP_S)

