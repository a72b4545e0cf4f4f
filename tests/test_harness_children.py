"""The long-lived children of the test and bench harnesses end when their starter is killed.

A starter process (SIGKILLed, so none of its own clean-up runs) started:
- two loopback tensor ranks through `testing.tensor_parallel.run_ranks` (rank 0 idle in
  Python, rank 1 blocked in the ring's all_sum waiting for it, the two states a rank of
  a killed test or bench is found in);
- `kimi-mlx bench tensor`'s two ranks (the bench itself is the starter);
- an echo server of the floor bench (`cluster.bench.grpc_floor`, used by `bench hop`).
Each child must be gone within the bound (the parent poll, `lifetime.PARENT_POLL_S`, plus
its stop; SIGKILL of itself after `lifetime.STOP_TIMEOUT` when stuck), found by a unique
marker in its command line or environment from /proc (Linux only). Before, each of them
kept running under PID 1 (the ranks with the model loaded).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kimi_mlx.generation.generate import default_model

MICRO = default_model()
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")

BOUND_S = 30.0  # poll 0.5 s + SIGTERM handling, or the watcher's own exit after 10 s

RANK = r'''
import sys, time
import mlx.core as mx
group = mx.distributed.init(backend="ring", strict=True)
print("joined", flush=True)
if group.rank() == 0:
    time.sleep(600)  # idle in Python
mx.eval(mx.distributed.all_sum(mx.ones(4), group=group))  # rank 1: waits for rank 0
'''


def _pids_with(marker: str, command: str = ""):
    """Live (not zombie) processes whose command line or environment holds `marker` (and
    whose command line holds `command`), other than this one."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{d}/cmdline", "rb") as f:
                text = cmd = f.read().replace(b"\0", b" ")
            with open(f"/proc/{d}/environ", "rb") as f:
                text += f.read()
        except OSError:
            continue
        if marker.encode() in text and command.encode() in cmd and state != "Z":
            out.append(int(d))
    return out


def _wait(pred, timeout: float, what: str, log: Path = None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout:.0f} s"
                         + (f":\n{log.read_text(errors='replace')[-3000:]}" if log else ""))


def _kill_then_gone(starter: subprocess.Popen, children) -> float:
    """SIGKILL `starter`; seconds until none of `children()` is left (AssertionError
    naming them after BOUND_S)."""
    t0 = time.monotonic()
    starter.kill()
    starter.wait(10)
    while children() and time.monotonic() - t0 < BOUND_S:
        time.sleep(0.1)
    left = children()
    assert not left, f"still running {BOUND_S:.0f} s after their starter was killed: {left}"
    return time.monotonic() - t0


def _cleanup(starter, marker):
    if starter.poll() is None:
        starter.kill()
        starter.wait(10)
    for pid in _pids_with(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.timeout(300)
def test_loopback_ranks_end_when_their_starter_is_killed(tmp_path):
    marker = str(tmp_path / "marker-ranks")
    os.makedirs(marker)
    (Path(marker) / "idle_rank.py").write_text(RANK)
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        from pathlib import Path
        from kimi_mlx.testing.tensor_parallel import run_ranks
        from kimi_mlx.testing.ports import free_ports
        run_ranks(free_ports(2), [], Path({marker!r}), timeout=600, module="idle_rank",
                  env={{"PYTHONPATH": {marker!r}}})
    """)], stdin=subprocess.DEVNULL)
    ranks = lambda: _pids_with(marker, "kimi_mlx.testing.watched idle_rank")  # noqa: E731
    try:
        logs = [Path(marker) / f"rank{r}.log" for r in range(2)]
        _wait(lambda: all(l.exists() and "joined" in l.read_text() for l in logs), 120,
              "both ranks joined")
        assert len(ranks()) == 2
        took = _kill_then_gone(starter, ranks)
        print(f"loopback ranks gone {took:.1f} s after their starter's SIGKILL")
    finally:
        _cleanup(starter, marker)


@pytest.mark.timeout(600)
@pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint")
def test_bench_tensor_ranks_end_when_the_bench_is_killed(tmp_path):
    from kimi_mlx.testing.ports import free_ports

    marker = str(tmp_path / "tmpdir-bench-killed")  # the bench's TMPDIR: in every child's env
    os.makedirs(marker)
    port, _ = free_ports(2, consecutive=True)
    log = tmp_path / "bench.log"
    with open(log, "wb") as out:
        bench = subprocess.Popen(
            [sys.executable, "-m", "kimi_mlx.commands.main", "bench", "tensor", "--model",
             str(MICRO), "--port", str(port), "--repeats", "1", "--decode", "400"],
            env=dict(os.environ, TMPDIR=marker, PYTHONUNBUFFERED="1"), stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ranks = lambda: _pids_with(marker, "kimi_mlx.testing.tensor_parallel")  # noqa: E731
    try:
        # killed once both ranks are past the ring's init: inside it MLX holds the
        # interpreter lock until every peer answers, so no watcher can run there
        joined = lambda: sum("joined" in p.read_text(errors="replace")  # noqa: E731
                             for p in Path(marker).rglob("rank*.log"))
        _wait(lambda: (len(ranks()) == 2 and joined() == 2) or bench.poll() is not None, 400,
              "two ranks past init", log)
        assert bench.poll() is None, log.read_text(errors="replace")[-3000:]
        took = _kill_then_gone(bench, ranks)
        print(f"bench tensor's ranks gone {took:.1f} s after its SIGKILL")
    finally:
        _cleanup(bench, marker)


@pytest.mark.timeout(120)
def test_floor_bench_server_ends_when_its_starter_is_killed(tmp_path):
    marker = str(tmp_path / "marker-floor")
    os.makedirs(marker)
    starter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from pathlib import Path
        from kimi_mlx.cluster.bench.grpc_floor import _Server
        s = _Server("tcp", Path({marker!r}))
        s.port()
        print(s.proc.pid, flush=True)
        time.sleep(600)
    """)], stdout=subprocess.PIPE, text=True, stdin=subprocess.DEVNULL)
    try:
        server = int(starter.stdout.readline())
        assert _pids_with(marker, "grpc_floor serve") == [server]
        took = _kill_then_gone(starter, lambda: _pids_with(marker, "grpc_floor serve"))
        print(f"floor echo server gone {took:.1f} s after its starter's SIGKILL")
    finally:
        _cleanup(starter, marker)
