"""The one-process `kimi-mlx server` ends when the process that started it dies.

A real process tree: a reaper (this test's child, a Linux child subreaper so that the
orphaned server is handed to it and its exit status can be read) starts a parent, the
parent starts `kimi-mlx server` with `kimi_mlx.lifetime.child_env` (as the harnesses
and benches do), the reaper waits for the server's /health 200 (model loaded, memory
wired on a faked Mac), SIGKILLs the parent and waits for the server. The server must be
gone within the bound, by its clean stop (exit 0, the wired limit put back), not left
serving under a dead parent as before.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kimi_mlx.testing import fake_metal

from test_wired import MAC64, MICRO

pytestmark = [
    pytest.mark.skipif(MICRO is None, reason="needs the shipped micro checkpoint"),
    pytest.mark.skipif(not sys.platform.startswith("linux"),
                       reason="the reaper uses Linux's PR_SET_CHILD_SUBREAPER"),
]

BOUND_S = 30.0  # parent poll 0.5 s + uvicorn's graceful stop, on a loaded 2-core machine

REAPER = r"""
import ctypes, json, os, signal, subprocess, sys, time
from kimi_mlx.testing.health import wait_healthy
port, bound = sys.argv[1], float(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER: orphans come to this process
    sys.exit("prctl failed")
parent_code = (
    "import subprocess, sys, time\n"
    "from kimi_mlx.lifetime import child_env\n"
    "p = subprocess.Popen([sys.executable, '-m', 'kimi_mlx', 'server', '--port', sys.argv[1],"
    " '--quiet', '--max-concurrency', '1'], env=child_env(), stdin=subprocess.DEVNULL)\n"
    "print(p.pid, flush=True)\n"
    "time.sleep(3600)\n")
parent = subprocess.Popen([sys.executable, "-c", parent_code, port], stdout=subprocess.PIPE,
                          text=True)
server = int(parent.stdout.readline())
out = {"server": server}
try:
    try:  # the server is a grandchild: not ours to poll(), its parent prints its output
        wait_healthy(f"http://127.0.0.1:{port}", 300)
    except RuntimeError as e:
        out["error"] = str(e)
        raise SystemExit
    t0 = time.monotonic()
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    while True:
        try:
            pid, status = os.waitpid(server, os.WNOHANG)
        except ChildProcessError:  # not handed to this process yet
            pid = 0
        if pid:
            out["exit"] = os.waitstatus_to_exitcode(status)
            out["seconds"] = time.monotonic() - t0
            break
        if time.monotonic() - t0 > bound:
            out["exit"], out["seconds"] = None, None  # still serving: it ignored its parent
            break
        time.sleep(0.05)
finally:
    for pid in (parent.pid, server):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    try:
        os.waitpid(server, 0)
    except ChildProcessError:
        pass
    print(json.dumps(out), flush=True)
"""


@pytest.mark.timeout(600)
def test_server_started_with_the_parent_watch_stops_when_its_parent_is_killed(tmp_path):
    from kimi_mlx.testing.ports import free_ports

    rec = tmp_path / "calls.jsonl"
    port = free_ports(1)[0]
    r = subprocess.run([sys.executable, "-c", REAPER, str(port), str(BOUND_S)],
                       env=fake_metal.env(MAC64, rec), capture_output=True, text=True,
                       timeout=500, stdin=subprocess.DEVNULL)
    assert r.returncode == 0, r.stderr[-4000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "error" not in out, r.stderr[-4000:]
    assert out["exit"] == 0, (out, r.stderr[-4000:])  # its clean stop, within the bound
    assert out["seconds"] < BOUND_S
    calls = [c for c in fake_metal.records(rec) if c["pid"] == out["server"]]
    assert len(calls) == 2 and calls[0]["limit"] > 0 and calls[-1]["limit"] == 0, calls
