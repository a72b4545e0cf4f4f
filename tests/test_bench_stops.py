"""A `kimi-mlx bench` stopped by a signal leaves no process and no temporary folder.

`kimi-mlx bench hop` (its null stage processes; it re-executes itself with one BLAS
thread, so its own handler is what runs) takes SIGTERM, `kimi-mlx bench tensor` (its two
ring ranks, through the bench dispatcher's handler) takes SIGHUP, each while its
processes run. Each must end with 128 + the signal after stopping them and removing its
folder. The processes are found by a marker (a unique TMPDIR) in their command line or
environment, from /proc (Linux only). Before the handlers both were killed outright,
leaving the folder (and, for `bench tensor`, the ranks, which do not watch their parent).
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from kimi_mlx.generation.generate import default_model

MICRO = default_model()
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc"),
              pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint")]


def _pids_with(marker: str, command: str = ""):
    """Live (not zombie) processes whose command line or environment holds `marker` (and
    whose command line holds `command`)."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{d}/cmdline", "rb") as f:
                text = cmd = f.read()
            with open(f"/proc/{d}/environ", "rb") as f:
                text += f.read()
        except OSError:
            continue
        if marker.encode() in text and command.encode() in cmd and state != "Z":
            out.append(int(d))
    return out


def _stop_while_running(tmp_path, argv, ready, sig):
    """Start `kimi-mlx bench ARGV` with a unique TMPDIR, wait until `ready(tmpdir)` (its
    processes run), send `sig`; returns (exit status, processes left, folders left)."""
    tmp = tmp_path / "tmpdir-bench-signal"
    tmp.mkdir()
    env = dict(os.environ, TMPDIR=str(tmp), PYTHONUNBUFFERED="1")
    log = tmp_path / "bench.log"
    out = open(log, "wb")
    bench = subprocess.Popen([sys.executable, "-m", "kimi_mlx.commands.main", "bench", *argv],
                             env=env, stdout=out, stderr=subprocess.STDOUT,
                             stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        end = time.monotonic() + 400
        while time.monotonic() < end and bench.poll() is None and not ready(tmp):
            time.sleep(0.1)
        assert bench.poll() is None and ready(tmp), log.read_text(errors="replace")[-3000:]
        bench.send_signal(sig)
        code = bench.wait(120)
        time.sleep(0.5)  # a child's exit is seen in /proc once it is reaped
        # ours are named kimi-*; MLX may leave its own `mlx` folder of shared files there
        return (code, _pids_with(str(tmp)), [f.name for f in tmp.iterdir()
                                             if f.name.startswith("kimi-")],
                log.read_text(errors="replace"))
    finally:
        out.close()
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for pid in _pids_with(str(tmp)):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(600)
def test_sigterm_to_bench_hop_stops_its_stages_and_removes_its_folder(tmp_path):
    def ready(tmp):
        logs = [f / f"null{i}.log" for f in tmp.iterdir()
                if f.name.startswith("kimi-mlx-hop-bench-") for i in range(5)]
        return bool(logs) and all(l.exists() and "listening on" in l.read_text(errors="replace")
                                  for l in logs)

    code, left, folders, text = _stop_while_running(
        tmp_path, ["hop", "--model", str(MICRO), "--repeats", "1"], ready, signal.SIGTERM)
    assert code == 128 + signal.SIGTERM, text[-3000:]
    assert left == [] and folders == [], (left, folders)
    assert "bench hop: stopped (SIGTERM)" in text


@pytest.mark.timeout(600)
def test_sighup_to_bench_tensor_stops_its_ranks_and_removes_its_folder(tmp_path):
    from kimi_mlx.testing.ports import free_ports

    port, _ = free_ports(2, consecutive=True)

    def ready(tmp):
        return len(_pids_with(str(tmp), "kimi_mlx.testing.tensor_parallel")) == 2  # both ranks

    code, left, folders, text = _stop_while_running(
        tmp_path, ["tensor", "--model", str(MICRO), "--port", str(port), "--repeats", "50",
                   "--decode", "64"], ready, signal.SIGHUP)
    assert code == 128 + signal.SIGHUP, text[-3000:]
    assert left == [] and folders == [], (left, folders)
    assert "bench tensor: stopped (SIGHUP)" in text
