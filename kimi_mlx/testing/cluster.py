"""Stage processes for tests and the bench: `kimi-mlx cluster serve` as child processes.

Every wait is bounded; `StageProc.stop()` stops the process group (SIGTERM, SIGKILL only
after its bound; use it in `finally`). Each stage also ends itself when the process that
started it is gone (`cluster.net.lifetime.watch_parent_from_env`, in `cluster serve`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List, Optional, Sequence

READY_RE = re.compile(r"listening on (\S+):(\d+)")


def reference_checkpoint(workdir: Path, seed: int = 0) -> Path:
    """The shipped micro checkpoint when this install has it, else a tiny one built in
    `workdir/tiny` (kimi_mlx.testing.checkpoints.build_checkpoint)."""
    from kimi_mlx.generation.generate import default_model

    shipped = default_model()
    if shipped is not None:
        return shipped
    path = Path(workdir) / f"tiny-{seed}"
    if not path.exists():
        from kimi_mlx.testing.checkpoints import build_checkpoint

        build_checkpoint(path, seed=seed)
    return path


class StageProc:
    """One `kimi-mlx cluster serve` child process.

    Args:
        models: its --models folder. secret_file: its --secret-file.
        node_id: --node-id. port: --port (0 = any; the bound port is read from its log).
        interface: --interface. advertise: register with zeroconf.
        netns: run inside this network namespace (`ip netns exec`).
        extra: more serve flags. log: file for its stdout/stderr.
    """

    def __init__(self, models: Path, secret_file: Path, node_id: str, log: Path, port: int = 0,
                 interface: str = "127.0.0.1", advertise: bool = False, netns: Optional[str] = None,
                 extra: Sequence[str] = (), env: Optional[dict] = None):
        self.models, self.secret_file, self.node_id = models, secret_file, node_id
        self.port, self.interface, self.advertise, self.netns = port, interface, advertise, netns
        self.extra, self.log, self.env = list(extra), Path(log), env
        self.proc: Optional[subprocess.Popen] = None
        self.host: Optional[str] = None

    def command(self) -> List[str]:
        """The command line it runs."""
        cmd = [sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "serve", "--models", str(self.models),
               "--secret-file", str(self.secret_file), "--node-id", self.node_id,
               "--port", str(self.port), "--interface", self.interface] + self.extra
        if not self.advertise:
            cmd.append("--no-advertise")
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        return cmd

    def start(self) -> "StageProc":
        """Start the process (its own process group); returns self."""
        from kimi_mlx.cluster.net.lifetime import child_env

        env = child_env(dict(os.environ, PYTHONUNBUFFERED="1", **(self.env or {})))
        self._offset = self.log.stat().st_size if self.log.exists() else 0
        f = open(self.log, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=f, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        f.close()
        return self

    def wait_ready(self, timeout: float = 60.0) -> "StageProc":
        """Wait for the 'listening on' line; RuntimeError (with the log) on exit/timeout."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            text = self.log_text()
            m = READY_RE.search(text)
            if m:
                self.host, self.port = m.group(1), int(m.group(2))
                return self
            if self.proc.poll() is not None:
                raise RuntimeError(f"stage {self.node_id} exited {self.proc.returncode}:\n{text}")
            time.sleep(0.05)
        raise RuntimeError(f"stage {self.node_id} not ready in {timeout:.0f} s:\n{self.log_text()}")

    def log_text(self) -> str:
        """What it logged since the last start."""
        try:
            with open(self.log, "rb") as f:
                f.seek(self._offset)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    @property
    def address(self) -> str:
        """'host:port' it listens on (after wait_ready)."""
        return f"{self.host}:{self.port}"

    def alive(self) -> bool:
        """Whether the process is running."""
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the process group (the serve process and any wrapper)."""
        if self.alive():
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def stop(self, timeout: float = 5.0, terminate: bool = True) -> Optional[int]:
        """SIGTERM (clean: unadvertise; skipped when `terminate` is false, i.e. already
        sent: a second one while the interpreter shuts down kills it by the default
        action), then SIGKILL after `timeout` seconds. Returns the exit status (0: a
        clean stop; -6: it aborted; -9: killed), None if never started."""
        if self.proc is None:
            return None
        if self.alive():
            if terminate:
                self.signal(signal.SIGCONT)
                self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def stop_all(procs: Sequence[StageProc], timeout: float = 5.0) -> List[Optional[int]]:
    """Stop several stage processes at once (SIGTERM to all, then wait; SIGKILL
    stragglers); returns their exit statuses (see `StageProc.stop`)."""
    for p in procs:
        if p.alive():
            p.signal(signal.SIGCONT)
            p.signal(signal.SIGTERM)
    return [p.stop(timeout, terminate=False) for p in procs]


def start_stages(n: int, models: Path, secret_file: Path, workdir: Path, prefix: str = "node",
                 timeout: float = 60.0, ports: Optional[Sequence[int]] = None,
                 extras: Optional[Sequence[Sequence[str]]] = None, **kw) -> List[StageProc]:
    """Start n stage processes in parallel and wait until all listen (stops them all on
    failure). `ports`: one --port per stage (default: `kw`'s port, or any free one);
    `extras`: more serve flags per stage (after `kw`'s extra)."""
    def own(i):
        k = dict(kw, port=ports[i]) if ports else dict(kw)
        if extras:
            k["extra"] = list(kw.get("extra", ())) + list(extras[i])
        return k

    procs = [StageProc(models, secret_file, f"{prefix}{i}", Path(workdir) / f"{prefix}{i}.log",
                       **own(i)) for i in range(n)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(timeout)
    except BaseException:
        stop_all(procs)
        raise
    return procs


class LocalCluster:
    """n stage processes on loopback serving one checkpoint, with a fresh cluster secret:
    the setup shared by the pipeline and fault tests and the cluster bench.

    Attributes:
        ckpt: the checkpoint (default: `reference_checkpoint(workdir)`), linked into
            `models` as "ckpt" (the stages' --models folder).
        secret_file / secret: the cluster secret (file mode 0600) and its bytes.
        fp: the checkpoint's fingerprint. args: its `ModelArgs`.
        procs: the running `StageProc`s (already listening).
    Call `stop()` in a `finally`.
    """

    def __init__(self, workdir: Path, n: int = 3, prefix: str = "stage", ckpt: Optional[Path] = None,
                 **stage_kw):
        from kimi_mlx.model.config import ModelArgs, read_config

        from kimi_mlx.cluster.net.auth import init_secret, load_secret
        from kimi_mlx.cluster.net.fingerprint import fingerprint

        self.workdir = Path(workdir)
        self.ckpt = Path(ckpt) if ckpt is not None else reference_checkpoint(self.workdir)
        self.models = self.workdir / "models"
        self.models.mkdir()
        (self.models / "ckpt").symlink_to(self.ckpt.resolve())
        self.secret_file = init_secret(self.workdir / "cluster.key")
        self.secret = load_secret(self.secret_file)
        self.fp = fingerprint(self.ckpt)
        self.args = ModelArgs.from_config(read_config(self.ckpt))
        self.procs = start_stages(n, self.models, self.secret_file, self.workdir, prefix=prefix,
                                  **stage_kw)

    def nodes(self):
        """`NodeInfo` of every stage process, in order."""
        from kimi_mlx.cluster.net.discovery import NodeInfo

        return [NodeInfo(p.node_id, p.host, p.port) for p in self.procs]

    def load_transport(self, max_len: int = 4096, batch: int = 1, peer_timeout: float = 10.0,
                       dtype: str = "float32", kv=(None, None)):
        """A `GrpcTransport` with every stage process checked (none refused) and loaded on
        `plan_stages`' split, activations and wire in `dtype`, DSA caches in format `kv`
        ((kv_bits, kv_group_size); None: the model dtype, the cache's default group),
        planned in that format as `cluster launch` plans them. Returns (transport, stages);
        the caller calls `transport.shutdown()`. Raises AssertionError naming the refused
        nodes."""
        from kimi_mlx.cluster.net.nodes import check_nodes
        from kimi_mlx.cluster.head.plan import plan_stages
        from kimi_mlx.cluster.head.transport import GrpcTransport

        t = GrpcTransport(self.secret, peer_timeout=peer_timeout)
        try:
            accepted, rejected = check_nodes(self.nodes(), t.stub_for, self.fp)
            assert not rejected, rejected
            stages = plan_stages(self.ckpt, [n for n, _ in accepted], max_len, batch, *kv)[1]
            t.load(self.fp, stages, dtype, dtype, kv=kv)
        except BaseException:
            t.shutdown()
            raise
        return t, stages

    def sessions(self, i: int) -> int:
        """Sessions stage process i holds now (its Health RPC)."""
        from kimi_mlx.cluster.net import stage_pb2 as pb
        from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
        from kimi_mlx.cluster.net.channel import make_channel

        stub = pb_grpc.StageStub(make_channel(self.procs[i].address, self.secret))
        return stub.Health(pb.HealthRequest(), timeout=5).sessions

    def stop(self, timeout: float = 5.0) -> List[Optional[int]]:
        """Stop every stage process (SIGKILL after `timeout` s); returns their exit
        statuses (see `StageProc.stop`)."""
        return stop_all(self.procs, timeout)


class ServerProc:
    """`kimi-mlx cluster server` over a `LocalCluster`'s stages, as a child process (float32
    activations, --peer-timeout 3, model name "micro", prefill chunks of 16 unless `extra`
    says otherwise). `log` collects its stderr lines as they come. Call `stop()` in a
    `finally`.

    Args:
        cluster: the LocalCluster. port: HTTP port. extra: more server flags.
        timeout: seconds to wait for /health 200 (RuntimeError with the log after it).
    """

    def __init__(self, cluster: "LocalCluster", port: int, *extra: str, timeout: float = 120.0):
        import threading

        from kimi_mlx.cluster.net.lifetime import child_env

        self.url = f"http://127.0.0.1:{port}"
        self.log: List[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "server", "--model",
             str(cluster.ckpt), "--nodes", ",".join(p.address for p in cluster.procs),
             "--secret-file", str(cluster.secret_file), "--port", str(port),
             "--activation-dtype", "float32", "--wire-dtype", "float32", "--peer-timeout", "3",
             "--served-model-name", "micro", "--prefill-chunk", "16", *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            env=child_env(dict(os.environ, PYTHONUNBUFFERED="1")))  # ends when this process does
        threading.Thread(target=self._read, daemon=True).start()
        try:
            from kimi_mlx.testing.health import wait_healthy

            wait_healthy(self.url, timeout, self.proc, output=self.log_text)
        except BaseException:
            self.stop()
            raise

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.log.append(line)

    def log_text(self) -> str:
        return "".join(self.log)

    def health(self):
        """(status code or None when not answering, reason or '')."""
        import httpx

        try:
            r = httpx.get(self.url + "/health", timeout=2)
            return r.status_code, r.json().get("reason", "")
        except (httpx.HTTPError, ValueError) as e:
            return None, str(e)

    def wait_health(self, code: int, timeout: float, seen: Optional[list] = None) -> str:
        """Poll /health until it answers `code`; returns its reason. RuntimeError (with the
        server's log) after `timeout` s or when the server exits. The reasons seen
        meanwhile are appended to `seen`."""
        end = time.monotonic() + timeout
        while True:
            got, reason = self.health()
            if seen is not None and reason:
                seen.append(reason)
            if got == code:
                return reason
            if time.monotonic() > end or self.proc.poll() is not None:
                raise RuntimeError(f"/health did not answer {code} within {timeout:g} s (last: "
                                   f"{got} {reason}); server log:\n{self.log_text()[-4000:]}")
            time.sleep(0.1)

    def stop(self) -> Optional[int]:
        """SIGTERM, SIGKILL after 10 s; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode
