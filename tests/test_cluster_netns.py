"""Three hosts as three Linux network namespaces on a bridge (as root): real mDNS finds
them, a launch across them generates what one process generates, and a host whose link
goes down mid-generation is named within 10 s.

Everything lives in namespaces this test creates (the bridge too, in its own namespace),
with 10.213.77.0/24 addresses that exist only there; the host's own network is not
touched. Skipped, with the reason, when not root or when `ip netns` is unavailable.
"""

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from kimi_mlx.cluster.net.auth import init_secret
from kimi_mlx.testing.cluster import StageProc, reference_checkpoint, stop_all

SUBNET = "10.213.77"


def _ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20, check=check)


def _skip_reason():
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"kmxp{os.getpid()}"
    r = _ip("netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


SKIP = _skip_reason()
# three stage processes of its own in namespaces, a launch, a link taken down mid-generation:
# ~30 s quiet, after the suite (make test-e2e)
pytestmark = [pytest.mark.skipif(SKIP is not None, reason=f"three-host namespace test skipped: {SKIP}"),
              pytest.mark.e2e]


@pytest.fixture(scope="module")
def hosts():
    tag = f"kmx{os.getpid() % 100000}"
    br, names = f"{tag}br", [f"{tag}h{i}" for i in range(3)]
    try:
        _ip("netns", "add", br)
        _ip("-n", br, "link", "add", "br0", "type", "bridge")
        _ip("-n", br, "link", "set", "br0", "up")
        for i, ns in enumerate(names):
            _ip("netns", "add", ns)
            _ip("-n", br, "link", "add", f"v{i}", "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("-n", br, "link", "set", f"v{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{SUBNET}.{i + 1}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield names
    finally:
        for ns in names + [br]:
            _ip("netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def cluster(hosts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("netns")
    ckpt = reference_checkpoint(tmp)
    models = tmp / "models"
    models.mkdir()
    (models / "ckpt").symlink_to(ckpt)
    secret = init_secret(tmp / "cluster.key")
    procs = [StageProc(models, secret, f"host{i}", tmp / f"host{i}.log", port=52415,
                       interface=f"{SUBNET}.{i + 1}", advertise=True, netns=ns)
             for i, ns in enumerate(hosts)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.wait_ready(60)
        yield dict(hosts=hosts, procs=procs, ckpt=ckpt, secret=secret, tmp=tmp)
    finally:
        stop_all(procs)


def _in(ns, args, timeout=120, **kw):
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-m", "kimi_mlx.commands.main"] + args
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"), **kw)


def _body(stdout):
    return "\n".join(l for l in stdout.splitlines()
                     if not l.startswith(("Prompt:", "Generation:", "Peak memory:")))


def _ls(c):
    r = _in(c["hosts"][0], ["cluster", "ls", "--interface", f"{SUBNET}.1", "--timeout", "3",
                            "--json", "--secret-file", str(c["secret"])])
    assert r.returncode == 0, r.stderr
    return {n["node_id"]: n for n in json.loads(r.stdout)}


def test_mdns_finds_the_three_hosts_and_a_launch_generates(cluster):
    nodes = _ls(cluster)
    assert sorted(nodes) == ["host0", "host1", "host2"], nodes
    for i in range(3):
        n = nodes[f"host{i}"]
        assert n["host"] == f"{SUBNET}.{i + 1}" and n["port"] == 52415
        assert n["status"].startswith("ok"), n
    flags = ["--model", str(cluster["ckpt"]), "--prompt", "The licence grants you the right to",
             "--max-tokens", "16", "--ignore-chat-template"]
    launch = _in(cluster["hosts"][0], ["cluster", "launch", "--nodes", "auto", "--interface",
                                       f"{SUBNET}.1", "--secret-file", str(cluster["secret"])] + flags)
    assert launch.returncode == 0, launch.stderr
    for i in range(3):
        assert f"node host{i} at {SUBNET}.{i + 1}:52415" in launch.stderr, launch.stderr
    one = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate"] + flags,
                         capture_output=True, text=True, timeout=120)
    assert _body(launch.stdout) == _body(one.stdout)


def test_a_host_dropping_off_the_network_is_named_within_10s(cluster):
    from kimi_mlx.text.tokenizer import KimiTokenizer

    hosts = cluster["hosts"]
    tok = KimiTokenizer.from_pretrained(cluster["ckpt"])
    text = "Each stage answers only to the head that holds its lease. "
    while len(tok.encode(text)) < 1000:
        text += "Each stage answers only to the head that holds its lease. "
    cmd = ["ip", "netns", "exec", hosts[0], sys.executable, "-m", "kimi_mlx.commands.main", "cluster",
           "launch", "--nodes", "auto", "--interface", f"{SUBNET}.1", "--secret-file",
           str(cluster["secret"]), "--model", str(cluster["ckpt"]), "--prompt", text,
           "--ignore-chat-template", "--max-tokens", "200", "--prefill-chunk", "4",
           "--peer-timeout", "4"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
    started, err = threading.Event(), []
    threading.Thread(target=lambda: [started.set() for l in p.stdout if l.startswith("====")],
                     daemon=True).start()
    threading.Thread(target=lambda: err.extend(p.stderr), daemon=True).start()
    try:
        assert started.wait(60)
        time.sleep(0.3)
        assert p.poll() is None, "generation ended before the link went down"
        _ip("-n", hosts[1], "link", "set", "eth0", "down")
        down = time.monotonic()
        rc = p.wait(30)
        elapsed = time.monotonic() - down
    finally:
        p.kill()
        _ip("-n", hosts[1], "link", "set", "eth0", "up")
    time.sleep(0.5)
    stderr = "".join(err)
    print(f"\nlink down -> exit {elapsed:.2f} s")
    assert rc == 1, stderr
    assert elapsed < 10, elapsed
    assert "stage 1 (node host1" in stderr and "lost" in stderr, stderr
    assert "host0 (0 sessions left)" in stderr and "host2 (0 sessions left)" in stderr, stderr
    # back on the network, host1 drops the orphaned session too (its peers let go)
    end = time.monotonic() + 15
    while time.monotonic() < end:
        nodes = _ls(cluster)
        if all("0 sessions" in nodes[h]["status"] for h in ("host0", "host1", "host2")):
            break
    assert all("0 sessions" in nodes[h]["status"] for h in ("host0", "host1", "host2")), nodes
