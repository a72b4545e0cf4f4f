"""`cluster launch --parallel tensor` on loopback: this head (rank 0) and one `cluster serve`
node (rank 1) form an MLX ring group through the control plane (no hostfile, no ssh).

- greedy output equals `kimi-mlx generate` in one process (the independent reference);
- a rank killed or stopped (SIGSTOP) mid-generation: the head names it and exits 1, the
  node reports it and no rank process is left;
- a node that cannot join (backend missing) is refused by name before anything loads.
Every process has a hard timeout; the node's ports are a free pair (gRPC, and its rank on gRPC + 1).
"""

import functools
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kimi_mlx.cluster.tensor.group import TensorSetupError, choose_backend, hosts_json

PROMPT = "PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2"
HARD_TIMEOUT = 180


@pytest.fixture(scope="module")
def node(tensor_node):
    """The session's tensor node (tests/fixtures/shared.py; its gRPC port and its rank's
    ring port, gRPC + 1, were free): the tests below kill or stop only the ranks it starts."""
    return tensor_node


def launch_cmd(c, *extra, max_tokens=24):
    return [sys.executable, "-m", "kimi_mlx.commands.main", "cluster", "launch",
            "--model", str(c.ckpt), "--nodes", c.procs[0].address,
            "--secret-file", str(c.secret_file), "--ignore-chat-template",
            "--prompt", PROMPT, "--max-tokens", str(max_tokens), "--temp", "0", *extra]


def generated_text(stdout: str) -> str:
    """The streamed text between `print_generation`'s ===== lines."""
    return stdout.split("=" * 10)[1] if stdout.count("=" * 10) >= 2 else stdout


def rank_pids(c, after: int):
    """pids of the rank processes the node started (its log), from log offset `after`."""
    return [int(p) for p in re.findall(r"tensor rank \d+ of \d+ .*started, pid (\d+)",
                                       c.procs[0].log_text()[after:])]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_choose_backend_and_hosts():
    assert choose_backend({"a": ["ring"], "b": ["ring", "jaccl"]}) == "ring"
    with pytest.raises(TensorSetupError, match="sent no RDMA report"):  # tests/test_jaccl.py has more
        choose_backend({"a": ["ring", "jaccl"], "b": ["jaccl", "ring"]}, "jaccl")
    with pytest.raises(TensorSetupError, match=r"node b \(has: no distributed backend\)"):
        choose_backend({"node a": ["ring"], "node b": []})
    assert hosts_json([("10.0.0.1", 5), ("10.0.0.2", 6)]) == '[["10.0.0.1:5"], ["10.0.0.2:6"]]'


DRAFT = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-draft"


@functools.lru_cache(maxsize=None)  # greedy: one run serves the three cases below
def _one_process(ckpt: str) -> subprocess.CompletedProcess:
    ref = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate",
                          "--model", ckpt, "--ignore-chat-template", "--prompt", PROMPT,
                          "--max-tokens", "24", "--temp", "0"],
                         capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert ref.returncode == 0, ref.stderr
    return ref


# plain in make test; the two speculative launches through the group in make test-e2e
@pytest.mark.parametrize("extra", [(), pytest.param(("--draft-model", str(DRAFT)), marks=pytest.mark.e2e),
                                   pytest.param(("--draft", "ngram"), marks=pytest.mark.e2e)],
                         ids=["plain", "draft-model", "ngram"])
def test_greedy_equals_one_process(node, extra):
    """Greedy output through the group equals one process, plain and speculative (the
    draft on rank 0, verify steps through the group, rollback on every rank)."""
    ref = _one_process(str(node.ckpt))
    start = len(node.procs[0].log_text())
    r = subprocess.run(launch_cmd(node, "--parallel", "tensor", *extra,
                                  "--verbose", "true"),
                       capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert "ring group of 2" in r.stderr
    assert generated_text(r.stdout) == generated_text(ref.stdout)
    assert generated_text(r.stdout).strip()
    if extra:  # it did speculate: verify steps, some drafts accepted
        m = re.search(r"Speculative: (\d+) verify steps .*?([\d.]+) accepted per step", r.stdout)
        assert m and int(m.group(1)) > 0, r.stdout[-1000:]
        if "--draft-model" in extra:
            assert float(m.group(2)) > 0, m.group(0)
    log = node.procs[0].log_text()[start:]
    assert f"rank 1 on node {node.procs[0].node_id}: done after 1 request(s)" in log
    pids = rank_pids(node, start)
    assert len(pids) == 1
    deadline = time.monotonic() + 10
    while alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids[0])


DSPARK = Path(__file__).resolve().parents[1] / "kimi_mlx" / "assets" / "micro-dspark"
# past micro's index_topk (64) so the DSA layers' sparse selection is exercised
LONG_PROMPT = " ".join([PROMPT] * 4 + ["Permission is hereby granted, free of charge, to any "
                                       "person obtaining a copy of this software"] * 3)


@pytest.mark.e2e  # two whole runs of 32 tokens on a 100-token prompt, one through the group (make test-e2e)
def test_block_drafter_greedy_equals_one_process(node):
    """A DSpark block drafter on rank 0 reads the group's hidden states (rank 0's own
    forward pass): greedy output equals plain greedy in one process, on a prompt past
    index_topk, with drafts accepted."""
    common = ["--ignore-chat-template", "--prompt", LONG_PROMPT, "--max-tokens", "32",
              "--temp", "0"]
    ref = subprocess.run([sys.executable, "-m", "kimi_mlx.commands.main", "generate",
                          "--model", str(node.ckpt), *common],
                         capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert ref.returncode == 0, ref.stderr
    m = re.search(r"Prompt: (\d+) tokens", ref.stdout)
    assert m and int(m.group(1)) > 64, ref.stdout[-500:]
    cmd = launch_cmd(node, "--parallel", "tensor", "--draft-model", str(DSPARK),
                     "--num-draft-tokens", "4", "--verbose", "true")
    cmd[cmd.index("--prompt") + 1] = LONG_PROMPT
    cmd[cmd.index("--max-tokens") + 1] = "32"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert r.returncode == 0, r.stderr
    assert generated_text(r.stdout) == generated_text(ref.stdout)
    m = re.search(r"Speculative: (\d+) verify steps .*?([\d.]+) accepted per step", r.stdout)
    assert m and int(m.group(1)) > 0 and float(m.group(2)) > 0, r.stdout[-1000:]
    print(m.group(0))


def test_backend_missing_refused_by_name(node):
    start = len(node.procs[0].log_text())
    r = subprocess.run(launch_cmd(node, "--parallel", "tensor", "--backend", "jaccl"),
                       capture_output=True, text=True, timeout=HARD_TIMEOUT)
    assert r.returncode == 1
    assert f"node {node.procs[0].node_id} (has: ring)" in r.stderr and "jaccl" in r.stderr
    assert "started, pid" not in node.procs[0].log_text()[start:]  # nothing ran on the node


@pytest.mark.e2e  # a fault run: a 2000-token launch whose rank is killed or stopped (make test-e2e)
@pytest.mark.parametrize("sig,why", [(signal.SIGKILL, "was killed by SIGKILL"),
                                     (signal.SIGSTOP, "is stopped (SIGSTOP)")])
def test_rank_lost_mid_generation(node, sig, why):
    """Kill or stop the node's rank once text streams: the head names node and rank, exits
    1, and the rank process is gone (a stopped one is killed by its node)."""
    start = len(node.procs[0].log_text())
    head = subprocess.Popen(launch_cmd(node, "--parallel", "tensor", max_tokens=2000),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            bufsize=1)
    out: list = []
    threading.Thread(target=lambda: out.extend(iter(lambda: head.stdout.read(1), "")),
                     daemon=True).start()
    err: list = []
    threading.Thread(target=lambda: err.append(head.stderr.read()), daemon=True).start()
    try:
        deadline = time.monotonic() + HARD_TIMEOUT
        while len("".join(out)) < 40 + 10 and head.poll() is None:  # past "=====\n" and some text
            assert time.monotonic() < deadline, "no text streamed"
            time.sleep(0.05)
        assert head.poll() is None, "the head ended before the fault"
        pid = rank_pids(node, start)[0]
        t0 = time.monotonic()
        os.kill(pid, sig)
        head.wait(timeout=30)
        detected = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = not alive(pid)
    finally:
        if head.poll() is None:
            head.kill()
            head.wait()
    time.sleep(0.2)
    stderr = "".join(err)
    print(f"{sig.name}: head exited {detected:.2f} s after the fault")
    assert head.returncode == 1
    name = node.procs[0].node_id
    assert f"tensor group torn down: rank 1 on node {name} {why}" in stderr, stderr[-2000:]
    assert f"rank 1 on node {name} {why}" in node.procs[0].log_text()[start:]
    assert gone
    assert node.procs[0].alive()  # the node itself serves on
