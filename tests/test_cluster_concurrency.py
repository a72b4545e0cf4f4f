"""Three stage processes under several heads at once: eight `kimi-mlx cluster launch`
processes started together print what `kimi-mlx generate` prints (each stage loads once;
the other Loads wait for it and find it loaded), a full session table answers
RESOURCE_EXHAUSTED naming the limit, and the stages exit cleanly on SIGTERM after all
that."""

import os
import re
import subprocess
import sys
import time

import grpc
import mlx.core as mx
import pytest

from kimi_mlx.cluster.net import stage_pb2 as pb
from kimi_mlx.cluster.net import stage_pb2_grpc as pb_grpc
from kimi_mlx.cluster.head.pipeline import Pipeline
from kimi_mlx.sampling import Sampling
from kimi_mlx.cluster.net.channel import make_channel
from kimi_mlx.testing.cluster import LocalCluster
from kimi_mlx.cluster.head.transport import StageFailure
from kimi_mlx.cluster.net.wire import to_tensor

HEADS = 8
FLAGS = ["--prompt", "The licence grants you the right to", "--max-tokens", "6", "--temp", "0",
         "--ignore-chat-template"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = LocalCluster(tmp_path_factory.mktemp("heads"), 3, prefix="conc",
                     extra=["--max-sessions", str(HEADS)])
    try:
        yield c
    finally:
        c.stop()


def _cli(args):
    return [sys.executable, "-m", "kimi_mlx.commands.main"] + args


def _body(stdout):
    return "\n".join(l for l in stdout.splitlines()
                     if not l.startswith(("Prompt:", "Generation:", "Peak memory:")))


def _wait_no_sessions(c, timeout=10.0):
    end = time.monotonic() + timeout
    while True:
        left = [c.sessions(i) for i in range(len(c.procs))]
        if not any(left) or time.monotonic() > end:
            return left
        time.sleep(0.05)


@pytest.mark.e2e  # eight launches at once: ~15 s alone, a minute loaded; after the suite
def test_eight_launches_at_once_print_what_generate_prints(cluster):
    flags = ["--model", str(cluster.ckpt)] + FLAGS
    nodes = ",".join(p.address for p in cluster.procs)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    launches = [subprocess.Popen(_cli(["cluster", "launch", "--nodes", nodes, "--secret-file",
                                       str(cluster.secret_file)] + flags),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for _ in range(HEADS)]
    try:
        outs = [p.communicate(timeout=300) for p in launches]
    finally:
        for p in launches:
            if p.poll() is None:
                p.kill()
    gen = subprocess.run(_cli(["generate"] + flags), capture_output=True, text=True, env=env,
                         timeout=120)
    assert gen.returncode == 0, gen.stderr
    for p, (out, err) in zip(launches, outs):
        assert p.returncode == 0, err
        assert _body(out) == _body(gen.stdout), (out, gen.stdout)
    # Every stage loaded its layers once; the seven other Loads waited for that load (or
    # came after it) and were answered "already loaded", none refused.
    err = "".join(e for _, e in outs)
    for i in range(3):
        lines = re.findall(rf"stage {i} \(node conc{i} .*?\): (loaded|already loaded) ", err)
        assert sorted(lines) == ["already loaded"] * (HEADS - 1) + ["loaded"], (i, lines)
    assert _wait_no_sessions(cluster) == [0, 0, 0]


def _open_forward(stub, session, x):
    """A Forward stream into the last stage that opens `session` and stays open until
    the returned `close()` is called; returns (call, close)."""
    import queue

    q = queue.Queue()
    m = pb.Activation(session=session, seq=0, offset=0, length=x.shape[2])
    to_tensor(x, out=m.tensor)
    m.open.CopyFrom(pb.SessionOpen(session=session, head="table-test"))
    q.put(m)

    def requests():
        while (item := q.get()) is not None:
            yield item

    call = stub.Forward(requests(), timeout=30)
    return call, lambda: q.put(None)


def test_a_full_session_table_answers_resource_exhausted_with_the_limit(cluster):
    t, _ = cluster.load_transport()
    try:
        # HEADS sessions hold every stage's table full (a prompt chunk each, no token yet)
        for k in range(HEADS):
            t.open(f"full-{k}", Sampling())
            t.send(f"full-{k}", 0, 0, [1, 2, 3], sample=False)
        end = time.monotonic() + 30
        while min(cluster.sessions(i) for i in range(3)) < HEADS and time.monotonic() < end:
            time.sleep(0.05)
        assert [cluster.sessions(i) for i in range(3)] == [HEADS] * 3
        # one more through the head: refused by stage 0, with the limit named
        with pytest.raises(StageFailure) as e:
            list(Pipeline(t).generate([1, 2, 3], Sampling(), 2, session="one-too-many"))
        assert "session table full" in str(e.value) and f"the limit is {HEADS}" in str(e.value)
        assert "stage 0" in str(e.value)
        # and on the wire: RESOURCE_EXHAUSTED from the last stage, whose table is full too
        stub = pb_grpc.StageStub(make_channel(cluster.procs[2].address, cluster.secret))
        a = cluster.args
        k = -(-t.stages[2].start // a.attn_res_block_size)
        call, close = _open_forward(stub, "raw-extra", mx.zeros((k + 1, 1, 2, a.hidden_size)))
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        close()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"the limit is {HEADS}" in e.value.details() and "--max-sessions" in e.value.details()
    finally:
        t.abort()
        t.shutdown()
    assert _wait_no_sessions(cluster) == [0, 0, 0]


def test_stages_exit_cleanly_on_sigterm_after_serving(cluster):
    """Run last in this module: SIGTERM every stage after the sessions above; each exits 0
    (no SIGABRT from MLX's per-thread state released during interpreter shutdown)."""
    assert cluster.stop(timeout=30) == [0, 0, 0]
    for p in cluster.procs:
        log = p.log_text()
        assert "terminate called" not in log and "Fatal Python error" not in log, log[-2000:]
