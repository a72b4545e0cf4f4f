"""Zeroconf discovery over real mDNS on the loopback interface: nodes advertise their TXT
records, `cluster ls` lists them, `cluster launch --nodes auto` generates across them, and
a node killed without a goodbye and restarted re-advertises and is found again. Browses
of 1 s find running nodes (their answers come ~0.1 s in; see discovery.MIN_BROWSE_S)."""

import os
import secrets
import signal
import subprocess
import sys
import time

import pytest

from kimi_mlx.cluster.net.auth import init_secret, key_id, load_secret
from kimi_mlx.cluster.net.discovery import browse
from kimi_mlx.cluster.net.fingerprint import fingerprint
from kimi_mlx.testing.cluster import reference_checkpoint, start_stages, stop_all
from kimi_mlx.cluster.net.wire import PROTOCOL_VERSION, package_versions

LO = ["127.0.0.1"]


def _find(prefix, want, timeout=15.0):
    """Browse until exactly the node ids in `want` (with this prefix) are seen."""
    end = time.monotonic() + timeout
    nodes = {}
    while time.monotonic() < end:
        nodes = {n.node_id: n for n in browse(1.5, LO) if n.node_id.startswith(prefix)}
        if set(nodes) == set(want):
            return nodes
    return nodes


def _run(args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main"] + args, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def _body(stdout):
    return "\n".join(l for l in stdout.splitlines()
                     if not l.startswith(("Prompt:", "Generation:", "Peak memory:")))


@pytest.mark.e2e  # 2 advertising stages of its own, a launch, a kill and a rejoin: ~17 s quiet (make test-e2e)
def test_mdns_on_loopback_ls_launch_and_rejoin(tmp_path):
    ckpt = reference_checkpoint(tmp_path)
    models = tmp_path / "models"
    models.mkdir()
    (models / "ckpt").symlink_to(ckpt)
    secret_file = init_secret(tmp_path / "cluster.key")
    prefix = f"mdns-{secrets.token_hex(3)}-"
    procs = start_stages(2, models, secret_file, tmp_path, prefix=prefix, advertise=True)
    try:
        ids = [p.node_id for p in procs]
        nodes = _find(prefix, ids)
        assert set(nodes) == set(ids)
        fp, ours = fingerprint(ckpt), package_versions()[0]
        for p in procs:
            n = nodes[p.node_id]
            assert (n.host, n.port) == ("127.0.0.1", p.port)
            assert n.protocol == PROTOCOL_VERSION and n.version == ours and fp in n.fingerprints
            assert n.key_id == key_id(load_secret(secret_file))
            assert n.total_memory > 0 and 0 < n.usable_memory <= n.total_memory

        ls = _run(["cluster", "ls", "--interface", "127.0.0.1", "--timeout", "1",
                   "--secret-file", str(secret_file)])
        assert ls.returncode == 0, ls.stderr
        for p in procs:
            line = next(l for l in ls.stdout.splitlines() if l.startswith(p.node_id))
            assert f"127.0.0.1:{p.port}" in line and " ok (idle" in line, ls.stdout

        flags = ["--model", str(ckpt), "--prompt", "def fibonacci(n):", "--max-tokens", "12",
                 "--ignore-chat-template"]
        launch = _run(["cluster", "launch", "--nodes", "auto", "--interface", "127.0.0.1",
                       "--discover-timeout", "1", "--secret-file", str(secret_file)] + flags)
        assert launch.returncode == 0, launch.stderr
        assert _body(launch.stdout) == _body(_run(["generate"] + flags).stdout)
        # Other nodes on this machine's loopback (other secrets) are skipped, not used.
        assert all(f"node {p.node_id} at" in launch.stderr for p in procs), launch.stderr

        # Killed without a goodbye: gone from a fresh browse; restarted (new port): back.
        procs[1].signal(signal.SIGKILL)
        procs[1].proc.wait(5)
        assert set(_find(prefix, ids[:1])) == set(ids[:1])
        procs[1].port = 0
        procs[1].start().wait_ready(60)
        again = _find(prefix, ids)
        assert again[ids[1]].port == procs[1].port
    finally:
        stop_all(procs)
