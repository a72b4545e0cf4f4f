"""`kimi-mlx cluster server --parallel tensor` heals (issue 33, part 5): this head and one
`cluster serve` node (rank 1) on loopback, the micro checkpoint.

After a rank is lost (SIGKILL or SIGSTOP of the rank, while idle and during a request) or
its node is (the node's process group killed, or stopped and resumed): /health answers
503 naming it, the request in flight fails naming it, and once the node answers again the
server forms the group again by itself; the next greedy completion equals `kimi-mlx
generate` in one process (the independent reference). A stopped rank (and node) that
resumes cannot touch the new group. Afterwards exactly one rank 0 process (the server's
child; besides it at most the spare for the next group) and one node rank run, every
earlier one is gone, nothing new is in /dev/shm, and
after the server stops no rank process is left.

Every process has a hard timeout; ports are chosen free at run time. Timings are printed
(pytest -s): time to the named 503, time from the node's return to serving again.
"""

import os
import re
import signal
import threading
import time

from pathlib import Path

import pytest

from kimi_mlx.testing.cluster import LocalCluster, ServerProc
from kimi_mlx.testing.tensor_parallel import free_ports

from test_cluster_tensor_server import PROMPT, alive, one_process

HARD_TIMEOUT = 240
HEAL_S = 10.0  # the target: serving again within 10 s of the node's return
# asserted with a 2x margin: on a shared 2-core test machine at load 8, starting the two
# fresh rank processes (Python + MLX imports) alone took 4-6 s of the 3-7 s measured
HEAL_BOUND = 2 * HEAL_S


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    from kimi_mlx.testing.cluster import reference_checkpoint

    return one_process(reference_checkpoint(tmp_path_factory.mktemp("ref")), 12)


def make_node(tmp_path_factory, prefix):
    grpc_port, _ = free_ports(2, consecutive=True)
    return LocalCluster(tmp_path_factory.mktemp(prefix), n=1, prefix=prefix, ports=[grpc_port])


def children(pid: int):
    """Live (not zombie) processes whose parent is `pid`."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(d))
    return out


def shm():
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def ask(srv, max_tokens=12):
    import httpx

    r = httpx.post(srv.url + "/v1/completions", timeout=HARD_TIMEOUT,
                   json=dict(model="micro", prompt=PROMPT, max_tokens=max_tokens, temperature=0))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


class Streaming:
    """A long streamed completion in a thread: `tokens` so far, `error` when it failed."""

    def __init__(self, srv):
        import httpx

        self.tokens, self.error = 0, None

        def run():
            try:
                with httpx.stream("POST", srv.url + "/v1/completions", timeout=HARD_TIMEOUT,
                                  json=dict(model="micro", prompt=PROMPT, max_tokens=3000,
                                            temperature=0, stream=True)) as r:
                    for line in r.iter_lines():
                        if '"error"' in line:
                            self.error = line
                        elif line.startswith("data: {"):
                            self.tokens += 1
            except Exception as e:  # noqa: BLE001 - what the client saw
                self.error = str(e)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def wait_tokens(self, n, srv):
        end = time.monotonic() + HARD_TIMEOUT
        while self.tokens < n:
            assert time.monotonic() < end and self.thread.is_alive(), \
                (self.error, srv.log_text()[-3000:])
            time.sleep(0.02)


def node_rank(node):
    """(pid of the node's live rank process)."""
    kids = children(node.procs[0].proc.pid)
    assert len(kids) == 1, kids
    return kids[0]


def server_rank0(srv):
    """(pid of the server's rank 0 process): the one the log names last, a child of the
    server; at most one other child runs (the spare rank 0 process for the next group,
    `tensor.relay.start_spare`)."""
    end = time.monotonic() + 10
    while True:
        kids = children(srv.proc.pid)
        named = re.findall(r"rank 0 (?:this head's rank )?process \(?pid (\d+)", srv.log_text())
        if named and int(named[-1]) in kids:
            break
        assert time.monotonic() < end, (kids, named)
        time.sleep(0.05)
    assert len(kids) <= 2, kids
    return int(named[-1])


def lose(srv, node, what, during, ref, timings):
    """Lose the rank (what: "kill" / "stop" of the rank; "node-kill" / "node-stop" of the
    node's process group) idle or `during` a request; check the named 503, the failed
    request, the return, the reply and the process table; record the timings."""
    old_rank, old_rank0 = node_rank(node), server_rank0(srv)
    stream = None
    if during:
        stream = Streaming(srv)
        stream.wait_tokens(5, srv)
    t0 = time.monotonic()
    if what == "kill":
        os.kill(old_rank, signal.SIGKILL)
        named = "rank 1 on node {n} was killed by SIGKILL"
    elif what == "stop":
        os.kill(old_rank, signal.SIGSTOP)
        named = "rank 1 on node {n} is stopped (SIGSTOP)"
    elif what == "rank0-kill":
        os.kill(old_rank0, signal.SIGKILL)
        named = "rank 0 (this head's rank process) was killed by SIGKILL"
    elif what == "rank0-stop":
        os.kill(old_rank0, signal.SIGSTOP)
        named = "rank 0 (this head's rank process) is stopped (SIGSTOP)"
    elif what == "node-kill":
        node.procs[0].signal(signal.SIGKILL)
        named = "node {n}"
    else:
        node.procs[0].signal(signal.SIGSTOP)
        named = "node {n} stopped answering"
    named = named.format(n=node.procs[0].node_id)
    reason = srv.wait_health(503, 20)
    to_503 = time.monotonic() - t0
    assert named in reason, reason
    if stream is not None:
        stream.thread.join(20)
        assert not stream.thread.is_alive()
        assert stream.error and named in stream.error, stream.error
    # the node returns
    if what == "node-kill":
        time.sleep(1.0)
        assert "waiting for it to answer again" in srv.health()[1], srv.health()
        node.procs[0].proc.wait(10)
        node.procs[0].start().wait_ready(60)
    elif what == "node-stop":
        time.sleep(1.0)
        # the stale rank resumes first (its node still stopped, so nothing kills it): it
        # finds its group gone; then the node resumes
        os.kill(old_rank, signal.SIGCONT)
        time.sleep(1.0)
        node.procs[0].signal(signal.SIGCONT)
    back = time.monotonic()
    srv.wait_health(200, 60)
    healed = time.monotonic() - back
    timings.append((what, "during a request" if during else "idle", to_503, healed))
    print(f"{what} {'during a request' if during else 'idle'}: named 503 after {to_503:.2f} s; "
          f"serving again {healed:.2f} s after the node's return")
    assert healed <= HEAL_BOUND, srv.log_text()[-3000:]
    assert ask(srv) == ref
    # the process table: one new rank 0 and one new node rank; the old ones are gone
    new_rank, new_rank0 = node_rank(node), server_rank0(srv)
    assert new_rank != old_rank and new_rank0 != old_rank0
    assert not alive(old_rank0)
    end = time.monotonic() + 10
    while alive(old_rank) and time.monotonic() < end:
        time.sleep(0.05)
    assert not alive(old_rank)


def finish(srv, node, before_shm, tmp, kill=False, healing=False):
    """Stop the server (SIGTERM, or SIGKILL: then rank 0's process notices its parent
    gone and the node its lease broken; `healing`: while it forms the group again); no
    rank process may be left, nor shared memory, nor a host file in the processes' TMPDIR
    `tmp`."""
    ranks = children(node.procs[0].proc.pid) + children(srv.proc.pid)
    assert healing or len(ranks) in (2, 3), ranks  # (3: with rank 0's spare)
    if kill:
        srv.proc.kill()
        srv.proc.wait(10)
    srv.stop()
    end = time.monotonic() + 10
    while (any(alive(p) for p in ranks) or children(node.procs[0].proc.pid)) \
            and time.monotonic() < end:
        time.sleep(0.05)
    assert not any(alive(p) for p in ranks), ranks
    assert children(node.procs[0].proc.pid) == []
    assert shm() - before_shm == set()

    def left():  # the node removes its rank's host file just after reaping the rank
        return [f for f in os.listdir(tmp) if f.startswith("kimi-mlx-")]

    end = time.monotonic() + 10
    while left() and time.monotonic() < end:
        time.sleep(0.05)
    assert not left(), left()


@pytest.mark.e2e  # ~60-85 s: seven losses and recoveries (make test-e2e)
def test_heals_after_a_rank_is_lost(tmp_path_factory, ref, monkeypatch):
    """A node's rank killed / stopped, or this head's rank 0 process killed or stopped,
    idle and during a request: each time the server forms the group again (the node
    answers at once) and the reply equals one process. Last, the server is stopped while
    it forms the group again."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(tmp))  # the processes' host files: none may be left
    node = make_node(tmp_path_factory, "hlnode")
    before = shm()
    (port,) = free_ports(1)
    srv = ServerProc(node, port, "--parallel", "tensor", timeout=HARD_TIMEOUT)
    timings: list = []
    try:
        assert ask(srv) == ref
        for what, during in [("kill", False), ("kill", True), ("stop", False), ("stop", True),
                             ("rank0-kill", False), ("rank0-kill", True), ("rank0-stop", True)]:
            lose(srv, node, what, during, ref, timings)
        assert len(re.findall("serving again through a tensor-parallel group", srv.log_text())) == 7
        os.kill(node_rank(node), signal.SIGKILL)
        srv.wait_health(503, 20)
        time.sleep(0.5)  # the recovery is forming the group again
        finish(srv, node, before, tmp, healing=True)
    finally:
        srv.stop()
        node.stop()
    print(timings)


@pytest.mark.e2e  # ~50 s (make test-e2e)
def test_heals_when_its_node_returns(tmp_path_factory, ref, monkeypatch):
    """The node's whole process group killed (then started again on its port) and stopped
    (then resumed, its stale rank with it): /health waits for the node, the group is
    formed again within 10 s of its return, the stale rank cannot touch it. Then the
    server is SIGKILLed: its rank 0 process and the node's rank end by themselves."""
    tmp = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setenv("TMPDIR", str(tmp))
    node = make_node(tmp_path_factory, "hrnode")
    before = shm()
    (port,) = free_ports(1)
    srv = ServerProc(node, port, "--parallel", "tensor", timeout=HARD_TIMEOUT)
    timings: list = []
    try:
        assert ask(srv) == ref
        lose(srv, node, "node-kill", False, ref, timings)
        lose(srv, node, "node-stop", True, ref, timings)
        finish(srv, node, before, tmp, kill=True)
    finally:
        srv.stop()
        node.stop()
    print(timings)


# -- the recovery's decisions, without processes ------------------------------------------

class _Watch:
    def __init__(self, nodes):
        self.nodes, self.failed, self.failed_node, self.closed = nodes, None, None, 0
        self.exit = None

    def close(self):
        self.closed += 1


def _engine(reform, probe, replan):
    from types import SimpleNamespace

    from kimi_mlx.cluster.net.discovery import NodeInfo
    from kimi_mlx.cluster.tensor.engine import TensorEngine

    nodes = {"a": NodeInfo("a", "127.0.0.1", 1), "b": NodeInfo("b", "127.0.0.1", 2)}
    watch = _Watch(nodes)
    eng = TensorEngine(SimpleNamespace(size=lambda: 3), None, watch,
                       SimpleNamespace(shutdown=lambda: None), [0], ranks=[(1, "a"), (2, "b")],
                       reform=reform, probe=probe, replan=replan)
    watch.failed, watch.failed_node = "rank 2 on node b was killed by SIGKILL", "b"
    watch.exit(1)  # the watch's teardown, as TensorGroup.fail calls it
    return eng, watch


def test_recovery_waits_replans_and_ignores_an_old_group():
    """No answer: wait (no --replan) or form without the node (--replan, excluded);
    a failed attempt is shown and retried; a report from the old group's watch after the
    new group formed changes nothing."""
    from types import SimpleNamespace

    from kimi_mlx.cluster.net.nodes import Rejected

    down = Rejected("b", "127.0.0.1:2", "not answering: connection refused", "unreachable")
    calls = []

    def reform(excluded, epoch, cancelled):
        assert not cancelled()
        calls.append((set(excluded), epoch))
        if len(calls) == 1:
            raise RuntimeError("the model does not split over 2 ranks")
        return (SimpleNamespace(shutdown=lambda: None), SimpleNamespace(size=lambda: 2), None,
                _Watch({}), [(1, "a")])

    eng, old = _engine(reform, lambda nodes: ([], [down]), replan=False)
    assert "rank 2 on node b was killed by SIGKILL" in eng.health()
    ranks = {r["rank"]: r for r in eng.stages()}
    assert not ranks[0]["ok"] and ranks[0]["reason"] is None
    assert "node b" in ranks[2]["reason"] and ranks[1]["reason"] is None
    eng.keeper.heal()
    assert calls == [] and "waiting for it to answer again" in eng.health()
    assert "node b at 127.0.0.1:2: not answering" in eng.health()

    eng, old = _engine(reform, lambda nodes: ([], [down]), replan=True)
    eng.keeper.heal()
    assert calls == [({"b"}, 1)] and "failed, trying again" in eng.health()
    assert "does not split over 2 ranks" in eng.health()
    eng.keeper.heal()
    assert calls[-1] == ({"b"}, 1) and eng.health() is None and eng.epoch == 1
    assert eng.ranks == [(1, "a")]
    assert [(r["rank"], r["node"], r["ok"]) for r in eng.stages()] == [(0, "this head", True),
                                                                      (1, "a", True)]
    old.exit(1)  # the old group's watch reports late: ignored
    assert eng.health() is None


def test_check_fits_splits_and_memory(tmp_path):
    """`check_fits` on the micro checkpoint: it splits over 2 ranks, not over 3 (its
    attention heads, from its config, do not divide by 3); a node without the memory for
    its slices is named."""
    import json

    from kimi_mlx.cluster.net.discovery import NodeInfo
    from kimi_mlx.cluster.net.ranks import TensorSetupError
    from kimi_mlx.cluster.tensor.launch import check_fits
    from kimi_mlx.testing.cluster import reference_checkpoint

    ckpt = Path(reference_checkpoint(tmp_path))
    heads = json.loads((ckpt / "config.json").read_text())
    heads = heads.get("text_config", heads)["num_attention_heads"]

    def big(name):
        return NodeInfo(name, "h", 1, usable_memory=2**34, total_memory=2**35), None

    assert heads % 2 == 0 and heads % 3
    check_fits(ckpt, [big("n0")], 256)
    with pytest.raises(TensorSetupError, match="does not split over 3 ranks"):
        check_fits(ckpt, [big("n0"), big("n1")], 256)
    small = (NodeInfo("tiny", "h", 1, usable_memory=1000, total_memory=2000), None)
    with pytest.raises(TensorSetupError, match="node tiny has 0.0 GiB usable"):
        check_fits(ckpt, [small], 256)


def test_relay_command_carries_image_rows_as_float32():
    """A MEDIA command to rank 0's process: the ids, keep, flags, pad id and the rows
    (bfloat16 here) arrive as NumPy's float32 of the rows; a command without rows has
    none; rows of the wrong size are refused by name."""
    import mlx.core as mx
    import numpy as np

    from kimi_mlx.cluster.tensor.relay import _decode_command, _encode_command
    from kimi_mlx.cluster.tensor.step import MEDIA, OP_FORWARD

    rows = mx.random.normal((3, 8)).astype(mx.bfloat16)
    want = np.array(rows.astype(mx.float32))  # bfloat16 -> float32 is exact
    buf = _encode_command(OP_FORWARD, [5, 163, 163, 163, 7], -1, MEDIA, (163, rows))
    op, ids, keep, flags, media, _ = _decode_command(buf)
    assert (op, ids, keep, flags) == (OP_FORWARD, [5, 163, 163, 163, 7], -1, MEDIA)
    assert media[0] == 163 and media[1].dtype == mx.float32
    assert np.array_equal(np.array(media[1]), want)
    assert _decode_command(_encode_command(OP_FORWARD, [1, 2], 3, 0))[1:] == ([1, 2], 3, 0, None, None)
    with pytest.raises(ValueError, match="expected 3 x 8 float32"):
        _decode_command(buf[:-4])
