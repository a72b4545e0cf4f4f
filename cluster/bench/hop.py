"""`make bench` / `kimi-mlx bench hop`: the pipeline's own cost, apart from model compute.

Three stage processes that all compute the model compete for 2 CPU cores, so the
loopback bench (`cluster.bench`) cannot show hop latency or overlapped prefill on a
small machine. This bench runs the real stage service, transport and head code
(`GrpcTransport`, `StageService.Forward`, `wire`, `Pipeline`) with *null stages*:
`NullRunner` replaces the model's layers and leaves everything else as it is. It prints,
from one run:

- hop: ms per decode token through 1, 2 and 3 null stages (no compute at all), and the
  cost of one hop = (3-stage - 1-stage) / 2: one stage-to-stage message with its encode,
  gRPC send, receive, checks, decode and hand-off to and from the stage's MLX thread.
  Target: <= 0.3 ms per hop. Beside it: the CPU time the head and stage processes spend
  per step (on a machine with fewer free cores than processes, wall time above CPU time
  is waiting for a core), and the floors (`grpc_floor`, measured between the hop rounds
  of the same run, same message size): one bare message between two processes over
  sync/aio gRPC streams, unary calls and a plain TCP socket, and one more hop through a
  chain of bare gRPC relay processes (sync and aio, with and without a compute-thread
  hand-off), so "ours" = hop - the bare relay with the same threads as a stage.
- prefill: 2 stages whose compute is a sleep of a fixed time per token (it stands for
  compute but takes no CPU, so 2 cores suffice), chunks sent back to back (pipelined)
  against one chunk at a time (sequential). Target: >= 1.8x; the ideal with n equal
  chunks is 2n / (n + 1), printed beside it.
- compute: the real model's per-stage compute time (`StageRunner.run` of the bench
  checkpoint split in 3, in this process, one BLAS thread), per decode token and per
  prefill chunk, so a reader can tell transport from compute.

A null stage keeps the wire layouts of `node.runner.StageRunner`: the first stage writes each
token id into feature 0 of an otherwise zero hidden state, a middle stage passes its input
on unchanged (the AttnRes banks it would add are copies of the partial sum, as identity
layers would leave them), and the last stage "samples" feature 0 of the last position:
the pipeline echoes its input token (`tests/test_cluster_hop.py` checks the values).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import List, Optional, Sequence

import mlx.core as mx
import numpy as np

from kimi_mlx.cluster.node.runner import Output, Refused, Session, StageRunner, StageSpec
from kimi_mlx.testing.cluster import StageProc
from kimi_mlx.cluster.bench.grpc_floor import FloorBench
from kimi_mlx.cluster.net.wire import mx_dtype


class NullRunner(StageRunner):
    """A stage with no model compute (see the module doc): same checks, wire shapes and
    session bookkeeping as `StageRunner`, layers replaced by an identity and an optional
    sleep of `ms_per_token` x chunk length (a stand-in for compute that uses no CPU).

    Args:
        args: the checkpoint's `ModelArgs` (hidden size, vocab, AttnRes block, context).
        spec: the stage's `StageSpec`. ms_per_token: sleep per position of a chunk (ms).
    """

    def __init__(self, args, spec: StageSpec, ms_per_token: float = 0.0):
        self.model = None
        self.spec = spec
        self.args = args
        self.max_positions = args.max_position_embeddings  # as StageRunner's
        self.compute = mx_dtype(spec.compute_dtype)
        self.wire = mx_dtype(spec.wire_dtype)
        self.is_first = spec.start == 0
        self.is_last = spec.end == args.num_hidden_layers
        self.lock = threading.Lock()
        bs = args.attn_res_block_size
        self.in_banks = -(-spec.start // bs) if bs else 0
        self.out_banks = -(-spec.end // bs) if bs else 0
        self.ms_per_token = ms_per_token

    def new_session(self, session: str, head: str, sampling, return_logprobs: bool = False) -> Session:
        """A session with no caches (sampling settings are kept but unused)."""
        return Session(session, head, sampling, return_logprobs, [])

    def run(self, s: Session, seq: int, offset: int, x: mx.array, sample: bool) -> Output:
        """Check the chunk, sleep `ms_per_token` x length, pass the input on (see the class
        doc). Raises Refused as `StageRunner.run` (order, range, token ids)."""
        length = x.shape[-1] if self.is_first else x.shape[2]
        self.check(s, seq, offset, length, sample)
        if self.ms_per_token:
            time.sleep(self.ms_per_token * length / 1e3)
        # NumPy, not MLX: an MLX eval costs a hand-off to its stream thread (~0.1-0.6 ms
        # here), which is compute, not transport. from_tensor's arrays are already
        # evaluated, so np.asarray is a view.
        a = np.asarray(x)
        if self.is_first:
            lo, hi = int(a.min()), int(a.max())
            if lo < 0 or hi >= self.args.vocab_size:
                raise Refused(f"session {s.session}: token id out of range [0, "
                              f"{self.args.vocab_size}) (got {lo}..{hi})")
            h = np.zeros((1, length, self.args.hidden_size), np.float32)
            h[..., 0] = a
            banks = []
        else:
            h, banks = a[-1], list(a[:self.in_banks])
        out = Output()
        if not self.is_last:
            banks = banks + [h] * (self.out_banks - len(banks))
            m = mx.array(np.stack(banks + [h]))
            out.hidden = m if m.dtype == self.wire else m.astype(self.wire)
        elif sample:
            out.token = int(np.asarray(h[0, -1, 0], np.float32))
        s.next_seq += 1
        s.offset += length
        s.last_active = time.monotonic()
        return out


def null_loader(ms_per_token: float):
    """A `StageService.stage_loader` that builds a `NullRunner` from the checkpoint's
    config alone (no tensors read)."""
    def load(path, spec: StageSpec, progress=None):
        from kimi_mlx.model.config import ModelArgs, read_config

        runner = NullRunner(ModelArgs.from_config(read_config(path)), spec, ms_per_token)
        if progress:
            progress(1, 1)
        return runner, SimpleNamespace(bytes_loaded=0), 0
    return load


# -- a null stage process ---------------------------------------------------------------

def serve(argv: Sequence[str]) -> int:
    """`python -m kimi_mlx.cluster.bench.hop serve ...`: a stage process whose Load builds
    `NullRunner`s; prints 'listening on HOST:PORT' and serves until SIGTERM / SIGHUP /
    SIGINT, or until the bench that started it is gone (`lifetime.watch_parent`: it
    started this one with `child_env`, `testing.cluster.StageProc`)."""
    from kimi_mlx.lifetime import watch_parent_from_env

    from kimi_mlx.cluster.net.auth import load_secret
    from kimi_mlx.cluster.node.server import StageServer
    from kimi_mlx.cluster.node.service import StageService

    p = argparse.ArgumentParser(prog="hop_bench serve")
    p.add_argument("--models", required=True)
    p.add_argument("--secret-file", required=True)
    p.add_argument("--node-id", required=True)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--interface", default="127.0.0.1")
    p.add_argument("--ms-per-token", type=float, default=0.0)
    a = p.parse_args(argv)

    class NullService(StageService):
        stage_loader = staticmethod(null_loader(a.ms_per_token))

    secret = load_secret(a.secret_file)
    service = NullService(a.node_id, Path(a.models), secret)
    server = StageServer(service, [a.interface], a.port, secret).start()
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    watch_parent_from_env(grace=10.0)
    print(f"hop_bench null stage {a.node_id} listening on {a.interface}:{server.port} "
          f"({a.ms_per_token} ms per token of sleep)", flush=True)
    stop.wait()
    server.stop(1.0)
    return 0


class NullStageProc(StageProc):
    """A `StageProc` running `serve` (a null stage) instead of `kimi-mlx cluster serve`."""

    def __init__(self, *a, ms_per_token: float = 0.0, **kw):
        super().__init__(*a, **kw)
        self.ms_per_token = ms_per_token

    def command(self) -> List[str]:
        return [sys.executable, "-m", "kimi_mlx.cluster.bench.hop", "serve", "--models",
                str(self.models), "--secret-file", str(self.secret_file), "--node-id",
                self.node_id, "--port", str(self.port), "--interface", self.interface,
                "--ms-per-token", str(self.ms_per_token)]


class NullCluster:
    """Null stage processes on loopback serving one checkpoint folder (for tests and this
    bench). `ms_per_token[i]` is stage process i's sleep. Call `stop()` in a `finally`.

    Attributes: ckpt, secret, fp (fingerprint), args (ModelArgs), procs.
    """

    def __init__(self, workdir: Path, ckpt: Path, ms_per_token: Sequence[float], env=None):
        from kimi_mlx.model.config import ModelArgs, read_config

        from kimi_mlx.cluster.net.auth import init_secret, load_secret
        from kimi_mlx.cluster.net.fingerprint import fingerprint
        from kimi_mlx.testing.cluster import stop_all

        self.workdir = Path(workdir)
        self.ckpt = Path(ckpt)
        models = self.workdir / "null-models"
        models.mkdir()
        (models / "ckpt").symlink_to(self.ckpt.resolve())
        secret_file = init_secret(self.workdir / "null-cluster.key")
        self.secret = load_secret(secret_file)
        self.fp = fingerprint(self.ckpt)
        self.args = ModelArgs.from_config(read_config(self.ckpt))
        self.procs = [NullStageProc(models, secret_file, f"null{i}", self.workdir / f"null{i}.log",
                                    ms_per_token=ms, env=env)
                      for i, ms in enumerate(ms_per_token)]
        try:
            for p in self.procs:
                p.start()
            for p in self.procs:
                p.wait_ready(60)
        except BaseException:
            stop_all(self.procs)
            raise

    def nodes(self):
        """`NodeInfo` of each process, in order."""
        from kimi_mlx.cluster.net.discovery import NodeInfo

        return [NodeInfo(p.node_id, p.host, p.port) for p in self.procs]

    def plan(self, which: Sequence[int]):
        """`StageAssignment`s splitting the layers evenly over processes `which`."""
        from kimi_mlx.cluster.head.transport import StageAssignment

        nodes, L, n = self.nodes(), self.args.num_hidden_layers, len(which)
        cut = [round(i * L / n) for i in range(n + 1)]
        return [StageAssignment(nodes[k], cut[i], cut[i + 1]) for i, k in enumerate(which)]

    def stop(self):
        """Stop every process (SIGKILL after 5 s)."""
        from kimi_mlx.testing.cluster import stop_all

        return stop_all(self.procs)


# -- the bench --------------------------------------------------------------------------

def _threads_env(n: int) -> dict:
    return {"OPENBLAS_NUM_THREADS": str(n), "OMP_NUM_THREADS": str(n)}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the hop bench (see the module doc); prints the figures."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:
        return serve(argv[1:])
    p = argparse.ArgumentParser(prog="python -m kimi_mlx.cluster.bench.hop",
                                description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the cluster bench's "
                   "mid-size random one, built in a temp folder)")
    p.add_argument("--decode-tokens", type=int, default=200, help="tokens per decode run")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=64, help="prefill chunk (tokens)")
    p.add_argument("--ms-per-token", type=float, default=0.1,
                   help="the prefill stages' sleep per token (ms), standing for compute")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--no-compute", action="store_true",
                   help="skip the real model's per-stage compute figures")
    args = p.parse_args(argv)
    if os.environ.get("OPENBLAS_NUM_THREADS") != "1":  # one BLAS thread per stage, as cluster.bench
        os.execve(sys.executable, [sys.executable, "-m", "kimi_mlx.cluster.bench.hop"] + argv,
                  dict(os.environ, **_threads_env(1)))
    from kimi_mlx.cluster.net.lifetime import Stopped, exit_on_signals

    exit_on_signals()  # in the exec'd process too: SIGTERM / SIGHUP run the `finally`s
    try:
        with tempfile.TemporaryDirectory(prefix="kimi-mlx-hop-bench-") as tmp:
            return _run(args, Path(tmp))
    except Stopped as e:  # its stage processes are stopped and their folder removed by now
        print(f"kimi-mlx bench hop: stopped ({e})", flush=True)
        return 128 + e.signum


def _cpu_seconds(pids: Sequence[int]) -> float:
    """CPU time (user + system, s) used so far by this process and processes `pids`
    (Linux /proc; 0 for a pid it cannot read)."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def _median_gap(gen, n: int) -> float:
    stamps = []
    for _ in range(n):
        next(gen)
        stamps.append(time.perf_counter())
    gen.close()
    return statistics.median(b - a for a, b in zip(stamps[1:], stamps[2:]))


def _run(args, tmp: Path) -> int:
    from kimi_mlx.cluster.head.pipeline import Pipeline
    from kimi_mlx.cluster.net.nodes import check_nodes
    from kimi_mlx.sampling import Sampling
    from kimi_mlx.cluster.head.transport import GrpcTransport

    if args.model:
        ckpt = Path(args.model)
    else:
        from kimi_mlx.bench.model import bench_text_config
        from kimi_mlx.testing.checkpoints import build_checkpoint

        ckpt = build_checkpoint(tmp / "bench", text_config=bench_text_config(), seed=0)
    ms = args.ms_per_token
    # processes 0..2: no compute (hop); 3, 4: a sleep per token (prefill)
    cluster = NullCluster(tmp, ckpt, [0.0, 0.0, 0.0, ms, ms], env=_threads_env(1))
    t = GrpcTransport(cluster.secret, peer_timeout=30)
    try:
        accepted, rejected = check_nodes(cluster.nodes(), t.stub_for, cluster.fp)
        if rejected:
            raise RuntimeError(rejected)
        a = cluster.args
        D = a.hidden_size
        print(f"kimi-mlx hop bench: {ckpt.name} (hidden {D}, {a.num_hidden_layers} layers), "
              f"null stage processes on loopback (real service, transport and wire code; no "
              f"model compute), float32 activations, {os.cpu_count()} CPU cores")

        # -- hop ---------------------------------------------------------------------
        pipe = Pipeline(t, prefill_chunk=args.chunk)
        prompt = [(13 * i + 7) % (a.vocab_size - 1) + 1 for i in range(8)]
        per = {1: [], 2: [], 3: []}
        cpu = {1: 0.0, 2: 0.0, 3: 0.0}
        pids = [p.proc.pid for p in cluster.procs[:3]]
        bs = a.attn_res_block_size
        msg_kb = ((-(-a.num_hidden_layers // (3 * bs)) if bs else 0) + 1) * D * 4 / 1024
        floors = FloorBench(tmp, int(msg_kb * 1024))
        try:
            for r in range(args.repeats + 1):  # round 0 warms up
                for n in (1, 2, 3):
                    t.load(cluster.fp, cluster.plan(range(n)), "float32", "float32", force=True)
                    c0 = _cpu_seconds(pids)
                    g = _median_gap(pipe.generate(prompt, Sampling(), args.decode_tokens),
                                    args.decode_tokens)
                    if r:
                        per[n].append(g)
                        cpu[n] += (_cpu_seconds(pids) - c0) / (args.decode_tokens * args.repeats)
                floors.round()  # the bare floors, interleaved with the hop rounds
        finally:
            floors.close()
        d = {n: statistics.median(v) * 1e3 for n, v in per.items()}
        hop = (d[3] - d[1]) / 2
        hop_cpu = (cpu[3] - cpu[1]) / 2 * 1e3
        print(f"hop: decode step through 1 / 2 / 3 null stages {d[1]:.3f} / {d[2]:.3f} / "
              f"{d[3]:.3f} ms ({d[1] / 2:.3f} ms per message with 1 stage); one more hop "
              f"+{hop:.3f} ms (messages of ~{msg_kb:.0f} KiB; target <= 0.3 ms per hop: "
              f"{'met' if hop <= 0.3 else 'NOT met'}); CPU time of the head and stage "
              f"processes per step {cpu[1] * 1e3:.3f} / {cpu[2] * 1e3:.3f} / "
              f"{cpu[3] * 1e3:.3f} ms, +{hop_cpu:.3f} ms per hop (load average "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores: a wall figure well above "
              "the CPU one is waiting for a core)")
        print("floors, measured in the same run between the hop rounds, same message size "
              "(kimi_mlx.cluster.bench.grpc_floor):")
        print("  one message between two processes, one-way (echo round trip / 2), CPU of "
              "both per message: " + "; ".join(
                  f"{f.name} {f.ms:.3f} ms (CPU {f.cpu_ms:.3f})" for f in floors.floors()))
        relays = {f.name: f for f in floors.relays()}
        print("  one more hop through a chain of bare relay processes (receive on a stream, "
              "send on the next one; no checks, no compute), CPU of all per hop: " + "; ".join(
                  f"{f.name} +{f.ms:.3f} ms (CPU +{f.cpu_ms:.3f})" for f in relays.values()))
        ref = relays.get("sync relay + hand-off")
        if ref is not None:
            print(f"  ours: of the +{hop:.3f} ms per hop, the bare relay with the same threads "
                  f"(sync grpcio, a compute-thread hand-off) takes {ref.ms:.3f} ms; the rest, "
                  f"{hop - ref.ms:+.3f} ms, is our checks, wire decode/encode and bookkeeping")

        # -- prefill -----------------------------------------------------------------
        P, C = args.prompt_tokens, args.chunk
        t.load(cluster.fp, cluster.plan([3, 4]), "float32", "float32", force=True)
        long_prompt = [(31 * i + 11) % (a.vocab_size - 1) + 1 for i in range(P + 1)]

        def ttft(pipelined: bool) -> float:
            t0 = time.perf_counter()
            next(pipe.generate(long_prompt, Sampling(), 1, pipelined=pipelined))
            return time.perf_counter() - t0

        seq_t, pip_t = [], []
        for r in range(args.repeats + 1):
            s, q = ttft(False), ttft(True)
            if r:
                seq_t.append(s)
                pip_t.append(q)
        s, q = statistics.median(seq_t), statistics.median(pip_t)
        n_chunks = -(-P // C)
        ideal = 2 * n_chunks / (n_chunks + 1)
        ratio = s / q
        print(f"prefill: 2 stages, compute = sleep {ms} ms per token ({ms * C:.1f} ms per "
              f"{C}-token chunk per stage), {P} tokens in {n_chunks} chunks: sequential "
              f"{s * 1e3:.0f} ms, pipelined {q * 1e3:.0f} ms: {ratio:.2f}x (target >= 1.8x: "
              f"{'met' if ratio >= 1.8 else 'NOT met'}; compute alone would give 2n/(n+1) = "
              f"{ideal:.2f}x; sequential also waits a round trip per chunk)")
    finally:
        t.shutdown()
        cluster.stop()

    if not args.no_compute:
        _compute_figures(ckpt, cluster.fp, a, args.chunk)
    return 0


def _compute_figures(ckpt: Path, fp: str, a, chunk: int, decode: int = 16) -> None:
    """Print each of 3 stages' real compute (StageRunner.run in this process)."""
    from kimi_mlx.sampling import Sampling
    from kimi_mlx.cluster.node.runner import load_stage

    L = a.num_hidden_layers
    cut = [round(i * L / 3) for i in range(4)]
    runners = [load_stage(ckpt, StageSpec(fp, cut[i], cut[i + 1], i, 3, "float32", "float32"))[0]
               for i in range(3)]
    sessions = [r.new_session(f"c{i}", "bench", Sampling()) for i, r in enumerate(runners)]
    times = [{"prefill": [], "decode": []} for _ in runners]
    tokens = [(7 * i + 3) % (a.vocab_size - 1) + 1 for i in range(chunk)]
    seq = off = 0

    def step(x, length: int, kind: str, keep: bool):
        nonlocal seq, off
        for i, (r, s) in enumerate(zip(runners, sessions)):
            t0 = time.perf_counter()
            out = r.run(s, seq, off, x, sample=True)
            if keep:
                times[i][kind].append(time.perf_counter() - t0)
            x = out.hidden
        seq, off = seq + 1, off + length
        return out.token

    for k in range(2):  # the first chunk warms up
        step(mx.array([tokens]), chunk, "prefill", keep=k == 1)
    tok = tokens[-1]
    for k in range(decode + 2):
        tok = step(mx.array([[tok]]), 1, "decode", keep=k >= 2)
    rows = []
    for i in range(3):
        dm = statistics.median(times[i]["decode"]) * 1e3
        pm = times[i]["prefill"][0] * 1e3
        rows.append(f"stage {i} [{cut[i]}, {cut[i + 1]}) {dm:.2f} ms/token, "
                    f"{pm:.0f} ms per {chunk}-token chunk")
    print("compute (real model, this checkpoint, StageRunner in one process, 1 BLAS thread): "
          + "; ".join(rows))


if __name__ == "__main__":
    sys.exit(main())
