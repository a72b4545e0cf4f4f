"""The floors under a pipeline hop: what one message costs on bare transports here.

`kimi-mlx bench hop` (`hop_bench`) prints these beside its own hop figure, so a reader
can tell the cost of gRPC in Python on this machine from the cost of our code. Each
variant is an echo ping-pong between this process and a child server process on
loopback: the client sends an `Activation` of `payload` bytes, the server sends the same
message back, so a round trip is two equal one-way messages and round trip / 2 is the
one-way cost of a hop's message. Variants (each against its own server process, all
interleaved round by round so load from other jobs falls on all of them alike):

- `sync stream`: sync grpcio bidi stream whose request iterator is fed from a queue (as
  the stages' downstream link and the head's session stream are);
- `sync unary`: one blocking sync unary call per message;
- `aio stream`: grpc.aio bidi stream, `write` then `read`, client and server on asyncio;
- `aio unary`: one grpc.aio unary call per message;
- `aio stream, sync server`: an aio client against the sync server (a stage process
  serving with the sync server and sending downstream with asyncio);
- `tcp`: a plain loopback TCP socket (length-prefixed bytes, TCP_NODELAY, one blocking
  `recv` loop): the lower bound of any Python transport.

Per variant: median round trip / 2 (ms), and the CPU time (user + system) the client and
server processes spent per one-way message.

A pipeline hop is more than one message: a stage process receives on one stream and
sends on another. So the bench also builds chains of 3 bare relay processes (sync grpcio
with a queue-fed downstream stream, as `node.sessions.Downstream`; and grpc.aio), the last of
which hands each message to the head's `Watch`-like stream, and measures one more hop =
(round trip through 3 relays - through 1) / 2, with and without a hand-off of each message
to a compute thread (sync: which puts it into the downstream queue while the handler
waits for it, as `StageService.Forward` does with its MLX thread; aio: there and back
through a one-thread executor). The sync relay with the hand-off is the floor under
`hop_bench`'s hop: the same threads and calls, no checks, no compute.
Every variant checks that it gets back the message it sent (sequence number and size).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import queue
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Sequence, Tuple

SERVICE = "kimimlx.bench.Echo"
KINDS = ("sync", "aio", "tcp")
RELAY_KINDS = ("relay-sync", "relay-aio")


def _handlers(aio: bool):
    import grpc

    from kimi_mlx.cluster.net import stage_pb2 as pb

    ser, des = pb.Activation.SerializeToString, pb.Activation.FromString
    if aio:
        async def stream(it, context):
            async for m in it:
                yield m

        async def unary(m, context):
            return m
    else:
        def stream(it, context):
            for m in it:
                yield m

        def unary(m, context):
            return m
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Stream": grpc.stream_stream_rpc_method_handler(stream, des, ser),
        "Unary": grpc.unary_unary_rpc_method_handler(unary, des, ser),
    })


# -- relay chains: a hop with bare gRPC --------------------------------------------------

RELAY = "kimimlx.bench.Relay"


def _identity(m):
    return m


def _relay_handlers_sync(next_address: str):
    """Sync relay: `Forward` passes each message to the next relay's `Forward` (a
    queue-fed stream, as `node.sessions.Downstream`), or, on the last relay, to `Watch`.
    A stream whose messages carry session 'handoff' hands each message to a compute
    thread, which passes it on while the handler waits (as `StageService.Forward`)."""
    import grpc

    from kimi_mlx.cluster.net import stage_pb2 as pb
    from kimi_mlx.cluster.node.compute import ComputeThread

    ser, des = pb.Activation.SerializeToString, pb.Activation.FromString
    watch_q: "queue.Queue" = queue.Queue()
    compute = ComputeThread("relay-mlx")
    channel = grpc.insecure_channel(next_address) if next_address else None

    def forward(it, context):
        q: "queue.Queue" = queue.Queue()
        call = None
        if channel is not None:
            call = channel.stream_stream(f"/{RELAY}/Forward", ser, des)(iter(q.get, None))
            threading.Thread(target=lambda: [None for _ in call], daemon=True).start()
        sink = q.put if call is not None else watch_q.put
        for m in it:
            if m.session == "handoff":
                compute.call(sink, m)
            else:
                sink(m)
        q.put(None)
        return iter(())

    def watch(request, context):
        while context.is_active():
            try:
                yield watch_q.get(timeout=0.5)
            except queue.Empty:
                continue

    return grpc.method_handlers_generic_handler(RELAY, {
        "Forward": grpc.stream_stream_rpc_method_handler(forward, des, ser),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, des, ser),
    })


def _relay_handlers_aio(next_address: str):
    """Aio relay: as `_relay_handlers_sync` on asyncio (the downstream is an aio stream
    written from the handler; the hand-off runs on a one-thread executor)."""
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from kimi_mlx.cluster.net import stage_pb2 as pb

    ser, des = pb.Activation.SerializeToString, pb.Activation.FromString
    watch_q: "asyncio.Queue" = asyncio.Queue()
    compute = ThreadPoolExecutor(1, thread_name_prefix="relay-mlx")
    channel = grpc.aio.insecure_channel(next_address) if next_address else None

    async def forward(it, context):
        loop = asyncio.get_running_loop()
        call = channel.stream_stream(f"/{RELAY}/Forward", ser, des)() if channel else None
        async for m in it:
            if m.session == "handoff":
                m = await loop.run_in_executor(compute, _identity, m)
            if call is not None:
                await call.write(m)
            else:
                watch_q.put_nowait(m)
        if call is not None:
            await call.done_writing()
        return
        yield

    async def watch(request, context):
        while True:
            yield await watch_q.get()

    return grpc.method_handlers_generic_handler(RELAY, {
        "Forward": grpc.stream_stream_rpc_method_handler(forward, des, ser),
        "Watch": grpc.unary_stream_rpc_method_handler(watch, des, ser),
    })


def _write_port(port_file: str, port: int) -> None:
    tmp = Path(port_file + ".tmp")
    tmp.write_text(str(port))
    tmp.replace(port_file)


def serve(argv: Sequence[str]) -> int:
    """`python -m kimi_mlx.cluster.bench.grpc_floor serve KIND --port-file F`: an echo server
    (KIND sync, aio or tcp) on 127.0.0.1; writes its port to F, serves until SIGTERM /
    SIGHUP / SIGINT, or until the bench that started it is gone (`lifetime.watch_parent`:
    its SIGTERM to this process)."""
    from kimi_mlx.lifetime import watch_parent_from_env

    p = argparse.ArgumentParser(prog="grpc_floor serve")
    p.add_argument("kind", choices=KINDS + RELAY_KINDS)
    p.add_argument("--port-file", required=True)
    p.add_argument("--next", default="", help="relays: the next relay's host:port")
    a = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    watch_parent_from_env(grace=10.0)
    if a.kind in ("sync", "relay-sync"):
        from concurrent import futures

        import grpc

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        server.add_generic_rpc_handlers((_handlers(False) if a.kind == "sync"
                                         else _relay_handlers_sync(a.next),))
        _write_port(a.port_file, server.add_insecure_port("127.0.0.1:0"))
        server.start()
        stop.wait()
        server.stop(0)
    elif a.kind in ("aio", "relay-aio"):
        import grpc

        async def main():
            server = grpc.aio.server()
            server.add_generic_rpc_handlers((_handlers(True) if a.kind == "aio"
                                             else _relay_handlers_aio(a.next),))
            _write_port(a.port_file, server.add_insecure_port("127.0.0.1:0"))
            await server.start()
            while not stop.is_set():
                await asyncio.sleep(0.1)
            await server.stop(0)

        asyncio.run(main())
    else:
        lsock = socket.create_server(("127.0.0.1", 0))
        _write_port(a.port_file, lsock.getsockname()[1])
        lsock.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = lsock.accept()
            except socket.timeout:
                continue
            threading.Thread(target=_tcp_echo, args=(conn,), daemon=True).start()
    return 0


def _recv_exact(sock: socket.socket, n: int, buf: bytearray) -> bool:
    view = memoryview(buf)[:n]
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            return False
        got += k
    return True


def _tcp_echo(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(None)
    head = bytearray(4)
    body = bytearray(1 << 20)
    with conn:
        while _recv_exact(conn, 4, head):
            (n,) = struct.unpack("<I", head)
            if n > len(body):
                body = bytearray(n)
            if not _recv_exact(conn, n, body):
                return
            conn.sendall(bytes(head) + bytes(body[:n]))


class _Server:
    def __init__(self, kind: str, workdir: Path, name: str = "", next_address: str = ""):
        from kimi_mlx.lifetime import child_env

        self.port_file = Path(workdir) / f"floor-{name or kind}.port"
        # child_env: the echo server ends by itself when this process is gone
        env = child_env(dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1"))
        self.proc = subprocess.Popen([sys.executable, "-m", "kimi_mlx.cluster.bench.grpc_floor",
                                      "serve", kind, "--port-file", str(self.port_file),
                                      "--next", next_address],
                                     start_new_session=True, env=env)

    def port(self, timeout: float = 60.0) -> int:
        end = time.monotonic() + timeout
        while not self.port_file.exists():
            if self.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"echo server {self.port_file.name} did not start")
            time.sleep(0.05)
        return int(self.port_file.read_text())

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def _proc_cpu(pid: int) -> float:
    """CPU seconds (user + system) of process `pid` (Linux /proc; 0 when unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def _check(reply, seq: int, payload: int = -1) -> None:
    """RuntimeError unless `reply` is message `seq` (with `payload` bytes when >= 0)."""
    got = getattr(reply, "seq", None)
    size = len(reply.tensor.data) if hasattr(reply, "tensor") else -1
    if got != seq or (payload >= 0 and size != payload):
        raise RuntimeError(f"floor bench: got message {got} of {size} bytes back, expected "
                           f"message {seq}" + (f" of {payload} bytes" if payload >= 0 else ""))


@dataclass
class Floor:
    """One variant's figures: `ms` median round trip / 2, `cpu_ms` client + server CPU
    time per one-way message (both ms)."""

    name: str
    ms: float
    cpu_ms: float


def _variants(ports: Dict[str, int], payload: int, loop):
    """name -> (run(n): n ping-pongs returning their completion times (perf_counter s),
    server kind), and a close(); aio calls run on `loop`."""
    import grpc

    from kimi_mlx.cluster.net import stage_pb2 as pb

    ser, des = pb.Activation.SerializeToString, pb.Activation.FromString
    data = bytes(payload)

    def msg(i: int):
        m = pb.Activation(session="echo", seq=i)
        m.tensor.data = data
        return m

    def sync_channel(kind):
        return grpc.insecure_channel(f"127.0.0.1:{ports[kind]}")

    # sync bidi stream fed from a queue
    ch_s = sync_channel("sync")
    q: "queue.Queue" = queue.Queue()

    call = ch_s.stream_stream(f"/{SERVICE}/Stream", ser, des)(iter(q.get, None))

    def sync_stream(n):
        out = []
        for i in range(n):
            q.put(msg(i))
            _check(next(call), i, payload)
            out.append(time.perf_counter())
        return out

    unary_s = ch_s.unary_unary(f"/{SERVICE}/Unary", ser, des)

    def sync_unary(n):
        out = []
        for i in range(n):
            _check(unary_s(msg(i)), i, payload)
            out.append(time.perf_counter())
        return out

    def aio_stream_on(kind):
        async def setup():
            ch = grpc.aio.insecure_channel(f"127.0.0.1:{ports[kind]}")
            c = ch.stream_stream(f"/{SERVICE}/Stream", ser, des)()
            return ch, c
        ch, c = loop.run_until_complete(setup())

        async def run(n):
            out = []
            for i in range(n):
                await c.write(msg(i))
                _check(await c.read(), i, payload)
                out.append(time.perf_counter())
            return out
        return lambda n: loop.run_until_complete(run(n)), (ch, c)

    aio_stream, keep1 = aio_stream_on("aio")
    aio_on_sync, keep2 = aio_stream_on("sync")

    async def setup_unary():
        ch = grpc.aio.insecure_channel(f"127.0.0.1:{ports['aio']}")
        return ch, ch.unary_unary(f"/{SERVICE}/Unary", ser, des)
    ch_au, unary_a = loop.run_until_complete(setup_unary())

    async def aio_unary_run(n):
        out = []
        for i in range(n):
            _check(await unary_a(msg(i)), i, payload)
            out.append(time.perf_counter())
        return out

    sock = socket.create_connection(("127.0.0.1", ports["tcp"]))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray(payload + 64)

    def tcp(n):
        out = []
        for i in range(n):
            body = msg(i).SerializeToString()
            sock.sendall(struct.pack("<I", len(body)) + body)
            _recv_exact(sock, 4, buf)
            (k,) = struct.unpack("<I", bytes(buf[:4]))
            _recv_exact(sock, k, buf)
            _check(pb.Activation.FromString(bytes(buf[:k])), i, payload)
            out.append(time.perf_counter())
        return out

    def close():
        q.put(None)
        ch_s.close()
        for ch, c in (keep1, keep2):
            c.cancel()
            loop.run_until_complete(ch.close())
        loop.run_until_complete(ch_au.close())
        sock.close()

    return {
        "sync stream (queue-fed)": (sync_stream, "sync"),
        "sync unary": (sync_unary, "sync"),
        "aio stream": (aio_stream, "aio"),
        "aio unary": (lambda n: loop.run_until_complete(aio_unary_run(n)), "aio"),
        "aio stream, sync server": (aio_on_sync, "sync"),
        "tcp": (tcp, "tcp"),
    }, close


def _relay_variants(heads: Dict[str, List[int]], payload: int, loop):
    """name -> (run(n) -> completion times, chain kind) for the relay chains; a chain of
    3 enters at its first relay, a chain of 1 at its last. Returns (variants, close)."""
    import grpc

    from kimi_mlx.cluster.net import stage_pb2 as pb

    ser, des = pb.Activation.SerializeToString, pb.Activation.FromString
    data = bytes(payload)
    closers = []
    variants = {}
    for kind, ports in heads.items():
        # one Watch per chain: the last relay hands each message to whichever Watch
        # call takes it first
        if kind == "sync":
            wch = grpc.insecure_channel(f"127.0.0.1:{ports[-1]}")
            watch = wch.unary_stream(f"/{RELAY}/Watch", ser, des)(pb.Activation())
            closers.append(lambda wch=wch, watch=watch: (watch.cancel(), wch.close()))
        else:
            async def setup_watch(last=ports[-1]):
                wch = grpc.aio.insecure_channel(f"127.0.0.1:{last}")
                return wch, wch.unary_stream(f"/{RELAY}/Watch", ser, des)(pb.Activation())
            wch, watch = loop.run_until_complete(setup_watch())
            closers.append(lambda wch=wch, watch=watch: (
                watch.cancel(), loop.run_until_complete(wch.close())))
        for handoff in (False, True):
            session = "handoff" if handoff else "plain"
            for length in (1, 3):
                first = ports[len(ports) - length]
                name = f"{kind} relay{' + hand-off' if handoff else ''}, {length}"
                if kind == "sync":
                    ch = grpc.insecure_channel(f"127.0.0.1:{first}")
                    q: "queue.Queue" = queue.Queue()

                    call = ch.stream_stream(f"/{RELAY}/Forward", ser, des)(iter(q.get, None))

                    def run(n, q=q, watch=watch, session=session):
                        out = []
                        for i in range(n):
                            m = pb.Activation(session=session, seq=i)
                            m.tensor.data = data
                            q.put(m)
                            _check(next(watch), i, payload)
                            out.append(time.perf_counter())
                        return out

                    def close(q=q, ch=ch, call=call):
                        q.put(None)
                        call.cancel()
                        ch.close()
                else:
                    async def setup(first=first):
                        ch = grpc.aio.insecure_channel(f"127.0.0.1:{first}")
                        return ch, ch.stream_stream(f"/{RELAY}/Forward", ser, des)()
                    ch, call = loop.run_until_complete(setup())

                    async def arun(n, call=call, watch=watch, session=session):
                        out = []
                        for i in range(n):
                            m = pb.Activation(session=session, seq=i)
                            m.tensor.data = data
                            await call.write(m)
                            _check(await watch.read(), i, payload)
                            out.append(time.perf_counter())
                        return out

                    def run(n, arun=arun):
                        return loop.run_until_complete(arun(n))

                    def close(ch=ch, call=call):
                        call.cancel()
                        loop.run_until_complete(ch.close())
                variants[name] = (run, kind)
                closers.insert(0, close)

    def close_all():
        for c in closers:
            c()
    return variants, close_all


@dataclass
class RelayFloor:
    """A bare relay chain's cost of one more hop: `ms` = (round trip through 3 relays -
    through 1) / 2, `cpu_ms` the same difference of CPU time (all processes), in ms."""

    name: str
    ms: float
    cpu_ms: float
    rt1_ms: float
    rt3_ms: float


class FloorBench:
    """The echo servers and relay chains of the module doc, started once; `round()`
    runs every variant once (interleaved with whatever the caller measures between
    rounds), `floors()` / `relays()` give medians over the rounds after the first
    (a warm-up). Call `close()` in a `finally`.

    Args:
        workdir: folder for the servers' port files. payload: bytes per message.
        n: ping-pongs per variant per round.
    Raises:
        RuntimeError: a server process did not start within 60 s.
    """

    def __init__(self, workdir: Path, payload: int, n: int = 300):
        self.n = n
        self.servers: Dict[str, _Server] = {}
        self.chains: Dict[str, List[_Server]] = {"sync": [], "aio": []}
        self.loop = asyncio.new_event_loop()
        self._closers: List[Callable[[], None]] = []
        self.rounds = 0
        try:
            self.servers = {k: _Server(k, workdir) for k in KINDS}
            for kind, chain in self.chains.items():
                nxt = ""
                for i in (2, 1, 0):  # the last relay first: each needs its next one's port
                    srv = _Server(f"relay-{kind}", workdir, f"relay-{kind}-{i}", nxt)
                    chain.insert(0, srv)
                    nxt = f"127.0.0.1:{srv.port()}"
            echo, close = _variants({k: s.port() for k, s in self.servers.items()}, payload,
                                    self.loop)
            self._closers.append(close)
            relay, close = _relay_variants({k: [s.port() for s in v]
                                            for k, v in self.chains.items()}, payload, self.loop)
            self._closers.append(close)
        except BaseException:
            self.close()
            raise
        self.variants = {name: (run, [self.servers[kind].proc.pid]) for name, (run, kind) in echo.items()}
        self.variants.update({name: (run, [s.proc.pid for s in self.chains[kind]])
                              for name, (run, kind) in relay.items()})
        self.gaps: Dict[str, List[float]] = {k: [] for k in self.variants}
        self.cpu: Dict[str, float] = {k: 0.0 for k in self.variants}

    def round(self) -> None:
        """Run every variant once (`n` ping-pongs); the first round is not counted."""
        for name, (run, pids) in self.variants.items():
            c0 = time.process_time() + sum(_proc_cpu(p) for p in pids)
            stamps = run(self.n)
            c1 = time.process_time() + sum(_proc_cpu(p) for p in pids)
            if self.rounds:
                self.gaps[name].append(statistics.median(b - a for a, b in zip(stamps, stamps[1:])))
                self.cpu[name] += (c1 - c0) / self.n
        self.rounds += 1

    def _rt(self, name: str) -> Tuple[float, float]:
        """(median round trip, mean CPU per round trip), ms."""
        k = max(self.rounds - 1, 1)
        return statistics.median(self.gaps[name]) * 1e3, self.cpu[name] / k * 1e3

    def floors(self) -> List[Floor]:
        """The echo variants: one-way ms (round trip / 2) and CPU per message."""
        out = []
        for name in self.variants:
            if "relay" not in name:
                rt, cpu = self._rt(name)
                out.append(Floor(name, rt / 2, cpu / 2))
        return out

    def relays(self) -> List[RelayFloor]:
        """The relay chains: cost of one more hop (see RelayFloor)."""
        out = []
        for name in self.variants:
            if name.endswith(", 1"):
                base = name[:-3]
                (rt1, c1), (rt3, c3) = self._rt(name), self._rt(base + ", 3")
                out.append(RelayFloor(base, (rt3 - rt1) / 2, (c3 - c1) / 2, rt1, rt3))
        return out

    def close(self) -> None:
        """Close the calls and stop every server process."""
        for c in self._closers:
            try:
                c()
            except Exception:  # a server already gone: nothing left to close
                pass
        self._closers = []
        if not self.loop.is_closed():
            self.loop.close()
        for s in list(self.servers.values()) + [s for v in self.chains.values() for s in v]:
            s.stop()


def main(argv=None) -> int:
    """`python -m kimi_mlx.cluster.bench.grpc_floor [--payload B]`: print the floors, or
    (`serve KIND`) run one echo server."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.cluster.bench.grpc_floor")
    p.add_argument("--payload", type=int, default=8192)
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args(argv)
    import tempfile

    from kimi_mlx.lifetime import exit_on_signals

    exit_on_signals()  # SIGTERM / SIGHUP: the servers stopped and the folder removed below
    with tempfile.TemporaryDirectory(prefix="kimi-mlx-floor-") as tmp:
        bench = FloorBench(Path(tmp), a.payload, a.n)
        try:
            for _ in range(a.rounds + 1):
                bench.round()
        finally:
            bench.close()
        for f in bench.floors():
            print(f"{f.name:26s} {f.ms:.3f} ms one-way (round trip / 2), "
                  f"CPU {f.cpu_ms:.3f} ms per message")
        for f in bench.relays():
            print(f"{f.name:26s} +{f.ms:.3f} ms per hop (round trip 1 / 3 relays "
                  f"{f.rt1_ms:.3f} / {f.rt3_ms:.3f} ms), CPU +{f.cpu_ms:.3f} ms per hop")
    return 0


if __name__ == "__main__":
    sys.exit(main())
